"""`report --diff A B`: two census runs side by side, with the change in every figure.

Each run is a census folder or one segment file; its figures are the totals of all its processes and
devices. Rows per direction and host memory kind (count, bytes, time, and the copies' GB/s), kernels,
memsets; with request counts, the same per request, over each run's serving period (``serving``: start-up
left out, by direction, no memory kind: the windows have none) where both runs' start-up is told apart, else
over the whole runs, saying so. Integers stay exact (B - A); a per-request quotient that does not divide keeps
two decimals. A time neither collector of a run measured (copies counted at their calls, busy under the
default collector) reads "—", never a measured-looking zero; the first line after the runs names the biggest
change in bytes moved or time. The case this is for: an upgrade that copies the same bytes, but in cheaper copies
(same bytes, less time, more GB/s).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

from otel_gpu_census.report import serving
from otel_gpu_census.census import DIRECTIONS, MEMORY_KINDS, DeviceTotals, KernelTime, ProcessCensus, Stat
from otel_gpu_census.report.figures import DIRECTION_LABELS, UNITS_NOTE, exact, human_size, per, seconds
from otel_gpu_census.report.render import HOST_DIRECTIONS, kernel_times


NOT_MEASURED = "—"      # the single report's mark for a time its collector does not measure


@dataclass(frozen=True)
class Measured:
    """Which durations a run's collector measured: in every process, or the figure is not measured."""
    busy: bool = True       # not under the default collector (event pairs) nor with no durations at all
    graphs: bool = True     # graph spans: not with no durations at all
    copies: bool = True     # copy and memset time: only CUPTI's copy records have them


@dataclass(frozen=True)
class Run:
    source: str
    censuses: List[ProcessCensus]
    requests: Optional[int] = None

    def totals(self) -> DeviceTotals:
        out = DeviceTotals(device_id=-1)
        for c in self.censuses:
            out = out + c.totals()
        return out

    def kernel_time(self) -> KernelTime:
        """Its kernel time, estimated where a process counted kernels (report.kernel_times)."""
        return sum(kernel_times(self.censuses).values(), KernelTime(0))

    def serving(self) -> serving.Split:
        return serving.split(self.censuses)

    def measured(self) -> Measured:
        ks = [c.kernels for c in self.censuses]
        return Measured(busy=not any(k.untimed or k.events for k in ks), graphs=not any(k.untimed for k in ks),
                        copies=all(k.copies_timed for k in ks))


@dataclass(frozen=True)
class Row:
    figure: str          # stable key, e.g. copies.dtoh.pageable.bytes
    label: str
    unit: str            # count, bytes, ns, GB/s
    a: Optional[float]   # None: not measured (see measured), or no copies to rate
    b: Optional[float]
    measured: Tuple[bool, bool] = (True, True)

    @property
    def change(self):
        return None if self.a is None or self.b is None else self.b - self.a


def _row(figure: str, label: str, unit: str, a, b, ma: bool = True, mb: bool = True) -> Row:
    return Row(figure, label, unit, a if ma else None, b if mb else None, (ma, mb))


def _stat_rows(key: str, label: str, a: Stat, b: Stat, rate: bool = True, indent: str = "",
               timed: Tuple[bool, bool] = (True, True)) -> List[Row]:
    rows = [Row(f"{key}.count", indent + label, "count", a.count, b.count),
            Row(f"{key}.bytes", indent + "  bytes", "bytes", a.bytes, b.bytes),
            _row(f"{key}.ns", indent + "  time s", "ns", a.ns, b.ns, *timed)]
    if rate and (a.ns or b.ns):
        rows.append(_row(f"{key}.gb_per_s", indent + "  GB/s", "GB/s", a.bytes / a.ns if a.ns else None,
                         b.bytes / b.ns if b.ns else None, *timed))    # None: no copies, no rate
    return rows


