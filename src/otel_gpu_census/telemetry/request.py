"""One request lifecycle for every integration: a span, the GenAI metrics, the GPU cost.

An integration learns a request's boundaries its own way (the llama.cpp proxy from the HTTP stream,
an engine hook from the engine's steps) and tells this module; everything after that is the same::

    telemetry = RequestTelemetry(tracer_provider, meter_provider, provider_name="vllm")
    req = telemetry.start(start_ns=t0, operation="chat", model="llama-3", span_name="chat llama-3")
    ...
    req.first_token(t1)              # when the first generated token is out
    req.served()                     # optional: the answer is over, the GPU cost comes later
    cost = await ledger.close(key, t2)
    req.finish(t2, cost=cost, output_tokens=n)

:meth:`TrackedRequest.finish` sets ``gen_ai.response.time_to_first_chunk`` (seconds, the GenAI
conventions' name; the request's whole time is the span's duration), the GPU attributes (:func:`attributes.gpu_attributes`), ``error.type`` and an error status, ends the
span at the request's end (not when finish is called: the GPU cost may come seconds later), and
records ``gen_ai.server.request.duration``, ``.time_to_first_token``, ``.time_per_output_token`` and
the per-request GPU histograms and the chargeback counters of the request's tenant and model
(``gpu_census.chargeback.*``: instruments.py) with the span's context, so exemplars point at the trace. The
in-flight counter (``gpu_census.requests.in_flight``) goes up at start and down exactly once, at
:meth:`TrackedRequest.served` or else at finish. Nothing here raises into the server: a failure
costs one log line. Attribute values pass through :func:`redact.attributes` (printable, bounded,
inside what OTLP carries): they hold what clients and engines said.

Token counts: the GenAI conventions define ``gen_ai.usage.*`` on the client's inference span and no server span.
Ours carries them (without an instrumented client they are the only counts a GenAI backend gets), so a backend that
sums a trace counts them twice under an instrumented client; ``OTEL_GPU_CENSUS_SPAN_USAGE=census`` names ours
``gpu_census.usage.*`` instead (:func:`usage_prefix`).

No web framework is imported here (nor by anything this imports): engine workers load it as is.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Tuple

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from otel_gpu_census import settings
from otel_gpu_census.version import __version__
from otel_gpu_census.telemetry import redact
from otel_gpu_census.telemetry.attributes import gpu_attributes
from otel_gpu_census.telemetry.instruments import RequestInstruments
from otel_gpu_census.telemetry.tenant import TENANT

if TYPE_CHECKING:
    from opentelemetry.context import Context

    from otel_gpu_census.attribution.ledger import GpuCost
    from otel_gpu_census.attribution.shares import Share

log = logging.getLogger("otel_gpu_census.telemetry")

USAGE_ENV = settings.SETTINGS["SPAN_USAGE"].variable     # gen_ai (default) | census
GEN_AI_USAGE, CENSUS_USAGE = "gen_ai.usage.", "gpu_census.usage."


def usage_prefix(env: Mapping[str, str] = os.environ) -> str:
    """Where a span's token counts go: ``gen_ai.usage.`` (the default), or ``gpu_census.usage.`` with
    OTEL_GPU_CENSUS_SPAN_USAGE=census (the client's GenAI span has them); another value: one line, the default."""
    value, warning = settings.choice("SPAN_USAGE", env)
    if warning:
        log.warning("%s; token counts stay gen_ai.usage.*", redact.text(warning, 120))
    return CENSUS_USAGE if value == "census" else GEN_AI_USAGE


def _usage_named(attrs: Dict[str, Any], prefix: str) -> Dict[str, Any]:
    if prefix == GEN_AI_USAGE:
        return attrs
    return {(prefix + k[len(GEN_AI_USAGE):] if k.startswith(GEN_AI_USAGE) else k): v for k, v in attrs.items()}

OPERATION = "gen_ai.operation.name"
PROVIDER = "gen_ai.provider.name"
MODEL = "gen_ai.request.model"
TTFT = "gen_ai.response.time_to_first_chunk"     # seconds from the request to its first streamed chunk
ERROR_TYPE = "error.type"


class RequestTelemetry:
    """One request lifecycle for every integration: a span, the GenAI metrics, the GPU cost."""

    def __init__(self, tracer_provider=None, meter_provider=None, *, provider_name: str,
                 instrumentation_name: str = "otel_gpu_census"):
        """Spans and metrics under the scope `instrumentation_name`; `provider_name` is the
        ``gen_ai.provider.name`` of every request (a request's own attributes may name another)."""
        self.provider_name = provider_name
        self.usage = usage_prefix()
        self.tracer = (tracer_provider or trace.get_tracer_provider()).get_tracer(instrumentation_name, __version__)
        self.instruments = RequestInstruments(meter_provider, instrumentation_name)

    def start(self, *, start_ns: int, operation: str, model: Optional[str] = None, span_name: str,
              parent: "Optional[Context]" = None, attributes: Mapping[str, Any] = (), kind=SpanKind.SERVER,
              ids: Optional[Tuple[int, int]] = None, tenant: Optional[str] = None) -> "TrackedRequest":
        """A request that began at `start_ns` (wall clock, ns): its span starts then, under `parent`
        (a context extracted from the request's headers, or None), with `attributes` and the GenAI
        operation, provider and model; the in-flight counter goes up by one. `ids`: (trace id, span id)
        chosen beforehand (an engine that hands its spans' context to the engine's own spans before
        the span exists); the trace id counts only where the span has no parent. `tenant`: who the request's
        GPU share is charged to (telemetry/tenant.py: already clean), ``gpu_census.tenant`` on the span."""
        attrs: Dict[str, Any] = {OPERATION: operation, PROVIDER: self.provider_name}
        attrs.update(dict(attributes))
        if model:
            attrs[MODEL] = model
        if tenant:
            attrs[TENANT] = tenant
        attrs = _usage_named(redact.attributes(attrs), self.usage)
        base = {OPERATION: attrs[OPERATION], PROVIDER: attrs[PROVIDER]}
        try:
            with _chosen_ids(self.tracer, ids):
                span = self.tracer.start_span(span_name, context=parent, kind=kind, start_time=start_ns,
                                              attributes=attrs)
        except Exception:
            log.exception("request telemetry: could not start a span")
            span = trace.INVALID_SPAN
        req = TrackedRequest(self.instruments, span, start_ns, base, model, self.usage)
        req.tenant = attrs.get(TENANT)
        try:
            self.instruments.started(base)
            req._in_flight = True
        except Exception:
            log.exception("request telemetry: could not count a request in flight")
        return req


    def dropped(self, n: int) -> None:
        """`n` requests that got no span (their settling process died with them): counted."""
        try:
            self.instruments.dropped(n, {PROVIDER: self.provider_name})
        except Exception:
            log.exception("request telemetry: could not count dropped requests")


class _ChosenIds:
    """An SDK id generator that hands out ids chosen beforehand, on the thread that chose them."""

    def __init__(self, inner):
        self.inner = inner
        self.next = threading.local()

    def generate_span_id(self) -> int:
        ids = getattr(self.next, "ids", None)
        return ids[1] if ids else self.inner.generate_span_id()

    def generate_trace_id(self) -> int:
        ids = getattr(self.next, "ids", None)
        return ids[0] if ids else self.inner.generate_trace_id()

    def is_trace_id_random(self) -> bool:
        return getattr(self.inner, "is_trace_id_random", lambda: False)()


@contextlib.contextmanager
def _chosen_ids(tracer, ids: Optional[Tuple[int, int]]):
    """Within: `tracer` (an SDK tracer; others are left alone) gives its next span these (trace, span) ids."""
    gen = getattr(tracer, "id_generator", None) if ids else None
    if gen is None:
        yield
        return
    if not isinstance(gen, _ChosenIds):
        gen = tracer.id_generator = _ChosenIds(gen)
    gen.next.ids = ids
    try:
        yield
    finally:
        gen.next.ids = None


class TrackedRequest:
    """One request between :meth:`RequestTelemetry.start` and :meth:`finish`.

    ``span`` is the live span (an integration may put its context on the request it forwards, or
    rename it once it knows the model)."""

    def __init__(self, instruments: RequestInstruments, span, start_ns: int, base: Dict[str, str],
                 model: Optional[str], usage: str = GEN_AI_USAGE):
        self.span = span
        self._usage = usage
        self.start_ns = start_ns
        self.first_token_ns: Optional[int] = None
        self.model = model
        self.tenant: Optional[str] = None
        self._instruments = instruments
        self._base = base
        self._in_flight = False
        self._finished = False
        self._lock = threading.Lock()      # engine hooks may end a request from another thread

    def first_token(self, t_ns: int) -> None:
        """The first generated token went out at `t_ns` (the first call counts)."""
        if self.first_token_ns is None:
            self.first_token_ns = t_ns

    def set_attributes(self, attrs: Mapping[str, Any]) -> None:
        """Span attributes now; a ``gen_ai.request.model`` among them also labels the metrics."""
        try:
            attrs = _usage_named(redact.attributes(attrs), self._usage)
            self._learn_model(attrs)
            self.span.set_attributes(attrs)
        except Exception:
            log.exception("request telemetry: could not set span attributes")

    def served(self) -> None:
        """The request is over for its client (the GPU cost may still be on its way): the in-flight
        counter goes down now rather than at :meth:`finish`. Idempotent."""
        with self._lock:
            leave, self._in_flight = self._in_flight, False
        if leave:
            try:
                self._instruments.ended(self._base)
            except Exception:
                log.exception("request telemetry: could not count a request out")

    def finish(self, end_ns: int, *, cost: "Optional[GpuCost]" = None, attributes: Mapping[str, Any] = (),
               output_tokens: Optional[int] = None, error_type: Optional[str] = None,
               kv_offload: "Optional[Share]" = None) -> None:
        """End the request: latencies, GPU attributes and error on the span, the span ended at
        `end_ns`, the histograms and chargeback counters recorded, the in-flight counter down (if
        :meth:`served` did not). `error_type` marks a failure (``error.type``; no TTFT or TPOT is recorded
        for it); `output_tokens` gives the time per output token; `kv_offload`: the part of the cost's share
        that KV-offload transfers were. Idempotent; never raises."""
        with self._lock:
            if self._finished:
                return
            self._finished = True
        try:
            self._finish(end_ns, cost, attributes, output_tokens, error_type, kv_offload)
        except Exception:
            log.exception("request telemetry: could not finish a request")
        finally:
            try:
                self.span.end(end_time=end_ns)
            except Exception:
                log.exception("request telemetry: could not end a span")
            self.served()

    # -- the parts of finish --------------------------------------------------------------------
    def _learn_model(self, attrs: Mapping[str, Any]) -> None:
        model = attrs.get(MODEL)
        if isinstance(model, str) and model:
            self.model = model

    def _finish(self, end_ns: int, cost, attributes, output_tokens, error_type, kv_offload=None) -> None:
        attrs: Dict[str, Any] = redact.attributes(attributes)
        self._learn_model(attrs)
        duration_s = max(0, end_ns - self.start_ns) / 1e9
        ttft_s = None
        if self.first_token_ns is not None:
            ttft_s = max(0, self.first_token_ns - self.start_ns) / 1e9
        if ttft_s is not None:
            attrs[TTFT] = ttft_s
        if cost is not None:
            attrs.update(gpu_attributes(cost))
        if error_type is not None:
            attrs[ERROR_TYPE] = error_type
        self.span.set_attributes(_usage_named(attrs, self._usage))
        if error_type is not None and _status_unset(self.span):
            self.span.set_status(Status(StatusCode.ERROR, error_type))
        self._record(end_ns, duration_s, ttft_s, cost, output_tokens, error_type, kv_offload)

    def _record(self, end_ns: int, duration_s: float, ttft_s: Optional[float], cost, output_tokens,
                error_type, kv_offload=None) -> None:
        ctx = trace.set_span_in_context(self.span)
        labels = dict(self._base)
        if self.model:
            labels[MODEL] = self._instruments.model_label(self.model)
        if error_type is not None:
            labels[ERROR_TYPE] = error_type
        ok = error_type is None
        tpot_s = None
        if ok and self.first_token_ns is not None and output_tokens is not None and output_tokens >= 2:
            tpot_s = max(0, end_ns - self.first_token_ns) / 1e9 / (output_tokens - 1)
        self._instruments.finished(labels, duration_s, ttft_s if ok else None, tpot_s, context=ctx)
        if cost is not None:
            self._instruments.gpu(labels, cost, context=ctx)
            self._instruments.chargeback(labels, self.tenant, cost, kv_offload, context=ctx)


def _status_unset(span) -> bool:
    """Whether the span has no status yet (an integration may have set a more precise error)."""
    status = getattr(span, "status", None)
    return status is None or status.status_code is StatusCode.UNSET
