"""One table of settings for C and Python (native/include/gpu_census_settings.def): every OTEL_GPU_CENSUS_* name the
code reads is in it, the injector knows exactly its names, and the README documents its user settings and no other."""
from __future__ import annotations

import re
from pathlib import Path

from otel_gpu_census.settings import PREFIX, SETTINGS, USER_SETTINGS, markdown_table

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"OTEL_GPU_CENSUS_([A-Z][A-Z0-9_]*[A-Z0-9])")


def test_every_name_the_code_reads_is_in_the_table():
    used = {}
    for f in list((ROOT / "src").rglob("*.py")) + list((ROOT / "native" / "src").rglob("*.[ch]")):
        for m in NAME.finditer(f.read_text()):
            used.setdefault(m.group(1), f.name)
    unknown = {n: f for n, f in used.items() if n not in SETTINGS}
    assert not unknown, f"settings used but not in gpu_census_settings.def: {unknown}"


def test_the_table_is_small_for_users_and_parsed_whole():
    table = (ROOT / "native" / "include" / "gpu_census_settings.def").read_text()
    assert len(SETTINGS) == sum(1 for line in table.splitlines() if line.startswith("S("))
    assert 5 <= len(USER_SETTINGS) <= 10
    assert {s.name for s in USER_SETTINGS} >= {"DIR", "COLLECTOR", "DISABLED"}
    assert markdown_table().count("\n") == len(USER_SETTINGS) + 1


def test_the_readme_documents_the_user_settings_and_no_internal_one():
    readme = (ROOT / "README.md").read_text()
    named = set(NAME.findall(readme))
    assert {s.name for s in USER_SETTINGS} <= named, "user settings missing from the README"
    internal = {n for n in named if n in SETTINGS and not SETTINGS[n].user}
    assert not internal, f"the README documents internal settings: {sorted(internal)}"
    assert PREFIX + "COLLECTOR" in readme


def test_a_choice_and_disabled_are_read_one_way_from_the_table():
    from otel_gpu_census import settings
    assert settings.SETTINGS["COLLECTOR"].choices == ["default", "precise"]
    assert settings.SETTINGS["DIR"].choices == [] and settings.SETTINGS["FLUSH_MS"].choices == []
    assert settings.choice("COLLECTOR", {}) == ("default", None)
    assert settings.choice("COLLECTOR", {PREFIX + "COLLECTOR": " Precise "}) == ("precise", None)
    value, warning = settings.choice("COLLECTOR", {PREFIX + "COLLECTOR": "sometimes"})
    assert value == "default" and warning == \
        f"{PREFIX}COLLECTOR='sometimes' is not one of default | precise: using default"
    # the injector's rule (config.c, gc_config_disabled): set, not empty, not 0
    assert [settings.disabled({PREFIX + "DISABLED": v}) for v in ("", "0", "1", "yes", "00")] == \
        [False, False, True, True, True]
    assert not settings.disabled({})
