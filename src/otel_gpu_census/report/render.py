"""The census report: a text table per process and device, and the same figures as JSON.

Bytes are printed exactly (thousands separators) beside a decimal size (MB = 10^6 bytes), times
in seconds. Start-up is told apart from serving (``serving``); with a request count or request records,
the per-request figures over all processes while serving: the figure people quote ("209,612,345 bytes
(209.6 MB) device-to-host per request"), with no model load divided into it. Then the explaining part
(``explain``): where the GPU time went next to requests in flight, and the diagnoses.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from otel_gpu_census.report import cost

from otel_gpu_census.report import explain

from otel_gpu_census.report import serving
from otel_gpu_census.census import (DIRECTIONS, FLAG_DROPPED, FLAG_RING_OVERRUN, MEMORY_KINDS, NO_MANAGED,
                                    STATE_ACTIVE, DeviceTotals, KernelTime, ProcessCensus, Stat, merge_devices)
from otel_gpu_census.telemetry.redact import printable
from otel_gpu_census.report.figures import DIRECTION_LABELS, UNITS_NOTE, exact, human_size, per, percent, plural, seconds, size

PEER_RECEIVED_LABEL = "peer-to-peer received"   # DeviceTotals.peer_recv: copies other devices sent here
HOST_DIRECTIONS = ("htod", "dtoh", "htoh")    # a host side exists: split pageable / pinned


# ---------------------------------------------------------------------------------------------
# facts derived from a census

def census_time_ns(c: ProcessCensus) -> int:
    """Wall time the census covered: from CUDA's initialising it in the process (wall_start_ns)
    to the segment's last update (the final flush at exit). Not the process lifetime: Python
    start-up and anything before CUDA initialised are outside it."""
    return max(0, c.wall_update_ns - c.wall_start_ns) if c.wall_update_ns else 0


def kernel_base_ns(c: ProcessCensus) -> int:
    """What busy time is a share of: the census time."""
    return census_time_ns(c)


def kernel_times(censuses: Iterable[ProcessCensus]) -> Dict[str, KernelTime]:
    """Kernel time per physical GPU (keyed as merge_devices) over the processes, each process's device
    priced by its own mode (estimated under counted tracing)."""
    out: Dict[str, KernelTime] = {}
    for c in censuses:
        for d in c.devices.values():
            key = d.uuid or f"cuda:{d.device_id}"
            out[key] = out.get(key, KernelTime(0)) + c.kernel_time(d)
    return out


# a run too short for any of its eager launches to be timed (about 1 in EVENT_EVERY is, never a function's first)
NONE_TIMED = "not measured (too few eager launches for one to be timed)"


def _kernel_time_words(kt: KernelTime) -> str:
    if kt.unknown and not kt.estimated:
        return "not measured (counted at the calls, none timed)"
    if kt.unknown and not kt.ns:
        return NONE_TIMED
    return f"{seconds(kt.ns)} s" + (" (estimated)" if kt.estimated else "") + \
        (" (graph launches only: no eager launch was timed)" if kt.unknown else "")


def kernel_tracing_note(c: ProcessCensus) -> Optional[str]:
    k = c.kernels
    if k.untimed:
        lost = (f"; {c.calls_lost:,} copies, memsets or graph launches were seen but could not be counted "
                "(in no total)" if c.calls_lost else "")
        lost += (f"; {c.launches_lost:,} kernel launches were counted but could not be placed (in no total)"
                 if c.launches_lost else "")
        how = ("seen by the census library preloaded: CUPTI was never loaded (no CUPTI tax on any CUDA call, "
               "see docs/measurements.md)" if k.preloaded else
               "CUPTI's activity API was never set up (its tax on every CUDA call not paid; its callbacks still cost "
               "each launch)")
        return (f"kernels counted at their calls, none timed, {how}; "
                "kernel counts, copies (bytes, direction, host memory) and memsets are exact, and no duration was "
                f"measured: kernel, copy and memset time, graph spans and busy time are unknown{lost}")
    untimed_graphs = (f"; {k.graph_untimed:,} graph launches had no measured span to price them (counted, not in "
                      "kernel time)" if k.graph_untimed else "")
    if k.events:
        lost = untimed_graphs
        lost += (f"; {k.events_missed + k.events_failed:,} launches of the sample went untimed (no free event pair, "
                 "or an event call failed)" if k.events_missed + k.events_failed else "")
        lost += (f"; {k.events_forced:,} gated pairs were dropped, their gate opened by the census's watchdog after "
                 "10 ms (their launching thread held up)" if k.events_forced else "")
        lost += (f"; {k.events_idle:,} eager pairs met an idle stream and read long: " +
                 ("they priced the eager launches, no pair having met a busy one" if not c.totals().eager_traced else
                  "left out of the sample") if k.events_idle else "")
        eager = (f"about 1 of every {k.events_every_eager:,} eager launches and " if k.events_every_eager else "")
        graphs = ("every graph launch" if k.events_every_graph <= 1 else
                  f"about 1 of every {k.events_every_graph:,} graph launches (every launch of a graph until 8 "
                  "were timed)")
        priced = ("eager launches priced at the sampled mean duration, each graph launch at its graph's mean span"
                  if k.events_every_eager else
                  "each graph launch priced at its graph's mean span; eager kernels are not timed (an event pair "
                  "around one times its launching thread as much as the kernel), so their time is unknown")
        lead = (f"; each eager pair less the GPU's pass over one event, timed just before it (mean "
                f"{k.events_lead_ns / k.events_lead:,.0f} ns)" if k.events_lead else "")
        gated = (f" ({k.events_gated:,} gated: the stream waited for the launch to be submitted before the first "
                 f"event{lead})" if k.events_gate else " (not gated)")
        return (f"kernels counted at their calls by the census library preloaded, with durations from "
                f"{k.events_timed:,} CUDA event pairs{gated} around {eager}{graphs} of each thread "
                "(the default collector; CUPTI never loaded); kernel counts, copies "
                f"and memsets are exact; kernel time is estimated: {priced}; copy time and busy time are not "
                f"measured{lost}")
    return None


def busy_of_census_time(d: DeviceTotals, census_ns: int) -> Tuple[Optional[float], str]:
    """(busy_ns / census time, "") or (None, why that ratio would mislead).

    The census time must cover all the GPU activity counted in it; when it is shorter (a segment
    written by an injector that created it at its first buffer, long after CUDA initialised, or
    a census time of zero), dividing by it gives a number above 100% that means nothing."""
    span = max(0, d.last_ns - d.first_ns)
    if census_ns <= 0:
        return None, "no census time recorded"
    if census_ns < span:
        return None, (f"census time {seconds(census_ns)} s is shorter than the {seconds(span)} s of GPU "
                      "activity it counted, so the census started after the work did")
    return d.busy_ns / census_ns, ""


def has_activity(d: DeviceTotals) -> bool:
    return bool(d.kernel_count or d.graph_launches or d.copies.total().count or d.memset.count
                or d.peer_recv.count)


def process_warnings(c: ProcessCensus) -> List[str]:
    """What makes this process's figures incomplete or uncertain, in plain words."""
    out = []
    if c.torn:
        out.append("the segment was caught mid-update (its writer died or is stopped inside an update): "
                   "figures may be partly updated")
    if c.dropped:
        out.append(f"CUPTI dropped {c.dropped:,} activity records: the totals are short by those records")
    elif c.flags & FLAG_DROPPED and not c.buffers_refused:
        out.append("CUPTI dropped activity records (how many is unknown): the totals are short")
    if c.buffers_refused:
        out.append(f"{c.buffers_refused:,} activity buffers were refused to keep memory bounded "
                   "(their records were dropped)")
    if c.graphs.unknown:
        out.append(f"{c.graphs.unknown:,} CUDA graph launches were of graphs the census did not see made: "
                   "their kernels and copies are not counted (only their time)")
    if c.graphs.inexact:
        out.append(f"{c.graphs.inexact:,} CUDA graph launches had conditional nodes or nodes changed after "
                   "instantiation: their kernel and copy counts are a floor")
    if c.flags & FLAG_RING_OVERRUN:
        out.append("the window/step rings were overrun: per-window and per-step figures are incomplete "
                   "(the totals are not affected)")
    if c.state == STATE_ACTIVE and not c.alive:
        out.append("the process ended without the census's final flush (killed?): figures are as of its "
                   "last update, up to about 1 s before it ended")
    elif c.state == STATE_ACTIVE:
        out.append("still running: figures are as of its last update (up to about 1 s stale)")
    return out


