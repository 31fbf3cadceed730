"""GPU cost per tenant and per model (LoRA adapter): who a request belongs to (telemetry/tenant.py), the
chargeback counters (telemetry/instruments.py), the request log's tenant and model, and `report --by`
(report/chargeback.py), which add up to the census exactly."""
from __future__ import annotations

import json
import logging
import random
import tracemalloc
from types import SimpleNamespace

import pytest

from otel_gpu_census.attribution.ledger import COMPLETE, PARTIAL, STALE, GpuCost
from otel_gpu_census.attribution.shares import Share
from otel_gpu_census.census import Stat, Step
from otel_gpu_census.report import chargeback, engine_requests
from otel_gpu_census.telemetry import tenant
from otel_gpu_census.telemetry.instruments import TENANT_LABELS, RequestInstruments

from chargeback_sums import check_metrics_equal_spans, check_report, metric_sums  # tests/support
from engine_standins import Census, Clock, in_memory_providers  # tests/support

MS = 1_000_000


# -- who a request belongs to ---------------------------------------------------------------------------

def test_the_tenant_comes_from_the_documented_baggage_key_or_the_configured_header():
    src = tenant.source({})
    assert src == tenant.Source(header="", baggage=True)
    assert tenant.of_headers({"baggage": "userId=7, gpu_census.tenant=team%20a;prop=1"}, src) == "team a"
    assert tenant.of_headers({"Baggage": "gpu_census.tenant=b"}, src) == "b"            # any case of the name
    assert tenant.of_headers({"baggage": "other=1"}, src) is None
    assert tenant.of_headers({"x-tenant-id": "acme"}, src) is None                      # no header configured
    both = tenant.source({tenant.TENANT_ENV: "header:X-Tenant-Id,baggage"})
    assert both == tenant.Source(header="x-tenant-id", baggage=True)
    assert tenant.of_headers({"x-tenant-id": "acme", "baggage": "gpu_census.tenant=b"}, both) == "acme"
    assert tenant.of_headers({"baggage": "gpu_census.tenant=b"}, both) == "b"
    only = tenant.source({tenant.TENANT_ENV: "header:x-tenant-id"})
    assert tenant.of_headers({"baggage": "gpu_census.tenant=b"}, only) is None           # baggage turned off
    off = tenant.source({tenant.TENANT_ENV: "off"})
    assert off.off and tenant.of_headers({"baggage": "gpu_census.tenant=b", "x-tenant-id": "a"}, off) is None
    # pairs (an ASGI scope's headers) and a multidict read alike
    from multidict import CIMultiDict
    assert tenant.of_headers(CIMultiDict([("X-Tenant-Id", "m")]), both) == "m"
    assert tenant.of_headers([("x-tenant-id", "p")], both) == "p"


@pytest.mark.parametrize("value", ["on", "header:", "header:a b", "baggage,header:x,header:y", "off,baggage"])
def test_a_tenant_setting_it_cannot_read_says_so_once_and_reads_baggage(value, caplog):
    with caplog.at_level(logging.WARNING):
        assert tenant.source({tenant.TENANT_ENV: value}) == tenant.DEFAULT
    assert [r.getMessage() for r in caplog.records if tenant.TENANT_ENV in r.getMessage()][0].startswith(
        f"{tenant.TENANT_ENV}=")


def test_a_credential_is_never_a_tenant_it_is_hashed():
    src = tenant.source({tenant.TENANT_ENV: "header:authorization"})
    got = tenant.of_headers({"authorization": "Bearer sk-live-123"}, src)
    assert got.startswith("sha256:") and len(got) == len("sha256:") + 16 and "sk-live" not in got
    assert tenant.of_headers({"authorization": "Bearer sk-live-123"}, src) == got         # the same key, the same id
    assert tenant.of_headers({"authorization": "Bearer sk-live-124"}, src) != got
    key = tenant.source({tenant.TENANT_ENV: "header:x-api-key"})
    assert tenant.of_headers({"x-api-key": "plainvalue"}, key).startswith("sha256:")
    # a key that looks like one, wherever it came from
    assert tenant.of_headers({"baggage": "gpu_census.tenant=sk-abc123"}, tenant.DEFAULT).startswith("sha256:")


