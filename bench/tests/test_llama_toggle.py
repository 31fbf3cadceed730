"""CPU tests of bench/server/llama_toggle.py (and toggle_slots.py) against the llama-server stand-in
(tests/support/llama_standin.py): one streaming load, a mode switched slot by slot, each slot rated by the tokens
the clients received, counted from the events' running `tokens_predicted`."""
from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench" / "server"))
sys.path.insert(0, str(REPO / "tests" / "support"))
import llama_toggle  # noqa: E402
from llama_standin import Standin  # noqa: E402


@pytest.fixture
def standin():
    s = Standin(tokens=1000, token_delay=0.002).start()
    yield s
    s.stop()


def test_tokens_are_counted_from_tokens_predicted_when_one_event_carries_several(standin):
    """llama-server holds back an incomplete UTF-8 sequence and sends it with the next token: counting events
    would miss those tokens, the running count does not."""
    standin.opts.tokens_per_event = 3

    async def go():
        async with llama_toggle.StreamLoop(standin.url, clients=3, prompt_tokens=8, n_predict=10, seed=1) as sl:
            await asyncio.sleep(0.3)
        return sl
    sl = asyncio.run(go())
    assert sl.results and not sl.errors
    assert all(r == {"tokens": 10, "predicted_n": 10, "asked": 10} for r in sl.results)
    assert sl.n == 10 * len(sl.results)          # every request in flight at the end was finished, none cut
    prompts = [json.loads(s.body)["prompt"] for s in standin.seen if s.path == "/completion"]
    assert len(prompts) == len(sl.results) and len({tuple(p) for p in prompts}) == len(prompts)   # all distinct
    assert all(len(p) == 8 for p in prompts)


def test_tokens_held_back_for_the_final_event_are_counted():
    """An answer that ends inside a UTF-8 sequence: llama-server sends its last tokens only in the stop event
    (tokens_predicted 64 there, 62 in the last partial). The H200 run of 2026-12-04 failed its check on this."""
    s = Standin(tokens=1000, token_delay=0.001).start()
    s.opts.held_at_end = 2
    try:
        async def go():
            async with llama_toggle.StreamLoop(s.url, clients=2, prompt_tokens=4, n_predict=9, seed=2) as sl:
                await asyncio.sleep(0.2)
            return sl
        sl = asyncio.run(go())
    finally:
        s.stop()
    assert sl.results and not sl.errors
    assert all(r == {"tokens": 9, "predicted_n": 9, "asked": 9} for r in sl.results)
    assert sl.n == 9 * len(sl.results)
    assert all(ok for ok, _ in llama_toggle.checks({"slots": [], "errors": [], "requests": sl.results}))


def test_toggle_load_rates_each_slot_and_sees_a_mode_that_halves_the_rate(standin):
    switched = []

    def switch(mode):
        switched.append(mode)
        standin.opts.token_delay = 0.004 if mode == "events" else 0.002
        return True
    got = asyncio.run(llama_toggle.toggle_load(standin.url, clients=4, prompt_tokens=4, n_predict=20, ramp_s=0.2,
                                               seconds=2.4, slot_s=0.25, switch=switch, seed=5, order="abba"))
    slots = got["slots"]
    assert [s["mode"] for s in slots] == switched and switched[:4] == ["off", "events", "events", "off"]
    assert len(slots) >= 6 and all(s["tokens"] > 0 for s in slots)
    pairs = llama_toggle.toggle_pairs(slots)
    assert pairs["pairs"] == len(slots) // 2 and 0.35 < pairs["events/off"]["median"] < 0.75
    assert set(pairs["slot_cv"]) == {"off", "events"}
    assert got["tokens"] == sum(r["tokens"] for r in got["requests"])
    assert all(ok for ok, _ in llama_toggle.checks(got))


