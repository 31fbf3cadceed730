"""bench/server/ballast.py keeps N processes spinning while it is entered, none after; and
bench/perf/host_noise.py says how steady the CPU was, in its own JSON."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench" / "server"))
sys.path.insert(0, str(REPO / "bench" / "device"))
from ballast import Ballast  # noqa: E402
import proc_cpu  # noqa: E402


def test_ballast_spins_while_entered_and_leaves_nothing_behind():
    with Ballast(2) as b:
        pids = [p.pid for p in b.procs]
        time.sleep(0.3)
        before = {p: proc_cpu.snapshot(p) for p in pids}
        time.sleep(0.7)
        spent = [sum(v["cpu_s"] for v in proc_cpu.delta(before[p], proc_cpu.snapshot(p)).values()) for p in pids]
        assert b.alive() == 2
    assert all(s > 0.2 for s in spent)           # each busy for most of the 0.7 s (2 cores here, CI too)
    assert b.alive() == 0 and all(proc_cpu.snapshot(p) == {} for p in pids)
    with Ballast(0) as none:
        assert none.procs == []


def test_host_noise_reports_its_loops_bins_and_why_no_instruction_counter():
    r = subprocess.run([sys.executable, str(REPO / "bench" / "perf" / "host_noise.py"), "--seconds", "2.5"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["loops"] > 10 and got["busy_beside"] == 0
    assert got["wall_ms"]["p5"] <= got["wall_ms"]["median"] <= got["wall_ms"]["p95"]
    assert got["bins_1s"]["n"] == 2 and got["bins_1s"]["max_over_min"] >= 1.0
    inst = got["instructions"]
    assert ("unavailable" in inst and inst["unavailable"]) or inst["median"] > 0
