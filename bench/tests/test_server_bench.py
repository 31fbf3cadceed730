"""CPU tests of the server benchmark: token-time encoding, the steady-state window, pair ratios,
variant environments, and run_server_bench.py end to end (restart and --proxy-pairs modes) against
a llama-server stand-in. Run: .venv/bin/python -m pytest -q bench/tests
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1]
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH / "server"))
import benchlib as bl  # noqa: E402
import load  # noqa: E402
import micro  # noqa: E402
import run_server_bench as rsb  # noqa: E402


def test_token_times_round_trip_within_half_a_millisecond():
    rng = random.Random(3)
    t0 = 1000.0
    ts = sorted(t0 + rng.uniform(0, 30) for _ in range(500))
    s = load.encode_times(ts, t0)
    back = load.decode_times(s)
    assert len(back) == len(ts)
    assert max(abs(b - (t - t0)) for b, t in zip(back, ts)) <= 0.0005 + 1e-9
    assert len(s) < 6 * len(ts)          # compact: a few characters an event
    assert load.decode_times("") == [] and load.encode_times([], t0) == ""


def req(client, start, end, ev):
    return {"client": client, "start": start, "end": end, "ev": load.encode_times(ev, 0.0)}


def test_steady_state_counts_tokens_while_every_client_is_busy():
    # Two clients, two requests each. The last first-wave first token is at 1.5 s (client 1); the
    # first client to finish its last request is client 0 at 2.8 s. Tokens in (1.5, 2.8]:
    # A 1.6 1.8 | B 1.7 1.9 2.1 | C 2.3 2.5 2.7 | D 2.6 2.8  -> 10 tokens in 1.3 s.
    rs = [req(0, 0.0, 1.9, [1.0, 1.2, 1.4, 1.6, 1.8]), req(1, 0.0, 2.2, [1.5, 1.7, 1.9, 2.1]),
          req(0, 1.9, 2.8, [2.3, 2.5, 2.7]), req(1, 2.2, 3.3, [2.6, 2.8, 3.0, 3.2])]
    st = load.steady_state(rs)
    assert (st["steady_from_s"], st["steady_to_s"], st["steady_tokens"]) == (1.5, 2.8, 10)
    assert st["steady_tok_s"] == round(10 / 1.3, 2)


def test_steady_state_is_none_without_a_busy_window():
    one_wave = [req(0, 0.0, 1.2, [1.0, 1.1]), req(1, 0.0, 2.0, [1.5, 1.9])]   # client 0 done before 1 starts
    st = load.steady_state(one_wave)
    assert st["steady_tok_s"] is None and "too few" in st["steady_why"]
    no_token = [req(0, 0.0, 1.0, []), req(1, 0.0, 2.0, [1.5]), req(1, 2.0, 3.0, [2.5])]
    assert load.steady_state(no_token)["steady_tok_s"] is None


def test_summary_of_a_load_has_both_throughputs():
    rs = [dict(req(c, 0.0, 0.0, []), i=c, ttft_s=0.1, e2e_s=1.0, tokens_out=4) for c in range(2)]
    for r in rs:   # summarise takes monotonic times and "times"; build them from the same schedule
        r["start"], r["end"] = 100.0, 101.0 + r["client"] * 0.5
        r["times"] = [100.1 + 0.2 * k + r["client"] * 0.05 for k in range(4)]
        del r["ev"]
    rs += [{"i": 2 + c, "client": c, "start": 101.0 + c * 0.5, "end": 102.0 + c * 0.1, "ttft_s": 0.1,
            "e2e_s": 1.0, "tokens_out": 4, "times": [101.2 + c * 0.5 + 0.1 * k for k in range(4)]} for c in range(2)]
    s = load.summarise(rs)
    assert s["output_tok_s"] == round(16 / 2.1, 2)
    assert s["steady_tok_s"] is not None and s["steady_from_s"] == pytest.approx(0.15)
    assert all(isinstance(r["ev"], str) and "times" not in r for r in s["per_request"])


def test_compare_gives_median_ratios_spreads_and_the_target():
    pairs = [({"output_tok_s": 100, "steady_tok_s": 110}, {"output_tok_s": 99, "steady_tok_s": 110}),
             ({"output_tok_s": 100, "steady_tok_s": 100}, {"output_tok_s": 95, "steady_tok_s": 98}),
             ({"output_tok_s": 100, "steady_tok_s": None}, {"output_tok_s": 101, "steady_tok_s": 100})]
    c = rsb.compare(pairs)
    assert c["ratio"] == 0.99 and c["ratio_spread"] == 0.06 and c["target_ratio_ge_0_99"] is True
    assert c["steady_pair_ratios"] == [1.0, 0.98] and c["steady_ratio"] == 0.99
    assert rsb.compare(pairs[1:2])["target_ratio_ge_0_99"] is False


def test_micro_census_is_set_against_the_floor_with_the_target():
    a = argparse.Namespace(variants="plain,floor,census", variant=None, floor_kinds="kernel",
                           workloads=["eager"], eager_n=1000)
    v = micro.parse_variants(a, bl.Log())
    assert v["census"] == {"base": "census", "env": {}, "floor": "floor"}
    t = {"plain": 1.0, "floor": 1.2, "census": 1.25}
    runs = [{"round": k, "variant": n, "launches": {"eager": 1}, "eager_s": [t[n]]} for k in range(2) for n in v]
    rows = {r["variant"]: r for r in micro.summarise(a, runs, v)}
    assert rows["census"]["above_floor_pct"] == pytest.approx(100 * (1.25 / 1.2 - 1), abs=0.01)
    assert rows["census"]["target_above_floor_le_10pct"] is True and rows["census"]["overhead_vs_floor"] == 1.25


# ---- end to end against the stand-in --------------------------------------------------------------

def free_port_pair() -> int:
    """A port p with p and p+1 free (the server and its proxy)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        try:
            with socket.socket() as s2:
                s2.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    pytest.skip("no two adjacent free ports")


