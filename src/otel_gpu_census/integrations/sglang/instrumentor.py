"""The SGLang instrumentor: where the integration hooks into SGLang, and the guards that keep SGLang safe.

Hooks, registered with SGLang's own ``HookRegistry`` (``sglang.srt.plugins``), which applies them in
every SGLang process after its plugins are loaded (with wrapt, when each module is imported, on an
SGLang without the registry):

| SGLang                                        | process        | what the hook does                      |
|-----------------------------------------------|----------------|-----------------------------------------|
| TokenizerManager._init_req_state              | HTTP server    | keep the caller's traceparent, the      |
|                                               |                | operation, the arrival time, the tenant |
|                                               |                | and the LoRA adapter with the request,  |
|                                               |                | even with SGLang tracing off            |
| ReqTimeStatsBase.__getstate__ / new_from_obj  | all            | carry them to the scheduler (inside the |
|                                               |                | request's time stats, which SGLang      |
|                                               |                | pickles to the scheduler)               |
| Scheduler.get_next_batch_to_run (and the      | scheduler      | one step id around the batch's          |
| disaggregation modes' own),                   | (every rank)   | preparation (its input copies), its run |
| Scheduler.run_batch,                          |                | and its sampling (the overlap scheduler |
| Scheduler.launch_batch_sample_if_needed       |                | samples a batch later); the scheduler's |
|                                               |                | state with each batch                   |
| ScheduleBatch.retract_decode                  | scheduler      | retracted requests: what they compute   |
|                                               |                | again is priced                         |
| Scheduler._add_request_to_queue               | scheduler      | a request's span starts                 |
| SchedulerOutputStreamer.stream_output         | scheduler      | first token; the request's last output  |
| Scheduler.send_abort_output                   | scheduler      | the end of a request SGLang drops       |
|                                               |                | outside the output stream               |
| Scheduler.run_event_loop                      | scheduler      | at its end: final flush, last spans     |
| utils.common.kill_process_tree (and every     | launcher,      | before SGLang SIGKILLs a process tree   |
| ``from ... import`` of it: the registry       | Engine         | (at every stop): the final census flush |
| rebinds those)                                |                | of the processes it is about to kill    |

Every hook calls SGLang's function exactly once, with its arguments untouched, and returns its result or
raises its exception. Our own code around it runs inside a guard: an exception there switches the
integration off for the rest of the process, with one log line, and SGLang serves on.
"""
from __future__ import annotations

import logging
import os
import time
from types import ModuleType
from typing import Any, Callable, Collection, List, Tuple

from opentelemetry.instrumentation.instrumentor import BaseInstrumentor

from otel_gpu_census import injector
from otel_gpu_census.integrations.engine import final_flush
from otel_gpu_census.integrations.engine.guard import HookGuard, make_engine, start_integration
from otel_gpu_census.integrations.sglang.package import _instruments

log = logging.getLogger("otel_gpu_census.sglang")

NAME = "sglang"     # as OTEL_PYTHON_DISABLED_INSTRUMENTATIONS and SGLANG_PLUGINS name it


_providers: Tuple[Any, Any] = (None, None)   # (tracer, meter) providers given to instrument()


TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"


def _follow_traces_endpoint() -> None:
    """SGLang's --otlp-traces-endpoint, when its tracing is on (--enable-trace), is where SGLang sends its own
    spans: ours go there too (the variable the span exporter reads, here and in a settling child started
    later), unless an OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT names where. Read before the first span."""
    if os.environ.get(TRACES_ENDPOINT) or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return
    try:
        from sglang.srt.runtime_context import get_observability
        obs = get_observability()
    except Exception:            # an SGLang without it, or its configuration not published in this process
        return
    endpoint = getattr(obs, "otlp_traces_endpoint", None)
    if getattr(obs, "enable_trace", False) is True and isinstance(endpoint, str) and endpoint:
        os.environ[TRACES_ENDPOINT] = endpoint
        log.info("otel-gpu-census: request spans go to SGLang's --otlp-traces-endpoint %s", endpoint)


def _make_engine():
    from otel_gpu_census.integrations.sglang.engine import SchedulerTelemetry
    _follow_traces_endpoint()
    return make_engine(SchedulerTelemetry, _providers)


