"""The engine side of the vLLM integration: steps, requests and their spans, in EngineCore.

With one GPU per engine (tensor and pipeline parallel 1) vLLM runs the worker inside EngineCore, so
this one process sees everything the join needs:

- every step (``WorkerWrapperBase.execute_model`` and then ``sample_tokens``): its id is pushed on
  the launching thread (``injector.step_begin``), so the census tallies its kernels and copies
  under that id, and the step's ``{request id: scheduled tokens}`` goes to the :class:`StepLedger`;
- every request (``Scheduler.add_request`` .. ``Scheduler._free_request``): arrival time, the
  caller's trace context (``Request.trace_headers``, which the API-server hook fills even when
  vLLM's own tracing is off), first token, token counts, how it ended;
- the census of this process (its own segment), read a few times a second where settling runs (a
  child process by default, ``settle_process.py``), which splits each completed step among its
  requests and ends each request's span with its share.

With tensor or pipeline parallelism the workers run in other processes, EngineCore's children: their
steps are tagged the same way (the id is the worker's count of execute_model calls, the same on every
rank), EngineCore counts the same calls (``MultiprocExecutor.execute_model``) and opens each step in
its ledger, and settling reads every worker's segment (:mod:`.ranks`): a request's share
is the sum over ranks of its share of each rank's steps.

KV-offload transfers are sub-steps of the requests whose blocks they move (:mod:`.kv_offload`); the
work of dual-batch overlap's micro-batch threads is its step's (:mod:`.ubatch`).

With vLLM's own tracing on (``--otlp-traces-endpoint``) vLLM ends each request with a SERVER span of
its own, ``llm_request``, under the context in the request's ``trace_headers``. So that the caller's
trace shows one request, the request's span here takes ids chosen when the request arrives and its
``trace_headers`` are pointed at it: ``llm_request`` is its child, never its sibling, and ours is INTERNAL
(span-derived request counts see vLLM's SERVER span once). (The other way
round, ours under vLLM's, would leave ours without a parent for every request vLLM does not trace:
those its clients abort.)

The engine-neutral part (step and sub-step ids, settling, the request log, shutdown) is
``integrations/engine/steps.py``, which the SGLang integration shares. Everything here runs inside
vLLM's engine loop, so the hot path only counts and appends: no reads, no locks held across calls, no
allocation beyond a dict copy per step. Failures never reach vLLM: the instrumentor's guards turn any
exception into "integration off" with one log line.
"""
from __future__ import annotations

import logging
import os
import random
import re
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from otel_gpu_census.attribution.cost_model import ModelShape
from otel_gpu_census.attribution.steps import TOKENS
from otel_gpu_census.census import proctree
from otel_gpu_census.telemetry.attributes import share_attributes
from otel_gpu_census.integrations.engine.steps import SETTLE_PERIOD_S, RequestLog, StepEngine  # noqa: F401  (their old home)
from otel_gpu_census.integrations.engine.steps import extract as _extract  # noqa: F401
from otel_gpu_census.integrations.vllm.kv_offload import LOAD, STORE, KvTransfers
from otel_gpu_census.integrations.vllm.ranks import RankCensus
from otel_gpu_census.integrations.vllm.sched_state import Recompute, reader as state_reader

log = logging.getLogger("otel_gpu_census.vllm")

OPERATION_HEADER = "x-otel-gpu-census-operation"   # set by the API-server hook beside traceparent
CHILD_HEADER = "x-otel-gpu-census-n"                # set where vLLM fans a request out (n > 1): its ids are
                                                    # f"{index}_{parent}"
TENANT_HEADER = "x-otel-gpu-census-tenant"         # the request's tenant as the API-server hook read it (clean)
OURS = frozenset((OPERATION_HEADER, CHILD_HEADER, TENANT_HEADER))   # taken off the request once the engine has read them
STEP_NOTE = ("step attribution: this request's share of the GPU work of every engine step that served "
             "it, an allocation of each step's measured kernels and copies among the step's requests "
             "({split}), and the KV-offload transfers that moved its own blocks (by blocks); GPU work "
             "outside steps (start-up, compilation, graph capture) and steps that served nobody are "
             "not anyone's")

