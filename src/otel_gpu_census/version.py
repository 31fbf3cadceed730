"""The package's version, from one source: the installed distribution's metadata (pyproject.toml)."""
from __future__ import annotations

from typing import Optional

DISTRIBUTION = "otel-gpu-census"


def installed_version() -> Optional[str]:
    """The installed distribution's version; None in a source checkout that was never installed."""
    try:
        from importlib.metadata import version
        return version(DISTRIBUTION)
    except Exception:
        return None


__version__ = installed_version() or "0+unknown"
