"""Diagnoses: plain sentences that explain a census, each with its number and its evidence.

Pure functions of the census model (``census.ProcessCensus``), the per-window timeline built from it
(``timeline``), and what the caller knows besides: a request count, a request log
(``request_log``), an SM occupancy measured by NVML GPM. Each diagnosis is made only when its
evidence is there; otherwise it is silent. The thresholds are named below, with the reason for each.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import timeline as tl_mod
from .census import KERNELS_OFF, ProcessCensus
from .report import exact, human_size, per, seconds
from .request_log import RequestRecord, peak_in_flight
from .timeline import Slot, Timeline

MB = 1_000_000

# A state save happens when a request takes a slot, before its prompt is processed: within one
# server iteration (a decode or prompt batch: tens of ms, a long prompt batch ~150 ms) of its arrival.
SAVE_BEFORE_NS = 20_000_000
SAVE_AFTER_NS = 200_000_000
SAVE_MIN_PER_REQUEST = 4 * MB     # excess bytes per arrival below this cost little (a logits row is ~0.5 MB)
SAVE_MIN_SHARE = 0.5              # most device->host bytes near arrivals...
SAVE_MIN_DENSITY = 3.0            # ...at 3x or more the bytes per window of the other windows
SAVE_MAX_COVER = 0.8              # arrivals so dense that no window is far from one tell nothing
SAVE_MIN_REQUESTS = 3
# The same save seen as bursts (llama-server with 16 slots: each save is 100-200 ms before the
# request's end, as its slot is released, and arrivals are so dense that windows around them cover
# most of the time): short bursts of device->host bytes, about one per request.
SAVE_BURST_MAX_NS = 100_000_000   # a save is one short burst of copies (gaps of a window or two inside)...
SAVE_BURST_GAP = 2
SAVE_BURST_MIN = 16 * MB          # ...of at least this many bytes (a logits row of a 128k vocabulary: 0.5 MB)
SAVE_BURSTS_PER_REQUEST = (0.25, 2.0)   # one per request that reused a slot (its first use saves nothing)

HOT_MIN_COPIES = 20               # a handful of pageable copies is set-up, not a hot path
HOT_MIN_RATE = 5.0                # pageable copies a second while serving...
HOT_MIN_PER_REQUEST = 1.0         # ...or at least one per request
HOT_MIN_SECONDS = 5               # without a request log: spread over this many seconds...
HOT_MIN_SPREAD = 0.5              # ...and half of the seconds with any GPU activity (a model load is one burst)

OFFLOAD_MIN_SHARE = 0.3           # host->device copy time, share of the serving time
OFFLOAD_MIN_PER_REQUEST = 64 * MB

BUSY_LOW = 0.8                    # kernels running less than this share of the serving time
FEW_IN_FLIGHT = 1.5               # mean requests in flight at or below this: the clients send too few
MANY_IN_FLIGHT = 4.0              # at or above this: requests are waiting on the server
MIN_SERVING_NS = 1_000_000_000

OCCUPANCY_BUSY_MIN = 0.7
OCCUPANCY_LOW = 0.3

DIRECTION_WORDS = {"dtoh": "device-to-host", "htod": "host-to-device"}


@dataclass(frozen=True)
class Facts:
    """What the caller knows besides the census."""

    requests: Optional[int] = None                    # a request count (report --requests)
    records: Optional[Sequence[RequestRecord]] = None  # a request log (report --request-log)
    sm_occupancy: Optional[float] = None              # 0..1, NVML GPM (gpu_census.sm.occupancy)

    def request_count(self) -> Optional[int]:
        if self.requests:
            return self.requests
        return len(self.records) if self.records else None


@dataclass(frozen=True)
class Diagnosis:
    kind: str                 # state_save, pageable_hot_path, weights_copied, client_bound, server_bound, low_occupancy
    text: str
    pid: int
    figures: Dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "pid": self.pid, "text": self.text, "figures": self.figures}


def _pct(x: float) -> str:
    return f"{100.0 * x:.1f}%"


def _bytes(n) -> str:
    return f"{exact(n)} bytes ({human_size(n)})"


def _is_llama_server(c: ProcessCensus) -> bool:
    return "llama" in (c.comm or "").lower()


def _records_in(t: Timeline, slots: Sequence[Slot]) -> List[RequestRecord]:
    if not t.requests or not slots:
        return []
    lo, hi = slots[0].start_ns, slots[-1].end_ns
    return [r for r in t.requests if r.end_ns > lo and r.start_ns < hi]


# ---------------------------------------------------------------------------------------------
# the diagnoses

def _save_text(c: ProcessCensus, evidence: str) -> str:
    if _is_llama_server(c):
        return (f"state saved to the host at every request: {evidence}. This is llama-server's prompt cache and "
                "context checkpoints saving a slot's state when a new request takes the slot; "
                "`--cache-ram 0 --ctx-checkpoints 0` turns them off (smaller values bound them).")
    return (f"state saved to the host at request boundaries: {evidence}. A server that saves each request's "
            "state (a prompt cache, context checkpoints, KV offload) does this; for llama-server "
            "`--cache-ram 0 --ctx-checkpoints 0` turns it off.")


def _pageable_note(c: ProcessCensus) -> str:
    dtoh = c.totals().copies.get("dtoh")
    pageable = c.totals().copies.get("dtoh", "pageable")
    return (f"; {_pct(pageable.bytes / dtoh.bytes)} of all its device-to-host bytes went to pageable memory"
            if dtoh.bytes and pageable.bytes else "")


def state_save(c: ProcessCensus, t: Optional[Timeline]) -> Optional[Diagnosis]:
    """Large device->host copies that follow request boundaries. Needs a request log. Two views of the
    same thing: the bytes crowd the windows right after arrivals, or they come in short large bursts,
    about one per request (where requests are so dense that every window is near an arrival)."""
    if t is None or not t.requests:
        return None
    slots = t.serving()
    if not slots or not sum(s.dtoh_bytes for s in slots):
        return None
    return _save_near_arrivals(c, t, slots) or _save_bursts(c, t, slots)


def _save_near_arrivals(c: ProcessCensus, t: Timeline, slots: Sequence[Slot]) -> Optional[Diagnosis]:
    """The windows right after requests arrive carry far more device->host bytes than the others.

    The figure per request is the excess: bytes in the windows near arrivals beyond what the other
    windows' density would put there, so copies spread evenly over time (logits) count for nothing."""
    total = sum(s.dtoh_bytes for s in slots)
    t0, width = slots[0].start_ns, slots[0].length
    near = [False] * len(slots)
    arrivals = 0
    for r in t.requests:
        if not (t0 <= r.start_ns <= slots[-1].end_ns - SAVE_AFTER_NS):
            continue              # its neighbourhood is not all inside what the ring holds
        arrivals += 1
        i0 = max(0, (r.start_ns - SAVE_BEFORE_NS - t0) // width)
        i1 = min(len(slots) - 1, (r.start_ns + SAVE_AFTER_NS - 1 - t0) // width)
        for i in range(i0, i1 + 1):
            near[i] = True
    n_near = sum(near)
    n_far = len(slots) - n_near
    if arrivals < SAVE_MIN_REQUESTS or not n_far or n_near / len(slots) > SAVE_MAX_COVER:
        return None
    near_bytes = sum(s.dtoh_bytes for s, n in zip(slots, near) if n)
    far_bytes = total - near_bytes
    excess = near_bytes - far_bytes * n_near // n_far
    density = (near_bytes / n_near) / (far_bytes / n_far) if far_bytes else float("inf")
    share, cover = near_bytes / total, n_near / len(slots)
    per_req = per(max(0, excess), arrivals)
    if share < SAVE_MIN_SHARE or density < SAVE_MIN_DENSITY or per_req < SAVE_MIN_PER_REQUEST:
        return None
    dens = "no bytes at all in" if not far_bytes else f"{density:.1f}x the device-to-host bytes of"
    evidence = (f"{_bytes(per_req)} device-to-host per request above the background, copied between "
                f"{SAVE_BEFORE_NS // 1_000_000} ms before and {SAVE_AFTER_NS // 1_000_000} ms after a request "
                f"arrived: the 20 ms windows around the {arrivals} arrivals carry {dens} the other windows "
                f"({_pct(share)} of the bytes while serving, in {_pct(cover)} of the time){_pageable_note(c)}")
    return Diagnosis("state_save", _save_text(c, evidence), c.pid, {
        "dtoh_bytes_per_request": per_req, "dtoh_bytes_near_arrivals": near_bytes, "dtoh_bytes_serving": total,
        "arrivals": arrivals, "share": share, "time_share": cover,
        "density_ratio": None if not far_bytes else density,
        "window_ns": [-SAVE_BEFORE_NS, SAVE_AFTER_NS], "method": "near_arrivals"})


def _dtoh_bursts(slots: Sequence[Slot]) -> List[Tuple[int, int, int]]:
    """(first window, last window, bytes) of each run of windows with device->host bytes, runs
    separated by more than SAVE_BURST_GAP empty windows."""
    out: List[List[int]] = []
    for i, s in enumerate(slots):
        if not s.dtoh_bytes:
            continue
        if out and i - out[-1][1] <= SAVE_BURST_GAP + 1:
            out[-1][1] = i
            out[-1][2] += s.dtoh_bytes
        else:
            out.append([i, i, s.dtoh_bytes])
    return [(a, b, n) for a, b, n in out]


def _save_bursts(c: ProcessCensus, t: Timeline, slots: Sequence[Slot]) -> Optional[Diagnosis]:
    """Short large bursts of device->host bytes, about one per request, holding most of the bytes.
    Logits do not look like this: a row per token (0.5 MB) spreads over the whole generation."""
    total = sum(s.dtoh_bytes for s in slots)
    width = slots[0].length
    lo, hi = slots[0].start_ns, slots[-1].end_ns
    requests = sum(1 for r in t.requests if lo <= r.start_ns <= hi)
    saves = [n for a, b, n in _dtoh_bursts(slots)
             if (b - a + 1) * width <= SAVE_BURST_MAX_NS and n >= SAVE_BURST_MIN]
    if len(saves) < SAVE_MIN_REQUESTS or not requests:
        return None
    ratio = len(saves) / requests
    share = sum(saves) / total
    if not (SAVE_BURSTS_PER_REQUEST[0] <= ratio <= SAVE_BURSTS_PER_REQUEST[1]) or share < SAVE_MIN_SHARE:
        return None
    saves.sort()
    median = saves[len(saves) // 2]
    per_req = per(sum(saves), requests)
    evidence = (f"{len(saves)} bursts of device-to-host copies of at least {human_size(SAVE_BURST_MIN)} each, "
                f"none longer than {SAVE_BURST_MAX_NS // 1_000_000} ms, for {requests} requests "
                f"(median burst {_bytes(median)}; {_bytes(per_req)} per request), "
                f"{_pct(share)} of the device-to-host bytes while serving{_pageable_note(c)}")
    return Diagnosis("state_save", _save_text(c, evidence), c.pid, {
        "dtoh_bytes_per_request": per_req, "dtoh_bytes_in_bursts": sum(saves), "dtoh_bytes_serving": total,
        "bursts": len(saves), "burst_median_bytes": median, "requests": requests, "share": share,
        "method": "bursts"})


def _seconds_spread(slots: Sequence[Slot], direction: str) -> tuple:
    """(seconds with a copy in `direction` started, seconds with any activity), 1 s buckets."""
    if not slots:
        return 0, 0
    t0 = slots[0].start_ns
    with_copy, active = set(), set()
    for s in slots:
        k = (s.start_ns - t0) // 1_000_000_000
        if s.copies_started(direction):
            with_copy.add(k)
        if s.kernel_ns or s.copy_only_ns:
            active.add(k)
    return len(with_copy), len(active)


def pageable_hot_path(c: ProcessCensus, t: Optional[Timeline]) -> List[Diagnosis]:
    """Copies to or from pageable host memory, many of them, while serving (not one model load)."""
    if t is None:
        return []
    slots = t.serving()
    if not slots:
        return []
    span = sum(s.length for s in slots)
    recs = _records_in(t, slots)
    out = []
    totals = c.totals()
    for d in ("dtoh", "htod"):
        pageable = totals.copies.get(d, "pageable")
        if not pageable.count:
            continue
        others = totals.copies.get(d).count - pageable.count
        started = sum(s.copies_started(d) for s in slots)
        at_least = started - others      # the window ring has no memory kind: what pinned copies cannot explain
        if at_least < HOT_MIN_COPIES:
            continue
        rate = at_least / (span / 1e9)
        if recs:
            per_req = at_least / len(recs)
            if rate < HOT_MIN_RATE and per_req < HOT_MIN_PER_REQUEST:
                continue
            where = f"while serving ({len(recs)} requests in the log: {exact(round(per_req, 2))} per request)"
        else:
            with_copy, active = _seconds_spread(slots, d)
            if rate < HOT_MIN_RATE or with_copy < HOT_MIN_SECONDS or with_copy < HOT_MIN_SPREAD * active:
                continue
            where = f"spread over {with_copy} of the {active} seconds with GPU activity"
        bw = pageable.bytes / pageable.ns if pageable.ns else 0.0        # bytes/ns = GB/s
        pinned = totals.copies.get(d, "pinned")
        compare = (f"; its pinned {DIRECTION_WORDS[d]} copies ran at {pinned.bytes / pinned.ns:.1f} GB/s"
                   if pinned.count and pinned.ns else "")
        # untimed (OTEL_GPU_CENSUS_ACTIVITY=off): bytes without a time, never "0.0 GB/s"
        took = f" in {seconds(pageable.ns)} s ({bw:.1f} GB/s){compare}" if pageable.ns else ""
        text = (f"pageable host memory on a hot path: at least {exact(at_least)} {DIRECTION_WORDS[d]} copies with "
                f"pageable memory {where}, {rate:.1f} a second; all {exact(pageable.count)} such copies moved "
                f"{_bytes(pageable.bytes)}{took}. A copy with "
                "pageable memory is synchronous and staged through a driver buffer; page-locked host buffers "
                "(cudaHostAlloc, torch's pin_memory) make it asynchronous and faster.")
        out.append(Diagnosis("pageable_hot_path", text, c.pid, {
            "direction": d, "copies_serving_at_least": at_least, "copies_per_s": rate,
            "pageable_count": pageable.count, "pageable_bytes": pageable.bytes, "pageable_ns": pageable.ns}))
    return out


def weights_copied(c: ProcessCensus, t: Optional[Timeline]) -> Optional[Diagnosis]:
    """Host->device copies fill a large share of the serving time, hundreds of MB per request: weights
    kept in host memory and copied in for every batch. Needs a request log (else a model load looks
    the same)."""
    if t is None or not t.requests:
        return None
    slots = t.serving()
    recs = _records_in(t, slots)
    if not slots or not recs:
        return None
    span = sum(s.length for s in slots)
    htod_ns = sum(s.htod_ns for s in slots)
    htod_bytes = sum(s.htod_bytes for s in slots)
    kernel_ns = sum(s.kernel_ns for s in slots)
    per_req = per(htod_bytes, len(recs))
    share = htod_ns / span
    if share < OFFLOAD_MIN_SHARE or per_req < OFFLOAD_MIN_PER_REQUEST:
        return None
    flags = (" (llama.cpp: -ngl / --n-gpu-layers below the model's layer count, --cpu-moe, -ot; "
             "--no-op-offload stops the copies and runs those layers on the CPU)" if _is_llama_server(c) else "")
    # the windows' kernel time is whole only with every kernel traced
    kernels = f"{seconds(kernel_ns)} s of kernels, " if t.kernels_traced else ""
    text = (f"weights copied to the GPU for every batch: {_bytes(per_req)} host-to-device per request, and "
            f"host-to-device copies ran {_pct(share)} of the time while serving ({seconds(htod_ns)} s of copies, "
            f"{kernels}{len(recs)} requests). That is the pattern of layers kept in host "
            f"memory and copied in to compute{flags}. GPU utilisation counts this as a busy GPU; it is PCIe "
            "time. Fit more layers on the GPU or a smaller quantisation.")
    return Diagnosis("weights_copied", text, c.pid, {
        "htod_bytes_per_request": per_req, "htod_bytes_serving": htod_bytes, "htod_ns": htod_ns,
        "kernel_ns": kernel_ns, "serving_ns": span, "share": share, "requests": len(recs)})


def concurrency(c: ProcessCensus, t: Optional[Timeline]) -> Optional[Diagnosis]:
    """GPU busy far below 100 % while serving: with few requests in flight the clients are the
    bottleneck; with many, the server is. Needs a request log and every kernel traced."""
    if t is None or not t.requests or not t.kernels_traced:
        return None
    slots = t.serving()
    sp = tl_mod.split(slots)
    if sp.span_ns < MIN_SERVING_NS:
        return None
    busy = sp.share(sp.kernel_ns)
    if busy >= BUSY_LOW:
        return None
    mean = sp.mean_in_flight
    peak = peak_in_flight(t.requests, slots[0].start_ns, slots[-1].end_ns)
    recs = _records_in(t, slots)
    few = [s for s in slots if s.in_flight_ns <= s.length]          # at most one request in flight on average
    none_ = [s for s in slots if s.in_flight_ns == 0]
    idle_few = sum(s.idle_ns for s in few)
    idle_none = sum(s.idle_ns for s in none_)
    head = (f"the GPU ran kernels {_pct(busy)} of {tl_mod.span_words(t, slots)}, with {mean:.2f} requests in "
            f"flight on average (at most {peak})")
    figures = {"busy_share": busy, "nothing_share": sp.share(sp.idle_ns), "copies_only_share": sp.share(sp.copy_only_ns),
               "mean_in_flight": mean, "peak_in_flight": peak, "serving_ns": sp.span_ns, "requests": len(recs),
               "idle_ns_at_most_one_in_flight": idle_few, "idle_ns_none_in_flight": idle_none}
    if mean <= FEW_IN_FLIGHT:
        gaps = (f", {seconds(idle_none)} s of it with no request in flight at all (gaps between a client's "
                "requests)" if idle_none else "")
        text = (f"the clients are the bottleneck, not the GPU: {head}; nothing ran on the GPU {_pct(sp.share(sp.idle_ns))} "
                f"of the time{gaps}. One request at a time leaves the GPU waiting on each token's round trip; "
                "send requests concurrently (more clients, an async client) before adding GPUs.")
        return Diagnosis("client_bound", text, c.pid, figures)
    if mean >= MANY_IN_FLIGHT:
        text = (f"the server is the bottleneck, not the GPU: {head}; nothing ran on the GPU "
                f"{_pct(sp.share(sp.idle_ns))} of the time while requests waited. Look at the server's CPU side "
                "(tokenising, sampling, synchronous copies) and its batch limits (llama-server --parallel / "
                "--batch-size, vLLM --max-num-seqs).")
        return Diagnosis("server_bound", text, c.pid, figures)
    return None


def low_occupancy(censuses: Sequence[ProcessCensus], occupancy: Optional[float],
                  records: Optional[Sequence[RequestRecord]] = None) -> Optional[Diagnosis]:
    """Census busy high, SM occupancy low: the kernels keep the GPU 'busy' but fill little of it.

    Busy is the kernels' share of the time while serving when a request log gives it (a server's
    load and idle start-up would dilute it), else of the time from first to last GPU activity."""
    if occupancy is None:
        return None
    best = None
    for c in censuses:
        if c.kernels.mode == KERNELS_OFF:
            continue
        t = tl_mod.build(c, records) if records else None
        serving = t.serving() if t is not None and t.kernels_traced else []
        if serving:
            sp = tl_mod.split(serving)
            if sp.kernel_ns and (best is None or sp.share(sp.kernel_ns) > best[0]):
                best = (sp.share(sp.kernel_ns), c, None, f"while serving ({tl_mod.span_words(t, serving)})")
            continue
        for d in c.devices.values():
            span = d.last_ns - d.first_ns
            if c.kernels.scheduled:        # busy covers the traced phases only
                span = c.kernels.traced_between(d.first_ns, d.last_ns)
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
    text = (f"kernels fill little of the chip: on {name} kernels ran {_pct(ratio)} of the time {when}, but the "
            f"SM occupancy NVML GPM measured was {_pct(occupancy)} (warp slots in use): GPU utilisation calls this "
            f"GPU busy while about {1 - occupancy:.0%} of it sits unused. Larger batches (more requests at once), "
            "longer sequences per kernel, or fused kernels fill more of it.")
    return Diagnosis("low_occupancy", text, c.pid, {
        "busy_share": ratio, "sm_occupancy": occupancy, "device_id": None if d is None else d.device_id,
        "uuid": None if d is None else d.uuid, "while_serving": d is None})


def _active(c: ProcessCensus) -> bool:
    return any(d.kernel_count or d.copies.total().count or d.memset.count for d in c.devices.values())


def diagnose(censuses: Sequence[ProcessCensus], facts: Facts = Facts()) -> List[Diagnosis]:
    """Every diagnosis the evidence supports, process by process, then the occupancy one."""
    out: List[Diagnosis] = []
    for c in censuses:
        if not _active(c):
            continue
        t = tl_mod.build(c, facts.records)
        for d in (state_save(c, t), *pageable_hot_path(c, t), weights_copied(c, t), concurrency(c, t)):
            if d is not None:
                out.append(d)
    occ = low_occupancy(censuses, facts.sm_occupancy, facts.records)
    if occ is not None:
        out.append(occ)
    return out
