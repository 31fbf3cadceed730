"""Trying the census without a GPU: the `report` commands that examples/census/README.md (and the README's
first lines, where they show them) give on the census folders recorded on a GPU, run as written, say what
those runs showed. Skipped while a folder is not there (the samples are recorded on a GPU machine)."""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "examples" / "census"
DEFAULT, NOCACHE = SAMPLES / "llama-default", SAMPLES / "llama-nocache"


def _commands():
    """Every `otel-gpu-census report …` line over examples/census in a shell block of the two READMEs."""
    out = []
    for doc in (ROOT / "README.md", SAMPLES / "README.md"):
        if not doc.exists():
            continue
        for block in re.findall(r"```(?:sh|bash|console)?\n(.*?)```", doc.read_text(), re.S):
            for line in block.splitlines():
                line = line.split("  #")[0].strip()
                if line.startswith("otel-gpu-census report") and "examples/census/" in line:
                    out.append((doc.name, line))
    return out


def _folders_of(line: str):
    return [ROOT / a for a in shlex.split(line) if a.startswith("examples/census/")]


def _run(line: str) -> subprocess.CompletedProcess:
    argv = shlex.split(line)
    return subprocess.run([sys.executable, "-m", "otel_gpu_census.cli", *argv[1:]], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def _need(*folders):
    for f in folders:
        if not f.is_dir() or not list(f.glob("gpu-census-*.seg")):
            pytest.skip(f"{f.relative_to(ROOT)} is not recorded yet (a census folder from a GPU machine)")


def test_the_readme_shows_report_and_diff_on_the_samples():
    lines = [line for _, line in _commands()]
    assert any("--diff" not in x for x in lines) and any("--diff" in x for x in lines), lines


@pytest.mark.parametrize("doc,line", _commands(), ids=lambda x: x if isinstance(x, str) and " " not in x else None)
def test_each_command_runs_as_written(doc, line):
    _need(*{p.parent if p.suffix else p for p in _folders_of(line)})
    r = _run(line)
    assert r.returncode == 0, f"{doc}: {line}\n{r.stdout}{r.stderr}"
    assert r.stdout.strip() and "Traceback" not in r.stderr


def test_the_default_server_is_found_saving_state_at_every_request():
    _need(DEFAULT)
    r = _run(f"otel-gpu-census report {DEFAULT.relative_to(ROOT)} --request-log "
             f"{(DEFAULT / 'requests.jsonl').relative_to(ROOT)}")
    assert r.returncode == 0, r.stderr
    assert "saved slot state to host memory" in r.stdout and "--cache-ram 0 --ctx-checkpoints 0" in r.stdout
    assert "where the GPU time went" in r.stdout


def test_the_diff_shows_the_state_save_gone():
    _need(DEFAULT, NOCACHE)
    r = _run(f"otel-gpu-census report --diff {DEFAULT.relative_to(ROOT)} {NOCACHE.relative_to(ROOT)} --requests 64")
    assert r.returncode == 0, r.stderr
    rows = {}
    for x in r.stdout.splitlines():   # the run totals come first, the per-request figures after
        if x.strip():
            rows.setdefault(x.split("  ")[0].strip(), x.split())
    copies = [int(v.replace(",", "")) for v in rows["device-to-host copies"][2:4]]
    assert copies[1] < copies[0] / 4                   # the state saves (pageable copies) are gone
    # the default collector measures no copy or busy time: said, never a zero
    assert not re.search(r"^\s*(busy s|time s)\s+0\.000000", r.stdout, re.M), r.stdout
    assert re.search(r"^busy s\s+—\s+—\s+—$", r.stdout, re.M)
    assert r.stdout.splitlines()[3] == ("biggest change: device-to-host bytes per request (start-up included) "
                                        "481.0 MB → 32.8 MB (481,014,432 → 32,849,568 B, -93.2%)")


def _output_block(doc: Path, has: str) -> str:
    blocks = [b for lang, b in re.findall(r"^```(\w*)\n(.*?)^```", doc.read_text(), re.S | re.M)
              if not lang and has in b]
    assert len(blocks) == 1, (doc, has, blocks)
    return blocks[0]


def _in_order(shown: str, out: str) -> None:
    """Every part of `shown` between its `...` elisions is in `out`, in that order, whitespace aside (the README
    wraps a long line)."""
    flat = " ".join(out.split())
    at = 0
    for part in (" ".join(p.split()) for p in shown.split("...")):
        i = flat.find(part, at)
        assert part and i >= 0, f"not in the output (after char {at}): {part!r}\n{out}"
        at = i + len(part)


def test_the_readmes_sample_output_is_what_the_bundled_sample_prints():
    _need(DEFAULT, NOCACHE)
    readme = ROOT / "README.md"
    r = _run(f"otel-gpu-census report {DEFAULT.relative_to(ROOT)} --request-log "
             f"{(DEFAULT / 'requests.jsonl').relative_to(ROOT)}")
    assert r.returncode == 0, r.stderr
    _in_order(_output_block(readme, "diagnoses:"), r.stdout)
    d = _run(f"otel-gpu-census report --diff {DEFAULT.relative_to(ROOT)} {NOCACHE.relative_to(ROOT)} --requests 64")
    (shown,) = re.findall(r"The diff's headline: `(.+?)`", readme.read_text())
    (line,) = [x for x in d.stdout.splitlines() if x.startswith("biggest change: ")]
    assert line.startswith("biggest change: " + shown), (shown, line)


def test_what_the_flags_bought_is_the_recorded_bench():
    """The README's tokens/s and TTFT for the two flags are the bench's plain rows (no census) of the same load."""
    raw = json.loads((ROOT / "bench/results/llamacpp_prompt_cache_d2h_bytes_per_request/server-flags.json")
                     .read_text())
    plain = {r["flags"]: r for r in raw["rows"] if r["variant"] == "plain"}
    text = " ".join((ROOT / "README.md").read_text().split())
    m = re.search(r"took output from ([\d.]+) to ([\d.]+) tokens/s and TTFT p50 from ([\d.]+) to ([\d.]+) s", text)
    assert m, "the README no longer says what the flags bought"
    assert [float(x) for x in m.groups()] == [round(plain["default"]["census"], 1), round(plain["nocache"]["census"], 1),
                                              round(plain["default"]["ttft_p50_s"], 3),
                                              round(plain["nocache"]["ttft_p50_s"], 3)]
    assert raw["config"]["prompt_tokens"] == 1800 and raw["config"]["clients"] == 16     # the samples' load
