"""`report --by tenant|model`: each tenant's (or model's) share of the GPU work, without a metrics backend.

Read from the request logs the vLLM and SGLang integrations write beside each engine process's segment
(engine_requests.py): each line is one request's share of the steps that served it, with its ``tenant`` and
``model`` (the LoRA adapter's name where one served it); the log's last line is the ledger's summary, with
``total`` (every step's kernels and copies) and ``unattributed`` (the steps' work no request was in).

The table has a row per tenant (or model; a line without one: ``unknown``), then ``unattributed``, then the
``steps`` total, which the rows above add up to exactly (integers: kernel counts, kernel ns, bytes) wherever
every request has its line; where they do not (requests dropped with their settling process, a log read only
in part) the difference has a row of its own, never hidden. Below, ``outside steps``: what the segment
counted beyond the steps (start-up, graph capture, work between steps): counts and bytes, exact; its kernel
time is not split (the census prices it over the process's life, the steps each by their own sample).

Kernel times under counted kernels (the default collector) are estimates; ``estimated`` says how many of a row's
requests have one, ``partial`` how many know they miss work. At most MAX_ROWS rows; the rest are one row.

The proxy writes no request log: its spans are its record. With ``--request-log FILE`` (OTLP JSON, as the
Collector's file exporter writes it) :func:`from_spans` makes the same table from the spans that carry a GPU share
(each its share of the time windows it was in flight in), then ``rest of the census``: the segments' counts and
bytes less the rows' (the work while no request was in flight, and that of any request whose span is not in the
file); kernel time is not split there (the census prices it over each process's life, the spans per window).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from otel_gpu_census.census import DIRECTIONS
from otel_gpu_census.report import engine_requests as er
from otel_gpu_census.telemetry.redact import printable

UNKNOWN = "unknown"
UNATTRIBUTED = "unattributed"
STEPS = "steps (census)"
REST, CENSUS = "rest of the census", "census"
MISSING = "not in any request line"
OUTSIDE = "outside steps"
OTHERS = "_OTHER"
MAX_ROWS = 50
# the figures added up, as the request lines and the summary name them
FIGURES = ("kernel.count", "kernel.time_ns") + tuple(f"copy.{d}.bytes" for d in DIRECTIONS) + ("memset.bytes",)
KV = "kv_offload.bytes"


@dataclass
class Row:
    name: str
    requests: int = 0
    figures: Dict[str, int] = field(default_factory=lambda: dict.fromkeys(FIGURES + (KV,), 0))
    estimated: int = 0
    partial: int = 0

    def add(self, values: Dict[str, int]) -> None:
        for k, v in values.items():
            self.figures[k] = self.figures.get(k, 0) + v


@dataclass
class Chargeback:
    by: str
    rows: List[Row]              # tenants (or models), largest kernel time first
    unattributed: Row
    steps: Row                   # the summaries' total: the rows above add up to it
    missing: Optional[Row]       # steps - (rows + unattributed), where not all zero
    outside: Optional[Row]       # the segments' totals beyond the steps (counts and bytes)
    logs: int
    notes: List[str]
    summarised: bool = True      # every log has its summary: the steps' total is known
    spans: bool = False          # from a request log's spans (from_spans), not the engines' logs


def _request_figures(r: er.Request) -> Dict[str, int]:
    out = dict(zip(er.FIELDS, r.gpu))
    for k, v in (r.more or {}).items():
        if k in er.KV:
            out[KV] = out.get(KV, 0) + v
        else:
            out[k] = v
    return {k: out.get(k, 0) for k in FIGURES + (KV,)}


def _summary_figures(part) -> Dict[str, int]:
    """A summary's share_attributes dict as FIGURES (0 where absent; a non-integer: ValueError)."""
    part = part if isinstance(part, dict) else {}
    return {k: er._whole(part.get(k)) for k in FIGURES}


