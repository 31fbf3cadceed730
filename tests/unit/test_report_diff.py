"""`report --diff A B`: the same bytes copied, in cheaper copies; every figure side by side with its
exact change, per direction and host memory kind, and per request."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from otel_gpu_census.report import diff
from otel_gpu_census.census import reader

ROOT = Path(__file__).resolve().parents[2]
MS = 1_000_000
T0 = 10**12
EACH = 3_375_000


def _run(folder: Path, segments, records, mem: str, copy_ns: int, kernels: int = 100):
    folder.mkdir(mode=0o700)
    recs = [records.memcpy("dtoh", EACH, T0 + i * 10 * MS, T0 + i * 10 * MS + copy_ns, src="device", dst=mem,
                           corr=i + 1) for i in range(64)]
    recs += [records.kernel(T0 + i * MS, T0 + i * MS + 500_000, corr=1000 + i) for i in range(kernels)]
    segments.segment(folder, recs, comm="llama-server")
    return folder


@pytest.fixture
def runs(tmp_path, segments, records):
    a = _run(tmp_path / "a", segments, records, "pageable", 1_000_000)     # 3.4 GB/s
    b = _run(tmp_path / "b", segments, records, "pinned", 125_000)         # 27 GB/s
    return a, b


def _row(text: str, label: str, after: int = 0):
    lines = text.splitlines()
    i = next(k for k, ln in enumerate(lines) if ln.startswith(label))
    return lines[i + after]


def test_same_bytes_cheaper_copies(runs):
    a, b = (diff.load_run(str(p), 64) for p in runs)
    text = diff.render_text(a, b)
    total = 64 * EACH
    assert re.search(rf"^device-to-host copies\s+64\s+64\s+0$", text, re.M), text
    assert re.search(rf"^  bytes\s+{total:,}\s+{total:,}\s+0$", text, re.M)
    assert re.search(r"^  time s\s+0\.064000\s+0\.008000\s+-0\.056000 \(-87\.5%\)$", text, re.M)
    assert re.search(r"^  GB/s\s+3\.38\s+27\.00\s+\+23\.62 \(\+700\.0%\)$", text, re.M)
    # by host memory kind: all pageable in A, all pinned in B
    assert re.search(rf"^  pageable host copies\s+64\s+0\s+-64 \(-100\.0%\)$", text, re.M)
    assert re.search(rf"^    bytes\s+{total:,}\s+0\s+-{total:,} \(-100\.0%\)$", text, re.M)
    assert re.search(rf"^  pinned host copies\s+0\s+64\s+\+64$", text, re.M)
    per = text.split("per request over the whole runs, start-up included (A: 64, B: 64; start-up not told apart: "
                     "A: pid ")[1]               # no pause in either run: start-up and serving are one
    assert re.search(rf"^  bytes\s+{EACH:,}\s+{EACH:,}\s+0$", per, re.M)
    assert re.search(r"^kernels\s+1\.56\s+1\.56\s+0$", per, re.M)           # 100/64: two decimals
    assert "GB/s" not in per
    pinned_rate = text.split("  pinned host copies")[1].splitlines()[3]
    assert re.fullmatch(r"    GB/s\s+-\s+27\.00\s+-", pinned_rate), pinned_rate    # A had no pinned copies


def test_diff_as_json_keeps_integers_exact(runs):
    a, b = (diff.load_run(str(p), n) for p, n in zip(runs, (64, 32)))
    rows = {r["figure"]: r for r in diff.to_dict(a, b)["rows"]}
    r = rows["copies.dtoh.bytes"]
    assert (r["a"], r["b"], r["change"]) == (64 * EACH, 64 * EACH, 0)
    assert (r["a_per_request"], r["b_per_request"], r["change_per_request"]) == (EACH, 2 * EACH, EACH)
    assert rows["copies.dtoh.ns"]["change"] == 64 * 125_000 - 64 * MS
    assert rows["copies.dtoh.pinned.count"]["a"] == 0 and rows["copies.dtoh.pinned.count"]["b"] == 64
    assert "a_per_request" not in rows["copies.dtoh.gb_per_s"]
    assert rows["copies.dtoh.pinned.gb_per_s"]["a"] is None and rows["copies.dtoh.pinned.gb_per_s"]["change"] is None
    assert all(isinstance(r[k], int) for r in rows.values() if r["unit"] != "GB/s" for k in ("a", "b", "change"))


def test_per_request_while_serving_leaves_each_runs_model_load_out(tmp_path, segments, records):
    from serving_census import clocks, model_load, serve
    folders = []
    for name, n in (("a", 100), ("b", 300)):           # B loads three times the weights, serves the same
        load, start = model_load(records, n=n)
        sv = serve(records, clients=1, requests=8, start_ns=start)
        folder = tmp_path / name
        folder.mkdir(mode=0o700)
        segments.segment(folder, load + sv.records, comm="llama-server", edit=clocks())
        folders.append(folder)
    a, b = (diff.load_run(str(p), 8) for p in folders)
    text = diff.render_text(a, b)
    assert re.search(r"^    bytes\s+5,000,000,000\s+15,000,000,000\s+\+10,000,000,000 \(\+200\.0%\)$", text, re.M)
    per = text.split("per request while serving (A: 8, B: 8; start-up left out):")[1]
    assert "host-to-device" not in per and re.search(r"^device-to-host copies\s+64\s+64\s+0$", per, re.M), per
    out = diff.to_dict(a, b)
    rows = {r["figure"]: r for r in out["rows"]}
    assert out["per_request_scope"] == "serving" and rows["copies.dtoh.count"]["a_per_request"] == 64
    assert "a_per_request" not in rows["copies.htod.bytes"] and "a_per_request" not in rows["copies.dtoh.pageable.count"]


def test_a_segment_file_is_a_run(runs):
    seg = reader.segment_paths(runs[0])[0]
    r = diff.load_run(str(seg))
    assert r.source == str(seg) and len(r.censuses) == 1 and r.totals().copies.get("dtoh").count == 64


# ---- the CLI -----------------------------------------------------------------------------------

def _cli(*args, tmp_path=None):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-m", "otel_gpu_census.cli", "report", *args], env=env,
                       capture_output=True, text=True, timeout=60)
    assert "Traceback" not in p.stderr, p.stderr
    return p


def test_cli_diff_text_and_json(runs):
    a, b = map(str, runs)
    p = _cli("--diff", a, b, "--requests", "64")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("otel-gpu-census diff\n") and f"  A: {a}  (1 process, 64 requests)" in p.stdout
    p = _cli("--diff", a, b, "--requests", "64,32", "--json")
    assert p.returncode == 0
    d = json.loads(p.stdout)
    assert d["a"]["requests"] == 64 and d["b"]["requests"] == 32


@pytest.mark.parametrize("extra, code, message", [
    (["--request-log", "x.jsonl"], 2, "--diff compares whole runs"),
    (["--pid", "5"], 2, "--diff compares whole runs"),
    (["--requests", "1,2,3"], 2, "expected N or NA,NB"),
    (["--requests", "0,4"], 2, "must be at least 1"),
])
def test_cli_diff_bad_arguments(runs, extra, code, message):
    p = _cli("--diff", *map(str, runs), *extra)
    assert p.returncode == code and message in p.stderr, p.stderr


def test_cli_diff_missing_or_empty_run(runs, tmp_path):
    p = _cli("--diff", str(runs[0]), str(tmp_path / "nope"))
    assert p.returncode == 1 and "does not exist" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    empty = tmp_path / "empty"
    empty.mkdir()
    p = _cli("--diff", str(empty), str(runs[1]))
    assert p.returncode == 1 and "no census segment in" in p.stderr


def test_cli_two_request_counts_need_diff(runs):
    p = _cli(str(runs[0]), "--requests", "64,32")
    assert p.returncode == 2 and "--requests NA,NB goes with --diff" in p.stderr


# ---- what neither collector measured, and the headline --------------------------------------------

def _counted_at_calls(run: diff.Run) -> diff.Run:
    """The same run as the default collector would have it: copies counted at their calls, kernel time from event
    pairs, busy and copy time not measured."""
    from dataclasses import replace
    return replace(run, censuses=[replace(c, kernels=replace(c.kernels, events=True)) for c in run.censuses])


def test_times_the_collector_did_not_measure_read_as_not_measured_not_zero(runs):
    a, b = (diff.load_run(str(p), 64) for p in runs)
    text = diff.render_text(_counted_at_calls(a), b)
    assert re.search(r"^busy s\s+—\s+[0-9.]+\s+—$", text, re.M), text
    assert re.search(r"^  time s\s+—\s+0\.008000\s+—$", text, re.M)
    assert "GB/s" in text and re.search(r"^  GB/s\s+—\s+27\.00\s+—$", text, re.M)
    out = diff.to_dict(_counted_at_calls(a), _counted_at_calls(b))
    rows = {r["figure"]: r for r in out["rows"]}
    for figure in ("busy.ns", "copies.dtoh.ns", "copies.dtoh.pinned.ns"):
        r = rows[figure]
        assert (r["a"], r["b"], r["change"], r["not_measured"]) == (None, None, None, ["a", "b"]), r
    assert "not_measured" not in rows["copies.dtoh.bytes"] and rows["copies.dtoh.bytes"]["a"] == 64 * EACH
    assert rows["copies.dtoh.ns"]["a_per_request"] is None and rows["copies.dtoh.ns"]["change_per_request"] is None
    both = diff.render_text(_counted_at_calls(a), _counted_at_calls(b))
    assert not re.search(r"^\s*(busy s|time s)\s+0\.000000", both, re.M), both


def test_the_headline_names_the_biggest_change_in_bytes_or_time(runs):
    a, b = (diff.load_run(str(p), 64) for p in runs)
    lines = diff.render_text(a, b).splitlines()
    # same bytes, the copies' time down 87.5 %: the kernels' time is the same, so the copy time leads
    assert lines[3] == ("biggest change: device-to-host copy time per request (start-up included) 0.001000 s → "
                        "0.000125 s (-87.5%)"), lines[:5]
    assert diff.to_dict(a, b)["headline"] == {"figure": "copies.dtoh.ns", "a": MS, "b": 125_000,
                                              "change": 125_000 - MS}
    a0, b0 = (diff.load_run(str(p)) for p in runs)         # no request counts: the runs' totals
    assert diff.render_text(a0, b0).splitlines()[3].startswith(
        "biggest change: device-to-host copy time 0.064000 s → 0.008000 s (-87.5%)")
    same = diff.render_text(a, a).splitlines()[3]
    assert same == "biggest change: none (no bytes moved or time measured changed per request (start-up included))"
    # not measured on one side: the copy time is no change to name; bytes and kernels did not change either
    assert diff.render_text(_counted_at_calls(a), b).splitlines()[3].startswith("biggest change: none")
