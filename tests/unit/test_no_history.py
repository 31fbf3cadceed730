"""Product code holds no history: no `§` references to measurement chapters, no dates, no session or run numbers and no
one machine's name in src/ or native/. The why stays in a few words; the figures and their history live in
docs/measurements.md, docs/archive/ and bench/results/."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUFFIXES = {".py", ".c", ".h", ".cu", ".cuh", ".def", ".map"}
SKIP_DIRS = {"build", "__pycache__"}
HISTORY = [
    ("a § reference", re.compile("§")),
    ("a date", re.compile(r"\b\d{4}-\d{2}-\d{2}\b")),
    ("a session or run number", re.compile(r"\b(session|run)s? \d+\b", re.I)),
    ("one machine's name", re.compile(r"\b[HA]100\b|\bH200\b|\bB200\b")),
]


def sources():
    for top in ("src", "native"):
        for p in sorted((ROOT / top).rglob("*")):
            parts = set(p.relative_to(ROOT).parts)
            if p.is_file() and (p.suffix in SUFFIXES or p.name == "Makefile") and not parts & SKIP_DIRS \
                    and not any(x.endswith(".egg-info") for x in parts):
                yield p


def history(text: str):
    for n, line in enumerate(text.splitlines(), 1):
        for what, pattern in HISTORY:
            if pattern.search(line):
                yield n, what, line.strip()


def test_the_patterns_catch_what_they_are_for():
    sample = ("x  # measured on the H200 (docs/measurements.md §27, 2026-12-04, session 18)\n"
              "y  # run 3 of the H100 sweep\nz  # a clean comment: run the census, 2 sessions\n")
    found = {(n, what) for n, what, _ in history(sample)}
    assert found == {(1, "a § reference"), (1, "a date"), (1, "a session or run number"), (1, "one machine's name"),
                     (2, "a session or run number"), (2, "one machine's name")}


def test_src_and_native_hold_no_history():
    files = list(sources())
    assert len(files) > 20
    hits = [f"{p.relative_to(ROOT)}:{n}: {what}: {line[:100]}" for p in files
            for n, what, line in history(p.read_text(errors="replace"))]
    assert not hits, "history in product code (it belongs in docs/measurements.md):\n" + "\n".join(hits)
