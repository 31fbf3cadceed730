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


def test_the_ns_a_mode_adds_is_per_rotation_and_the_c_childs_counts_are_checked_against_what_it_did():
    did = {"eager_launches": 2300, "graph_launches": 230, "graph_kernels": 14720, "htod_pinned": [230, 942080],
           "dtoh_pinned": [230, 942080]}
    exact = {"eager_launches": 2300, "graph_launches": 230, "graph_kernel_count": 14720, "kernel_count": 17020,
             "htod_pinned": [230, 942080], "dtoh_pinned": [230, 942080]}
    rotations = [
        {"plain": proc(2000.0, did=did), "events": proc(2030.0, exact, did=did), "pairs": proc(2400.0, exact, did=did)},
        {"plain": proc(2100.0, did=did), "events": proc(2110.0, {**exact, "dtoh_pinned": [229, 937984]}, did=did),
         "pairs": proc(2600.0, exact, did=did)},
        {"plain": proc(1900.0, did=did), "events": proc(1950.0, exact, did=did),
         "pairs": proc(2300.0, {**exact, "kernel_count": 17019}, did=did)},
    ]
    s = calls_tax.summarise(rotations)
    assert s["events-plain eager_ns"] == {"median": 30.0, "min": 10.0, "max": 50.0}
    assert s["pairs-plain eager_ns"]["median"] == 400.0
    assert "events-plain control_ms" not in s           # a time in ms is no price a call
    assert s["census_exact_events"] == {"rotations": 3, "exact": 2}   # one copy fewer counted
    assert s["census_exact_pairs"] == {"rotations": 3, "exact": 2}    # one kernel fewer counted


def test_the_c_child_runs_pinned_with_its_counts_and_its_result_is_read(tmp_path):
    fake = tmp_path / "launch_price"
    fake.write_text("#!/bin/sh\necho \"args $*\" >&2\n"
                    "echo 'RESULT {\"eager_ns\": 2000.5, \"graph_issue_ns\": 3000, \"graph_ns\": 90000, "
                    "\"copy_pair_ns\": 20000, \"control_ms\": 4.2, \"did\": {\"eager_launches\": 46}}'\n")
    fake.chmod(0o755)
    a = type("A", (), {"child": "c", "binary": str(fake), "core": 0, "rounds": 21, "adds": 2, "replays": 3, "pairs": 4})
    r = calls_tax.run_child("plain", a)
    assert r["eager_ns"] == 2000.5 and r["did"] == {"eager_launches": 46} and "census" not in r
    assert "args 21 2 3 4" in r["stderr"]
    fake.write_text("#!/bin/sh\necho 'no GPU' >&2\nexit 1\n")
    assert calls_tax.run_child("plain", a) == {"mode": "plain", "error": "no GPU\n"}
