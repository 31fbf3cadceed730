"""telemetry.request: the one request lifecycle (span, GenAI metrics, GPU cost), on the SDK's
in-memory exporters."""
from __future__ import annotations

import subprocess
import sys

import pytest
from opentelemetry.trace import SpanKind, StatusCode

from otel_gpu_census.attribution.ledger import COMPLETE, NO_SEGMENT, GpuCost
from otel_gpu_census.attribution.shares import Share
from otel_gpu_census.census import Stat
from otel_gpu_census.telemetry.request import RequestTelemetry
from engine_standins import in_memory_providers  # tests/support

T0 = 1_700_000_000_000_000_000
MS = 1_000_000
BASE = {"gen_ai.operation.name": "chat", "gen_ai.provider.name": "vllm"}


@pytest.fixture
def rig():
    tp, mp, spans, reader = in_memory_providers()
    tel = RequestTelemetry(tp, mp, provider_name="vllm", instrumentation_name="test.scope")
    yield tel, spans, reader
    tp.shutdown()
    mp.shutdown()


def points(reader):
    """{metric name: [data points]} of one collection."""
    out = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            assert sm.scope.name == "test.scope"
            for m in sm.metrics:
                out.setdefault(m.name, []).extend(m.data.data_points)
    return out


def in_flight(reader) -> int:
    return sum(p.value for p in points(reader).get("gpu_census.requests.in_flight", []))


def cost(**kw) -> GpuCost:
    share = Share(kernel_count=7, kernel_ns=30 * MS, copies={"htod": Stat(2, 4096, MS), "dtoh": Stat(1, 1000, MS)})
    c = GpuCost(status=COMPLETE, share=share, window=share + Share(kernel_count=1, kernel_ns=MS), buckets=3,
                pids=[42], kernel_tracing=["all"], kernel_traced_ns=100 * MS, kernel_span_ns=100 * MS)
    for k, v in kw.items():
        setattr(c, k, v)
    return c


def test_a_request_gives_one_span_with_latencies_and_gpu_cost_and_its_metrics(rig):
    tel, spans, reader = rig
    req = tel.start(start_ns=T0, operation="chat", span_name="chat", attributes={"server.port": 8000})
    assert in_flight(reader) == 1
    req.first_token(T0 + 40 * MS)
    req.first_token(T0 + 90 * MS)                      # the first call counts
    req.set_attributes({"gen_ai.request.model": "llama-3"})
    req.finish(T0 + 240 * MS, cost=cost(note="what the window holds"), output_tokens=21)
    (s,) = spans.get_finished_spans()
    assert (s.name, s.kind, s.start_time, s.end_time) == ("chat", SpanKind.SERVER, T0, T0 + 240 * MS)
    a = s.attributes
    assert (a["gen_ai.operation.name"], a["gen_ai.provider.name"], a["server.port"]) == ("chat", "vllm", 8000)
    # the conventions' names: time to first chunk in seconds, the whole request as the span's duration
    assert a["gen_ai.response.time_to_first_chunk"] == 0.04 and not [k for k in a if k.startswith("gen_ai.latency")]
    assert a["gpu_census.kernel.count"] == 7 and a["gpu_census.copy.htod.bytes"] == 4096
    assert a["gpu_census.attribution.method"] == "time_window_shared" and a["gpu_census.window.kernel.count"] == 8
    assert a["gpu_census.attribution.note"] == "what the window holds"
    assert "error.type" not in a and s.status.status_code is StatusCode.UNSET
    pts = points(reader)
    labels = {**BASE, "gen_ai.request.model": "llama-3"}
    (dur,) = pts["gen_ai.server.request.duration"]
    assert dict(dur.attributes) == labels and dur.sum == pytest.approx(0.24)
    (ttft,) = pts["gen_ai.server.time_to_first_token"]
    assert ttft.sum == pytest.approx(0.04)
    (tpot,) = pts["gen_ai.server.time_per_output_token"]
    assert tpot.sum == pytest.approx(0.2 / 20)
    copies = {p.attributes["gpu_census.copy.direction"]: p.sum for p in pts["gpu_census.request.copy.size"]}
    assert copies == {"htod": 4096, "dtoh": 1000}
    (kt,) = pts["gpu_census.request.kernel.time"]
    assert kt.sum == pytest.approx(0.03) and dict(kt.attributes) == labels
    # exemplars point at the request's trace
    assert {e.trace_id for e in dur.exemplars} == {s.context.trace_id}
    assert in_flight(reader) == 0


