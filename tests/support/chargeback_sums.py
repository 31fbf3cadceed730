"""The chargeback sums every engine's and the proxy's tests check, once: per tenant (and per model) the
chargeback counters equal the sum of their requests' span shares, the request log's `report --by` rows equal
the sum of its lines, and the rows plus what is unattributed equal the census, every integer exactly."""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, Iterable, Tuple

from otel_gpu_census.census import DIRECTIONS

INTS = ("kernel.count",) + tuple(f"copy.{d}.bytes" for d in DIRECTIONS)


def span_sums(spans: Iterable, key: str = "gpu_census.tenant") -> Dict[str, Dict[str, float]]:
    """{tenant (or model): {figure: sum over its spans}}; kernel.time_ns from the spans' seconds."""
    out: Dict[str, Dict[str, float]] = defaultdict(lambda: defaultdict(int))
    for s in spans:
        a = s.attributes
        if "gpu_census.kernel.count" not in a:
            continue
        who = a.get(key, "unknown")
        for f in INTS:
            out[who][f] += a.get("gpu_census." + f, 0)
        out[who]["kernel.time_ns"] += round(a["gpu_census.kernel.time"] * 1e9)
        out[who]["requests"] += 1
    return {k: dict(v) for k, v in out.items()}


def collected(reader):
    """The reader's one collection (exemplars come with the first collection after the measurements only)."""
    if not hasattr(reader, "chargeback_data"):
        reader.chargeback_data = reader.get_metrics_data()
    return reader.chargeback_data


def metric_sums(reader, key: str = "gpu_census.tenant") -> Dict[str, Dict[str, float]]:
    """{tenant (or model): {figure: the chargeback counters' value}} from an InMemoryMetricReader."""
    out: Dict[str, Dict[str, float]] = defaultdict(lambda: defaultdict(int))
    for rm in collected(reader).resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if not m.name.startswith("gpu_census.chargeback."):
                    continue
                assert m.data.is_monotonic, m.name
                for dp in m.data.data_points:
                    who = dp.attributes[key]
                    name = m.name[len("gpu_census.chargeback."):]
                    if name == "copy.size":
                        out[who][f"copy.{dp.attributes['gpu_census.copy.direction']}.bytes"] += dp.value
                    elif name == "kernel.time":
                        out[who]["kernel.time_s"] += dp.value
                    elif name == "kv_offload.size":
                        out[who]["kv.bytes"] += dp.value
                    else:
                        out[who][name] += dp.value
    return {k: dict(v) for k, v in out.items()}


def check_metrics_equal_spans(spans, reader, key: str = "gpu_census.tenant") -> Dict[str, Dict[str, float]]:
    """Each tenant's chargeback counters = the sum of its requests' span shares (integers exactly, kernel
    time to the float's precision), their exemplars the request spans'. The span sums."""
    by_span, by_metric = span_sums(spans, key), metric_sums(reader, key)
    assert set(by_span) == set(by_metric), (sorted(by_span), sorted(by_metric))
    for who, s in by_span.items():
        m = by_metric[who]
        assert m["requests"] == s["requests"], who
        for f in INTS:
            assert m.get(f, 0) == s[f], (who, f)
            assert isinstance(m.get(f, 0), int), (who, f)
        assert abs(m["kernel.time_s"] - s["kernel.time_ns"] / 1e9) <= 1e-9 * max(1.0, m["kernel.time_s"]), who
    exemplars = {e.span_id for rm in collected(reader).resource_metrics for sm in rm.scope_metrics
                 for m in sm.metrics if m.name.startswith("gpu_census.chargeback.")
                 for dp in m.data.data_points for e in dp.exemplars}
    assert exemplars and exemplars <= {sp.context.span_id for sp in spans}      # they point at request spans
    return by_span


def check_report(log_paths, census_rows, by: str = "tenant", spans=None) -> Tuple[object, Dict[str, Dict[str, int]]]:
    """`report --by` over the engines' request logs: its rows are the sums of the log lines (and of the spans,
    where given), and rows + unattributed == the steps' total == `census_rows` summed (census rows:
    Share.as_row() of every step the census counted), every figure exactly. The table."""
    from otel_gpu_census.attribution.shares import Share
    from otel_gpu_census.report import chargeback, engine_requests
    logs = [engine_requests.read(str(p)) for p in log_paths]
    cb = chargeback.build(logs, by)
    assert cb.summarised and cb.missing is None, cb.notes
    lines: Dict[str, Dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for log in logs:
        for r in log.requests:
            who = (r.tenant if by == "tenant" else r.model) or "unknown"
            for f, v in zip(engine_requests.FIELDS, r.gpu):
                lines[who][f] += v
            lines[who]["requests"] += 1
    rows = {x.name: x for x in cb.rows}
    assert set(rows) == set(lines)
    for who, x in rows.items():
        assert x.requests == lines[who]["requests"]
        for f in engine_requests.FIELDS:
            assert x.figures[f] == lines[who][f], (who, f)
    if spans is not None:
        key = "gpu_census.tenant" if by == "tenant" else "gen_ai.request.model"
        for who, s in span_sums(spans, key).items():
            for f in INTS + ("kernel.time_ns",):
                assert rows[who].figures[f] == s[f], (who, f)
    census = Share.from_row([sum(c) for c in zip(*census_rows)])
    want = {"kernel.count": census.kernel_count, "kernel.time_ns": census.kernel_ns,
            **{f"copy.{d}.bytes": census.copy(d).bytes for d in DIRECTIONS}, "memset.bytes": census.memset.bytes}
    for f, v in want.items():
        assert cb.steps.figures[f] == v, f
        assert sum(x.figures[f] for x in cb.rows) + cb.unattributed.figures[f] == v, f
    return cb, {k: dict(v) for k, v in lines.items()}
