"""The census on and off side by side on ONE llama-server, in alternating phases (bench/server/control_phases.py:
`off` paused, `events` counting as the default collector does, `on` the precise one) as --modes names them. Each
phase runs the same load shape with prompts of its own (no phase finds its prompts cached by another); the modes
rotate who goes first. Throughput ratios mode/off per round, with their median and spread, and the census's copies
per output token per mode (copies must not depend on the mode). --beside-plain loads a plain server after every
round, --beside-traced one tracing every kernel (the measured kernel time an estimate is checked against).

    python3 bench/server/llama_phases.py --server PATH --model M.gguf --out phases.json [--rounds 8] [--modes ...]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from control_phases import Phases, delta, phase_seed, run_rounds, summarise  # noqa: E402
from load import run_load  # noqa: E402
from run_server_bench import wait_health  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--n-predict", type=int, default=64)
    ap.add_argument("--port", type=int, default=8193)
    ap.add_argument("--modes", default="off,events",
                    help="census modes of control_phases.MODES, each a phase of every round")
    ap.add_argument("--flags", default="--cache-ram 0 --ctx-checkpoints 0",
                    help="llama-server flags beside -m -ngl 99 -np CLIENTS")
    ap.add_argument("--beside-plain", action="store_true",
                    help="also a plain llama-server (no census, on --port + 1), the same load after every round: "
                         "mode/plain says what the census costs against no census at all")
    ap.add_argument("--beside-traced", action="store_true",
                    help="also a llama-server under the activity census tracing every kernel (on --port + 2), the same "
                         "load after every round, alone on the GPU: each mode's kernel ns an output token / its "
                         "(`kt:MODE/traced`), the check of the default's estimated kernel time against the measured")
    ap.add_argument("--budget-s", type=float, default=float("inf"), help="no round starts that would end past this")
    ap.add_argument("--precise", action="store_true",
                    help="the census server under `run --precise` (default: run's own, the default collector)")
    a = ap.parse_args()
    t_start = time.time()
    census = Path(tempfile.mkdtemp(prefix="llama-phases-"))
    os.chmod(census, 0o700)
    url = f"http://127.0.0.1:{a.port}"

    def server(port):
        return [a.server, "-m", a.model, "-ngl", "99", "-np", str(a.clients), "-c", str(2048 * a.clients),
                "--host", "127.0.0.1", "--port", str(port), *a.flags.split()]
    cmd = [sys.executable, "-m", "otel_gpu_census.cli", "run", "--dir", str(census), "--exporter", "none",
           *(["--precise"] if a.precise else []), "--", *server(a.port)]
    log = open(Path(a.out).with_suffix(".server.log"), "w")
    procs = [subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)]
    logs = [log]
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(cmd), "rounds": []}
    plain_url = f"http://127.0.0.1:{a.port + 1}"
    if a.beside_plain:
        res["plain_command"] = " ".join(server(a.port + 1))
        logs.append(open(Path(a.out).with_suffix(".plain.log"), "w"))
        procs.append(subprocess.Popen(server(a.port + 1), stdout=logs[-1], stderr=subprocess.STDOUT,
                                      start_new_session=True))
    traced_url = f"http://127.0.0.1:{a.port + 2}"
    traced = Path(tempfile.mkdtemp(prefix="llama-traced-"))
    if a.beside_traced:
        os.chmod(traced, 0o700)
        tcmd = [*cmd[:4], "--dir", str(traced), "--exporter", "none", "--precise", "--", *server(a.port + 2)]
        res["traced_command"] = " ".join(tcmd)
        logs.append(open(Path(a.out).with_suffix(".traced.log"), "w"))
        procs.append(subprocess.Popen(tcmd, stdout=logs[-1], stderr=subprocess.STDOUT, start_new_session=True))
    try:
        urls = [url] + [plain_url] * a.beside_plain + [traced_url] * a.beside_traced
        for u, p in zip(urls, procs):
            if wait_health(u, p, 300) is None:
                res["error"] = f"llama-server at {u} did not come up"
                return 1
            run_load(u, a.clients, a.clients, n_predict=16, seed=999)        # warm-up (and the segment)
        time.sleep(1.5)
        ph = Phases(census)
        tr = Phases(traced)
        if a.beside_traced and not tr.set("events"):       # on: the traced server runs `run --precise`
            res["error"] = "the traced server's census did not switch to every kernel"
            return 1

        modes = a.modes.split(",")

        def one(mode, i):
            # fresh prompts every phase: with one seed a round, the phases after the first would find their
            # prompts already in the slots (llama-server reuses a slot's matching prefix even with
            # --cache-ram 0) and skip their prefill
            ld = run_load(url, a.clients, a.requests, n_predict=a.n_predict, seed=phase_seed(100, i, mode, modes))
            return {"tok_s": ld.get("output_tok_s"), "steady_tok_s": ld.get("steady_tok_s"),
                    "tokens": ld.get("output_tokens"), "errors": ld.get("errors"), "ttft_p50_s": ld.get("ttft_p50_s")}

        def plain(rnd):       # the plain server after each round, its prompts its own too
            ld = run_load(plain_url, a.clients, a.requests, n_predict=a.n_predict,
                          seed=phase_seed(100, len(res["rounds"]), "plain", modes))
            rnd["plain"] = {"tok_s": ld.get("output_tok_s"), "tokens": ld.get("output_tokens"),
                            "errors": ld.get("errors"), "ttft_p50_s": ld.get("ttft_p50_s")}
            for m in modes:
                if rnd[m].get("tok_s") and rnd["plain"]["tok_s"]:
                    rnd[f"{m}/plain"] = round(rnd[m]["tok_s"] / rnd["plain"]["tok_s"], 4)
            res["rounds"].append(rnd)
            print("plain", {k: v for k, v in rnd.items() if k.endswith("/plain")}, flush=True)
        def measured(rnd):    # the every-kernel server after each round, alone on the GPU, prompts its own
            before = tr.totals()
            ld = run_load(traced_url, a.clients, a.requests, n_predict=a.n_predict,
                          seed=phase_seed(100, len(res["rounds"]), "traced", modes) + 7)
            time.sleep(1.5)     # the flusher's period: the load's records into the totals
            rnd["traced"] = {"tok_s": ld.get("output_tok_s"), "tokens": ld.get("output_tokens"), "switched": True,
                             "errors": ld.get("errors"), "census": delta(tr.totals(), before)}
            t = rnd["traced"]
            for m in modes:
                c = rnd[m]["census"]
                if m != "off" and c.get("kernel_time_ns") and t["census"].get("kernel_time_ns") \
                        and rnd[m].get("tokens") and t["tokens"]:
                    rnd[f"kt:{m}/traced"] = round(c["kernel_time_ns"] / rnd[m]["tokens"]
                                                  / (t["census"]["kernel_time_ns"] / t["tokens"]), 4)
            print("traced", {k: v for k, v in rnd.items() if k.startswith("kt:")}, flush=True)

        def after(rnd):
            if a.beside_traced:
                measured(rnd)
            if a.beside_plain:
                plain(rnd)      # appends the round to res["rounds"]
            else:
                res["rounds"].append(rnd)
        res["rounds"] = run_rounds(ph, a.rounds, one, modes=modes, after=after, deadline=t_start + a.budget_s)
        res.update(summarise(res["rounds"], modes=modes))
        if a.beside_traced:     # the measured server's figures an output token, beside each mode's
            res["per_output_token"]["traced"] = summarise(
                [{"traced": x["traced"]} for x in res["rounds"]], modes=["traced"])["per_output_token"]["traced"]
        return 0
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
        for f in logs:
            f.close()
        Path(a.out).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