def rows(a: DeviceTotals, b: DeviceTotals, ka: Optional[KernelTime] = None,
         kb: Optional[KernelTime] = None, ma: Measured = Measured(), mb: Measured = Measured()) -> List[Row]:
    """Every figure either run has, in report order; ka, kb: the runs' kernel times when estimated
    (counted kernel tracing) rather than the measured kernel_ns; ma, mb: what each run's collector measured."""
    ka, kb = ka or KernelTime(a.kernel_ns), kb or KernelTime(b.kernel_ns)
    estimated = " (estimated)" if ka.estimated or kb.estimated else ""
    timed = (ma.copies, mb.copies)
    out = [Row("kernels.count", "kernels", "count", a.kernel_count, b.kernel_count),
           _row("kernels.ns", "kernel time s" + estimated, "ns", ka.ns, kb.ns, not ka.unknown, not kb.unknown),
           _row("busy.ns", "busy s", "ns", a.busy_ns, b.busy_ns, ma.busy, mb.busy)]
    if a.graph_launches or b.graph_launches:
        out += [Row("graphs.count", "graph launches", "count", a.graph_launches, b.graph_launches),
                _row("graphs.ns", "graph time s", "ns", a.graph_ns, b.graph_ns, ma.graphs, mb.graphs)]
    for d in DIRECTIONS:
        sa, sb = a.copies.get(d), b.copies.get(d)
        if not (sa.count or sb.count):
            continue
        out += _stat_rows(f"copies.{d}", f"{DIRECTION_LABELS[d]} copies", sa, sb, timed=timed)
        if d in HOST_DIRECTIONS:
            for m in MEMORY_KINDS:
                ma_, mb_ = a.copies.get(d, m), b.copies.get(d, m)
                if ma_.count or mb_.count:
                    out += _stat_rows(f"copies.{d}.{m}", f"{m} host copies", ma_, mb_, indent="  ", timed=timed)
    if a.memset.count or b.memset.count:
        out += _stat_rows("memset", "memsets", a.memset, b.memset, rate=False, timed=timed)
    if a.peer_recv.count or b.peer_recv.count:
        out += _stat_rows("peer_received", "peer-to-peer received", a.peer_recv, b.peer_recv, timed=timed)
    return out


def serving_rows(a: serving.Phase, b: serving.Phase, ma: Measured = Measured(),
                 mb: Measured = Measured()) -> List[Row]:
    """The rows of two serving periods: kernels, copies by direction, memsets (no memory kind, no busy)."""
    estimated = " (estimated)" if a.kernel_time.estimated or b.kernel_time.estimated else ""
    timed = (ma.copies, mb.copies)
    out = [Row("kernels.count", "kernels", "count", a.kernel_count, b.kernel_count),
           _row("kernels.ns", "kernel time s" + estimated, "ns", a.kernel_time.ns, b.kernel_time.ns,
                not a.kernel_time.unknown, not b.kernel_time.unknown)]
    for d in DIRECTIONS:
        sa, sb = a.copy(d), b.copy(d)
        if sa.count or sb.count:
            out += _stat_rows(f"copies.{d}", f"{DIRECTION_LABELS[d]} copies", sa, sb, rate=False, timed=timed)
    if a.memset.count or b.memset.count:
        out += _stat_rows("memset", "memsets", a.memset, b.memset, rate=False, timed=timed)
    return out


def per_request_rows(a: Run, b: Run) -> Tuple[str, List[Row], Optional[str]]:
    """("serving", rows of both serving periods, None) where both runs' start-up is told apart, else
    ("whole_run", rows of the whole runs, why not)."""
    sa, sb = a.serving(), b.serving()
    if sa.ok and sb.ok:
        return "serving", serving_rows(sa.total("serving"), sb.total("serving"), a.measured(), b.measured()), None
    whole = [r for r in all_rows(a, b) if r.unit != "GB/s"]
    why = "; ".join(f"{side}: {sv.why}" for side, sv in (("A", sa), ("B", sb)) if not sv.ok)
    return "whole_run", whole, why


def all_rows(a: Run, b: Run) -> List[Row]:
    return rows(a.totals(), b.totals(), a.kernel_time(), b.kernel_time(), a.measured(), b.measured())


