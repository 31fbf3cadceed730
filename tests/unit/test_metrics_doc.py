"""docs/metrics.md's table and the code agree: every documented name is emitted, every emitted name
is documented, with the same instrument, unit and attributes.

Census names are checked against a real export (real segments, real reader, the SDK's in-memory
reader). NVML names cannot be emitted without a GPU: here they are checked against the specs the
NVML code registers from and the callbacks it has for them; tests/integration/test_metrics_nvml.py emits them
on a GPU. The request instruments are checked against what the one request lifecycle (telemetry.request,
which the proxy and the engine hooks use) records for a request that succeeds and one that fails.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import Gauge, Histogram, InMemoryMetricReader, Sum

from otel_gpu_census import census
from otel_gpu_census.attribution.ledger import COMPLETE, GpuCost
from otel_gpu_census.attribution.shares import Share
from otel_gpu_census.telemetry import census_metrics as metrics, nvml
from otel_gpu_census.telemetry.request import RequestTelemetry

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
KINDS = {"counter": "Counter", "gauge": "Gauge", "updowncounter": "UpDownCounter"}
MS = 1_000_000
T0 = 1_700_000_000_000_000_000


def doc_table():
    """{name: (instrument, unit, (attributes...))} from the one table whose header starts with Name."""
    rows, in_table = {}, False
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if cells and cells[0] == "Name":
            assert not rows, "docs/metrics.md must have one metrics table"
            assert cells == ["Name", "Instrument", "Unit", "Attributes", "Meaning"], cells
            in_table = True
            continue
        if not in_table:
            continue
        if cells is None:
            if rows:
                in_table = False
            continue
        if set(cells[0]) <= {"-", " "}:
            continue
        name = re.fullmatch(r"`([^`]+)`", cells[0])
        assert name, f"metric name not in backticks: {cells[0]!r}"
        unit = re.fullmatch(r"`([^`]+)`", cells[2])
        assert unit, f"unit not in backticks: {cells[2]!r}"
        attrs = tuple(re.findall(r"`([^`]+)`", cells[3]))
        assert name.group(1) not in rows, f"{name.group(1)} documented twice"
        rows[name.group(1)] = (cells[1], unit.group(1), attrs)
    assert rows, "no metrics table found in docs/metrics.md"
    return rows


def exported(census_dir):
    """{name: (instrument, unit, attribute keys)} as the census instruments actually export them."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    metrics.register_census_instruments(provider, metrics.segment_source(census_dir), min_refresh_s=0)
    out = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if isinstance(m.data, Sum):
                    kind = "Counter" if m.data.is_monotonic else "UpDownCounter"
                else:
                    assert isinstance(m.data, Gauge)
                    kind = "Gauge"
                keys = {tuple(sorted(dp.attributes)) for dp in m.data.data_points}
                assert len(keys) == 1, (m.name, keys)
                out[m.name] = (kind, m.unit, keys.pop())
    provider.shutdown()
    return out


@pytest.fixture
def busy_segment(segments, records, census_dir):
    """One segment with every kind of activity, so every census instrument has a data point."""
    r = records
    segments.segment(census_dir, [r.kernel(10, 20), r.memcpy("htod", 64, 30, 40, src="pinned"),
                                  r.memset(8, 50, 60), r.graph_trace(70, 80), r.peer(32, 90, 95, 0, 1)],
                     final=True, state=census.STATE_ACTIVE)
    return census_dir


def test_every_census_name_documented_and_emitted(busy_segment):
    doc = doc_table()
    got = exported(busy_segment)
    census_names = {s.name for s in metrics.CENSUS_INSTRUMENTS}
    assert set(got) == census_names, "the census exported names its spec table does not list (or missed some)"
    undocumented = set(got) - set(doc)
    assert not undocumented, f"emitted but not in docs/metrics.md: {sorted(undocumented)}"
    for name, (kind, unit, keys) in got.items():
        d_kind, d_unit, d_attrs = doc[name]
        assert (d_kind, d_unit, tuple(sorted(d_attrs))) == (kind, unit, keys), name