def test_finish_is_idempotent_and_in_flight_drops_once(rig):
    tel, spans, reader = rig
    a = tel.start(start_ns=T0, operation="chat", span_name="chat")
    b = tel.start(start_ns=T0, operation="chat", span_name="chat")
    assert in_flight(reader) == 2
    a.served()                    # the answer is over; the GPU cost comes later
    a.served()
    assert in_flight(reader) == 1
    a.finish(T0 + MS)
    a.finish(T0 + 5 * MS, error_type="late")
    b.finish(T0 + 2 * MS)
    assert in_flight(reader) == 0
    ends = sorted(s.end_time for s in spans.get_finished_spans())
    assert ends == [T0 + MS, T0 + 2 * MS]
    assert sum(p.count for p in points(reader)["gen_ai.server.request.duration"]) == 2


def test_an_error_marks_the_span_and_the_duration_only(rig):
    tel, spans, reader = rig
    req = tel.start(start_ns=T0, operation="text_completion", model="m", span_name="text_completion m")
    req.first_token(T0 + MS)
    req.finish(T0 + 10 * MS, output_tokens=5, error_type="upstream_timeout")
    (s,) = spans.get_finished_spans()
    assert s.status.status_code is StatusCode.ERROR and s.attributes["error.type"] == "upstream_timeout"
    assert s.attributes["gen_ai.request.model"] == "m"
    pts = points(reader)
    (dur,) = pts["gen_ai.server.request.duration"]
    assert dur.attributes["error.type"] == "upstream_timeout"
    assert "gen_ai.server.time_to_first_token" not in pts and "gen_ai.server.time_per_output_token" not in pts


def test_a_status_the_integration_set_is_kept(rig):
    from opentelemetry.trace import Status
    tel, spans, _ = rig
    req = tel.start(start_ns=T0, operation="chat", span_name="chat")
    req.span.set_status(Status(StatusCode.ERROR, "upstream 127.0.0.1:8080 refused the connection"))
    req.finish(T0 + MS, error_type="upstream_unavailable")
    (s,) = spans.get_finished_spans()
    assert s.status.description == "upstream 127.0.0.1:8080 refused the connection"


def test_step_costs_carry_their_method_and_no_window(rig):
    tel, spans, reader = rig
    req = tel.start(start_ns=T0, operation="chat", span_name="chat")
    c = cost(method="step_tokens", steps=4, buckets=0)
    req.finish(T0 + MS, cost=c)
    a = spans.get_finished_spans()[0].attributes
    assert a["gpu_census.attribution.method"] == "step_tokens" and a["gpu_census.attribution.steps"] == 4
    assert not [k for k in a if k.startswith("gpu_census.window.")] and "gpu_census.attribution.buckets" not in a
    assert "gpu_census.attribution.note" not in a          # no note given, nothing went wrong
    assert a["gpu_census.kernel.count"] == 7


def test_no_gpu_histograms_without_a_complete_cost_and_no_kernel_time_when_sampled(rig):
    tel, spans, reader = rig
    tel.start(start_ns=T0, operation="chat", span_name="chat").finish(
        T0 + MS, cost=GpuCost(status=NO_SEGMENT, notes=["no segment"]))
    a = spans.get_finished_spans()[0].attributes
    assert a["gpu_census.attribution.status"] == "no_segment" and a["gpu_census.attribution.note"] == "no segment"
    assert "gpu_census.request.copy.size" not in points(reader)
    tel.start(start_ns=T0, operation="chat", span_name="chat").finish(
        T0 + MS, cost=cost(kernel_tracing=["5/50"], kernel_traced_ns=10 * MS))
    pts = points(reader)
    assert "gpu_census.request.kernel.time" not in pts and len(pts["gpu_census.request.copy.size"]) == 2


def test_finish_never_raises_and_still_ends_the_span(rig, caplog):
    tel, spans, reader = rig
    req = tel.start(start_ns=T0, operation="chat", span_name="chat")
    broken = cost()
    broken.share = None                                  # a bug upstream of the lifecycle
    req.finish(T0 + 3 * MS, cost=broken)
    (s,) = spans.get_finished_spans()
    assert s.end_time == T0 + 3 * MS and in_flight(reader) == 0
    assert "could not finish a request" in caplog.text


def test_a_request_may_name_another_provider(rig):
    tel, spans, reader = rig
    tel.start(start_ns=T0, operation="chat", span_name="chat",
              attributes={"gen_ai.provider.name": "ollama"}).finish(T0 + MS)
    assert spans.get_finished_spans()[0].attributes["gen_ai.provider.name"] == "ollama"
    (dur,) = points(reader)["gen_ai.server.request.duration"]
    assert dur.attributes["gen_ai.provider.name"] == "ollama"


