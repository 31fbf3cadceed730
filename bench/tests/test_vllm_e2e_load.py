"""CPU tests of bench/device/vllm_e2e.py's load against a stand-in /v1/completions (aiohttp): tokens
counted from the stream's events, or from the usage of one JSON answer when not streaming; the
caller's traceparent sent with every request; errors counted, not raised."""
from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import threading
import time
from types import SimpleNamespace
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench" / "device"))
sys.path.insert(0, str(REPO / "tests" / "support"))
import vllm_e2e  # noqa: E402
from otel_gpu_census.attribution.shares import Share  # noqa: E402
from otel_gpu_census.census import Stat  # noqa: E402
from otel_gpu_census.telemetry.attributes import share_attributes  # noqa: E402
from ports import free_port  # noqa: E402


@pytest.fixture
def server():
    """port, requests seen, and the stand-in's state: `generated` (its token counter, served at /metrics
    as vLLM names it), `reads` (the counter's value at each /metrics read), `delay_s` (per answer)."""
    from aiohttp import web
    seen = []
    state = {"generated": 0, "reads": [], "delay_s": 0.0, "metrics": True}

    async def completions(request):
        body = await request.json()
        seen.append((request.headers.get("traceparent"), body))
        n = body["max_tokens"]
        if body.get("prompt", "").startswith("omicron"):        # one prompt of the seed fails
            return web.Response(status=500)
        if state["delay_s"]:
            await asyncio.sleep(state["delay_s"])
        state["generated"] += n
        if not body["stream"]:
            return web.json_response({"id": f"cmpl-{len(seen)}", "usage": {"completion_tokens": n}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(n):
            ev = {"id": f"cmpl-{len(seen)}", "choices": [{"text": f"t{i}"}]}
            await resp.write(f"data: {json.dumps(ev)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    port = free_port()
    loop = asyncio.new_event_loop()
    app = web.Application()
    async def metrics(request):
        state["reads"].append(state["generated"])
        text = "# TYPE vllm:generation_tokens_total counter\n"
        if state["metrics"]:
            text += f'vllm:generation_tokens_total{{engine="0",model_name="m"}} {float(state["generated"])}\n'
        return web.Response(text=text + 'vllm:generation_tokens_created{engine="0",model_name="m"} 1.7e9\n')

    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    yield port, seen, state
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(5)
    loop.call_soon_threadsafe(loop.stop)
    t.join(5)


@pytest.mark.parametrize("stream", [True, False])
def test_tokens_are_counted_streaming_or_not(server, stream):
    port, seen, _ = server
    res = asyncio.run(vllm_e2e.load(port, clients=3, per_client=2, max_tokens=5, seed=7, stream=stream))
    ok = [r for r in res["requests"]]
    assert len(ok) + len(res["errors"]) == 6 and len(seen) == 6
    assert all(r["tokens"] == 5 and r["id"] for r in ok)
    assert all((r["ttft_s"] is not None) == stream for r in ok)
    assert res["tok_per_s"] > 0 and all(e == 500 for e in res["errors"])
    sent = {tp for tp, _ in seen}
    assert {f"00-{r['trace_id']}-{r['span_id']}-01" for r in ok} <= sent and len(sent) == 6
    assert all(b["stream"] is stream and b["ignore_eos"] for _, b in seen)


def test_window_load_rates_the_servers_own_counter_over_the_window_and_cuts_no_request(server):
    """Closed-loop clients: the rate is the server's counter between its two reads over the window alone;
    every request is answered whole (tokens as asked, each its own length within the range); once the
    window ends no new request is sent."""
    port, seen, state = server
    state["delay_s"] = 0.02
    res = asyncio.run(vllm_e2e.window_load(port, clients=4, ramp_s=0.2, window_s=0.5, tokens=(3, 9), seed=11))
    n0, n1 = state["reads"][-2:]
    assert res["window"]["tokens"] == n1 - n0 > 0
    assert res["tok_per_s"] == pytest.approx((n1 - n0) / res["window"]["s"])
    assert 0.5 <= res["window"]["s"] < 0.7 and res["elapsed_s"] >= 0.7
    ok = res["requests"]
    assert len(ok) + len(res["errors"]) == len(seen) and len(ok) > 8
    assert all(r["tokens"] == r["max_tokens"] and 3 <= r["tokens"] <= 9 for r in ok)
    assert len({r["max_tokens"] for r in ok}) > 1                  # not one length for all
    assert state["generated"] == sum(r["tokens"] for r in ok)     # nothing answered was left out
    sent = len(seen)
    time.sleep(0.2)
    assert len(seen) == sent                                        # the clients stopped


def test_a_server_whose_counter_is_missing_or_still_is_said_before_the_phases(server):
    port, _, state = server
    assert not vllm_e2e.counter_readable(port)          # a counter that counted nothing is no gauge
    state["generated"] = 5
    assert vllm_e2e.counter_readable(port)
    state["metrics"] = False
    assert not vllm_e2e.counter_readable(port)
    with pytest.raises(RuntimeError, match="generation_tokens_total"):
        asyncio.run(vllm_e2e.window_load(port, clients=1, ramp_s=0, window_s=0.1))


@pytest.mark.parametrize("bad", ["1", "a,b", "-1,3", "1,0"])
def test_phase_window_takes_a_ramp_and_a_window(bad):
    r = subprocess.run([sys.executable, str(REPO / "bench" / "device" / "vllm_e2e.py"), "--out", "/tmp/x",
                        "--phase-window", bad], capture_output=True, text=True)
    assert r.returncode == 2 and "--phase-window" in r.stderr and "Traceback" not in r.stderr


class _FakeServer:
    """Stands in for a vLLM server of a cycle: records when it started, stops with rc 0."""
    started: list = []

    def __init__(self, name, port, model, out, census_dir=None, extra=(), env=None, gpu_mem=0.2, cache=None):
        self.name, self.port, self.census_dir, self.cache, self.gpu_mem = name, port, census_dir, cache, gpu_mem
        _FakeServer.started.append(self)
        self.ready_s = 1.0

    def wait(self):
        return self.name != "cycle3"                     # one server never comes up

    def stop(self):
        return {"rc": 0, "stop_s": 0.1}


def _cycles(monkeypatch, tmp_path, n, parallel, budget_s):
    import argparse
    _FakeServer.started = []
    monkeypatch.setattr(vllm_e2e, "Server", _FakeServer)
    monkeypatch.setattr(vllm_e2e.time, "sleep", lambda s: None)

    async def fake_load(port, clients, per_client, max_tokens, seed=0, **kw):
        return {"requests": [{"port": port}] * (clients * per_client), "errors": [], "tok_per_s": 1.0}
    monkeypatch.setattr(vllm_e2e, "load", fake_load)
    monkeypatch.setattr(vllm_e2e, "read_census", lambda d: ([], [{"gpu": {}}] * 16))
    a = argparse.Namespace(cycles=n, cycle_parallel=parallel, cycle_gpu_mem=0.15, budget_s=budget_s)
    return vllm_e2e.cycles_run(a, "/m", tmp_path, tmp_path, {})


def test_cycles_run_in_waves_each_with_its_own_port_folder_and_cache(monkeypatch, tmp_path):
    cyc = _cycles(monkeypatch, tmp_path, n=5, parallel=2, budget_s=1e9)
    assert [c["cycle"] for c in cyc] == [0, 1, 2, 3, 4]
    s = _FakeServer.started
    assert len({x.port for x in s}) == 5 and len({x.census_dir for x in s}) == 5
    # two slots: a slot's cache is reused from wave to wave, never by two servers of one wave
    assert [x.cache for x in s] == ["/tmp/vc-cycle0", "/tmp/vc-cycle1"] * 2 + ["/tmp/vc-cycle0"]
    assert all(x.gpu_mem == 0.15 for x in s)
    assert cyc[3]["up"] is False and cyc[3]["requests"] == 0 and cyc[3]["errors"] == 1
    assert all(c["requests"] == 16 and c["logged"] == 16 for i, c in enumerate(cyc) if i != 3)


def test_cycles_stop_before_a_wave_that_would_pass_the_budget(monkeypatch, tmp_path):
    clock = iter(range(0, 10_000, 50))           # every time.time() call moves 50 s on
    monkeypatch.setattr(vllm_e2e.time, "time", lambda: next(clock))
    cyc = _cycles(monkeypatch, tmp_path, n=10, parallel=2, budget_s=300)
    assert 0 < len(cyc) < 10 and len(cyc) % 2 == 0


def _phases_against(monkeypatch, out, rate, rounds, names, window=None, together=""):
    """phases_run with the load, the census switches and the servers stood in for: `rate` port ->
    tok/s; returns (the result, the ports loaded in order, the (folder, mode) switches asked for)."""
    import argparse
    sys.path.insert(0, str(REPO / "bench" / "server"))
    import control_phases
    order, switched = [], []

    class FakePhases:
        def __init__(self, d):
            self.d = d

        def set(self, mode, timeout=10.0):
            switched.append((Path(self.d).name, mode))
            return True

        def totals(self):
            return {}
    monkeypatch.setattr(control_phases, "Phases", FakePhases)
    monkeypatch.setattr(control_phases.time, "sleep", lambda s: None)
    monkeypatch.setattr(vllm_e2e, "wait_quiet", lambda: 0.0)

    async def fake_load(port, clients, per_client, max_tokens, seed=0, stream=True, **kw):
        order.append(port)
        return {"requests": [{"tokens": max_tokens, "ttft_s": None}] * 2, "errors": [], "tok_per_s": rate[port]}
    monkeypatch.setattr(vllm_e2e, "load", fake_load)

    async def fake_window(port, clients, ramp_s, window_s, seed=0, root=None, **kw):
        order.append(("window", port, ramp_s, window_s))
        # each server's process tree: a main process whose CPU is its pid's share of the window
        cpu = {"VLLM::EngineCore": {"cpu_s": window_s * root / 10000, "processes": 1,
                                    "threads": {"main": window_s * root / 20000}}}
        return {"requests": [{"tokens": 100, "max_tokens": 100, "ttft_s": None}] * 3, "errors": [],
                "tok_per_s": rate[port], "window": {"tokens": rate[port] * window_s, "s": window_s},
                "client_tok_per_s": rate[port] * 0.9, "cpu": cpu}
    monkeypatch.setattr(vllm_e2e, "window_load", fake_window)
    monkeypatch.setattr(vllm_e2e, "counter_readable", lambda port: True)

    class Srv:
        def __init__(self, port):
            self.port, self.proc = port, SimpleNamespace(poll=lambda: None, pid=port)

        def wait(self):
            return True

        def stop(self):
            return {"rc": 0, "stop_s": 0.1}
    servers = {"R": Srv(8105), **{n: Srv(vllm_e2e.BESIDE[n][0]) for n in names}}
    a = argparse.Namespace(phase_clients=2, phase_requests=1, phase_stream=False, phase_modes="off,launch",
                           phase_rounds=rounds, budget_s=1e9, phase_window=window, phase_together=together)
    return vllm_e2e.phases_run(a, "/m", out, out, {}, servers), order, switched


def test_phases_with_split_load_plain_and_integration_off_servers_in_alternating_order(monkeypatch, tmp_path):
    """--phase-split: after each round of R's phases, P (plain) and S (census paused, integration off)
    take the same load, their order alternating; off/P, off/S and S/P per round and summarised."""
    res, order, _ = _phases_against(monkeypatch, tmp_path, {8105: 900.0, 8101: 1000.0, 8107: 950.0}, 2, ("P", "S"))
    assert sorted(order[:3]) == [8101, 8105, 8107]              # each warmed once
    assert [p for p in order[3:] if p != 8105] == [8101, 8107, 8107, 8101]   # P, S, then S, P
    assert res["off/P"]["median"] == 0.9 and res["off/S"]["median"] == round(900 / 950, 4)
    assert res["S/P"]["median"] == 0.95


def test_phases_beside_a_chain_rotate_their_order_and_keep_every_ratio(monkeypatch, tmp_path):
    """--phase-beside P,Q,S,X: every beside server once a round, the order rotating round to round;
    off/n for each, and n/m for each m before n in the chain (Q/P: two identical servers' spread)."""
    ports = {n: vllm_e2e.BESIDE[n][0] for n in ("P", "Q", "S", "X")}
    rate = {8105: 800.0, ports["P"]: 1000.0, ports["Q"]: 960.0, ports["S"]: 900.0, ports["X"]: 850.0}
    res, order, paused = _phases_against(monkeypatch, tmp_path, rate, 3, ("P", "Q", "S", "X"))
    # S and X run paused beside R (P and Q have no census); R is set per phase
    assert ("S", "off") in paused and ("X", "off") in paused and not {"P", "Q"} & {d for d, _ in paused}
    beside = [p for p in order[5:] if p != 8105]
    P, Q, S, X = (ports[n] for n in "PQSX")
    assert beside == [P, Q, S, X, Q, S, X, P, S, X, P, Q]
    assert res["Q/P"]["median"] == 0.96 and res["X/S"]["median"] == round(850 / 900, 4)
    assert res["off/X"]["median"] == round(800 / 850, 4) and res["S/Q"]["median"] == round(900 / 960, 4)
    assert res["launch/P"]["median"] == 0.8 and res["launch/X"]["median"] == round(800 / 850, 4)
    assert "P/Q" not in res and set(res["beside"]) == {"P", "Q", "S", "X"}


def test_phase_beside_names_an_unknown_server_is_a_usage_error():
    r = subprocess.run([sys.executable, str(REPO / "bench" / "device" / "vllm_e2e.py"), "--out", "/tmp/x",
                        "--phase-beside", "P,W"], capture_output=True, text=True)
    assert r.returncode == 2 and "unknown W" in r.stderr and "Traceback" not in r.stderr


def test_a_retired_census_mode_is_a_usage_error():
    """The control file switches the census off and on only; a mode of the retired ones would stop a run midway."""
    r = subprocess.run([sys.executable, str(REPO / "bench" / "device" / "vllm_e2e.py"), "--out", "/tmp/x",
                        "--phase-modes", "off,launch"], capture_output=True, text=True)
    assert r.returncode == 2 and "unknown launch" in r.stderr and "Traceback" not in r.stderr


def test_phase_kv_bytes_fix_every_phase_servers_kv_cache():
    import argparse
    assert vllm_e2e.phase_extra(argparse.Namespace(phase_kv_bytes=0)) == []
    assert vllm_e2e.phase_extra(argparse.Namespace(phase_kv_bytes=4 << 30)) == ["--kv-cache-memory-bytes", "4294967296"]


def test_phase_window_times_every_load_of_r_and_beside_it_over_the_window(monkeypatch, tmp_path):
    """--phase-window: R's phases and the servers beside it all take the closed-loop window load (none
    the fixed-request one, after the warm-up); the ratios are of the windows' rates."""
    rate = {8105: 800.0, vllm_e2e.BESIDE["P"][0]: 1000.0}
    res, order, _ = _phases_against(monkeypatch, tmp_path, rate, 2, ("P",), window=(1.0, 3.0))
    warm, timed = order[:2], order[2:]
    assert sorted(warm) == [8101, 8105]
    assert len(timed) == 2 * 3 and all(o[0] == "window" and o[2:] == (1.0, 3.0) for o in timed)
    assert res["off/P"]["median"] == 0.8 and res["launch/P"]["median"] == 0.8
    assert res["rounds"][0]["P"]["window"] == {"tokens": 3000.0, "s": 3.0, "client_tok_per_s": 900.0}
    assert "window" in res["load"] and res["rounds"][0]["off"]["tokens"] == 300
    # CPU per 1,000 generated tokens of each server's processes (here: pid/10000 cores over the window)
    cpu = res["cpu_ms_per_ktok"]
    assert cpu["P"]["VLLM::EngineCore"] == pytest.approx({"all": 8101 / 10000 / 1000 * 1e6,
                                                          "main": 8101 / 20000 / 1000 * 1e6, "cores": 0.81}, abs=0.01)
    assert cpu["off"]["VLLM::EngineCore"]["all"] == pytest.approx(8105 / 10000 / 800 * 1e6, abs=0.01)
    assert set(cpu) == {"off", "launch", "P"}


def test_started_before_r_servers_start_first(monkeypatch, tmp_path):
    """F (plain, started before R) is what starting first does to a server: it starts before R, every
    other server after it."""
    started = []

    class Srv:
        def __init__(self, name, port, *a, **k):
            started.append(name)
    monkeypatch.setattr(vllm_e2e, "Server", Srv)
    monkeypatch.setattr(vllm_e2e.time, "sleep", lambda s: None)
    import argparse
    a = argparse.Namespace(phase_gpu_mem=0.1, phase_kv_bytes=0)
    servers = vllm_e2e.start_phase_servers(a, ["P", "F", "S"], "/m", tmp_path, tmp_path, {})
    assert started == ["F", "R", "P", "S"] and set(servers) == {"F", "R", "P", "S"}


def test_spans_check_fails_a_request_short_of_steps(monkeypatch, tmp_path):
    """A request served by fewer steps than its output tokens lost the share of the steps it missed
    (what s4's and s5's H200 runs had and no check said): spans_check says so; one step a token is fine."""
    monkeypatch.setattr(vllm_e2e, "FAILS", [])
    reqs = [{"id": f"cmpl-{i}", "trace_id": f"{i:032x}", "span_id": f"{i:016x}", "max_tokens": 8} for i in (1, 2)]
    steps = {"cmpl-1": 8, "cmpl-2": 5}             # the second request missed 3 of its steps

    def span(r):
        return SimpleNamespace(resource={"service.name": "vllm-R"}, trace_id=r["trace_id"], parent_span_id=r["span_id"],
                               attributes={"gen_ai.response.id": r["id"], "gpu_census.kernel.count": 3,
                                           "gpu_census.attribution.method": "step_tokens",
                                           "gen_ai.usage.output_tokens": 8,
                                           "gpu_census.attribution.steps": steps[r["id"]]})
    spans = [span(r) for r in reqs]
    rx = SimpleNamespace(wait_for_spans=lambda pred, timeout: spans, span_snapshot=lambda: spans)
    res: dict = {}
    vllm_e2e.spans_check(rx, {"requests": reqs}, "R", tmp_path, res)
    assert res["short_of_steps"] == 1
    assert vllm_e2e.FAILS == ["R: every request served by a step per output token at least (1 short)"]
    spans[1].attributes["gpu_census.attribution.steps"] = 9
    monkeypatch.setattr(vllm_e2e, "FAILS", [])
    vllm_e2e.spans_check(rx, {"requests": reqs}, "R", tmp_path, res)
    assert res["short_of_steps"] == 0 and vllm_e2e.FAILS == []


def test_same_window_ratios_divide_loads_that_ran_at_once():
    """--phase-together: R's mode over each server loaded at once, two such servers over each other,
    and R's mode over off through one of them; a server without a rate gives no ratio."""
    rnd = {"off": {"tok_s": 1000.0, "together": {"P": {"tok_per_s": 1250.0}, "S": {"tok_per_s": 1000.0}}},
           "counted": {"tok_s": 600.0, "together": {"P": {"tok_per_s": 750.0}, "S": {"tok_per_s": 0.0}}}}
    vllm_e2e.same_window_ratios(rnd, ["off", "counted"], ["P", "S"])
    assert rnd["off/P@once"] == 0.8 and rnd["counted/P@once"] == 0.8
    assert rnd["counted/off@P"] == 1.0          # 0.6 sequentially: the host's speed moved both
    assert rnd["off/S@once"] == 1.0 and rnd["S/P@once:off"] == 0.8
    assert "counted/S@once" not in rnd and "S/P@once:counted" not in rnd and "counted/off@S" not in rnd


def test_phase_together_loads_r_and_its_together_servers_at_once_and_the_rest_after(monkeypatch, tmp_path):
    """--phase-together P,S with Q beside: every phase of R loads R, P and S at once (one window each),
    Q alone after the round; the same-window ratios are kept beside the sequential ones."""
    rate = {8105: 800.0, vllm_e2e.BESIDE["P"][0]: 1000.0, vllm_e2e.BESIDE["S"][0]: 900.0,
            vllm_e2e.BESIDE["Q"][0]: 500.0}
    res, order, switched = _phases_against(monkeypatch, tmp_path, rate, 2, ("P", "S", "Q"), window=(1.0, 3.0),
                                           together="P,S")
    timed = [o[1] for o in order if isinstance(o, tuple)]
    P, S, Q = (vllm_e2e.BESIDE[n][0] for n in "PSQ")
    assert timed == [8105, P, S] * 2 + [Q] + [8105, P, S] * 2 + [Q]
    assert set(res["together"]) == {"P", "S"} and set(res["beside"]) == {"Q"}
    assert ("S", "off") in switched                       # a census server loaded at once runs paused
    assert res["off/P@once"]["median"] == 0.8 and res["launch/off@P"]["median"] == 1.0
    assert res["S/P@once:off"]["median"] == 0.9 and res["off/Q"]["median"] == 1.6
    assert "P" not in res["rounds"][0] and res["rounds"][0]["off"]["together"]["S"]["tok_per_s"] == 900.0


def test_estimate_check_places_requests_in_their_phase_and_wants_kernels_in_every_counting_phase(monkeypatch):
    """Requests placed in their phase by start time, kernel time a token per mode; a request of a counting phase
    without kernels fails, one of a paused phase does not."""
    rounds = [{"order": ["launch", "events", "off"], "launch": {"t0_ns": 0, "t1_ns": 99},
               "events": {"t0_ns": 100, "t1_ns": 199}, "off": {"t0_ns": 200, "t1_ns": 299}}]

    def run(events_ns, events_kernels=20):
        lines = [{"start_time_unix_nano": 10, "output_tokens": 10, "gpu": {"kernel.count": 20, "kernel.time_ns": 1000}},
                 {"start_time_unix_nano": 150, "output_tokens": 10, "kernel_time_estimated": True,
                  "gpu": {"kernel.count": events_kernels, "kernel.time_ns": events_ns}},
                 {"start_time_unix_nano": 250, "output_tokens": 10, "gpu": {"kernel.count": 0}},   # paused
                 {"summary": {}}]
        monkeypatch.setattr(vllm_e2e, "FAILS", [])
        res: dict = {}
        vllm_e2e.estimate_check("R", lines, rounds, res)
        return res, list(vllm_e2e.FAILS)
    res, fails = run(950)
    assert fails == [] and res["per_mode"]["events"]["kernel_ns_per_token"] == 95
    assert res["per_mode"]["off"]["without_kernels"] == 1 and res["per_mode"]["launch"]["kernel_ns_per_token"] == 100
    _, fails = run(0, events_kernels=0)
    assert fails == ["R: every request of the events phases has kernels (1 without)"]


def test_conservation_leaves_estimated_kernel_time_to_the_estimate_check(monkeypatch, tmp_path):
    """Under counted kernels, a ledger that priced each request's share on its own (no ``kernel_time_conserved``
    in its summary) conserves no kernel time: that identity is not asserted then; every other field still is. A
    ledger that priced each step once conserves it exactly: asserted, estimated or not."""
    lines = [{"kernel_time_estimated": True, "gpu": {"kernel.count": 5, "kernel.time_ns": 900, "copy.htod.bytes": 7}},
             {"summary": {"total": {"kernel.count": 5, "kernel.time_ns": 300, "copy.htod.bytes": 7},
                          "unattributed": {}}}]
    (tmp_path / "x.requests.jsonl").write_text("\n".join(json.dumps(l) for l in lines))
    # the span's attributes as the product writes them (GPU times in seconds), not as this test guesses
    share = Share(kernel_count=5, kernel_ns=900, copies={"htod": Stat(1, 7, 0)})
    spans = [SimpleNamespace(attributes=share_attributes("gpu_census.", share, seconds=True))]
    monkeypatch.setattr(vllm_e2e, "FAILS", [])
    res: dict = {"_out": str(tmp_path / "out")}
    (tmp_path / "out").mkdir()
    vllm_e2e.conservation_check("R", tmp_path, spans, res)
    assert res["kernel_time_ns_requests_vs_steps_records"] == [900, 300]
    assert [f for f in vllm_e2e.FAILS if "segment" not in f] == []
    lines[0]["kernel_time_estimated"] = False          # measured: the identity holds or fails
    (tmp_path / "x.requests.jsonl").write_text("\n".join(json.dumps(l) for l in lines))
    monkeypatch.setattr(vllm_e2e, "FAILS", [])
    vllm_e2e.conservation_check("R", tmp_path, spans, {"_out": str(tmp_path / "out")})
    assert any("kernel.time_ns: requests 900" in f for f in vllm_e2e.FAILS)
    lines[0]["kernel_time_estimated"] = True           # priced per step: the estimate is conserved, or fails
    lines[1]["summary"]["kernel_time_conserved"] = True
    for total, fails in ((300, 1), (900, 0)):
        lines[1]["summary"]["total"]["kernel.time_ns"] = total
        (tmp_path / "x.requests.jsonl").write_text("\n".join(json.dumps(l) for l in lines))
        monkeypatch.setattr(vllm_e2e, "FAILS", [])
        vllm_e2e.conservation_check("R", tmp_path, spans, {"_out": str(tmp_path / "out")})
        assert len([f for f in vllm_e2e.FAILS if "kernel.time_ns: requests 900" in f]) == fails


def test_reference_check_compares_r_with_the_measured_server_loaded_in_the_same_windows(monkeypatch):
    """R's requests of each windows phase (estimated kernel time) against A's requests started in the same phase
    (every kernel traced): the per-token ratio of each phase, its median within the stated bound, and each R request's
    distance from A's median request beside A's own requests' distance; paused phases and other windows left out."""
    rounds = [{"windows": {"t0_ns": 0, "t1_ns": 99}, "off": {"t0_ns": 100, "t1_ns": 199}},
              {"windows": {"t0_ns": 200, "t1_ns": 299}, "off": {"t0_ns": 300, "t1_ns": 399}}]

    def req(t, ns, tokens=10):
        return {"start_time_unix_nano": t, "output_tokens": tokens, "gpu": {"kernel.time_ns": ns, "kernel.count": 5}}
    a = [req(10, 1000), req(20, 1200), req(30, 800), req(210, 2000), req(220, 2000), req(150, 99_999)]
    monkeypatch.setattr(vllm_e2e, "FAILS", [])
    out = vllm_e2e.reference_check([req(50, 1050), req(60, 950), req(250, 2100), req(150, 5)], a, rounds,
                                   ["off", "windows"])
    w = out["windows"]
    assert list(out) == ["windows"] and w["phases"] == 2 and w["requests"] == 3 and w["reference_requests"] == 5
    assert (w["ratio_min"], w["ratio_max"], w["kernel_ns_per_token_ratio_median"]) == (1.0, 1.05, 1.025)
    assert w["request_error_p50"] == 0.05 and w["reference_spread_p90"] == 0.2 and vllm_e2e.FAILS == []
    out = vllm_e2e.reference_check([req(50, 1300), req(250, 2400)], a, rounds, ["windows"])
    assert out["windows"]["kernel_ns_per_token_ratio_median"] == 1.25 and len(vllm_e2e.FAILS) == 1


def test_reference_check_sets_each_phase_against_a_loaded_beside_in_its_round(monkeypatch):
    """A loaded after R's round (alone on the GPU): each of R's phases is set against A's load of the same round,
    found by A's own wall times; A's requests that fell in R's windows are not the reference."""
    rounds = [{"events": {"t0_ns": 0, "t1_ns": 99}, "off": {"t0_ns": 100, "t1_ns": 199}, "A": {"t0_ns": 200, "t1_ns": 299}},
              {"events": {"t0_ns": 300, "t1_ns": 399}, "off": {"t0_ns": 400, "t1_ns": 499}, "A": {"t0_ns": 500, "t1_ns": 599}},
              {"events": {"t0_ns": 600, "t1_ns": 699}, "off": {"t0_ns": 700, "t1_ns": 799}}]   # A down: left out

    def req(t, ns, tokens=10):
        return {"start_time_unix_nano": t, "output_tokens": tokens, "gpu": {"kernel.time_ns": ns, "kernel.count": 5}}
    a = [req(210, 1000), req(220, 1000), req(510, 2000), req(50, 7777)]
    monkeypatch.setattr(vllm_e2e, "FAILS", [])
    r = [req(50, 1050), req(350, 2100), req(650, 999)]
    out = vllm_e2e.reference_check(r, a, rounds, ["off", "events"], a_beside=True)
    e = out["events"]
    assert e["phases"] == 2 and e["requests"] == 2 and e["reference_requests"] == 3
    assert e["kernel_ns_per_token_ratio_median"] == 1.05 and vllm_e2e.FAILS == []
    # together (the default) the same logs compare R's first phase with A's request inside it
    out = vllm_e2e.reference_check(r, a, rounds, ["off", "events"])
    assert out["events"]["phases"] == 1 and out["events"]["kernel_ns_per_token_ratio_median"] == round(1050 / 7777, 4)


def test_pin_gives_each_server_its_own_cpus_and_a_bad_list_is_a_usage_error(monkeypatch, tmp_path):
    """--pin R=0-3,P=4-7: each named server's whole tree under taskset; a server not named is not pinned."""
    import argparse
    assert vllm_e2e.pin_arg("R=0-3,P=4-7,bench=12-15") == {"R": "0-3", "P": "4-7", "bench": "12-15"}
    assert vllm_e2e.cpu_set("0-3") == {0, 1, 2, 3} and vllm_e2e.cpu_set("4:6-7") == {4, 6, 7}
    for bad in ("R", "R=", "=0-3", "R=0-3;rm"):
        with pytest.raises(argparse.ArgumentTypeError):
            vllm_e2e.pin_arg(bad)
    r = subprocess.run([sys.executable, str(REPO / "bench" / "device" / "vllm_e2e.py"), "--out", str(tmp_path),
                        "--pin", "R=a-b"], capture_output=True, text=True)
    assert r.returncode == 2 and "--pin wants" in r.stderr and "Traceback" not in r.stderr

    cmds = {}

    class Popen:
        def __init__(self, cmd, env=None, **kw):
            cmds[env["OTEL_SERVICE_NAME"]] = cmd
    monkeypatch.setattr(vllm_e2e.subprocess, "Popen", Popen)
    monkeypatch.setattr(vllm_e2e.time, "sleep", lambda s: None)
    a = argparse.Namespace(phase_gpu_mem=0.1, phase_kv_bytes=0, pin={"R": "0-3", "P": "4-7"})
    vllm_e2e.start_phase_servers(a, ["P", "E"], "/m", tmp_path, tmp_path, {})
    assert cmds["vllm-R"][:3] == ["taskset", "-c", "0-3"] and "otel_gpu_census.cli" in cmds["vllm-R"]
    assert cmds["vllm-P"][:3] == ["taskset", "-c", "4-7"] and "otel_gpu_census.cli" not in cmds["vllm-P"]
    assert cmds["vllm-E"][0] != "taskset" and "otel_gpu_census.cli" in cmds["vllm-E"]


def test_e_counts_through_every_phase_beside_r_and_its_ratios_are_taken_at_once(monkeypatch, tmp_path):
    """E (the default census counting, the integration disabled) is never paused: R's events / E at once
    is the integration's share, E / P at once the census's own."""
    E, P = vllm_e2e.BESIDE["E"][0], vllm_e2e.BESIDE["P"][0]
    res, _, switched = _phases_against(monkeypatch, tmp_path, {8105: 900.0, P: 1000.0, E: 960.0}, 2, ("P", "E"),
                                       window=(1.0, 3.0), together="P,E")
    assert not [s for s in switched if s[0] == "E"] and ("R", "launch") in switched
    rnd = res["rounds"][0]
    assert rnd["launch/E@once"] == round(900 / 960, 4) and rnd["E/P@once:launch"] == 0.96
    assert "E" in vllm_e2e.COUNTING and vllm_e2e.BESIDE["E"][2] == {"OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "vllm"}


def test_a_window_summary_says_how_busy_the_host_was_and_how_long_each_role_waited_for_a_cpu():
    got = vllm_e2e.summary({"requests": [], "errors": [], "tok_per_s": 1000.0, "client_tok_per_s": 900.0,
                            "window": {"tokens": 3000, "s": 3.0},
                            "host": {"busy_pct": 20.0, "idle_pct": 79.0, "steal_pct": 1.0},
                            "cpu": {"VLLM::EngineCore": {"cpu_s": 3.0, "wait_s": 0.3, "processes": 1,
                                                         "threads": {"main": 2.9}}}})
    assert got["host"] == {"busy_pct": 20.0, "idle_pct": 79.0, "steal_pct": 1.0}
    assert got["run_queue_wait"] == {"VLLM::EngineCore": 0.1} and got["cpu_cores"] == {"VLLM::EngineCore": 1.0}


def test_toggle_load_switches_in_abba_pairs_and_rates_each_slot_by_the_servers_counter(server):
    """--only toggle: one load, the census switched every slot, pairs in ABBA order; each slot's tok/s is the
    server's counter between the reads after its switch took and at its end; when the server slows down in a
    mode (here: `events` doubles each answer's delay) the pairs say so."""
    port, seen, state = server
    state["delay_s"] = 0.01
    switched = []

    def switch(mode):
        switched.append(mode)
        state["delay_s"] = 0.02 if mode == "events" else 0.01
        return True
    res = asyncio.run(vllm_e2e.toggle_load(port, clients=4, ramp_s=0.2, seconds=2.5, slot_s=0.25, switch=switch,
                                           tokens=(3, 5), seed=3, order="abba"))
    slots = res["slots"]
    assert [s["mode"] for s in slots] == switched
    assert switched[:8] == ["off", "events", "events", "off", "off", "events", "events", "off"]
    assert len(slots) % 2 == 0 and len(slots) >= 6 and [s["pair"] for s in slots[:4]] == [0, 0, 1, 1]
    assert all(s["tokens"] > 0 and s["tok_s"] == pytest.approx(s["tokens"] / s["s"], rel=1e-3) for s in slots)
    got = vllm_e2e.toggle_pairs(slots)
    assert got["pairs"] == len(slots) // 2 and got["left_out"] == 0
    assert 0.35 < got["events/off"]["median"] < 0.75             # twice the delay: about half the rate
    assert got["events/off"]["gmean_95"][0] <= got["events/off"]["gmean"] <= got["events/off"]["gmean_95"][1]
    assert state["generated"] == sum(r["tokens"] for r in res["requests"])
    assert set(res["errors"]) <= {500}                           # the stand-in fails one prompt of the seed


def test_toggle_load_with_ticks_reads_the_counter_inside_each_slot(server):
    """--toggle-tick: each slot also keeps the server's counter every tick (its last mark is the slot's own
    reading), so toggle_pairs can say what spreads a slot (tick_noise) and rate it after it settles."""
    port, seen, state = server
    state["delay_s"] = 0.01
    res = asyncio.run(vllm_e2e.toggle_load(port, clients=4, ramp_s=0.2, seconds=2.0, slot_s=0.4, switch=lambda m: True,
                                           tokens=(3, 5), seed=3, tick_s=0.1))
    slots = res["slots"]
    assert len(slots) >= 4 and all(len(s["marks"]) >= 3 and s["marks"][-1] == [s["s"], s["tokens"]] for s in slots)
    assert all(0 <= a[1] <= b[1] for s in slots for a, b in zip(s["marks"], s["marks"][1:]))
    got = vllm_e2e.toggle_pairs(slots, settle_s=0.1)
    assert got["tick_noise"]["ticks"] >= 3 * len(slots) and got["settled"]["pairs"] == got["pairs"]


def test_toggle_pairs_leave_out_a_pair_whose_switch_did_not_take():
    def sl(pair, mode, tok_s, ok=True):
        return {"pair": pair, "mode": mode, "tok_s": tok_s, "switched": ok}
    slots = [sl(0, "off", 100.0), sl(0, "events", 99.0), sl(1, "events", 90.0), sl(1, "off", 100.0),
             sl(2, "off", 100.0), sl(2, "events", 50.0, ok=False), sl(3, "off", 200.0)]
    got = vllm_e2e.toggle_pairs(slots)
    assert got["pairs"] == 2 and got["left_out"] == 2
    assert got["events/off"]["all"] == [0.99, 0.9] and got["events/off"]["median"] == 0.945
    # each mode's slots, the kept pairs' only: off 100 and 100, events 99 and 90
    assert got["slot_cv"] == {"off": 0.0, "events": round(statistics.stdev([99.0, 90.0]) / 94.5, 4)}


@pytest.mark.parametrize("v, want", [("960,1088", (960, 1088)), ("64,64", (64, 64)), ("0,10", None),
                                     ("10,5", None), ("1,2000", None), ("a,b", None), ("100", None)])
def test_toggle_tokens_are_lo_hi_within_what_the_model_length_holds(v, want):
    import argparse
    if want:
        assert vllm_e2e.tokens_arg(v) == want
    else:
        with pytest.raises(argparse.ArgumentTypeError):
            vllm_e2e.tokens_arg(v)


def test_toggle_run_loads_r_alone_within_the_budget_and_stops_it(monkeypatch, tmp_path):
    """--only toggle: R warmed, its counter checked, one toggled load no longer than the budget leaves room for
    (the stop and the checks: 60 s), its pairs summarised, R stopped; a slot whose switch did not take fails."""
    import argparse
    sys.path.insert(0, str(REPO / "bench" / "server"))
    import control_phases
    asked = {}

    class FakePhases:
        def __init__(self, d):
            self.d = d

        def set(self, mode, timeout=10.0):
            return True
    monkeypatch.setattr(control_phases, "Phases", FakePhases)
    monkeypatch.setattr(vllm_e2e, "wait_quiet", lambda: 0.0)
    monkeypatch.setattr(vllm_e2e, "counter_readable", lambda port: True)

    async def fake_load(*a, **k):
        return {"requests": [], "errors": [], "tok_per_s": 1.0}
    monkeypatch.setattr(vllm_e2e, "load", fake_load)

    async def fake_toggle(port, clients, ramp_s, seconds, slot_s, switch, modes=("off", "events"), seed=0, root=None,
                          tokens=(64, 192), order="random", tick_s=0.0):
        asked.update(port=port, seconds=seconds, slot_s=slot_s, modes=modes, root=root, switch=switch, tokens=tokens,
                     order=order, seed=seed, tick_s=tick_s)
        slots = [{"pair": 0, "mode": "off", "tok_s": 100.0, "switched": True},
                 {"pair": 0, "mode": "events", "tok_s": 99.0, "switched": True},
                 {"pair": 1, "mode": "events", "tok_s": 98.0, "switched": False},
                 {"pair": 1, "mode": "off", "tok_s": 100.0, "switched": True}]
        return {"slots": slots, "requests": [{}] * 5, "errors": []}
    monkeypatch.setattr(vllm_e2e, "toggle_load", fake_toggle)
    stopped = []
    r = SimpleNamespace(port=8105, proc=SimpleNamespace(pid=4242), stop=lambda: stopped.append(1) or {"rc": 0})
    servers = {"R": r}
    monkeypatch.setattr(vllm_e2e, "T0", time.time() - 100)
    a = argparse.Namespace(phase_modes="off,events", phase_window=(1.0, 3.0), budget_s=400.0, toggle_s=600.0,
                           toggle_slot=2.0, phase_clients=8, toggle_tokens=(960, 1088), toggle_order="random",
                           toggle_seed=701, toggle_tick=0.5, toggle_settle=1.0)
    fails = len(vllm_e2e.FAILS)
    res = vllm_e2e.toggle_run(a, tmp_path, tmp_path, servers)
    assert 230 <= asked["seconds"] <= 240 and asked["slot_s"] == 2.0 and asked["root"] == 4242
    assert asked["modes"] == ("off", "events") and asked["switch"].__self__.d == tmp_path / "R"
    assert asked["tokens"] == (960, 1088) and "each request 960-1088 tokens" in res["load"]
    assert asked["order"] == "random" and "pairs in random order" in res["load"]
    assert asked["seed"] == 701 and asked["tick_s"] == 0.5
    assert res["pairs"] == 1 and res["left_out"] == 1 and res["events/off"]["median"] == 0.99
    assert stopped == [1] and "R" not in servers and res["requests"] == 5
    assert vllm_e2e.FAILS[fails:] == ["R: every slot switched the census"]
    del vllm_e2e.FAILS[fails:]
