"""`report` prints the per-request figures an engine integration logged beside its segment (the vLLM
integration's ``*.requests.jsonl``), and a hostile file in that place changes nothing."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
T0 = 1_700_000_000_000_000_000


def run_report(d):
    env = dict(os.environ, PYTHONPATH=str(SRC))
    return subprocess.run([sys.executable, "-m", "otel_gpu_census.cli", "report", str(d)], env=env,
                          capture_output=True, text=True, timeout=60)


def request(i, dtoh, kns):
    return {"id": f"cmpl-{i}-0", "start_time_unix_nano": T0 + i, "end_time_unix_nano": T0 + i + 10**9,
            "first_token_time_unix_nano": T0 + i + 50_000_000, "output_tokens": 256, "status": "complete",
            "gpu": {"kernel.count": 1000 + i, "kernel.time_ns": kns, "copy.htod.bytes": 10, "copy.dtoh.bytes": dtoh}}


def test_report_prints_the_engines_per_request_figures(tmp_path, segments, records):
    d = tmp_path / "census"
    d.mkdir(mode=0o700)
    seg = segments.segment(d, [records.kernel(T0, T0 + 1000)])
    log = Path(str(seg)[:-len(".seg")] + ".requests.jsonl")
    lines = [json.dumps(request(i, dtoh, 3_500_000)) for i, dtoh in enumerate((3048, 3076, 41_276_715))]
    lines += ["not json", json.dumps({"summary": {"method": "step_tokens", "steps_split": 565,
                                                  "unattributed": {"kernel.count": 7, "copy.dtoh.bytes": 0}}})]
    log.write_text("\n".join(lines) + "\n")
    p = run_report(d)
    assert p.returncode == 0, p.stderr
    assert "per request, as the engine integration attributed them (3 requests, by step_tokens" in p.stdout
    assert "device-to-host   median 3,076 bytes, mean 13,760,946, max 41,276,715" in p.stdout
    assert "steps split 565; no request's: 7 kernels" in p.stdout
    assert "(1 lines of the log were not requests and were skipped)" in p.stdout
    assert "time to first token median 0.0500 s" in p.stdout


def test_a_fifo_or_link_in_place_of_the_log_is_ignored(tmp_path, segments, records):
    d = tmp_path / "census"
    d.mkdir(mode=0o700)
    seg = segments.segment(d, [records.kernel(T0, T0 + 1000)])
    os.mkfifo(str(seg)[:-len(".seg")] + ".requests.jsonl")
    p = run_report(d)                                           # would hang on a blocking open
    assert p.returncode == 0 and "engine integration" not in p.stdout
    os.unlink(str(seg)[:-len(".seg")] + ".requests.jsonl")
    secret = tmp_path / "elsewhere.jsonl"
    secret.write_text(json.dumps(request(1, 5, 5)) + "\n")
    os.symlink(secret, str(seg)[:-len(".seg")] + ".requests.jsonl")
    p = run_report(d)
    assert p.returncode == 0 and "engine integration" not in p.stdout


def test_report_says_when_per_request_kernel_time_is_a_sample_and_scales_it(tmp_path, segments, records):
    """Sampled kernel tracing: lines carry kernel_tracing and kernel_traced_ratio; report names the
    sample and shows kernel time / ratio beside it (a line without the keys was traced whole)."""
    d = tmp_path / "census"
    d.mkdir(mode=0o700)
    seg = segments.segment(d, [records.kernel(T0, T0 + 1000)])
    log = Path(str(seg)[:-len(".seg")] + ".requests.jsonl")
    lines = [dict(request(0, 10, 1_000_000), kernel_tracing="100/1000", kernel_traced_ratio=0.1),
             dict(request(1, 10, 3_000_000), kernel_tracing="100/1000", kernel_traced_ratio=0.5),
             dict(request(2, 10, 0), kernel_tracing="100/1000", kernel_traced_ratio=0.0),   # no estimate
             request(3, 10, 2_000_000)]
    log.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    p = run_report(d)
    assert p.returncode == 0, p.stderr
    assert "kernel time median 0.001500 s, max 0.003000 s" in p.stdout           # as logged
    assert ("kernel figures are a sample (kernel tracing 100/1000: 3 of 4 requests, median 10.0% of their "
            "steps' time traced)") in p.stdout
    # estimates 10 ms, 6 ms, 2 ms
    assert "kernel time scaled to the whole (time / traced ratio, 3 requests): median 0.006000 s, max 0.010000 s" \
        in p.stdout
    log.write_text("\n".join(json.dumps(request(i, 10, 5)) for i in range(2)) + "\n")
    assert "sample" not in run_report(d).stdout


def test_report_says_how_many_shares_are_partial_and_how_many_requests_were_dropped(tmp_path, segments, records):
    d = tmp_path / "census"
    d.mkdir(mode=0o700)
    seg = segments.segment(d, [records.kernel(T0, T0 + 1000)])
    log = Path(str(seg)[:-len(".seg")] + ".requests.jsonl")
    reqs = [request(i, 10, 100) for i in range(4)]
    note = "3 steps that served it are missing from its share (no records of them came); 9 were split"
    reqs[1].update(status="partial", notes=[note])
    reqs[2].update(status="partial", notes=["closed by the sweep"])
    summary = {"summary": {"method": "step_tokens", "steps_split": 12, "requests_dropped": 2, "unattributed": {}}}
    log.write_text("\n".join(json.dumps(x) for x in reqs + [summary]) + "\n")
    p = run_report(d)
    assert p.returncode == 0, p.stderr
    assert f'2 requests partial: their shares miss work they know of (e.g. "{note}"); 0 stale; 2 dropped' in p.stdout
    complete = Path(str(seg)[:-len(".seg")] + ".requests.jsonl")
    complete.write_text("\n".join(json.dumps(request(i, 10, 100)) for i in range(2)) + "\n")
    assert "partial" not in run_report(d).stdout
