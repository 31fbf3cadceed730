"""The OTEL_GPU_CENSUS_* settings: one table, native/include/gpu_census_settings.def, which the injector compiles in
and Python reads here. USER settings are the README's; INTERNAL ones exist for the test suite and benches only."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict

from otel_gpu_census._native import header_path

PREFIX = "OTEL_GPU_CENSUS_"
TABLE_NAME = "gpu_census_settings.def"
_LINE = re.compile(r'^S\((\w+), (USER|INTERNAL), "((?:[^"\\]|\\.)*)", "((?:[^"\\]|\\.)*)", "((?:[^"\\]|\\.)*)"\)$')


@dataclass(frozen=True)
class Setting:
    name: str           # without the prefix
    user: bool
    default: str
    values: str
    help: str

    @property
    def variable(self) -> str:
        return PREFIX + self.name


def _load() -> Dict[str, Setting]:
    text = (header_path().parent / TABLE_NAME).read_text()
    out = {}
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if m:
            name, audience, default, values, help_ = m.groups()
            out[name] = Setting(name, audience == "USER", default, values, help_)
    return out


SETTINGS: Dict[str, Setting] = _load()
USER_SETTINGS = [s for s in SETTINGS.values() if s.user]


def markdown_table() -> str:
    """The README's table of user settings."""
    rows = ["| variable | default | values | what it does |", "|---|---|---|---|"]
    cell = lambda text: text.replace("|", "\\|")      # noqa: E731  (a value list's pipes inside a table cell)
    rows += [f"| `{s.variable}` | {cell(s.default)} | {cell(s.values)} | {cell(s.help)} |" for s in USER_SETTINGS]
    return "\n".join(rows)
