"""The scheduler side of the SGLang integration: steps, requests and their spans, per scheduler process.

SGLang runs one scheduler process per (TP, PP) rank, and each drives its own GPU: its own census
segment, its own steps. Every rank

- tags each batch's GPU work as one step (``Scheduler.run_batch`` and, with the overlap scheduler, the
  delayed sampling ``launch_batch_sample_if_needed`` of the same batch), with the batch's
  ``{rid: scheduled tokens}`` (an extend batch: ``extend_lens``, one per request in ``reqs``; a decode
  batch: one token each);
- follows each request (``_add_request_to_queue`` .. the ``stream_output`` that carries its last
  output), with the caller's trace context that the HTTP-side hooks carried to it;
- splits its steps among their requests and writes one JSON line per request beside its segment.

Spans and request metrics come from one rank per group of ranks that share requests (attention-TP rank 0
on the first pipeline stage), with that rank's GPU share; the other ranks' shares are in their request
logs. The shared machinery (step ids, ledger, settling, request log) is ``integrations/engine_steps.py``.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Dict, Mapping, Optional

from ..engine_steps import SETTLE_PERIOD_S, StepEngine

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

    # -- steps (scheduler thread) ---------------------------------------------------------------
    def batch_begin(self, batch) -> int:
        """Before Scheduler.run_batch: a new step with the batch's tokens."""
        self._sampled_batch = batch
        return self.open_step(step_tokens(batch))

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
        self.start_request(rid, start_ns=start_ns, operation=operation, model=self._model_name(scheduler),
                           headers=headers,
                           attributes={"gen_ai.response.id": rid, "sglang.request.id": rid})

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

    def _done(self, req) -> None:
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
        if reason is not None and hasattr(reason, "to_json"):
            try:
                kind = reason.to_json().get("type")
            except Exception:
                kind = None
        if kind:
            facts["gen_ai.response.finish_reasons"] = [str(kind)]
        self.request_done(req.rid, facts, error_of(req))

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
