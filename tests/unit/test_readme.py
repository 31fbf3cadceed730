"""The README stays a quickstart: short, no measurement diary, every known limit tied to a headline figure."""
from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
FIGURES = {e["name"]: e["value"] for e in json.loads((REPO / "bench/results/headline.json").read_text())}


def section(title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, flags=re.M | re.S)
    assert m, title
    return m.group(1)


def test_it_is_short_and_holds_no_history():
    assert len(README.splitlines()) <= 200
    assert "§" not in README
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", README)
    assert not re.search(r"\b(session|run) \d+\b", README, flags=re.I)


def test_at_most_ten_settings_in_one_table():
    rows = [ln for ln in section("Settings").splitlines() if ln.startswith("| `")]
    assert 1 <= len(rows) <= 10


def test_every_known_limit_is_one_bullet_naming_a_headline_figure_with_its_value():
    bullets = re.findall(r"^- (.*?)(?=^- |\Z)", section("Known limits"), flags=re.M | re.S)
    assert 1 <= len(bullets) <= 10
    for b in bullets:
        names = [n for n in re.findall(r"`([a-z0-9_]+)`", b) if n in FIGURES]
        assert names, b
        for n in names:        # the figure's value is quoted in the same bullet (as written in headline.json)
            v = FIGURES[n]
            shown = {f"{v:,}", f"{v:.3f}", str(v)} | ({f"{v:.3f}".rstrip("0")} if isinstance(v, float) else set())
            assert any(s in b for s in shown), (n, v, b)


def test_every_figure_the_readme_names_exists():
    named = {n for n in re.findall(r"`([a-z0-9_]+_(?:ratio|ns|us_[a-z_]+|occupancy|request|core))`", README)}
    assert named and named <= set(FIGURES), named - set(FIGURES)
