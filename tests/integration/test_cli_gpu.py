"""`otel-gpu-census run` end to end on a real GPU, with PyTorch workloads whose copies are known.

    OTEL_GPU_CENSUS_LIB=$PWD/native/build/libotel_gpu_census.so python -m pytest -m gpu tests/integration/test_cli_gpu.py -v

Skipped without an NVIDIA GPU or without torch.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
N = 10
ELEMS = 10_000_000            # float32: 40,000,000 bytes a copy

# N device-to-host copies of one 40 MB tensor into pageable memory, after a warm-up that copies nothing.
WORK = textwrap.dedent(f"""
    import torch
    x = torch.ones({ELEMS}, device="cuda")
    torch.cuda.synchronize()
    for _ in range({N}):
        y = x.cpu()
    torch.cuda.synchronize()
""")


@pytest.fixture
def gpu_env(tmp_path):
    pytest.importorskip("torch")
    from otel_gpu_census import _native
    if _native.find_library() is None:
        pytest.skip("native library not built")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env.pop("CUDA_INJECTION64_PATH", None)
    return env


def run(env, tmp_path, *cmd, requests=N):
    out = tmp_path / "report.json"
    p = subprocess.run([sys.executable, "-m", "otel_gpu_census.cli", "run", "--dir", str(tmp_path / "census"),
                        "--json", str(out), "--requests", str(requests), "--", *cmd],
                       env=env, capture_output=True, text=True, timeout=300)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], f"cli_gpu_{tmp_path.name}.txt").write_text(p.stderr)
    assert p.returncode == 0, p.stderr[-4000:]
    return p, json.loads(out.read_text())


def test_run_counts_torch_copies_exactly(gpu_env, tmp_path):
    script = tmp_path / "work.py"
    script.write_text(WORK)
    p, data = run(gpu_env, tmp_path, sys.executable, str(script))
    [proc] = data["processes"]
    assert proc["state"] == "exited" and proc["dropped"] == 0
    dtoh = proc["devices"][0]["copies"]["dtoh"]
    assert dtoh["bytes"] == N * ELEMS * 4 and dtoh["count"] == N
    assert dtoh["by_host_memory"]["pageable"]["bytes"] == N * ELEMS * 4
    assert "40,000,000 bytes (40.0 MB) device-to-host per request, in 1 copy" in p.stderr


def test_run_reports_every_cuda_process_of_the_tree(gpu_env, tmp_path):
    script = tmp_path / "work.py"
    script.write_text(WORK)
    py = f"{sys.executable} {script}"
    p, data = run(gpu_env, tmp_path, "sh", "-c", f"{py} & {py}; wait", requests=2 * N)
    assert len(data["processes"]) == 2
    assert sum(d["copies"]["dtoh"]["bytes"] for proc in data["processes"] for d in proc["devices"]) \
        == 2 * N * ELEMS * 4
    assert "all 2 processes, per GPU" in p.stderr