def exactness(censuses: Sequence[ProcessCensus]) -> Optional[str]:
    """None when every process's census counted all it saw; else the one line that says the totals are not exact
    and what they miss (never a silent gap)."""
    parts = [f"pid {c.pid}: " + "; ".join(c.gaps) for c in censuses if c.gaps]
    if not parts:
        return None
    return ("NOT EXACT: the census knows it missed GPU work, so the totals below are exact only for what it saw ("
            + "; ".join(parts) + ")")


def no_activity_reason(censuses: Sequence[ProcessCensus], hint: Optional[str] = None) -> Optional[str]:
    """None when some GPU activity was recorded; else the sentence that says so and why."""
    if any(has_activity(d) for c in censuses for d in c.devices.values()):
        return None
    if not censuses:
        why = hint or "no census segment was found (no process under the census initialised CUDA)"
    else:
        why = (f"{len(censuses)} process(es) initialised CUDA under the census but launched no kernels, "
               "copies or memsets")
        if hint:
            why += f"; {hint}"
    return f"no GPU activity was recorded: {why}"


# ---------------------------------------------------------------------------------------------
# JSON

def _stat_dict(s: Stat) -> Dict[str, int]:
    return {"count": s.count, "bytes": s.bytes, "ns": s.ns}


def _copies_dict(d: DeviceTotals) -> Dict[str, dict]:
    out = {}
    for direction in DIRECTIONS:
        s = d.copies.get(direction)
        if s.count:
            by_memory = {m: d.copies.get(direction, m) for m in MEMORY_KINDS}
            out[direction] = dict(_stat_dict(s), by_host_memory={m: _stat_dict(v) for m, v in by_memory.items()
                                                                 if v.count})
    return out


