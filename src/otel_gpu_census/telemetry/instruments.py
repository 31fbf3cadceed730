"""The request metrics every integration records (engine-neutral). Attributes are bounded: operation,
provider, model, error type, copy direction; never request ids. A client names the model (the proxy reads it
from the request), so a process labels at most MODEL_LABELS distinct models; later ones are labelled
OTHER_MODEL (their spans keep the name), and no client can grow the metrics without bound.

| name | instrument | unit | attributes |
|---|---|---|---|
| gen_ai.server.time_to_first_token | histogram | s | gen_ai.operation.name, gen_ai.provider.name, gen_ai.request.model |
| gen_ai.server.request.duration | histogram | s | same + error.type (on failure) |
| gen_ai.server.time_per_output_token | histogram | s | same as TTFT |
| gpu_census.requests.in_flight | up-down counter | {request} | gen_ai.operation.name, gen_ai.provider.name |
| gpu_census.request.copy.size | histogram | By | same as TTFT + gpu_census.copy.direction (htod, dtoh) |
| gpu_census.request.kernel.time | histogram | s | same as TTFT |
| gpu_census.requests.dropped | counter | {request} | gen_ai.provider.name |

The GPU histograms take a request's attributed share (``GpuCost.share``) once the census is complete
for it (status complete or settled); kernel time only where every kernel was traced, or under counted
kernel tracing (the default) as estimated (``GpuCost.kernel_time``) where a sample priced it.
"""
from __future__ import annotations

from typing import Dict, Optional

from opentelemetry.metrics import MeterProvider, get_meter_provider

from otel_gpu_census.attribution.ledger import COMPLETE, PARTIAL, SETTLED, GpuCost
from otel_gpu_census.version import __version__

# Bucket boundaries advised by the GenAI semantic conventions.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
DURATION_BUCKETS = [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
# Bytes: 1 KiB to 64 GiB in factors of 4 (a logits copy is ~32 MB, a prompt-state save ~200 MB).
BYTES_BUCKETS = [float(1 << s) for s in range(10, 37, 2)]
# Kernel time of one request: 100 µs to ~7 min in factors of 4.
KERNEL_TIME_BUCKETS = [1e-4 * 4 ** k for k in range(12)]
IN_FLIGHT = "gpu_census.requests.in_flight"
DROPPED = "gpu_census.requests.dropped"
COPY_DIRECTIONS = ("htod", "dtoh")
MODEL = "gen_ai.request.model"
MODEL_LABELS = 64
OTHER_MODEL = "_OTHER"            # as the HTTP conventions label a method they do not know


class RequestInstruments:
    """The instruments of :mod:`telemetry.request`, on one meter (`name`: the instrumentation scope)."""

    def __init__(self, meter_provider: Optional[MeterProvider] = None, name: str = "otel_gpu_census"):
        meter = (meter_provider or get_meter_provider()).get_meter(name, __version__)
        self._models: set = set()        # the model label values given out (MODEL_LABELS at most)
        self.ttft = meter.create_histogram(
            "gen_ai.server.time_to_first_token", unit="s",
            description="Time from the request reaching the server (or its proxy) to the first generated token",
            explicit_bucket_boundaries_advisory=TTFT_BUCKETS)
        self.duration = meter.create_histogram(
            "gen_ai.server.request.duration", unit="s",
            description="Time from the request reaching the server (or its proxy) to the end of the answer",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS)
        self.tpot = meter.create_histogram(
            "gen_ai.server.time_per_output_token", unit="s",
            description="Time per output token after the first: (duration - TTFT) / (output tokens - 1)",
            explicit_bucket_boundaries_advisory=TPOT_BUCKETS)
        self.in_flight = meter.create_up_down_counter(
            IN_FLIGHT, unit="{request}",
            description="Model requests in flight (a low number while users wait points at the clients, "
                        "not the GPU)")
        self.copy_size = meter.create_histogram(
            "gpu_census.request.copy.size", unit="By",
            description="Bytes copied between host and GPU attributed to one request, by direction",
            explicit_bucket_boundaries_advisory=BYTES_BUCKETS)
        self.kernel_time = meter.create_histogram(
            "gpu_census.request.kernel.time", unit="s",
            description="Kernel time attributed to one request (recorded where every kernel was traced; "
                        "estimated under the default collector)",
            explicit_bucket_boundaries_advisory=KERNEL_TIME_BUCKETS)

        self.dropped_requests = meter.create_counter(
            DROPPED, unit="{request}",
            description="Requests an engine served that got no span or request log line (their settling "
                        "process died before it settled them)")

    def model_label(self, model: str) -> str:
        """`model` as a metric label: itself while fewer than MODEL_LABELS models are labelled, else OTHER_MODEL."""
        if model in self._models:
            return model
        if len(self._models) < MODEL_LABELS:
            self._models.add(model)
            return model
        return OTHER_MODEL

    def dropped(self, n: int, attrs: Dict[str, str]) -> None:
        self.dropped_requests.add(n, attrs)

    def started(self, base: Dict[str, str]) -> None:
        self.in_flight.add(1, base)

    def ended(self, base: Dict[str, str]) -> None:
        self.in_flight.add(-1, base)

    def finished(self, attrs: Dict[str, str], duration_s: float, ttft_s: Optional[float],
                 tpot_s: Optional[float], context=None) -> None:
        self.duration.record(duration_s, attrs, context=context)
        ok = {k: v for k, v in attrs.items() if k != "error.type"}
        if ttft_s is not None:
            self.ttft.record(ttft_s, ok, context=context)
        if tpot_s is not None:
            self.tpot.record(tpot_s, ok, context=context)

    def gpu(self, attrs: Dict[str, str], cost: GpuCost, context=None) -> None:
        if cost.status not in (COMPLETE, SETTLED, PARTIAL):
            return
        ok = {k: v for k, v in attrs.items() if k != "error.type"}
        for d in COPY_DIRECTIONS:
            self.copy_size.record(cost.share.copy(d).bytes, {**ok, "gpu_census.copy.direction": d}, context=context)
        if cost.kernel_counted:
            kt = cost.share_time()
            if not kt.unknown:
                self.kernel_time.record(kt.ns / 1e9, ok, context=context)
        elif cost.kernel_traced_ratio >= 1.0:
            self.kernel_time.record(cost.share_time().ns / 1e9, ok, context=context)