def test_checks_fail_on_a_switch_not_taken_a_failed_request_or_a_short_count():
    good = {"slots": [{"switched": True}], "errors": [],
            "requests": [{"tokens": 64, "predicted_n": 64, "asked": 64}, {"tokens": 70, "predicted_n": 70, "asked": 70}]}
    assert [ok for ok, _ in llama_toggle.checks(good)] == [True, True, True]
    bad = {"slots": [{"switched": True}, {"switched": False}], "errors": ["HTTP 503"],
           "requests": [{"tokens": 63, "predicted_n": 64, "asked": 64}]}
    got = llama_toggle.checks(bad)
    assert [ok for ok, _ in got] == [False, False, False] and "1 not, the first" in got[2][1]
    assert not llama_toggle.checks({**good, "requests": [{"tokens": 64, "predicted_n": None, "asked": 64}]})[2][0]
    assert not llama_toggle.checks({**good, "requests": [{"tokens": 60, "predicted_n": 60, "asked": 64}]})[2][0]


def test_main_runs_the_server_under_run_toggles_its_census_and_writes_every_figure(standin, monkeypatch, tmp_path):
    """The command: `run` (its default census unless --precise), llama-server with the load's slots, pinned with
    --pin, OTEL_GPU_CENSUS_FLUSH_MS=200; the toggled load within --budget-s; checks and pairs in the JSON."""
    started = {}

    class Proc:
        pid = os.getpid()          # its process tree's CPU a slot is read (proc_cpu): this one's

        def poll(self):
            return None

        def wait(self, t=None):
            return 0

    def popen(cmd, env=None, **kw):
        started.update(cmd=cmd, env=env)
        return Proc()
    monkeypatch.setattr(llama_toggle.subprocess, "Popen", popen)
    monkeypatch.setattr(llama_toggle.os, "killpg", lambda pid, sig: started.setdefault("killed", (pid, sig)))
    monkeypatch.setattr(llama_toggle, "wait_health", lambda url, proc, t: 1.0)

    class FakePhases:
        def __init__(self, d):
            self.d = d

        def set(self, mode, timeout=10.0):
            standin.opts.token_delay = 0.004 if mode == "events" else 0.002
            return True

        def totals(self):
            return {"kernel_count": 1}
    monkeypatch.setattr(llama_toggle, "Phases", FakePhases)
    port = standin.port
    out = tmp_path / "toggle.json"
    rc = llama_toggle.main(["--server", "/x/llama-server", "--model", "/m.gguf", "--out", str(out), "--port", str(port),
                            "--clients", "3", "--prompt-tokens", "4", "--n-predict", "12", "--ramp", "0.2",
                            "--slot", "0.2", "--seconds", "1.6", "--pin", "0-3"])
    res = json.loads(out.read_text())
    cmd = started["cmd"]
    assert cmd[:3] == ["taskset", "-c", "0-3"] and cmd[4:7] == ["-m", "otel_gpu_census.cli", "run"]
    assert "--precise" not in cmd and cmd[cmd.index("--") + 1:cmd.index("--") + 3] == ["/x/llama-server", "-m"]
    assert ["-np", "3"] == cmd[cmd.index("-np"):cmd.index("-np") + 2] and "--cache-ram" in cmd
    assert started["env"]["OTEL_GPU_CENSUS_FLUSH_MS"] == "200" and started["killed"][0] == os.getpid()
    assert rc == 0 and all(c["ok"] for c in res["checks"]) and res["pairs"] >= 3 and res["census"] == {"kernel_count": 1}
    assert 0.35 < res["events/off"]["median"] < 0.75 and res["requests"] > 0 and res["tokens"] >= 12 * res["requests"]


def test_main_says_so_when_the_server_does_not_come_up(monkeypatch, tmp_path):
    monkeypatch.setattr(llama_toggle.subprocess, "Popen", lambda cmd, **kw: SimpleNamespace(
        pid=1, poll=lambda: 1, wait=lambda t=None: 1))
    monkeypatch.setattr(llama_toggle, "wait_health", lambda url, proc, t: None)
    out = tmp_path / "t.json"
    assert llama_toggle.main(["--server", "s", "--model", "m", "--out", str(out)]) == 1
    assert "did not come up" in json.loads(out.read_text())["error"]
    with pytest.raises(SystemExit):
        llama_toggle.main(["--server", "s", "--model", "m", "--out", str(out), "--modes", "off"])


