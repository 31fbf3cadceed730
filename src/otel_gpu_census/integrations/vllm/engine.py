"""The engine side of the vLLM integration: steps, requests and their spans, in EngineCore.

With one GPU per engine (tensor and pipeline parallel 1) vLLM runs the worker inside EngineCore, so
this one process sees everything the join needs:

- every step (``WorkerWrapperBase.execute_model`` and then ``sample_tokens``): its id is pushed on
  the launching thread (``injector.step_begin``), so the census tallies its kernels and copies
  under that id, and the step's ``{request id: scheduled tokens}`` goes to the :class:`StepLedger`;
- every request (``Scheduler.add_request`` .. ``Scheduler._free_request``): arrival time, the
  caller's trace context (``Request.trace_headers``, which the API-server hook fills even when
  vLLM's own tracing is off), first token, token counts, how it ended;
- the census of this process (its own segment), read a few times a second by a settling thread,
  which splits each completed step among its requests and ends each request's span with its share.

With tensor or pipeline parallelism the workers run in other processes, EngineCore's children: their
steps are tagged the same way (the id is the worker's count of execute_model calls, the same on every
rank), EngineCore counts the same calls (``MultiprocExecutor.execute_model``) and opens each step in
its ledger, and the settling thread reads every worker's segment (:mod:`.ranks`): a request's share
is the sum over ranks of its share of each rank's steps.

Everything here runs inside vLLM's engine loop, so the hot path only counts and appends: no reads,
no locks held across calls, no allocation beyond a dict copy per step. Failures never reach vLLM:
the instrumentor's guards turn any exception into "integration off" with one log line.
"""
from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from typing import Any, Dict, Mapping, Optional, Tuple

from ... import injector
from ...attribution.ledger import COMPLETE, STALE, GpuCost
from ...attribution.shares import Share
from ...attribution.steps import METHOD, StepLedger
from ...census import proctree, reader
from ...telemetry.attributes import share_attributes
from .kv_offload import LOAD, STORE, KvTransfers
from .ranks import RankCensus

log = logging.getLogger("otel_gpu_census.vllm")

SETTLE_PERIOD_S = 0.25
OPERATION_HEADER = "x-otel-gpu-census-operation"   # set by the API-server hook beside traceparent
STEP_NOTE = ("step attribution: this request's share of the GPU work of every engine step that served "
             "it, each step's kernels and copies split among the step's requests by their scheduled "
             "tokens, and the KV-offload transfers that moved its own blocks (by blocks); GPU work "
             "outside steps (start-up, compilation, graph capture) and steps that served nobody are "
             "not anyone's")

_INTERNAL_SUFFIX = re.compile(r"-[0-9a-zA-Z]{8}$")      # input_processor: f"{external}-{uuid:.8}"
_CHILD_PREFIX = re.compile(r"^\d+_")                    # parallel sampling (n > 1): f"{index}_{parent}"
_PROMPT_INDEX = re.compile(r"^(cmpl-.+)-\d+$")          # completions: f"{response id}-{prompt index}"


def external_id(internal: str) -> str:
    """The request id vLLM's API server gave the engine (what vLLM's own ``llm_request`` span calls
    ``gen_ai.request.id``), from an engine-internal id."""
    return _INTERNAL_SUFFIX.sub("", _CHILD_PREFIX.sub("", internal), count=1)


def response_id(internal: str) -> str:
    """The ``id`` of the response the client got: completions add the prompt's index to it."""
    ext = external_id(internal)
    m = _PROMPT_INDEX.match(ext)
    return m.group(1) if m else ext


FINISH_ERRORS = {"FINISHED_ABORTED": "aborted", "FINISHED_ERROR": "engine_error",
                 "FINISHED_IGNORED": "ignored"}


