"""What every engine integration (vLLM, SGLang) does with its hooks, once: steps, requests, settling.

An engine hook tells :class:`StepEngine` three things, from the engine's own thread:

- a step begins: ``open_step({request id: scheduled tokens})`` pushes a new step id on the launching
  thread (``injector.step_begin``), so the census tallies its kernels and copies under that id, and
  hands the step's tokens to the :class:`~otel_gpu_census.attribution.steps.StepLedger`;
  ``reopen_step()`` tags later launches of the same step (vLLM's ``sample_tokens``, SGLang's delayed
  sampling); ``end_step(sid)`` pops it (the instrumentors' closing guards pop it even when the
  integration went off in between, so no step stays open on the engine thread);
- ids come from one increasing sequence (``next_sid``) shared by steps and their *sub-steps* (GPU work
  inside a step that belongs to particular requests, such as vLLM's KV-offload transfers: opened on the
  ledger with a kind of their own and claimed per request, ``StepLedger.step_claimed``);
- a request starts (``start_request``: the ledger follows it from then, ``request_started``), has its
  first token (``first_token``), ends (``request_done``; ``awaiting=True`` when a sub-step still to open
  will claim it); every request that starts ends in exactly one span and one log line: one the engine
  let go of without an end the hooks saw is closed by a sweep (its engine object is gone: a weak
  reference says so), at most MAX_OPEN are open at once, and those still open when the engine (or its
  settling) ends are closed then, each with a note and status ``partial``;
- the engine shuts down (``shutdown``): the census's final flush first, then every request settled,
  spans out.

Settling reads the census a few times a second, splits each completed step among its requests
(``attribution/steps.py``) and ends each request's span through the one request lifecycle
(``telemetry/request.py``), with its share; each settled request is also one JSON line beside the
segment (:class:`RequestLog`, what ``report`` reads). It runs in a process of its own by default
(``settle_process.py``: the engine records, a child replays the records into the same class and
settles, so the engine's loop shares its GIL with nothing of ours but the recording), or in a
thread beside the engine's (``OTEL_GPU_CENSUS_SETTLE=thread``, tests, or no child could start).
The census is this process's own segment, or (``ledger.read`` replaced by a subclass) the segments
of the processes that run its steps, one ``(header, steps)`` pair each (vLLM's TP/PP workers,
``integrations/vllm/ranks.py``): a request's share is then the sum over processes. The engine thread
only counts and appends. Subclasses
(``integrations/vllm/engine.py``, ``integrations/sglang/engine.py``) read their engine's objects and call
these methods; nothing here knows an engine.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
import weakref
from typing import Any, Dict, List, Mapping, Optional, Tuple

from opentelemetry.trace import SpanKind

from otel_gpu_census import injector
from otel_gpu_census.attribution.cost_model import ModelShape
from otel_gpu_census.attribution.ledger import COMPLETE, PARTIAL, STALE, GpuCost
from otel_gpu_census.attribution.shares import Share
from otel_gpu_census.attribution.steps import (ALONE_METHOD, FLOPS_METHOD, METHOD, METHODS, MODEL_METHOD, PRICED,
                                               TOKENS, StepLedger)
from otel_gpu_census.census import reader
from otel_gpu_census.telemetry import redact
from otel_gpu_census.telemetry.attributes import share_attributes
from otel_gpu_census.integrations.engine import settle_process

log = logging.getLogger("otel_gpu_census.engine")

SETTLE_PERIOD_S = 0.25
STEP_NOTE = ("step attribution: this request's share of the GPU work of every engine step that served "
             "it, an allocation of each step's measured kernels and copies among the step's requests "
             "({split}); GPU work outside steps (start-up, compilation, graph capture) and steps that "
             "served nobody are not anyone's")
SPLITS = {METHOD: "by their scheduled tokens",
          FLOPS_METHOD: "kernels by each request's estimated FLOPs in the step (its tokens and the context "
                        "before them), copies by tokens",
          ALONE_METHOD: "kernels by what each request's part of the step would cost alone (its estimated FLOPs "
                        "plus a step's fixed cost, fitted on this engine's steps), copies by tokens",
          MODEL_METHOD: "kernels by each request's part of the step's cost as fitted on this engine's steps of its "
                        "kind (a step's fixed cost shared, plus per request, per token and per attention pair), "
                        "copies by tokens"}
ATTRIBUTION_ENV = "OTEL_GPU_CENSUS_ATTRIBUTION"     # tokens (default) | flops | alone | model: how steps are split
SWEEP_PERIOD_NS = 5_000_000_000     # how often the engine thread looks for requests the engine let go of
MAX_OPEN = 1 << 16                  # requests open at once (beyond: the oldest is closed)
SWEPT = ("closed by the sweep: the engine let go of it without an end the hooks saw (its end time is "
         "when the sweep found it)")
TOO_MANY = f"closed early: more than {MAX_OPEN} requests were open at once (the oldest is closed)"
ENGINE_ENDED = "the engine ended before it did"


def attribution_method(env=os.environ) -> str:
    """The ledger's method from OTEL_GPU_CENSUS_ATTRIBUTION (tokens, the default, flops or alone)."""
    v = (env.get(ATTRIBUTION_ENV) or "tokens").strip().lower()
    if v not in METHODS:
        log.warning("otel-gpu-census: %s=%r is not one of %s; splitting steps by tokens", ATTRIBUTION_ENV, v,
                    " | ".join(METHODS))
        v = "tokens"
    return METHODS[v]


