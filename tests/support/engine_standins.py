"""Stand-ins the engine integrations' tests share (vLLM and SGLang alike): the engine's own census as
its settler reads it, a clock the test moves, and request telemetry into in-memory exporters."""
from __future__ import annotations

from types import SimpleNamespace

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel_gpu_census.telemetry.request import RequestTelemetry


class Census:
    """The engine's own segment as the settler reads it: steps appear when 'the GPU ran them', and
    the totals are complete up to `complete` (wall ns)."""

    def __init__(self, complete: int = 0):
        self.steps, self.complete = {}, complete

    def read(self, lo, hi):
        head = SimpleNamespace(complete_wall_ns=self.complete, alive=True, state_name="active")
        return head, {i: s for i, s in self.steps.items() if lo <= i <= hi}


class Clock:
    def __init__(self):
        self.t = 1_800_000_000_000_000_000

    def __call__(self):
        return self.t


def in_memory_providers():
    """SDK providers whose spans and metrics land in memory: (tracer provider, meter provider, span exporter,
    metric reader)."""
    spans = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    return tp, MeterProvider(metric_readers=[reader]), spans, reader


def in_memory_telemetry(provider: str, metrics: bool = True):
    """RequestTelemetry whose spans (and metrics) land in memory: (telemetry, span exporter, metric reader)."""
    tp, mp, spans, reader = in_memory_providers()
    rt = RequestTelemetry(tp, mp if metrics else None, provider_name=provider,
                          instrumentation_name=f"otel_gpu_census.{provider}")
    return rt, spans, reader if metrics else None
