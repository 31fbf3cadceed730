"""Chargeback on a real GPU: an engine's steps (the StepEngine every integration shares, in a process the
census counts) serve three tenants on two adapters; `report --by tenant|model` over its request log adds up to
the steps the census counted, and those to what the steps launched: every kernel and byte.

Run on a machine with an NVIDIA GPU and PyTorch:  python -m pytest -m gpu tests/gpu/test_chargeback_gpu.py -v
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu.test_gpu_census import census_env, lib_path  # noqa: E402  (skips without a GPU)

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
STEPS, KERNELS_PER_STEP = 30, 4

WORK = textwrap.dedent(f"""
    import json, torch
    from otel_gpu_census import injector
    from otel_gpu_census.integrations.engine.steps import StepEngine
    x = torch.zeros(1 << 16, device="cuda")
    injector.wait_attached()
    host = torch.ones(1 << 16)                   # 256 KiB of pageable memory, copied to the GPU each step
    torch.cuda.synchronize()
    eng = StepEngine()
    tenants, models = ("team-a", "team-b", "team-c"), ("sql-lora", "chat-lora")
    live = []
    for k in range({STEPS}):
        if k < 12:
            key = "r%d" % k
            eng.start_request(key, start_ns=eng.clock(), operation="chat", model=models[k % 2], headers={{}},
                              attributes={{}}, prompt_tokens=8, tenant=tenants[k % 3] if k % 4 else None)
            live.append(key)
        tokens = {{r: 1 + (i * 7 + k) % 5 for i, r in enumerate(live)}} if k % 5 else {{}}
        sid = eng.open_step(tokens)
        for _ in range({KERNELS_PER_STEP}):
            x.add_(1)
        y = host.to("cuda")
        torch.cuda.synchronize()
        eng.end_step(sid)
        for key in list(live):
            eng.first_token(key, eng.clock())
        if k % 3 == 2 and live:
            eng.request_done(live.pop(0), {{"gen_ai.usage.output_tokens": 4}})
    for key in live:
        eng.request_done(key, {{"gen_ai.usage.output_tokens": 4}})
    eng.shutdown(10.0)
    print("RESULT " + json.dumps({{"htod": {STEPS} * host.numel() * host.element_size()}}))
""")


def report(tmp_path, by):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    p = subprocess.run([sys.executable, "-m", "otel_gpu_census.cli", "report", str(tmp_path), "--by", by, "--json"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


@pytest.mark.parametrize("precise", [False, True])
def test_tenants_and_adapters_add_up_to_the_steps_and_the_steps_to_their_work(tmp_path, precise):
    extra = {} if precise else {"OTEL_GPU_CENSUS_ACTIVITY": "events", "LD_PRELOAD": lib_path()}
    env = census_env(tmp_path, OTEL_GPU_CENSUS_SETTLE="thread", OTEL_TRACES_EXPORTER="none",
                     OTEL_METRICS_EXPORTER="none", **extra)
    p = subprocess.run([sys.executable, "-c", WORK], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    want = json.loads(next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))[7:])
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], f"chargeback_gpu_{'precise' if precise else 'default'}.txt").write_text(
            subprocess.run([sys.executable, "-m", "otel_gpu_census.cli", "report", str(tmp_path), "--by", "tenant"],
                           env=dict(os.environ, PYTHONPATH=str(ROOT / "src")), capture_output=True, text=True).stdout)
    for by, names in (("tenant", {"team-a", "team-b", "team-c", "unknown"}), ("model", {"sql-lora", "chat-lora"})):
        got = report(tmp_path, by)
        assert got["conserved"] is True, got["notes"]
        assert {r["name"] for r in got["rows"]} == names
        steps = got["steps"]
        # the steps hold exactly what they launched: 4 kernels and one 256 KiB copy each
        assert steps["kernel.count"] == STEPS * KERNELS_PER_STEP
        assert steps["copy.htod.bytes"] == want["htod"]
        for f in ("kernel.count", "kernel.time_ns", "copy.htod.bytes", "copy.dtoh.bytes"):
            assert sum(r[f] for r in got["rows"]) + got["unattributed"][f] == steps[f], f
        # every 5th step served nobody: unattributed, never anyone's
        assert got["unattributed"]["kernel.count"] == (STEPS // 5) * KERNELS_PER_STEP
        assert all(v >= 0 for k, v in got["outside_steps"].items() if isinstance(v, int)), got["outside_steps"]
