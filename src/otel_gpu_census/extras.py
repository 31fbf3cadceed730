"""The optional parts of the package and the extra that installs each (pyproject.toml's
``[project.optional-dependencies]``): a path that needs one says so in one line, naming the extra.

| extra        | for                                                 | modules it brings             |
|--------------|-----------------------------------------------------|-------------------------------|
| `proxy`      | the tracing proxy (`proxy`, `run --proxy`)          | aiohttp, yarl, multidict      |
| `prometheus` | a Prometheus scrape endpoint                        | opentelemetry.exporter.prometheus, prometheus_client |
| `cupti`      | libcupti for the precise census (`run --precise`)      | (a shared library, found by `launcher.find_cupti`) |
"""
from __future__ import annotations

import importlib
from typing import Dict, Optional, Tuple

DIST = "otel-gpu-census"

# extra -> (what needs it, the modules it brings)
EXTRAS: Dict[str, Tuple[str, Tuple[str, ...]]] = {
    "proxy": ("the tracing proxy", ("aiohttp", "yarl", "multidict")),
    "prometheus": ("the Prometheus endpoint", ("opentelemetry.exporter.prometheus", "prometheus_client")),
    "cupti": ("the precise census (CUPTI)", ()),
}


def install_line(extra: str) -> str:
    return f"pip install '{DIST}[{extra}]'"


def needs(extra: str, missing: str = "") -> str:
    """One line: what needs `extra`, what is missing (if said), and the install command."""
    what = EXTRAS[extra][0]
    return f"{what} needs the [{extra}] extra{f' ({missing} is not installed)' if missing else ''}: " \
           f"{install_line(extra)}"


def missing(extra: str) -> Optional[str]:
    """None when the modules of `extra` import here, else the one line of :func:`needs`."""
    modules = EXTRAS[extra][1]
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as e:
            name = getattr(e, "name", None) or module
            if not any(m == name or m.startswith(name + ".") for m in modules):
                raise            # present but broken inside (a dependency of its own missing): not the extra
            return needs(extra, name)
    return None
