"""The census switched off / on every few seconds inside ONE load of ONE llama-server (bench/server/toggle_slots.py).

llama_phases.py gives each mode its own load of a few seconds (ramp, tail, which prompts meet): ±5 % a round on
the GPU machine, so 11 rounds left the census's cost inside ±1.3 %. Here the same load shape (closed-loop clients,
one slot each, distinct prompts of --prompt-tokens ids, --n-predict tokens, ignore_eos) runs on, and the census is
switched through its control file every --slot seconds, pairs in random order (--order). Each request asks for
--n-predict tokens, or a number drawn in LO..HI, which keeps the clients out of step. A slot is rated by the tokens
the clients received over it, counted from each event's `tokens_predicted` (exact when llama-server merges tokens
into one event, or holds the last ones back for its final event), between the switch having taken and the slot's
end. The server runs with OTEL_GPU_CENSUS_FLUSH_MS=200 so that a switch takes within ~0.2 s.

    python3 bench/server/llama_toggle.py --server PATH --model M.gguf --out toggle.json [--seconds 300] [--slot 3]

Checks (in the JSON's `checks`; exit 1 if one fails): every slot switched; no request failed; the tokens counted
equal llama-server's own `predicted_n` of every request that ended, and each is what it asked for. With --tick, each
slot keeps its count every tick, and the pairs are rated again leaving out each slot's first --settle seconds.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from control_phases import Phases  # noqa: E402
from load import prompt_ids, run_load  # noqa: E402
from run_server_bench import wait_health  # noqa: E402
from toggle_slots import ORDERS, toggle_pairs, toggle_slots, toggle_summary  # noqa: E402


class StreamLoop:
    """`clients` closed-loop streaming /completion clients while the block runs (each sends its next request once
    its last has ended; every prompt distinct). `n` is the tokens received so far, from each event's running
    `tokens_predicted`; mark() reads it (and when). On leaving, no new request is sent and the ones in flight end."""

    def __init__(self, url, clients, prompt_tokens, n_predict, seed, timeout_s=300.0):
        # n_predict: an int, or (lo, hi): request i's drawn from random.Random(seed * 7919 + i)
        self.url, self.clients, self.prompt_tokens, self.n_predict = url, clients, prompt_tokens, n_predict
        self.seed, self.timeout_s = seed, timeout_s
        self.n = 0
        self.results: list = []     # per ended request: the tokens counted and llama-server's own predicted_n
        self.errors: list = []
        self._next = itertools.count()
        self._stop = asyncio.Event()

    async def _one(self, i):
        n_predict = (self.n_predict if isinstance(self.n_predict, int)
                     else random.Random(self.seed * 7919 + i).randint(*self.n_predict))
        body = {"prompt": prompt_ids(self.seed, i, self.prompt_tokens), "n_predict": n_predict,
                "stream": True, "ignore_eos": True, "seed": self.seed + i}
        got, predicted = 0, None
        try:
            async with self._s.post(self.url + "/completion", json=body,
                                    timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as r:
                if r.status != 200:
                    self.errors.append(f"HTTP {r.status}")
                    return
                async for raw in r.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    ev = json.loads(line[5:])
                    # one event may carry several tokens: llama-server holds back an incomplete UTF-8 sequence
                    # and sends it with the next token, or only in the final (stop) event when it ends the answer
                    k = int(ev.get("tokens_predicted") or got + (not ev.get("stop")))
                    self.n += k - got
                    got = k
                    if ev.get("stop"):
                        predicted = (ev.get("timings") or {}).get("predicted_n")
                        break
        except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, ValueError) as e:
            self.errors.append(f"{type(e).__name__}: {e}"[:200])
            return
        self.results.append({"tokens": got, "predicted_n": predicted, "asked": n_predict})

    async def _client(self):
        while not self._stop.is_set():
            await self._one(next(self._next))

    async def mark(self):
        return self.n, time.perf_counter()

    async def __aenter__(self):
        # force_close: llama-server may close a connection after a streamed answer (load.py does the same)
        self._s = await aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.clients,
                                                                              force_close=True)).__aenter__()
        self._tasks = [asyncio.create_task(self._client()) for _ in range(self.clients)]
        return self

    async def __aexit__(self, *exc):
        self._stop.set()
        try:
            await asyncio.gather(*self._tasks)
        finally:
            await self._s.__aexit__(*exc)


async def toggle_load(url, clients, prompt_tokens, n_predict, ramp_s, seconds, slot_s, switch,
                      modes=("off", "events"), seed=0, root=None, order="random", tick_s=0.0) -> dict:
    async with StreamLoop(url, clients, prompt_tokens, n_predict, seed) as sl:
        await asyncio.sleep(ramp_s)
        slots = await toggle_slots(sl, seconds, slot_s, switch, modes, root=root, order=order, seed=seed,
                                   tick_s=tick_s)
    return {"slots": slots, "requests": sl.results, "errors": sl.errors, "tokens": sl.n}


def checks(res: dict) -> list:
    """What must hold of a toggled load, as (ok, what)."""
    req = res["requests"]
    bad = [r for r in req if not r["tokens"] == r["predicted_n"] == r["asked"]]
    return [(all(s["switched"] for s in res["slots"]), "every slot switched the census"),
            (not res["errors"], f"no request failed ({len(res['errors'])})"),
            (not bad, f"every request's tokens counted = its predicted_n = the tokens it asked for ({len(req)} requests"
                      + (f"; {len(bad)} not, the first {bad[0]})" if bad else ")"))]


def n_predict_arg(v: str):
    """--n-predict N or LO,HI: 1 <= LO <= HI."""
    try:
        x = [int(t) for t in v.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"N or LO,HI of whole numbers, not {v!r}") from None
    if len(x) == 1 and x[0] >= 1:
        return x[0]
    if len(x) == 2 and 1 <= x[0] <= x[1]:
        return x[0], x[1]
    raise argparse.ArgumentTypeError(f"N >= 1 or 1 <= LO <= HI, not {v!r}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=1800)
    ap.add_argument("--n-predict", type=n_predict_arg, default=64, metavar="N|LO,HI",
                    help="tokens a request asks for, or drawn uniformly in LO..HI per request")
    ap.add_argument("--order", choices=ORDERS, default="random",
                    help="each pair's order drawn at random (seeded), or alternating (ABBA)")
    ap.add_argument("--tick", type=float, default=0.0, help="seconds between a slot's own marks (0: none)")
    ap.add_argument("--settle", type=float, default=0.0,
                    help="with --tick: also rate the pairs leaving out each slot's first SETTLE seconds")
    ap.add_argument("--seconds", type=float, default=300.0, help="how long the census is toggled")
    ap.add_argument("--slot", type=float, default=3.0, help="seconds a slot")
    ap.add_argument("--ramp", type=float, default=10.0, help="seconds of load before the first slot")
    ap.add_argument("--modes", default="off,events", help="two modes of control_phases.MODES")
    ap.add_argument("--port", type=int, default=8196)
    ap.add_argument("--flags", default="--cache-ram 0 --ctx-checkpoints 0",
                    help="llama-server flags beside -m -ngl 99 -np CLIENTS")
    ap.add_argument("--precise", action="store_true",
                    help="the census server under `run --precise` (default: run's own, the default collector)")
    ap.add_argument("--pin", default="", metavar="CPUS", help="taskset -c CPUS for the server (and its census)")
    ap.add_argument("--budget-s", type=float, default=float("inf"), help="the whole run, start to stop")
    a = ap.parse_args(argv)
    modes = tuple(a.modes.split(","))
    if len(modes) != 2:
        ap.error("--modes: two modes")
    t_start = time.time()
    census = Path(tempfile.mkdtemp(prefix="llama-toggle-"))
    os.chmod(census, 0o700)
    url = f"http://127.0.0.1:{a.port}"
    server = [a.server, "-m", a.model, "-ngl", "99", "-np", str(a.clients), "-c", str(2048 * a.clients),
              "--host", "127.0.0.1", "--port", str(a.port), *a.flags.split()]
    cmd = [sys.executable, "-m", "otel_gpu_census.cli", "run", "--dir", str(census), "--exporter", "none",
           *(["--precise"] if a.precise else []), "--", *server]
    if a.pin:
        cmd = ["taskset", "-c", a.pin, *cmd]
    env = dict(os.environ, OTEL_GPU_CENSUS_FLUSH_MS="200")
    log = open(Path(a.out).with_suffix(".server.log"), "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(cmd), "modes": modes}
    rc = 1
    try:
        up = wait_health(url, proc, 300)
        if up is None:
            res["error"] = f"llama-server at {url} did not come up"
            return 1
        res["ready_s"] = round(up, 1)
        run_load(url, a.clients, a.clients, n_predict=16, seed=999)        # warm-up (and the segment)
        time.sleep(1.5)
        ph = Phases(census)
        seconds = max(min(a.seconds, a.budget_s - (time.time() - t_start) - a.ramp - 30), 4 * a.slot)
        got = asyncio.run(toggle_load(url, a.clients, a.prompt_tokens, a.n_predict, a.ramp, seconds, a.slot, ph.set,
                                      modes=modes, seed=random.Random(a.port).randrange(1 << 20), root=proc.pid,
                                      order=a.order, tick_s=a.tick))
        asked = a.n_predict if isinstance(a.n_predict, int) else "%d-%d" % a.n_predict
        res.update(load=f"{a.clients} closed-loop streaming clients, prompts of {a.prompt_tokens} distinct token "
                        f"ids, {asked} tokens each (ignore_eos), {a.ramp} s of ramp, then {seconds:.0f} s with "
                        f"the census switched {'/'.join(modes)} every {a.slot} s, pairs in {a.order} order",
                   order=a.order, n_predict=asked,
                   slots=got["slots"], requests=len(got["requests"]), errors=got["errors"][:20], tokens=got["tokens"],
                   **toggle_pairs(got["slots"], modes, settle_s=a.settle))
        time.sleep(0.5)
        res["census"] = ph.totals()
        res["checks"] = [{"ok": ok, "what": w} for ok, w in checks(got)]
        for c in res["checks"]:
            print(("ok   " if c["ok"] else "FAIL ") + c["what"], flush=True)
        print("toggle", toggle_summary(res), flush=True)
        rc = 0 if all(c["ok"] for c in res["checks"]) else 1
        return rc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        log.close()
        res["wall_s"] = round(time.time() - t_start, 1)
        Path(a.out).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
