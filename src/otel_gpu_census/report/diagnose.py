"""Diagnoses: the cause a user can act on, one sentence each, with its figure and the action in the
user's terms (a server flag, a client change).

Pure functions of the census model (``census.ProcessCensus``), its 20 ms windows (``timeline``), the
serving period told apart from start-up (``serving``), and what the caller knows besides: a request
count, request records (``request_log``), an SM occupancy measured by NVML GPM. A diagnosis is made
only where its evidence is there, and only from what the GPU did while serving: start-up (a model
load, graph capture) is never a hot path. Every rule works from exact counts and bytes, so it holds
under the default census (copies counted at their calls, no copy time) and under CUPTI alike; copy
time, where measured, is added to the figure. The thresholds are named below, with the reason for each.
Where a vLLM or SGLang integration logged the engine's own state (``engine_causes``), it names the cause of
low utilisation under load (the engine's cap, its front end) and prices preemption; without it the rules
here decide as before.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from otel_gpu_census.report import engine_causes, serving
from otel_gpu_census.report import timeline as tl_mod
from otel_gpu_census.census import FLAG_ENV_UNIFIED, PRECISE_HINT, ProcessCensus
from otel_gpu_census.report.engine_requests import for_segments
from otel_gpu_census.report.figures import exact, plural, seconds, share, size
from otel_gpu_census.report.request_log import RequestRecord, peak_in_flight
from otel_gpu_census.report.timeline import Slot, Timeline

MB = 1_000_000

# State saved to the host (llama-server's prompt cache and context checkpoints, a KV offload): bursts of
# many device->host copies. A server's other device->host traffic is its logits (one copy per step, a
# row of the vocabulary per sequence: ~0.5 MB each with a 128k vocabulary), spread over every step.
SAVE_WINDOW_MIN = 4 * MB          # a 20 ms window of a burst moves at least this much device->host...
SAVE_BYTES_FACTOR = 4             # ...and 4x the usual window's bytes (its lower quartile: logits)...
SAVE_COPIES_FACTOR = 3            # ...or 3x the usual window's copies (one logits copy a step)...
SAVE_MIN_COPIES = 4               # ...and at least this many
SAVE_EDGE_MIN = MB                # a window beside a burst's, with twice a usual window's bytes: the burst's edge
SAVE_BURST_GAP = 2                # windows of a burst are at most this many quiet windows apart
SAVE_MIN_BURSTS = 3               # a save that recurs, not one dump
SAVE_MIN_SHARE = 0.5              # most of the device->host bytes while serving
SAVE_MIN_PER_REQUEST = 4 * MB     # below this a request's save costs little (a logits row is ~0.5 MB)

HOT_MIN_COPIES = 20               # a handful of pageable copies is set-up, not a hot path
HOT_MIN_RATE = 5.0                # pageable copies a second while serving...
HOT_MIN_PER_REQUEST = 1.0         # ...or at least one per request

WEIGHTS_MIN_RATE = 2e9            # host->device bytes a second all through serving: far above a server's inputs
WEIGHTS_MIN_PER_REQUEST = 64 * MB

# Managed memory migrated host->device while serving: pages the GPU touched came over PCIe on demand. A server's
# inputs never need this much; its weights or KV cache paging in do.
MIGRATE_MIN_BYTES = 64 * MB       # migrated host->device over the period looked at (serving, or the run)...
MIGRATE_MIN_PER_REQUEST = 4 * MB  # ...and per request, where the requests are known
MANAGED_MIN_BYTES = 64 * MB       # managed memory allocated, its migrations unmeasured: worth naming the cause
UNIFIED_ENV = "GGML_CUDA_ENABLE_UNIFIED_MEMORY"

BUSY_LOW = 0.8                    # kernels running less than this share of the serving time
FEW_IN_FLIGHT = 1.5               # mean requests in flight at or below this: the clients send too few
MANY_IN_FLIGHT = 4.0              # at or above this: requests are waiting on the server
MIN_SERVING_NS = 1_000_000_000

OCCUPANCY_BUSY_MIN = 0.7
OCCUPANCY_LOW = 0.3

DIRECTION_WORDS = {"dtoh": "device-to-host", "htod": "host-to-device"}
LLAMA_FLAGS = "`--cache-ram 0 --ctx-checkpoints 0`"


@dataclass(frozen=True)
class Facts:
    """What the caller knows besides the census."""

    requests: Optional[int] = None                    # a request count (report --requests)
    records: Optional[Sequence[RequestRecord]] = None  # request records (a log, the proxy, an engine's log)
    sm_occupancy: Optional[float] = None              # 0..1, NVML GPM (gpu_census.sm.occupancy)

    def request_count(self) -> Optional[int]:
        if self.requests:
            return self.requests
        return len(self.records) if self.records else None


@dataclass(frozen=True)
class Diagnosis:
    kind: str                 # state_save, pageable_hot_path, weights_copied, managed_migrations, managed_memory,
                              # client_bound, server_bound, cap_bound, front_end_bound, preemption, low_occupancy
    text: str
    pid: int
    figures: Dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "pid": self.pid, "text": self.text, "figures": self.figures}


def server_program(c: ProcessCensus) -> Optional[str]:
    """The server a process is, when it is one whose host buffers the user does not own: "llama-server",
    "ollama", "engine" (vLLM, SGLang: by name or by the request log their integration writes); None for
    the user's own program."""
    comm = (c.comm or "").lower()
    if "ollama" in comm:
        return "ollama"
    if "llama" in comm:
        return "llama-server"
    if "vllm" in comm or "sglang" in comm or for_segments([c.path]):
        return "engine"
    return None


