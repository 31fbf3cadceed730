"""The trace-context propagators OTEL_PROPAGATORS names, without failing on one that cannot load.

OpenTelemetry reads OTEL_PROPAGATORS when `opentelemetry.propagate` is first imported and raises there
on a name with no installed propagator (``b3``, ``jaeger`` without their packages, a typo): the import,
and whatever imported it, fails with two tracebacks. Here the names are tried first; those that load are
used, the others are left out and said in one line, and with none left the W3C default
(``tracecontext,baggage``) is used.
"""
from __future__ import annotations

import os
from typing import Any, List, Optional, Tuple

W3C_DEFAULT = ("tracecontext", "baggage")


def _load(name: str):
    from opentelemetry.util._importlib_metadata import entry_points
    return next(iter(entry_points(group="opentelemetry_propagator", name=name))).load()()


def for_environment() -> Tuple[Any, Optional[str]]:
    """(an object with OpenTelemetry's `extract` and `inject`, a line naming what was left out or None)."""
    names = [n.strip() for n in os.environ.get("OTEL_PROPAGATORS", "").split(",") if n.strip()]
    dropped: List[str] = []
    loaded, used = [], []
    if any(n.lower() == "none" for n in names):
        names = []
    for name in names:
        try:
            loaded.append(_load(name))
            used.append(name)
        except StopIteration:
            dropped.append(f"{name} (not installed)")
        except Exception as e:       # a propagator package that fails to load
            dropped.append(f"{name} ({type(e).__name__})")
    if not dropped:
        from opentelemetry import propagate      # loads the same names; honours set_global_textmap
        return propagate, None
    from opentelemetry.propagators.composite import CompositePropagator
    if not loaded:
        loaded, used = [_load(n) for n in W3C_DEFAULT], list(W3C_DEFAULT)
    shown = ", ".join(dropped)
    return (CompositePropagator(loaded),
            f"OTEL_PROPAGATORS: left out {shown}; propagating {','.join(used)}")