def test_requests_ask_for_tokens_drawn_in_a_range_and_each_is_checked_against_its_own(standin):
    """--n-predict LO,HI: clients that would stay in step (same prompt size, same answer length) drift apart."""
    async def go():
        async with llama_toggle.StreamLoop(standin.url, clients=3, prompt_tokens=4, n_predict=(5, 15), seed=4) as sl:
            await asyncio.sleep(0.4)
        return sl
    sl = asyncio.run(go())
    asked = [r["asked"] for r in sl.results]
    assert len(sl.results) >= 6 and all(5 <= x <= 15 for x in asked) and len(set(asked)) > 2
    assert all(r["tokens"] == r["predicted_n"] == r["asked"] for r in sl.results)
    sent = sorted(json.loads(s.body)["n_predict"] for s in standin.seen if s.path == "/completion")
    assert sent == sorted(asked)
    assert all(ok for ok, _ in llama_toggle.checks({"slots": [], "errors": [], "requests": sl.results}))


@pytest.mark.parametrize("v, want", [("64", 64), ("48,80", (48, 80)), ("7,7", (7, 7)), ("0", None), ("9,3", None),
                                     ("1,2,3", None), ("x", None)])
def test_n_predict_is_n_or_lo_hi(v, want):
    import argparse
    if want:
        assert llama_toggle.n_predict_arg(v) == want
    else:
        with pytest.raises(argparse.ArgumentTypeError):
            llama_toggle.n_predict_arg(v)


class Meter:
    """A meter whose rate depends on the mode last switched to: tokens = integral of the rate."""

    def __init__(self, rates):
        import time
        self.rates, self.mode, self.n, self.t = rates, "off", 0.0, time.perf_counter()

    def _advance(self):
        import time
        now = time.perf_counter()
        self.n += self.rates[self.mode] * (now - self.t)
        self.t = now
        return now

    async def mark(self):
        now = self._advance()
        return int(self.n), now

    def switch(self, mode):
        self._advance()
        self.mode = mode
        return True


def test_random_order_is_seeded_both_orders_occur_and_every_pair_holds_both_modes():
    import toggle_slots as ts

    def orders(seed):
        m = Meter({"off": 1000.0, "events": 1000.0})
        slots = asyncio.run(ts.toggle_slots(m, 0.9, 0.02, m.switch, seed=seed))
        return [tuple(s["mode"] for s in slots if s["pair"] == p) for p in sorted({s["pair"] for s in slots})]
    a, b = orders(11), orders(11)
    n = min(len(a), len(b))
    assert n >= 12 and a[:n] == b[:n]                                   # seeded: the same draws
    assert set(a) == {("off", "events"), ("events", "off")}             # both orders, every pair both modes
    with pytest.raises(ValueError):
        asyncio.run(ts.toggle_slots(Meter({"off": 1.0}), 0.1, 0.02, lambda m: True, order="abab"))


def test_marks_rate_a_slot_after_it_settles_and_by_position_shows_a_transient():
    """A server that runs 30 % fast for the first 0.1 s after any switch to events and 30 % slow after one to off:
    in ABBA order the second slot of a pair always follows a switch, so by_position shows it; leaving out each slot's
    first 0.1 s (settled) gives the steady ratio, 1."""
    import time
    import toggle_slots as ts

    class Transient(Meter):
        def _advance(self):           # the integral of the rate since the last reading
            now = time.perf_counter()
            boost = 1.3 if self.mode == "events" else 0.7
            fast = max(0.0, min(now, self.since + 0.1) - self.t)
            self.n += 1000.0 * (boost * fast + (now - self.t - fast))
            self.t = now
            return now

        async def mark(self):
            now = self._advance()
            return self.n, now

        def switch(self, mode):
            self._advance()
            if mode != self.mode:
                self.since = time.perf_counter()
            self.mode = mode
            return True
    m = Transient({})
    m.since = time.perf_counter()
    slots = asyncio.run(ts.toggle_slots(m, 3.3, 0.4, m.switch, order="abba", tick_s=0.05))
    assert all(s["marks"][-1] == [s["s"], s["tokens"]] and len(s["marks"]) >= 7 for s in slots)
    got = ts.toggle_pairs(slots, settle_s=0.15)
    assert got["events/off"]["gmean"] > 1.02                            # the transient, counted
    assert abs(got["settled"]["events/off"]["gmean"] - 1.0) < 0.05 and got["settled"]["pairs"] == got["pairs"]
    pos = got["by_position"]
    assert pos["events second"]["mean_log"] > pos["events first"]["mean_log"] + 0.03
    assert pos["off second"]["mean_log"] < pos["off first"]["mean_log"] - 0.03
    assert ts.settled_rate({"marks": [[0.1, 10], [0.2, 20]]}, 0.5) is None and ts.settled_rate({}, 0.1) is None


