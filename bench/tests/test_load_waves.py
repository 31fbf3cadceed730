"""CPU tests of load.py's waves mode: the wave barrier against the llama-server stand-in (no request of
wave k+1 starts before every request of wave k ended; the free loop, on the same server, does start
them early), and the arithmetic of a waves load's figures (tok/s over the sum of the wave walls, the
CV across waves, the per-wave steady window). Run: .venv/bin/python -m pytest -q bench/tests
"""
from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH / "server"))
import load  # noqa: E402

CLIENTS, REQUESTS, SEED = 4, 12, 1
SLOW_I, SLOW_S = 2, 0.4          # request 2 (wave 0; body seed SEED + 2) is held back SLOW_S


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def standin():
    """fake_llama_server.py: 8 tokens 10 ms apart, request SLOW_I slow."""
    port = free_port()
    env = dict(os.environ, FAKE_TOKENS="8", FAKE_TOKEN_DELAY="0.01",
               FAKE_SLOW=f"{SEED + SLOW_I}-{SEED + SLOW_I}:{SLOW_S}")
    p = subprocess.Popen([sys.executable, str(BENCH / "tests" / "fake_llama_server.py"), "--port", str(port)],
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 15
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1):
                break
        except OSError:
            if p.poll() is not None or time.monotonic() > deadline:
                p.kill()
                pytest.fail(f"stand-in did not start: {p.stderr.read().decode()[-500:]}")
            time.sleep(0.05)
    yield url
    p.terminate()
    p.wait(10)


def by_wave(res):
    out = {}
    for r in res["per_request"]:
        out.setdefault(r["wave"], []).append(r)
    return [out[w] for w in sorted(out)]


def test_no_request_of_a_wave_starts_before_the_previous_wave_ended(standin):
    gap = 0.1
    res = load.run_load(standin, CLIENTS, REQUESTS, prompt_tokens=8, n_predict=8, seed=SEED,
                        request_timeout_s=10, total_timeout_s=30, waves=True, wave_gap_s=gap)
    assert res["ok"] == REQUESTS and res["load_mode"] == "waves" and res["wave_gap_s"] == gap
    waves = by_wave(res)
    assert [sorted(r["i"] for r in rs) for rs in waves] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert all(sorted(r["client"] for r in rs) == list(range(CLIENTS)) for rs in waves)
    for prev, nxt in zip(waves, waves[1:]):
        # the barrier, and the gap after it (per_request times are rounded to 0.1 ms)
        assert min(r["start"] for r in nxt) >= max(r["end"] for r in prev) + gap - 1e-3
    for rs in waves:   # a wave's requests go out together
        assert max(r["start"] for r in rs) - min(r["start"] for r in rs) < 0.05
    slow = next(r for r in res["per_request"] if r["i"] == SLOW_I)
    assert slow["end"] == max(r["end"] for r in waves[0]) and slow["e2e_s"] > SLOW_S
    # every token event's time was kept; TTFT and e2e as in free mode
    assert all(len(load.decode_times(r["ev"])) == 8 for r in res["per_request"])
    assert slow["ttft_s"] > SLOW_S and res["ttft_p50_s"] < SLOW_S
    # the figures from the same per-request times
    w = res["waves"]
    assert [x["requests"] for x in w] == [CLIENTS] * 3 and w[0]["wall_s"] > SLOW_S > w[1]["wall_s"]
    walls = sum(x["end"] - x["start"] for x in w)
    assert res["waves_wall_s"] == pytest.approx(walls, abs=1e-3)
    assert res["output_tok_s"] == pytest.approx(REQUESTS * 8 / walls, rel=1e-3)
    assert res["wall_s"] > walls + 2 * gap - 1e-3          # the span counts the gaps, tok/s does not
    assert res["wave_tok_s_cv"] == round(statistics.stdev(x["tok_s"] for x in w)
                                         / statistics.mean(x["tok_s"] for x in w), 4)
    assert res["steady_tok_s"] and res["steady_waves"] >= 2


