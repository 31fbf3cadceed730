"""llama-server's and Ollama's facts about a request as span attributes, and the note that explains
their GPU figures.

GenAI names follow the OpenTelemetry semantic conventions, with the ``gen_ai.latency.*`` names
vLLM's own ``llm_request`` span uses, so one dashboard reads every engine. Engine-specific values
go under ``llamacpp.*`` (llama-server's ``timings`` and ``id_slot``) and ``ollama.*``. GPU cost
(``gpu_census.*``) comes from the engine-neutral ``telemetry.attributes``; the full table is in
examples/llamacpp/README.md.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from otel_gpu_census.telemetry import redact
from otel_gpu_census.integrations.llamacpp.stream import StreamFacts

NOTE_STATE_SAVE = (
    "time-window attribution: this request's share of the GPU work in the 20 ms census buckets it was in "
    "flight for, split with the other requests in flight by overlap time. llama-server saves the previous "
    "request's prompt state (device-to-host) when the next request takes the slot, before prompt processing: "
    "that copy appears in the next request's window, in its prefill part (gpu_census.prefill.*)."
)
"""GpuCost.note of the proxy's requests (the first part of ``gpu_census.attribution.note``)."""


def fact_attributes(f: StreamFacts) -> Dict[str, Any]:
    """GenAI attributes from what the response said (the request lifecycle adds the latencies)."""
    out: Dict[str, Any] = {}
    if f.response_id:
        out["gen_ai.response.id"] = f.response_id
    if f.model:
        out["gen_ai.response.model"] = f.model
    # Chat streams carry usage only with stream_options.include_usage; llama-server's timings
    # always say how many prompt tokens were processed (prompt_n) or reused (cache_n) and generated.
    inp, outp = f.input_tokens, output_tokens(f)
    if inp is None and "prompt_n" in f.timings:
        inp = int(f.timings["prompt_n"] + f.timings.get("cache_n", 0))
    if inp is not None:
        out["gen_ai.usage.input_tokens"] = inp
    if outp is not None:
        out["gen_ai.usage.output_tokens"] = outp
    if f.cached_tokens is not None:
        out["gen_ai.usage.cache_read.input_tokens"] = f.cached_tokens
    if f.finish_reason:
        out["gen_ai.response.finish_reasons"] = [f.finish_reason]
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
        out["gpu_census.proxy.upstream_error"] = redact.text(f.error, 1000)
    if f.unparsed:
        out["gpu_census.proxy.body.unparsed_events"] = f.unparsed
    if f.note:
        out["gpu_census.proxy.body.note"] = f.note
    return out


def output_tokens(f: StreamFacts) -> Optional[int]:
    """Tokens generated: the answer's usage, else llama-server's timings."""
    if f.output_tokens is not None:
        return f.output_tokens
    if "predicted_n" in f.timings:
        return int(f.timings["predicted_n"])
    return None
