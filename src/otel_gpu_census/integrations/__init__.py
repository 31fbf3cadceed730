"""Integrations: each learns request boundaries its own way (an HTTP stream, engine steps) and hands them to the request-telemetry core."""