def test_a_hostile_tenant_is_cut_escaped_or_dropped_never_a_crash():
    big = "t" * 10_240
    src = tenant.source({tenant.TENANT_ENV: "header:x-tenant"})
    got = tenant.of_headers({"x-tenant": big}, src)
    assert got == "t" * tenant.TENANT_CHARS + "…"
    esc = tenant.of_headers({"x-tenant": "a\x1b[31mb\nc\u202e"}, src)
    assert esc.isprintable() and "\\x1b" in esc and "\\u202e" in esc
    # baggage past the W3C limits is not read at all (the proxy drops it whole)
    assert tenant.of_headers({"baggage": "gpu_census.tenant=" + "x" * 9000}, tenant.DEFAULT) is None
    assert tenant.of_headers({"baggage": ",".join(["a=1"] * 200) + ",gpu_census.tenant=z"}, tenant.DEFAULT) is None
    assert tenant.of_headers({"baggage": "gpu_census.tenant=%1b%5b2J"}, tenant.DEFAULT) == "\\x1b[2J"
    assert tenant.of_headers({"baggage": "gpu_census.tenant=   "}, tenant.DEFAULT) is None
    assert tenant.of_headers(object(), tenant.DEFAULT) is None                            # never raises
    assert tenant.of_headers({"baggage": 5}, tenant.DEFAULT) is None


def test_a_hundred_thousand_tenants_make_a_bounded_number_of_series_in_bounded_memory(caplog):
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    reader = InMemoryMetricReader()
    inst = RequestInstruments(MeterProvider(metric_readers=[reader]))
    base = {"gen_ai.operation.name": "chat", "gen_ai.provider.name": "vllm", "gen_ai.request.model": "m"}
    cost = GpuCost(status=COMPLETE, share=Share(kernel_count=1, kernel_ns=10, copies={"htod": Stat(1, 3, 1)}))
    inst.chargeback(base, "warm-up", cost)
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    with caplog.at_level(logging.WARNING):
        for i in range(100_000):
            inst.chargeback(base, f"tenant-{i}", cost)
    grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename"))
    tracemalloc.stop()
    assert grown < 2 << 20, grown              # labels capped: no per-tenant state past the cap
    points = metric_sums(reader)
    assert len(points) == TENANT_LABELS + 1 and points["_OTHER"]["requests"] == 100_000 + 1 - TENANT_LABELS
    assert sum(p["requests"] for p in points.values()) == 100_001
    assert sum(p["copy.htod.bytes"] for p in points.values()) == 3 * 100_001
    said = [r.getMessage() for r in caplog.records if "_OTHER" in r.getMessage()]
    assert len(said) == 1 and f"more than {TENANT_LABELS} tenants" in said[0]


def test_requests_without_a_tenant_are_unknown_said_once_and_statuses_stay_apart(caplog):
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    reader = InMemoryMetricReader()
    inst = RequestInstruments(MeterProvider(metric_readers=[reader]))
    base = {"gen_ai.operation.name": "chat", "gen_ai.provider.name": "vllm"}
    share = Share(kernel_count=2, kernel_ns=10, copies={"dtoh": Stat(1, 5, 1)})
    with caplog.at_level(logging.WARNING):
        for status in (COMPLETE, PARTIAL, PARTIAL, "no_census"):
            inst.chargeback(base, None, GpuCost(status=status, share=share))
    assert sum("gpu_census.tenant=unknown" in r.getMessage() for r in caplog.records) == 1
    by_status = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for dp in m.data.data_points:
                    assert dp.attributes["gpu_census.tenant"] == "unknown"
                    by_status[(m.name, dp.attributes["gpu_census.attribution.status"])] = dp.value
    assert by_status[("gpu_census.chargeback.requests", "partial")] == 2
    assert by_status[("gpu_census.chargeback.requests", "no_census")] == 1     # counted, no figures
    assert by_status[("gpu_census.chargeback.copy.size", "partial")] == 10
    assert ("gpu_census.chargeback.copy.size", "no_census") not in by_status


def test_sampled_kernels_give_no_kernel_points_and_counted_ones_say_estimated():
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    reader = InMemoryMetricReader()
    inst = RequestInstruments(MeterProvider(metric_readers=[reader]))
    share = Share(kernel_count=4, kernel_ns=400, copies={"htod": Stat(1, 8, 1)})
    inst.chargeback({}, "s", GpuCost(status=COMPLETE, share=share, kernel_tracing=["100/1000"],
                                     kernel_traced_ns=1, kernel_span_ns=10))
    inst.chargeback({}, "c", GpuCost(status=COMPLETE, share=share, kernel_tracing=["counted:100/1000"],
                                     kernel_counted=True, kernel_priced=(400, 3)))   # 3 launches unpriced
    names = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for dp in m.data.data_points:
                    names.setdefault(dp.attributes["gpu_census.tenant"], {})[m.name] = dict(dp.attributes)
    assert "gpu_census.chargeback.kernel.count" not in names["s"] and "gpu_census.chargeback.copy.size" in names["s"]
    assert names["c"]["gpu_census.chargeback.kernel.time"]["gpu_census.kernel.time_estimated"] is True