def _device_dict(d: DeviceTotals, census_ns: Optional[int],
                 kt: Optional[KernelTime] = None) -> dict:
    """census_ns None: a sum over processes, which has no one census time. kt: its kernel time as
    estimated (counted kernel tracing), beside the measured kernel_ns."""
    span = max(0, d.last_ns - d.first_ns)
    out = {
        "device_id": d.device_id, "uuid": d.uuid,
        "kernel_count": d.kernel_count, "kernel_ns": d.kernel_ns, "busy_ns": d.busy_ns,
        "gpu_span_ns": span, "busy_ratio_of_gpu_span": d.busy_ns / span if span else None,
        "graph_launches": d.graph_launches, "graph_ns": d.graph_ns, "graph_kernel_count": d.graph_kernel_count,
        "eager_launches": d.eager_launches, "eager_traced": d.eager_traced, "eager_traced_ns": d.eager_traced_ns,
        "copies": _copies_dict(d), "memset": _stat_dict(d.memset),
        "peer_received": _stat_dict(d.peer_recv),
    }
    if d.managed != NO_MANAGED:
        out["managed"] = {k: _stat_dict(v) if isinstance(v, Stat) else v for k, v in vars(d.managed).items()}
    if kt is not None and kt.estimated:
        out["kernel_ns_estimated"] = kt.ns
        out["kernel_time_unknown"] = kt.unknown
    elif kt is not None and kt.unknown:     # no duration measured at all (untimed): kernel_ns is no time
        out["kernel_time_unknown"] = True
    if census_ns is not None:
        ratio, why = busy_of_census_time(d, census_ns)
        out["busy_ratio_of_census_time"] = ratio
        if why:
            out["busy_ratio_of_census_time_unavailable"] = why
    return out


def whole_run(censuses: Sequence[ProcessCensus]) -> serving.Phase:
    """Everything the processes did, as one phase (kernel time priced per process, as kernel_times)."""
    total = DeviceTotals(device_id=-1)
    for c in censuses:
        total = total + c.totals()
    kt = sum(kernel_times(censuses).values(), KernelTime(0))
    return serving.Phase({d: st for d, st in total.copies.by_direction().items() if st.count}, total.memset,
                         total.kernel_count, kt)


def per_request(phase: serving.Phase, requests: int, scope: str = "serving", why: Optional[str] = None) -> dict:
    """A phase's figures divided by the requests (scope: "serving", or "whole_run" with why the start-up
    could not be told apart)."""
    kt = phase.kernel_time
    out = {"requests": requests, "scope": scope,
           "kernel_count": per(phase.kernel_count, requests),
           "kernel_ns": per(kt.ns, requests),
           "copies": {}}
    if why:
        out["whole_run_because"] = why
    if kt.estimated:
        out["kernel_time_estimated"] = True
    if kt.unknown:
        out["kernel_time_unknown"] = True
    for direction in DIRECTIONS:
        s = phase.copy(direction)
        if s.count:
            out["copies"][direction] = {"count": per(s.count, requests), "bytes": per(s.bytes, requests),
                                        "ns": per(s.ns, requests)}
    if phase.memset.count:
        out["memset"] = {k: per(v, requests) for k, v in _stat_dict(phase.memset).items()}
    return out


def request_scope(censuses: Sequence[ProcessCensus], sv: serving.Split, requests: int) -> dict:
    """The per-request figures: over the serving period when it was told apart, else over the whole run."""
    if sv.ok:
        return per_request(sv.total("serving"), requests)
    return per_request(whole_run(censuses), requests, "whole_run", sv.why)


def serving_dict(sv: serving.Split) -> dict:
    p = sv.period
    out = {"basis": p.basis if p else None, "start_unix_ns": p.start_ns if p else None,
           "end_unix_ns": p.end_ns if p else None, "span_ns": p.span_ns if p else None,
           "requests_in_records": p.requests if p else None,
           "pause_ns": serving.PAUSE_NS if p and p.basis == "pause" else None, "not_told_apart": sv.why}
    if sv.ok:
        out.update({part: serving.phase_dict(sv.total(part)) for part in ("startup", "serving", "after")})
        out["processes"] = [dict({part: serving.phase_dict(getattr(ps, part)) for part in ("startup", "serving", "after")},
                                 pid=ps.census.pid) for ps in sv.processes]
        out["inexact"] = list(sv.inexact)
    return out


