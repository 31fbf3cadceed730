"""Per request, what the tracing proxy adds at the START and at the END of an answer, seen from the
upstream's side of the wire (not a pytest test: run it).

    .venv/bin/python bench/perf/proxy_gaps.py --server LLAMA_SERVER --model GGUF [--server-args "..."]
        [--pairs 3] [--clients 16] [--requests 64] [--prompt-tokens 256] [--n-predict 64]
        [--proxy-src DIR] [--also-src DIR] [--no-census] [--proxy-args "..."] [--json FILE]

A timestamping TCP relay (this file, `--_relay`) sits in front of llama-server; the direct loads and
the proxy both go through it, so its own cost (~0.1 ms a hop) is on both sides. Per connection it
records, on the machine-wide monotonic clock: the request's first byte from the client side (the load
or the proxy), the read that carried the `"seed"` of its body (which request it is), the upstream's first byte, the chunk
with the final event (`"stop":true`), the chunked terminator, and who closed first. The load is
bench/server/load.py's client (the one `run_server_bench.py --proxy-pairs` uses): closed loop,
`--clients` streaming /completion requests, each ended at its final event; it records each request's
send and end times on the same clock. Per request:

  start_added  the load sending the request -> the request reaching llama-server (the relay's read
               that carried its body's seed)
  end_added    llama-server sending the final event -> the load having read it (its end)
  slot_gap     llama-server sending a client's final event -> the same client's next request reaching
               it (the slot's idle time between two requests of one client)

and per load: output tok/s, llama-server's own decode step (its `predicted_ms` over the tokens after
the first: a proxy that slows the server itself shows here), the share of slot time busy (final event
sent minus request received, summed, over clients x wall) and each process's CPU seconds.

Direct and proxied loads alternate (order swapped every pair; with --also-src, a second proxy from
another src/ folder takes its turn too). Prints the medians and p90s of each, per target, and the
throughput. `--proxy-src DIR`: the first proxy from another checkout's src/.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SUPPORT = ROOT / "tests" / "support"
sys.path.insert(0, str(SUPPORT))
sys.path.insert(0, str(ROOT / "bench" / "server"))
sys.path.insert(0, str(HERE))

from llama_cpu import stop  # noqa: E402  (tests/support: terminate, then kill after 10 s)
from ports import free_port  # noqa: E402

SEED_RE = re.compile(rb'"seed"\s*:\s*(\d+)')


# ---- the relay (child process) -----------------------------------------------------------------

async def _relay_main(listen_port: int, upstream_port: int, log_path: str) -> None:
    log = open(log_path, "a", buffering=1)

    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        rec = {"accept": time.monotonic()}
        try:
            ur, uw = await asyncio.open_connection("127.0.0.1", upstream_port)
        except OSError:
            cw.close()
            return
        rec["up_connected"] = time.monotonic()

        async def c2u() -> None:
            head = b""
            while True:
                data = await cr.read(65536)
                now = time.monotonic()
                if not data:
                    rec.setdefault("client_eof", now)
                    try:
                        uw.write_eof()
                    except OSError:
                        pass
                    return
                rec.setdefault("req_first", now)
                if "seed" not in rec and len(head) < 1 << 20:
                    head += data
                    m = SEED_RE.search(head)
                    if m:
                        rec["seed"] = int(m.group(1))
                        rec["req_seen"] = now
                rec["req_last"] = now
                uw.write(data)
                await uw.drain()

        async def u2c() -> None:
            tail = b""
            while True:
                data = await ur.read(65536)
                now = time.monotonic()
                if not data:
                    rec.setdefault("up_eof", now)
                    try:
                        cw.write_eof()
                    except OSError:
                        pass
                    return
                rec.setdefault("resp_first", now)
                both = tail + data
                if "stop" not in rec and b'"stop":true' in both:
                    rec["stop"] = now
                if b"\r\n0\r\n\r\n" in both or both.startswith(b"0\r\n\r\n"):
                    rec.setdefault("term", now)
                tail = both[-16:]
                cw.write(data)
                await cw.drain()

        tasks = [asyncio.ensure_future(c2u()), asyncio.ensure_future(u2c())]
        try:
            # both directions to their end; a reset on one ends the other
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()
                elif not t.cancelled():
                    t.exception()          # retrieved: a reset is part of the traffic, not an error here
            rec["closed"] = time.monotonic()
            for w in (cw, uw):
                w.close()
            log.write(json.dumps(rec) + "\n")

    srv = await asyncio.start_server(handle, "127.0.0.1", listen_port, backlog=256)
    print("ready", flush=True)
    async with srv:
        await srv.serve_forever()


# ---- the load ----------------------------------------------------------------------------------

async def _load(url: str, clients: int, requests: int, prompt_tokens: int, n_predict: int, seed: int):
    """load.py's free mode, keeping each request's absolute monotonic start and end."""
    import aiohttp
    import load as ld
    queue = list(range(requests))
    out = []

    async def worker(client: int, session) -> None:
        while queue:
            i = queue.pop(0)
            body = {"prompt": ld.prompt_ids(seed, i, prompt_tokens), "n_predict": n_predict, "stream": True,
                    "ignore_eos": True, "seed": seed * 100_000 + i}
            r = await ld.one_request(session, url, body, 120)
            out.append({"client": client, "seed": body["seed"], "start": r["start"], "end": r["end"],
                        "ttft_s": r.get("ttft_s"), "tokens": r["tokens_out"], "error": r.get("error"),
                        "predicted_ms": r.get("predicted_ms"), "predicted_n": r.get("predicted_n")})

    conn = aiohttp.TCPConnector(limit=clients, force_close=True)   # as load.py
    t = time.monotonic()
    async with aiohttp.ClientSession(connector=conn) as s:
        await asyncio.gather(*(worker(c, s) for c in range(clients)))
    return out, time.monotonic() - t


def _q(xs, q):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _figures(reqs, relay, wall, clients):
    """Per-request start/end/slot gaps of one load, matched to the relay's records by seed."""
    by_seed = {r["seed"]: r for r in relay if "seed" in r}
    start, end, slot, term, busy = [], [], [], [], 0.0
    per_client = {}
    for q in reqs:
        r = by_seed.get(q["seed"])
        if r is None or q["error"] or "stop" not in r:
            continue
        start.append(r["req_seen"] - q["start"])
        end.append(q["end"] - r["stop"])
        if "term" in r:
            term.append(r["term"] - r["stop"])
        busy += r["stop"] - r["req_seen"]
        per_client.setdefault(q["client"], []).append((q["start"], r))
    for rs in per_client.values():
        rs.sort(key=lambda x: x[0])
        slot += [b[1]["req_seen"] - a[1]["stop"] for a, b in zip(rs, rs[1:])]
    toks = sum(q["tokens"] for q in reqs if not q["error"])
    # llama-server's own decode step (its predicted_ms over the tokens after the first)
    steps = [q["predicted_ms"] / (q["predicted_n"] - 1) for q in reqs
             if not q["error"] and q.get("predicted_ms") and (q.get("predicted_n") or 0) > 1]
    ms = lambda xs, q: None if _q(xs, q) is None else round(_q(xs, q) * 1e3, 3)  # noqa: E731
    return {"requests": len(reqs), "matched": len(start), "errors": sum(1 for q in reqs if q["error"]),
            "tok_s": round(toks / wall, 2), "wall_s": round(wall, 3),
            "slot_busy": round(busy / (clients * wall), 4),
            "server_step_ms": None if not steps else round(statistics.fmean(steps), 3),
            "start_added_ms_p50": ms(start, .5), "start_added_ms_p90": ms(start, .9),
            "end_added_ms_p50": ms(end, .5), "end_added_ms_p90": ms(end, .9),
            "slot_gap_ms_p50": ms(slot, .5), "slot_gap_ms_p90": ms(slot, .9), "slot_gap_ms_max": ms(slot, 1),
            "stop_to_terminator_ms_p50": ms(term, .5),
            "_raw": {"start": start, "end": end, "slot": slot}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--server", required=True, help="a llama-server binary")
    ap.add_argument("--model", required=True, help="its GGUF model")
    ap.add_argument("--server-args", default="-np 16 -c 8192 -t 1", help="more llama-server arguments (one string)")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--n-predict", type=int, default=64)
    ap.add_argument("--proxy-src", help="run the proxy from this src/ folder (another checkout)")
    ap.add_argument("--also-src", help="a second proxy from this src/ folder, taking its turn in every round")
    ap.add_argument("--no-census", action="store_true", help="no census writer (spans say no_segment)")
    ap.add_argument("--proxy-args", default="", help="extra proxy options (one string)")
    ap.add_argument("--exporter", default="console", help="OTEL_TRACES_EXPORTER of the proxy (default console)")
    ap.add_argument("--json", help="write every load and the summary here")
    a = ap.parse_args()
    py = sys.executable
    work = Path(tempfile.mkdtemp(prefix="proxy-gaps-"))
    cdir = work / "census"
    cdir.mkdir(mode=0o700)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(SUPPORT)]))
    procs = []
    import perf_proxy_overhead as ppo
    try:
        sport, rport = free_port(), free_port()
        with open(work / "server.log", "w") as slog:
            server = subprocess.Popen([a.server, "-m", a.model, "--host", "127.0.0.1", "--port", str(sport),
                                       "--no-webui"] + a.server_args.split(), stdout=slog, stderr=subprocess.STDOUT)
        procs.append(server)
        ppo._wait_http(f"http://127.0.0.1:{sport}/health", server, timeout=120)
        relay_log = work / "relay.jsonl"
        named = {}
        relay = subprocess.Popen([py, __file__, "--_relay", str(rport), str(sport), str(relay_log)],
                                 stdout=subprocess.PIPE, text=True)
        procs.append(relay)
        if relay.stdout.readline().strip() != "ready":
            raise SystemExit("the relay did not start")
        if not a.no_census:
            writer = subprocess.Popen([py, str(HERE / "perf_proxy_overhead.py"), "--_writer", str(cdir),
                                       str(server.pid)], env=env, stdout=subprocess.PIPE, text=True)
            procs.append(writer)
            named["writer"] = writer
            if writer.stdout.readline().strip() != "ready":
                raise SystemExit("the census writer did not start")
        penv = dict(env, OTEL_TRACES_EXPORTER=a.exporter, OTEL_METRICS_EXPORTER="none")
        targets = {"direct": f"http://127.0.0.1:{rport}"}

        def start_proxy(name: str, src) -> None:
            port = free_port()
            e = dict(penv, PYTHONPATH=os.pathsep.join([str(Path(src).resolve()), str(SUPPORT)])) if src else penv
            with open(work / f"{name}.log", "w") as log:
                p = subprocess.Popen([py, "-m", "otel_gpu_census.cli", "proxy", "--upstream",
                                      f"http://127.0.0.1:{rport}", "--listen", f"127.0.0.1:{port}", "--census-dir",
                                      str(cdir), "--upstream-pid", str(server.pid)] + a.proxy_args.split(),
                                     env=e, stdout=log, stderr=subprocess.STDOUT)
            procs.append(p)
            named[name] = p
            ppo._wait_http(f"http://127.0.0.1:{port}/health", p)
            targets[name] = f"http://127.0.0.1:{port}"

        named.update(server=server, relay=relay)
        start_proxy("proxy", a.proxy_src)
        if a.also_src:
            start_proxy("proxy-b", a.also_src)
        for via in targets:       # warm-up: server, proxies (imports, first connections)
            asyncio.run(_load(targets[via], a.clients, a.clients, a.prompt_tokens, a.n_predict, 1))
        time.sleep(1)
        loads = []
        names = list(targets)
        print(f"{'pair':>4} {'via':<8}{'tok/s':>8}{'step':>7}{'busy':>7}{'start p50':>10}{'p90':>7}{'end p50':>9}{'p90':>7}"
              f"{'slot gap p50':>13}{'p90':>7}{'max':>8}  (ms)", flush=True)
        for pair in range(a.pairs):
            order = names if pair % 2 == 0 else names[::-1]
            for k, via in enumerate(order):
                seed = 10 + pair * len(names) + k
                size = relay_log.stat().st_size if relay_log.exists() else 0
                cpu0 = {n_: ppo._cpu_s(p_.pid) for n_, p_ in named.items()}
                self0 = time.process_time()
                reqs, wall = asyncio.run(_load(targets[via], a.clients, a.requests, a.prompt_tokens, a.n_predict,
                                               seed))
                time.sleep(0.5)      # the relay writes each connection's record when it closes
                with open(relay_log) as f:
                    f.seek(size)
                    relay_recs = [json.loads(line) for line in f if line.strip()]
                fig = _figures(reqs, relay_recs, wall, a.clients)
                fig.update(pair=pair, via=via)
                fig["cpu_s"] = {n_: round(ppo._cpu_s(p_.pid) - cpu0[n_], 2) for n_, p_ in named.items()}
                fig["cpu_s"]["load"] = round(time.process_time() - self0, 2)
                loads.append(fig)
                print(f"{pair:>4} {via:<8}{fig['tok_s']:>8.1f}{fig['server_step_ms'] or 0:>7.2f}{fig['slot_busy']:>7.3f}{fig['start_added_ms_p50']:>10.2f}"
                      f"{fig['start_added_ms_p90']:>7.2f}{fig['end_added_ms_p50']:>9.2f}{fig['end_added_ms_p90']:>7.2f}"
                      f"{fig['slot_gap_ms_p50']:>13.2f}{fig['slot_gap_ms_p90']:>7.2f}{fig['slot_gap_ms_max']:>8.1f}"
                      + (f"  errors {fig['errors']}" if fig["errors"] else ""), flush=True)
                time.sleep(1.5)       # spans settle before the next load
    finally:
        for p in reversed(procs):
            stop(p)
        shutil.rmtree(work, ignore_errors=True)

    summary = {"clients": a.clients, "requests": a.requests, "prompt_tokens": a.prompt_tokens,
               "n_predict": a.n_predict, "server_args": a.server_args, "proxy_src": a.proxy_src,
               "also_src": a.also_src, "census": not a.no_census}
    for via in names:
        mine = [f for f in loads if f["via"] == via]
        raw = {k: [x for f in mine for x in f["_raw"][k]] for k in ("start", "end", "slot")}
        summary[via] = {"tok_s_median": statistics.median(f["tok_s"] for f in mine),
                        "slot_busy_median": statistics.median(f["slot_busy"] for f in mine),
                        "server_step_ms_median": statistics.median(f["server_step_ms"] or 0 for f in mine),
                        "proxy_cpu_s_median": statistics.median(f["cpu_s"].get(via, 0) for f in mine),
                        **{f"{k}_ms_{n}": round(_q(raw[k], q) * 1e3, 3) for k in raw
                           for n, q in (("p50", .5), ("p90", .9), ("p99", .99))}}
        if via != "direct":
            summary[via]["tok_s_ratio_median"] = round(statistics.median(
                p["tok_s"] / d["tok_s"] for d, p in
                ((next(x for x in loads if x["pair"] == i and x["via"] == "direct"),
                  next(x for x in loads if x["pair"] == i and x["via"] == via)) for i in range(a.pairs))), 4)
    print(json.dumps(summary))
    if a.json:
        for f in loads:
            f.pop("_raw", None)
        Path(a.json).write_text(json.dumps({"summary": summary, "loads": loads}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--_relay":
        import signal
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))    # records are written per connection
        asyncio.run(_relay_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]))
        sys.exit(0)
    sys.exit(main())
