"""The sidecar's own instruments (census and NVML, all observable) carry no exemplar reservoir
(``sidecar.own_views``): the SDK's default one costs work at every collection for series that can
never hold an exemplar. Other instruments on the same provider (the proxy's under ``run --proxy``,
recorded inside spans) keep theirs."""
from __future__ import annotations

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider

from otel_gpu_census.telemetry import nvml, sidecar
from otel_gpu_census.telemetry.census_metrics import CENSUS_INSTRUMENTS
from otel_gpu_census.telemetry.specs import METER_NAME


def test_one_view_per_own_instrument_on_its_own_meter():
    got = {(v._meter_name, v._instrument_name) for v in sidecar.own_views()}
    want = {(METER_NAME, s.name) for s in CENSUS_INSTRUMENTS} | \
        {(METER_NAME + ".nvml", s.name) for s in nvml.NVML_INSTRUMENTS}
    assert got == want


def _exemplars(reader):
    out = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out[(sm.scope.name, m.name)] = sum(len(dp.exemplars) for dp in m.data.data_points)
    return out


def test_own_instruments_keep_no_exemplars_others_do():
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], views=sidecar.own_views())
    tracer = TracerProvider().get_tracer("t")
    # an instrument named like a census one, recorded inside a sampled span: the default reservoir
    # would keep an exemplar; the sidecar's view keeps none
    own = provider.get_meter(METER_NAME).create_counter("gpu_census.kernel.count")
    same_name_other_meter = provider.get_meter("otel_gpu_census.proxy").create_counter("gpu_census.kernel.count")
    proxy = provider.get_meter(METER_NAME).create_histogram("gen_ai.server.request.duration", unit="s")
    with tracer.start_as_current_span("request"):
        own.add(3, {"hw.id": "GPU-0"})
        same_name_other_meter.add(1)
        proxy.record(0.5, {"gen_ai.operation.name": "chat"})
    got = _exemplars(reader)
    assert got[(METER_NAME, "gpu_census.kernel.count")] == 0
    assert got[("otel_gpu_census.proxy", "gpu_census.kernel.count")] == 1
    assert got[(METER_NAME, "gen_ai.server.request.duration")] == 1