# The headline: the biggest relative change among what a run moved or spent, by direction (no memory kind).
_HEADLINE = {"kernels.ns": "kernel time", "busy.ns": "busy time", "memset.bytes": "memset bytes",
             "memset.ns": "memset time", **{f"copies.{d}.bytes": f"{label} bytes" for d, label in
                                            DIRECTION_LABELS.items()},
             **{f"copies.{d}.ns": f"{label} copy time" for d, label in DIRECTION_LABELS.items()}}


def headline(rs: Sequence[Row], value: Callable[[Row], Tuple[float, float]], scope: str) -> Tuple[str, Optional[dict]]:
    """(the line, its figure as a dict): the row of _HEADLINE whose value changed most relative to the larger side,
    both sides measured (ties: the larger absolute change)."""
    best, key = None, (0.0, 0.0)
    for r in rs:
        if r.figure not in _HEADLINE or not all(r.measured):
            continue
        a, b = value(r)
        if a is None or b is None or a == b:
            continue
        k = (abs(b - a) / max(abs(a), abs(b)), abs(b - a))
        if k > key:
            best, key = (r, a, b), k
    if best is None:
        return f"biggest change: none (no bytes moved or time measured changed{scope})", None
    r, a, b = best
    words = _HEADLINE[r.figure] + ("" if r.unit != "ns" or "estimated" not in r.label else " (estimated)")
    pct = f"{100.0 * (b - a) / a:+.1f}%" if a else "none in A"
    if r.unit == "bytes":
        shown = f"{human_size(a)} → {human_size(b)} ({exact(a)} → {exact(b)} B, {pct})"
    else:
        shown = f"{seconds(a)} s → {seconds(b)} s ({pct})"
    return (f"biggest change: {words}{scope} {shown}",
            {"figure": r.figure, "a": a, "b": b, "change": b - a})


def _value(unit: str, v, measured: bool = True) -> str:
    if not measured:
        return NOT_MEASURED
    if v is None:
        return "-"
    if unit == "ns":
        return seconds(v)
    if unit == "GB/s":
        return f"{v:.2f}"
    return exact(v)


def _change(r: Row, a, b) -> str:
    if not all(r.measured):
        return NOT_MEASURED
    if a is None or b is None:
        return "-"
    ch = b - a
    if r.unit == "ns":
        text = ("+" if ch > 0 else "") + seconds(ch)
    elif r.unit == "GB/s":
        text = f"{ch:+.2f}"
    else:
        text = ("+" if ch > 0 else "") + exact(ch)
    if a and ch:
        text += f" ({100.0 * ch / a:+.1f}%)"
    return text


def _table(rs: Sequence[Row], value: Callable[[Row], Tuple[float, float]]) -> List[str]:
    lines = [f"{'':<30}{'A':>22}{'B':>22}   change"]
    for r in rs:
        a, b = value(r)
        va, vb = _value(r.unit, a, r.measured[0]), _value(r.unit, b, r.measured[1])
        lines.append(f"{r.label:<30}{va:>22}{vb:>22}   {_change(r, a, b)}")
    return lines


def _describe(run: Run) -> str:
    n = len(run.censuses)
    req = f", {run.requests:,} requests" if run.requests else ""
    return f"{run.source}  ({n} process{'es' if n != 1 else ''}{req})"


def _per_request(r: Row, a: Run, b: Run):
    return (None if r.a is None else per(r.a, a.requests), None if r.b is None else per(r.b, b.requests))


def _headline(a: Run, b: Run, rs: Sequence[Row]) -> Tuple[str, Optional[dict]]:
    if a.requests and b.requests:
        scope, prs, _why = per_request_rows(a, b)
        return headline(prs, lambda r: _per_request(r, a, b),
                        " per request" + (" while serving" if scope == "serving" else " (start-up included)"))
    return headline(rs, lambda r: (r.a, r.b), "")


