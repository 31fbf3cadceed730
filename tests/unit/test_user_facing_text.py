"""What a user reads besides the output: every command's --help, and the files the docs send them to."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from otel_gpu_census.cli import main as cli

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = [[], ["run"], ["report"], ["doctor"], ["proxy"]]


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(a) or "otel-gpu-census")
def test_help_prints_what_argparse_means(argv, capsys):
    """argparse %-formats help strings but not descriptions: a '%%' in a description prints as is."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv + ["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "%%" not in out
    if argv == ["report"]:
        assert "busy %," in out


def _docs():
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").rglob("*.md")),
            *sorted((ROOT / "collector-config").rglob("*.md")), ROOT / "bench" / "README.md"]


def test_test_files_the_docs_name_exist():
    """A path like tests/…py or tests/…sh in the docs is one a reader can open (history in
    docs/measurements.md names files of its time and is left as it was)."""
    missing = []
    for doc in _docs():
        if doc.name == "measurements.md" or not doc.exists():
            continue
        for m in re.finditer(r"(?<![\w/.-])((?:bench/)?tests/[\w/.-]+\.(?:py|sh))", doc.read_text()):
            if not (ROOT / m.group(1)).exists():
                missing.append(f"{doc.relative_to(ROOT)}: {m.group(1)}")
    assert missing == []
