#!/usr/bin/env python3
"""Load-to-load spread of load.py's two shapes, free and waves, on ONE llama-server stand-in (CPU).

  .venv/bin/python bench/tests/compare_load_modes.py [--loads 10] [--jitter 0,0.1,0.2] [--out f.json]

For every --jitter J it starts bench/tests/fake_llama_server.py with FAKE_TOKEN_JITTER=J (each
request's token delay FAKE_TOKEN_DELAY x (1 + J u), u in [-1, 1] drawn from the request's seed), runs
--loads pairs of loads on it, free and waves in ABBA order, the two loads of a pair with the same
seeds (the same requests, so the same request lengths, in the two shapes), and prints each shape's
tok/s, mean and coefficient of variation across its loads (and, for waves, the median CV across the
waves of a load). The stand-in streams every request on its own (no batching), so J is the only
thing that makes request lengths differ; J = 0 shows the harness's own noise. "model CV" is what the
seeded delays alone give, no server: every request (n_predict - 1) delays long, the free loop's wall
the time its busiest client ends, a waves load's the sum of its waves' longest requests.
"""
from __future__ import annotations

import argparse
import heapq
import json
import random
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "server"))
import benchlib as bl  # noqa: E402
import load  # noqa: E402


def start_standin(tokens: int, delay: float, jitter: float) -> tuple:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, FAKE_TOKENS=str(tokens), FAKE_TOKEN_DELAY=str(delay), FAKE_TOKEN_JITTER=str(jitter))
    p = subprocess.Popen([sys.executable, str(HERE / "fake_llama_server.py"), "--port", str(port)], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1):
                return p, url
        except OSError:
            if p.poll() is not None or time.monotonic() > deadline:
                p.kill()
                raise SystemExit(f"stand-in did not start: {p.stderr.read().decode()[-500:]}")
            time.sleep(0.05)


def model_tok_s(mode: str, seed: int, a: argparse.Namespace, jitter: float) -> float:
    """A load's tok/s from the stand-in's seeded token delays alone (fake_llama_server.py's paced mode)."""
    d = [(a.n_predict - 1) * a.token_delay * (1 + jitter * random.Random(seed + i).uniform(-1, 1))
         for i in range(a.requests)]
    if mode == "waves":
        wall = sum(max(d[w:w + a.clients]) for w in range(0, a.requests, a.clients))
    else:   # each request goes to the client that is free first
        free = [0.0] * a.clients
        for x in d:
            heapq.heappush(free, heapq.heappop(free) + x)
        wall = max(free)
    return a.requests * a.n_predict / wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loads", type=int, default=10, help="loads of each shape (default 10)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--n-predict", type=int, default=64)
    ap.add_argument("--token-delay", type=float, default=0.01, help="the stand-in's seconds between tokens")
    ap.add_argument("--jitter", default="0,0.1,0.2", help="FAKE_TOKEN_JITTER values, comma-separated")
    ap.add_argument("--out", help="write every load's figures here (JSON)")
    a = ap.parse_args()
    try:
        jitters = [float(x) for x in a.jitter.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--jitter {a.jitter!r}: want numbers, e.g. 0,0.1")
    if not jitters or any(not 0 <= j < 1 for j in jitters):
        ap.error("--jitter: each value in [0, 1)")
    if a.loads < 2 or a.clients < 1 or a.requests % a.clients or a.token_delay <= 0:
        ap.error("--loads >= 2, --requests a multiple of --clients, --token-delay > 0")
    print(f"{a.loads} loads of each shape per jitter, ABBA; {a.requests} requests, {a.clients} clients, "
          f"{a.n_predict} tokens {a.token_delay * 1000:g} ms apart")
    print(f"{'jitter':>6} {'shape':<6} {'mean tok/s':>10} {'CV':>8} {'model CV':>9} {'wave CV':>8}  tok/s of the loads")
    report = {"config": vars(a), "runs": []}
    for j in jitters:
        p, url = start_standin(a.n_predict, a.token_delay, j)
        try:
            got = {"free": [], "waves": []}
            for k in range(a.loads):
                for mode in (("free", "waves") if k % 4 in (0, 3) else ("waves", "free")):
                    res = load.run_load(url, a.clients, a.requests, prompt_tokens=16, n_predict=a.n_predict,
                                        seed=1000 * (k + 1), request_timeout_s=60, total_timeout_s=300,
                                        waves=mode == "waves")
                    if res["ok"] != res["requests"]:
                        raise SystemExit(f"load failed: {res['first_errors']}")
                    got[mode].append({k2: res.get(k2) for k2 in ("output_tok_s", "wall_s", "wave_tok_s_cv",
                                                                  "steady_tok_s")})
        finally:
            p.terminate()
            p.wait(10)
        for mode, loads in got.items():
            tps = [x["output_tok_s"] for x in loads]
            wcv = bl.median(x["wave_tok_s_cv"] for x in loads)
            model = bl.cv(model_tok_s(mode, 1000 * (k + 1), a, j) for k in range(a.loads))
            row = {"jitter": j, "shape": mode, "mean_tok_s": round(statistics.mean(tps), 1), "cv": bl.cv(tps),
                   "model_cv": model, "steady_cv": bl.cv(x["steady_tok_s"] for x in loads),
                   "wave_cv_median": bl.rnd(wcv), "loads": loads}
            report["runs"].append(row)
            print(f"{j:>6g} {mode:<6} {row['mean_tok_s']:>10.1f} {row['cv']:>8.4f} "
                  f"{'' if model is None else f'{model:.4f}':>9} "
                  f"{'' if wcv is None else f'{wcv:.4f}':>8}  {[round(t) for t in tps]}")
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