def render_text(a: Run, b: Run) -> str:
    rs = all_rows(a, b)
    lines = ["otel-gpu-census diff", f"  A: {_describe(a)}", f"  B: {_describe(b)}", _headline(a, b, rs)[0],
             f"({UNITS_NOTE}; {NOT_MEASURED}: not measured by that run's collector)", ""]
    lines += _table(rs, lambda r: (r.a, r.b))
    if a.requests and b.requests:
        scope, prs, why = per_request_rows(a, b)
        head = (f"per request while serving (A: {a.requests:,}, B: {b.requests:,}; start-up left out):"
                if scope == "serving" else
                f"per request over the whole runs, start-up included (A: {a.requests:,}, B: {b.requests:,}; "
                f"start-up not told apart: {why}):")
        lines += ["", head]
        lines += _table(prs, lambda r: _per_request(r, a, b))
    return "\n".join(lines) + "\n"


def to_dict(a: Run, b: Run) -> dict:
    scope, prs, why = per_request_rows(a, b) if a.requests and b.requests else (None, [], None)
    per_row = {r.figure: r for r in prs}
    out_rows = []
    rs = all_rows(a, b)
    for r in rs:
        d = {"figure": r.figure, "unit": r.unit, "a": r.a, "b": r.b, "change": r.change}
        if not all(r.measured):
            d["not_measured"] = [side for side, m in zip("ab", r.measured) if not m]
        pr = per_row.get(r.figure)
        if pr is not None:
            pa, pb = _per_request(pr, a, b)
            d.update(a_per_request=pa, b_per_request=pb,
                     change_per_request=None if pa is None or pb is None else pb - pa)
        out_rows.append(d)
    side = lambda run: {"source": run.source, "processes": len(run.censuses), "requests": run.requests}  # noqa: E731
    return {"units": {"bytes": "exact", "time": "ns", "GB/s": "bytes per ns",
                      "per_request": "over each run's serving period (per_request_scope serving: by direction, "
                                     "no memory kind), else over the whole runs (whole_run, whole_run_because)"},
            "not_measured": "a null value with not_measured naming its side: that run's collector does not "
                            "measure the figure",
            "a": side(a), "b": side(b), "per_request_scope": scope, "whole_run_because": why,
            "headline": _headline(a, b, rs)[1], "rows": out_rows}


class RunError(Exception):
    pass


def load_run(path: str, requests: Optional[int] = None) -> Run:
    """A run from a census folder or one segment file; RunError (one line) when it has no segment."""
    from otel_gpu_census.census import folder, reader
    if os.path.isfile(path):
        try:
            return Run(path, [reader.read_segment(path)], requests)
        except reader.SegmentError as e:
            raise RunError(f"could not read {e.path}: {e.reason}") from None
    try:
        d = folder.readable_dir(path)
    except folder.CensusDirError as e:
        raise RunError(str(e)) from None
    censuses, errors = reader.scan(d)
    if errors:
        raise RunError(f"could not read {errors[0].path}: {errors[0].reason}")
    if not censuses:
        raise RunError(f"no census segment in {d}")
    return Run(str(d), censuses, requests)


def run_diff(args, say: Callable[[str], None]) -> int:
    """The CLI's `report --diff A B [--requests N|NA,NB] [--json]`: 0, or 1 after one line on stderr."""
    import json
    import sys
    if args.pid is not None or getattr(args, "request_log", None) or getattr(args, "sm_occupancy", None) is not None:
        say("--diff compares whole runs: --pid, --request-log and --sm-occupancy do not go with it")
        return 2
    if args.dir:
        say(f"--diff takes its two runs itself; drop the extra argument {args.dir!r}")
        return 2
    counts = args.requests if isinstance(args.requests, tuple) else (args.requests, args.requests)
    try:
        a, b = (load_run(p, n) for p, n in zip(args.diff, counts))
    except RunError as e:
        say(str(e))
        return 1
    if args.json:
        json.dump(to_dict(a, b), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render_text(a, b))
    sys.stdout.flush()
    return 0
