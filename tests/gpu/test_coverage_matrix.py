"""The coverage matrix: every way of putting work on the GPU, the default census against CUPTI's, row by row.

Each row of tests/gpu/coverage.cu (and a Triton kernel, and torch) runs in a process of its own twice: under
`otel-gpu-census run` (the default collector: counted at the calls by the library preloaded) and under
`run --precise` (CUPTI's activity records). Every row's kernel count, copies by direction and host memory kind
(count and bytes), memsets and peer copies must be equal, and neither census may know of work it missed.
The table goes to $OUT/coverage_matrix.md (docs/measurements.md quotes it).

    python -m pytest -q -m gpu tests/gpu/test_coverage_matrix.py
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

if shutil.which("nvidia-smi") is None or subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode != 0:
    pytest.skip("no NVIDIA GPU here: `make gpu-test` on one", allow_module_level=True)

TRITON = """
import torch, triton, triton.language as tl
@triton.jit
def add(x, y, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + i, tl.load(x + i, mask=i < n) + 1, mask=i < n)
x = torch.arange(100003, device='cuda', dtype=torch.float32)
y = torch.empty_like(x)
for _ in range(5):
    add[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
torch.cuda.synchronize()
"""

TORCH = """
import torch
a = torch.ones(123457, device='cuda')
b = a.cpu()                                   # pageable device-to-host
p = torch.empty(77779, pin_memory=True).fill_(2)
c = p.to('cuda', non_blocking=True)           # pinned host-to-device
for _ in range(9):
    a.add_(1)
g = torch.cuda.CUDAGraph()
s = torch.cuda.Stream()
with torch.cuda.stream(s):
    a.mul_(2)                                 # warm-up on the capture stream
    with torch.cuda.graph(g):
        a.mul_(2); a.add_(3)
torch.cuda.current_stream().wait_stream(s)
for _ in range(6):
    g.replay()
torch.cuda.synchronize()
"""


def _cuda_home() -> Path:
    return Path(shutil.which("nvcc")).resolve().parents[1]


@pytest.fixture(scope="module")
def programs(tmp_path_factory) -> dict:
    if shutil.which("nvcc") is None:
        pytest.skip("no nvcc")
    d = tmp_path_factory.mktemp("coverage")
    cuda = _cuda_home()
    stubs = [str(p) for p in (cuda / "lib64" / "stubs", cuda / "targets" / "x86_64-linux" / "lib" / "stubs") if p.is_dir()]
    link = [f"-L{p}" for p in stubs] + ["-lcuda"]
    subprocess.run(["nvcc", "-O2", "-arch=sm_90", "-o", str(d / "coverage"), str(HERE / "coverage.cu"), *link, "-ldl"],
                   check=True)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", f"-I{cuda / 'include'}", "-o", str(d / "liblinked.so"),
                    str(HERE / "linked.c"), *link], check=True)
    (d / "triton_row.py").write_text(TRITON)
    (d / "torch_row.py").write_text(TORCH)
    rows = subprocess.run([str(d / "coverage"), "list"], capture_output=True, text=True, check=True).stdout.split()
    out = {r: [str(d / "coverage"), r] for r in rows}
    out["triton"] = [sys.executable, str(d / "triton_row.py")]
    out["torch"] = [sys.executable, str(d / "torch_row.py")]
    return {"rows": out, "env": {"COVERAGE_LINKED_LIB": str(d / "liblinked.so")}}


def census(tmp: Path, name: str, argv, extra_env: dict, precise: bool):
    """The row's process under `run` (the default collector) or `run --precise`: its summary, or None (skipped)."""
    folder = tmp / f"{name}-{'precise' if precise else 'default'}"
    env = dict(os.environ, **extra_env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    env.pop("OTEL_GPU_CENSUS_COLLECTOR", None)
    cmd = [sys.executable, "-m", "otel_gpu_census.cli", "run", "--dir", str(folder),
           *(["--precise"] if precise else []), "--", *argv]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    if p.returncode == 77:
        return None
    assert p.returncode == 0, f"{name}: {p.stderr[-3000:]}"
    from otel_gpu_census.census.reader import read_segment
    segs = [read_segment(str(f)) for f in sorted(folder.glob("*.seg"))]
    segs = [s for s in segs if s.devices]
    assert len(segs) == 1, (name, [s.comm for s in segs], p.stderr[-2000:])
    return summary(segs[0]), segs[0].gaps, p.stderr


def summary(c) -> dict:
    d = c.totals()
    out = {"kernels": d.kernel_count, "memset": (d.memset.count, d.memset.bytes),
           "peer_received": (d.peer_recv.count, d.peer_recv.bytes)}
    for (dr, mem), st in sorted(d.copies.cells.items()):
        if st.count or st.bytes:
            out[f"{dr} {mem}"] = (st.count, st.bytes)
    return out


def test_every_row_is_counted_alike_by_the_default_census_and_cupti(programs, tmp_path):
    table, failures = [], []
    for name, argv in programs["rows"].items():
        got = {}
        for precise in (False, True):
            got[precise] = census(tmp_path, name, argv, programs["env"], precise)
        if got[False] is None or got[True] is None:
            table.append((name, "skipped: this driver lacks the row's functions", "", "", ""))
            continue
        (dflt, dgaps, derr), (prec, pgaps, perr) = got[False], got[True]
        for key in sorted(set(dflt) | set(prec)):
            a, b = dflt.get(key, (0, 0) if key != "kernels" else 0), prec.get(key, (0, 0) if key != "kernels" else 0)
            table.append((name, key, a, b, "yes" if a == b else "NO"))
            if a != b:
                failures.append(f"{name} {key}: default {a}, precise {b}")
        if dgaps or pgaps:
            failures.append(f"{name}: gaps default {dgaps}, precise {pgaps}")
    md = ["| row | what | default census | CUPTI (precise) | equal |", "|---|---|---:|---:|---|"]
    md += [f"| {r} | {k} | {a} | {b} | {e} |" for r, k, a, b, e in table]
    out = os.environ.get("OUT")
    if out:
        Path(out, "coverage_matrix.md").write_text("\n".join(md) + "\n")
        Path(out, "coverage_matrix.json").write_text(json.dumps({"rows": table, "failures": failures}, indent=1,
                                                                default=str))
    print("\n".join(md))
    assert not failures, "\n".join(failures)
