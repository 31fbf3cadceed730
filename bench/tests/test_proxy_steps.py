"""The proxy-cost analyses: proxy_steps.py (where a proxied request's time goes, from a run_server_bench
result), proxy_gaps.py (its per-request start/end/slot gaps and its timestamping relay), and the
per-request server timings run_server_bench keeps for them."""
from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH / "server"))
sys.path.insert(0, str(BENCH / "perf"))
sys.path.insert(0, str(BENCH.parent / "tests" / "support"))
import load  # noqa: E402
import proxy_gaps  # noqa: E402
import proxy_steps  # noqa: E402
import run_server_bench as rsb  # noqa: E402
from ports import free_port  # noqa: E402


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


def test_gap_figures_match_requests_to_the_relay_by_seed():
    # two requests of one client: sent at 10.0 and 12.0; the relay saw them 3 ms later, the final event
    # left the server 1 s after that, and the client read it 2 ms later
    reqs = [{"client": 0, "seed": 7, "start": 10.0, "end": 11.005, "tokens": 64, "error": None,
             "predicted_ms": 630.0, "predicted_n": 64},
            {"client": 0, "seed": 8, "start": 11.006, "end": 12.011, "tokens": 64, "error": None,
             "predicted_ms": 630.0, "predicted_n": 64}]
    relay = [{"seed": 7, "accept": 10.002, "req_seen": 10.003, "stop": 11.003, "term": 11.003},
             {"seed": 8, "accept": 11.008, "req_seen": 11.009, "stop": 12.009},
             {"accept": 9.0}]                                  # a connection without a body (health)
    f = proxy_gaps._figures(reqs, relay, wall=2.011, clients=1)
    assert f["matched"] == 2 and f["errors"] == 0
    assert abs(f["start_added_ms_p50"] - 3.0) < 1e-6
    assert abs(f["end_added_ms_p50"] - 2.0) < 1e-6
    assert abs(f["slot_gap_ms_max"] - 6.0) < 1e-6               # 11.003 -> 11.009
    assert f["server_step_ms"] == 10.0
    assert abs(f["slot_busy"] - 2.0 / 2.011) < 1e-3


def test_relay_forwards_byte_for_byte_and_times_the_final_event(tmp_path):
    answer = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
              b"f\r\ndata: {\"a\":1}\n\n\r\n" + b"15\r\ndata: {\"stop\":true}\n\n\r\n" + b"0\r\n\r\n")

    async def upstream(reader, writer):
        await reader.readuntil(b"}")              # the request's body ends with its JSON
        for part in (answer[:120], answer[120:]):
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(0.02)
        writer.close()

    async def main():
        up = await asyncio.start_server(upstream, "127.0.0.1", 0)
        uport = up.sockets[0].getsockname()[1]
        rport = free_port()
        log = tmp_path / "relay.jsonl"
        task = asyncio.create_task(proxy_gaps._relay_main(rport, uport, str(log)))
        for _ in range(100):
            try:
                r, w = await asyncio.open_connection("127.0.0.1", rport)
                break
            except OSError:
                await asyncio.sleep(0.01)
        body = json.dumps({"prompt": [1, 2], "seed": 4242}).encode()
        t0 = time.monotonic()
        w.write(b"POST /completion HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        got = await r.read()
        w.close()
        for _ in range(100):
            if log.exists() and log.read_text().strip():
                break
            await asyncio.sleep(0.01)
        task.cancel()
        up.close()
        return t0, got, [json.loads(x) for x in log.read_text().splitlines()]

    t0, got, recs = asyncio.run(main())
    assert got == answer
    assert len(recs) == 1
    rec = recs[0]
    assert rec["seed"] == 4242 and t0 <= rec["req_seen"] <= rec["resp_first"]
    assert rec["resp_first"] + 0.015 <= rec["stop"] == rec["term"] <= rec["up_eof"]