@dataclass(frozen=True)
class Scene:
    """One process as the rules see it: its windows, the serving period and its share of the split."""

    census: ProcessCensus
    timeline: Optional[Timeline]
    period: Optional[serving.Period]
    split: Optional[serving.ProcessSplit]
    requests: Optional[int]

    @property
    def slots(self) -> List[Slot]:
        """The windows of the serving period (of all the windows kept, where no period was found)."""
        t = self.timeline
        if t is None:
            return []
        if self.period is None:
            return list(t.slots)
        return t.between(self.period.start_ns, self.period.end_ns)

    @property
    def whole_period(self) -> bool:
        """The windows reach back to the start of the serving period."""
        return (self.period is not None and self.timeline is not None and bool(self.timeline.slots)
                and self.timeline.start_ns <= self.period.start_ns)

    def span_words(self, slots: Sequence[Slot]) -> str:
        span = (slots[-1].end_ns - slots[0].start_ns) / 1e9 if slots else 0.0
        if self.whole_period:
            return f"the {span:.3f} s of serving"
        if self.period is not None:
            return f"the last {span:.3f} s of serving, as far back as the 20 ms windows kept reach"
        if self.timeline is not None and self.timeline.complete:
            return f"the {span:.3f} s of its GPU work, start-up included"
        return f"the last {span:.3f} s of its GPU work, as far back as the 20 ms windows kept reach"


# ---------------------------------------------------------------------------------------------
# state saved to the host

def _quantile(xs: List[int], q: float) -> int:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0


def save_bursts(slots: Sequence[Slot]) -> Tuple[List[Tuple[int, int, int]], int, int]:
    """([(first window, last window, device->host bytes in its windows)], those bytes summed, the bytes
    of a usual window with device->host copies outside the bursts: what the bursts' windows hold besides
    the save, at most a window's logits each)."""
    busy = [s for s in slots if s.dtoh_count]
    if not busy:
        return [], 0, 0
    usual_bytes = _quantile([s.dtoh_bytes for s in busy], 0.25)
    usual_count = _quantile([s.dtoh_count for s in busy], 0.5)
    copies_min = max(SAVE_MIN_COPIES, SAVE_COPIES_FACTOR * usual_count)

    def heavy(s: Slot) -> bool:
        return s.dtoh_bytes >= SAVE_WINDOW_MIN and (s.dtoh_bytes >= SAVE_BYTES_FACTOR * usual_bytes
                                                    or s.dtoh_count >= copies_min)
    flags = [heavy(s) for s in slots]
    rest = [s.dtoh_bytes for s, f in zip(slots, flags) if s.dtoh_count and not f]
    background = _quantile(rest, 0.5)
    # a burst's first or last window may hold only a copy or two of it: kept where it stands out too
    edge = [not f and s.dtoh_bytes >= max(SAVE_EDGE_MIN, 2 * background)
            and ((i and flags[i - 1]) or (i + 1 < len(flags) and flags[i + 1]))
            for i, (s, f) in enumerate(zip(slots, flags))]
    flags = [f or e for f, e in zip(flags, edge)]
    bursts: List[List[int]] = []
    for i, (s, f) in enumerate(zip(slots, flags)):
        if not f:
            continue
        extra = s.dtoh_bytes
        if bursts and i - bursts[-1][1] <= SAVE_BURST_GAP + 1:
            bursts[-1][1] = i
            bursts[-1][2] += extra
        else:
            bursts.append([i, i, extra])
    return [(a, b, n) for a, b, n in bursts], sum(n for _, _, n in bursts), background


