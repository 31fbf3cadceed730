"""CPU test of bench/server/llama_phases.py's rounds with the servers beside R (--beside-plain, --beside-traced):
the servers, their loads and their censuses stood in for, so that what is compared with what is checked."""
from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench" / "server"))
import llama_phases as lp  # noqa: E402


class Proc:
    pid = 0

    def poll(self):
        return 0


def test_beside_traced_sets_each_modes_kernel_time_a_token_against_the_measured_server(tmp_path, monkeypatch):
    started, loads, switched = [], [], {}
    kernel_ns_per_token = {8193: 1100, 8194: 0, 8195: 1000}   # R's events estimate 10 % over the measured
    totals = {}

    class FakePhases:
        def __init__(self, d):
            self.d = str(d)
            totals.setdefault(self.d, {"kernel_time_ns": 0, "copy.dtoh.pageable.bytes": 0})

        def set(self, mode, timeout=10.0):
            switched.setdefault(self.d, []).append(mode)
            return True

        def totals(self):
            return dict(totals[self.d])

    census_of_port = {}

    def fake_popen(cmd, **kw):
        started.append(cmd)
        port = int(cmd[cmd.index("--port") + 1])
        if "--dir" in cmd:
            census_of_port[port] = cmd[cmd.index("--dir") + 1]
        return Proc()

    def fake_load(url, clients, requests, n_predict=64, seed=0):
        port = int(url.rsplit(":", 1)[1])
        loads.append(port)
        tokens = requests * n_predict
        if port in census_of_port:
            t = totals.setdefault(census_of_port[port], {"kernel_time_ns": 0, "copy.dtoh.pageable.bytes": 0})
            t["kernel_time_ns"] += kernel_ns_per_token[port] * tokens
            t["copy.dtoh.pageable.bytes"] += 4096 * tokens
        return {"output_tok_s": 100.0 + port - 8193, "output_tokens": tokens, "errors": 0}

    monkeypatch.setattr(lp.subprocess, "Popen", fake_popen)
    monkeypatch.setattr(lp, "wait_health", lambda u, p, t: True)
    monkeypatch.setattr(lp, "run_load", fake_load)
    monkeypatch.setattr(lp, "Phases", FakePhases)
    monkeypatch.setattr(lp.time, "sleep", lambda s: None)
    made = iter(range(9))
    monkeypatch.setattr(lp.tempfile, "mkdtemp", lambda prefix: str(_mkdir(tmp_path / f"{prefix}{next(made)}")))
    monkeypatch.setattr(lp, "run_rounds", _rounds_without_waiting(lp.run_rounds, monkeypatch))
    out = tmp_path / "phases.json"
    monkeypatch.setattr(sys, "argv", ["llama_phases.py", "--server", "/bin/llama-server", "--model", "m.gguf",
                                      "--out", str(out), "--rounds", "3", "--modes", "off,events",
                                      "--precise", "--beside-plain", "--beside-traced"])
    assert lp.main() == 0
    res = json.loads(out.read_text())
    # three servers: R under `run --precise`, plain, and the traced reference under `run --precise`
    assert len(started) == 3 and "--precise" in started[0] and "--dir" not in started[1]
    assert "--precise" in started[2] and started[2][started[2].index("--port") + 1] == "8195"
    assert switched[census_of_port[8195]] == ["events"]      # on (it runs `run --precise`)
    assert len(res["rounds"]) == 3 and all(len(r["order"]) == 2 for r in res["rounds"])
    # every round: R's two phases, then the traced server, then the plain one
    assert loads.count(8195) == 3 + 1 and loads.count(8194) == 3 + 1
    assert res["kt:events/traced"]["all"] == [1.1, 1.1, 1.1]
    assert res["events/plain"]["median"] == round(100 / 101, 4)
    per = res["per_output_token"]
    assert per["traced"]["kernel_time_ns"] == 1000 and per["events"]["kernel_time_ns"] == 1100
    assert per["traced"]["copy.dtoh.pageable.bytes"] == per["events"]["copy.dtoh.pageable.bytes"] == 4096


def _rounds_without_waiting(run_rounds, monkeypatch):
    def go(ph, rounds, load, modes, after=None, deadline=float("inf")):
        return run_rounds(ph, rounds, load, modes=modes, after=after, settle_s=0.0, deadline=deadline)
    return go


def _mkdir(p: Path) -> Path:
    p.mkdir()
    return p


def test_phase_kernel_time_prices_each_phases_eager_launches_at_its_own_sample():
    """graph spans 400 (kernel_ns 500 less the sample's 100) + 8 eager launches at the sample's 50 ns = 800 ns for 10 tokens, against 1,000 ns for 10 tokens
    measured: 0.8; a phase without a traced load beside it, or without a sample, is left out."""
    import phase_kernel_time as pk
    ev = {"kernel_count": 10, "kernel_ns": 500, "eager_launches": 8, "eager_traced": 2, "eager_traced_ns": 100}
    raw = {"rounds": [{"events": {"tokens": 10, "census": ev}, "traced": {"tokens": 10, "census": {"kernel_ns": 1000}}},
                      {"events": {"tokens": 10, "census": ev}},
                      {"events": {"tokens": 10, "census": {**ev, "eager_traced": 0, "eager_traced_ns": 0}},
                       "traced": {"tokens": 10, "census": {"kernel_ns": 1000}}}]}
    assert pk.ratios(raw, "events") == [0.8]
