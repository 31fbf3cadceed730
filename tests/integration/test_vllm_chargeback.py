"""Chargeback with the real vLLM classes (skipped where vLLM does not import: `make test-vllm`): the tenant read
once by the API-server hook from a client's real headers, the LoRA adapter from a real Request's lora_request,
three tenants and two adapters in one load through the engine hooks, and per tenant the chargeback counters =
the sum of its requests' span shares, `report --by` = the sum of its log lines, and tenants + unattributed =
the census, every integer exactly."""
from __future__ import annotations

import asyncio
import random
import time
from types import SimpleNamespace

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (make test-vllm installs it)")

from otel_gpu_census import injector  # noqa: E402
from otel_gpu_census.attribution.shares import Share  # noqa: E402
from otel_gpu_census.census import Stat, Step  # noqa: E402
from otel_gpu_census.integrations.vllm import instrumentor as vi  # noqa: E402
from otel_gpu_census.telemetry import tenant as tenant_mod  # noqa: E402
from otel_gpu_census.integrations.vllm.engine import TENANT_HEADER, EngineTelemetry  # noqa: E402

from chargeback_sums import check_metrics_equal_spans, check_report  # noqa: E402  (tests/support)
from engine_standins import Census, in_memory_telemetry  # noqa: E402

TENANTS = ("team-a", "team-b", "team-c")
ADAPTERS = ("sql-lora", None)          # None: the base model


def _serving():
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat

    class Off:
        async def is_tracing_enabled(self):
            return False
    obj = object.__new__(OpenAIServingChat)
    obj.engine_client = Off()
    return obj


def _trace_headers(raw):
    """What vLLM's API server hands the engine for a client's request with these headers (starlette's
    Headers, as the server passes them), through our hook."""
    from starlette.datastructures import Headers
    return asyncio.run(_serving()._get_trace_headers(Headers(raw=[(k.encode(), v.encode()) for k, v in raw])))


@pytest.fixture
def hooked(monkeypatch):
    monkeypatch.setattr(tenant_mod, "_configured", None)
    inst = vi.VllmInstrumentor()
    inst.instrument()
    yield
    inst.uninstrument()


def test_the_api_server_reads_the_tenant_once_and_a_client_cannot_set_ours(hooked, monkeypatch):
    got = _trace_headers([("baggage", "gpu_census.tenant=team-a"), ("content-type", "application/json")])
    assert got[TENANT_HEADER] == "team-a"
    forged = _trace_headers([(TENANT_HEADER, "someone-else")])      # our carrier header, sent by a client
    assert TENANT_HEADER not in forged
    monkeypatch.setattr(tenant_mod, "_configured", None)
    monkeypatch.setenv("OTEL_GPU_CENSUS_TENANT", "header:authorization")
    hashed = _trace_headers([("authorization", "Bearer sk-secret")])[TENANT_HEADER]
    assert hashed.startswith("sha256:") and "secret" not in hashed
    monkeypatch.setattr(tenant_mod, "_configured", None)
    monkeypatch.setenv("OTEL_GPU_CENSUS_TENANT", "off")
    assert TENANT_HEADER not in _trace_headers([("baggage", "gpu_census.tenant=team-a")])


def test_three_tenants_and_two_adapters_add_up_to_their_requests_and_the_census(hooked, monkeypatch, tmp_path):
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.request import Request, RequestStatus
    import support_vllm

    monkeypatch.setattr(injector, "step_begin", lambda sid: True)
    monkeypatch.setattr(injector, "step_end", lambda: None)
    monkeypatch.setattr(injector, "finish", lambda: True)
    rt, spans, reader = in_memory_telemetry("vllm")
    census = Census(complete=1 << 62)
    eng = EngineTelemetry(telemetry=rt, read=census.read, settle_period_s=3600)
    seg = tmp_path / "gpu-census-5-5.seg"
    eng.log_segment = lambda: str(seg)
    sched = SimpleNamespace(vllm_config=SimpleNamespace(model_config=SimpleNamespace(served_model_name="base"),
                                                        observability_config=SimpleNamespace(otlp_traces_endpoint=None)))
    rnd = random.Random(59)
    live, new, n = {}, [], 0
    vi.GUARD.current = eng                 # the hooks below reach this engine, as vLLM's calls would
    try:
        for k in range(40):
            if n < 18 and rnd.random() < 0.6:
                tenant = TENANTS[n % 3] if n % 5 else None
                headers = _trace_headers([("baggage", f"gpu_census.tenant={tenant}")] if tenant else [])
                adapter = ADAPTERS[n % 2]
                req = Request(request_id=f"cmpl-{n}-0-abcdef{n:02d}", prompt_token_ids=list(range(1, 9)),
                              sampling_params=SamplingParams(max_tokens=8), pooling_params=None,
                              arrival_time=time.time(), trace_headers=headers,
                              lora_request=LoRARequest(adapter, 1, "/adapters/" + adapter) if adapter else None)
                vi._add_request(lambda r: None, sched, (req,), {})
                live[req.request_id] = req
                new.append(req)
                n += 1
            tokens = {r: rnd.randint(1, 40) for r in live} if k % 7 else {}     # every 7th: nobody's step
            so = support_vllm.make_scheduler_output(tokens, new_requests=[r for r in new if r.request_id in tokens])
            new = [r for r in new if r.request_id not in tokens]
            vi._execute_model(lambda so: None, None, (so,), {})
            census.steps[eng.sid] = Step(id=eng.sid, kernel_count=rnd.randint(1, 300), kernel_ns=rnd.randint(1, 10**7),
                                         copies={"htod": Stat(1, rnd.randint(0, 10**6), 5),
                                                 "dtoh": Stat(1, rnd.randint(0, 10**5), 5)})
            out = {0: EngineCoreOutputs(outputs=[EngineCoreOutput(request_id=r, new_token_ids=[7]) for r in tokens])}
            vi._update_from_output(lambda so, mro: out, sched, (so, None), {})
            for rid in list(live):
                if rnd.random() < 0.2:
                    req = live.pop(rid)
                    req.status = RequestStatus.FINISHED_STOPPED
                    vi._free_request(lambda r, delay_free_blocks=False: None, sched, (req,), {})
        for req in live.values():
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            vi._free_request(lambda r, delay_free_blocks=False: None, sched, (req,), {})
    finally:
        vi.GUARD.current = None
    assert not vi.GUARD.off
    eng.settle()
    eng.shutdown(timeout_s=0.5)
    done = spans.get_finished_spans()
    assert len(done) == 18
    assert {s.attributes.get("gpu_census.tenant", "unknown") for s in done} == set(TENANTS) | {"unknown"}
    assert {s.attributes["gen_ai.request.model"] for s in done} == {"sql-lora", "base"}
    check_metrics_equal_spans(done, reader)
    check_metrics_equal_spans(done, reader, key="gen_ai.request.model")
    rows = [Share(s.kernel_count, s.kernel_ns, dict(s.copies), s.memset).as_row() for s in census.steps.values()]
    log = seg.with_suffix(".requests.jsonl")
    cb, _ = check_report([log], rows, "tenant", spans=done)
    assert cb.unattributed.figures["kernel.count"] > 0
    cbm, _ = check_report([log], rows, "model", spans=done)
    assert {x.name for x in cbm.rows} == {"sql-lora", "base"}
