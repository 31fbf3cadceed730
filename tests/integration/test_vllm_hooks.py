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
    "UBatchContext.__enter__": ["self"],
    "UBatchContext.__exit__": ["self", "exc_type", "exc_val", "exc_tb"],
    "ParentRequest.__init__": ["self", "request"],
    "MultiprocExecutor.execute_model": ["self", "scheduler_output"],
    "Scheduler.add_request": ["self", "request"],
    "Scheduler.update_from_output": ["self", "scheduler_output", "model_runner_output"],
    "Scheduler._free_request": ["self", "request", "delay_free_blocks"],
    "Scheduler._preempt_request": ["self", "request", "timestamp"],
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
    # what each name holds itself (None where it inherits the method) and the method it resolves to
    own = {(m, name): vars(_target(m, name)[0]).get(_target(m, name)[1]) for m, name, _ in vi.HOOKS}
    originals = {(m, name): inspect.getattr_static(*_target(m, name)) for m, name, _ in vi.HOOKS}
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
        assert vars(cls).get(meth) is own[(m, name)], name


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
    # vLLM's own answer: None with its tracing off in 0.25; the traceparent alone in later releases
    vllms = asyncio.run(serving(OpenAIServingCompletion)._get_trace_headers(headers))
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
    assert plain == {OPERATION_HEADER: "text_completion"}      # no traceparent: the operation all the same
    assert asyncio.run(serving(OpenAIServingCompletion)._get_trace_headers(headers)) == vllms   # unwrapped again


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
    assert sp.kind.name == "SERVER"                       # vLLM's tracing off: ours is the request's span
    assert sp.attributes["gen_ai.usage.input_tokens"] == 5 and sp.attributes["gpu_census.kernel.count"] == 12
    assert sp.attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert sp.attributes["gen_ai.response.time_to_first_chunk"] >= 0


def test_the_plugin_entry_point_is_what_vllm_loads():
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group
    plugins = load_plugins_by_group(DEFAULT_PLUGINS_GROUP)
    assert plugins.get("otel_gpu_census") is vi.register


# -- labels, ids, the span tree with vLLM's tracing on, micro-batch threads --------------------------------

def _serving(cls):
    class Off:
        async def is_tracing_enabled(self):
            return False
    obj = object.__new__(cls)
    obj.engine_client = Off()
    return obj


def _engine_with_spans(monkeypatch, metrics=False):
    from engine_standins import in_memory_telemetry
    monkeypatch.setattr(injector, "step_begin", lambda sid: True)
    monkeypatch.setattr(injector, "step_end", lambda: None)
    rt, spans, reader = in_memory_telemetry("vllm", metrics=metrics)
    steps = {}
    eng = EngineTelemetry(telemetry=rt, read=lambda lo, hi: (SimpleNamespace(
        complete_wall_ns=1 << 62, alive=True, state_name="active"), steps), settle_period_s=3600)
    return eng, spans, reader, steps


def _sched(tracing=None):
    return SimpleNamespace(vllm_config=SimpleNamespace(
        model_config=SimpleNamespace(served_model_name="m"),
        observability_config=SimpleNamespace(otlp_traces_endpoint=tracing)))


def _finish(eng, req):
    from vllm.v1.request import RequestStatus
    req.status = RequestStatus.FINISHED_STOPPED
    eng.request_freed(req)