def test_the_free_loop_on_the_same_server_does_not_wait(standin):
    """What the barrier prevents: free clients take requests 4.. while the slow request 2 still runs."""
    res = load.run_load(standin, CLIENTS, REQUESTS, prompt_tokens=8, n_predict=8, seed=SEED,
                        request_timeout_s=10, total_timeout_s=30)
    assert res["ok"] == REQUESTS and res["load_mode"] == "free" and "waves" not in res
    slow = next(r for r in res["per_request"] if r["i"] == SLOW_I)
    assert min(r["start"] for r in res["per_request"] if r["i"] >= CLIENTS) < slow["end"]


def req(i, wave, start, end, ev, tokens=None, error=None):
    r = {"i": i, "client": i % 2, "wave": wave, "start": start, "end": end, "times": ev,
         "ttft_s": ev[0] - start if ev else None, "e2e_s": end - start,
         "tokens_out": len(ev) if tokens is None else tokens}
    if error:
        r["error"] = error
    return r


def test_waves_figures_leave_the_gaps_out():
    # t0 = 100. Wave 0: [100.0, 101.0], 2 x 4 tokens. A 5 s gap. Wave 1: [106.0, 106.5], 2 x 4 tokens.
    rs = [req(0, 0, 100.0, 101.0, [100.2, 100.4, 100.6, 100.8]),
          req(1, 0, 100.0, 100.9, [100.3, 100.5, 100.7, 100.9]),
          req(2, 1, 106.0, 106.5, [106.1, 106.2, 106.3, 106.4]),
          req(3, 1, 106.01, 106.45, [106.15, 106.25, 106.35, 106.45])]
    s = load.summarise(rs, waves=True)
    assert s["load_mode"] == "waves" and s["wall_s"] == 6.5
    assert [(w["wall_s"], w["output_tokens"], w["tok_s"]) for w in s["waves"]] == [(1.0, 8, 8.0), (0.5, 8, 16.0)]
    assert s["waves_wall_s"] == 1.5 and s["output_tok_s"] == round(16 / 1.5, 2)   # not 16 / 6.5
    assert s["wave_tok_s_cv"] == round(statistics.stdev([8.0, 16.0]) / 12.0, 4)
    # steady: wave 0 from its last first token (100.3) to its first end (100.9): 100.4 100.5 100.6 100.7
    # 100.8 100.9 = 6 tokens in 0.6 s; wave 1 from 106.15 to 106.45: 106.2 106.25 106.3 106.35 106.4
    # 106.45 = 6 tokens in 0.3 s. 12 tokens / 0.9 s.
    assert (s["steady_tokens"], s["steady_s"], s["steady_waves"]) == (12, 0.9, 2)
    assert s["steady_tok_s"] == round(12 / 0.9, 2)
    assert [w["start"] for w in s["waves"]] == [0.0, 6.0] and s["per_request"][3]["start"] == 6.01


def test_a_failed_request_counts_in_its_waves_wall_but_not_its_tokens():
    rs = [req(0, 0, 0.0, 1.0, [0.5, 0.9]), req(1, 0, 0.0, 2.0, [], tokens=0, error="HTTP 500: x"),
          req(2, 1, 3.0, 4.0, [3.5, 3.9]), req(3, 1, 3.0, 4.0, [3.4, 3.8])]
    s = load.summarise(rs, waves=True)
    assert s["ok"] == 3 and [w["wall_s"] for w in s["waves"]] == [2.0, 1.0]
    assert [w["output_tokens"] for w in s["waves"]] == [2, 4] and s["output_tok_s"] == 2.0
    assert s["steady_waves"] == 1     # wave 0 has a request without a token: no steady window there


def test_waves_option_wants_whole_waves():
    d = subprocess.run([sys.executable, str(BENCH / "server" / "load.py"), "--waves", "--clients", "16",
                        "--requests", "40"], capture_output=True, text=True, timeout=30)
    assert d.returncode == 2 and "multiple of --clients" in d.stderr and "Traceback" not in d.stderr