@pytest.fixture()
def fake(tmp_path, monkeypatch):
    lib = bl.census_lib()
    if not lib.is_file():
        pytest.skip(f"no native library at {lib} (make -C native): the proxy needs it")
    # the bench runs with the checkout's src/ first on its path, where no library is: name this one
    monkeypatch.setenv("OTEL_GPU_CENSUS_LIB", str(lib))
    server = tmp_path / "llama-server"
    server.write_text(f"#!/bin/sh\nexec {sys.executable} {BENCH / 'tests' / 'fake_llama_server.py'} \"$@\"\n")
    server.chmod(0o755)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    return server, model


def run_bench(args, tmp_path, timeout=120):
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    env.pop("CUDA_INJECTION64_PATH", None)
    return subprocess.run([sys.executable, str(BENCH / "server" / "run_server_bench.py")] + args,
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("mode", ["free", "waves"])
def test_proxy_pairs_on_one_server(fake, tmp_path, mode):
    server, model = fake
    out = tmp_path / "pp.json"
    d = run_bench(["--server", str(server), "--model", str(model), "--out", str(out), "--proxy-pairs", "2",
                   "--flag-sets", "nocache", "--requests", "8", "--clients", "4", "--prompt-tokens", "16",
                   "--n-predict", "16", "--warmup-requests", "4", "--gap-s", "0.2", "--census-mode", "env",
                   "--load-mode", mode, "--port", str(free_port_pair())], tmp_path)
    assert d.returncode == 0, d.stdout[-2000:] + d.stderr[-2000:]
    res = json.loads(out.read_text())
    (row,) = res["rows"]
    assert row["variant"] == "census+proxy" and row["reference"] == "direct" and row["pairs"] == 2
    assert row["census"] > 0 and row["plain"] > 0 and len(row["pair_ratios"]) == 2
    assert row["steady_tok_s"] and row["plain_steady_tok_s"]
    (session,) = res["runs"]
    assert [(x["pair"], x["via"]) for x in session["loads"]] == [(0, "direct"), (0, "proxy"), (1, "proxy"), (1, "direct")]
    assert session["warmup"]["ok"] == 4 and session["stop"]["how"] == "SIGTERM"
    # the proxy's event-loop lag probe (on by default here), read per load, direct loads too
    assert all(x["loop_lag"]["wakeups"] > 0 and "p99_ms" in x["loop_lag"] for x in session["loads"])
    assert row["loop_lag_proxy_loads"]["loads"] == row["loop_lag_direct_loads"]["loads"] == 2
    assert all(len(load.decode_times(r["ev"])) == 16 for x in session["loads"] for r in x["per_request"])
    assert res["variant_env"] == {"census": {}, "census+proxy": {}}
    assert res["load_mode"] == res["config"]["load_mode"] == mode
    assert all(x["load"]["load_mode"] == mode for x in session["loads"])
    if mode == "free":
        assert "wave_tok_s_cv" not in row and all("wave" not in r for x in session["loads"] for r in x["per_request"])
        return
    for x in session["loads"]:   # two waves of four, one after the other
        ld, per = x["load"], x["per_request"]
        assert [w["requests"] for w in ld["waves"]] == [4, 4] and ld["waves"][1]["start"] >= ld["waves"][0]["end"]
        assert sorted(r["wave"] for r in per) == [0] * 4 + [1] * 4
        assert ld["output_tok_s"] == pytest.approx(8 * 16 / sum(w["wall_s"] for w in ld["waves"]), rel=2e-3)
    loads = {via: [x["load"] for x in session["loads"] if x["via"] == via] for via in ("direct", "proxy")}
    assert row["wave_tok_s_cvs"] == [ld["wave_tok_s_cv"] for ld in loads["proxy"]]
    assert row["plain_wave_tok_s_cvs"] == [ld["wave_tok_s_cv"] for ld in loads["direct"]]
    assert row["per_pair"][0]["direct"]["wave_tok_s_cv"] == loads["direct"][0]["wave_tok_s_cv"]


def test_restart_mode_records_each_variants_environment(fake, tmp_path):
    server, model = fake
    out = tmp_path / "rr.json"
    d = run_bench(["--server", str(server), "--model", str(model), "--out", str(out), "--rounds", "2",
                   "--variants", "plain,census", "--server-env", "OTEL_GPU_CENSUS_EVENT_EVERY=x",
                   "--flag-sets", "default", "--requests", "8", "--clients", "4", "--prompt-tokens", "16",
                   "--n-predict", "8", "--warmup-requests", "0", "--census-mode", "env",
                   "--port", str(free_port_pair())], tmp_path)
    assert d.returncode == 0, d.stdout[-2000:] + d.stderr[-2000:]
    res = json.loads(out.read_text())
    assert [r["variant"] for r in res["runs"]] == ["plain", "census", "census", "plain"]
    said = {r["variant"]: (tmp_path / "server-work" / r["server_log"]).read_text().split("fake-llama-server: ")[1].split()
            for r in res["runs"]}     # what each server process was started with
    assert said == {"plain": ["OTEL_GPU_CENSUS_EVENT_EVERY=x", "CUDA_INJECTION64_PATH=(unset)"],   # --server-env: every server
                    "census": ["OTEL_GPU_CENSUS_EVENT_EVERY=x", "CUDA_INJECTION64_PATH=set"]}
    rows = {r["variant"]: r for r in res["rows"]}
    assert rows["census"]["pairs"] == 2 and "steady_ratio" in rows["census"]


def test_bad_options_are_refused_without_a_traceback(tmp_path):
    d = run_bench(["--server", "x", "--model", "y", "--variants", "plain,census-sampled"], tmp_path)
    assert d.returncode == 2 and "census-sampled" in d.stderr and "Traceback" not in d.stderr
    d = run_bench(["--server", "x", "--model", "y", "--server-env", "NOEQUALS"], tmp_path)
    assert d.returncode == 2 and "K=V" in d.stderr and "Traceback" not in d.stderr
    d = run_bench(["--server", "x", "--model", "y", "--load-mode", "waves", "--requests", "40"], tmp_path)
    assert d.returncode == 2 and "multiple of --clients" in d.stderr and "Traceback" not in d.stderr