# -- an engine's load: three tenants, two adapters -----------------------------------------------------

TENANTS = ("team-a", "team-b", "team-c")
ADAPTERS = ("sql-lora", "chat-lora")


def engine_load(eng, census, clock, seed=59, n=24):
    """Requests of three tenants (and some without one) on two adapters, stepped together: random tokens, random
    kernels and bytes per step, and steps that served nobody. The census's step rows."""
    rnd = random.Random(seed)
    live = []
    started = 0
    for k in range(60):
        if started < n and rnd.random() < 0.6:
            key = f"r{started}"
            who = TENANTS[started % 3] if started % 7 else None
            eng.start_request(key, start_ns=clock.t, operation="chat", model=ADAPTERS[started % 2],
                              headers={}, attributes={}, prompt_tokens=10, tenant=who)
            live.append(key)
            started += 1
        tokens = {r: rnd.randint(1, 50) for r in live} if k % 9 else {}      # every 9th: nobody's step
        sid = eng.open_step(tokens)
        census.steps[sid] = Step(id=sid, kernel_count=rnd.randint(1, 500), kernel_ns=rnd.randint(1, 10**7),
                                 copies={"htod": Stat(2, rnd.randint(0, 10**6), 10),
                                         "dtoh": Stat(1, rnd.randint(0, 10**5), 10),
                                         "dtod": Stat(1, rnd.randint(0, 999), 10)}, memset=Stat(1, rnd.randint(0, 99), 1))
        clock.t += 10 * MS
        eng.end_step(sid)
        for r in list(live):
            eng.first_token(r, clock.t)
            if rnd.random() < 0.15:
                eng.request_done(r, {"gen_ai.usage.output_tokens": 3})
                live.remove(r)
    for r in live:
        eng.request_done(r, {"gen_ai.usage.output_tokens": 3})
    return [Share(s.kernel_count, s.kernel_ns, dict(s.copies), s.memset).as_row() for s in census.steps.values()]


def test_an_engines_tenants_and_adapters_add_up_to_their_requests_and_the_census_exactly(tagged, tmp_path):
    from otel_gpu_census.integrations.engine.steps import StepEngine
    from otel_gpu_census.telemetry.request import RequestTelemetry
    tp, mp, spans, reader = in_memory_providers()
    rt = RequestTelemetry(tp, mp, provider_name="vllm")
    census, clock = Census(), Clock()
    eng = StepEngine(telemetry=rt, read=census.read, clock=clock, settle_period_s=3600)
    seg = tmp_path / "gpu-census-9-9.seg"
    eng.log_segment = lambda: str(seg)
    rows = engine_load(eng, census, clock)
    census.complete = clock.t + 10**9
    eng.settle()
    eng.shutdown(timeout_s=0.5)
    done = spans.get_finished_spans()
    assert len(done) == 24
    assert {s.attributes.get("gpu_census.tenant", "unknown") for s in done} == set(TENANTS) | {"unknown"}
    by_tenant = check_metrics_equal_spans(done, reader)
    check_metrics_equal_spans(done, reader, key="gen_ai.request.model")
    assert set(by_tenant) == set(TENANTS) | {"unknown"}
    log = seg.with_suffix(".requests.jsonl")
    cb, lines = check_report([log], rows, "tenant", spans=done)
    assert cb.unattributed.figures["kernel.count"] > 0          # the steps nobody was in
    cbm, _ = check_report([log], rows, "model", spans=done)
    assert {x.name for x in cbm.rows} == set(ADAPTERS)
    text = chargeback.render_text(cb)
    assert "team-a" in text and "unattributed" in text and "add up to the steps exactly" in text
    assert json.loads(json.dumps(chargeback.to_dict(cb)))["conserved"] is True


def test_a_log_missing_lines_or_its_summary_says_so_never_claims_the_sums(tagged, tmp_path):
    from otel_gpu_census.integrations.engine.steps import StepEngine
    from engine_standins import in_memory_telemetry
    rt, _, _ = in_memory_telemetry("vllm", metrics=False)
    census, clock = Census(), Clock()
    eng = StepEngine(telemetry=rt, read=census.read, clock=clock, settle_period_s=3600)
    seg = tmp_path / "gpu-census-9-9.seg"
    eng.log_segment = lambda: str(seg)
    engine_load(eng, census, clock, n=8)
    census.complete = clock.t + 10**9
    eng.shutdown(timeout_s=0.5)
    log = seg.with_suffix(".requests.jsonl")
    lines = log.read_text().splitlines()
    log.write_text("\n".join(lines[1:]) + "\n")                 # a request's line lost
    cb = chargeback.build([engine_requests.read(str(log))], "tenant")
    assert cb.missing is not None and cb.missing.figures["kernel.count"] > 0
    assert "not in any request line" in chargeback.render_text(cb)
    assert chargeback.to_dict(cb)["conserved"] is False
    log.write_text("\n".join(lines[:-1]) + "\n")                # no summary (the engine was killed)
    cb = chargeback.build([engine_requests.read(str(log))], "tenant")
    assert not cb.summarised and "no summary" in " ".join(cb.notes)
    assert "add up to the steps exactly" not in chargeback.render_text(cb)