_INTERNAL_SUFFIX = re.compile(r"-[0-9a-zA-Z]{8}$")      # input_processor: f"{external}-{uuid:.8}"
_CHILD_PREFIX = re.compile(r"^\d+_")                    # parallel sampling (n > 1): f"{index}_{parent}"
_PROMPT_INDEX = re.compile(r"^(cmpl-.+)-\d+$")          # completions: f"{response id}-{prompt index}"
_SUB_REQUEST = re.compile(r"^(resp_.+)_\d+$")           # responses: f"{response id}_{sub-request}"


def external_id(internal: str, child: bool = False) -> str:
    """The request id vLLM's API server gave the engine (what vLLM's own ``llm_request`` span calls
    ``gen_ai.request.id``), from an engine-internal id; `child`: one of the n > 1 requests vLLM made of
    one (only then does a leading ``<index>_`` belong to vLLM rather than to the id)."""
    return _INTERNAL_SUFFIX.sub("", _CHILD_PREFIX.sub("", internal, count=1) if child else internal, count=1)


def response_id(internal: str, child: bool = False) -> str:
    """The ``id`` of the response the client got: completions add the prompt's index to it, the
    Responses API the sub-request's."""
    ext = external_id(internal, child)
    m = _PROMPT_INDEX.match(ext) or _SUB_REQUEST.match(ext)
    return m.group(1) if m else ext


def operation_of(serving) -> str:
    """The GenAI operation of a request from the vLLM serving object that took it in."""
    name = type(serving).__name__
    return "chat" if "Chat" in name or "Responses" in name else "text_completion"


def mark_children(request) -> None:
    """Before vLLM fans an EngineCoreRequest out into n (ParentRequest): its trace headers, which the
    children share, say so."""
    request.trace_headers = {**(getattr(request, "trace_headers", None) or {}), CHILD_HEADER: "1"}


def _trace_parent(headers: Mapping[str, str]) -> Optional[Tuple[int, str]]:
    """(trace id, flags) of a W3C traceparent, or None."""
    parts = str(headers.get("traceparent", "")).strip().split("-")
    if len(parts) != 4 or len(parts[1]) != 32 or len(parts[3]) != 2:
        return None
    try:
        trace_id = int(parts[1], 16)
        int(parts[3], 16)
    except ValueError:
        return None
    return (trace_id, parts[3]) if trace_id else None


FINISH_ERRORS = {"FINISHED_ABORTED": "aborted", "FINISHED_ERROR": "engine_error",
                 "FINISHED_IGNORED": "ignored"}