def _cost_dict(c: ProcessCensus, census_ns: int) -> Optional[dict]:
    e = cost.estimate(c)
    if e is None:                 # no prices (cost.PRICES_FILE): no estimate
        return None
    return {"seconds": round(e.seconds, 6), "share_of_census_time": round(e.share_of(census_ns), 6),
            "eager_kernels": e.eager_kernels, "graph_nodes": e.graph_nodes, "copies_and_memsets": e.copies,
            "graphs_per_node": e.per_node, "launches_counted": e.launches_counted,
            "launches_priced_set_up": e.launches_set_up, "graph_launches": e.graph_launches,
            "event_pairs_eager": e.pairs_eager, "event_pairs_graph": e.pairs_graph}


def cost_line(c: ProcessCensus) -> Optional[str]:
    """What the census cost the process's launching threads, estimated (cost.py); None without records."""
    e = cost.estimate(c)
    if e is None or not (e.eager_kernels or e.graph_nodes or e.copies or e.launches_counted):
        return None
    census_ns = census_time_ns(c)
    share = f", {100.0 * e.share_of(census_ns):.2f}% of census time" if census_ns > 0 else ""
    us = lambda s: f"{s * 1e6:g} us"      # noqa: E731
    if e.wrapped:
        pairs = (f", {e.pairs_eager:,} eager event pairs x {us(cost.PAIR_EAGER_S)}, {e.pairs_graph:,} graph event pairs "
                 f"x {us(e.pair_graph_s)}" if c.kernels.events else "")
        return (f"census cost, estimated: {e.seconds:.6f} s of the launching threads{share} "
                f"({e.launches_counted:,} eager launches counted x {us(cost.WRAPPED_LAUNCH_S)}, {e.graph_launches:,} "
                f"graph launches x {us(cost.WRAPPED_GRAPH_LAUNCH_S)}{pairs}; {e.copies:,} copies and memsets not "
                "priced: the census library's wrappers, CUPTI never loaded; prices of "
                "bench/results/census_cost_prices.json)")
    if c.kernels.untimed:
        return (f"census cost, estimated: {e.seconds:.3f} s of the launching threads (of the GPU for graph nodes)"
                f"{share} ({e.launches_counted:,} launches counted x {us(cost.CALLS_LAUNCH_S)}, {e.graph_nodes:,} "
                f"graph kernel nodes x {us(cost.CALLS_GRAPH_NODE_S)}, {e.copies:,} copies and memsets x "
                f"{us(cost.CALLS_COPY_S)}: CUPTI's callbacks; prices of bench/results/census_cost_prices.json)")
    counted = (f", {e.launches_set_up:,} {'launches counted' if e.launches_counted else 'eager launches'} x "
               f"{us(cost.SET_UP_EAGER_S)} (CUPTI set up)" if e.launches_set_up else "")
    nodes = ("graph nodes among them, traced node by node: an upper bound" if e.per_node and not e.graph_nodes
             else f"{e.graph_nodes:,} graph kernel nodes x {us(e.node_s)}")
    return (f"census cost, estimated: {e.seconds:.3f} s of the launching threads (of the GPU for graph nodes)"
            f"{share} ({e.eager_kernels:,} "
            f"kernel records x {us(cost.EAGER_KERNEL_S)}, {nodes}, {e.copies:,} copies and memsets x "
            f"{us(cost.COPY_S)}{counted}: CUPTI's; prices of bench/results/census_cost_prices.json)")


