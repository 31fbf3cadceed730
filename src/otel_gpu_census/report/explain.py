"""The report's explaining part: the diagnoses, and where GPU time went next to requests in flight.

``report.render_text`` and ``report.to_dict`` call ``facts_for``, ``lines`` and ``to_dict``; the logic is
in ``diagnose``, ``serving`` and ``timeline``. Request records come from the caller (a request log, the
proxy of `run --proxy`) or, without them, from the request logs an engine integration wrote beside its
segments.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence

from otel_gpu_census.report import diagnose as dg
from otel_gpu_census.report import engine_requests
from otel_gpu_census.report import serving
from otel_gpu_census.report import timeline as tl_mod
from otel_gpu_census.census import ProcessCensus
from otel_gpu_census.report.figures import seconds
from otel_gpu_census.report.request_log import RequestRecord

SPLIT_NOTE = ("kernels: kernel time in each 20 ms window, capped at the window (concurrent kernels add up); "
              "copies only: copy and memset time the kernels left; nothing: the rest")
ESTIMATED_NOTE = "kernel time estimated: eager kernels priced at a sampled mean"
UNTIMED_COPIES_NOTE = "copies counted at their calls have no duration: their time is in nothing"


def _notes(t: tl_mod.Timeline) -> str:
    notes = [SPLIT_NOTE]
    if t.census.graphs.paused_ns:
        notes.append(f"the census was paused {seconds(t.census.graphs.paused_ns)} s by a control file: that time "
                     "reads as nothing")
    if t.kernel_time_estimated:
        notes.append(ESTIMATED_NOTE)
    if not t.copies_timed:
        notes.append(UNTIMED_COPIES_NOTE)
    return "; ".join(notes)


def _pct(x: float) -> str:
    return f"{100.0 * x:.1f}%"


def _server_timelines(censuses: Sequence[ProcessCensus], facts: dg.Facts) -> List[tl_mod.Timeline]:
    """Timelines of the processes that were active while the logged requests were in flight."""
    out = []
    for c in censuses:
        t = tl_mod.build(c, facts.records)
        if t is None or not t.kernel_time_known:
            continue
        slots = t.serving()
        if any(s.kernel_ns or s.copy_only_ns for s in slots):
            out.append(t)
    return out


def idle_time(t: tl_mod.Timeline) -> dict:
    slots = t.serving()
    step, rows = tl_mod.intervals(slots)
    whole = tl_mod.split(slots)

    def row(sp: tl_mod.Split) -> dict:
        return {"span_ns": sp.span_ns, "kernel_ns": sp.kernel_ns, "copy_only_ns": sp.copy_only_ns,
                "nothing_ns": sp.idle_ns, "in_flight_mean": sp.mean_in_flight}

    t0 = slots[0].start_ns if slots else 0
    return {"pid": t.census.pid, "comm": t.census.comm, "start_unix_ns": t0, "interval_ns": step,
            "whole": row(whole),
            "intervals": [dict(row(sp), offset_ns=start - t0) for start, sp in rows],
            "by_in_flight": [dict(row(sp), in_flight=label) for label, sp in tl_mod.by_in_flight(slots)],
            "kernel_time_estimated": t.kernel_time_estimated, "copies_timed": t.copies_timed, "note": _notes(t)}


def _split_cells(sp: tl_mod.Split) -> str:
    return (f"{_pct(sp.share(sp.kernel_ns)):>9}{_pct(sp.share(sp.copy_only_ns)):>13}"
            f"{_pct(sp.share(sp.idle_ns)):>10}")


def idle_lines(t: tl_mod.Timeline) -> List[str]:
    slots = t.serving()
    if not slots:
        return []
    step, rows = tl_mod.intervals(slots)
    whole = tl_mod.split(slots)
    lines = [f"where the GPU time went: pid {t.census.pid} {t.census.comm or '?'}, {tl_mod.span_words(t, slots)}, "
             f"by {step // 10**9} s:",
             f"  {'from s':>10}{'kernels':>9}{'copies only':>13}{'nothing':>10}{'in flight':>11}"]
    t0 = slots[0].start_ns
    for start, sp in rows:
        lines.append(f"  {(start - t0) / 1e9:>10.3f}{_split_cells(sp)}{sp.mean_in_flight:>11.2f}")
    lines.append(f"  {'all':>10}{_split_cells(whole)}{whole.mean_in_flight:>11.2f}")
    lines.append(f"  {'in flight':>10}{'kernels':>9}{'copies only':>13}{'nothing':>10}{'time s':>11}")
    for label, sp in tl_mod.by_in_flight(slots):
        lines.append(f"  {label:>10}{_split_cells(sp)}{seconds(sp.span_ns):>11}")
    lines.append(f"  ({_notes(t)})")
    return lines


def engine_records(censuses: Sequence[ProcessCensus]) -> List[RequestRecord]:
    """The requests an engine integration logged beside the segments, as records (start, end, first token)."""
    out = []
    for log in engine_requests.for_segments([c.path for c in censuses]):
        for r in log.requests:
            start, end, first = r.start_ns, r.end_ns, r.first_token_ns
            if not 0 < start <= end:
                continue
            out.append(RequestRecord(start, end, first if start <= first <= end else None))
    return sorted(out, key=lambda r: (r.start_ns, r.end_ns))


def facts_for(censuses: Sequence[ProcessCensus], facts: Optional[dg.Facts] = None,
              requests: Optional[int] = None) -> dg.Facts:
    """The caller's facts, with the request count it gave, and request records from an engine's logs
    where the caller had none."""
    facts = facts or dg.Facts()
    if requests and not facts.requests:
        facts = dataclasses.replace(facts, requests=requests)
    if not facts.records:
        recs = engine_records(censuses)
        if recs:
            facts = dataclasses.replace(facts, records=recs)
    return facts


def lines(censuses: Sequence[ProcessCensus], facts: dg.Facts, sv: serving.Split) -> List[str]:
    """The report lines: the idle-time table (with request records), then the diagnoses (if any)."""
    out: List[str] = []
    if facts.records:
        for t in _server_timelines(censuses, facts):
            out += [""] + idle_lines(t)
    found = dg.diagnose(censuses, facts, sv)
    if found:
        pids = {d.pid for d in found}
        out += ["", "diagnoses:"]
        for d in found:
            who = f"pid {d.pid}: " if len(pids) > 1 or len(censuses) > 1 else ""
            out.append(f"  * {who}{d.text}")
    return out


def to_dict(censuses: Sequence[ProcessCensus], facts: dg.Facts, sv: serving.Split) -> dict:
    out = {"diagnoses": [d.to_dict() for d in dg.diagnose(censuses, facts, sv)]}
    if facts.records:
        out["idle_time"] = [idle_time(t) for t in _server_timelines(censuses, facts)]
    return out
