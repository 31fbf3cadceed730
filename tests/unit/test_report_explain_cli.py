"""`report --request-log F --sm-occupancy R` as a user runs it: the table, the diagnoses, JSON, and
one clear line for bad input."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from serving_census import clocks, serve

ROOT = Path(__file__).resolve().parents[2]
MB = 1_000_000


def _cli(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-m", "otel_gpu_census.cli", "report", *args], env=env,
                       capture_output=True, text=True, timeout=60)
    assert "Traceback" not in p.stderr, p.stderr
    return p


@pytest.fixture
def served(census_dir, segments, records, tmp_path):
    sv = serve(records, clients=1, requests=8, save_bytes=225 * MB)
    segments.segment(census_dir, sv.records, comm="llama-server", edit=clocks())
    return census_dir, sv.write_log(tmp_path / "requests.jsonl")


def test_report_with_a_request_log(served):
    folder, log = served
    p = _cli(str(folder), "--request-log", log, "--requests", "8")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "where the GPU time went: pid" in out and "(8 requests), by 1 s:" in out
    diag = out.split("\ndiagnoses:\n")[1]
    assert "  * llama-server's prompt cache and context checkpoints saved slot state" in diag
    assert "pageable host memory" not in diag          # llama-server's buffers are not the user's to pin
    assert out.index("start-up and serving:") < out.index("per request while serving (8 requests") \
        < out.index("where the GPU time went") < out.index("diagnoses:")


def test_report_json_with_a_request_log_and_occupancy(served):
    folder, log = served
    p = _cli(str(folder), "--request-log", log, "--sm-occupancy", "14%", "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    kinds = [x["kind"] for x in d["diagnoses"]]
    assert "state_save" in kinds and "pageable_hot_path" not in kinds
    assert d["serving"]["basis"] == "requests" and d["per_request"]["scope"] == "serving"
    occ = next(x for x in d["diagnoses"] if x["kind"] == "low_occupancy")     # kernels ran ~80 % of the time
    assert occ["figures"]["sm_occupancy"] == 0.14 and 0.79 < occ["figures"]["busy_share"] < 0.81
    assert d["idle_time"][0]["whole"]["span_ns"] > 0


def test_report_without_a_log_has_no_table(served):
    folder, _ = served
    p = _cli(str(folder))
    assert p.returncode == 0 and "where the GPU time went" not in p.stdout and "state saved" not in p.stdout


@pytest.mark.parametrize("args, code, message", [
    (["--request-log", "/nonexistent/requests.jsonl"], 1, "cannot read request log /nonexistent/requests.jsonl"),
    (["--sm-occupancy", "2"], 2, "must be between 0 and 1"),
    (["--sm-occupancy", "lots"], 2, "not a ratio or a percentage"),
])
def test_bad_input_is_one_clear_line(served, args, code, message):
    folder, _ = served
    p = _cli(str(folder), *args)
    assert p.returncode == code and message in p.stderr, p.stderr
    if code == 1:
        assert len(p.stderr.strip().splitlines()) == 1 and p.stdout == ""


def test_a_log_that_is_not_json(served, tmp_path):
    folder, _ = served
    bad = tmp_path / "bad.jsonl"
    # (a log is read a line at a time: line 1 must be a good request for line 2's error to be the one said)
    bad.write_text('{"start_time_unix_nano": 1764400000000000000, "end_time_unix_nano": 1764400000000001000}\n'
                   'not json\n')
    p = _cli(str(folder), "--request-log", str(bad))
    assert p.returncode == 1 and f"{bad}, line 2: not JSON" in p.stderr
