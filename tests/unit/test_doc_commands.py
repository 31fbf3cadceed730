"""Every command the docs give in a shell block still parses, and the ones that need no GPU, server or network
run: `otel-gpu-census` lines are parsed by the CLI's own parser (a stale option fails here, not in a user's
terminal); `report` on the bundled census folders, `env` and `--help` are run; a script or file a command names by
its path in the checkout exists."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(ROOT.glob("examples/*/README.md")),
        ROOT / "bench" / "README.md"]
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
# what a doc's shell variables stand for: the background job's pid, the llama-server binary built
SHELL_VALUES = {"$!": "4242", "$bin": "llama-server"}
CHECKOUT_DIRS = ("examples/", "bench/", "tests/", "docs/", "collector-config/", "native/")


def _commands():
    """(doc, words) of each command in a sh/bash block: continuations joined, comments, prompts and variable
    assignments in front dropped, `&&`, `||`, `;` and `|` split."""
    out = []
    for doc in DOCS:
        if not doc.exists():
            continue
        for block in re.findall(r"^```(?:sh|bash|console|shell)\n(.*?)^```", doc.read_text(), re.S | re.M):
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                line = re.sub(r"(^|\s)#.*$", "", line).strip().removeprefix("$ ")
                for part in re.split(r"\s(?:&&|\|\||;|\|)\s", line):
                    try:
                        words = shlex.split(part)
                    except ValueError:          # an unbalanced quote: the doc's own business, below
                        words = [part]
                    while words and ASSIGNMENT.match(words[0]):
                        words = words[1:]
                    if words and words[0] in ("export", "env"):
                        continue
                    words = [SHELL_VALUES.get(w, w) for w in words if w != "&"]
                    if words:
                        out.append((f"{doc.relative_to(ROOT)}", words))
    return out


COMMANDS = _commands()
CLI = [(d, w) for d, w in COMMANDS if w[0] == "otel-gpu-census"]


def test_the_docs_give_commands():
    assert len(CLI) >= 10 and any(d == "README.md" for d, _ in CLI), CLI


@pytest.mark.parametrize("doc,words", CLI, ids=[f"{d}:{' '.join(w)[:60]}" for d, w in CLI])
def test_each_otel_gpu_census_line_parses(doc, words, capsys):
    from otel_gpu_census.cli.main import build_parser
    argv = words[1:]
    if "-h" in argv or "--help" in argv:
        return                                 # run below
    try:
        build_parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"{doc}: `{' '.join(words)}` does not parse ({e.code}): {capsys.readouterr().err.strip()}")


def _runnable(words):
    argv = words[1:]
    if "--help" in argv or "-h" in argv or argv[:1] == ["env"]:
        return True
    return argv[:1] == ["report"] and all((ROOT / a).exists() for a in argv if a.startswith("examples/census/"))\
        and any(a.startswith("examples/census/") for a in argv)


RUNNABLE = [(d, w) for d, w in CLI if _runnable(w)]


@pytest.mark.parametrize("doc,words", RUNNABLE, ids=[f"{d}:{' '.join(w)[:60]}" for d, w in RUNNABLE])
def test_each_command_that_needs_no_gpu_runs(doc, words):
    r = subprocess.run([sys.executable, "-m", "otel_gpu_census.cli", *words[1:]], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() and "Traceback" not in r.stderr, f"{doc}: {words}\n{r.stderr}"


def _paths():
    out = []
    for doc, words in COMMANDS:
        for w in words[:3]:                       # the command, or the script an interpreter runs
            w = w.split("=", 1)[-1]
            if w.startswith(CHECKOUT_DIRS) and not any(c in w for c in "<>*$"):
                out.append((doc, w))
    return sorted(set(out))


@pytest.mark.parametrize("doc,path", _paths(), ids=[f"{d}:{p}" for d, p in _paths()])
def test_each_file_a_command_names_is_in_the_checkout(doc, path):
    assert (ROOT / path).exists(), f"{doc} names {path}, which is not in the checkout"