def request_exported():
    """{name: (instrument, unit, attribute keys over every point)} of two requests through the request
    lifecycle: one that succeeds with a model named and its GPU cost complete, one that fails."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    tel = RequestTelemetry(None, provider, provider_name="llama.cpp")
    ok = tel.start(start_ns=T0, operation="chat", span_name="chat", model="m", tenant="team-a")
    ok.first_token(T0 + 40 * MS)
    share = Share(kernel_count=7, kernel_ns=30 * MS, copies={"htod": census.Stat(2, 4096, MS),
                                                            "dtoh": census.Stat(1, 1000, MS)})
    ok.finish(T0 + 240 * MS, output_tokens=21, cost=GpuCost(status=COMPLETE, share=share, window=share, buckets=3,
                                                            kernel_tracing=["all"], kernel_traced_ns=100 * MS,
                                                            kernel_span_ns=100 * MS),
              kv_offload=Share(copies={"dtoh": census.Stat(1, 1000, MS)}))
    bad = tel.start(start_ns=T0, operation="chat", span_name="chat")
    bad.finish(T0 + 10 * MS, error_type="500")
    open_ = tel.start(start_ns=T0, operation="chat", span_name="chat")      # in flight at the collection
    out = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                kind = ("Histogram" if isinstance(m.data, Histogram) else
                        "Counter" if m.data.is_monotonic else "UpDownCounter")
                keys = set().union(*(set(dp.attributes) for dp in m.data.data_points))
                out[m.name] = (kind, m.unit, tuple(sorted(keys)))
    open_.finish(T0 + 20 * MS)
    provider.shutdown()
    return out


def test_every_request_instrument_documented_as_recorded():
    doc = doc_table()
    got = request_exported()
    assert set(got) == {"gen_ai.server.time_to_first_token", "gen_ai.server.request.duration",
                        "gen_ai.server.time_per_output_token", "gpu_census.requests.in_flight",
                        "gpu_census.request.copy.size", "gpu_census.request.kernel.time",
                        "gpu_census.chargeback.requests", "gpu_census.chargeback.kernel.count",
                        "gpu_census.chargeback.kernel.time", "gpu_census.chargeback.copy.size",
                        "gpu_census.chargeback.kv_offload.size"}
    for name, (kind, unit, keys) in got.items():
        assert name in doc, f"recorded but not in docs/metrics.md: {name}"
        d_kind, d_unit, d_attrs = doc[name]
        assert (d_kind, d_unit, tuple(sorted(d_attrs))) == (kind, unit, keys), name


def test_every_documented_name_comes_from_the_code():
    doc = doc_table()
    census_names = {s.name for s in metrics.CENSUS_INSTRUMENTS}
    nvml_specs = {s.name: s for s in nvml.NVML_INSTRUMENTS}
    assert not (census_names & set(nvml_specs))
    stray = set(doc) - census_names - set(nvml_specs) - set(request_exported())
    assert not stray, f"documented but emitted by nothing: {sorted(stray)}"
    missing = set(nvml_specs) - set(doc)
    assert not missing, f"NVML instruments not documented: {sorted(missing)}"
    for name, spec in nvml_specs.items():
        assert doc[name] == (KINDS[spec.instrument], spec.unit, spec.attributes), name
    for spec in metrics.CENSUS_INSTRUMENTS:
        assert doc[spec.name] == (KINDS[spec.instrument], spec.unit, spec.attributes), spec.name


def test_nvml_code_registers_every_documented_nvml_name():
    """Each NVML spec has a callback, and registration walks the specs (GPM ones when a GPU has GPM)."""
    sampler = nvml.NvmlSampler(nvml=None, devices=[], driver="")
    assert set(sampler.callbacks()) == {s.name for s in nvml.NVML_INSTRUMENTS}
    assert sampler.specs() == nvml.BASE_INSTRUMENTS          # no GPU here has GPM
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    assert sampler.register(provider) == [s.name for s in nvml.BASE_INSTRUMENTS]
    provider.shutdown()
