"""An engine that dies under `otel-gpu-census run`: killed (SIGKILL, the OOM killer, vLLM's own
SIGKILL after its shutdown timeout) inside a step, or ended by an exception escaping its loop. `run`
must not hang and must exit with the engine's status; the segment must stay readable, the request log
hold only whole lines, and `report` read both.

The engine is vLLM's engine side without vLLM or a GPU: the integration's EngineTelemetry driven
step by step in a child process, with the real injector loaded as CUDA would load it
(CUDA_INJECTION64_PATH, InitializeInjection) over the mock libcupti (native/tests/mock_cupti.c),
which hands the injector real CUPTI records for every launch the "engine" makes."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]

ENGINE = textwrap.dedent(r"""
    import os, sys, time
    from types import SimpleNamespace
    sys.path.insert(0, sys.argv[1])
    import cffi, cupti_records as cr
    mode = sys.argv[2]
    g = cffi.FFI(); g.cdef("int InitializeInjection(void);")
    g.dlopen(os.environ["CUDA_INJECTION64_PATH"]).InitializeInjection()      # what the CUDA driver does
    m = cffi.FFI(); m.cdef("int mock_queue_record(const void *, uint32_t); int mock_api_call(int, uint32_t, uint32_t);")
    mock = m.dlopen(os.environ["OTEL_GPU_CENSUS_CUPTI"])
    rffi, rlib = cr.records()
    LAUNCH = rlib.CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_v7000
    T = 1_700_000_000_000_000_000
    corr = [0]
    def launch(n):                  # n kernels, each through the launch callback, as CUDA would
        for _ in range(n):
            corr[0] += 1
            c = corr[0]
            mock.mock_api_call(0, LAUNCH, c)
            rec = cr.kernel(T + c * 1000, T + c * 1000 + 100, corr=c)
            mock.mock_queue_record(rffi.cast("void *", rec), rffi.sizeof(cr.KERNEL_T))

    from opentelemetry.sdk.trace import TracerProvider
    from otel_gpu_census.integrations.vllm.engine import EngineTelemetry
    from otel_gpu_census.telemetry.request import RequestTelemetry
    eng = EngineTelemetry(telemetry=RequestTelemetry(TracerProvider(), None, provider_name="vllm"),
                          settle_period_s=0.02)
    sched = SimpleNamespace(vllm_config=None)
    def req(i):
        return SimpleNamespace(request_id=f"cmpl-{i}-0-abcdefgh", arrival_time=time.time(), trace_headers=None,
                               num_prompt_tokens=8, num_output_tokens=3, status=SimpleNamespace(name="FINISHED_STOPPED"),
                               get_finished_reason=lambda: "stop")
    live = []
    for i in range(40):
        if i % 4 == 0:
            live.append(req(i))
            eng.request_added(sched, live[-1])
        sid = eng.begin_execute(SimpleNamespace(num_scheduled_tokens={r.request_id: 1 for r in live}))
        launch(5)
        eng.end_step(sid)
        if i % 4 == 3:
            eng.request_freed(live.pop(0))
        time.sleep(0.01)
    deadline = time.time() + 20                       # the settler logs what the census completed
    log = eng._requests_log
    while log._lines < 5 and time.time() < deadline:
        time.sleep(0.05)
    print("LOGGED", log._lines, flush=True)
    sid = eng.begin_execute(SimpleNamespace(num_scheduled_tokens={r.request_id: 1 for r in live}))
    launch(3)                                          # dies inside this step
    if mode == "kill":
        os.kill(os.getpid(), 9)
    raise RuntimeError("the engine core died")        # an exception escapes the engine loop
""")


def _run(tmp_path, native, mock_lib, mode):
    census = tmp_path / "census"
    script = tmp_path / "engine.py"
    script.write_text(ENGINE)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "CUDA_INJECTION"))}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]),
               OTEL_GPU_CENSUS_LIB=native[2], OTEL_GPU_CENSUS_CUPTI=mock_lib, OTEL_GPU_CENSUS_FLUSH_MS="20",
               XDG_RUNTIME_DIR=str(tmp_path / "xdg"))
    (tmp_path / "xdg").mkdir(mode=0o700)
    t = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "otel_gpu_census.cli", "run", "--dir", str(census), "--exporter",
                        "none", "--", sys.executable, str(script), str(ROOT / "tests" / "support"), mode],
                       env=env, capture_output=True, text=True, timeout=90)
    return p, time.monotonic() - t, census, env


def _logged(census: Path):
    (log,) = census.glob("*.requests.jsonl")
    lines = log.read_text().splitlines()
    return [json.loads(line) for line in lines]          # every line whole: json.loads would raise


def test_an_engine_killed_inside_a_step_leaves_a_readable_census_and_run_exits(tmp_path, native, mock_lib):
    p, took, census, env = _run(tmp_path, native, mock_lib, "kill")
    assert p.returncode == 128 + signal.SIGKILL, p.stderr[-2000:]
    assert "LOGGED" in p.stdout and took < 60
    from otel_gpu_census.census import reader
    (seg,) = census.glob("*.seg")
    c = reader.read_segment(str(seg))
    assert c.state_name == "active" and not c.alive            # never finished: no final flush
    assert 0 < c.totals().kernel_count <= 40 * 5 + 3          # what the flusher published before the kill
    reqs = _logged(census)
    assert len(reqs) >= 5 and all(r["status"] == "complete" and r["gpu"]["kernel.count"] > 0 for r in reqs)
    assert sum(r["gpu"]["kernel.count"] for r in reqs) <= sum(s.kernel_count for s in c.steps.values())
    assert not [r for r in reqs if "summary" in r]             # killed: no shutdown, no summary line
    rep = subprocess.run([sys.executable, "-m", "otel_gpu_census.cli", "report", str(census)], env=env,
                         capture_output=True, text=True, timeout=60)
    assert rep.returncode == 0 and "Traceback" not in rep.stderr, rep.stderr
    assert "final flush" in rep.stdout and "per request" in rep.stdout, rep.stdout


def test_an_engine_ended_by_an_exception_still_completes_its_census(tmp_path, native, mock_lib):
    p, took, census, env = _run(tmp_path, native, mock_lib, "raise")
    assert p.returncode == 1 and "the engine core died" in p.stderr and took < 60
    from otel_gpu_census.census import reader
    (seg,) = census.glob("*.seg")
    c = reader.read_segment(str(seg))
    assert c.state_name == "exited"                            # the injector's exit flush ran
    assert c.totals().kernel_count == 40 * 5 + 3               # every launch counted, the last step's too
    assert c.steps[41].kernel_count == 3
    assert len(_logged(census)) >= 5
