"""The OTEL_GPU_CENSUS_* settings: one table, native/include/gpu_census_settings.def, which the injector compiles in
and Python reads here. USER settings are the README's; INTERNAL ones exist for the test suite and benches only."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
import os
from typing import Dict, List, Mapping, Optional, Tuple

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

    @property
    def choices(self) -> List[str]:
        """The values a choice takes ("a | b" in the table), the default first; [] for a free value."""
        names = [v.strip() for v in self.values.split("|")]
        return names if len(names) > 1 and all(n.replace("_", "").isalnum() for n in names) else []


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


def value(name: str, env: Optional[Mapping[str, str]] = None) -> str:
    """The setting's value as the injector reads it: unset and empty alike give ""."""
    return (os.environ if env is None else env).get(SETTINGS[name].variable, "")


def disabled(env: Optional[Mapping[str, str]] = None) -> bool:
    """OTEL_GPU_CENSUS_DISABLED as the injector reads it (config.c): set, not empty and not 0."""
    return value("DISABLED", env) not in ("", "0")


def choice(name: str, env: Optional[Mapping[str, str]] = None) -> Tuple[str, Optional[str]]:
    """A choice setting's value (one of the table's, case and spaces aside; unset: its default), and the one line
    that says a value named none of them and the default was taken (None when none is needed)."""
    s = SETTINGS[name]
    raw = value(name, env)
    v = raw.strip().lower()
    if not v:
        return s.choices[0], None
    if v in s.choices:
        return v, None
    shown = raw if len(raw) <= 40 else raw[:40] + "..."
    return s.choices[0], f"{s.variable}={shown!r} is not one of {s.values}: using {s.choices[0]}"

