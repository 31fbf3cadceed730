"""SGLang: each request's GPU cost, measured in every scheduler process, in the caller's trace.

Install the package and start SGLang under the census; the ``sglang.srt.plugins`` entry point
(``otel_gpu_census``; ``SGLANG_PLUGINS`` may list it) loads this integration in every SGLang process::

    pip install .                 # from a checkout of otel-gpu-census, beside SGLang
    OTEL_EXPORTER_OTLP_ENDPOINT=http://collector:4317 otel-gpu-census run -- python -m sglang.launch_server --model-path MODEL

Each request gets one span (``chat MODEL`` / ``text_completion MODEL``, kind SERVER) under the client's
``traceparent`` (kept even when SGLang's own tracing is off), with TTFT, queue time, token counts and its
share of every batch that served it: kernels, kernel time and copies by direction (``gpu_census.*``, the
same attributes as the vLLM integration and the llama.cpp proxy).

Also an OpenTelemetry instrumentor (``opentelemetry_instrumentor`` entry point ``sglang``)::

    from otel_gpu_census.integrations.sglang import SglangInstrumentor
    SglangInstrumentor().instrument(tracer_provider=tp, meter_provider=mp)   # both optional

Spans and metrics go to the providers given to ``instrument()``, else to the application's (SDK providers
set globally, as ``opentelemetry-instrument`` does), else to providers built from the OTEL_* variables.
``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS=sglang`` (or ``*``) switches it off. Without the census injector in the
process it does nothing and says so once; any failure of its own switches it off with one log line and
SGLang serves on. Supported: see ``package._instruments``.
"""
from otel_gpu_census.integrations.sglang.instrumentor import SglangInstrumentor, register
from otel_gpu_census.integrations.sglang.package import _instruments

__all__ = ["SglangInstrumentor", "register", "_instruments"]
