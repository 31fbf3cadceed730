"""Code holds no history: no `§` references to measurement chapters, no dates, no session or run numbers and no
one machine's name in src/ or native/, nor in the comments and docstrings of tests/ (a test's data may name a GPU model
or a date: what it feeds the code is not history). The why stays in a few words; the figures and their history live
in docs/measurements.md, docs/archive/ and bench/results/."""
from __future__ import annotations

import ast
import io
import re
import tokenize
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
THIS = Path(__file__).resolve()


def sources(tops=("src", "native"), suffixes=SUFFIXES):
    for top in tops:
        for p in sorted((ROOT / top).rglob("*")):
            parts = set(p.relative_to(ROOT).parts)
            if p.is_file() and (p.suffix in suffixes or p.name == "Makefile") and not parts & SKIP_DIRS \
                    and not any(x.endswith(".egg-info") for x in parts):
                yield p


def history(text: str):
    for n, line in enumerate(text.splitlines(), 1):
        for what, pattern in HISTORY:
            if pattern.search(line):
                yield n, what, line.strip()


def prose(path: Path) -> str:
    """A test file's comments and docstrings, each on its own line number (code and data blanked)."""
    text = path.read_text(errors="replace")
    lines = [""] * (text.count("\n") + 2)
    if path.suffix == ".sh":   # shell: the lines that are comments
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip().startswith("#"):
                lines[n] = line
        return "\n".join(lines[1:])
    if path.suffix != ".py":   # C and CUDA: /* */ and // comments, wherever they stand
        for m in re.finditer(r"/\*.*?\*/|//[^\n]*", text, re.S):
            first = text.count("\n", 0, m.start()) + 1
            for k, line in enumerate(m.group(0).split("\n")):
                lines[first + k] += " " + line
        return "\n".join(lines[1:])
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            lines[tok.start[0]] += tok.string
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            for k, line in enumerate(body[0].value.value.splitlines()):
                lines[body[0].lineno + k] += " " + line
    return "\n".join(lines[1:])


def test_the_patterns_catch_what_they_are_for():
    sample = ("x  # measured on the H200 (docs/measurements.md §27, 2026-12-04, session 18)\n"
              "y  # run 3 of the H100 sweep\nz  # a clean comment: run the census, 2 sessions\n")
    found = {(n, what) for n, what, _ in history(sample)}
    assert found == {(1, "a § reference"), (1, "a date"), (1, "a session or run number"), (1, "one machine's name"),
                     (2, "a session or run number"), (2, "one machine's name")}


def test_prose_is_comments_and_docstrings_only(tmp_path):
    p = tmp_path / "t.py"
    p.write_text('"""Recorded on the H200."""\nGPU = "NVIDIA H200"  # a model name\n\n\ndef f():\n'
                 '    """run 3 of it"""\n    return "2026-12-02"\n')
    found = {(n, what) for n, what, _ in history(prose(p))}
    assert found == {(1, "one machine's name"), (6, "a session or run number")}
    c = tmp_path / "t.c"
    c.write_text('/* measured on the H100 */\nconst char *m = "H100";\n')
    assert {n for n, _, _ in history(prose(c))} == {1}


def test_src_and_native_hold_no_history():
    files = list(sources())
    assert len(files) > 20
    hits = [f"{p.relative_to(ROOT)}:{n}: {what}: {line[:100]}" for p in files
            for n, what, line in history(p.read_text(errors="replace"))]
    assert not hits, "history in product code (it belongs in docs/measurements.md):\n" + "\n".join(hits)


def test_tests_comments_hold_no_history():
    files = [p for p in sources(("tests",), SUFFIXES | {".sh"}) if p != THIS]
    assert len(files) > 50
    hits = [f"{p.relative_to(ROOT)}:{n}: {what}: {line[:100]}" for p in files
            for n, what, line in history(prose(p))]
    assert not hits, "history in a test's comments (it belongs in docs/measurements.md):\n" + "\n".join(hits)