class EngineTelemetry:
    """One per engine process: the step counter, the ledger, the requests' spans, the settler."""

    def __init__(self, telemetry=None, read=None, clock=time.time_ns, settle_period_s: float = SETTLE_PERIOD_S):
        self.clock = clock
        self.ledger = StepLedger(read or self._read_own_census, clock=clock)
        self._telemetry = telemetry          # RequestTelemetry, made on first use (providers from OTEL_*)
        self._tracked: Dict[str, Any] = {}   # request id -> TrackedRequest
        self._model: Optional[str] = None
        self.sid = 0                         # the current step (last execute_model)
        self._last_id = 0                    # the last id handed out: steps and their sub-steps
        self.has_scheduler = False           # requests live in this process (TP = PP = 1)
        self.tagging = False                 # the injector is counting here and steps are tagged
        self._period = settle_period_s
        self._wake = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._stopped = False
        self._shutdown_done = False
        self._requests_log = RequestLog(self)
        self._providers: Tuple = ()
        self.settle_errors = 0
        self.kv = KvTransfers(self)          # KV-offload transfers: sub-steps of their requests
        self.ranks: Optional[RankCensus] = None   # TP/PP > 1: the workers' segments (EngineCore)
        self._executing: Dict[int, int] = {}      # ... id(scheduler output) -> its step, until its output

    # -- the census of this process --------------------------------------------------------------
    @staticmethod
    def _read_own_census(lo: int, hi: int):
        path = injector.segment_path()
        if not path:                         # no buffer completed yet: the segment does not exist
            return None, {}
        head = reader.read_segment(path, detail=False)
        return head, {s.id: s for s in reader.read_steps(path, lo, hi + 1)}

    # -- steps (engine thread) --------------------------------------------------------------------
    def begin_execute(self, scheduler_output) -> int:
        """Before WorkerWrapperBase.execute_model: a new step id, tagged on this thread."""
        sid = self.sid = self.next_sid()
        if self.has_scheduler:
            tokens = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
            self.ledger.step_opened(sid, dict(tokens), self.clock())
        self.tagging = injector.step_begin(sid)
        return sid

    def next_sid(self) -> int:
        """The next id of the one increasing sequence of steps and sub-steps (the census's step ring
        takes ids in increasing order). Without requests here (a TP/PP worker) only steps take ids,
        so every rank numbers its steps alike."""
        self._last_id += 1
        return self._last_id

    # -- steps run by worker processes (EngineCore, TP/PP > 1) --------------------------------------
    def executor_step(self, executor, scheduler_output) -> None:
        """Before MultiprocExecutor.execute_model: every worker numbers this step alike; open it here."""
        if not self.has_scheduler:
            return
        if self.ranks is None:
            n = getattr(executor, "local_world_size", None) or getattr(executor, "world_size", 1)
            self.ranks = RankCensus(os.getpid(), n)
            self.ledger.read = self.ranks.read
            self.tagging = True              # the workers tag their steps; their segments say what ran
        sid = self.next_sid()
        tokens = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        self.ledger.step_opened(sid, dict(tokens), self.clock())
        self._executing[id(scheduler_output)] = sid

    def step_output(self, scheduler_output) -> None:
        """Scheduler.update_from_output: the step's results came back from the workers: it is over
        (and so is any earlier one still open)."""
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

    def begin_sample(self) -> int:
        """Before sample_tokens: the same step as the execute_model it follows."""
        if self.sid and injector.step_begin(self.sid):
            return self.sid
        return 0

    def end_step(self, sid: int) -> None:
        injector.step_end()
        if self.has_scheduler:
            self.ledger.step_touched(sid, self.clock())
            self._ensure_settler()

    # -- requests (engine thread) -----------------------------------------------------------------
    def request_added(self, scheduler, request) -> None:
        self.has_scheduler = True
        rid = request.request_id
        if rid in self._tracked:             # a streaming-input session's next chunk: same request
            return
        self.ledger.request_started(rid)
        headers = dict(getattr(request, "trace_headers", None) or {})
        operation = headers.get(OPERATION_HEADER, "text_completion")
        model = self._model_name(scheduler)
        arrival_ns = int(getattr(request, "arrival_time", time.time()) * 1e9)
        self._tracked[rid] = self.telemetry().start(
            start_ns=arrival_ns, operation=operation, model=model,
            span_name=f"{operation} {model}" if model else operation, parent=_extract(headers),
            attributes={"gen_ai.request.id": external_id(rid), "gen_ai.response.id": response_id(rid),
                        "vllm.request.id": rid})

    def outputs(self, engine_core_outputs) -> None:
        """After Scheduler.update_from_output: the requests whose first token came out now."""
        if not self._tracked:
            return
        now = None
        for eco in (engine_core_outputs or {}).values():
            for o in getattr(eco, "outputs", ()) or ():
                t = self._tracked.get(o.request_id)
                if t is not None and t.first_token_ns is None and o.new_token_ids:
                    now = now or self.clock()
                    t.first_token(now)
                    self.ledger.first_token(o.request_id, now)
                    # prompt tokens served from the prefix cache: only this first output carries them
                    ps = getattr(o, "prefill_stats", None)
                    cached = getattr(ps, "num_cached_tokens", None)
                    if cached is not None and cached >= 0:
                        t.set_attributes({"gen_ai.usage.cache_read.input_tokens": int(cached)})

    def request_freed(self, request) -> None:
        """Scheduler._free_request: finished, aborted or failed; no later step serves it."""
        rid = request.request_id
        t = self._tracked.get(rid)
        if t is None:
            return
        now = self.clock()
        t.served()
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
        self.ledger.request_done(rid, (facts, FINISH_ERRORS.get(status)), now, awaiting=self.kv.awaits(rid))
        if not self.tagging:                 # no census here: nothing to wait for
            self._ensure_settler()

    # -- settling (its own thread) ----------------------------------------------------------------
    def _ensure_settler(self) -> None:
        if self._thread is None and not self._stopped:
            self._thread = threading.Thread(target=self._run, name="otel-gpu-census-settle", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stopped:
            self._wake.wait(self._period)
            self._wake.clear()
            if self._stopped:
                break
            try:
                self.settle()
            except Exception:                # the census can be unreadable for a moment: try again
                self.settle_errors += 1
                if self.settle_errors == 1:  # but say so once, with the reason
                    log.warning("otel-gpu-census: settling requests failed (retrying every %.2f s)",
                                self._period, exc_info=True)

    def settle(self, final: bool = False) -> int:
        """Split what the census completed; end the spans of the requests that settled. Their count."""
        done = self.ledger.settle(final=final)
        for s in done:
            t = self._tracked.pop(s.key, None)
            if t is None:
                continue
            facts, error_type = s.facts
            attrs = dict(facts)
            arrival = t.start_ns
            if s.first_step_ns:
                attrs["gen_ai.latency.time_in_queue"] = max(0, s.first_step_ns - arrival) / 1e9
            cost = None
            attrs.update(kv_attributes(s))
            if self.tagging:
                cost = GpuCost(status=COMPLETE if s.status == "complete" else STALE, method=METHOD,
                               steps=s.steps, note=STEP_NOTE, share=s.share, prefill=s.prefill,
                               pids=self.ranks.pids if self.ranks else [os.getpid()], notes=list(s.notes))
            t.finish(s.end_ns, cost=cost, attributes=attrs, output_tokens=facts["gen_ai.usage.output_tokens"],
                     error_type=error_type)
            self._requests_log.write(s, t, facts, error_type)
        return len(done)

    # -- the end of the engine ----------------------------------------------------------------------
    def shutdown(self, timeout_s: float = 3.0) -> None:
        """After EngineCore.shutdown: the census's final flush (vLLM ends this process without running
        atexit handlers), every waiting request settled, spans and metrics exported. Bounded."""
        if self._shutdown_done:
            return
        self._shutdown_done = True
        self._stopped = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s / 3)
        if self.ranks is not None:           # the workers still run (and flush): let their census catch up
            deadline = time.monotonic() + timeout_s / 2
            while self.ledger.pending() and time.monotonic() < deadline:
                self.settle()
                time.sleep(0.05)
        injector.finish()
        if self.has_scheduler:
            self.settle(final=True)
            self._requests_log.summary(self.ledger, self.settle_errors)
        if self._telemetry is not None:
            self._telemetry_flush(timeout_s)

    def _telemetry_flush(self, timeout_s: float) -> None:
        for provider in self._providers:
            try:
                if hasattr(provider, "force_flush"):
                    provider.force_flush(int(timeout_s * 1000))
            except Exception:
                log.debug("flush at shutdown failed", exc_info=True)

    # -- providers ----------------------------------------------------------------------------------
    def telemetry(self):
        if self._telemetry is None:
            from ...telemetry.request import RequestTelemetry
            from ...telemetry.setup import engine_telemetry
            tel = engine_telemetry()
            self._providers = (tel.tracer_provider, tel.meter_provider)
            self._telemetry = RequestTelemetry(tel.tracer_provider, tel.meter_provider, provider_name="vllm",
                                               instrumentation_name="otel_gpu_census.vllm")
        return self._telemetry

    def _model_name(self, scheduler) -> Optional[str]:
        if self._model is None:
            cfg = getattr(getattr(scheduler, "vllm_config", None), "model_config", None)
            name = getattr(cfg, "served_model_name", None) or getattr(cfg, "model", None)
            if isinstance(name, (list, tuple)):
                name = name[0] if name else None
            self._model = str(name) if name else ""
        return self._model or None