def state_save(sc: Scene) -> Optional[Diagnosis]:
    """Bursts of many device->host copies, recurring while serving, holding most of its device->host bytes."""
    c, slots = sc.census, sc.slots
    total = sum(s.dtoh_bytes for s in slots)
    if not total:
        return None
    bursts, saved, background = save_bursts(slots)
    if len(bursts) < SAVE_MIN_BURSTS or saved < SAVE_MIN_SHARE * total or saved < SAVE_MIN_BURSTS * SAVE_WINDOW_MIN:
        return None
    n = sc.requests if sc.period is not None else None
    figures: Dict[str, Any] = {"dtoh_bytes_in_bursts": saved, "dtoh_bytes": total, "share": saved / total,
                               "bursts": len(bursts), "background_bytes_per_window": background,
                               "span_ns": slots[-1].end_ns - slots[0].start_ns, "whole_period": sc.whole_period}
    when = sc.span_words(slots)
    bursts_words = plural(len(bursts), "burst")
    if n and sc.whole_period and sc.split is not None:
        per_req = saved // n
        if per_req < SAVE_MIN_PER_REQUEST:
            return None
        figures.update(requests=n, dtoh_bytes_in_bursts_per_request=per_req)
        figure = (f"{size(per_req)} device-to-host per request came in bursts of copies, {bursts_words} holding "
                  f"{share(saved / total)} of the device-to-host bytes over {when}")
    elif n and sc.split is not None:
        dtoh = sc.split.serving.copy("dtoh").bytes
        figures.update(requests=n, dtoh_bytes_per_request=dtoh // n)
        figure = (f"{share(saved / total)} of the device-to-host bytes over {when} came in {bursts_words} of "
                  f"copies, and serving moved {size(dtoh // n)} device-to-host per request")
    else:
        figure = (f"{size(saved)} device-to-host came in {bursts_words} of copies, {share(saved / total)} of the "
                  f"device-to-host bytes over {when}")
    burst_ns = sum(s.dtoh_ns for a, b, _ in bursts for s in slots[a:b + 1])
    if burst_ns:
        figures["burst_copy_ns"] = burst_ns
        figure += f", the bursts' copies taking {seconds(burst_ns)} s"
    program = server_program(c)
    if program == "llama-server":
        text = (f"llama-server's prompt cache and context checkpoints saved slot state to host memory: {figure}; "
                f"start llama-server with {LLAMA_FLAGS} to turn both off (smaller values bound them).")
    else:
        who = "ollama's llama runner" if program == "ollama" else "the server"
        text = (f"state saved to host memory in bursts, as a prompt cache, context checkpoints or a KV offload do: "
                f"{figure}; turn off or bound {who}'s prompt cache or offload (llama-server: {LLAMA_FLAGS}).")
    return Diagnosis("state_save", text, c.pid, figures)


# ---------------------------------------------------------------------------------------------
# copies with pageable host memory, where the user owns the buffer

def pageable_hot_path(sc: Scene, saved: bool = False) -> List[Diagnosis]:
    """Many copies with pageable host memory while serving, in a program whose buffers the user owns
    (not a server's: it has flags for its own copies, or none). `saved`: a state save was diagnosed, and
    its device->host copies are not named twice."""
    c = sc.census
    if sc.split is None or server_program(c):
        return []
    slots = sc.slots
    span = sum(s.length for s in slots)
    if not span:
        return []
    out = []
    totals = c.totals()
    for d in ("dtoh", "htod"):
        pageable = totals.copies.get(d, "pageable")
        if not pageable.count or (d == "dtoh" and saved):
            continue
        others = totals.copies.get(d).count - pageable.count
        at_least = sum(s.copies_started(d) for s in slots) - others   # windows hold no memory kind
        if at_least < HOT_MIN_COPIES:
            continue
        rate = at_least / (span / 1e9)
        per_req = at_least / sc.requests if sc.requests else None
        if rate < HOT_MIN_RATE and (per_req is None or per_req < HOT_MIN_PER_REQUEST):
            continue
        how = f"{exact(round(per_req, 2))} copies per request, " if per_req is not None else ""
        # untimed (the default census): bytes without a time, never "0.0 GB/s"
        took = f", all of them at {pageable.bytes / pageable.ns:.1f} GB/s" if pageable.ns else ""
        pinned = totals.copies.get(d, "pinned")
        if pageable.ns and pinned.count and pinned.ns:
            took += f" against {pinned.bytes / pinned.ns:.1f} GB/s pinned"
        text = (f"pageable host memory on a hot path: at least {exact(at_least)} {DIRECTION_WORDS[d]} copies with "
                f"pageable host memory over {sc.span_words(slots)} ({how}{rate:.1f} copies a second{took}), each "
                "synchronous and staged through a driver buffer; allocate those host buffers page-locked "
                "(cudaHostAlloc, torch's pin_memory) to make the copies asynchronous and faster.")
        out.append(Diagnosis("pageable_hot_path", text, c.pid, {
            "direction": d, "copies_serving_at_least": at_least, "copies_per_s": rate,
            "pageable_count": pageable.count, "pageable_bytes": pageable.bytes, "pageable_ns": pageable.ns}))
    return out


# ---------------------------------------------------------------------------------------------
# weights copied in for every batch

def weights_copied(sc: Scene) -> Optional[Diagnosis]:
    """Host->device bytes all through serving at a rate no input explains: layers kept in host memory
    and copied in to compute. Needs the serving period (a model load looks the same)."""
    c, ps, period = sc.census, sc.split, sc.period
    if ps is None or period is None or period.span_ns < MIN_SERVING_NS:
        return None
    htod = ps.serving.copy("htod")
    rate = htod.bytes / (period.span_ns / 1e9)
    per_req = htod.bytes // sc.requests if sc.requests else None
    if rate < WEIGHTS_MIN_RATE or (per_req is not None and per_req < WEIGHTS_MIN_PER_REQUEST):
        return None
    figures = {"htod_bytes_serving": htod.bytes, "htod_bytes_per_s": rate, "serving_ns": period.span_ns}
    figure = f"{size(per_req)} host-to-device per request, " if per_req is not None else ""
    figure += f"{rate / 1e9:.2f} GB a second over the {period.span_ns / 1e9:.3f} s of serving"
    if per_req is not None:
        figures["htod_bytes_per_request"] = per_req
    slots = sc.slots
    if htod.ns and slots:
        busy = sum(s.htod_ns for s in slots) / sum(s.length for s in slots)
        figures["htod_time_share"] = busy
        figure += f", copying {share(busy)} of the time"
    program = server_program(c)
    if program in ("llama-server", "ollama"):
        action = ("keep every layer on the GPU (`-ngl`/`--n-gpu-layers` at least the model's layer count, no "
                  "`--cpu-moe` or `-ot` to the CPU) or use a smaller quantisation that fits")
    else:
        action = "keep the weights on the GPU (no CPU offload of layers) or use a smaller quantisation that fits"
    text = (f"weights copied to the GPU for every batch: {figure}, which GPU utilisation counts as busy though it "
            f"is PCIe time; {action}.")
    return Diagnosis("weights_copied", text, c.pid, figures)


# ---------------------------------------------------------------------------------------------
# managed (unified) memory migrated to the GPU

def _unified_cause(c: ProcessCensus) -> Tuple[str, str]:
    """(what made the memory managed, what to do), in the server's own terms where the census can tell."""
    program = server_program(c)
    if c.flags & FLAG_ENV_UNIFIED:
        cause = (f"{UNIFIED_ENV} was set for this process, so llama.cpp's CUDA backend allocated its buffers as "
                 "managed memory")
        action = (f"unset {UNIFIED_ENV} and keep the model within GPU memory (fewer layers on the GPU with "
                  "`-ngl`, a smaller quantisation or context), so that weights stay put instead of paging in")
    elif program in ("llama-server", "ollama"):
        cause = f"the server allocated managed memory (llama.cpp does when {UNIFIED_ENV} is set)"
        action = (f"unset {UNIFIED_ENV} and keep the model within GPU memory (`-ngl`, a smaller quantisation or "
                  "context)")
    else:
        cause = "the program allocated managed memory (cudaMallocManaged) larger than it keeps on the GPU"
        action = ("keep the working set within GPU memory, or prefetch it (cudaMemPrefetchAsync) and set "
                  "cudaMemAdvise hints so pages move once instead of on every fault")
    return cause, action


def managed_migrations(sc: Scene) -> Optional[Diagnosis]:
    """Managed memory migrated host->device while serving (precise collector): the model does not fit, or unified
    memory is on. Under a census that does not measure migrations, managed memory of some size is named with what
    made it and how to measure it."""
    c = sc.census
    if not c.managed_in_use:
        return None
    m = c.managed_totals()
    cause, action = _unified_cause(c)
    figures: Dict[str, Any] = {"managed_allocs": m.allocs, "managed_alloc_bytes": m.alloc_bytes,
                               "managed_live_bytes": m.live_bytes, "unified_env": bool(c.flags & FLAG_ENV_UNIFIED),
                               "measured": c.migrations_measured}
    if not c.migrations_measured:
        if m.alloc_bytes < MANAGED_MIN_BYTES and not c.flags & FLAG_ENV_UNIFIED:
            return None
        text = (f"managed (unified) memory in use: {size(m.alloc_bytes)} allocated in "
                f"{plural(m.allocs, 'managed allocation')}; {cause}. Its pages move between host and device "
                f"whenever either touches them, and this census did not measure those moves: {PRECISE_HINT}; "
                f"{action}.")
        return Diagnosis("managed_memory", text, c.pid, figures)
    if sc.split is not None and sc.period is not None:
        htod, dtoh = sc.split.serving.copy("managed_htod"), sc.split.serving.copy("managed_dtoh")
        span_ns, when = sc.period.span_ns, "while serving"
    else:
        t = c.totals()
        htod, dtoh = t.copies.get("managed_htod"), t.copies.get("managed_dtoh")
        span_ns, when = max(0, max((d.last_ns for d in c.devices.values()), default=0)
                            - min((d.first_ns for d in c.devices.values() if d.first_ns), default=0)), "over the run"
    per_req = htod.bytes // sc.requests if sc.requests and sc.period is not None else None
    if htod.bytes < MIGRATE_MIN_BYTES or (per_req is not None and per_req < MIGRATE_MIN_PER_REQUEST):
        return None
    figures.update(migrated_htod_bytes=htod.bytes, migrated_htod_count=htod.count, migrated_dtoh_bytes=dtoh.bytes,
                   span_ns=span_ns, when=when)
    figure = f"{size(htod.bytes)} migrated host-to-device through managed memory {when}"
    if per_req is not None:
        figures["migrated_htod_bytes_per_request"] = per_req
        figure += f" ({size(per_req)} per request"
        figure += f", {htod.bytes / (span_ns / 1e9) / 1e9:.2f} GB a second)" if span_ns else ")"
    elif span_ns:
        figure += f" ({htod.bytes / (span_ns / 1e9) / 1e9:.2f} GB a second)"
    if dtoh.bytes:
        figure += f", and {size(dtoh.bytes)} back device-to-host"
    if htod.ns:
        figures["migrated_htod_ns"] = htod.ns
        figure += f", the migrations taking {seconds(htod.ns)} s"
    text = (f"{figure}: pages came over PCIe as the GPU touched (or prefetched) them, time GPU utilisation counts as busy; "
            f"the model does not fit in GPU memory, or unified memory is on: {cause}; {action}.")
    return Diagnosis("managed_migrations", text, c.pid, figures)


# ---------------------------------------------------------------------------------------------
# the clients or the server, not the GPU

def concurrency(sc: Scene, saved: bool = False) -> Optional[Diagnosis]:
    """Kernels running far below 100 % of the time between the first request and the last: with few
    requests in flight the clients are the bottleneck; with many, the server is. Needs request records
    and the kernels' time (measured, or estimated from a sample)."""
    c, t = sc.census, sc.timeline
    if t is None or not t.requests or not t.kernel_time_known or c.graphs.paused_ns:
        return None      # a census paused by its control file counted nothing then: that reads as an idle GPU
    slots = t.serving()
    sp = tl_mod.split(slots)
    if sp.span_ns < MIN_SERVING_NS:
        return None
    busy = sp.share(sp.kernel_ns)
    if t.kernel_time_estimated:    # each launch's time sits in its launch's window: only the sum is busy time
        busy = min(1.0, sum(s.kernel_work_ns for s in slots) / sp.span_ns)
    if busy >= BUSY_LOW:
        return None
    mean = sp.mean_in_flight
    peak = peak_in_flight(t.requests, slots[0].start_ns, slots[-1].end_ns)
    none_ = [s for s in slots if s.in_flight_ns == 0]
    idle_none = sum(s.idle_ns for s in none_)
    est = " (kernel time estimated)" if t.kernel_time_estimated else ""
    head = (f"with {mean:.2f} requests in flight on average (at most {plural(peak, 'request')}), kernels ran "
            f"{share(busy)}{est} of {tl_mod.span_words(t, slots)}")
    figures = {"busy_share": busy, "nothing_share": sp.share(sp.idle_ns),
               "copies_only_share": sp.share(sp.copy_only_ns), "mean_in_flight": mean, "peak_in_flight": peak,
               "serving_ns": sp.span_ns, "requests": len(t.requests), "idle_ns_none_in_flight": idle_none,
               "kernel_time_estimated": t.kernel_time_estimated}
    logs = engine_causes.logs_of([c.path])
    st = engine_causes.over(logs, slots[0].start_ns, slots[-1].end_ns) if logs else None
    if st is not None:      # the engine's own state names the cause, where it can
        got = engine_causes.cause(st, sp.span_ns, mean, len(t.requests),
                                  f"kernels ran {share(busy)}{est} of {tl_mod.span_words(t, slots)}", FEW_IN_FLIGHT)
        if got is not None:
            kind, text, extra = got
            return Diagnosis(kind, text, c.pid, {**figures, **extra})
    if mean <= FEW_IN_FLIGHT:
        gaps = (f", and for {seconds(idle_none)} s no request was in flight at all" if idle_none else "")
        text = (f"the clients are the bottleneck, not the GPU: {head}{gaps}; send requests concurrently (more "
                "clients, an async client) before adding GPUs.")
        return Diagnosis("client_bound", text, c.pid, figures)
    if mean >= MANY_IN_FLIGHT:
        program = server_program(c)
        if saved and program == "llama-server":
            action = "turn off the state saves above first: llama-server makes them on its one thread, waiting on each copy"
        elif program == "llama-server":
            action = ("look at llama-server's CPU side (tokenising, sampling) and its batch limits "
                      "(`--parallel`, `--batch-size`, `--ubatch-size`)")
        else:
            action = ("look at the server's CPU side (tokenising, sampling, synchronous copies) and its batch "
                      "limits (vLLM `--max-num-seqs`, SGLang `--max-running-requests`)")
        text = f"the server is the bottleneck, not the GPU: {head} while requests waited; {action}."
        return Diagnosis("server_bound", text, c.pid, figures)
    return None


def preemption(sc: Scene) -> Optional[Diagnosis]:
    """Sequences an engine preempted for want of KV cache, and what computing them again cost (its state
    lines, over the serving period where one is known)."""
    logs = engine_causes.logs_of([sc.census.path])
    if not logs:
        return None
    lo, hi = (sc.period.start_ns, sc.period.end_ns) if sc.period is not None else (0, 1 << 63)
    st = engine_causes.over(logs, lo, hi)
    got = engine_causes.preemption(st) if st is not None else None
    return Diagnosis(got[0], got[1], sc.census.pid, got[2]) if got is not None else None


# ---------------------------------------------------------------------------------------------
# kernels that fill little of the chip

def low_occupancy(censuses: Sequence[ProcessCensus], occupancy: Optional[float],
                  records: Optional[Sequence[RequestRecord]] = None) -> Optional[Diagnosis]:
    """Census busy high, SM occupancy low: the kernels keep the GPU 'busy' but fill little of it.

    Busy is the kernels' share of the time while serving when request records give it (a server's
    load and idle start-up would dilute it), else of the time from first to last GPU activity."""
    if occupancy is None:
        return None
    best = None
    for c in censuses:
        t = tl_mod.build(c, records) if records else None
        serving_slots = t.serving() if t is not None and t.kernel_time_known else []
        if serving_slots:
            sp = tl_mod.split(serving_slots)
            if sp.kernel_ns and (best is None or sp.share(sp.kernel_ns) > best[0]):
                best = (sp.share(sp.kernel_ns), c, None, f"while serving ({tl_mod.span_words(t, serving_slots)})")
            continue
        for d in c.devices.values():
            span = d.last_ns - d.first_ns
            if span <= 0 or not d.busy_ns:
                continue
            ratio = min(1.0, d.busy_ns / span)
            if best is None or ratio > best[0]:
                best = (ratio, c, d, "from the first GPU activity to the last")
    if best is None:
        return None
    ratio, c, d, when = best
    if ratio < OCCUPANCY_BUSY_MIN or occupancy > OCCUPANCY_LOW:
        return None
    name = f"pid {c.pid}" if d is None else f"cuda:{d.device_id}" + (f" ({d.uuid})" if d.uuid else "")
    text = (f"kernels fill little of the chip: on {name} kernels ran {share(ratio)} of the time {when}, but the "
            f"SM occupancy NVML GPM measured was {share(occupancy)} of the warp slots, so GPU utilisation calls the "
            f"GPU busy while about {share(1 - occupancy)} of it sits unused; larger batches (more requests at "
            "once), longer sequences per kernel or fused kernels fill more of it.")
    return Diagnosis("low_occupancy", text, c.pid, {
        "busy_share": ratio, "sm_occupancy": occupancy, "device_id": None if d is None else d.device_id,
        "uuid": None if d is None else d.uuid, "while_serving": d is None})


# ---------------------------------------------------------------------------------------------

def _active(c: ProcessCensus) -> bool:
    return any(d.kernel_count or d.copies.total().count or d.memset.count for d in c.devices.values())


def scenes(censuses: Sequence[ProcessCensus], facts: Facts, sv: Optional[serving.Split] = None) -> List[Scene]:
    sv = sv if sv is not None else serving.split(censuses, facts.records)
    splits = {ps.census.pid: ps for ps in sv.processes}
    out = []
    for c in censuses:
        if not _active(c):
            continue
        ps = splits.get(c.pid) if sv.ok else None
        out.append(Scene(c, tl_mod.build(c, facts.records), sv.period, ps, facts.request_count()))
    return out


def diagnose(censuses: Sequence[ProcessCensus], facts: Facts = Facts(),
             sv: Optional[serving.Split] = None) -> List[Diagnosis]:
    """Every diagnosis the evidence supports, process by process, then the occupancy one."""
    out: List[Diagnosis] = []
    for sc in scenes(censuses, facts, sv):
        save = state_save(sc)
        found = [save, *pageable_hot_path(sc, saved=save is not None), weights_copied(sc), managed_migrations(sc),
                 concurrency(sc, saved=save is not None), preemption(sc)]
        out.extend(d for d in found if d is not None)
    occ = low_occupancy(censuses, facts.sm_occupancy, facts.records)
    if occ is not None:
        out.append(occ)
    return out
