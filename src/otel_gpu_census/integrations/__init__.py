"""Integrations: each learns a request's boundaries its own way and hands them to the engine-neutral
core (``telemetry.request``, ``attribution.ledger``). Only here may a web framework be imported."""