def to_dict(censuses: Sequence[ProcessCensus], errors: Sequence = (), requests: Optional[int] = None,
            census_dir: Optional[str] = None, hint: Optional[str] = None, facts=None) -> dict:
    """facts: a diagnose.Facts (request log, SM occupancy) for the diagnoses."""
    procs = []
    for c in censuses:
        census_ns = census_time_ns(c)
        procs.append({
            "kernel_tracing": c.kernels.name, "launches_lost": c.launches_lost,
            "graph_tracing": c.graphs.name, "graph_launches_unknown": c.graphs.unknown,
            "graph_launches_inexact": c.graphs.inexact, "paused_ns": c.graphs.paused_ns,
            "attach": c.attach.name, "attach_wall_ns": c.attach.wall_ns, "attach_after_ns": c.attach.after_ns,
            "contexts_late": c.attach.contexts_late,
            "pid": c.pid, "ppid": c.ppid, "comm": c.comm, "state": c.state_name, "alive": c.alive,
            "torn": c.torn, "path": c.path, "cupti_version": c.cupti_version,
            "wall_start_ns": c.wall_start_ns, "wall_update_ns": c.wall_update_ns, "census_time_ns": census_ns,
            "records": c.records, "records_unknown": c.records_unknown, "dropped": c.dropped,
            "buffers": c.buffers, "buffers_refused": c.buffers_refused,
            "step_unmatched": c.step_unmatched, "window_late": c.window_late,
            "flags": c.flags, "warnings": process_warnings(c), "gaps": c.gaps,
            "unsized_calls": c.unsized_calls, "unwrapped": c.unwrapped, "unsized_name": c.unsized_name,
            "managed_in_use": c.managed_in_use, "migrations_measured": c.migrations_measured,
            "um_cpu_faults": c.um_cpu_faults,
            "calls_lost": c.calls_lost,
            "devices": [_device_dict(d, kernel_base_ns(c), kt=c.kernel_time(d))
                        for _, d in sorted(c.devices.items())],
            "census_cost_estimate": _cost_dict(c, census_ns),
        })
    gpus = merge_devices(censuses)
    gpu_kernel_times = kernel_times(censuses)
    out = {
        "census_dir": census_dir,
        "exact": exactness(censuses) is None,
        "not_exact": exactness(censuses),
        "units": {"bytes": "exact", "time": "ns",
                  "census_time_ns": "wall_update_ns - wall_start_ns: from CUDA initialising the census to its "
                                    "last update (not the process lifetime)",
                  "busy_ratio_of_census_time": "busy_ns / census_time_ns; null (with a reason) when the census "
                                               "time does not cover the GPU activity",
                  "serving": "the serving period (basis: requests, from the first request's start to the last one's "
                             "end; pause, from the first GPU work after start-up's last pause of pause_ns or more) and "
                             "every count and byte split into startup, serving and after it; not_told_apart says "
                             "why there is no split",
                  "per_request": "serving's figures divided by the requests (scope serving), or the whole run's, "
                                 "start-up included (scope whole_run, with whole_run_because)"},
        "processes": procs,
        # per physical GPU over all processes; busy_ns adds across processes (an upper bound)
        "gpus": {key: _device_dict(d, None, kt=gpu_kernel_times[key]) for key, d in sorted(gpus.items())},
        "no_activity": no_activity_reason(censuses, hint),
        "errors": [{"path": getattr(e, "path", None), "reason": getattr(e, "reason", str(e))} for e in errors],
    }
    if not out["no_activity"]:
        facts = explain.facts_for(censuses, facts, requests)
        sv = serving.split(censuses, facts.records)
        out["serving"] = serving_dict(sv)
        n = facts.request_count()
        if n:
            out["per_request"] = request_scope(censuses, sv, n)
            paused = sum(c.graphs.paused_ns for c in censuses)
            if paused:
                out["per_request"]["census_paused_ns"] = paused
        out.update(explain.to_dict(censuses, facts, sv))
    return out


# ---------------------------------------------------------------------------------------------
# text

_LABEL_END = 26      # indent + label column: room for "peer-to-peer received"
_COPY_HEADER = f"{'':<{_LABEL_END}}{'count':>12}{'bytes':>22}{'size':>12}{'time s':>14}"


def _copy_row(label: str, s: Stat, indent: int = 4, untimed: bool = False) -> str:
    return (f"{' ' * indent}{label:<{_LABEL_END - indent}}{s.count:>12,}{s.bytes:>22,}{human_size(s.bytes):>12}"
            f"{'—' if untimed else seconds(s.ns):>14}")


def _managed_lines(d: DeviceTotals) -> List[str]:
    """What the calls said of managed memory on the device (its migrations are the managed_* rows above)."""
    m = d.managed
    if m == NO_MANAGED:
        return []
    parts = [f"{plural(m.allocs, 'allocation')}, {m.alloc_bytes:,} bytes ({human_size(m.alloc_bytes)}), "
             f"{m.live_bytes:,} bytes live"]
    for st, where in ((m.prefetch_in, "to the device"), (m.prefetch_out, "to the host")):
        if st.count:
            parts.append(f"{plural(st.count, 'prefetch', 'prefetches')} {where} asked for {st.bytes:,} bytes")
    if m.advises:
        parts.append(plural(m.advises, "cudaMemAdvise call"))
    for n, what in ((m.gpu_faults, "GPU page fault group"), (m.thrashing, "thrashing report"),
                    (m.throttling, "throttling report"), (m.remote_maps, "remote map")):
        if n:
            parts.append(plural(n, what))
    if m.migrated_dtod.count:
        parts.append(f"{m.migrated_dtod.bytes:,} bytes migrated in from other devices")
    return ["    managed memory: " + "; ".join(parts)]


