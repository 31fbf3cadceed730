"""bench/device/proc_cpu.py on this machine's /proc: a server's whole process tree (a child in a session
of its own included), its CPU per role and per thread over a window."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench" / "device"))
import proc_cpu  # noqa: E402

TREE = r'''
import subprocess, sys, threading, time
spin = "import time\nt = time.time()\nwhile time.time() - t < 2.5: pass\n"
child = subprocess.Popen([sys.executable, "-c", spin, "otel_gpu_census.integrations." + "settle_process"],
                         start_new_session=True)
threading.Thread(target=lambda: exec(spin), name="spinner").start()
time.sleep(3); child.wait()
'''


def test_a_trees_cpu_is_counted_per_role_and_thread_children_in_sessions_of_their_own_too():
    p = subprocess.Popen([sys.executable, "-c", TREE])
    try:
        time.sleep(0.4)
        before = proc_cpu.snapshot(p.pid)
        time.sleep(1.5)
        got = proc_cpu.delta(before, proc_cpu.snapshot(p.pid))
    finally:
        p.wait(10)
    # the parent (no role word: its comm) spins one thread, its main thread sleeps; the settling child spins
    settle = got["settle"]
    assert settle["processes"] == 1 and 1.0 <= settle["cpu_s"] <= 1.7
    assert list(settle["threads"]) == ["main"]
    (parent,) = [v for k, v in got.items() if k != "settle"]
    assert 1.0 <= parent["cpu_s"] <= 1.7 and parent["threads"].get("main", 0) < 0.2


def test_a_pid_that_is_gone_is_an_empty_tree():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert proc_cpu.snapshot(p.pid) == {} and proc_cpu.delta({}, {}) == {}