def test_a_tenant_travels_in_the_start_record_to_a_settling_child(tagged, tmp_path):
    """Settling runs in a child that replays the engine's records: the tenant is in the start record, and a
    child started again after the first died is told it too (in_flight)."""
    from otel_gpu_census.integrations.engine import settle_process
    from otel_gpu_census.integrations.engine.steps import StepEngine
    sent = []

    class Remote:                        # the engine's side of the child, recording what it is sent
        ledger = SimpleNamespace(step_opened=lambda *a, **k: None, step_touched=lambda *a, **k: None)

        def __init__(self, eng, path):
            pass

        def record(self, ev):
            sent.append(ev)
    orig = settle_process.Remote
    settle_process.Remote = Remote
    try:
        eng = StepEngine(settle_in="process")
    finally:
        settle_process.Remote = orig
    eng.start_request("k", start_ns=1, operation="chat", model="sql-lora", headers={}, attributes={}, tenant="team-a")
    (ev,) = sent
    assert ev[0] == "start" and ev[2]["tenant"] == "team-a" and ev[2]["model"] == "sql-lora"
    assert eng.in_flight()[0][1]["tenant"] == "team-a"
    from engine_standins import in_memory_telemetry
    rt, spans, _ = in_memory_telemetry("vllm", metrics=False)
    child = StepEngine(telemetry=rt, read=Census().read, settle_in="child")
    settle_process.apply(child, ev)
    child.request_done("k", {}, end_ns=2)
    child.settle(final=True)
    (span,) = spans.get_finished_spans()
    assert span.attributes["gpu_census.tenant"] == "team-a" and span.attributes["gen_ai.request.model"] == "sql-lora"


def _otlp_span(attrs):
    return json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [{
        "kind": "SPAN_KIND_SERVER", "startTimeUnixNano": "1764400000000000000", "endTimeUnixNano": "1764400001000000000",
        "attributes": [{"key": k, "value": v} for k, v in attrs.items()]}]}]}]})


def test_a_request_logs_span_gives_its_share_and_a_wrong_type_is_refused_with_where():
    from otel_gpu_census.report.request_log import RequestLogError, parse
    good = {"gpu_census.tenant": {"stringValue": "team-a"}, "gen_ai.request.model": {"stringValue": "m"},
            "gpu_census.kernel.count": {"intValue": "12"}, "gpu_census.kernel.time": {"doubleValue": 0.000123456789},
            "gpu_census.copy.htod.bytes": {"intValue": "4096"}, "gpu_census.kernel.time_estimated": {"boolValue": True}}
    (r,) = parse([_otlp_span(good)])
    figures = dict(r.charge.figures)
    assert (r.charge.tenant, r.charge.model, r.charge.estimated) == ("team-a", "m", True)
    assert figures["kernel.count"] == 12 and figures["kernel.time_ns"] == 123457 and figures["copy.htod.bytes"] == 4096
    (plain,) = parse([_otlp_span({"gpu_census.tenant": {"stringValue": "x"}})])
    assert plain.charge is None                                  # no GPU share: nothing to add up
    for bad in ({"intValue": "-1"}, {"intValue": "12x"}, {"stringValue": "1e3"}, {"intValue": str(1 << 64)}):
        with pytest.raises(RequestLogError, match="line 1: gpu_census.kernel.count is not a whole number"):
            parse([_otlp_span(dict(good, **{"gpu_census.kernel.count": bad}))])
    with pytest.raises(RequestLogError, match="gpu_census.kernel.time is negative"):
        parse([_otlp_span(dict(good, **{"gpu_census.kernel.time": {"doubleValue": -1.0}}))])
    rows = chargeback.from_spans(parse([_otlp_span(good), _otlp_span(dict(good, **{
        "gpu_census.tenant": {"stringValue": "b" * 10_000}}))]), "tenant")
    assert sorted(len(x.name) for x in rows.rows) == [6, 256]
    assert rows.unattributed is None and not rows.summarised     # no census given: no rest, and it says so
    assert "no rest of the census" in chargeback.render_text(rows)