class RequestLog:
    """Each settled request as one JSON line beside the engine's segment
    (``gpu-census-<pid>-<start>.requests.jsonl``), so ``report`` prints per-request figures after the
    run, and the ledger's totals as the last line at shutdown. Times in Unix ns (the OTLP names).
    Bounded: at most MAX_LINES requests, then one log line; written by the settling thread."""

    MAX_LINES = 200_000

    def __init__(self, engine=None):
        self._f = None
        self._lines = 0
        self._failed = False
        self._engine = engine

    def _segment(self) -> str:
        """The engine's segment; with TP/PP > 1 EngineCore may launch no GPU work of its own (no
        segment): then the name its segment would have, in the folder its workers write to."""
        seg = injector.segment_path()
        ranks = getattr(self._engine, "ranks", None)
        if seg or ranks is None or not ranks.paths:
            return seg
        ticks = proctree.proc_start_ticks(os.getpid())
        return os.path.join(os.path.dirname(next(iter(ranks.paths.values()))),
                            f"gpu-census-{os.getpid()}-{ticks}.seg")

    def _open(self):
        if self._f is None and not self._failed:
            seg = self._segment()
            if not seg:
                return None
            try:
                fd = os.open(seg[:-len(".seg")] + ".requests.jsonl",
                             os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                self._f = os.fdopen(fd, "a", buffering=1)
            except OSError as e:
                self._failed = True
                log.warning("otel-gpu-census: cannot write the request log beside %s: %s", seg, e)
        return self._f

    def _put(self, obj) -> None:
        f = self._open()
        if f is None:
            return
        try:
            f.write(json.dumps(obj, separators=(",", ":")) + "\n")
        except OSError as e:
            self._failed = True
            log.warning("otel-gpu-census: request log write failed: %s", e)

    def write(self, s, tracked, facts, error_type) -> None:
        if self._lines >= self.MAX_LINES:
            if self._lines == self.MAX_LINES:
                log.warning("otel-gpu-census: request log full (%d requests); spans go on", self.MAX_LINES)
                self._lines += 1
            return
        self._lines += 1
        obj = {"id": external_id(s.key), "response_id": response_id(s.key), "start_time_unix_nano": tracked.start_ns, "end_time_unix_nano": s.end_ns,
               "input_tokens": facts.get("gen_ai.usage.input_tokens"),
               "output_tokens": facts.get("gen_ai.usage.output_tokens"), "status": s.status, "steps": s.steps,
               "gpu": share_attributes("", s.share), "prefill": share_attributes("", s.prefill)}
        if s.weights:
            obj["kv"] = {"stored_blocks": s.weights.get(STORE, 0), "loaded_blocks": s.weights.get(LOAD, 0),
                         "gpu": share_attributes("", s.sub, always=False)}
        if tracked.first_token_ns:
            obj["first_token_time_unix_nano"] = tracked.first_token_ns
        if error_type:
            obj["error"] = error_type
        self._put(obj)

    def summary(self, ledger, errors: int = 0) -> None:
        self._put({"summary": {"method": METHOD, "steps_split": ledger.settled_sid, "settle_errors": errors,
                               "steps_missing": ledger.steps_missing, "steps_dropped": ledger.steps_dropped,
                               "kv_sub_steps": ledger.sub_steps,
                               "ranks": {str(pid): {k: share_attributes("", Share.from_row(v)) for k, v in per.items()}
                                         for pid, per in ledger.per_process.items()},
                               "kv_total": share_attributes("", Share.from_row(ledger.sub_total)),
                               "total": share_attributes("", Share.from_row(ledger.total)),
                               "unattributed": share_attributes("", Share.from_row(ledger.unattributed))}})
        if self._f is not None:
            try:
                self._f.close()
            except OSError:
                pass
            self._f = None


def kv_attributes(s) -> Dict[str, Any]:
    """A settled request's KV-offload figures: blocks it stored and loaded, and the part of its GPU
    share those transfers were (``gpu_census.kv_offload.*``, included in ``gpu_census.*``)."""
    out: Dict[str, Any] = {}
    for kind, name in ((STORE, "vllm.kv_offload.stored_blocks"), (LOAD, "vllm.kv_offload.loaded_blocks")):
        if s.weights.get(kind):
            out[name] = s.weights[kind]
    if out:
        out.update(share_attributes("gpu_census.kv_offload.", s.sub, always=False))
    return out


def _extract(headers: Mapping[str, str]):
    """The caller's context from W3C trace headers, or None (a root span)."""
    if "traceparent" not in headers:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    return TraceContextTextMapPropagator().extract(headers)