@pytest.mark.parametrize("module", ["otel_gpu_census.telemetry.request", "otel_gpu_census.attribution.ledger",
                                    "otel_gpu_census.census.reader", "otel_gpu_census.telemetry.sidecar"])
def test_the_core_never_loads_a_web_framework(module):
    code = f"import sys, {module}; print('aiohttp' in sys.modules, 'multidict' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False", "False"], out.stderr


def test_clients_naming_many_models_get_a_bounded_model_label_and_spans_keep_the_name(rig):
    """The proxy takes `model` from the client's request: past MODEL_LABELS distinct names the metrics say
    _OTHER (as the HTTP conventions do for a method they do not know); the span keeps what was asked."""
    from otel_gpu_census.telemetry.instruments import MODEL_LABELS, OTHER_MODEL
    tel, spans, reader = rig
    for i in range(MODEL_LABELS + 10):
        req = tel.start(start_ns=T0, operation="chat", model=f"m{i}", span_name=f"chat m{i}")
        req.finish(T0 + MS)
    req = tel.start(start_ns=T0, operation="chat", model="m0", span_name="chat m0")   # a known one stays itself
    req.finish(T0 + MS)
    models = [dict(p.attributes)["gen_ai.request.model"] for p in points(reader)["gen_ai.server.request.duration"]]
    assert len(models) == MODEL_LABELS + 1 and models.count(OTHER_MODEL) == 1
    assert {f"m{i}" for i in range(MODEL_LABELS)} | {OTHER_MODEL} == set(models)
    by_model = {dict(p.attributes)["gen_ai.request.model"]: p.count for p in points(reader)["gen_ai.server.request.duration"]}
    assert by_model[OTHER_MODEL] == 10 and by_model["m0"] == 2
    assert {s.attributes["gen_ai.request.model"] for s in spans.get_finished_spans()} == {
        f"m{i}" for i in range(MODEL_LABELS + 10)}


@pytest.mark.parametrize("setting, total", [("", 92), ("gen_ai", 92), ("census", 46)])
def test_a_trace_under_an_instrumented_client_counts_its_tokens_once_with_span_usage_census(monkeypatch, setting,
                                                                                            total):
    """A GenAI backend sums gen_ai.usage.* over the spans of a trace: the client's inference span (CLIENT, as the
    conventions define it) and ours (SERVER, its child) both carry the request's 40 + 6 tokens, so the trace reads
    92. OTEL_GPU_CENSUS_SPAN_USAGE=census names ours gpu_census.usage.*: 46, and the counts stay on our span."""
    from opentelemetry import trace
    monkeypatch.setenv("OTEL_GPU_CENSUS_SPAN_USAGE", setting)
    tp, mp, spans, _reader = in_memory_providers()
    client = tp.get_tracer("a.genai.client").start_span("chat m", kind=SpanKind.CLIENT, attributes={
        "gen_ai.usage.input_tokens": 40, "gen_ai.usage.output_tokens": 6})
    tel = RequestTelemetry(tp, mp, provider_name="llama.cpp")
    req = tel.start(start_ns=T0, operation="chat", span_name="chat", parent=trace.set_span_in_context(client),
                    attributes={"gen_ai.usage.input_tokens": 40})
    req.set_attributes({"gen_ai.usage.cache_read.input_tokens": 8})
    req.finish(T0 + 10 * MS, attributes={"gen_ai.usage.output_tokens": 6}, output_tokens=6)
    client.end()
    ours, theirs = spans.get_finished_spans()
    assert ours.parent.span_id == theirs.context.span_id and ours.kind == SpanKind.SERVER
    summed = sum(v for s in (ours, theirs) for k, v in s.attributes.items()
                 if k in ("gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens"))
    assert summed == total
    prefix = "gpu_census.usage." if setting == "census" else "gen_ai.usage."
    assert {k: v for k, v in ours.attributes.items() if "usage." in k} == {
        prefix + "input_tokens": 40, prefix + "output_tokens": 6, prefix + "cache_read.input_tokens": 8}
    tp.shutdown()
    mp.shutdown()


def test_an_unknown_span_usage_value_is_one_line_and_the_default(monkeypatch, caplog):
    from otel_gpu_census.telemetry.request import usage_prefix
    with caplog.at_level("WARNING"):
        assert usage_prefix({"OTEL_GPU_CENSUS_SPAN_USAGE": "both"}) == "gen_ai.usage."
    assert [r.getMessage() for r in caplog.records] == [
        "OTEL_GPU_CENSUS_SPAN_USAGE='both' is not one of gen_ai | census: using gen_ai; token counts stay gen_ai.usage.*"]
    assert usage_prefix({"OTEL_GPU_CENSUS_SPAN_USAGE": " Census "}) == "gpu_census.usage."
