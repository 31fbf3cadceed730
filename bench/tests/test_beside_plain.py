"""bench/device/beside_plain.py: the factor table of a phase run with servers loaded together, on a run whose
servers' speeds are known (each window's host speed moves every server alike)."""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench" / "device"))
import beside_plain  # noqa: E402

SPEED = {"P": 1.0, "Q": 1.0, "N": 0.99, "E": 0.97, "R:off": 0.96, "R:events": 0.95}
CPU = {"P": 100.0, "Q": 100.0, "N": 101.0, "E": 104.0, "R:off": 106.0, "R:events": 108.0}


def _summary(load: str, host: float, noise: float) -> dict:
    return {"tok_per_s": 10_000 * SPEED[load] * host * noise,
            "cpu_ms_per_ktok": {"api_server": {"all": CPU[load] * 0.4}, "EngineCore": {"all": CPU[load] * 0.6},
                                "bench": {"all": 999.0}}}


def _run(rounds: int = 24, seed: int = 3) -> dict:
    rnd, out = random.Random(seed), []
    for i in range(rounds):
        order = ["off", "events"] if i % 2 == 0 else ["events", "off"]
        r = {"order": order}
        for m in order:
            host = rnd.uniform(0.7, 1.3)          # the host moves every server of a window alike
            noise = lambda: rnd.uniform(0.995, 1.005)   # noqa: E731
            r[m] = {**_summary(f"R:{m}", host, noise()),
                    "together": {n: _summary(n, host, noise()) for n in ("P", "Q", "N", "E")}}
        out.append(r)
    return {"rounds": out}


def test_each_factor_is_the_ratio_of_its_two_servers_in_the_same_windows():
    f = {x["factor"]: x for x in beside_plain.factors(_run())["factors"]}
    want = {"A/A": 1.0, "launcher": 0.99, "counting": 0.97 / 0.99, "integration, census paused": 0.96 / 0.99,
            "census switched on in R": 0.95 / 0.96, "the whole, beside plain": 0.95,
            "the whole paused, beside plain": 0.96}
    assert set(f) == set(want)
    for name, w in want.items():
        t = f[name]["throughput"]
        assert abs(t["gmean"] - w) < 0.004, (name, t)          # the host's swings (+-30 %) cancel in a window
        assert t["ci95"][0] <= t["gmean"] <= t["ci95"][1] and t["ci95"][1] - t["ci95"][0] < 0.01, t
    assert f["A/A"]["throughput"]["n"] == 48 and f["census switched on in R"]["throughput"]["n"] == 24
    # CPU per token: the whole tree, the clients' own CPU ("bench") left out
    assert abs(f["the whole, beside plain"]["cpu_per_token"]["gmean"] - 1.08) < 1e-4
    assert abs(f["counting"]["cpu_per_token"]["gmean"] - 104 / 101) < 1e-4


def test_a_run_without_servers_together_is_refused_with_one_line(tmp_path):
    raw = tmp_path / "vllm_e2e.json"
    raw.write_text(json.dumps({"phases": {"rounds": [{"order": ["off"], "off": {"tok_per_s": 1.0}}]}}))
    p = subprocess.run([sys.executable, str(REPO / "bench/device/beside_plain.py"), str(raw)],
                       capture_output=True, text=True)
    assert p.returncode == 2 and p.stdout == "" and p.stderr.count("\n") == 1 and "--phase-together" in p.stderr
    raw.write_text(json.dumps({"phases": _run(6)}))
    p = subprocess.run([sys.executable, str(REPO / "bench/device/beside_plain.py"), str(raw), "--md"],
                       capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.startswith("| factor |") and "| A/A | Q/P |" in p.stdout


def test_repin_moves_every_thread_of_a_server_tree(tmp_path):
    """--pin-swap's move: every thread of the server's process tree (a child in a session of its own included) onto
    the new CPU set."""
    import os
    import types
    import vllm_e2e
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        import pytest
        pytest.skip("one CPU: nothing to move between")
    code = ("import subprocess, sys, threading, time\n"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'], start_new_session=True)\n"
            "threading.Thread(target=time.sleep, args=(30,), daemon=True).start(); time.sleep(30)\n")
    p = subprocess.Popen(["taskset", "-c", str(cpus[0]), sys.executable, "-c", code])
    try:
        import time
        time.sleep(1.0)
        srv = types.SimpleNamespace(proc=p, cpus=str(cpus[0]))
        moved = vllm_e2e.repin({"R": srv}, {"R": str(cpus[1])})
        tids = [(pid, t) for pid in vllm_e2e.proc_cpu.tree(p.pid) for t in os.listdir(f"/proc/{pid}/task")]
        assert len({pid for pid, _ in tids}) == 2 and moved == {"R": len(tids)} and len(tids) >= 3
        assert all(os.sched_getaffinity(int(t)) == {cpus[1]} for _, t in tids) and srv.cpus == str(cpus[1])
    finally:
        for pid in vllm_e2e.proc_cpu.tree(p.pid):
            os.kill(pid, 9)
        p.wait()