def _ticked_slots(read_err, rate_err, slot_err=0.0, n_slots=60, ticks=8, tick_s=0.5, seed=5):
    """Slots whose marks come from a load of 1,000 tok/s: each read off by N(0, read_err) tokens (a meter late or
    early), each tick's rate off by N(0, rate_err) (the load itself), or each slot's by N(0, slot_err) (a slow
    drift); a last tick cut to 0.01 s, as a slot's end mark can land right after its last tick's."""
    import random
    rng = random.Random(seed)
    slots = []
    for _ in range(n_slots):
        n, marks, slow = 0.0, [], rng.gauss(0, slot_err)
        for k in range(1, ticks + 1):
            n += tick_s * 1000.0 * (1 + slow + rng.gauss(0, rate_err))
            marks.append([k * tick_s, n + rng.gauss(0, read_err)])
        marks.append([ticks * tick_s + 0.01, marks[-1][1] + 10 + rng.gauss(0, read_err)])
        slots.append({"marks": marks})
    return slots


def test_tick_noise_tells_a_meter_whose_reads_jitter_from_a_load_whose_rate_varies():
    import toggle_slots as ts
    jitter = ts.tick_noise(_ticked_slots(read_err=20.0, rate_err=0.0))
    load = ts.tick_noise(_ticked_slots(read_err=0.0, rate_err=0.05))
    drift = ts.tick_noise(_ticked_slots(read_err=0.0, rate_err=0.02, slot_err=0.05))
    assert jitter["lag1"] < -0.4 and abs(load["lag1"]) < 0.1          # shared reads: -0.5; independent ticks: 0
    assert drift["lag1"] > 0.5                                          # slower than a slot: ticks agree
    assert jitter["ticks"] == load["ticks"] == 60 * 8                  # the cut-short last ticks are not rated
    assert load["cv"] == pytest.approx(0.05, rel=0.15)                 # each tick's rate off by 5 %
    assert jitter["cv"] == pytest.approx(20 * 2 ** 0.5 / 500, rel=0.15)  # two reads' errors over 500 tokens
    assert ts.tick_noise([{"marks": [[0.5, 500], [1.0, 1000]]}, {}]) is None
    got = ts.toggle_pairs([{**s, "pair": i // 2, "mode": ("off", "events")[i % 2], "switched": True, "tok_s": 1000.0}
                           for i, s in enumerate(_ticked_slots(read_err=20.0, rate_err=0.0, n_slots=8))])
    assert got["tick_noise"]["ticks"] == 64 and got["tick_noise"]["lag1"] < -0.3


def test_cpu_per_token_pairs_each_roles_cpu_the_second_mode_over_the_first():
    """A server whose engine's main thread spends 2 % more CPU a token in events: cpu_per_token says 1.02 for it
    and 1.0 for a role whose CPU did not move; a role in one slot of a pair only, or without a main thread, is
    rated where it can be."""
    import toggle_slots as ts
    slots = []
    for i in range(6):
        for m in (("off", "events") if i % 2 else ("events", "off")):
            k = 1.02 if m == "events" else 1.0
            cpu = {"engine": {"all": 80.0 * k + i, "main": 70.0 * k}, "api": {"all": 30.0}}
            if i == 0 and m == "events":
                cpu["settle"] = {"all": 5.0}
            slots.append({"pair": i, "mode": m, "switched": True, "tok_s": 1000.0, "cpu_ms_per_ktok": cpu})
    got = ts.toggle_pairs(slots)["cpu_per_token"]
    assert set(got) == {"engine", "api"} and set(got["api"]) == {"all"}
    assert got["engine"]["main"]["median"] == 1.02 and got["engine"]["main"]["events_ms_per_ktok"] == 71.4
    assert got["api"]["all"]["median"] == 1.0 and got["api"]["all"]["off_ms_per_ktok"] == 30.0
    assert 1.0 < got["engine"]["all"]["gmean"] < 1.02                 # +i a pair on both sides: less than 2 %
    assert "cpu_per_token" not in ts.toggle_pairs([{**s, "cpu_ms_per_ktok": None} for s in slots])
