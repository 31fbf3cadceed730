"""otel-gpu-census: an exact census of GPU kernels and copies per process and per request, over OpenTelemetry.

Layers, one way: integrations → telemetry → attribution → census (docs/architecture.md).
"""