def build(logs: Sequence[er.EngineRequests], by: str, segments: Sequence = ()) -> Chargeback:
    """The table over `logs` (one per engine process), keyed by `by` (tenant | model); `segments`: those
    processes' censuses (ProcessCensus), for the row outside the steps."""
    unattributed, steps = Row(UNATTRIBUTED), Row(STEPS)
    notes: List[str] = []
    summarised = 0
    ordered = _rows(((r.tenant, r.model, _request_figures(r), r.estimated, r.status in ("partial", "stale"))
                     for log in logs for r in log.requests), by, notes)
    for log in logs:
        summary = log.summary or {}
        try:
            total, unattr = _summary_figures(summary.get("total")), _summary_figures(summary.get("unattributed"))
            kv = er._whole((summary.get("kv_total") or {}).get("copy.htod.bytes")) + \
                er._whole((summary.get("kv_total") or {}).get("copy.dtoh.bytes"))
        except (ValueError, AttributeError):
            notes.append(f"{printable(log.path)}: its summary is not one of ours; its requests are counted, "
                         "its steps are not")
            continue
        if not summary:
            notes.append(f"{printable(log.path)}: no summary yet (the engine still runs, or was killed): its "
                         "requests are counted, its steps' total is not known")
            continue
        summarised += 1
        unattributed.add(unattr)
        steps.add(dict(total, **{KV: kv}))
        if log.unread:
            notes.append(f"{printable(log.path)}: {log.unread}")
    missing = None
    if summarised == len(logs) and logs:
        diff = {k: steps.figures[k] - unattributed.figures[k] - sum(x.figures[k] for x in ordered) for k in FIGURES}
        if any(diff.values()):
            missing = Row(MISSING, figures=dict(diff, **{KV: 0}))
            notes.append("the request lines do not add up to the steps: requests settled without a line (dropped "
                         "with their settling process, past the log's bound) or a log read in part")
    whole = bool(logs) and summarised == len(logs)
    outside = _outside(segments, steps) if whole else None
    if outside is not None and any(v < 0 for v in outside.figures.values()):
        notes.append("the segments counted less than their steps (read at another moment than the logs' summaries): "
                     "no row outside the steps")
        outside = None
    return Chargeback(by, ordered, unattributed, steps, missing, outside, len(logs), notes, whole)


def _rows(items, by: str, notes: List[str]) -> List[Row]:
    """Rows from (tenant, model, figures, estimated, partial) of each request, largest kernel time first."""
    rows: Dict[str, Row] = {}
    for tenant, model, figures, estimated, partial in items:
        key = (tenant if by == "tenant" else model) or UNKNOWN
        row = rows.get(key)
        if row is None:
            row = rows[key] = Row(key)
        row.requests += 1
        row.add(figures)
        row.estimated += estimated
        row.partial += partial
    ordered = sorted(rows.values(), key=lambda x: (-x.figures["kernel.time_ns"], -x.requests, x.name))
    if len(ordered) > MAX_ROWS:
        rest = Row(OTHERS)
        for x in ordered[MAX_ROWS - 1:]:
            rest.requests += x.requests
            rest.add(x.figures)
            rest.estimated += x.estimated
            rest.partial += x.partial
        notes.append(f"{len(ordered) - MAX_ROWS + 1:,} {by}s with the least kernel time are one row, {OTHERS}")
        ordered = ordered[:MAX_ROWS - 1] + [rest]
    return ordered


def from_spans(records: Sequence, by: str, segments: Sequence = ()) -> Optional[Chargeback]:
    """The table over a request log's spans that carry a GPU share (request_log.Charge), against the census of
    `segments`; None when none has one."""
    charged = [r.charge for r in records if getattr(r, "charge", None) is not None]
    if not charged:
        return None
    notes: List[str] = []
    rows = _rows(((c.tenant, c.model, dict(c.figures), c.estimated, c.status in ("partial", "stale")) for c in charged),
                 by, notes)
    census = _totals(segments)
    census.name = CENSUS
    rest = Row(REST, figures={k: census.figures[k] - sum(x.figures[k] for x in rows) for k in census.figures})
    rest.figures["kernel.time_ns"] = 0
    if any(v < 0 for v in rest.figures.values()):
        notes.append("the spans hold more than these segments counted (another run's spans, or other processes "
                     "than these segments'): no rest of the census")
        rest = None
    return Chargeback(by, rows, rest, census, None, None, len(charged), notes, rest is not None, spans=True)


def _totals(segments: Sequence) -> Row:
    """The segments' kernel count, kernel time (each device's total) and bytes."""
    total = dict.fromkeys(FIGURES + (KV,), 0)
    for c in segments:
        for dev in c.devices.values():
            total["kernel.count"] += dev.kernel_count
            total["kernel.time_ns"] += dev.kernel_ns
            for d, st in dev.copies.by_direction().items():
                if f"copy.{d}.bytes" in total:
                    total[f"copy.{d}.bytes"] += st.bytes
            total["memset.bytes"] += dev.memset.bytes
    return Row(STEPS, figures=total)


