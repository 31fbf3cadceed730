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
| gpu_census.chargeback.requests | counter | {request} | CHARGE (below) |
| gpu_census.chargeback.kernel.count | counter | {kernel} | CHARGE |
| gpu_census.chargeback.kernel.time | counter | s | CHARGE + gpu_census.kernel.time_estimated |
| gpu_census.chargeback.copy.size | counter | By | CHARGE + gpu_census.copy.direction (each direction that moved bytes) |
| gpu_census.chargeback.kv_offload.size | counter | By | CHARGE + gpu_census.copy.direction (vLLM's KV offload) |

The chargeback counters (CHARGE: gpu_census.tenant, gen_ai.request.model, gen_ai.operation.name,
gen_ai.provider.name, gpu_census.attribution.method, gpu_census.attribution.status) add up each request's share
by who it belongs to (telemetry/tenant.py) and which model or LoRA adapter served it, once the census gave it figures
(``GpuCost.has_figures``: complete, settled, partial, and the engines' stale shares, which their status
tells apart). A process labels at most TENANT_LABELS tenants (then OTHER_MODEL, said once) and MODEL_LABELS
models. Kernel count and time are left out where kernels were sampled (a part, not the whole); KV-offload bytes
are part of the copy bytes too.

The GPU histograms take a request's attributed share (``GpuCost.share``) once the census is complete
for it (status complete or settled); kernel time only where every kernel was traced, or under counted
kernel tracing (the default) as estimated (``GpuCost.kernel_time``) where a sample priced it.
"""
from __future__ import annotations

import logging
from typing import Dict, Optional

from opentelemetry.metrics import MeterProvider, get_meter_provider

from otel_gpu_census.attribution.ledger import COMPLETE, PARTIAL, SETTLED, GpuCost
from otel_gpu_census.attribution.shares import Share
from otel_gpu_census.census import DIRECTIONS
from otel_gpu_census.telemetry.tenant import TENANT, UNKNOWN
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
TENANT_LABELS = 100               # tenants one process labels (times models, methods and statuses: past the
                                  # SDK's limit of series an instrument keeps, 2000 by default, its overflow series)
CHARGE = "gpu_census.chargeback."
METHOD, STATUS = "gpu_census.attribution.method", "gpu_census.attribution.status"
ESTIMATED = "gpu_census.kernel.time_estimated"

log = logging.getLogger("otel_gpu_census.telemetry")


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
        self._tenants: set = set()
        self._said: set = set()          # what was said once: "unknown", "_OTHER"
        self.charge_requests = meter.create_counter(
            CHARGE + "requests", unit="{request}",
            description="Requests whose GPU share is counted in the chargeback series, by tenant and model")
        self.charge_kernel_count = meter.create_counter(
            CHARGE + "kernel.count", unit="{kernel}",
            description="Kernels attributed to the requests of a tenant and model (their shares added up)")
        self.charge_kernel_time = meter.create_counter(
            CHARGE + "kernel.time", unit="s",
            description="Kernel time attributed to the requests of a tenant and model (estimated where "
                        "gpu_census.kernel.time_estimated is true)")
        self.charge_copy = meter.create_counter(
            CHARGE + "copy.size", unit="By",
            description="Bytes copied between host and GPU attributed to the requests of a tenant and model")
        self.charge_kv = meter.create_counter(
            CHARGE + "kv_offload.size", unit="By",
            description="Of the copy bytes, those of KV-cache offload transfers (vLLM) of a tenant and model")

    def model_label(self, model: str) -> str:
        """`model` as a metric label: itself while fewer than MODEL_LABELS models are labelled, else OTHER_MODEL."""
        if model in self._models:
            return model
        if len(self._models) < MODEL_LABELS:
            self._models.add(model)
            return model
        return OTHER_MODEL

    def tenant_label(self, tenant: Optional[str]) -> str:
        """`tenant` as a metric label: itself while fewer than TENANT_LABELS are labelled, else OTHER_MODEL; none:
        UNKNOWN. Each of those two is said once."""
        if not tenant:
            self._say_once(UNKNOWN, "requests without a tenant are charged to gpu_census.tenant=unknown (the baggage "
                           "entry gpu_census.tenant, or OTEL_GPU_CENSUS_TENANT=header:NAME, names theirs)")
            return UNKNOWN
        if tenant in self._tenants:
            return tenant
        if len(self._tenants) < TENANT_LABELS:
            self._tenants.add(tenant)
            return tenant
        self._say_once(OTHER_MODEL, f"more than {TENANT_LABELS} tenants: the chargeback series label the others "
                       f"{OTHER_MODEL} (their spans keep gpu_census.tenant)")
        return OTHER_MODEL

    def _say_once(self, what: str, line: str) -> None:
        if what not in self._said:
            self._said.add(what)
            log.warning("otel-gpu-census: %s", line)

    def chargeback(self, attrs: Dict[str, str], tenant: Optional[str], cost: GpuCost,
                   kv_offload: Optional[Share] = None, context=None) -> None:
        """One request's share added to the chargeback counters of its tenant and model (`attrs`: provider,
        model). Integers stay integers (bytes, counts); kernel time in seconds."""
        labels = {k: v for k, v in attrs.items() if k != "error.type"}
        labels.update({TENANT: self.tenant_label(tenant), METHOD: cost.method, STATUS: cost.status})
        self.charge_requests.add(1, labels, context=context)
        if not cost.has_figures:
            return
        share = cost.share
        for d in DIRECTIONS:
            b = share.copy(d).bytes
            if b:
                self.charge_copy.add(b, {**labels, "gpu_census.copy.direction": d}, context=context)
            kv = kv_offload.copy(d).bytes if kv_offload is not None else 0
            if kv:
                self.charge_kv.add(kv, {**labels, "gpu_census.copy.direction": d}, context=context)
        sampled = not cost.kernel_counted and cost.kernel_traced_ratio < 1.0
        if sampled:
            return
        self.charge_kernel_count.add(share.kernel_count, labels, context=context)
        kt = cost.share_time()
        self.charge_kernel_time.add(kt.ns / 1e9, {**labels, ESTIMATED: bool(cost.kernel_counted and kt.estimated)},
                                    context=context)

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
