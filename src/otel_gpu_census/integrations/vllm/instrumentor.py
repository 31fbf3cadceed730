"""The vLLM instrumentor: where the integration hooks into vLLM, and the guards that keep vLLM safe.

Hooks (wrapt, applied when each module is imported, so a process that never imports a module pays
nothing for its hooks):

| vLLM                                              | process       | what the hook does                    |
|---------------------------------------------------|---------------|---------------------------------------|
| GenerateBaseServing._get_trace_headers            | API server    | keep the caller's traceparent (and the |
|                                                   |               | operation, the tenant) even with vLLM |
|                                                   |               | tracing off                           |
| WorkerWrapperBase.execute_model,                  | worker        | one step id around both calls         |
| gpu_worker.Worker.sample_tokens                   |               |                                       |
| UBatchContext.__enter__ / __exit__                | worker        | dual-batch overlap: the step's id on  |
|                                                   |               | its micro-batch threads too           |
| ParentRequest.__init__                            | API server    | n > 1: the children's trace headers   |
|                                                   |               | say their ids carry an index          |
| MultiprocExecutor.execute_model                   | EngineCore    | TP/PP > 1: the step's id and tokens   |
| Scheduler.add_request / update_from_output /      | EngineCore    | a request's span, first token, end;   |
| Scheduler._free_request / _preempt_request        |               | the scheduler's state per step, and   |
|                                                   |               | what preempted requests recompute     |
| OffloadingConnectorWorker.prepare_store_kv,      | worker        | KV-offload jobs -> their requests;    |
| .handle_preemptions, .start_kv_transfers, and     | (TP = PP = 1) | one sub-step per call and direction   |
| submit_store / submit_load of its OffloadingWorker|               | around the launches (kv_offload.py)   |
| EngineCore.shutdown                               | EngineCore    | final census flush, last spans out    |
|                                                   |               | (SIGTERM/SIGINT held until then)      |
| vllm.v1.utils.shutdown (and its import in         | API server    | the engines' final census flush (their |
| vllm.v1.engine.utils)                             |               | control files), then a 3 s grace      |

Every hook calls vLLM's method exactly once, with its arguments untouched, and returns its result or
raises its exception. Our own code around it runs inside a guard: an exception there switches the
integration off for the rest of the process, with one log line, and vLLM serves on.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, Collection, List, Tuple

import wrapt
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor
from opentelemetry.instrumentation.utils import unwrap

from otel_gpu_census.integrations.engine.guard import HookGuard, make_engine, start_integration
from otel_gpu_census.integrations.engine import final_flush
from otel_gpu_census.integrations.vllm import kv_offload, ubatch
from otel_gpu_census.integrations.vllm.engine import mark_children
from otel_gpu_census.integrations.vllm.package import _instruments

log = logging.getLogger("otel_gpu_census.vllm")

NAME = "vllm"       # as OTEL_PYTHON_DISABLED_INSTRUMENTATIONS names it

_providers: Tuple[Any, Any] = (None, None)   # (tracer, meter) providers given to instrument()


def _make_engine():
    from otel_gpu_census.integrations.vllm.engine import EngineTelemetry
    return make_engine(EngineTelemetry, _providers)


GUARD = HookGuard("vLLM", _make_engine, log)
engine = GUARD.engine       # the process's EngineTelemetry (made on first use)
_guard = GUARD              # _guard(what, fn, *args, default=None, closing=False)
_instrumented = False


# -- API server ---------------------------------------------------------------------------------------

def _trace_headers_from(instance, headers, got):
    """The request's trace headers: the caller's context (with vLLM's tracing off too) and, always, the
    operation (the engine learns it from nothing else); its tenant (telemetry/tenant.py), read here once."""
    from otel_gpu_census.integrations.vllm.engine import OPERATION_HEADER, TENANT_HEADER, operation_of
    from otel_gpu_census.telemetry import tenant
    out = dict(got or {})
    if "traceparent" not in out:
        out.update({k: headers[k] for k in ("traceparent", "tracestate") if k in headers})
    out[OPERATION_HEADER] = operation_of(instance)
    who = tenant.of_headers(headers, tenant.configured())
    if who:
        out[TENANT_HEADER] = who
    return out




def _get_trace_headers(wrapped, instance, args, kwargs):
    async def call():
        got = await wrapped(*args, **kwargs)
        headers = args[0] if args else kwargs.get("headers")
        return _guard("trace headers", _trace_headers_from, instance, headers, got, default=got)
    return call()


# -- worker ---------------------------------------------------------------------------------------------

def _execute_model(wrapped, instance, args, kwargs):
    so = args[0] if args else kwargs.get("scheduler_output")
    sid = _guard("step begin", lambda: engine().begin_execute(so), default=0)
    try:
        return wrapped(*args, **kwargs)
    finally:
        if sid:
            _guard("step end", lambda: engine().end_step(sid), closing=True)


def _sample_tokens(wrapped, instance, args, kwargs):
    sid = _guard("step begin", lambda: engine().begin_sample(), default=0)
    try:
        return wrapped(*args, **kwargs)
    finally:
        if sid:
            _guard("step end", lambda: engine().end_step(sid), closing=True)


# -- scheduler (EngineCore) -------------------------------------------------------------------------------

TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
_endpoint_read = False


def _follow_traces_endpoint(scheduler) -> None:
    """vLLM's --otlp-traces-endpoint, when the user set it, is where vLLM sends its own spans: ours go there
    too (through the variable the span exporter reads, here and in a settling child started later), unless
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT names another. Read once, at the first request, before any span."""
    global _endpoint_read
    if _endpoint_read:
        return
    _endpoint_read = True
    config = getattr(getattr(scheduler, "vllm_config", None), "observability_config", None)
    endpoint = getattr(config, "otlp_traces_endpoint", None)
    if not isinstance(endpoint, str) or not endpoint or os.environ.get(TRACES_ENDPOINT):
        return
    os.environ[TRACES_ENDPOINT] = endpoint
    log.info("otel-gpu-census: request spans go to vLLM's --otlp-traces-endpoint %s", endpoint)


def _add_request(wrapped, instance, args, kwargs):
    request = args[0] if args else kwargs.get("request")
    if not _endpoint_read:
        _guard("traces endpoint", _follow_traces_endpoint, instance)
    out = wrapped(*args, **kwargs)
    _guard("request start", lambda: engine().request_added(instance, request))
    return out


def _update_from_output(wrapped, instance, args, kwargs):
    out = wrapped(*args, **kwargs)
    so = args[0] if args else kwargs.get("scheduler_output")
    _guard("step output", lambda: engine().step_output(so, instance))
    _guard("first tokens", lambda: engine().outputs(out))
    return out


def _executor_execute_model(wrapped, instance, args, kwargs):
    so = args[0] if args else kwargs.get("scheduler_output")
    _guard("worker step", lambda: engine().executor_step(instance, so))
    return wrapped(*args, **kwargs)


def _preempt_request(wrapped, instance, args, kwargs):
    request = args[0] if args else kwargs.get("request")
    _guard("preemption", lambda: engine().preempting(instance, request))
    return wrapped(*args, **kwargs)


def _free_request(wrapped, instance, args, kwargs):
    request = args[0] if args else kwargs.get("request")
    _guard("request end", lambda: engine().request_freed(request))
    return wrapped(*args, **kwargs)


def _parent_request(wrapped, instance, args, kwargs):
    request = args[0] if args else kwargs.get("request")
    _guard("parallel sampling", lambda: mark_children(request))
    return wrapped(*args, **kwargs)


def _shutdown(wrapped, instance, args, kwargs):
    # ours first: the census's final flush and the last spans, before vLLM tears the engine down; the
    # API server's SIGTERM waits for them (vLLM has put it back to its default action by now)
    if GUARD.current is not None and not GUARD.off:
        with final_flush.stop_signals_deferred():
            _guard("shutdown", GUARD.current.shutdown)
    return wrapped(*args, **kwargs)


SHUTDOWN_GRACE_S = 3.0


def _finish_censuses(procs) -> None:
    """The final census flush of the engines about to be stopped (and their workers), through their
    control files: their flusher threads do it even when their main thread never reaches its shutdown
    (an engine with KV offloading was seen to ignore SIGTERM until it was killed)."""
    pids = [p.pid for p in procs if getattr(p, "pid", None) and getattr(p, "is_alive", lambda: False)()]
    final_flush.finish_censuses(pids, "engine", log)


def _process_shutdown(wrapped, instance, args, kwargs):
    """vllm.v1.utils.shutdown(procs, timeout): with vLLM's default --shutdown-timeout 0 the API server
    sends the engine SIGTERM and then SIGKILL at once, and the census loses its final flush and the
    last spans. Under the census, first the engines' final census flush (their flushers, through the
    control file: at most final_flush.FINISH_WAIT_S), then let the engine take up to SHUTDOWN_GRACE_S to exit by
    itself (it needs well under a second); an engine that exits sooner costs nothing."""
    def call(procs, timeout=None):
        if not GUARD.off:
            _guard("final census flush", _finish_censuses, procs)
            if timeout is not None and timeout < SHUTDOWN_GRACE_S:
                timeout = SHUTDOWN_GRACE_S
        return wrapped(procs, timeout=timeout)
    return call(*args, **kwargs)


KV_WORKER = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker"

HOOKS: List[Tuple[str, str, Callable]] = [
    ("vllm.entrypoints.generate.base.serving", "GenerateBaseServing._get_trace_headers", _get_trace_headers),
    ("vllm.v1.worker.worker_base", "WorkerWrapperBase.execute_model", _execute_model),
    # WorkerWrapperBase has no sample_tokens of its own (its __getattr__ hands it to the worker)
    ("vllm.v1.worker.gpu_worker", "Worker.sample_tokens", _sample_tokens),
    # dual-batch overlap: the model's kernels launched on the micro-batch threads are the step's
    ("vllm.v1.worker.ubatching", "UBatchContext.__enter__", ubatch.enter(_guard, engine)),
    ("vllm.v1.worker.ubatching", "UBatchContext.__exit__", ubatch.leave(_guard, engine)),
    # n > 1: the children's ids are f"{index}_{parent}"; their shared trace headers say so
    ("vllm.v1.engine.parallel_sampling", "ParentRequest.__init__", _parent_request),
    # TP/PP > 1: EngineCore numbers the steps its workers run, as each worker does
    ("vllm.v1.executor.multiproc_executor", "MultiprocExecutor.execute_model", _executor_execute_model),
    ("vllm.v1.core.sched.scheduler", "Scheduler.add_request", _add_request),
    ("vllm.v1.core.sched.scheduler", "Scheduler.update_from_output", _update_from_output),
    ("vllm.v1.core.sched.scheduler", "Scheduler._free_request", _free_request),
    # the engine state: a preempted request's computed tokens, before the scheduler resets them
    ("vllm.v1.core.sched.scheduler", "Scheduler._preempt_request", _preempt_request),
    ("vllm.v1.engine.core", "EngineCore.shutdown", _shutdown),
    # KV offloading (--kv-offloading-size): the transfers belong to the requests whose blocks they move
    (KV_WORKER, "OffloadingConnectorWorker.prepare_store_kv", kv_offload.prepare_store_kv(_guard, engine)),
    (KV_WORKER, "OffloadingConnectorWorker.handle_preemptions", kv_offload.transfers(_guard, engine, loads=False)),
    (KV_WORKER, "OffloadingConnectorWorker.start_kv_transfers", kv_offload.transfers(_guard, engine, loads=True)),
    # the function, and the name vllm.v1.engine.utils imported it under (its engine manager calls that)
    ("vllm.v1.utils", "shutdown", _process_shutdown),
    ("vllm.v1.engine.utils", "shutdown", _process_shutdown),
]


class VllmInstrumentor(BaseInstrumentor):
    """Per-request GPU cost for vLLM: ``VllmInstrumentor().instrument()`` (what the
    ``vllm.general_plugins`` entry point does in every vLLM process)."""

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments

    def _instrument(self, **kwargs: Any) -> None:
        """``tracer_provider`` / ``meter_provider``: where the request spans and metrics go (default: the
        application's global SDK providers, else providers built from the OTEL_* variables)."""
        global _instrumented, _providers
        _providers = (kwargs.get("tracer_provider"), kwargs.get("meter_provider"))
        GUARD.off = False
        _instrumented = True
        for module, name, hook in HOOKS:
            wrapt.when_imported(module)(lambda mod, name=name, hook=hook: _wrap(mod, name, hook))

    def _uninstrument(self, **kwargs: Any) -> None:
        global _instrumented
        GUARD.off = True
        _instrumented = False   # import hooks still registered (modules not imported yet) wrap nothing
        import sys
        kv_offload.unwrap_submits()
        for module, name, _ in HOOKS:
            mod = sys.modules.get(module)
            if mod is None:
                continue
            owner, attr = _owner(mod, name)
            wrapper = vars(owner).get(attr) if owner is not None else None
            if not isinstance(wrapper, wrapt.FunctionWrapper):
                continue
            if isinstance(owner, type) and any(vars(c).get(attr) is wrapper.__wrapped__ for c in owner.__mro__[1:]):
                delattr(owner, attr)    # wrapped where it was inherited (0.34: BaseServing's)
            else:
                unwrap(owner, attr)


def _owner(module, name: str):
    """(the object holding the hooked attribute, the attribute's name): a class or the module."""
    if "." not in name:
        return module, name
    cls_name, meth = name.split(".")
    return getattr(module, cls_name, None), meth


def _wrap(module, name: str, hook: Callable) -> None:
    """Wrap module.Class.method (or module.function) unless it is already wrapped by us, or the
    instrumentor was uninstrumented before the module was imported."""
    if not _instrumented:
        return
    owner, attr = _owner(module, name)
    if owner is None or not hasattr(owner, attr):
        log.warning("otel-gpu-census: vLLM has no %s.%s; that hook is off", module.__name__, name)
        return
    if isinstance(vars(owner).get(attr), wrapt.FunctionWrapper):
        return
    wrapt.wrap_function_wrapper(module, name, hook)


def register() -> None:
    """The ``vllm.general_plugins`` entry point: vLLM calls it in every process it starts. Never
    raises (vLLM would not start): at worst one log line and vLLM runs uninstrumented."""
    start_integration(NAME, "vLLM", "otel-gpu-census run -- vllm serve ...", lambda: VllmInstrumentor().instrument(), log)
