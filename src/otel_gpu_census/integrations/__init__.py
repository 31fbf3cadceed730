"""Integrations: each learns a request's boundaries its own way (an HTTP stream, engine steps) and
hands them to the engine-neutral core (``telemetry.request``, ``attribution.ledger``,
``attribution.steps``). Only here may a web framework be imported."""
