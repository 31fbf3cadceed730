"""Managed memory on the GPU: a known migration pattern (tests/gpu/managed.cu: 8 MiB written on the host, 6 MiB of it
touched by a kernel, 4 MiB read back on the host, the last 2 MiB prefetched to the device) under both collectors.

- `run --precise`: CUPTI's unified-memory counters, turned on at the allocation, measure 8 MiB host-to-device and
  4 MiB device-to-host, each within the driver's page granularity (at most one 2 MiB large page over what was
  touched, never less); the census knows of nothing it missed, and the report carries no NOT EXACT line.
- `run` (the default collector): the allocation and the prefetch counted from their calls; the census says in its
  gaps and the report's NOT EXACT line that migrations were not measured, and names the precise collector.

The figures go to $OUT/managed_gpu.json when $OUT is set.

    python -m pytest -q -m gpu tests/gpu/test_managed_gpu.py
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
MiB = 1 << 20
GRANULE = 2 * MiB      # the largest page the driver migrates at once

if shutil.which("nvidia-smi") is None or subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode != 0:
    pytest.skip("no NVIDIA GPU here", allow_module_level=True)


@pytest.fixture(scope="module")
def program(tmp_path_factory) -> str:
    if shutil.which("nvcc") is None:
        pytest.skip("no nvcc")
    out = tmp_path_factory.mktemp("managed") / "managed"
    subprocess.run(["nvcc", "-O2", "-o", str(out), str(HERE / "managed.cu")], check=True)
    return str(out)


def run(tmp: Path, program: str, precise: bool):
    """The program under `run` or `run --precise`: (its one segment, the report's text, the census's stderr)."""
    folder = tmp / ("precise" if precise else "default")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    env.pop("OTEL_GPU_CENSUS_COLLECTOR", None)
    cmd = [sys.executable, "-m", "otel_gpu_census.cli", "run", "--dir", str(folder),
           *(["--precise"] if precise else []), "--", program]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    if p.returncode == 77:
        pytest.skip("this GPU has no concurrent managed access")
    assert p.returncode == 0, p.stderr[-3000:]
    from otel_gpu_census.census.reader import read_segment
    from otel_gpu_census.report import render
    segs = [s for s in (read_segment(str(f)) for f in sorted(folder.glob("*.seg"))) if s.devices]
    assert len(segs) == 1, ([s.comm for s in segs], p.stderr[-2000:])
    return segs[0], render.render_text(segs), p.stderr


def figures(c) -> dict:
    d = c.totals()
    m = c.managed_totals()
    return {"flags": hex(c.flags), "gaps": c.gaps, "migrations_measured": c.migrations_measured,
            "managed_htod": [d.copies.get("managed_htod").count, d.copies.get("managed_htod").bytes,
                             d.copies.get("managed_htod").ns],
            "managed_dtoh": [d.copies.get("managed_dtoh").count, d.copies.get("managed_dtoh").bytes,
                             d.copies.get("managed_dtoh").ns],
            "allocs": m.allocs, "alloc_bytes": m.alloc_bytes, "live_bytes": m.live_bytes,
            "prefetch_in": [m.prefetch_in.count, m.prefetch_in.bytes], "gpu_faults": m.gpu_faults,
            "cpu_faults": c.um_cpu_faults, "thrashing": m.thrashing, "kernels": d.kernel_count,
            "um_refused_code": c.um_refused_code}


def test_the_precise_census_measures_the_migrations_and_the_default_one_says_it_did_not(program, tmp_path):
    precise, ptext, perr = run(tmp_path, program, precise=True)
    default, dtext, derr = run(tmp_path, program, precise=False)
    got = {"precise": figures(precise), "default": figures(default), "precise_stderr": perr[-2000:],
           "default_stderr": derr[-2000:]}
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "managed_gpu.json").write_text(json.dumps(got, indent=1))
    print(json.dumps(got, indent=1))

    p = got["precise"]
    assert precise.migrations_measured, (p, perr[-2000:])
    htod, dtoh = p["managed_htod"][1], p["managed_dtoh"][1]
    assert 8 * MiB <= htod <= 8 * MiB + GRANULE, p
    assert 4 * MiB <= dtoh <= 4 * MiB + GRANULE, p
    assert p["allocs"] == 1 and p["alloc_bytes"] == 8 * MiB and p["prefetch_in"] == [1, 2 * MiB], p
    assert precise.gaps == [] and "NOT EXACT" not in ptext, (precise.gaps, ptext)
    assert "managed host-to-device" in ptext and "managed memory: 1 allocation" in ptext, ptext

    d = got["default"]
    assert not default.migrations_measured and default.managed_in_use
    assert d["allocs"] == 1 and d["alloc_bytes"] == 8 * MiB and d["live_bytes"] == 0, d     # freed before exit
    assert d["prefetch_in"] == [1, 2 * MiB] and d["managed_htod"][1] == 0, d
    assert d["kernels"] == p["kernels"] == 1, (d, p)
    assert "NOT EXACT" in dtext and "not measured by this collector" in dtext and "--precise" in dtext, dtext
