"""Span attribute names and how a request's facts and GPU cost become attributes.

GenAI names follow the OpenTelemetry semantic conventions, with the ``gen_ai.latency.*`` names
vLLM's own ``llm_request`` span uses, so one dashboard reads every engine. Engine-specific values
go under ``llamacpp.*`` (llama-server's ``timings`` and ``id_slot``) and ``ollama.*``. GPU cost
goes under ``gpu_census.*``; the full table is in examples/llamacpp/README.md.

GPU attributes (integers, exact; times in ns because the census counts ns):

- ``gpu_census.kernel.count``, ``gpu_census.kernel.time_ns``: kernels attributed to the request;
- ``gpu_census.copy.<dir>.bytes|count|time_ns`` for dir in htod, dtoh (always present) and dtod,
  ptop, htoh, other (when non-zero); ``gpu_census.memset.*`` likewise;
- ``gpu_census.prefill.copy.dtoh.bytes``, ``.prefill.copy.htod.bytes``, ``.prefill.kernel.time_ns``:
  the part of the share before the first token (prompt processing, and state saved for the
  previous request — see ``gpu_census.attribution.note``);
- ``gpu_census.window.*``: everything the buckets of the request's window held (all requests
  together), and ``gpu_census.window.unattributed.*``: the part no request was in flight for;
- ``gpu_census.kernel.tracing``: ``all``, ``off`` or ``ON_MS/PERIOD_MS`` (OTEL_GPU_CENSUS_KERNELS);
  when not ``all``, ``gpu_census.kernel.traced_ratio``: the share of the request's time kernels were
  traced, so the kernel figures above are that share of the request's kernels (copies are exact);
- ``gpu_census.attribution.method`` (``time_window_shared``), ``.status`` (complete, settled, stale,
  no_census, no_segment, read_error, shutdown), ``.concurrency_max``, ``.buckets``, ``.wait_s``,
  ``.note``; ``gpu_census.process.pids``.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from ..attribution import METHOD, Share
from ..census import DIRECTIONS
from ..attribution.ledger import COMPLETE, SETTLED, GpuCost
from .stream import StreamFacts

ALWAYS_DIRECTIONS = ("htod", "dtoh")

NOTE_STATE_SAVE = (
    "time-window attribution: this request's share of the GPU work in the 20 ms census buckets it was in "
    "flight for, split with the other requests in flight by overlap time. llama-server saves the previous "
    "request's prompt state (device-to-host) when the next request takes the slot, before prompt processing: "
    "that copy appears in the next request's window, in its prefill part (gpu_census.prefill.*)."
)


def share_attributes(prefix: str, s: Share, always: bool = True) -> Dict[str, Any]:
    out: Dict[str, Any] = {f"{prefix}kernel.count": s.kernel_count, f"{prefix}kernel.time_ns": s.kernel_ns}
    for d in DIRECTIONS:
        st = s.copy(d)
        if (always and d in ALWAYS_DIRECTIONS) or st.count or st.bytes:
            out[f"{prefix}copy.{d}.bytes"] = st.bytes
            out[f"{prefix}copy.{d}.count"] = st.count
            out[f"{prefix}copy.{d}.time_ns"] = st.ns
    if s.memset.count or s.memset.bytes:
        out[f"{prefix}memset.bytes"] = s.memset.bytes
        out[f"{prefix}memset.count"] = s.memset.count
        out[f"{prefix}memset.time_ns"] = s.memset.ns
    return out


def gpu_attributes(cost: GpuCost) -> Dict[str, Any]:
    out: Dict[str, Any] = {
        "gpu_census.attribution.method": METHOD,
        "gpu_census.attribution.status": cost.status,
    }
    if cost.status not in (COMPLETE, SETTLED) and not cost.buckets and not cost.pids:
        if cost.notes:
            out["gpu_census.attribution.note"] = "; ".join(cost.notes)
        return out
    out.update(share_attributes("gpu_census.", cost.share))
    if cost.kernel_tracing:
        out["gpu_census.kernel.tracing"] = ",".join(cost.kernel_tracing)
        if cost.kernel_tracing != ["all"]:
            out["gpu_census.kernel.traced_ratio"] = round(cost.kernel_traced_ratio, 4)
    out["gpu_census.prefill.copy.dtoh.bytes"] = cost.prefill.copy("dtoh").bytes
    out["gpu_census.prefill.copy.htod.bytes"] = cost.prefill.copy("htod").bytes
    out["gpu_census.prefill.kernel.time_ns"] = cost.prefill.kernel_ns
    out.update(share_attributes("gpu_census.window.", cost.window))
    out.update(share_attributes("gpu_census.window.unattributed.", cost.unattributed, always=False))
    out["gpu_census.attribution.concurrency_max"] = cost.concurrency_max
    out["gpu_census.attribution.buckets"] = cost.buckets
    out["gpu_census.attribution.wait_s"] = round(cost.waited_s, 3)
    out["gpu_census.attribution.note"] = "; ".join([NOTE_STATE_SAVE] + cost.notes)
    if cost.pids:
        out["gpu_census.process.pids"] = list(cost.pids)
    return out


def fact_attributes(f: StreamFacts, start_ns: int, end_ns: int) -> Dict[str, Any]:
    """GenAI attributes from what the response said; latencies in seconds from proxy timestamps."""
    out: Dict[str, Any] = {}
    if f.response_id:
        out["gen_ai.response.id"] = f.response_id
    if f.model:
        out["gen_ai.response.model"] = f.model
    # Chat streams carry usage only with stream_options.include_usage; llama-server's timings
    # always say how many prompt tokens were processed (prompt_n) or reused (cache_n) and generated.
    inp, outp = f.input_tokens, f.output_tokens
    if inp is None and "prompt_n" in f.timings:
        inp = int(f.timings["prompt_n"] + f.timings.get("cache_n", 0))
    if outp is None and "predicted_n" in f.timings:
        outp = int(f.timings["predicted_n"])
    if inp is not None:
        out["gen_ai.usage.input_tokens"] = inp
    if outp is not None:
        out["gen_ai.usage.output_tokens"] = outp
    if f.cached_tokens is not None:
        out["gen_ai.usage.cache_read.input_tokens"] = f.cached_tokens
    if f.finish_reason:
        out["gen_ai.response.finish_reasons"] = [f.finish_reason]
    out["gen_ai.latency.e2e"] = (end_ns - start_ns) / 1e9
    ttft = time_to_first_token(f, start_ns)
    if ttft is not None:
        out["gen_ai.latency.time_to_first_token"] = ttft
    for k, v in f.timings.items():
        out[f"llamacpp.timings.{k}"] = v
    if "prompt_ms" in f.timings:
        out["gen_ai.latency.time_in_model_prefill"] = f.timings["prompt_ms"] / 1e3
    if "predicted_ms" in f.timings:
        out["gen_ai.latency.time_in_model_decode"] = f.timings["predicted_ms"] / 1e3
    if f.id_slot is not None:
        out["llamacpp.id_slot"] = f.id_slot
    for k, v in f.ollama.items():
        out[f"ollama.{k}"] = v
    if "prompt_eval_duration" in f.ollama:
        out["gen_ai.latency.time_in_model_prefill"] = f.ollama["prompt_eval_duration"] / 1e9
    if "eval_duration" in f.ollama:
        out["gen_ai.latency.time_in_model_decode"] = f.ollama["eval_duration"] / 1e9
    if f.error:
        out["gpu_census.proxy.upstream_error"] = f.error[:1000]
    if f.unparsed:
        out["gpu_census.proxy.body.unparsed_events"] = f.unparsed
    if f.note:
        out["gpu_census.proxy.body.note"] = f.note
    return out


def time_to_first_token(f: StreamFacts, start_ns: int) -> Optional[float]:
    if f.first_token_ns is None:
        return None
    return max(0, f.first_token_ns - start_ns) / 1e9


def time_per_output_token(f: StreamFacts, start_ns: int, end_ns: int) -> Optional[float]:
    """Decode time per token after the first: (e2e - ttft) / (output_tokens - 1)."""
    n = f.output_tokens
    if n is None and "predicted_n" in f.timings:
        n = int(f.timings["predicted_n"])
    if f.first_token_ns is None or not n or n < 2:
        return None
    return max(0, end_ns - f.first_token_ns) / 1e9 / (n - 1)