@pytest.mark.parametrize("cls_path, operation", [
    ("vllm.entrypoints.openai.chat_completion.serving.OpenAIServingChat", "chat"),
    ("vllm.entrypoints.openai.responses.serving.OpenAIServingResponses", "chat"),
    ("vllm.entrypoints.openai.completion.serving.OpenAIServingCompletion", "text_completion"),
])
def test_every_endpoint_names_its_operation_with_or_without_a_traceparent(monkeypatch, cls_path, operation):
    """The operation travels only in the trace headers: a request without a traceparent carries it too."""
    import pkgutil
    from otel_gpu_census.telemetry.instruments import IN_FLIGHT
    inst = vi.VllmInstrumentor()
    inst.instrument()
    try:
        got = asyncio.run(_serving(pkgutil.resolve_name(cls_path))._get_trace_headers({"content-type": "x"}))
    finally:
        inst.uninstrument()
    assert got == {OPERATION_HEADER: operation}
    eng, spans, reader, _ = _engine_with_spans(monkeypatch, metrics=True)
    req = real_request("chatcmpl-1-abcdefgh", trace=got)
    eng.request_added(_sched(), req)
    _finish(eng, req)
    eng.settle()
    (sp,) = spans.get_finished_spans()
    assert sp.name == f"{operation} m" and sp.attributes["gen_ai.operation.name"] == operation
    points = [p for m in reader.get_metrics_data().resource_metrics[0].scope_metrics[0].metrics
              if m.name == "gen_ai.server.request.duration" for p in m.data.data_points]
    assert [p.attributes["gen_ai.operation.name"] for p in points] == [operation]


