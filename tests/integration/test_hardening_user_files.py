"""Files a user names to a command, read with a memory bound: `report --request-log` refuses a FIFO or
a device at once (never waits on one), reads a line at a time with a bound on each line and on the
requests kept, and says what it left. Real files, the real CLI, under an address-space limit."""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from otel_gpu_census.report import request_log

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]
SRC, CENSUS = ROOT / "src", ROOT / "examples" / "census" / "llama-default"
T = 1_764_400_000_000_000_000
MEMORY = 1 << 30                     # what a report may take (its own figures are a few dozen MB)


def _limit():
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))


def _report(tmp_path, log, timeout=60):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "CUDA_INJECTION"))}
    env.update(PYTHONPATH=str(SRC), XDG_RUNTIME_DIR=str(tmp_path))
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "otel_gpu_census.cli", "report", str(CENSUS), "--request-log", str(log)],
                       env=env, capture_output=True, timeout=timeout, preexec_fn=_limit)
    err = p.stderr.decode("utf-8", "replace")
    assert "Traceback" not in err and "MemoryError" not in err, err[-2000:]
    return p.returncode, p.stdout.decode("utf-8", "replace"), err, time.monotonic() - t0


@pytest.mark.parametrize("what", ["fifo", "device"])
def test_a_fifo_or_a_device_is_refused_at_once(tmp_path, what):
    if what == "fifo":
        log = tmp_path / "requests.jsonl"
        os.mkfifo(log)                    # nobody ever writes it
        kind = "is a FIFO"
    else:
        log, kind = Path("/dev/zero"), "is a character device"
    rc, _, err, took = _report(tmp_path, log, timeout=30)
    assert rc == 1 and kind in err and len(err.strip().splitlines()) == 1 and took < 20


def test_a_huge_line_is_refused_within_the_memory_bound(tmp_path):
    log = tmp_path / "requests.jsonl"
    with open(log, "wb") as f:
        f.truncate(2 * MEMORY)            # sparse: 2 GiB of NUL bytes, one "line", no disk used
    rc, _, err, _ = _report(tmp_path, log)
    assert rc == 1 and "line 1: over 16,777,216 characters" in err and len(err.strip().splitlines()) == 1


def test_a_pretty_printed_document_past_its_bound_is_refused(monkeypatch):
    monkeypatch.setattr(request_log, "MAX_DOCUMENT_CHARS", 1000)
    lines = ["{\n"] + ['  "x": 1,\n'] * 200 + ["}\n"]
    with pytest.raises(request_log.RequestLogError, match="not one JSON document of up to 1,000 characters"):
        request_log.parse(iter(lines), "r.jsonl")


def test_requests_past_the_bound_are_left_and_said(tmp_path, monkeypatch):
    monkeypatch.setattr(request_log, "MAX_REQUESTS", 100)
    log = tmp_path / "requests.jsonl"
    log.write_text("".join(json.dumps({"start_time_unix_nano": T + i, "end_time_unix_nano": T + i + 5}) + "\n"
                           for i in range(1000)))
    recs = request_log.load(str(log))
    assert len(recs) == 100 and recs[0].start_ns == T
    assert recs.unread == "900 lines past the first 100 requests were not read"


def test_the_report_says_what_it_left(tmp_path):
    n = request_log.MAX_REQUESTS + 3
    log = tmp_path / "requests.jsonl"
    line = '{"start_time_unix_nano": %d, "end_time_unix_nano": %d}\n' % (T, T + 5)
    log.write_text(line * n)
    rc, out, err, _ = _report(tmp_path, log, timeout=110)
    assert rc == 0 and "3 lines past the first 500,000 requests were not read" in err


def test_thousands_of_empty_segment_named_files_cost_a_few_lines_and_the_report_stands(tmp_path):
    d = tmp_path / "census"
    d.mkdir(mode=0o700)
    for seg in CENSUS.glob("*.seg"):
        (d / seg.name).write_bytes(seg.read_bytes())
    for i in range(2000):
        (d / f"gpu-census-{100000 + i}-{i}.seg").touch()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "CUDA_INJECTION"))}
    env.update(PYTHONPATH=str(SRC), XDG_RUNTIME_DIR=str(tmp_path))
    p = subprocess.run([sys.executable, "-m", "otel_gpu_census.cli", "report", str(d)], env=env,
                       capture_output=True, text=True, timeout=60)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and "Traceback" not in p.stderr and len(lines) == 11
    assert lines[-1].startswith("otel-gpu-census: and 1,990 more files named like segments could not be read (1,990: ")
    assert "llama-server" in p.stdout                   # the census that could be read is still reported
