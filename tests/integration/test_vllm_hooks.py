"""The vLLM hooks against the real vLLM classes (skipped where vLLM does not import: `make test-vllm`
installs it, CPU only). A vLLM release that renames a hooked method, changes its parameters or the
request fields the engine side reads fails here."""
from __future__ import annotations

import asyncio
import inspect
import time
from types import SimpleNamespace

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (make test-vllm installs it)")
import wrapt  # noqa: E402

from otel_gpu_census import injector  # noqa: E402
from otel_gpu_census.integrations.vllm import instrumentor as vi  # noqa: E402
from otel_gpu_census.integrations.vllm.engine import OPERATION_HEADER, EngineTelemetry  # noqa: E402


def _target(module, name):
    import importlib
    mod = importlib.import_module(module)
    if "." not in name:
        return mod, name
    cls_name, meth = name.split(".")
    return getattr(mod, cls_name), meth


# the parameter each hook reads, by position or name
PARAMS = {
    "GenerateBaseServing._get_trace_headers": ["self", "headers"],
    "WorkerWrapperBase.execute_model": ["self", "scheduler_output"],
    "Worker.sample_tokens": ["self", "grammar_output"],
    "MultiprocExecutor.execute_model": ["self", "scheduler_output"],
    "Scheduler.add_request": ["self", "request"],
    "Scheduler.update_from_output": ["self", "scheduler_output", "model_runner_output"],
    "Scheduler._free_request": ["self", "request", "delay_free_blocks"],
    "EngineCore.shutdown": ["self"],
    "OffloadingConnectorWorker.prepare_store_kv": ["self", "metadata"],
    "OffloadingConnectorWorker.handle_preemptions": ["self", "kv_connector_metadata"],
    "OffloadingConnectorWorker.start_kv_transfers": ["self", "metadata"],
    "shutdown": ["procs", "timeout"],
}


def test_every_hooked_method_exists_with_the_parameters_the_hooks_read():
    assert {name for _, name, _ in vi.HOOKS} == set(PARAMS)
    for module, name, _ in vi.HOOKS:
        cls, meth = _target(module, name)
        fn = inspect.unwrap(vars(cls)[meth]) if meth in vars(cls) else getattr(cls, meth)
        assert list(inspect.signature(fn).parameters)[:len(PARAMS[name])] == PARAMS[name], name
    assert inspect.iscoroutinefunction(_target(*vi.HOOKS[0][:2])[0]._get_trace_headers)


def test_instrument_wraps_each_hook_once_and_uninstrument_restores_vllm():
    inst = vi.VllmInstrumentor()
    originals = {(m, name): vars(_target(m, name)[0])[_target(m, name)[1]] for m, name, _ in vi.HOOKS}
    inst.instrument()
    try:
        inst.instrument()                                      # idempotent
        for m, name, _ in vi.HOOKS:
            cls, meth = _target(m, name)
            w = vars(cls)[meth]
            assert isinstance(w, wrapt.FunctionWrapper) and w.__wrapped__ is originals[(m, name)], name
    finally:
        inst.uninstrument()
    for m, name, _ in vi.HOOKS:
        cls, meth = _target(m, name)
        assert vars(cls)[meth] is originals[(m, name)], name


def test_the_api_server_keeps_the_callers_traceparent_with_vllm_tracing_off():
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    class OpenAIServingChat(OpenAIServingCompletion):   # the operation comes from the serving class's name
        pass

    class Off:
        async def is_tracing_enabled(self):
            return False

    def serving(cls):                   # the real class, as vLLM calls it (bound), without its set-up
        obj = object.__new__(cls)
        obj.engine_client = Off()
        return obj
    headers = {"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01", "content-type": "application/json"}
    inst = vi.VllmInstrumentor()
    inst.instrument()
    try:
        got = asyncio.run(serving(OpenAIServingCompletion)._get_trace_headers(headers))
        chat = asyncio.run(serving(OpenAIServingChat)._get_trace_headers(headers))
        plain = asyncio.run(serving(OpenAIServingCompletion)._get_trace_headers({"content-type": "x"}))
    finally:
        inst.uninstrument()
    assert got["traceparent"] == headers["traceparent"] and "content-type" not in got
    assert got[OPERATION_HEADER] == "text_completion" and chat[OPERATION_HEADER] == "chat"
    assert plain is None                                       # nothing to keep: vLLM's answer as it was
    assert asyncio.run(serving(OpenAIServingCompletion)._get_trace_headers(headers)) is None   # unwrapped again


def real_request(rid, n_prompt=5, trace=None):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request
    return Request(request_id=rid, prompt_token_ids=list(range(1, n_prompt + 1)),
                   sampling_params=SamplingParams(max_tokens=4), pooling_params=None,
                   arrival_time=time.time(), trace_headers=trace)


def test_the_engine_side_reads_real_requests_and_outputs(monkeypatch):
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.request import RequestStatus
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from otel_gpu_census.census import Step
    from otel_gpu_census.telemetry.request import RequestTelemetry

    monkeypatch.setattr(injector, "step_begin", lambda sid: True)
    monkeypatch.setattr(injector, "step_end", lambda: None)
    spans = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(spans))
    steps = {}
    eng = EngineTelemetry(telemetry=RequestTelemetry(tp, None, provider_name="vllm"),
                          read=lambda lo, hi: (SimpleNamespace(complete_wall_ns=1 << 62, alive=True,
                                                               state_name="active"), steps))
    tid, psid = "ab" * 16, "cd" * 8
    req = real_request("cmpl-77-0-a1b2c3d4", trace={"traceparent": f"00-{tid}-{psid}-01", OPERATION_HEADER: "chat"})
    sched = SimpleNamespace(vllm_config=SimpleNamespace(model_config=SimpleNamespace(served_model_name="tiny")))
    eng.request_added(sched, req)
    import support_vllm
    so = support_vllm.make_scheduler_output({req.request_id: 5}, new_requests=[req])   # the real SchedulerOutput
    sid = eng.begin_execute(so)
    eng.end_step(sid)
    steps[sid] = Step(id=sid, kernel_count=12, kernel_ns=3400)
    eng.outputs({0: EngineCoreOutputs(outputs=[EngineCoreOutput(request_id=req.request_id, new_token_ids=[7])])})
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    eng.request_freed(req)
    assert eng.settle() == 1
    (sp,) = spans.get_finished_spans()
    assert format(sp.context.trace_id, "032x") == tid and format(sp.parent.span_id, "016x") == psid
    assert sp.name == "chat tiny" and sp.attributes["gen_ai.request.id"] == "cmpl-77-0"
    assert sp.attributes["gen_ai.usage.input_tokens"] == 5 and sp.attributes["gpu_census.kernel.count"] == 12
    assert sp.attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert sp.attributes["gen_ai.response.time_to_first_chunk"] >= 0


def test_the_plugin_entry_point_is_what_vllm_loads():
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group
    plugins = load_plugins_by_group(DEFAULT_PLUGINS_GROUP)
    assert plugins.get("otel_gpu_census") is vi.register
