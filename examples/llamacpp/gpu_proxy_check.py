#!/usr/bin/env python3
"""llama-server under the census, the tracing proxy in front, concurrent streaming clients: what the
spans say each request cost the GPU, next to TTFT and throughput.

    gpu_proxy_check.py --llama-server BIN --model GGUF --out DIR [--clients 16 --requests 64
                       --prompt-tokens 1800 --max-tokens 64] [--compare-direct] [-- extra llama-server args]

Writes DIR/summary.json (printed too), DIR/spans.jsonl (every span's attributes), DIR/server.log and
DIR/proxy.log. The proxy runs as its own process (`otel-gpu-census proxy`, console exporter into
proxy.log, read back for the spans), as in production, so the load driver here does not share its
interpreter. --compare-direct also drives the same load straight at llama-server, alternating
direct/proxy --pairs times, and reports the throughput ratio and client-side TTFT both ways (the
proxy's own cost). Needs the census library built
(``make -C native``) and a GPU; without them the spans say ``gpu_census.attribution.status`` no_segment.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

WORDS = ("the of and to in is was for on are with as his they at be this from have or one had by word but not "
         "what all were we when your can said there use an each which she do how their if will up other about "
         "out many then them these so some her would make like him into time has look two more write go see "
         "number no way could people my than first water been call who oil its now find long down day did get "
         "come made may part over new sound take only little work know place year live me back give most very "
         "after thing our just name good sentence man think say great where help through much before line right "
         "too mean old any same tell boy follow came want show also around form three small set put end does "
         "another well large must big even such because turn here why ask went men read need land different").split()


def prompt(i: int, n_tokens: int) -> str:
    rnd = random.Random(i)
    # ~1.3 tokens per English word with Llama-3's tokenizer
    return f"Request {i}. " + " ".join(rnd.choice(WORDS) for _ in range(int(n_tokens / 1.3)))


def pct(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def drive(base: str, n_requests: int, clients: int, prompt_tokens: int, max_tokens: int, offset: int):
    """Streaming /completion requests from `clients` concurrent clients; per-request client-side facts."""
    import aiohttp
    queue = list(range(offset, offset + n_requests))
    out = []

    async def client(session):
        while queue:
            i = queue.pop(0)
            body = {"prompt": prompt(i, prompt_tokens), "n_predict": max_tokens, "stream": True,
                    "ignore_eos": True}
            t0 = time.monotonic()
            first = None
            tokens = 0
            async with session.post(base + "/completion", json=body) as r:
                if r.status != 200:
                    out.append({"status": r.status, "error": (await r.text())[:200]})
                    continue
                async for line in r.content:
                    if not line.startswith(b"data: "):
                        continue
                    ev = json.loads(line[6:])
                    if ev.get("stop") is True:
                        tokens = ev.get("tokens_predicted", tokens)
                    elif first is None:
                        first = time.monotonic() - t0
            out.append({"status": 200, "ttft_s": first, "e2e_s": time.monotonic() - t0, "tokens": tokens})

    t = time.monotonic()
    # force_close: llama-server may close a connection after a streamed answer (a reused one then fails)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                     connector=aiohttp.TCPConnector(force_close=True, limit=0)) as s:
        await asyncio.gather(*(client(s) for _ in range(clients)))
    wall = time.monotonic() - t
    return out, wall


def wait_healthy(url: str, proc, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"llama-server exited with {proc.returncode}; see server.log")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} not healthy after {timeout:.0f} s")


def console_spans(path: Path):
    """Spans the console exporter wrote to `path` (pretty-printed JSON objects between log lines)."""
    from datetime import datetime
    text = path.read_text(errors="replace")
    dec = json.JSONDecoder()
    out, i = [], 0
    while True:
        j = text.find("{\n", i)
        if j < 0:
            return out
        try:
            obj, i = dec.raw_decode(text, j)
        except ValueError:
            i = j + 2
            continue
        if isinstance(obj, dict) and "attributes" in obj and "start_time" in obj:
            for k in ("start_time", "end_time"):
                obj[k] = int(datetime.fromisoformat(obj[k].replace("Z", "+00:00")).timestamp() * 1e9)
            out.append(obj)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-check-out"))
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=1800)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--port", type=int, default=18080)
    ap.add_argument("--compare-direct", action="store_true")
    ap.add_argument("--pairs", type=int, default=2, help="direct/proxy pairs with --compare-direct")
    ap.add_argument("server_args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    extra = [x for x in a.server_args if x != "--"]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    from otel_gpu_census.cli import launcher
    from otel_gpu_census.census import proctree, reader

    census = Path(tempfile.mkdtemp(prefix="census-"))
    os.chmod(census, 0o700)
    plan = launcher.build_env(census)
    for w in plan.warnings:
        print("warning:", w, file=sys.stderr)
    n_ctx = a.clients * (a.prompt_tokens + a.max_tokens + 256)
    cmd = [a.llama_server, "-m", a.model, "--host", "127.0.0.1", "--port", str(a.port), "-ngl", "99",
           "-np", str(a.clients), "-c", str(n_ctx), "--no-webui", *extra]
    log = open(out / "server.log", "wb")
    server = subprocess.Popen(cmd, env=plan.env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{a.port}"
    proxy_url = f"http://127.0.0.1:{a.port + 1}"
    proxy = None
    try:
        wait_healthy(base, server, 600)
        penv = dict(os.environ, OTEL_TRACES_EXPORTER="console", OTEL_METRICS_EXPORTER="none",
                    PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
        with open(out / "proxy.log", "wb") as plog:
            proxy = subprocess.Popen([sys.executable, "-m", "otel_gpu_census.cli", "proxy", "--upstream", base,
                                      "--listen", f"127.0.0.1:{a.port + 1}", "--dir", str(census),
                                      "--upstream-pid", str(server.pid)], env=penv, stdout=plog,
                                     stderr=subprocess.STDOUT)
        wait_healthy(proxy_url, proxy, 60)
        asyncio.run(drive(proxy_url, a.clients, a.clients, a.prompt_tokens, a.max_tokens, 10**6))   # warm-up
        runs = {"proxy": [], "direct": []}
        order = [w for k in range(a.pairs) for w in (("direct", "proxy") if k % 2 == 0 else ("proxy", "direct"))] \
            if a.compare_direct else ["proxy"]
        measured_from = time.time_ns()
        before = {c.pid: c.totals() for c in proctree.process_tree(server.pid, reader.scan(census)[0])}
        for k, which in enumerate(order):
            url = proxy_url if which == "proxy" else base
            res, wall = asyncio.run(drive(url, a.requests, a.clients, a.prompt_tokens, a.max_tokens, k * 10**4))
            runs[which].append({"results": res, "wall_s": wall})
            print(f"{which}: {sum(r.get('tokens', 0) for r in res) / wall:.1f} tok/s, TTFT p50 "
                  f"{pct([r['ttft_s'] for r in res if r.get('ttft_s') is not None], 50)}", file=sys.stderr)
        time.sleep(5)                    # every span gets its GPU cost (--gpu-wait 3 s) before the stop
        proxy.terminate()
        proxy.wait(30)
        after = proctree.process_tree(server.pid, reader.scan(census)[0])
    finally:
        if proxy is not None and proxy.poll() is None:
            proxy.kill()
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()

    spans = [s for s in console_spans(out / "proxy.log") if s["attributes"].get("gen_ai.operation.name")
             and s["attributes"].get("gpu_census.proxy.outcome") == "complete" and s["start_time"] >= measured_from]
    with open(out / "spans.jsonl", "w") as f:
        for s in spans:
            f.write(json.dumps({"name": s["name"], "start_ns": s["start_time"], "end_ns": s["end_time"],
                                "attributes": s["attributes"]}) + "\n")
    A = [s["attributes"] for s in spans]
    dtoh = [x.get("gpu_census.copy.dtoh.bytes") for x in A if "gpu_census.copy.dtoh.bytes" in x]
    pre = [x.get("gpu_census.prefill.copy.dtoh.bytes", 0) for x in A if "gpu_census.copy.dtoh.bytes" in x]
    ttft = [x["gen_ai.response.time_to_first_chunk"] for x in A if "gen_ai.response.time_to_first_chunk" in x]
    statuses = {}
    for x in A:
        st = x.get("gpu_census.attribution.status", "?")
        statuses[st] = statuses.get(st, 0) + 1
    census_dtoh = sum(c.totals().copies.get("dtoh").bytes for c in after) - \
        sum(t.copies.get("dtoh").bytes for t in before.values())

    def tput(run):
        toks = sum(r.get("tokens", 0) for r in run["results"])
        return toks / run["wall_s"] if run["wall_s"] else None

    summary = {
        "server_args": extra, "clients": a.clients, "requests_per_run": a.requests,
        "prompt_tokens": a.prompt_tokens, "max_tokens": a.max_tokens,
        "census_on": plan.census_on,
        "spans": len(A), "attribution_status": statuses,
        "dtoh_MB_per_request_mean": statistics.mean(dtoh) / 1e6 if dtoh else None,
        "dtoh_MB_per_request_p50": pct(dtoh, 50) / 1e6 if dtoh else None,
        "dtoh_MB_per_request_p90": pct(dtoh, 90) / 1e6 if dtoh else None,
        "prefill_dtoh_MB_per_request_mean": statistics.mean(pre) / 1e6 if pre else None,
        "census_dtoh_MB_during_measured_runs": census_dtoh / 1e6,     # direct runs included, if any
        "spans_dtoh_MB_total": sum(dtoh) / 1e6 if dtoh else 0,
        "ttft_s_p50_spans": pct(ttft, 50), "ttft_s_p90_spans": pct(ttft, 90),
        "throughput_tok_s_proxy": [tput(r) for r in runs["proxy"]],
        "throughput_tok_s_direct": [tput(r) for r in runs["direct"]],
        "errors": sum(1 for rs in runs.values() for r in rs for x in r["results"] if x.get("status") != 200),
    }
    if a.compare_direct and runs["direct"]:
        p = statistics.mean(tput(r) for r in runs["proxy"])
        d = statistics.mean(tput(r) for r in runs["direct"])
        summary["proxy_over_direct_throughput"] = p / d if d else None
        for which in ("direct", "proxy"):
            t = [x["ttft_s"] for r in runs[which] for x in r["results"] if x.get("ttft_s") is not None]
            summary[f"ttft_s_client_{which}"] = {"p50": pct(t, 50), "p90": pct(t, 90)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