GUARD = HookGuard("SGLang", _make_engine, log)
engine = GUARD.engine       # the process's SchedulerTelemetry (made on first use)
_guard = GUARD              # _guard(what, fn, *args, default=None, closing=False)


def _arg(args, kwargs, i: int, name: str, default=None):
    """Parameter `name` at position i of an AROUND hook's call (after self, for a method); `default`
    where the caller left it out."""
    return args[i] if len(args) > i else kwargs.get(name, default)


# -- HTTP server ----------------------------------------------------------------------------------------

TRACE_HEADERS = ("traceparent", "tracestate")     # what SGLang's own extract_trace_headers keeps
OPERATION_KEY = "x-otel-gpu-census-operation"
TENANT_KEY = "x-otel-gpu-census-tenant"


def _set_external(obj, request) -> None:
    """Before SGLang reads the request: its trace headers on ``obj.external_trace_header``, as SGLang's
    own tracing puts them there when it is on (with it off SGLang reads them nowhere), plus the
    operation and the tenant (telemetry/tenant.py, read here once). Sub-requests (a batch, n > 1) are
    copies of obj and inherit them."""
    from otel_gpu_census.integrations.sglang.engine import operation_for
    from otel_gpu_census.telemetry import tenant
    headers = request.headers
    ext = {k: headers[k] for k in TRACE_HEADERS if k in headers}
    ext[OPERATION_KEY] = operation_for(getattr(getattr(request, "url", None), "path", "") or "")
    who = tenant.of_headers(headers, tenant.configured())
    if who:
        ext[TENANT_KEY] = who
    obj.external_trace_header = ext


def _keep_trace_context(tm, obj) -> None:
    """After SGLang made the request's state: the context goes on its time stats, which SGLang pickles
    to the scheduler (ReqTimeStatsBase.__getstate__ below adds it to what SGLang sends)."""
    from otel_gpu_census.integrations.sglang.engine import CARRY_KEY
    ext = getattr(obj, "external_trace_header", None)
    ext = ext if isinstance(ext, dict) else {}
    carried = {k: ext[k] for k in TRACE_HEADERS if isinstance(ext.get(k), str)}
    op = ext.get(OPERATION_KEY)
    carried["operation"] = op if isinstance(op, str) else "text_completion"
    if isinstance(ext.get(TENANT_KEY), str):
        carried["tenant"] = ext[TENANT_KEY]
    carried["start_ns"] = time.time_ns()
    rids = [obj.rid] if isinstance(obj.rid, str) else list(obj.rid or ())
    states = getattr(tm, "rid_to_state", {})
    loras = getattr(obj, "lora_path", None)      # the adapter's name (SGLang's Req has only its id)
    for i, rid in enumerate(rids):
        ts = getattr(states.get(rid), "time_stats", None)
        if ts is not None and hasattr(ts, "__dict__"):
            lora = loras if isinstance(loras, str) else loras[i] if isinstance(loras, list) and i < len(loras) else None
            ts.__dict__[CARRY_KEY] = dict(carried, lora=lora) if isinstance(lora, str) and lora else dict(carried)


def _init_req_state(original, self, *args, **kwargs):
    obj = _arg(args, kwargs, 0, "obj")
    request = _arg(args, kwargs, 1, "request")
    if not GUARD.off and request is not None and getattr(obj, "external_trace_header", None) is None:
        _guard("trace context", _set_external, obj, request)
    out = original(self, *args, **kwargs)
    _guard("trace context", _keep_trace_context, self, obj)
    return out


def _getstate(result, self, *args, **kwargs):
    """AFTER ReqTimeStatsBase.__getstate__: our carried context goes along (SGLang lists its keys)."""
    from otel_gpu_census.integrations.sglang.engine import CARRY_KEY
    carried = self.__dict__.get(CARRY_KEY)
    if carried and isinstance(result, dict) and not GUARD.off:
        result[CARRY_KEY] = carried
    return result


def _new_from_obj(result, cls, obj=None, *args, **kwargs):
    """AFTER ReqTimeStatsBase.new_from_obj: SGLang copies only the keys its new class declares."""
    from otel_gpu_census.integrations.sglang.engine import CARRY_KEY
    carried = getattr(obj, "__dict__", {}).get(CARRY_KEY) if obj is not None else None
    if carried and result is not None and not GUARD.off:
        result.__dict__[CARRY_KEY] = carried
    return result