def test_n_children_are_named_for_their_parent_and_a_callers_own_index_like_id_is_kept(monkeypatch):
    """vLLM's parallel sampling names the n children f"{index}_{parent}": their ids are the parent's;
    an id the caller gave that looks the same (X-Request-Id "3_...") is left whole."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.parallel_sampling import ParentRequest
    inst = vi.VllmInstrumentor()
    inst.instrument()
    try:
        core = EngineCoreRequest(request_id="cmpl-p-0-a1b2c3d4", prompt_token_ids=[1, 2, 3], mm_features=None,
                                 sampling_params=SamplingParams(n=2, max_tokens=4), pooling_params=None,
                                 arrival_time=time.time(), lora_request=None, cache_salt=None, data_parallel_rank=None,
                                 trace_headers={OPERATION_HEADER: "text_completion"}, external_req_id="cmpl-p-0")
        parent = ParentRequest(core)                          # the hooked __init__, as AsyncLLM calls it
        child_id, _ = parent.get_child_info(1)
    finally:
        inst.uninstrument()
    eng, spans, _, _ = _engine_with_spans(monkeypatch)
    child = real_request(child_id, trace=core.trace_headers)
    own = real_request("3_mine-a1b2c3d4", trace={OPERATION_HEADER: "text_completion"})
    for r in (child, own):
        eng.request_added(_sched(), r)
        _finish(eng, r)
    eng.settle()
    got = {s.attributes["vllm.request.id"]: s.attributes for s in spans.get_finished_spans()}
    assert child_id == "1_cmpl-p-0-a1b2c3d4"
    assert (got[child_id]["gen_ai.request.id"], got[child_id]["gen_ai.response.id"]) == ("cmpl-p-0", "cmpl-p")
    assert got["3_mine-a1b2c3d4"]["gen_ai.request.id"] == "3_mine"


@pytest.mark.parametrize("caller", [True, False])
def test_with_vllms_tracing_on_its_llm_request_span_is_a_child_of_ours(monkeypatch, caller):
    """vLLM's own span (do_tracing: llm_request, SERVER, under the request's trace_headers as they come
    back with its last output) hangs under ours: the caller sees one request."""
    import vllm.tracing.otel as votel
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind
    from vllm.tracing import extract_trace_context
    from vllm.v1.engine import EngineCoreOutput
    eng, spans, _, _ = _engine_with_spans(monkeypatch)
    theirs = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(theirs))
    monkeypatch.setattr(votel.trace, "get_tracer", lambda *a, **k: tp.get_tracer("vllm"))
    tid, psid = "ab" * 16, "cd" * 8
    headers = {OPERATION_HEADER: "chat", **({"traceparent": f"00-{tid}-{psid}-01"} if caller else {})}
    req = real_request("chatcmpl-7-abcdefgh", trace=headers)
    eng.request_added(_sched(tracing="http://collector:4317"), req)
    out = EngineCoreOutput(request_id=req.request_id, new_token_ids=[1], trace_headers=req.trace_headers)
    votel.manual_instrument_otel("llm_request", time.time_ns(), attributes={"gen_ai.request.id": "chatcmpl-7"},
                                 context=extract_trace_context(out.trace_headers), kind=SpanKind.SERVER)
    _finish(eng, req)
    eng.settle()
    (ours,), (llm,) = spans.get_finished_spans(), theirs.get_finished_spans()
    assert llm.parent.span_id == ours.context.span_id and llm.context.trace_id == ours.context.trace_id
    assert (ours.kind, llm.kind) == (SpanKind.INTERNAL, SpanKind.SERVER)    # one SERVER span a request
    if caller:
        assert format(ours.context.trace_id, "032x") == tid and format(ours.parent.span_id, "016x") == psid
    else:
        assert ours.parent is None                            # a root, in the trace vLLM's span joins


def test_without_vllms_tracing_the_requests_trace_headers_are_the_callers_and_ours_are_taken_off(monkeypatch):
    """Ours are read once the request arrives: none is carried on each of its outputs after that."""
    eng, spans, _, _ = _engine_with_spans(monkeypatch)
    caller = {"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"}
    req = real_request("chatcmpl-8-abcdefgh", trace={**caller, OPERATION_HEADER: "chat"})
    plain = real_request("chatcmpl-9-abcdefgh", trace={OPERATION_HEADER: "chat"})
    for r in (req, plain):
        eng.request_added(_sched(), r)
    assert req.trace_headers == caller and plain.trace_headers is None


def test_micro_batch_threads_launch_under_the_open_step(monkeypatch):
    """Dual-batch overlap: vLLM's UBatchWrapper (0.25-0.30; UBatchRunner in 0.34) runs the model as
    two micro-batches on threads of their own (its real _run_ubatches / begin_capturable_run and
    UBatchContext here); what they launch is tagged with the step open on the engine thread, and nothing
    stays open on them after."""
    import threading
    import torch
    import vllm.v1.worker.ubatching as ub
    open_steps = {}                                            # thread -> its stack of step ids

    def begin(sid):
        open_steps.setdefault(threading.get_ident(), []).append(sid)
        return True

    def end():
        stack = open_steps.get(threading.get_ident())
        return stack.pop() if stack else None
    monkeypatch.setattr(injector, "step_begin", begin)
    monkeypatch.setattr(injector, "step_end", end)
    stream = object()
    monkeypatch.setattr(ub, "current_stream", lambda: stream)
    eng = EngineTelemetry(telemetry=object(), read=lambda lo, hi: (None, {}))
    launched = []

    def model(input_ids, positions, intermediate_tensors, inputs_embeds):
        launched.append((threading.get_ident(), list(open_steps.get(threading.get_ident(), []))))
        return input_ids.float()
    barrier = threading.Barrier(3)
    ub._CURRENT_CONTEXTS[:] = [None, None]
    try:
        from vllm.v1.worker.gpu_ubatch_wrapper import UBatchWrapper, UbatchMetadata      # 0.25
    except ImportError:
        UBatchWrapper = None
    if UBatchWrapper is not None:
        events = [threading.Event(), threading.Event()]
        ctxs = [ub.UBatchContext(id=i, comm_stream=stream, compute_stream=stream, forward_context=None,
                                 ready_barrier=barrier, cpu_wait_event=events[i],
                                 cpu_signal_event=events[(i + 1) % 2],
                                 gpu_comm_done_event=None, gpu_compute_done_event=None) for i in range(2)]
        meta = [UbatchMetadata(context=c, input_ids=torch.ones(2, dtype=torch.long), positions=None,
                               inputs_embeds=None, intermediate_tensors=None, num_tokens=2) for c in ctxs]
        wrapper = object.__new__(UBatchWrapper)
        wrapper.ready_barrier = barrier

        def run_ubatches():
            UBatchWrapper._run_ubatches(wrapper, meta, model)
    else:
        import contextlib
        import vllm.v1.worker.gpu.ubatch_utils as uu
        monkeypatch.setattr(uu, "current_stream", lambda: stream)
        monkeypatch.setattr(torch.accelerator, "set_device_index", lambda index: None)   # no GPU here
        runner = object.__new__(uu.UBatchRunner)
        runner.num_ubatches, runner.ready_barrier, runner.comm_stream = 2, barrier, stream
        runner.device, runner.sm_control, runner._pending_finish = SimpleNamespace(index=0), contextlib.nullcontext(), None
        runner.vllm_config = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32))
        state = uu.UBatchState(slices=[SimpleNamespace(token_slice=slice(0, 1), num_tokens=1),
                                       SimpleNamespace(token_slice=slice(1, 2), num_tokens=1)],
                               forward_contexts=[None, None])
        inputs = {"input_ids": torch.ones(2, dtype=torch.long), "positions": torch.arange(2),
                  "intermediate_tensors": None, "inputs_embeds": None}

        def run_ubatches():
            runner.run(model, inputs, state)
    vi.GUARD.current = eng
    inst = vi.VllmInstrumentor()
    inst.instrument()
    try:
        run_ubatches()                                        # no step open (as in graph capture): untagged
        sid = eng.begin_execute(SimpleNamespace(num_scheduled_tokens={}))
        run_ubatches()
        eng.end_step(sid)
    finally:
        inst.uninstrument()
        vi.GUARD.current = None
    main = threading.get_ident()
    assert [steps for t, steps in launched[:2]] == [[], []]
    assert [steps for t, steps in launched[2:]] == [[sid], [sid]] and all(t != main for t, _ in launched)
    assert all(not stack for stack in open_steps.values())


def test_a_request_vllm_lets_go_of_unseen_is_closed_by_the_sweep_and_one_open_at_the_end_by_shutdown(monkeypatch):
    """Whatever way a request ends, one span: vLLM dropping a Request without _free_request (nothing
    the hooks see) is found by the sweep once the object is gone; one still open when the engine shuts
    down is closed then. Both partial, saying why; the ledger and the engine keep nothing of them."""
    import gc
    import support_vllm
    from otel_gpu_census.census import Step
    from otel_gpu_census.integrations.engine import steps as engine_steps
    eng, spans, _, steps = _engine_with_spans(monkeypatch)
    forgotten, kept, done = (real_request(f"cmpl-{n}-0-abcdefgh") for n in ("forgotten", "kept", "done"))
    for r in (forgotten, kept, done):
        eng.request_added(_sched(), r)
    so = support_vllm.make_scheduler_output({r.request_id: 5 for r in (forgotten, kept, done)},
                                            new_requests=[forgotten, kept, done])
    sid = eng.begin_execute(so)
    eng.end_step(sid)                                          # (the first step's sweep finds nothing)
    steps[sid] = Step(id=sid, kernel_count=30, kernel_ns=3000)
    _finish(eng, done)
    del forgotten, so
    gc.collect()
    eng._next_sweep = 0                                        # the sweep's period has passed
    sid = eng.begin_execute(SimpleNamespace(num_scheduled_tokens={kept.request_id: 1}))
    eng.end_step(sid)
    steps[sid] = Step(id=sid, kernel_count=3, kernel_ns=300)
    assert eng.settle() == 2
    eng.shutdown()
    got = {s.attributes["vllm.request.id"][5:9]: s.attributes for s in spans.get_finished_spans()}
    assert sorted(got) == ["done", "forg", "kept"]
    assert got["done"]["gpu_census.attribution.status"] == "complete"
    assert got["forg"]["gpu_census.attribution.status"] == "partial" and got["forg"]["gpu_census.kernel.count"] == 10
    assert engine_steps.SWEPT in got["forg"]["gpu_census.attribution.note"] and "error.type" not in got["forg"]
    assert got["kept"]["gpu_census.attribution.status"] == "partial" and got["kept"]["error.type"] == "shutdown"
    assert engine_steps.ENGINE_ENDED in got["kept"]["gpu_census.attribution.note"]
    assert got["kept"]["gpu_census.kernel.count"] == 10 + 3 and got["kept"]["gen_ai.usage.input_tokens"] == 5
    assert not eng._open and not eng._tracked and not eng.ledger._acc and not eng.ledger._live


def test_open_requests_are_bounded(monkeypatch):
    from otel_gpu_census.integrations.engine import steps as engine_steps
    monkeypatch.setattr(engine_steps, "MAX_OPEN", 3)
    eng, spans, _, _ = _engine_with_spans(monkeypatch)
    eng.end_step(eng.begin_execute(SimpleNamespace(num_scheduled_tokens={})))    # the census counts here
    reqs = [real_request(f"cmpl-{i}-0-abcdefgh") for i in range(5)]
    for r in reqs:
        eng.request_added(_sched(), r)
    assert list(eng._open) == [r.request_id for r in reqs[2:]]
    eng.settle()
    closed = sorted(s.attributes["vllm.request.id"] for s in spans.get_finished_spans())
    assert closed == [reqs[0].request_id, reqs[1].request_id]
    assert all("open at once" in s.attributes["gpu_census.attribution.note"] for s in spans.get_finished_spans())


@pytest.mark.parametrize("method, note", [("flops", "estimated FLOPs"), ("alone", "would cost alone")])
def test_the_flops_split_reads_the_context_from_vllms_scheduler_output_and_the_shape_from_its_config(monkeypatch, method, note):
    """OTEL_GPU_CENSUS_ATTRIBUTION=flops: each request's kernels by its FLOPs in the step, from the real
    SchedulerOutput's num_computed_tokens (new and running requests) and the model's LlamaConfig; =alone reads
    the same (its first steps, before its fit has enough of them, are split by FLOPs too)."""
    import support_vllm
    from transformers import LlamaConfig
    from otel_gpu_census.attribution.cost_model import ModelShape, step_weights
    from otel_gpu_census.attribution.shares import split_weights
    from otel_gpu_census.census import Step
    monkeypatch.setenv("OTEL_GPU_CENSUS_ATTRIBUTION", method)
    eng, spans, _, steps = _engine_with_spans(monkeypatch)
    cfg = LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=32000)
    sched = _sched()
    sched.vllm_config.model_config.hf_text_config = cfg
    old, new = real_request("cmpl-old-0-abcdefgh", n_prompt=900), real_request("cmpl-new-0-abcdefgh", n_prompt=40)
    for r in (old, new):
        eng.request_added(sched, r)
    new.num_computed_tokens = 8                                   # a prefix-cache hit
    so = support_vllm.make_scheduler_output({old.request_id: 1, new.request_id: 32}, new_requests=[new])
    so.scheduled_cached_reqs.num_computed_tokens[0] = 1500       # the running one's context
    sid = eng.begin_execute(so)
    eng.end_step(sid)
    steps[sid] = Step(id=sid, kernel_count=100, kernel_ns=1_000_003)
    for r in (old, new):
        _finish(eng, r)
    eng.settle()
    got = {s.attributes["vllm.request.id"]: s.attributes for s in spans.get_finished_spans()}
    shape = ModelShape.of(cfg)
    w = step_weights(shape, [old.request_id, new.request_id], {old.request_id: 1, new.request_id: 32},
                     {old.request_id: 1500, new.request_id: 8}, {old.request_id: 900, new.request_id: 40})
    assert [round(got[r.request_id]["gpu_census.kernel.time"] * 1e9) for r in (old, new)] == \
        split_weights(1_000_003, w, sum(w))
    assert all(a["gpu_census.attribution.method"] == f"step_{method}" for a in got.values())
    assert note in got[old.request_id]["gpu_census.attribution.note"]
