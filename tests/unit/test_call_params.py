"""The driver calls' parameter layouts calls.c reads (native/src/preload/call_params.h), checked against CUPTI's own
generated_cuda_meta.h: native/tests/call_params_check.c compiles only when every offset agrees. A layout that
drifted would have the injector read a copy's size from the wrong word, inside someone else's server."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import cupti_records

ROOT = Path(__file__).resolve().parents[2]
CC = os.environ.get("CC") or shutil.which("cc") or "gcc"


def compile_check(native: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([CC, "-std=c11", "-Wall", "-Werror", f"-I{cupti_records.cupti_include()}", "-c",
                           str(native / "tests" / "call_params_check.c"), "-o", str(out)],
                          capture_output=True, text=True, timeout=120)


def test_every_parameter_read_sits_where_cuptis_header_puts_it(tmp_path):
    p = compile_check(ROOT / "native", tmp_path / "check.o")
    assert p.returncode == 0, p.stderr[-3000:]


def test_a_layout_that_drifted_does_not_compile(tmp_path):
    """The check can fail: the same check against a call_params.h whose HtoD copy has its two ends swapped."""
    native = tmp_path / "native"
    shutil.copytree(ROOT / "native" / "src", native / "src")
    shutil.copytree(ROOT / "native" / "tests", native / "tests")
    h = native / "src" / "preload" / "call_params.h"
    good = "struct p_htod { CUdeviceptr dst; const void *src;"
    assert good in h.read_text()
    h.write_text(h.read_text().replace(good, "struct p_htod { const void *src; CUdeviceptr dst;"))
    p = compile_check(native, tmp_path / "check.o")
    assert p.returncode != 0 and "cuMemcpyHtoD_v2_params.dstDevice is not p_htod.dst" in p.stderr, p.stderr[-2000:]
