"""Tracer and meter providers for the proxy, configured by the standard OTEL_* variables.

Traces: ``OTEL_TRACES_EXPORTER`` (``otlp``, the default — spans are what the proxy is for —
``console`` or ``none``); OTLP over ``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL`` (``grpc``, the default,
or ``http/protobuf``), endpoint, headers and TLS read by the OTel exporter itself. Metrics: as the
census sidecar (``exporters.py``): ``OTEL_METRICS_EXPORTER``, else OTLP when an OTLP endpoint is set.
A collector that is down costs one warning per outage, not a line per batch.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Callable, List, Mapping, Optional, Sequence

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from ..exporters import run_closers

log = logging.getLogger("otel_gpu_census.proxy")
# Longest the proxy's stop waits for its last spans and metrics to leave. An OTLP exporter retries
# for up to OTEL_EXPORTER_OTLP_TIMEOUT (10 s) per signal: with the collector down, a stop took 15-21 s.
SHUTDOWN_S = 2.0

_TRACE_LOGGERS = ("opentelemetry.exporter.otlp.proto.grpc.exporter",
                  "opentelemetry.exporter.otlp.proto.http.trace_exporter",
                  "opentelemetry.exporter.otlp.proto.http._common",
                  "opentelemetry.exporter.http_transport")


class _Quiet(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        try:
            return not str(record.msg).startswith(("Failed to export", "Transient error", "Request failed",
                                                   "Failed to send"))
        except Exception:
            return True


class QuietSpanExporter(SpanExporter):
    """One warning when the collector stops answering, one when it is back."""

    def __init__(self, inner: SpanExporter, target: str):
        self.inner, self.target, self.down = inner, target, False

    def export(self, spans: Sequence) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
            err = ""
        except Exception as e:
            result, err = SpanExportResult.FAILURE, f" ({type(e).__name__}: {e})"
        if result == SpanExportResult.SUCCESS:
            if self.down:
                log.warning("traces: export to %s works again", self.target)
            self.down = False
        else:
            if not self.down:
                log.warning("traces: cannot export to %s%s; dropping spans until it answers", self.target, err)
            self.down = True
        return result

    def shutdown(self) -> None:
        try:
            self.inner.shutdown()
        except Exception:
            pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        try:
            return self.inner.force_flush(timeout_millis)
        except Exception:
            return False


def _protocol(env: Mapping[str, str]) -> str:
    raw = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc")
    p = raw.strip().lower()
    if p not in ("grpc", "http/protobuf"):
        log.warning("OTLP protocol %r is not supported (use grpc or http/protobuf); using grpc", raw)
        p = "grpc"
    return p


def span_exporter(env: Mapping[str, str] = os.environ) -> Optional[SpanExporter]:
    names = [n.strip().lower() for n in (env.get("OTEL_TRACES_EXPORTER") or "otlp").split(",") if n.strip()]
    if "none" in names:
        return None
    if "console" in names:
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter
        return ConsoleSpanExporter(out=sys.stderr)
    for n in names:
        if n != "otlp":
            log.warning("OTEL_TRACES_EXPORTER: ignoring unknown exporter %r", n)
    proto = _protocol(env)
    if proto == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        inner = OTLPSpanExporter()
        target = getattr(inner, "_endpoint", None) or "localhost:4317"
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        inner = OTLPSpanExporter()
        target = getattr(inner, "_endpoint", None) or "http://localhost:4318/v1/traces"
    for name in _TRACE_LOGGERS:
        logging.getLogger(name).addFilter(_Quiet())
    return QuietSpanExporter(inner, f"OTLP {proto} {target}")


@dataclass
class Telemetry:
    tracer_provider: TracerProvider
    meter_provider: object
    descriptions: List[str] = field(default_factory=list)
    _closers: List[Callable[[], None]] = field(default_factory=list)

    def shutdown(self, timeout_s: float = SHUTDOWN_S) -> None:
        """Flush and close, for at most `timeout_s`: a collector that is down or does not answer
        costs what was still unsent, never a stuck stop. The flush runs in a daemon thread that is
        left behind (and ends with the process) when it overstays."""
        if not self._closers:
            return
        done = threading.Thread(target=run_closers, args=(self._closers,), name="otel-gpu-census-telemetry-stop",
                                daemon=True)
        done.start()
        done.join(timeout_s)
        if done.is_alive():
            log.warning("telemetry: the collector did not take the last spans and metrics within %g s; "
                        "stopping without them", timeout_s)


def build_telemetry(env: Mapping[str, str] = os.environ, traces: bool = True, metrics: bool = True) -> Telemetry:
    """Providers from the environment; with traces/metrics False that provider is a no-op one
    (the caller brings its own)."""
    from opentelemetry.sdk.metrics import MeterProvider

    from .. import exporters
    resource = exporters.make_resource()
    # shutdown_on_exit off: Telemetry.shutdown (bounded) is the one shutdown; the SDK's own at exit
    # would wait on the same stuck exporter again, unbounded
    tp = TracerProvider(resource=resource, shutdown_on_exit=False)
    desc: List[str] = []
    closers: List[Callable[[], None]] = [tp.shutdown]
    if traces:
        exp = span_exporter(env)
        if exp is not None:
            tp.add_span_processor(BatchSpanProcessor(exp))
            desc.append(f"traces → {getattr(exp, 'target', type(exp).__name__)}")
        else:
            desc.append("traces → none (OTEL_TRACES_EXPORTER=none)")
    readers = []
    if metrics:
        out = exporters.build_readers(exporters.choose_exporters(None, env), env=env)
        readers = out.readers
        desc.extend(f"metrics → {d}" for d in out.descriptions)
        if not readers:
            desc.append("metrics → none (set OTEL_METRICS_EXPORTER or OTEL_EXPORTER_OTLP_ENDPOINT)")
        closers.append(out.close)
    mp = MeterProvider(resource=resource, metric_readers=readers, shutdown_on_exit=False)
    closers.insert(1, mp.shutdown)
    return Telemetry(tp, mp, desc, closers)
