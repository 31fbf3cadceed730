"""bench/perf/calls_tax.py without a GPU: its arithmetic (ratios per rotation against plain, the census counts of
the two census modes compared) and its refusal to run without the injector."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("calls_tax", REPO / "bench/perf/calls_tax.py")
calls_tax = importlib.util.module_from_spec(spec)
spec.loader.exec_module(calls_tax)


def proc(eager, census=None, **kw):
    r = {"eager_ns": eager, "graph_issue_ns": 100.0, "graph_ns": 400.0, "copy_pair_ns": 20_000.0, "control_ms": 10.0}
    r.update(kw)
    if census is not None:
        r["census"] = census
    return r


def test_ratios_are_per_rotation_and_counts_are_compared_between_the_census_modes():
    c = {"kernels": "calls", "preloaded": False, "eager_launches": 100, "htod_pinned": [5, 20480], "kernel_ns": 0}
    d = {**c, "kernels": "counted:100/1000", "kernel_ns": 12345}       # durations differ, counts must not
    pre = {**c, "preloaded": True}                                     # the mode differs, counts must not
    rotations = [
        {"plain": proc(1000.0), "preload": proc(1001.0, pre), "calls": proc(1010.0, c), "default": proc(1300.0, d)},
        {"plain": proc(2000.0), "preload": proc(2002.0, {**pre, "htod_pinned": [5, 20481]}), "calls": proc(2000.0, c),
         "default": proc(2400.0, {**d, "eager_launches": 99})},
        {"plain": proc(1000.0), "calls": {"mode": "calls", "error": "boom"}, "default": proc(1200.0, d)},
    ]
    s = calls_tax.summarise(rotations)
    assert s["calls/plain eager_ns"]["all"] == [1.01, 1.0]           # the failed process leaves its rotation out
    assert s["preload/plain eager_ns"]["all"] == [1.001, 1.001]       # a rotation without the mode: left out
    assert s["default/plain eager_ns"]["all"] == [1.3, 1.2, 1.2] and s["default/plain eager_ns"]["median"] == 1.2
    assert s["census_counts_agree_calls"] == {"rotations": 2, "agree": 1}   # the second rotation's default lost a launch
    assert s["census_counts_agree_preload"] == {"rotations": 2, "agree": 1}


def test_without_the_injector_it_says_so():
    p = subprocess.run([sys.executable, str(REPO / "bench/perf/calls_tax.py"), "--out", "/dev/null"],
                       capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert p.returncode == 1 and "OTEL_GPU_CENSUS_LIB" in p.stderr