def _device_lines(d: DeviceTotals, census_ns: int, kt: Optional[KernelTime] = None, untimed: bool = False,
                  no_busy: bool = False) -> List[str]:
    """untimed (no duration measured): counts and bytes only; every time says it was not measured.
    no_busy (event pairs): kernel time estimated, busy and copy time not measured."""
    name = f"cuda:{d.device_id}" + (f"  {d.uuid}" if d.uuid else "")
    if not has_activity(d):
        return [f"  {name}: no GPU activity"]
    lines = [f"  {name}"]
    ratio, why = busy_of_census_time(d, census_ns)
    of = "census time"
    busy = f"busy {seconds(d.busy_ns)} s" + (f" = {100.0 * ratio:.1f}% of {of}" if ratio is not None
                                              else f" (no share of {of}: {why})")
    span = d.last_ns - d.first_ns
    if span > 0:
        busy += f"; {percent(d.busy_ns, span)} of the {seconds(span)} s from first to last GPU activity"
    if untimed or no_busy:
        busy = "busy not measured"
    lines.append(f"    kernels {d.kernel_count:>15,}   kernel time {_kernel_time_words(kt or KernelTime(d.kernel_ns))}   "
                 f"{busy}")
    if d.graph_launches:
        lines.append(f"    graph launches {d.graph_launches:,} " + (
            "(spans not measured)" if untimed else f"({seconds(d.graph_ns)} s)") + ", traced per launch: "
            f"{d.graph_kernel_count:,} of the kernels ran inside them" + ("" if untimed else " (kernel time: their spans)"))
    rows = []
    untimed = untimed or no_busy   # copies below: counted at their calls, no duration
    for direction in DIRECTIONS:
        s = d.copies.get(direction)
        if not s.count:
            continue
        rows.append(_copy_row(DIRECTION_LABELS[direction], s, untimed=untimed))
        if direction in HOST_DIRECTIONS:
            for mem in MEMORY_KINDS:
                m = d.copies.get(direction, mem)
                if m.count:
                    rows.append(_copy_row(f"{mem} host", m, indent=6, untimed=untimed))
    if d.peer_recv.count:          # not a copy this device made: listed apart from the directions
        rows.append(_copy_row(PEER_RECEIVED_LABEL, d.peer_recv, untimed=untimed))
    if d.memset.count:
        rows.append(_copy_row("memset", d.memset, untimed=untimed))
    rows += _managed_lines(d)
    if rows:
        lines.append(_COPY_HEADER)
        lines.extend(rows)
    return lines


def _process_lines(c: ProcessCensus) -> List[str]:
    census_ns = census_time_ns(c)
    state = c.state_name if c.alive or c.state != STATE_ACTIVE else "ended"
    head = (f"pid {c.pid}  {c.comm or '?'}  {state}  census time {seconds(census_ns)} s (CUDA init to last "
            f"update)  (ppid {c.ppid}, {c.records:,} records)")
    lines = [head]
    devices = [d for _, d in sorted(c.devices.items())]
    if not devices:
        lines.append("  no GPU activity")
    for d in devices:
        lines.extend(_device_lines(d, kernel_base_ns(c), c.kernel_time(d), c.kernels.untimed,
                                   c.kernels.events))
    cl = cost_line(c)
    if cl:
        lines.append(f"  {cl}")
    note = kernel_tracing_note(c)
    if note:
        lines.append(f"  note: {note}")
    if c.graphs.paused_ns:
        node = f" (~{cost.GRAPH_NODE_PER_LAUNCH_S * 1e6:g} us of GPU time a graph kernel node)" if cost.prices_known() else ""
        tail = (f", while CUPTI's cost on CUDA-graph replays went on{node}: CUPTI was set up before the context; the "
                "default collector never loads CUPTI, and OTEL_GPU_CENSUS_DISABLED=1 is free of it"
                if cost.context_made_under_cupti(c) else "")
        eager = f" (~{cost.SET_UP_EAGER_S * 1e6:g} us an eager launch, more on the calls around it)" if cost.prices_known() else ""
        after = (f"; CUPTI stayed set up, so the launching threads still paid its cost{eager}: a paused census is not an "
                 "untraced process"
                 if not cost.cupti_never_loaded(c) else "; CUPTI was never loaded, so the launching threads paid only the census "
                 "library's check of its wrappers")
        lines.append(f"  note: a control file paused the census for {seconds(c.graphs.paused_ns)} s"
                     f"{' (paused now)' if c.graphs.paused else ''}: nothing was counted then{tail}{after}")
    for w in process_warnings(c):
        lines.append(f"  warning: {w}")
    return lines


