"""The scheduler side of the SGLang integration: steps, requests and their spans, per scheduler process.

SGLang runs one scheduler process per (TP, PP) rank, and each drives its own GPU: its own census
segment, its own steps. Every rank

- tags each batch's GPU work as one step: its preparation (``get_next_batch_to_run`` and the
  disaggregation modes' own: ``prepare_for_extend`` / ``prepare_for_decode`` copy the batch's inputs to
  the GPU there), ``Scheduler.run_batch`` and, with the overlap scheduler, the delayed sampling
  ``launch_batch_sample_if_needed`` of the same batch, with the batch's ``{rid: scheduled tokens}``
  (an extend batch: ``extend_lens``, one per request in ``reqs``; a decode batch: one token each) and,
  for the FLOPs split, the tokens each had before (``prefix_lens``; ``seq_lens_cpu`` less the new one);
- follows each request (``_add_request_to_queue`` .. the ``stream_output`` that carries its last
  output, or ``send_abort_output``, which ends the requests SGLang drops outside the output stream:
  aborted while queued or in a chunked prefill, rejected for the queue or its priority, retracted for
  good), with the caller's trace context that the HTTP-side hooks carried to it;
- splits its steps among their requests and writes one JSON line per request beside its segment.

Spans and request metrics come from one rank per group of ranks that share requests (attention-TP rank 0
on the first pipeline stage), with that rank's GPU share; the other ranks' shares are in their request
logs. The shared machinery (step ids, ledger, settling, request log) is ``integrations/engine/steps.py``.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, Mapping, Optional

from otel_gpu_census.attribution.cost_model import ModelShape
from otel_gpu_census.integrations.engine.steps import SETTLE_PERIOD_S, StepEngine
from otel_gpu_census.integrations.sglang.sched_state import Recompute, reader as state_reader

log = logging.getLogger("otel_gpu_census.sglang")

# the key under which the HTTP-side hook keeps a request's trace context on SGLang's own request
# time-stats object (which SGLang pickles to the scheduler); it must not end in "time" (SGLang rebases
# the clocks of such keys)
CARRY_KEY = "_otel_gpu_census"


def operation_for(path: str) -> str:
    """The GenAI operation of an HTTP path (``/v1/chat/completions``, ``/v1/completions``, ``/generate``)."""
    p = path or ""
    if "chat" in p:
        return "chat"
    if "embed" in p:
        return "embeddings"
    return "text_completion"


def step_tokens(batch) -> Dict[str, int]:
    """{rid: tokens this batch computes for it}: extend_lens on an extend (or mixed) batch, else one each
    (decode, and speculative verify, where every request has the same number of draft tokens)."""
    reqs = getattr(batch, "reqs", None) or ()
    mode = getattr(batch, "forward_mode", None)
    lens = getattr(batch, "extend_lens", None)
    out: Dict[str, int] = {}
    if mode is not None and mode.is_extend() and lens is not None and len(lens) >= len(reqs):
        for req, n in zip(reqs, lens):
            out[req.rid] = out.get(req.rid, 0) + int(n)
    else:
        for req in reqs:
            out[req.rid] = 1
    return out


def tokens_before(batch) -> Dict[str, int]:
    """{rid: tokens computed before this batch}: prefix_lens on an extend batch, else each sequence's
    length less the token this step computes (decode)."""
    reqs = getattr(batch, "reqs", None) or ()
    mode = getattr(batch, "forward_mode", None)
    if mode is not None and mode.is_extend():
        pre = getattr(batch, "prefix_lens", None)
        if pre is not None and len(pre) >= len(reqs):
            return {req.rid: int(n) for req, n in zip(reqs, pre)}
        return {}
    lens = getattr(batch, "seq_lens_cpu", None)
    if lens is not None and len(lens) == len(reqs):
        return {req.rid: max(0, int(n) - 1) for req, n in zip(reqs, lens.tolist())}
    return {req.rid: max(0, len(req.origin_input_ids) + len(req.output_ids) - 1) for req in reqs}


def error_of(req) -> Optional[str]:
    reason = getattr(req, "finished_reason", None)
    if reason is not None and type(reason).__name__ == "FINISH_ABORT":
        return "aborted"
    return None


class SchedulerTelemetry(StepEngine):
    """One per scheduler process."""

    PROVIDER = "sglang"
    SCOPE = "otel_gpu_census.sglang"

    def __init__(self, telemetry=None, read=None, clock=time.time_ns, settle_period_s: float = SETTLE_PERIOD_S,
                 reports: Optional[bool] = None, settle_in: Optional[str] = None):
        super().__init__(telemetry=telemetry, read=read, clock=clock, settle_period_s=settle_period_s,
                         settle_in=settle_in)
        self._model: Optional[str] = None
        self._reports = reports              # None: learnt from SGLang's parallel context
        self._sampled_batch = None           # the batch of the last run_batch (its delayed sampling)
        self._ended: set = set()             # rids whose end was seen (overlap streams a finished one twice)
        self._prepared = (None, 0)           # (the batch get_next_batch_to_run returned, its step)
        self._sched: Any = None              # the scheduler (its first run_batch)
        self._state: Optional[Callable] = None   # ... its state reader (None: not yet, or other fields)
        self.recompute = Recompute()         # retracted requests and what they compute again

    # -- steps (scheduler thread) ---------------------------------------------------------------
    def prepare_begin(self) -> int:
        """Before get_next_batch_to_run: the id its batch's step will have, tagged on this thread (0:
        no request in flight, nothing to tag). Not taken yet: a call that returns no batch leaves it to
        the next step."""
        if not self._open:
            return 0
        sid = self._last_id + 1
        self._tag(sid)
        return sid

    def prepared(self, sid: int, plan) -> None:
        """After it: the batch it returned (if any) is step `sid` (run_batch opens it)."""
        batch = getattr(plan, "batch_to_run", None)
        if batch is not None and sid == self._last_id + 1:
            self._last_id = sid
            self._prepared = (batch, sid)

    def batch_begin(self, batch, scheduler=None) -> int:
        """Before Scheduler.run_batch: the step of the batch prepared for it (else a new one), with the
        batch's tokens and the scheduler's state."""
        self._sampled_batch = batch
        prepared, sid = self._prepared
        self._prepared = (None, 0)
        tokens = step_tokens(batch)
        if self._sched is None and scheduler is not None:
            self._sched = scheduler
            self._state = state_reader(scheduler)
        state = redo = None
        if self._state is not None:
            rc = self.recompute
            try:
                if rc.owed or rc.preempted:
                    preempted, redo = rc.step(batch, tokens)
                    state = self._state(batch, preempted, sum(redo.values()) if redo else 0)
                else:                        # (most steps)
                    state = self._state(batch, 0, 0)
            except Exception as e:
                self._state, state, redo = None, None, None
                log.warning("otel-gpu-census: reading SGLang's scheduler state failed (%s: %s); the engine state is "
                            "off", type(e).__name__, e)
        return self.open_step(tokens, tokens_before(batch) if self.wants_context else None,
                              sid=sid if prepared is batch else 0, state=state, redo=redo)

    def retracted(self, result) -> None:
        """After ScheduleBatch.retract_decode: the requests it retracted (the first of what it returns)."""
        if self._state is not None and isinstance(result, tuple) and result:
            self.recompute.retracted(result[0])

    def sample_begin(self, batch) -> int:
        """Before launch_batch_sample_if_needed: the same step as the run_batch of that batch."""
        if batch is None or batch is not self._sampled_batch:
            return 0
        return self.reopen_step()

    # -- requests (scheduler thread) ------------------------------------------------------------
    def request_queued(self, scheduler, req) -> None:
        """Scheduler._add_request_to_queue (a retracted request comes back here: already tracked)."""
        self.has_scheduler = True
        rid = req.rid
        if self.tracked(rid):
            return
        self._ended.discard(rid)
        carried: Mapping[str, Any] = getattr(getattr(req, "time_stats", None), "__dict__", {}).get(CARRY_KEY) or {}
        headers = {k: carried[k] for k in ("traceparent", "tracestate") if isinstance(carried.get(k), str)}
        start_ns = carried.get("start_ns")
        if not isinstance(start_ns, int) or start_ns <= 0:
            start_ns = self.clock()
        operation = carried.get("operation") if isinstance(carried.get("operation"), str) else "text_completion"
        if self.shape is None and self.wants_context:
            self.set_shape(ModelShape.of(getattr(getattr(scheduler, "model_config", None), "hf_config", None)))
        lora, tenant = carried.get("lora"), carried.get("tenant")
        self.start_request(rid, start_ns=start_ns, operation=operation,
                           model=lora if isinstance(lora, str) and lora else self._model_name(scheduler),
                           headers=headers, tenant=tenant if isinstance(tenant, str) else None,
                           attributes={"gen_ai.response.id": rid, "sglang.request.id": rid},
                           prompt_tokens=len(getattr(req, "origin_input_ids", ()) or ()), obj=req)

    def outputs(self, reqs, skip_req=None) -> None:
        """Before SchedulerOutputStreamer.stream_output: first tokens, and the requests that end now."""
        if not self._tracked:
            return
        now = None
        for req in reqs or ():
            if req is skip_req or not self.tracked(req.rid):
                continue
            now = now or self.clock()
            if len(getattr(req, "output_ids", ()) or ()) > 0:
                cached = getattr(req, "cached_tokens", None)
                self.first_token(req.rid, now, {"gen_ai.usage.cache_read.input_tokens": int(cached)}
                                 if isinstance(cached, int) and cached >= 0 else None)
            if req.finished() and not getattr(req, "finished_output", None):
                self._done(req)

    def aborted(self, req, abort_req=None) -> None:
        """Scheduler.send_abort_output: SGLang ends `req` outside the output stream."""
        if req is not None and self.tracked(req.rid):
            self._done(req, abort=getattr(abort_req, "finished_reason", None) or {"type": "abort"})

    def _done(self, req, abort=None) -> None:
        if req.rid in self._ended:
            return
        if len(self._ended) > 4096:
            self._ended &= set(self._tracked)
        self._ended.add(req.rid)
        reason = getattr(req, "finished_reason", None)
        facts: Dict[str, Any] = {
            "gen_ai.usage.input_tokens": len(getattr(req, "origin_input_ids", ()) or ()),
            "gen_ai.usage.output_tokens": len(getattr(req, "output_ids", ()) or ()),
        }
        kind = None
        if abort is not None:
            kind = abort.get("type", "abort") if isinstance(abort, dict) else "abort"
        elif reason is not None and hasattr(reason, "to_json"):
            try:
                kind = reason.to_json().get("type")
            except Exception:
                kind = None
        if kind:
            facts["gen_ai.response.finish_reasons"] = [str(kind)]
        self.request_done(req.rid, facts, "aborted" if abort is not None else error_of(req))

    # -- which rank reports -----------------------------------------------------------------------
    def reports(self) -> bool:
        if self._reports is None:
            try:
                from sglang.srt.runtime_context import get_parallel
                par = get_parallel()
                self._reports = (getattr(par, "attn_tp_rank", 0) or 0) == 0 and (getattr(par, "pp_rank", 0) or 0) == 0
            except Exception:
                self._reports = True         # no parallel context: one rank, this one
        return self._reports

    def exports(self) -> bool:
        return self.reports()

    def telemetry(self):
        # (a settling child was told by its engine: export_nothing() set its telemetry, or it reports)
        if self._telemetry is None and not self.settling_child and not self.reports():
            # another rank reports these requests: their shares go to this rank's request log only
            self.export_nothing()
        return super().telemetry()

    def _model_name(self, scheduler) -> Optional[str]:
        if self._model is None:
            args = getattr(scheduler, "server_args", None)
            name = getattr(args, "served_model_name", None) or getattr(args, "model_path", None)
            self._model = str(name) if name else ""
        return self._model or None