# -- scheduler ------------------------------------------------------------------------------------------

def _run_batch(original, self, *args, **kwargs):
    batch = _arg(args, kwargs, 0, "batch")
    sid = _guard("step begin", lambda: engine().batch_begin(batch, self), default=0)
    try:
        return original(self, *args, **kwargs)
    finally:
        if sid:
            _guard("step end", lambda: engine().end_step(sid), closing=True)


def _launch_batch_sample(original, self, *args, **kwargs):
    result = _arg(args, kwargs, 0, "batch_result")
    batch = _arg(args, kwargs, 1, "cur_batch")
    sid = 0
    if result is not None:
        sid = _guard("step begin", lambda: engine().sample_begin(batch), default=0)
    try:
        return original(self, *args, **kwargs)
    finally:
        if sid:
            _guard("step end", lambda: engine().end_step(sid), closing=True)


def _next_batch(original, self, *args, **kwargs):
    """get_next_batch_to_run and its disaggregation twins: the batch's preparation is its step's."""
    sid = _guard("batch preparation", lambda: engine().prepare_begin(), default=0)
    try:
        plan = original(self, *args, **kwargs)
    finally:
        if sid:
            _guard("batch preparation end", injector.step_end, closing=True)
    if sid:
        _guard("batch preparation", lambda: engine().prepared(sid, plan))
    return plan


def _retract_decode(result, self, *args, **kwargs):
    """After ScheduleBatch.retract_decode: the requests it retracted compute their KV again later."""
    if GUARD.current is not None:
        _guard("retraction", lambda: GUARD.current.retracted(result))
    return result


def _send_abort_output(original, self, *args, **kwargs):
    req = _arg(args, kwargs, 1, "req")
    abort_req = _arg(args, kwargs, 0, "abort_req")
    if GUARD.current is not None:
        _guard("request abort", lambda: GUARD.current.aborted(req, abort_req))
    return original(self, *args, **kwargs)


def _add_request_to_queue(original, self, *args, **kwargs):
    req = _arg(args, kwargs, 0, "req")
    _guard("request start", lambda: engine().request_queued(self, req))     # before: it may end inside
    return original(self, *args, **kwargs)


def _stream_output(original, self, *args, **kwargs):
    reqs = _arg(args, kwargs, 0, "reqs")
    skip = _arg(args, kwargs, 2, "skip_req")
    if GUARD.current is not None:
        _guard("request outputs", lambda: GUARD.current.outputs(reqs, skip))
    return original(self, *args, **kwargs)


def _run_event_loop(original, self, *args, **kwargs):
    try:
        return original(self, *args, **kwargs)
    finally:
        if GUARD.current is not None:
            _guard("shutdown", GUARD.current.shutdown)


def _finish_tree(args, kwargs) -> None:
    parent = _arg(args, kwargs, 0, "parent_pid", None)
    include_parent = _arg(args, kwargs, 1, "include_parent", True)
    skip = _arg(args, kwargs, 2, "skip_pid", None)
    if _arg(args, kwargs, 3, "wait_timeout", 60) is None:
        return                # SGLang's "must not block here" (a __del__): nothing to wait for then
    if parent is None:        # as kill_process_tree reads it
        parent, include_parent = os.getpid(), False
    exclude = [p for p in (skip, None if include_parent else parent) if p]
    final_flush.finish_censuses([parent], "SGLang process", log, exclude=exclude)


def _kill_process_tree(original, *args, **kwargs):
    """kill_process_tree(parent_pid, include_parent=True, skip_pid=None, wait_timeout=60): SGLang's
    launcher SIGKILLs its schedulers with it at every stop, so their own shutdown never runs. First the
    final flush of the censuses it is about to kill (their flushers, through their control files; at
    most final_flush.FINISH_WAIT_S, only under the census)."""
    if not GUARD.off:
        _guard("final census flush", _finish_tree, args, kwargs)
    return original(*args, **kwargs)