class EngineTelemetry(StepEngine):
    """One per engine process: vLLM's objects read into the shared steps, requests and settling."""

    PROVIDER = "vllm"
    SCOPE = "otel_gpu_census.vllm"
    NOTE = STEP_NOTE

    def __init__(self, telemetry=None, read=None, clock=time.time_ns, settle_period_s: float = SETTLE_PERIOD_S,
                 settle_in: Optional[str] = None):
        super().__init__(telemetry=telemetry, read=read, clock=clock, settle_period_s=settle_period_s,
                         settle_in=settle_in)
        self._model: Optional[str] = None
        self.kv = KvTransfers(self)          # KV-offload transfers: sub-steps of their requests
        self.ranks: Optional[RankCensus] = None   # TP/PP > 1: the workers' segments (EngineCore)
        self._executing: Dict[int, int] = {}      # ... id(scheduler output) -> its step, until its output
        self._vllm_tracing: Optional[bool] = None  # vLLM's own tracing is on (its llm_request spans)
        self._step_thread = 0                     # the thread of the open execute_model step
        self._step_open = 0                       # ... and its id (0: none)
        self._sched: Any = None                   # the scheduler (its first update_from_output or preemption)
        self._state: Optional[Callable] = None    # ... its state reader (None: not yet, or it has other fields)
        self.recompute = Recompute()              # preempted requests and what they compute again

    # -- where the census is (TP/PP > 1: the workers'), what a settled request adds -----------------
    def census_pids(self) -> List[int]:
        return self.ranks.pids if self.ranks else [self.census_pid]

    def census_elsewhere(self) -> bool:
        return self.ranks is not None

    def log_segment(self) -> str:
        """The engine's segment; with TP/PP > 1 EngineCore may launch no GPU work of its own (no
        segment): then the name its segment would have, in the folder its workers write to."""
        seg = super().log_segment()
        ranks = self.ranks
        if seg or ranks is None or not ranks.paths:
            return seg
        ticks = proctree.proc_start_ticks(self.census_pid)
        return os.path.join(os.path.dirname(next(iter(ranks.paths.values()))),
                            f"gpu-census-{self.census_pid}-{ticks}.seg")

    def span_attributes(self, s) -> Dict[str, Any]:
        return kv_attributes(s)

    def log_fields(self, s) -> Dict[str, Any]:
        if not s.weights:
            return {}
        return {"kv": {"stored_blocks": s.weights.get(STORE, 0), "loaded_blocks": s.weights.get(LOAD, 0),
                       "gpu": share_attributes("", s.sub, always=False)}}

    # -- steps (engine thread) --------------------------------------------------------------------
    def begin_execute(self, scheduler_output) -> int:
        """Before WorkerWrapperBase.execute_model: a new step id, tagged on this thread."""
        tokens = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        if self._state is not None:
            rc = self.recompute
            if rc.owed or rc.preempted:
                state, redo = self.step_state(tokens)
            else:                                        # (most steps)
                try:
                    state, redo = self._state(0, 0), None
                except Exception as e:
                    state, redo = self._state_failed(e)
            sid = self.open_step(tokens, before(scheduler_output) if self.wants_context else None, 0, state, redo)
        else:
            sid = self.open_step(tokens, before(scheduler_output) if self.wants_context else None)
        self._step_thread, self._step_open = threading.get_ident(), sid
        return sid

    def step_state(self, tokens) -> Tuple[Optional[tuple], Optional[Dict[str, int]]]:
        """The scheduler's state as this step opens (attribution/engine_state.FIELDS) and its recomputed
        tokens per preempted request; (None, None) once a read failed (one log line: the state is off)."""
        try:
            preempted, redo = self.recompute.step(tokens)
            return self._state(preempted, sum(redo.values()) if redo else 0), redo
        except Exception as e:
            return self._state_failed(e)

    def _state_failed(self, e: Exception) -> Tuple[None, None]:
        self._state = None
        log.warning("otel-gpu-census: reading vLLM's scheduler state failed (%s: %s); the engine state is off",
                    type(e).__name__, e)
        return None, None

    def scheduler_seen(self, scheduler) -> None:
        """The scheduler (from its update_from_output or _preempt_request): its state is read from the next step."""
        if self._sched is None:
            self._sched = scheduler
            self._state = state_reader(scheduler)

    def preempting(self, scheduler, request) -> None:
        """Scheduler._preempt_request, before it runs: the request's computed tokens are about to go."""
        self.scheduler_seen(scheduler)
        if self._state is not None:
            self.recompute.preempting(request)

    def end_step(self, sid: int) -> None:
        if sid == self._step_open:
            self._step_open = 0
        super().end_step(sid)

    def micro_batch_begin(self) -> int:
        """A dual-batch-overlap micro-batch thread entered its context: the open step tagged on it too."""
        sid = self._step_open
        if not sid or threading.get_ident() == self._step_thread:
            return 0
        self._tag(sid)
        return sid

    # -- steps run by worker processes (EngineCore, TP/PP > 1) --------------------------------------
    def executor_step(self, executor, scheduler_output) -> None:
        """Before MultiprocExecutor.execute_model: every worker numbers this step alike; open it here."""
        if not self.has_scheduler:
            return
        if self.ranks is None:
            n = getattr(executor, "local_world_size", None) or getattr(executor, "world_size", 1)
            if self.remote is not None:      # the settling child reads the workers' segments
                self.remote.record_sticky(("call", "ranks", (os.getpid(), n)))
            self.remote_ranks(os.getpid(), n)
        sid = self.next_sid()
        tokens = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        state, redo = self.step_state(tokens) if self._state is not None else (None, None)
        if state is not None:
            self.ledger.step_opened(sid, dict(tokens), self.clock(), TOKENS,
                                    before(scheduler_output) if self.wants_context else None, state, redo)
        elif self.wants_context:
            self.ledger.step_opened(sid, dict(tokens), self.clock(), before=before(scheduler_output))
        else:
            self.ledger.step_opened(sid, dict(tokens), self.clock())
        self._executing[id(scheduler_output)] = sid

    def remote_ranks(self, pid: int, n: int) -> None:
        """The workers of EngineCore `pid` (n of them) run the steps: read their segments."""
        self.ranks = RankCensus(pid, n)
        if self.remote is None:
            self.ledger.read = self.ranks.read
        self.tagging = True                  # the workers tag their steps; their segments say what ran

    def step_output(self, scheduler_output, scheduler=None) -> None:
        """Scheduler.update_from_output: the step's results came back from the workers: it is over
        (and so is any earlier one still open)."""
        if self._sched is None and scheduler is not None:
            self.scheduler_seen(scheduler)
        if not self._executing:
            return
        sid = self._executing.pop(id(scheduler_output), None)
        if sid is None:
            return
        now = self.clock()
        for key, older in [(k, v) for k, v in self._executing.items() if v < sid]:
            del self._executing[key]
            self.ledger.step_touched(older, now)
        self.ledger.step_touched(sid, now)
        self._ensure_settler()
        self.maybe_sweep(now)

    def begin_sample(self) -> int:
        """Before sample_tokens: the same step as the execute_model it follows."""
        return self.reopen_step()

    # -- requests (engine thread) -----------------------------------------------------------------
    def request_added(self, scheduler, request) -> None:
        self.has_scheduler = True
        rid = request.request_id
        if self.tracked(rid):                # a streaming-input session's next chunk: same request
            return
        headers = dict(getattr(request, "trace_headers", None) or {})
        operation = headers.get(OPERATION_HEADER, "text_completion")
        child = CHILD_HEADER in headers
        if headers.keys() & OURS:            # read now: not carried on every output of the request after this
            request.trace_headers = {k: v for k, v in headers.items() if k not in OURS} or None
        arrival_ns = int(getattr(request, "arrival_time", time.time()) * 1e9)
        if self.shape is None and self.wants_context:
            cfg = getattr(getattr(scheduler, "vllm_config", None), "model_config", None)
            self.set_shape(ModelShape.of(getattr(cfg, "hf_text_config", None) or getattr(cfg, "hf_config", None)))
        ids = self._parent_of_vllms_span(scheduler, request, headers)
        tenant = headers.get(TENANT_HEADER)
        self.start_request(rid, start_ns=arrival_ns, operation=operation,
                           model=lora_name(request) or self._model_name(scheduler), headers=headers,
                           tenant=tenant if isinstance(tenant, str) else None,
                           attributes={"gen_ai.request.id": external_id(rid, child),
                                       "gen_ai.response.id": response_id(rid, child), "vllm.request.id": rid},
                           prompt_tokens=int(getattr(request, "num_prompt_tokens", 0) or 0), obj=request, ids=ids)

    def _parent_of_vllms_span(self, scheduler, request, headers) -> Optional[Tuple[int, int]]:
        """With vLLM's tracing on: (trace id, span id) for this request's span, and the request's
        trace_headers pointed at it, so that vLLM's llm_request span is its child. None otherwise."""
        if self._vllm_tracing is None:
            obs = getattr(getattr(scheduler, "vllm_config", None), "observability_config", None)
            self._vllm_tracing = bool(getattr(obs, "otlp_traces_endpoint", None))
        if not self._vllm_tracing:
            return None
        caller = _trace_parent(headers)
        trace_id, flags = caller if caller else (random.getrandbits(128) or 1, "01")
        span_id = random.getrandbits(64) or 1
        request.trace_headers = {**(request.trace_headers or {}),
                                 "traceparent": f"00-{trace_id:032x}-{span_id:016x}-{flags}"}
        return trace_id, span_id

    def outputs(self, engine_core_outputs) -> None:
        """After Scheduler.update_from_output: the requests whose first token came out now."""
        due = self.first_due                 # (most steps: nobody waits for a first token)
        if not due:
            return
        now = None
        for eco in (engine_core_outputs or {}).values():
            for o in getattr(eco, "outputs", ()) or ():
                if o.request_id in due and o.new_token_ids:
                    now = now or self.clock()
                    attrs = None
                    # prompt tokens served from the prefix cache: only this first output carries them
                    ps = getattr(o, "prefill_stats", None)
                    cached = getattr(ps, "num_cached_tokens", None)
                    if cached is not None and cached >= 0:
                        attrs = {"gen_ai.usage.cache_read.input_tokens": int(cached)}
                    self.first_token(o.request_id, now, attrs)

    def request_freed(self, request) -> None:
        """Scheduler._free_request: finished, aborted or failed; no later step serves it."""
        rid = request.request_id
        if not self.tracked(rid):
            return
        status = getattr(getattr(request, "status", None), "name", "")
        reason = request.get_finished_reason() if hasattr(request, "get_finished_reason") else None
        facts = {
            "gen_ai.usage.input_tokens": int(getattr(request, "num_prompt_tokens", 0) or 0),
            "gen_ai.usage.output_tokens": int(getattr(request, "num_output_tokens", 0) or 0),
            "vllm.request.status": status,
        }
        if reason is not None:
            facts["gen_ai.response.finish_reasons"] = [str(reason)]
        # its last blocks may be stored after its end (vLLM defers a step's stores to the next step)
        self.request_done(rid, facts, FINISH_ERRORS.get(status), awaiting=self.kv.awaits(rid))

    def _model_name(self, scheduler) -> Optional[str]:
        if self._model is None:
            cfg = getattr(getattr(scheduler, "vllm_config", None), "model_config", None)
            name = getattr(cfg, "served_model_name", None) or getattr(cfg, "model", None)
            if isinstance(name, (list, tuple)):
                name = name[0] if name else None
            self._model = str(name) if name else ""
        return self._model or None


