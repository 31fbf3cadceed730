"""The proxy-cost analysis: proxy_steps.py (where a proxied request's time goes, from a run_server_bench
result), and the per-request server timings run_server_bench keeps for it."""
from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH / "server"))
sys.path.insert(0, str(BENCH / "perf"))
sys.path.insert(0, str(BENCH.parent / "tests" / "support"))
import load  # noqa: E402
import proxy_steps  # noqa: E402
import run_server_bench as rsb  # noqa: E402


def _req(client, start, step_s, n, predicted_ms=None, slow_at=None, tail_s=0.001):
    """A request of n token events `step_s` apart (one interval at index slow_at is 0.11 s), its end
    `tail_s` after the last event; times after the load's t0, as load.summarise leaves them."""
    ts, t = [], start + 0.2
    for k in range(n):
        ts.append(t)
        t += 0.11 if k == slow_at else step_s
    r = {"client": client, "start": start, "end": ts[-1] + tail_s, "ttft_s": 0.2, "e2e_s": ts[-1] + tail_s - start,
         "ev": load.encode_times(ts, 0.0)}
    if predicted_ms is not None:
        r["predicted_ms"] = predicted_ms
    return r


def test_steps_tell_a_slower_server_from_a_slower_path():
    # direct: 21 ms steps; proxy: 23 ms steps, the server's own decode time as long (a slower server)
    direct = [_req(0, 0.0, 0.021, 64, predicted_ms=63 * 21 + 89, slow_at=10),
              _req(0, 1.7, 0.021, 64, predicted_ms=63 * 21 + 89, slow_at=10)]
    proxy = [_req(0, 0.0, 0.023, 64, predicted_ms=62 * 23 + 110, slow_at=10, tail_s=0.002),
             _req(0, 1.9, 0.023, 64, predicted_ms=62 * 23 + 110, slow_at=10, tail_s=0.002)]
    figs = proxy_steps.per_target([{"via": "direct", "per_request": direct}, {"via": "proxy", "per_request": proxy}])
    d, p = figs["direct"], figs["proxy"]
    assert d["requests"] == p["requests"] == 2
    assert abs(d["step_ms"] - 21) < 0.6 and abs(p["step_ms"] - 23) < 0.6
    assert d["slow_steps"] == p["slow_steps"] == 1
    assert abs(p["transport_s"]) < 0.002 and abs(d["transport_s"]) < 0.002   # the server, not the path
    assert p["last_to_end_ms"] == 2.0 and d["last_to_end_ms"] == 1.0
    # the client sent its second request right after its first ended
    assert abs(d["client_gap_ms"] - (1.7 - direct[0]["end"]) * 1e3) < 1.0


def test_steps_skip_failed_requests_and_read_a_bench_result():
    good = _req(3, 0.0, 0.02, 8)
    bad = dict(_req(3, 1.0, 0.02, 8), error="HTTP 500")
    result = {"runs": [{"loads": [{"pair": 0, "via": "direct", "per_request": [good, bad]}]}]}
    figs = proxy_steps.per_target(proxy_steps.loads_of(result))
    assert figs["direct"]["requests"] == 1 and figs["direct"]["server_decode_s"] is None


def test_bench_keeps_the_servers_own_timings_per_request():
    res = {"requests": 1, "per_request": [{"i": 0, "client": 0, "start": 0.0, "end": 1.0, "prompt_ms": 12.5,
                                           "predicted_ms": 900.25, "content": "x" * 100, "token_ids": [1, 2]}]}
    _, per = rsb.load_record(res)
    assert per[0]["prompt_ms"] == 12.5 and per[0]["predicted_ms"] == 900.25
    assert "content" not in per[0] and "token_ids" not in per[0]