def _outside(segments: Sequence, steps: Row) -> Optional[Row]:
    """What the segments counted beyond their steps: kernel count and bytes (kernel time left at 0: not split)."""
    if not segments:
        return None
    total = _totals(segments).figures
    out = {k: total[k] - steps.figures[k] for k in FIGURES if k != "kernel.time_ns"}
    return Row(OUTSIDE, figures=dict(out, **{"kernel.time_ns": 0, KV: 0}))


def to_dict(cb: Chargeback) -> dict:
    def row(x: Row) -> dict:
        return {"name": x.name, "requests": x.requests, "estimated": x.estimated, "partial": x.partial,
                **{k: v for k, v in x.figures.items()}}
    out = {"by": cb.by, "source": "spans" if cb.spans else "engines", "rows": [row(x) for x in cb.rows],
           "logs" if not cb.spans else "spans": cb.logs, "notes": cb.notes,
           "conserved": cb.missing is None and cb.summarised}
    if cb.unattributed is not None:
        out["rest" if cb.spans else "unattributed"] = row(cb.unattributed)
    out["census" if cb.spans else "steps"] = row(cb.steps)
    if cb.missing is not None:
        out["missing"] = row(cb.missing)
    if cb.outside is not None:
        out["outside_steps"] = row(cb.outside)
    return out


def _bytes(n: int) -> str:
    return f"{n:,}"


def render_text(cb: Chargeback) -> str:
    if not cb.logs:
        return ("no engine request log (gpu-census-*.requests.jsonl) beside these segments: `report --by` reads the "
                "vLLM and SGLang integrations' logs (the proxy's spans: --request-log FILE)\n")
    kt = cb.steps.figures["kernel.time_ns"] or sum(x.figures["kernel.time_ns"] for x in cb.rows) or 1
    head = (f"{cb.by:<28} {'requests':>9} {'kernel s':>11} {'share':>6} {'kernels':>12} {'htod bytes':>16} "
            f"{'dtoh bytes':>16} {'other bytes':>14} {'KV offload':>14}  notes")
    if cb.spans:
        first = (f"GPU work by {cb.by} from the request log's spans ({cb.logs} with a GPU share; a row is the sum of "
                 "its requests' shares of the time windows they were in flight in; integers exact)")
    else:
        first = (f"GPU work by {cb.by} ({cb.logs} engine request log{'s' if cb.logs != 1 else ''}; a row is the sum "
                 "of its requests' shares of the engine's steps; integers exact)")
    lines = [first, head]
    totals = (UNATTRIBUTED, STEPS, MISSING, OUTSIDE, REST, CENSUS)

    def line(x: Row, share: bool = True) -> str:
        f = x.figures
        other = sum(f[k] for k in FIGURES if k.endswith(".bytes") and k not in ("copy.htod.bytes", "copy.dtoh.bytes"))
        note = []
        if x.estimated:
            note.append(f"{x.estimated} estimated")
        if x.partial:
            note.append(f"{x.partial} partial")
        name = printable(x.name if len(x.name) <= 28 else x.name[:27] + "…")
        pct = f"{100 * f['kernel.time_ns'] / kt:5.1f}%" if share else "     -"
        req = f"{x.requests:>9,}" if x.requests or x.name not in totals else " " * 9
        kernel_s = f"{f['kernel.time_ns'] / 1e9:>11.6f}" if share else f"{'-':>11}"
        return (f"{name:<28} {req} {kernel_s} {pct} {f['kernel.count']:>12,} "
                f"{_bytes(f['copy.htod.bytes']):>16} {_bytes(f['copy.dtoh.bytes']):>16} {_bytes(other):>14} "
                f"{_bytes(f[KV]):>14}  {', '.join(note)}").rstrip()
    lines += [line(x) for x in cb.rows]
    if cb.unattributed is not None:
        lines.append(line(cb.unattributed, share=not cb.spans))
    if cb.missing is not None:
        lines.append(line(cb.missing))
    lines.append(line(cb.steps))
    if cb.spans and cb.summarised:
        lines.append(f"the {cb.by}s and the rest add up to the census's kernel count and every byte (the rest: work "
                     "while no request was in flight, and any request whose span is not in the file)")
    elif cb.missing is None and cb.summarised:
        lines.append(f"the {cb.by}s and unattributed add up to the steps exactly (kernel count, kernel ns, every "
                     "byte)")
    if cb.outside is not None:
        lines.append(line(cb.outside, share=False) + "  start-up, graph capture, work between steps: nobody's")
    lines += cb.notes
    return "\n".join(lines) + "\n"