def before(scheduler_output) -> Dict[str, int]:
    """{request: tokens computed before this step} of a SchedulerOutput (new and running requests)."""
    out: Dict[str, int] = {}
    for r in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
        out[r.req_id] = int(r.num_computed_tokens or 0)
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    if cached is not None:
        out.update(zip(cached.req_ids, cached.num_computed_tokens))
    return out


def lora_name(request) -> Optional[str]:
    """The LoRA adapter a request asked for (its ``lora_request.lora_name``: the model name vLLM serves it
    under), or None for the base model."""
    name = getattr(getattr(request, "lora_request", None), "lora_name", None)
    return name if isinstance(name, str) and name else None


def kv_attributes(s) -> Dict[str, Any]:
    """A settled request's KV-offload figures: blocks it stored and loaded, and the part of its GPU
    share those transfers were (``gpu_census.kv_offload.*``, included in ``gpu_census.*``)."""
    out: Dict[str, Any] = {}
    for kind, name in ((STORE, "vllm.kv_offload.stored_blocks"), (LOAD, "vllm.kv_offload.loaded_blocks")):
        if s.weights.get(kind):
            out[name] = s.weights[kind]
    if out:
        out.update(share_attributes("gpu_census.kv_offload.", s.sub, always=False, seconds=True))
    return out
