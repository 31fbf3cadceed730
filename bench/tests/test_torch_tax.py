"""bench/perf/torch_tax.py without a GPU: one clear line and exit 2, nothing written; bad arguments exit 1."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_without_a_gpu_it_says_so_and_writes_nothing(tmp_path):
    out = tmp_path / "t.json"
    p = subprocess.run([sys.executable, str(REPO / "bench/perf/torch_tax.py"), "--rounds", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=120, env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"})
    assert p.returncode == 2 and p.stderr.startswith("torch_tax: no usable GPU") and not out.exists()


def test_bad_arguments_exit_1():
    p = subprocess.run([sys.executable, str(REPO / "bench/perf/torch_tax.py"), "--rounds", "0"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "must be positive" in p.stderr
