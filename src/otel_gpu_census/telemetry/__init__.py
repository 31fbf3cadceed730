"""Telemetry: everything that leaves the process as OpenTelemetry.

- ``setup``: the tracer and meter providers, from OTEL_* variables and flags (one table per signal);
- ``census_metrics``, ``nvml``, ``sidecar``: the census's and NVML's instruments, and ``run``'s sidecar;
- ``request``: one request lifecycle (span, GenAI metrics, GPU cost) for every integration, with
  ``attributes`` (GPU span attributes) and ``instruments`` (request metrics).

Imports run one way: this package reads ``attribution`` and ``census``, never an integration, and
never a web framework.
"""