class StepEngine:
    """One per engine process: the step counter, the ledger, the requests' spans, the settler.

    Subclasses set PROVIDER (``gen_ai.provider.name``), SCOPE (the instrumentation scope) and NOTE (the
    cost's note), and may override :meth:`request_ids` (the ids a request's log line carries: by default
    its span's ``gen_ai.request.id`` and ``gen_ai.response.id``),
    :meth:`census_pids` / :meth:`census_elsewhere` / :meth:`log_segment` (when the steps run in other
    processes), :meth:`span_attributes` and :meth:`log_fields` (what a settled request adds)."""

    PROVIDER = "engine"
    SCOPE = "otel_gpu_census.engine"
    NOTE = STEP_NOTE
    providers: Tuple = (None, None)          # (tracer, meter) providers given to the instrumentor

    def __init__(self, telemetry=None, read=None, clock=time.time_ns, settle_period_s: float = SETTLE_PERIOD_S,
                 settle_in: Optional[str] = None):
        """settle_in: "process" (a child settles; the default of a real engine), "thread" (the default
        when telemetry or read is given: tests), or "child" (this is that child: the engine's census
        is read, and nothing is recorded on an engine thread)."""
        self.clock = clock
        self.census_pid = os.getpid()        # whose census is read (a settling child reads its engine's)
        self.settling_child = settle_in == "child"
        self.settling_segment = ""           # the child: the engine's segment path, as the engine sends it
        if settle_in is None:
            settle_in = "thread" if telemetry is not None or read is not None else settle_process.settle_mode()
        self.method = attribution_method()
        self.remote: Optional[settle_process.Remote] = None
        if settle_in == "process":           # the child starts with the first settling (subclasses set up first)
            self.remote = settle_process.Remote(self, self.segment_path)
            self.ledger = self.remote.ledger
        else:
            self.ledger = self._new_ledger(read or self._read_own_census)
        self._telemetry = telemetry          # RequestTelemetry, made on first use (providers from OTEL_*)
        self._tracked: Dict[str, Any] = {}   # request id -> TrackedRequest (_Pending where a child settles)
        # requests started and not ended (in start order): key -> (weak reference to the engine's
        # object or None, prompt tokens)
        self._open: Dict[str, Tuple[Optional[weakref.ref], Optional[int]]] = {}
        self._next_sweep = 0
        self._log_ids: Dict[str, Tuple[str, str]] = {}   # key -> (request id, response id) of its log line
        self.shape: Optional[ModelShape] = None
        self.settled_requests = 0            # spans ended (a settling child acknowledges them)
        self.requests_dropped = 0            # requests that got no span (a settling child died with them)
        self.first_due: set = set()          # tracked requests without their first token yet
        self.sid = 0                         # the current step (last open_step)
        self._last_id = 0                    # the last id handed out: steps and their sub-steps
        self.has_scheduler = False           # requests live in this process
        self.tagging = False                 # the injector is counting here and steps are tagged
        self._period = settle_period_s
        self._wake = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._stopped = False
        self._shutdown_done = False
        self._requests_log = RequestLog(self)
        self._providers: Tuple = ()
        self.settle_errors = 0
        self._final_lock = threading.Lock()
        self._summarised = False             # the summary line is written (and telemetry flushed) once

    def _new_ledger(self, read) -> StepLedger:
        led = StepLedger(read, clock=self.clock, follows=True, method=self.method)
        led.set_shape(getattr(self, "shape", None))
        return led

    @property
    def wants_context(self) -> bool:
        """Whether steps need the tokens computed before them (the FLOPs and alone splits): hooks read them
        only then."""
        return self.method in (FLOPS_METHOD, ALONE_METHOD, MODEL_METHOD)

    def set_shape(self, shape: Optional[ModelShape]) -> None:
        """The model's shape (engine configuration), for the FLOPs split: before the first step."""
        if shape is None or shape == self.shape:
            return
        self.shape = shape
        if self.remote is not None:
            self.remote.record_sticky(("L", "set_shape", (shape,), None))
        else:
            self.ledger.set_shape(shape)

    # -- the census of this process (of the engine, in a settling child) ---------------------------
    def segment_path(self) -> str:
        return self.settling_segment if self.settling_child else injector.segment_path()

    def _read_own_census(self, lo: int, hi: int):
        path = self.segment_path()
        if not path:                         # no buffer completed yet: the segment does not exist
            return None, {}
        head = reader.read_segment(path, detail=False)
        return head, {s.id: s for s in reader.read_steps(path, lo, hi + 1)}

    # -- steps (engine thread) --------------------------------------------------------------------
    def open_step(self, tokens: Optional[Mapping[str, int]], before: Optional[Mapping[str, int]] = None,
                  sid: int = 0, state: Optional[tuple] = None, redo: Optional[Mapping[str, int]] = None) -> int:
        """A new step id (or `sid`, taken earlier with next_sid and tagged since), tagged on this thread;
        `tokens` ({request: scheduled tokens}, or None where the requests live in another process),
        `before` ({request: tokens computed before this step}, for the FLOPs split), `state` (the engine's,
        attribution/engine_state.FIELDS) and `redo` ({request: of its tokens, those recomputed after a
        preemption}) go to the ledger."""
        sid = self.sid = sid or self.next_sid()
        if self.has_scheduler and tokens is not None:
            if state is not None or redo:
                self.ledger.step_opened(sid, dict(tokens), self.clock(), TOKENS, before, state, redo or None)
            elif before is not None:
                self.ledger.step_opened(sid, dict(tokens), self.clock(), before=before)
            else:
                self.ledger.step_opened(sid, dict(tokens), self.clock())
        self._tag(sid)
        return sid

    def _tag(self, sid: int) -> None:
        tagging = injector.step_begin(sid)
        if tagging != self.tagging:
            self.tagging = tagging
            if self.remote is not None:
                self.remote.record_sticky(("tagging", tagging))

    def next_sid(self) -> int:
        """The next id of the one increasing sequence of steps and sub-steps (the census's step ring
        takes ids in increasing order). Without requests here (a TP/PP worker) only steps take ids,
        so every rank numbers its steps alike."""
        self._last_id += 1
        return self._last_id

    def reopen_step(self) -> int:
        """The same step as the last open_step, tagged again on this thread (0: nothing to tag)."""
        if self.sid and injector.step_begin(self.sid):
            return self.sid
        return 0

    def end_step(self, sid: int) -> None:
        injector.step_end()
        if self.has_scheduler:
            now = self.clock()
            self.ledger.step_touched(sid, now)
            self._ensure_settler()
            self.maybe_sweep(now)

    def maybe_sweep(self, now: int) -> None:
        """The sweep, once SWEEP_PERIOD_NS has passed since the last (from the engine thread's step end)."""
        if now >= self._next_sweep:
            self._next_sweep = now + SWEEP_PERIOD_NS
            self.sweep()

    # -- requests (engine thread) -----------------------------------------------------------------
    def tracked(self, key: str) -> bool:
        return key in self._tracked

    def start_request(self, key: str, *, start_ns: int, operation: str, model: Optional[str],
                      headers: Mapping[str, str], attributes: Mapping[str, Any], prompt_tokens: Optional[int] = None,
                      obj: Any = None, ids: Optional[Tuple[int, int]] = None, note: Optional[str] = None,
                      tenant: Optional[str] = None) -> None:
        """A request the engine took in: its span starts at start_ns under the caller's context. `ids`:
        (trace id, span id) chosen beforehand, because the engine's own SERVER span (vLLM's llm_request)
        will hang under it; the span is then INTERNAL, so a request has one SERVER span. `obj`: the engine's
        own object for it, whose end (garbage) without request_done the sweep notices; `note`: what its share
        misses already; `tenant`: who its share is charged to (telemetry/tenant.py, read by the hook that
        carried it here; it travels in the start record, so a settling child has it)."""
        self.has_scheduler = True
        if key in self._tracked or key in self._open:
            return
        if len(self._open) >= MAX_OPEN:
            self.sweep()
            while len(self._open) >= MAX_OPEN:
                self._close(next(iter(self._open)), TOO_MANY, None)
        ref = None
        if obj is not None:
            try:
                ref = weakref.ref(obj)
            except TypeError:
                pass
        self._open[key] = (ref, prompt_tokens)
        self.first_due.add(key)
        if self.remote is not None:          # the span is the child's; here, what the hooks ask after
            start = {"start_ns": start_ns, "operation": operation, "model": model, "headers": dict(headers),
                     "attributes": dict(attributes), "prompt_tokens": prompt_tokens, "ids": ids, "tenant": tenant}
            self._tracked[key] = _Pending(start_ns, start)
            self.remote.record(("start", key, dict(start, note=note)))
            return
        self.ledger.request_started(key, prompt_tokens)
        if note:
            self.ledger.note(key, note)
        ids_of = (attributes.get("gen_ai.request.id"), attributes.get("gen_ai.response.id"))
        if ids_of != (None, None):
            self._log_ids[key] = (ids_of[0] or key, ids_of[1] or ids_of[0] or key)
        self._tracked[key] = self.telemetry().start(
            start_ns=start_ns, operation=operation, model=model,
            span_name=f"{operation} {model}" if model else operation, parent=extract(headers),
            attributes=attributes, ids=ids, kind=SpanKind.INTERNAL if ids else SpanKind.SERVER, tenant=tenant)

    def first_token(self, key: str, now: int, attributes: Optional[Mapping[str, Any]] = None) -> bool:
        """The request's first token came out at `now` (the first call counts); False if untracked."""
        t = self._tracked.get(key)
        if t is None or t.first_token_ns is not None:
            return False
        self.first_due.discard(key)
        if self.remote is not None:
            t.first_token_ns = now
            self.remote.record(("first", key, now, attributes))
            return True
        t.first_token(now)
        self.ledger.first_token(key, now)
        if attributes:
            t.set_attributes(attributes)
        return True

    def request_done(self, key: str, facts: Dict[str, Any], error_type: Optional[str] = None,
                     awaiting: bool = False, end_ns: Optional[int] = None, note: Optional[str] = None) -> None:
        """The request ended now (or at end_ns: a settling child replaying it); no later step serves
        it. `facts` are its span attributes (``gen_ai.usage.output_tokens`` among them). awaiting: a
        sub-step still to open will claim it (its last KV blocks are stored after its end): the
        ledger waits for that. `note`: what its share misses (its status becomes partial)."""
        self.first_due.discard(key)
        self._open.pop(key, None)
        if self.remote is not None:
            if self._tracked.pop(key, None) is not None:
                self.remote.record(("done", key, facts, error_type, awaiting, self.clock(), note))
            return
        t = self._tracked.get(key)
        if t is None:
            return
        t.served()
        if note:
            self.ledger.note(key, note)
        self.ledger.request_done(key, (facts, error_type), self.clock() if end_ns is None else end_ns,
                                 awaiting=awaiting)
        if not self.tagging:                 # no census here: nothing to wait for
            self._ensure_settler()

    # -- requests nobody said ended ------------------------------------------------------------------
    def sweep(self) -> int:
        """Close the requests whose engine object is gone (the engine let go of them without an end
        the hooks saw). Their number."""
        gone = [k for k, (ref, _) in list(self._open.items()) if ref is not None and ref() is None]
        for key in gone:
            self._close(key, SWEPT, None)
        return len(gone)

    def close_open(self, note: str = ENGINE_ENDED, error_type: Optional[str] = "shutdown") -> int:
        """Close every request still open (the engine, or what settles it, is ending). Their number."""
        keys = list(self._open)
        for key in keys:
            self._close(key, note, error_type)
        return len(keys)

    def _close(self, key: str, note: str, error_type: Optional[str]) -> None:
        _, prompt = self._open.get(key, (None, None))
        facts = {"gen_ai.usage.input_tokens": prompt} if prompt is not None else {}
        self.request_done(key, facts, error_type, note=note)
        self._open.pop(key, None)

    def in_flight(self) -> List[Tuple[str, Dict[str, Any], Optional[int]]]:
        """(key, start record, first token ns) of each request a settling child follows now: what a new
        child is told when the first one dies (called from the shipper's thread)."""
        return [(k, t.start, t.first_token_ns) for k, t in list(self._tracked.items()) if isinstance(t, _Pending)]

    def request_ids(self, key: str) -> Tuple[str, str]:
        """(the request's id, the id of the response its client got), for its log line: its span's
        gen_ai.request.id and gen_ai.response.id where it started with them."""
        return self._log_ids.get(key, (key, key))

    # -- where the census is, what a settled request adds (subclasses) ------------------------------
    def census_pids(self) -> List[int]:
        """The processes whose census the ledger reads (a cost's ``pids``)."""
        return [self.census_pid]

    def census_elsewhere(self) -> bool:
        """Whether the steps' GPU work is in other processes' segments (still running, and flushing,
        when this one shuts down)."""
        return False

    def log_segment(self) -> str:
        """The segment the request log is written beside ("": none yet)."""
        return self.segment_path()

    def span_attributes(self, s) -> Dict[str, Any]:
        """Attributes a settled request's span gets beyond its facts (e.g. its sub-steps' figures)."""
        return {}

    def log_fields(self, s) -> Dict[str, Any]:
        """Fields a settled request's log line gets beyond the common ones."""
        return {}

    def exports(self) -> bool:
        """Whether this process's requests are exported (False: another rank reports them)."""
        return True

    def export_nothing(self) -> None:
        """Spans and metrics to nowhere (the request log is still written): a settling child of an
        engine whose exports() is False."""
        from opentelemetry.metrics import NoOpMeterProvider
        from opentelemetry.trace import NoOpTracerProvider

        from otel_gpu_census.telemetry.request import RequestTelemetry
        self._telemetry = RequestTelemetry(NoOpTracerProvider(), NoOpMeterProvider(),
                                           provider_name=self.PROVIDER, instrumentation_name=self.SCOPE)

    # -- settling (its own thread) ----------------------------------------------------------------
    def _ensure_settler(self) -> None:
        if self.settling_child:              # its loop settles (settle_process.serve)
            return
        if self.remote is not None:
            if self.remote.ensure():
                return
            self._settle_here()              # no child: this engine settles after all, nothing lost
        if self._thread is None and not self._stopped:
            self._thread = threading.Thread(target=self._run, name="otel-gpu-census-settle", daemon=True)
            self._thread.start()

    def _settle_here(self) -> None:
        """No child could start (or the last one died): a real ledger, and what was recorded for a child
        applied here (the requests a dead one followed announced again, partial)."""
        remote, self.remote = self.remote, None
        events = remote.take_over()
        opened = dict(self._open)            # (their weak references: the replay below has no objects)
        self._tracked.clear()                # placeholders: the replay below makes the spans
        self.first_due.clear()
        self._open.clear()
        self.ledger = self._new_ledger(self._read_own_census)
        for ev in events:
            settle_process.apply(self, ev)
        for key, (ref, _) in opened.items():
            if key in self._open and ref is not None:
                self._open[key] = (ref, self._open[key][1])

    def _run(self) -> None:
        while not self._stopped:
            self._wake.wait(self._period)
            self._wake.clear()
            if self._stopped:
                break
            self.settle_once()

    def settle_once(self) -> None:
        """One settling round (the thread's, or a settling child's): settle what the census completed;
        if the census has ended, the final outputs."""
        try:
            self.settle()
            if self.has_scheduler and not self._summarised and self.census_finished():
                # asked to finish by the process about to stop this one (census=finish), which
                # may never let its main thread reach shutdown(): the last requests are settled
                # by now (an exited census completes every step); write and send them here
                self._final_outputs(self._period * 4)
        except Exception:                    # the census can be unreadable for a moment: try again
            self.settle_errors += 1
            if self.settle_errors == 1:      # but say so once, with the reason
                log.warning("otel-gpu-census: settling requests failed (retrying every %.2f s)",
                            self._period, exc_info=True)

    def summarised(self) -> bool:
        return self._summarised

    def census_finished(self) -> bool:
        """This process's own census has ended (its segment says exited): nothing more will be counted."""
        path = self.segment_path()
        return bool(path) and reader.read_segment(path, detail=False).state_name == "exited"

    def _final_outputs(self, timeout_s: float) -> None:
        """Once: every waiting request settled, spans and metrics sent, then the ledger's summary line:
        what a stopping manager waits for (census/control.finish) before it kills this process, so
        the export goes first (bounded by timeout_s)."""
        with self._final_lock:
            if self._summarised:
                return
            self._summarised = True
            if self.has_scheduler:
                self.settle(final=True)
            if self._telemetry is not None:
                self.flush_telemetry(timeout_s)
            if self.has_scheduler:
                self._requests_log.summary(self.ledger, self.settle_errors, self.requests_dropped)

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
            attrs.update(self.span_attributes(s))
            if s.recomputed_tokens:
                attrs.update(preemption_attributes(s))
            if self.tagging:
                method = self.ledger.method
                cost = GpuCost(status=_STATUS.get(s.status, STALE), method=method,
                               steps=s.steps, note="; ".join(x for x in (self.NOTE.format(split=SPLITS[method]),
                                                                         s.split_note) if x),
                               share=s.share, prefill=s.prefill,
                               pids=self.census_pids(), notes=list(s.notes), kernel_tracing=list(s.kernel_tracing),
                               kernel_traced_ns=s.kernel_traced_ns, kernel_span_ns=s.kernel_span_ns,
                               kernel_counted=s.kernel_counted, eager_mean_ns=s.eager_mean_ns,
                               kernel_priced=s.kernel_priced, prefill_priced=s.prefill_priced)
            t.finish(s.end_ns, cost=cost, attributes=attrs, output_tokens=facts.get("gen_ai.usage.output_tokens"),
                     error_type=error_type, kv_offload=s.sub)
            self._requests_log.write(s, t, facts, error_type)
            self._log_ids.pop(s.key, None)
            self.settled_requests += 1
        states = getattr(self.ledger, "states", None)      # (none where a child settles)
        if states is not None:
            self._requests_log.states(states.drain(final))
        return len(done)

    def dropped(self, n: int) -> None:
        """`n` requests of this engine got no span (a settling process died with them): counted."""
        if n > 0:
            self.requests_dropped += n
            self.telemetry().dropped(n)

    # -- the end of the engine ----------------------------------------------------------------------
    def shutdown(self, timeout_s: float = 3.0) -> None:
        """At the engine's end: the census's final flush (engines may end their process without
        running atexit handlers), every waiting request settled, spans and metrics exported. Bounded.

        The flush comes first: the engine may be killed within a short grace (vLLM SIGKILLs its engine
        3 s after SIGTERM), and under CPU load joining the settler and settling can take most of it;
        a segment without the final flush loses the totals of its last buffers. Settling reads the
        flushed census after it."""
        if self._shutdown_done:
            return
        self._shutdown_done = True
        injector.finish()
        self._stopped = True
        self.close_open()
        if self.remote is not None and (self.remote.pending() or self.remote.dead):
            self._ensure_settler()           # requests recorded, no step yet: the child starts now (or the
                                             # engine settles, where none can)
        if self.remote is not None:          # the child settles, flushes and writes the summary
            self.remote.finish(timeout_s)
            return
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s / 3)
        self.settle_to_end(timeout_s)

    def settle_to_end(self, timeout_s: float) -> None:
        """The end of settling: what other processes' census still completes, then the final outputs."""
        if self.census_elsewhere():          # those processes still run (and flush): let their census catch up
            deadline = time.monotonic() + timeout_s / 2
            while self.ledger.pending() and time.monotonic() < deadline:
                self.settle()
                time.sleep(0.05)
        self._final_outputs(timeout_s)

    def flush_spans(self, timeout_s: float) -> bool:
        """The spans ended so far exported (False: the exporter did not confirm within timeout_s)."""
        for provider in self._providers[:1]:
            try:
                if hasattr(provider, "force_flush") and provider.force_flush(int(timeout_s * 1000)) is False:
                    return False
            except Exception:
                return False
        return True

    def flush_telemetry(self, timeout_s: float) -> None:
        for provider in self._providers:
            try:
                if hasattr(provider, "force_flush"):
                    provider.force_flush(int(timeout_s * 1000))
            except Exception:
                log.debug("flush at shutdown failed", exc_info=True)

    # -- providers ----------------------------------------------------------------------------------
    def telemetry(self):
        if self._telemetry is None:
            from otel_gpu_census.telemetry.request import RequestTelemetry
            from otel_gpu_census.telemetry.setup import engine_telemetry
            tel = engine_telemetry(*self.providers, service_name=self.PROVIDER)     # service.name: the engine
            self._providers = (tel.tracer_provider, tel.meter_provider)
            self._telemetry = RequestTelemetry(tel.tracer_provider, tel.meter_provider,
                                               provider_name=self.PROVIDER, instrumentation_name=self.SCOPE)
        return self._telemetry


