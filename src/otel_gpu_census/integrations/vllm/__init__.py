"""vLLM: each request's GPU cost, measured inside the engine, in the caller's trace.

Install the package and start vLLM under the census; the ``vllm.general_plugins`` entry point loads
this integration in every vLLM process::

    pip install .                 # from a checkout of otel-gpu-census, beside vLLM
    OTEL_EXPORTER_OTLP_ENDPOINT=http://collector:4317 otel-gpu-census run -- vllm serve MODEL

Each request gets one span (``text_completion MODEL`` / ``chat MODEL``, kind SERVER) under the
client's ``traceparent`` (kept even when vLLM's own tracing is off), with TTFT, queue time, token
counts and its share of every engine step that served it: kernels, kernel time and copies by
direction (``gpu_census.*``, the same attributes the llama.cpp proxy's spans carry). Per-request
histograms (``gen_ai.server.*``, ``gpu_census.request.*``) carry exemplars pointing at those spans.

The same hooks also work through OpenTelemetry's own loader (``opentelemetry-instrument``: the
``opentelemetry_instrumentor`` entry point ``vllm``), and by hand::

    from otel_gpu_census.integrations.vllm import VllmInstrumentor
    VllmInstrumentor().instrument(tracer_provider=tp, meter_provider=mp)   # both optional

Spans and metrics go to the providers given to ``instrument()``, else to the application's (SDK providers
set globally, as ``opentelemetry-instrument`` does), else to providers built from the OTEL_* variables;
vLLM's ``--otlp-traces-endpoint``, when set, is where the spans go unless
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` says otherwise. ``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS=vllm`` (or
``*``) switches it off. Without the census injector in the
process it does nothing and says so once; any failure of its own switches it off with one log line
and vLLM serves on. Supported: see ``package._instruments``.
"""
from otel_gpu_census.integrations.vllm.instrumentor import VllmInstrumentor, register
from otel_gpu_census.integrations.vllm.package import _instruments

__all__ = ["VllmInstrumentor", "register", "_instruments"]