def _phase_words(p: serving.Phase) -> str:
    """A phase in one line: its copies by direction, memsets and kernels, with their units."""
    parts = [f"{size(st.bytes)} {DIRECTION_LABELS[d]} in {plural(st.count, 'copy', 'copies')}"
             for d in DIRECTIONS for st in [p.copy(d)] if st.count]
    if p.memset.count:
        parts.append(f"{size(p.memset.bytes)} set in {plural(p.memset.count, 'memset')}")
    parts.append(plural(p.kernel_count, "kernel"))
    return ", ".join(parts)


def _serving_lines(sv: serving.Split, requests: Optional[int]) -> List[str]:
    """When the servers served, and what start-up and the time after took apart from it."""
    if not sv.ok:
        return [f"start-up and serving not told apart: {sv.why}"] if requests else []
    p = sv.period
    if p.basis == "requests":
        when = (f"the {p.span_ns / 1e9:.3f} s from the first request's start to the last one's end "
                f"({plural(p.requests, 'request')} in the records)")
    else:
        when = (f"the {p.span_ns / 1e9:.3f} s from the first GPU work after start-up's last pause of "
                f"{serving.PAUSE_NS / 1e9:g} s or more ({(p.start_ns - p.first_work_ns) / 1e9:.3f} s after the first "
                "GPU work) to the last GPU work")
    lines = ["start-up and serving:", f"  serving: {when}"]
    startup = sv.total("startup")
    lines.append("  start-up, before it (weights, compilation, graph capture, warm-up): "
                 + ("no GPU work" if startup.empty else _phase_words(startup)))
    after = sv.total("after")
    if not after.empty:
        lines.append(f"  after it: {_phase_words(after)}")
    for note in sv.inexact:
        lines.append(f"  note: {note}")
    return lines


def _per_request_lines(pr: dict, processes: int) -> List[str]:
    requests = pr["requests"]
    scope = "all processes and devices above" if processes > 1 else "all devices above"
    if pr["scope"] == "serving":
        lines = [f"per request while serving ({requests:,} requests; {scope}, start-up left out):"]
    else:
        lines = [f"per request over the whole run, start-up included ({requests:,} requests; {scope}):"]
    for direction, s in pr["copies"].items():
        lines.append(f"  {size(s['bytes'])} {DIRECTION_LABELS[direction]} per request, in "
                     f"{plural(s['count'], 'copy', 'copies')}")
    if "memset" in pr:
        lines.append(f"  {size(pr['memset']['bytes'])} set per request, in {plural(pr['memset']['count'], 'memset')}")
    untimed = pr.get("kernel_time_unknown") and not pr.get("kernel_time_estimated")
    # estimated and unknown: eager launches and no sample to price them (events with few launches), so the
    # figure is the graph part only and must not read as the whole
    how = (" (estimated, graph launches only: no eager launch was timed)" if pr.get("kernel_time_unknown")
           else " (estimated)") if pr.get("kernel_time_estimated") else ""
    lines.append(f"  {plural(pr['kernel_count'], 'kernel')} per request, " + (
        "kernel time not measured (counted at the calls, none timed)" if untimed else
        f"kernel time {NONE_TIMED}" if pr.get("kernel_time_unknown") and not pr["kernel_ns"] else
        f"{seconds(pr['kernel_ns'])} s kernel time per request{how}"))
    return lines


