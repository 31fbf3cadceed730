"""The proxy's metrics. Attributes are bounded: operation, provider, model, error type, direction;
never request ids.

| name | instrument | unit | attributes |
|---|---|---|---|
| gen_ai.server.time_to_first_token | histogram | s | gen_ai.operation.name, gen_ai.provider.name, gen_ai.request.model |
| gen_ai.server.request.duration | histogram | s | same + error.type (on failure) |
| gen_ai.server.time_per_output_token | histogram | s | same as TTFT |
| gpu_census.proxy.active_requests | up-down counter | {request} | gen_ai.operation.name, gen_ai.provider.name |
| gpu_census.request.copy.size | histogram | By | same as TTFT + gpu_census.copy.direction (htod, dtoh) |
"""
from __future__ import annotations

from typing import Dict, Optional

from opentelemetry.metrics import MeterProvider, get_meter_provider

from ..attribution.ledger import COMPLETE, SETTLED, GpuCost

# Bucket boundaries advised by the GenAI semantic conventions.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
DURATION_BUCKETS = [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
# Bytes: 1 KiB to 64 GiB in factors of 4 (a logits copy is ~32 MB, a prompt-state save ~200 MB).
BYTES_BUCKETS = [float(1 << s) for s in range(10, 37, 2)]


class ProxyInstruments:
    def __init__(self, meter_provider: Optional[MeterProvider] = None):
        from .. import proxy as _pkg
        meter = (meter_provider or get_meter_provider()).get_meter("otel_gpu_census.proxy", _pkg.__version__)
        self.ttft = meter.create_histogram(
            "gen_ai.server.time_to_first_token", unit="s",
            description="Time from the request reaching the proxy to the first generated token streaming back",
            explicit_bucket_boundaries_advisory=TTFT_BUCKETS)
        self.duration = meter.create_histogram(
            "gen_ai.server.request.duration", unit="s",
            description="Time from the request reaching the proxy to the last byte of the answer",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS)
        self.tpot = meter.create_histogram(
            "gen_ai.server.time_per_output_token", unit="s",
            description="Time per output token after the first: (duration - TTFT) / (output tokens - 1)",
            explicit_bucket_boundaries_advisory=TPOT_BUCKETS)
        self.active = meter.create_up_down_counter(
            "gpu_census.proxy.active_requests", unit="{request}",
            description="Model requests in flight through the proxy (a low number while users wait points at "
                        "the clients, not the GPU)")
        self.copy_size = meter.create_histogram(
            "gpu_census.request.copy.size", unit="By",
            description="Bytes copied between host and GPU attributed to one request, by direction",
            explicit_bucket_boundaries_advisory=BYTES_BUCKETS)

    def started(self, base: Dict[str, str]) -> None:
        self.active.add(1, base)

    def ended(self, base: Dict[str, str]) -> None:
        self.active.add(-1, base)

    def finished(self, attrs: Dict[str, str], duration_s: float, ttft_s: Optional[float],
                 tpot_s: Optional[float]) -> None:
        self.duration.record(duration_s, attrs)
        ok = {k: v for k, v in attrs.items() if k != "error.type"}
        if ttft_s is not None:
            self.ttft.record(ttft_s, ok)
        if tpot_s is not None:
            self.tpot.record(tpot_s, ok)

    def gpu(self, attrs: Dict[str, str], cost: GpuCost) -> None:
        if cost.status not in (COMPLETE, SETTLED):
            return
        ok = {k: v for k, v in attrs.items() if k != "error.type"}
        for d in ("htod", "dtoh"):
            self.copy_size.record(cost.share.copy(d).bytes, {**ok, "gpu_census.copy.direction": d})
