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


# ---- a hostile or huge log: bounded in bytes, lines and objects; bad types skipped ----------------

def test_a_log_of_many_tiny_lines_is_bounded_in_objects_and_says_what_it_did_not_read(tmp_path):
    import tracemalloc
    from otel_gpu_census.report import engine_requests
    log = tmp_path / "gpu-census-1-1.requests.jsonl"
    tiny = b'{"gpu":{}}\n'
    with open(log, "wb") as f:
        f.write(tiny * ((8 << 20) // len(tiny)))                # 8 MiB: 762,600 lines
        f.write(b'{"summary":{"method":"step_tokens"}}\n')
    tracemalloc.start()
    try:
        got = engine_requests.read(str(log))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(got.requests) == engine_requests.MAX_REQUESTS
    assert got.unread == f"{762_600 - engine_requests.MAX_REQUESTS + 1:,} lines past the first 200,000 requests " \
                         "were not read"
    assert got.summary == {"method": "step_tokens"}               # the last line is still read
    assert peak < 96 << 20, f"{peak >> 20} MiB for 200,000 requests"        # parsed whole: 400 MiB


def test_a_log_over_the_byte_bound_says_so(tmp_path, monkeypatch):
    from otel_gpu_census.report import engine_requests
    monkeypatch.setattr(engine_requests, "MAX_BYTES", 1000)
    log = tmp_path / "x.requests.jsonl"
    log.write_text("\n".join(json.dumps(request(i, 5, 5)) for i in range(40)) + "\n")
    got = engine_requests.read(str(log))
    assert 0 < len(got.requests) < 40 and got.unread == f"the log is {log.stat().st_size:,} bytes: only its first " \
                                                        "1,000 were read"


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


def test_lines_with_wrong_types_or_values_are_skipped_not_trusted(tmp_path, segments, records):
    d = tmp_path / "census"
    d.mkdir(mode=0o700)
    seg = segments.segment(d, [records.kernel(T0, T0 + 1000)])
    log = Path(str(seg)[:-len(".seg")] + ".requests.jsonl")
    good = request(1, 100, 5)
    bad = [dict(good, gpu={"copy.dtoh.bytes": "100"}), dict(good, gpu={"copy.dtoh.bytes": 1.5e300}),
           dict(good, gpu={"copy.dtoh.bytes": 10 ** 30}), dict(good, gpu={"kernel.count": -1}),
           dict(good, gpu={"kernel.count": True}), dict(good, start_time_unix_nano="x"),
           dict(good, first_token_time_unix_nano=10 ** 400), dict(good, gpu=[1, 2])]
    lines = [json.dumps(x) for x in bad] + ["[" * 100_000 + "]" * 100_000, '{"gpu":{"kernel.count":' + "9" * 5000 + "}}",
                                            json.dumps(dict(good, pad="x" * (70 << 10))), json.dumps(good),
                                            '{"gpu":{}, "kernel_traced_ratio": NaN, "kernel_tracing": 5}']
    log.write_text("\n".join(lines) + "\n")
    p = run_report(d)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert "(2 requests, by step_tokens" in p.stdout and "(11 lines of the log were not requests" in p.stdout
    assert "device-to-host   median 50 bytes, mean 50, max 100" in p.stdout


def test_report_says_when_a_log_was_not_read_whole(tmp_path, segments, records):
    from otel_gpu_census.report import engine_requests
    d = tmp_path / "census"
    d.mkdir(mode=0o700)
    seg = segments.segment(d, [records.kernel(T0, T0 + 1000)])
    log = Path(str(seg)[:-len(".seg")] + ".requests.jsonl")
    log.write_bytes(b'{"gpu":{"kernel.count":1}}\n' * (engine_requests.MAX_REQUESTS + 5))
    p = run_report(d)
    assert p.returncode == 0, p.stderr
    assert "(200,000 requests, by step_tokens" in p.stdout
    assert "(5 lines past the first 200,000 requests were not read: the figures above are of the requests read)" \
        in p.stdout


def test_report_by_tenant_and_model_adds_up_to_the_steps_and_says_what_was_outside_them(tmp_path, segments, records,
                                                                                      tagged):
    """`report --by tenant|model` over a log an engine wrote beside its real segment: one row per tenant (a request
    without one: unknown), unattributed, the steps' total they add up to exactly; below, what the segment counted
    outside the steps (its totals less the steps', exact)."""
    from otel_gpu_census.census import Stat, Step
    from otel_gpu_census.census.reader import read_segment
    from otel_gpu_census.integrations.engine.steps import StepEngine
    from engine_standins import Census, Clock, in_memory_telemetry
    d = tmp_path / "census"
    d.mkdir(mode=0o700)
    recs = [records.kernel(T0 + i * 1000, T0 + i * 1000 + 500, corr=i + 1) for i in range(100)]
    recs += [records.memcpy("htod", 10_000, T0, T0 + 10, src="pageable", corr=500)]
    seg = segments.segment(d, recs)
    rt, _, _ = in_memory_telemetry("vllm", metrics=False)
    census, clock = Census(), Clock()
    eng = StepEngine(telemetry=rt, read=census.read, clock=clock, settle_period_s=3600)
    eng.log_segment = lambda: str(seg)
    who = {"a": "team-a", "b": "team-b", "c": None}
    for k, t in who.items():
        eng.start_request(k, start_ns=clock.t, operation="chat", model="sql-lora" if k != "b" else "base",
                          headers={}, attributes={}, tenant=t)
    for sid_tokens, kernels, htod in (({"a": 3, "b": 1, "c": 2}, 12, 600), ({}, 5, 50), ({"a": 1, "c": 1}, 9, 1001)):
        sid = eng.open_step(sid_tokens)
        census.steps[sid] = Step(id=sid, kernel_count=kernels, kernel_ns=kernels * 1000,
                                 copies={"htod": Stat(1, htod, 10)})
        clock.t += 10**6
        eng.end_step(sid)
    for k in who:
        eng.request_done(k, {"gen_ai.usage.output_tokens": 2})
    census.complete = clock.t + 10**9
    eng.shutdown(timeout_s=0.5)
    env = dict(os.environ, PYTHONPATH=str(SRC))
    p = subprocess.run([sys.executable, "-m", "otel_gpu_census.cli", "report", str(d), "--by", "tenant", "--json"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    assert got["conserved"] is True and {r["name"] for r in got["rows"]} == {"team-a", "team-b", "unknown"}
    assert got["steps"]["kernel.count"] == 26 and got["steps"]["copy.htod.bytes"] == 1651
    assert got["unattributed"]["kernel.count"] == 5 and got["unattributed"]["copy.htod.bytes"] == 50
    assert sum(r["kernel.count"] for r in got["rows"]) == 21
    dev = read_segment(str(seg)).devices[0]
    assert got["outside_steps"]["kernel.count"] == dev.kernel_count - 26 == 74
    assert got["outside_steps"]["copy.htod.bytes"] == 10_000 - 1651
    text = subprocess.run([sys.executable, "-m", "otel_gpu_census.cli", "report", str(d), "--by", "model"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0].startswith("GPU work by model (1 engine request log;")
    assert [x.split()[0] for x in lines[2:6]] == ["sql-lora", "base", "unattributed", "steps"]
    assert "add up to the steps exactly" in text.stdout and "outside steps" in text.stdout
    both = subprocess.run([sys.executable, "-m", "otel_gpu_census.cli", "report", "--diff", str(d), str(d), "--by",
                           "tenant"], env=env, capture_output=True, text=True, timeout=60)
    assert both.returncode == 2 and "--by goes without --diff" in both.stderr