def _engine_request_lines(censuses: Sequence[ProcessCensus]) -> List[str]:
    """Per-request figures from the requests an engine integration logged beside its segment."""
    from otel_gpu_census.report import engine_requests
    lines = []
    for log in engine_requests.for_segments([c.path for c in censuses]):
        fig = engine_requests.figures(log)
        method = (log.summary or {}).get("method", "step_tokens")
        lines.append(f"per request, as the engine integration attributed them ({len(log.requests):,} requests, "
                     f"by {method}; {log.path}):")
        for key, label in (("copy.dtoh.bytes", "device-to-host"), ("copy.htod.bytes", "host-to-device"),
                           ("copy.dtod.bytes", "device-to-device")):
            f = fig[key]
            if f["max"]:
                lines.append(f"  {label:<16} median {exact(round(f['median']))} bytes, mean {exact(round(f['mean']))}, "
                             f"max {exact(f['max'])}")
        k, t = fig["kernel.count"], fig["kernel.time_ns"]
        lines.append(f"  kernels          median {exact(round(k['median']))}, kernel time median "
                     f"{seconds(t['median'])} s, max {seconds(t['max'])} s")
        ks = engine_requests.kernel_sample(log)
        if ks:
            traced = (f", median {ks['ratio_median']:.1%} of their steps' time traced"
                      if ks["ratio_median"] is not None else "")
            lines.append(f"  kernel figures are a sample (kernel tracing {', '.join(ks['modes'])}: "
                         f"{ks['requests']:,} of {len(log.requests):,} requests{traced})")
            e = ks["estimate"]
            lines.append(f"  kernel time scaled to the whole (time / traced ratio, {e['requests']:,} requests): "
                         f"median {seconds(round(e['median']))} s, max {seconds(round(e['max']))} s" if e else
                         "  kernel time cannot be scaled: no kernel was traced in their steps")
        ke = engine_requests.kernel_estimated(log)
        if ke:
            unknown = (f"; {ke['unknown']:,} had eager kernels no sample priced (their time left out)"
                       if ke["unknown"] else "")
            lines.append(f"  kernel counts exact, kernel time estimated for {ke['estimated']:,} of "
                         f"{len(log.requests):,} requests (kernel tracing {', '.join(ke['modes'])}: eager "
                         f"kernels' time priced at a sampled mean){unknown}")
        if "ttft_s" in fig:
            lines.append(f"  time to first token median {fig['ttft_s']['median']:.4f} s, max {fig['ttft_s']['max']:.4f} s")
        inc = engine_requests.incomplete(log)
        if inc:
            said = f' (e.g. "{inc["note"]}")' if inc["note"] else ""
            lines.append(f"  {inc['partial']:,} requests partial: their shares miss work they know of{said}; "
                         f"{inc['stale']:,} stale; {inc['dropped']:,} dropped (no span: their settling process died)")
        if log.summary:
            un = log.summary.get("unattributed", {})
            lines.append(f"  steps split {exact(log.summary.get('steps_split', 0))}; no request's: "
                         f"{exact(un.get('kernel.count', 0))} kernels, {exact(un.get('copy.dtoh.bytes', 0))} "
                         "device-to-host bytes")
            rec = engine_requests.recomputed(log)
            if rec:
                lines.append(f"  recomputed after preemptions: {exact(rec[0])} tokens, {seconds(rec[1])} s of kernel "
                             "time (inside the requests' kernel time above)")
        if log.skipped:
            lines.append(f"  ({log.skipped} lines of the log were not requests and were skipped)")
        if log.unread:
            lines.append(f"  ({log.unread}: the figures above are of the requests read)")
    return lines + ([""] if lines else [])


def _all_processes_lines(censuses: Sequence[ProcessCensus]) -> List[str]:
    """Per physical GPU across processes (vLLM / SGLang run one process per GPU or more)."""
    active = [c for c in censuses if any(has_activity(d) for d in c.devices.values())]
    if len(active) < 2:
        return []
    lines = [f"all {len(active)} processes, per GPU:"]
    kts = kernel_times(active)
    for key, d in sorted(merge_devices(active).items()):
        parts = [f"kernels {d.kernel_count:,} ({_kernel_time_words(kts[key])})"]
        for direction, s in d.copies.by_direction().items():
            if s.count:
                parts.append(f"{DIRECTION_LABELS[direction]} {s.bytes:,} bytes ({human_size(s.bytes)})")
        if d.peer_recv.count:
            parts.append(f"{PEER_RECEIVED_LABEL} {d.peer_recv.bytes:,} bytes ({human_size(d.peer_recv.bytes)})")
        lines.append(f"  {key}: " + ", ".join(parts))
    return lines + [""]


def render_text(censuses: Sequence[ProcessCensus], requests: Optional[int] = None,
                census_dir: Optional[str] = None, hint: Optional[str] = None, facts=None) -> str:
    """facts: a diagnose.Facts (request log, SM occupancy) for the diagnoses."""
    n = len(censuses)
    lines = [f"otel-gpu-census report: {n} process{'es' if n != 1 else ''}"
             + (f", census folder {census_dir}" if census_dir else ""),
             f"({UNITS_NOTE})", ""]
    gap = exactness(censuses)
    if gap:
        lines.extend([gap, ""])
    for c in censuses:
        lines.extend(_process_lines(c))
        lines.append("")
    lines.extend(_all_processes_lines(censuses))
    reason = no_activity_reason(censuses, hint)
    if reason:
        lines.append(reason)
    else:
        facts = explain.facts_for(censuses, facts, requests)
        sv = serving.split(censuses, facts.records)
        n = facts.request_count()
        lines.extend(_serving_lines(sv, n))
        if n:
            lines.extend(_per_request_lines(request_scope(censuses, sv, n), len(censuses)))
            paused = sum(c.graphs.paused_ns for c in censuses)
            if paused:
                lines.append(f"  note: a control file paused the census for {seconds(paused)} s: the work of that "
                             "time is in none of these figures")
        lines.extend(_engine_request_lines(censuses))
        lines.extend(explain.lines(censuses, facts, sv))
    # a segment's comm and note, and file names, are written by whoever could write the folder: terminal
    # escape sequences in them must not reach the terminal
    return printable("\n".join(lines).rstrip(), lines=True) + "\n"
