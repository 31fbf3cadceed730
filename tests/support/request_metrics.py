"""The request-level metrics the code emits, by the names Prometheus gives them: read off a real
MeterProvider after the proxy's instruments recorded one request."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Dict

UNIT_SUFFIX = {"By": "_bytes", "s": "_seconds"}


def emitted() -> Dict[str, SimpleNamespace]:
    """{otel name: (name, kind, unit, attributes)} of every metric point the request instruments made
    (the ones every integration records through telemetry.request)."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from otel_gpu_census.attribution import Share
    from otel_gpu_census.attribution.ledger import COMPLETE, GpuCost
    from otel_gpu_census.census import Stat
    from otel_gpu_census.telemetry.instruments import RequestInstruments

    mem = InMemoryMetricReader()
    inst = RequestInstruments(MeterProvider(metric_readers=[mem]))
    base = {"gen_ai.operation.name": "text_completion", "gen_ai.provider.name": "llama.cpp"}
    inst.started(base)
    inst.finished(dict(base, **{"gen_ai.request.model": "m"}), 1.0, 0.2, 0.01)
    share = Share(copies={"dtoh": Stat(1, 1000, 5), "htod": Stat(1, 10, 1)})
    inst.gpu(dict(base, **{"gen_ai.request.model": "m"}), GpuCost(status=COMPLETE, share=share))
    out = {}
    for rm in mem.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                kind = type(m.data).__name__
                attrs = set().union(*(p.attributes.keys() for p in m.data.data_points))
                name = m.name
                out[name] = SimpleNamespace(name=name, kind=kind, unit=m.unit, attributes=attrs)
    return out


def prometheus_names() -> Dict[str, SimpleNamespace]:
    """{prometheus series name: metric} as the OTel Prometheus exporters name them."""
    out = {}
    for m in emitted().values():
        base = m.name.replace(".", "_")
        suffix = UNIT_SUFFIX.get(m.unit, "")
        if not base.endswith(suffix):
            base += suffix
        if m.kind == "Histogram":
            for s in ("_bucket", "_sum", "_count"):
                out[base + s] = m
        elif m.kind == "Sum" and m.name not in ("gpu_census.requests.in_flight",):
            out[base + "_total"] = m
        else:
            out[base] = m
    return out