_STATUS = {"complete": COMPLETE, "partial": PARTIAL}   # the ledger's word -> GpuCost.status (else STALE)


class _Pending:
    """An engine's note of a request its settling child follows (the span is the child's): what a new
    child needs to follow it if the first one dies."""
    __slots__ = ("start_ns", "first_token_ns", "start")

    def __init__(self, start_ns: int, start: Dict[str, Any]):
        self.start_ns = start_ns
        self.first_token_ns: Optional[int] = None
        self.start = start


class RequestLog:
    """Each settled request as one JSON line beside the engine's segment
    (``gpu-census-<pid>-<start>.requests.jsonl``), so ``report`` prints per-request figures after the
    run, and the ledger's totals as the last line at shutdown. Times in Unix ns (the OTLP names). A line has
    the request's ``tenant`` (where it had one: telemetry/tenant.py) and ``model`` (the LoRA adapter's name where
    one served it), for ``report --by tenant|model``.
    Bounded: at most MAX_LINES requests, then one log line; written where settling runs. Under
    sampled or counted kernel tracing a line also has ``kernel_tracing`` (the modes, as the span's
    ``gpu_census.kernel.tracing``) and ``kernel_traced_ratio``; under counted tracing its kernel times
    are estimates (Settled.share_time: its parts of each step's kernel time priced once, which add up to the
    summary's steps exactly) and ``kernel_time_estimated`` says so (as the span's
    ``gpu_census.kernel.time_estimated``), with ``kernel_time_unknown`` when no sample priced its
    eager launches."""

    MAX_LINES = 200_000

    def __init__(self, engine=None):
        self._engine = engine                # its request_ids, log_segment, log_fields (StepEngine)
        self._f = None
        self._lines = 0
        self._failed = False

    def _segment(self) -> str:
        return self._engine.log_segment() if self._engine is not None else injector.segment_path()

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
        eng = self._engine
        rid, response = eng.request_ids(s.key) if eng is not None else (s.key, s.key)
        kt = s.share_time()
        obj = {"id": rid, "response_id": response, "start_time_unix_nano": tracked.start_ns, "end_time_unix_nano": s.end_ns,
               "input_tokens": facts.get("gen_ai.usage.input_tokens"),
               "output_tokens": facts.get("gen_ai.usage.output_tokens"), "status": s.status, "steps": s.steps,
               "method": eng.ledger.method if eng is not None else METHOD,
               "gpu": share_attributes("", s.share, kernel_ns=kt.ns),
               "prefill": share_attributes("", s.prefill, kernel_ns=s.prefill_time().ns)}
        if s.kernel_tracing and s.kernel_tracing != ["all"]:
            # sampled: its kernel figures are a sample, kernel.time_ns / kernel_traced_ratio estimates the
            # whole; counted: its kernel counts are exact and kernel.time_ns is already an estimate
            obj["kernel_tracing"] = ",".join(s.kernel_tracing)
            obj["kernel_traced_ratio"] = round(s.kernel_traced_ratio, 4)
        if s.kernel_counted:
            obj["kernel_time_estimated"] = kt.estimated
            if kt.unknown:
                obj["kernel_time_unknown"] = True
        if eng is not None:
            obj.update(eng.log_fields(s))
        # who it is charged to, for `report --by tenant|model` (absent: unknown)
        if getattr(tracked, "tenant", None):
            obj["tenant"] = tracked.tenant
        if getattr(tracked, "model", None):
            obj["model"] = redact.printable(redact.cut(str(tracked.model), 256))
        if tracked.first_token_ns:
            obj["first_token_time_unix_nano"] = tracked.first_token_ns
        if error_type:
            obj["error"] = error_type
        if s.notes:
            obj["notes"] = list(s.notes)
        if s.split_note:
            obj["split_note"] = s.split_note
        if s.recomputed_tokens:
            obj["preemption"] = {"recomputed_tokens": s.recomputed_tokens, "recompute_kernel_time_ns": s.recompute_ns}
        self._put(obj)

    def states(self, buckets) -> None:
        """The engine's state per second (attribution/engine_state.py), one line each, within MAX_LINES."""
        for b in buckets:
            if self._lines >= self.MAX_LINES:
                return
            self._lines += 1
            self._put({"engine_state": b, "engine": self._engine.PROVIDER if self._engine is not None else None})

    def summary(self, ledger, errors: int = 0, dropped: int = 0) -> None:
        """The ledger's totals. Their kernel.time_ns is each step's kernel time priced once (the same figures the
        requests' kernel.time_ns are parts of: ``kernel_time_conserved``), with the eager launches no mean could
        price counted in ``kernel_time_unpriced``."""
        kt = ledger.kernel_times
        out = {"method": ledger.method, "steps_split": ledger.settled_sid, "settle_errors": errors,
               "steps_missing": ledger.steps_missing, "steps_dropped": ledger.steps_dropped,
               "requests_partial": ledger.partial, "requests_dropped": dropped,
               "kv_sub_steps": ledger.sub_steps,
               "ranks": {str(pid): {k: share_attributes("", Share.from_row(v), kernel_ns=v[PRICED])
                                    for k, v in per.items()} for pid, per in ledger.per_process.items()},
               "kv_total": share_attributes("", Share.from_row(ledger.sub_total)),
               "total": share_attributes("", Share.from_row(ledger.total), kernel_ns=kt["total"][0]),
               "unattributed": share_attributes("", Share.from_row(ledger.unattributed),
                                                kernel_ns=kt["unattributed"][0]),
               "kernel_time_conserved": True}
        if ledger.states.steps:
            out["engine_state_steps"] = ledger.states.steps
        if ledger.recomputed[0]:
            out["recomputed"] = {"tokens": ledger.recomputed[0], "kernel_time_ns": ledger.recomputed[1]}
        if kt["total"][1]:
            out["kernel_time_unpriced"] = {"total": kt["total"][1], "unattributed": kt["unattributed"][1]}
        self._put({"summary": out})
        if self._f is not None:
            try:
                self._f.close()
            except OSError:
                pass
            self._f = None


def preemption_attributes(s) -> Dict[str, Any]:
    """A preempted request's recomputation: the tokens computed again, and their part of its kernel time."""
    return {"gpu_census.preemption.recomputed_tokens": s.recomputed_tokens,
            "gpu_census.preemption.kernel.time": s.recompute_ns / 1e9}


def extract(headers: Mapping[str, str]):
    """The caller's context from W3C trace headers, or None (a root span)."""
    if "traceparent" not in headers:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    return TraceContextTextMapPropagator().extract(headers)
