"""GPU span attributes of one request, engine-neutral: what ``GpuCost`` says, as ``gpu_census.*``.

Counts and bytes are exact integers; times are seconds (doubles), as the OpenTelemetry conventions give
durations (the census counts ns: the request log keeps those integers, ``share_attributes(seconds=False)``):

- ``gpu_census.kernel.count``, ``gpu_census.kernel.time``: kernels attributed to the request;
- ``gpu_census.copy.<dir>.bytes|count|time`` for dir in htod, dtoh (always present) and dtod,
  ptop, htoh, other (when non-zero); ``gpu_census.memset.*`` likewise; no ``time`` of copies and memsets where
  nothing timed them (counted at the calls: the default collector);
- ``gpu_census.prefill.copy.dtoh.bytes``, ``.prefill.copy.htod.bytes``, ``.prefill.kernel.time``:
  the part of the share before the first token;
- with window data (time-window attribution): ``gpu_census.window.*``, everything the buckets of the
  request's window held (all requests together), ``gpu_census.window.unattributed.*``, the part no
  request was in flight for, and ``gpu_census.attribution.buckets``;
- ``gpu_census.kernel.tracing``: ``all`` (the precise collector), ``events:EAGER/GRAPH`` (the default one, its
  event-pair sample) or ``calls`` (counted at the calls, no duration measured); when not ``all``,
  ``gpu_census.kernel.traced_ratio``: the share of the request's time kernel durations were measured in (0 for
  ``calls``). Counted at the calls: kernel counts are exact, and
  ``gpu_census.kernel.time_estimated`` (bool) says whether the kernel times (``*kernel.time``) are
  estimates: graph spans, plus eager launches x the mean duration of the eager kernels sampled (under
  step attribution each step priced once, by its own sample, else the server's over its life, and the
  request's kernel time is its part of those, so the requests' add up to the steps'; under windows the
  share's own sample, else the server's); with no sample at all their time is left out and the note says so;
- ``gpu_census.attribution.method`` (``GpuCost.method``: ``time_window_shared``, ``step_tokens``,
  ``step_flops``, ``step_alone``, ``step_model``: its note says how many of the request's steps fell back to
  tokens while the model's fit of their kind was not ready),
  ``.status`` (complete, settled, partial, stale, no_census, no_segment, read_error, shutdown),
  ``.concurrency_max``, ``.steps`` (step attribution), ``.wait_s``, ``.note`` (the integration's
  ``GpuCost.note`` first, then what went wrong); ``gpu_census.process.pids``.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from otel_gpu_census.attribution.ledger import GpuCost
from otel_gpu_census.attribution.shares import Share
from otel_gpu_census.census import DIRECTIONS, copy_times_measured, timed_modes

ALWAYS_DIRECTIONS = ("htod", "dtoh")


def share_attributes(prefix: str, s: Share, always: bool = True, kernel_ns: Optional[int] = None,
                     copy_time: bool = True, seconds: bool = False) -> Dict[str, Any]:
    """`s` as `prefix`kernel.*, copy.<dir>.*, memset.* (htod and dtoh even when zero if `always`);
    `kernel_ns`: its kernel time when not as measured (an estimate: GpuCost.kernel_time); not `copy_time`: no
    copy or memset time (counted at the calls nothing timed them: a 0 would read as measured). Times as
    ``time`` in seconds with `seconds` (span attributes), else as ``time_ns`` integers (the request log)."""
    key, t = ("time", lambda ns: ns / 1e9) if seconds else ("time_ns", lambda ns: ns)
    out: Dict[str, Any] = {f"{prefix}kernel.count": s.kernel_count,
                           f"{prefix}kernel.{key}": t(s.kernel_ns if kernel_ns is None else kernel_ns)}
    for d in DIRECTIONS:
        st = s.copy(d)
        if (always and d in ALWAYS_DIRECTIONS) or st.count or st.bytes:
            out[f"{prefix}copy.{d}.bytes"] = st.bytes
            out[f"{prefix}copy.{d}.count"] = st.count
            if copy_time:
                out[f"{prefix}copy.{d}.{key}"] = t(st.ns)
    if s.memset.count or s.memset.bytes:
        out[f"{prefix}memset.bytes"] = s.memset.bytes
        out[f"{prefix}memset.count"] = s.memset.count
        if copy_time:
            out[f"{prefix}memset.{key}"] = t(s.memset.ns)
    return out


def gpu_attributes(cost: GpuCost) -> Dict[str, Any]:
    """The span attributes of `cost` (the list in the module docstring)."""
    out: Dict[str, Any] = {
        "gpu_census.attribution.method": cost.method,
        "gpu_census.attribution.status": cost.status,
    }
    if not cost.has_figures:
        if cost.notes:
            out["gpu_census.attribution.note"] = "; ".join(cost.notes)
        return out
    kt = cost.share_time()
    timed_copies = copy_times_measured(cost.kernel_tracing)
    out.update(share_attributes("gpu_census.", cost.share, kernel_ns=kt.ns, copy_time=timed_copies, seconds=True))
    if cost.kernel_tracing:
        out["gpu_census.kernel.tracing"] = ",".join(cost.kernel_tracing)
        if cost.kernel_tracing != ["all"]:
            out["gpu_census.kernel.traced_ratio"] = round(cost.kernel_traced_ratio, 4)
    if cost.kernel_counted:
        out["gpu_census.kernel.time_estimated"] = kt.estimated
    out["gpu_census.prefill.copy.dtoh.bytes"] = cost.prefill.copy("dtoh").bytes
    out["gpu_census.prefill.copy.htod.bytes"] = cost.prefill.copy("htod").bytes
    out["gpu_census.prefill.kernel.time"] = cost.prefill_time().ns / 1e9
    if cost.has_window:
        out.update(share_attributes("gpu_census.window.", cost.window, kernel_ns=cost.kernel_time(cost.window).ns,
                                    copy_time=timed_copies, seconds=True))
        out.update(share_attributes("gpu_census.window.unattributed.", cost.unattributed, always=False,
                                    kernel_ns=cost.kernel_time(cost.unattributed).ns, copy_time=timed_copies,
                                    seconds=True))
    out["gpu_census.attribution.concurrency_max"] = cost.concurrency_max
    if cost.has_window:
        out["gpu_census.attribution.buckets"] = cost.buckets
    if cost.steps:
        out["gpu_census.attribution.steps"] = cost.steps
    out["gpu_census.attribution.wait_s"] = round(cost.waited_s, 3)
    note = [cost.note] if cost.note else []
    if kt.unknown and not timed_modes(cost.kernel_tracing):
        note.append("kernel time not measured (counted at the calls, none timed): kernel counts, copies and memsets only")
    elif kt.unknown:
        note.append(f"kernel time leaves out {cost.kernel_unpriced} eager kernel launches: no kernel "
                    "record was sampled to price them")
    if note or cost.notes:
        out["gpu_census.attribution.note"] = "; ".join(note + cost.notes)
    if cost.pids:
        out["gpu_census.process.pids"] = list(cost.pids)
    return out
