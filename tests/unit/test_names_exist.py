"""Every file path and setting name that a comment or a doc writes exists: a path names a file or folder of the
checkout (or one of the few outside files listed here), an OTEL_GPU_CENSUS_* name (or a bare SETTING=value) is a row
of native/include/gpu_census_settings.def. A rename that leaves a comment pointing at nothing fails here."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_no_history import ROOT, prose  # noqa: E402

from otel_gpu_census.settings import SETTINGS  # noqa: E402

# files of other projects that comments name: CUDA's and CUPTI's headers, the engines' sources
OUTSIDE = {"cuda.h", "cupti.h", "generated_cuda_meta.h", "vllm/v1/worker/ubatching.py",
           "phoenix/server/grpc_server.py",
           "table.md"}                      # ... and a file a script writes
# settings the tests set on purpose to see them refused as unknown
TYPOS = {"KERNEL", "NOSUCH"}
# NAME=value forms of other programs' variables
FOREIGN = re.compile(r"^(OTEL_(?!GPU_CENSUS_)|MOCK_|PHOENIX_|VLLM_|SGLANG_|CUDA_|GGML_|LD_|PYTHON|PROBE$)")
PATH = re.compile(r"(?<![\w/.$}\"'-])((?:[\w.-]+/)*[\w-]+\.(?:c|h|py|md|def|sh|cu|cuh|map))\b")
SETTING = re.compile(r"\bOTEL_GPU_CENSUS_([A-Z0-9_]*[A-Z0-9])")
BARE = re.compile(r"(?<![\w.])([A-Z][A-Z0-9_]{3,})=[a-z0-9]")
OPTION = re.compile(r"\b(run|report|env|doctor|proxy) (--[a-z][a-z-]*)")
DOC_SKIP = ("docs/archive/", "docs/measurements.md", "bench/")   # history: what was, under the names of then


def tracked():
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True, check=True).stdout
    return [f for f in out.split() if (ROOT / f).exists()]


FILES = tracked()


def _options():
    import argparse

    from otel_gpu_census.cli.main import build_parser
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {verb: {o for a in p._actions for o in a.option_strings} for verb, p in sub.choices.items()}


OPTIONS = _options()
NAMES = {Path(f).name for f in FILES} | {p for f in FILES for p in map(str, Path(f).parents) if p != "."}


def exists(name: str) -> bool:
    if name in OUTSIDE or name in NAMES or any(c.isupper() for c in Path(name).stem if c.isalpha()) \
            and "_" in Path(name).stem and Path(name).stem.upper() != Path(name).stem:
        return True
    rel = name.lstrip("./")
    while rel.startswith("../"):
        rel = rel[3:]
    return any(f == rel or f.endswith("/" + rel) for f in FILES)


def texts():
    """(file, prose): docs whole, code by its comments and docstrings."""
    for f in FILES:
        p = ROOT / f
        if f.startswith(DOC_SKIP) or p == Path(__file__).resolve():    # this file names what it catches
            continue
        if p.suffix == ".md" and (f.startswith(("docs/", "examples/")) or "/" not in f):
            yield f, p.read_text(errors="replace")
        elif f.startswith(("src/", "native/", "tests/")) and p.suffix in {".py", ".c", ".h", ".cu", ".cuh", ".sh"}:
            yield f, prose(p)


def dangling(f: str, text: str):
    for n, line in enumerate(text.splitlines(), 1):
        for m in PATH.finditer(line):
            if not exists(m.group(1)):
                yield f"{f}:{n}: no file {m.group(1)}"
        for m in SETTING.finditer(line):
            if m.group(1) not in SETTINGS and not (f.startswith("tests/") and m.group(1) in TYPOS):
                yield f"{f}:{n}: no setting OTEL_GPU_CENSUS_{m.group(1)}"
        for m in OPTION.finditer(line):
            if m.group(2) not in OPTIONS[m.group(1)]:
                yield f"{f}:{n}: no option {m.group(1)} {m.group(2)}"
        for m in BARE.finditer(line.replace("OTEL_GPU_CENSUS_", "")):
            name = m.group(1)
            if name not in SETTINGS and not FOREIGN.match(name) and not line[:m.start()].endswith("OTEL_"):
                yield f"{f}:{n}: no setting {name} (in {name}=...)"


def test_the_checks_catch_what_they_are_for():
    found = list(dangling("x.c", "see native/src/core/timing.c and steps.c\nOTEL_GPU_CENSUS_KERNELS=counted, "
                                 "ATTACH=context; OTEL_GPU_CENSUS_COLLECTOR=precise, CUDA_VISIBLE_DEVICES=0\n"
                                 "`run --activity off`, `run --precise`\n"))
    assert found == ["x.c:1: no file native/src/core/timing.c", "x.c:2: no setting OTEL_GPU_CENSUS_KERNELS",
                     "x.c:2: no setting KERNELS (in KERNELS=...)", "x.c:2: no setting ATTACH (in ATTACH=...)",
                     "x.c:3: no option run --activity"]


@pytest.mark.parametrize("kind", ["docs", "code"])
def test_every_name_written_exists(kind):
    pairs = [(f, t) for f, t in texts() if (f.endswith(".md")) == (kind == "docs")]
    assert len(pairs) > (5 if kind == "docs" else 100)
    hits = [h for f, t in pairs for h in dangling(f, t)]
    assert not hits, "names that point at nothing:\n" + "\n".join(hits)