SCHED = "sglang.srt.managers.scheduler.Scheduler"
HOOKS: List[Tuple[str, str, Callable]] = [
    # (target, HookType name, hook)
    ("sglang.srt.managers.tokenizer_manager.TokenizerManager._init_req_state", "AROUND", _init_req_state),
    ("sglang.srt.observability.req_time_stats.ReqTimeStatsBase.__getstate__", "AFTER", _getstate),
    ("sglang.srt.observability.req_time_stats.ReqTimeStatsBase.new_from_obj", "AFTER", _new_from_obj),
    (f"{SCHED}.get_next_batch_to_run", "AROUND", _next_batch),
    ("sglang.srt.disaggregation.decode.SchedulerDisaggregationDecodeMixin.get_next_disagg_decode_batch_to_run",
     "AROUND", _next_batch),
    ("sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin.get_next_disagg_prefill_batch_to_run",
     "AROUND", _next_batch),
    (f"{SCHED}.run_batch", "AROUND", _run_batch),
    # the engine state: requests retracted for want of KV cache (they are prefilled again)
    ("sglang.srt.managers.schedule_batch.ScheduleBatch.retract_decode", "AFTER", _retract_decode),
    (f"{SCHED}.send_abort_output", "AROUND", _send_abort_output),
    (f"{SCHED}.launch_batch_sample_if_needed", "AROUND", _launch_batch_sample),
    (f"{SCHED}._add_request_to_queue", "AROUND", _add_request_to_queue),
    (f"{SCHED}.run_event_loop", "AROUND", _run_event_loop),
    ("sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer.stream_output",
     "AROUND", _stream_output),
    # a function: the registry also rebinds the names other modules imported it under
    ("sglang.srt.utils.common.kill_process_tree", "AROUND", _kill_process_tree),
]

_registered = False


def _registry():
    """SGLang's HookRegistry and HookType, or (None, None) on an SGLang without them."""
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    except ImportError:
        return None, None
    return HookRegistry, HookType


class SglangInstrumentor(BaseInstrumentor):
    """Per-request GPU cost for SGLang: ``SglangInstrumentor().instrument()`` (what the
    ``sglang.srt.plugins`` entry point does in every SGLang process)."""

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments

    def _instrument(self, **kwargs: Any) -> None:
        """``tracer_provider`` / ``meter_provider``: where the request spans and metrics go (default: the
        application's global SDK providers, else providers built from the OTEL_* variables)."""
        global _registered, _providers
        _providers = (kwargs.get("tracer_provider"), kwargs.get("meter_provider"))
        GUARD.off = False
        if _registered:
            return
        registry, types = _registry()
        if registry is not None:
            for target, kind, hook in HOOKS:
                registry.register(target, hook, getattr(types, kind))
            if _plugins_loaded():
                # after SGLang's own plugin loading (opentelemetry-instrument, by hand): apply now
                registry.apply_hooks()
        else:
            _wrapt_hooks()
        _registered = True

    def _uninstrument(self, **kwargs: Any) -> None:
        # SGLang's registry cannot take back an applied hook: ours become pass-throughs
        GUARD.off = True


def _plugins_loaded() -> bool:
    try:
        import sglang.srt.plugins as plugins
    except ImportError:
        return False
    return bool(getattr(plugins, "_plugins_loaded", False))


def _wrapt_hooks() -> None:
    """An SGLang without HookRegistry: the same hooks through wrapt, when each module is imported."""
    import wrapt

    def adapt(kind, hook, function=False):
        if function:          # a module's function (AROUND): hook(original, *args, **kwargs)
            return lambda wrapped, instance, args, kwargs: hook(wrapped, *args, **kwargs)
        if kind == "AROUND":
            return lambda wrapped, instance, args, kwargs: hook(lambda _self, *a, **kw: wrapped(*a, **kw),
                                                                 instance, *args, **kwargs)
        return lambda wrapped, instance, args, kwargs: hook(wrapped(*args, **kwargs), instance, *args, **kwargs)

    for target, kind, hook in HOOKS:
        module, cls, meth = target.rsplit(".", 2)
        wrapt.when_imported(module)(
            lambda mod, cls=cls, meth=meth, kind=kind, hook=hook:
            hasattr(getattr(mod, cls, None), meth) and wrapt.wrap_function_wrapper(
                mod, f"{cls}.{meth}", adapt(kind, hook, isinstance(getattr(mod, cls), ModuleType))))


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: SGLang calls it in every process it starts, before it
    applies the registered hooks. Never raises: at worst one log line and SGLang runs uninstrumented."""
    start_integration(NAME, "SGLang", "otel-gpu-census run -- python -m sglang.launch_server ...", lambda: SglangInstrumentor().instrument(), log)
