"""What the tracing proxy costs a streaming load: direct vs through the proxy, alternating (not a
pytest test: run it).

    .venv/bin/python bench/perf/perf_proxy_overhead.py [--pairs 5] [--clients 16] [--requests 64]
        [--tokens 64] [--token-rate 25] [--prompt-s 0.2] [--prompt-tokens 1800] [--fast]
        [--exporter console|none|otlp] [--no-census] [--proxy-args "..."] [--json FILE]
        [--server LLAMA_SERVER --model GGUF [--server-args "..."]] [--proxy-src DIR]
        [--serial N [--also-src DIR]] [--loop-lag MS]

Processes, as on a server host: the llama-server stand-in (tests/support/llama_standin.py: /completion SSE
events of llama-server's shape, `--prompt-s` before the first token, then `--token-rate` tokens a
second per stream; `--fast`: no delays, to find the proxy's CPU limit); a census writer that maps a
real segment for the stand-in's pid and tallies real CUPTI records into it through the native tally
once a second, as the injector does (window and step rings full: ~650 KiB of windows to read); the
proxy (`python -m otel_gpu_census.cli proxy --upstream ... --dir ... --upstream-pid PID`, the
command bench/server/run_server_bench.py runs, console exporter to a file by default); and this
process, the load: `--clients` concurrent streaming clients sending `--requests` requests of
`--prompt-tokens` token ids each. Direct and proxied loads alternate (order swapped every pair) so
drift on a shared machine hits both. Prints per run and the medians: output tok/s, TTFT p50/p90,
and the proxy/direct throughput ratio; the target (issue 4) is a ratio >= 0.99.

`--server`: a real llama-server (e.g. the CPU build with a tiny random model) instead of the stand-in,
the same server for both sides of every pair. `--proxy-src`: run the proxy from another checkout's
src/ (before/after comparisons against the same upstream). `--serial N`: instead of loads, N single
requests alternating direct and proxied (one client, nothing else in flight): the latency the proxy
adds to the answer's head, first event and end (medians of the N paired differences) and its CPU time
per request; with `--also-src DIR` a second proxy from that src/ runs beside the first and takes its
turn in every round (random order), for a before/after comparison under the same conditions.
`--loop-lag MS`: the proxy runs its event-loop lag probe (`--loop-lag-probe MS`), reset before each
load and read after it: each run gets `loop_lag` (how late the proxy's loop woke: p50/p99/max ms, and
how many wake-ups were 5, 20, 100 ms late), during direct loads too (the idle proxy's baseline).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SUPPORT = ROOT / "tests" / "support"     # the stand-in, the segment writer, free ports
sys.path.insert(0, str(SUPPORT))
sys.path.insert(0, str(ROOT / "src"))

from ports import free_port  # noqa: E402

WINDOW_NS = 20_000_000


def _wait_http(url: str, proc: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args[:4]} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{url} did not answer within {timeout:.0f} s")


# ---- the census writer (child process) -------------------------------------------------------

def census_writer(directory: str, pid: int, stop_after_s: float) -> None:
    """Map a segment for `pid` and publish real records once a second, like the injector: ~1000
    kernels (one per ms, stepped), per 20 ms a logits DtoH, an HtoD, a DtoD and a memset, and a
    32 MiB DtoH per second, each second's records handed over ~0.5 s late as CUPTI does."""
    import cupti_records as cr
    import segments
    from otel_gpu_census.census import proctree
    ffi, lib, _ = cr.native()
    ticks = proctree.proc_start_ticks(pid) or 0
    mm, seg = segments.map_segment(Path(directory) / f"gpu-census-{pid}-{ticks}.seg", b"llama-server")  # CUPTI clock == wall clock
    seg.pid, seg.ppid, seg.proc_start_ticks, seg.state = pid, os.getppid(), ticks, 1
    tally = lib.gc_tally_create(seg)
    corr = [0]
    kern = [cr.kernel(0, 0) for _ in range(1000)]
    ext = [cr.external(0, 0) for _ in range(1000)]
    # per 20 ms bucket, as a decoding llama-server: logits back, a batch in, a KV shuffle, a memset
    small = [rec for _ in range(50) for rec in (cr.memcpy("dtoh", 128_256 * 4, 0, 0, dst="pageable"),
                                                cr.memcpy("htod", 4096, 0, 0, src="pinned"),
                                                cr.memcpy("dtod", 1 << 20, 0, 0), cr.memset(65536, 0, 0))]
    big = cr.memcpy("dtoh", 32 << 20, 0, 0, dst="pinned")

    def second(t0: int) -> None:
        """Records of the GPU second starting at t0 (wall ns), in one buffer completion."""
        lib.gc_segment_begin_update(seg)
        for j in range(1000):
            corr[0] += 1
            ext[j].correlationId, ext[j].externalId = corr[0], 1 + (t0 // 1_000_000_000) % 100_000
            k = kern[j]
            k.start, k.end, k.correlationId = t0 + j * 1_000_000, t0 + j * 1_000_000 + 600_000, corr[0]
            lib.gc_tally_record(tally, ext[j])
            lib.gc_tally_record(tally, k)
        for j, c in enumerate(small):
            c.start = t0 + (j // 4) * WINDOW_NS + 700_000 + (j % 4) * 100_000
            c.end = c.start + 40_000
            lib.gc_tally_record(tally, c)
        big.start, big.end = t0 + 500_000_000, t0 + 502_000_000
        lib.gc_tally_record(tally, big)
        lib.gc_tally_publish(tally, 0)
        seg.complete_wall_ns = t0 + 1_000_000_000       # as the injector's flusher: complete up to here
        lib.gc_segment_end_update(seg)

    now = time.time_ns()
    t = now - 45 * 1_000_000_000         # fill the rings: 45 s of history (the window ring holds ~41 s)
    while t + 1_000_000_000 <= now - 500_000_000:
        second(t)
        t += 1_000_000_000
    print("ready", flush=True)
    end = time.monotonic() + stop_after_s
    while time.monotonic() < end:
        time.sleep(max(0.0, (t + 1_500_000_000 - time.time_ns()) / 1e9))
        second(t)
        t += 1_000_000_000


# ---- the load -----------------------------------------------------------------------------

def _quantile(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def _load(url: str, clients: int, requests: int, prompt_tokens: int, n_predict: int, seed: int):
    import aiohttp
    queue = list(range(requests))
    ttft, gaps, tokens, errors = [], [], 0, []

    async def worker(session):
        nonlocal tokens
        while queue:
            i = queue.pop(0)
            rng = random.Random(seed * 1_000_003 + i)
            body = {"prompt": [rng.randrange(1000, 100000) for _ in range(prompt_tokens)], "n_predict": n_predict,
                    "stream": True, "ignore_eos": True}
            t0 = time.monotonic()
            first = last = None
            gap = 0.0
            try:
                async with session.post(url + "/completion", json=body) as r:
                    if r.status != 200:
                        errors.append(f"HTTP {r.status}")
                        continue
                    async for line in r.content:
                        if not line.startswith(b"data:"):
                            continue
                        now = time.monotonic()
                        if first is None:
                            first = now - t0
                        else:
                            gap = max(gap, now - last)
                        last = now
                        if b'"stop":true' in line:
                            tokens += json.loads(line[5:]).get("tokens_predicted", 0)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                errors.append(f"{type(e).__name__}: {e}")
                continue
            if first is not None:
                ttft.append(first)
                gaps.append(gap)

    t = time.monotonic()
    conn = aiohttp.TCPConnector(limit=clients, force_close=True)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as s:
        await asyncio.gather(*(worker(s) for _ in range(clients)))
    wall = time.monotonic() - t
    return {"wall_s": round(wall, 3), "tokens": tokens, "tok_s": round(tokens / wall, 2), "errors": errors[:3],
            "n_errors": len(errors), "ttft_p50_s": round(_quantile(ttft, 0.5) or 0, 4),
            "ttft_p90_s": round(_quantile(ttft, 0.9) or 0, 4),
            # the longest wait between two events of one answer: token delay plus any stall
            "gap_p90_s": round(_quantile(gaps, 0.9) or 0, 4), "gap_max_s": round(max(gaps, default=0), 4)}


async def _serial(targets, n: int, prompt_tokens: int, n_predict: int, pids: dict) -> dict:
    """Paired single requests: what each proxy adds to one answer's head, first event and end."""
    import aiohttp
    rng = random.Random(7)

    async def one(session, url, i):
        body = {"prompt": [rng.randrange(1000, 100000) for _ in range(prompt_tokens)], "n_predict": n_predict,
                "stream": True, "ignore_eos": True, "seed": i}
        t0 = time.perf_counter()
        first = None
        async with session.post(url + "/completion", json=body) as r:
            head = time.perf_counter() - t0
            async for line in r.content:
                if first is None and line.startswith(b"data:"):
                    first = time.perf_counter() - t0
        return head, first if first is not None else head, time.perf_counter() - t0

    added = {k: [] for k in pids}
    cpu0 = {k: _cpu_s(p) for k, p in pids.items()}     # all of it: work after an answer counts too
    order = list(targets)
    shuffle = random.Random(11).shuffle
    conn = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as s:
        for i in range(n):
            shuffle(order)
            got = {}
            for via in order:
                got[via] = await one(s, targets[via], i)
            for k in pids:
                added[k].append([p - d for p, d in zip(got[k], got["direct"])])
        await asyncio.sleep(4)          # spans settle (census wait), as in a load
    cpu = {k: _cpu_s(p) - cpu0[k] for k, p in pids.items()}
    out = {}
    for k in pids:
        med = [statistics.median(x[j] for x in added[k]) * 1e3 for j in range(3)]
        out[k] = {"added_head_ms": round(med[0], 3), "added_first_event_ms": round(med[1], 3),
                  "added_end_ms": round(med[2], 3), "proxy_cpu_ms_per_request": round(cpu[k] / n * 1e3, 2)}
    return {"requests": n, **out}


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _lag_summary(lags) -> dict:
    """Over the loads of one side: median p50/p99, the worst max, wake-ups late by 20 ms+ in all."""
    if not lags:
        return {}
    return {"p50_ms_median": statistics.median(x.get("p50_ms", 0) for x in lags),
            "p99_ms_median": statistics.median(x.get("p99_ms", 0) for x in lags),
            "max_ms": max(x.get("max_ms", 0) for x in lags),
            "over_20ms": sum(x.get("over_20ms", 0) for x in lags),
            "wakeups": sum(x.get("wakeups", 0) for x in lags)}


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    ap.add_argument("--token-rate", type=float, default=25.0, help="tokens per second per stream")
    ap.add_argument("--prompt-s", type=float, default=0.2, help="seconds before the first token")
    ap.add_argument("--prompt-tokens", type=int, default=1800)
    ap.add_argument("--fast", action="store_true", help="no delays at all: the proxy's CPU limit")
    ap.add_argument("--exporter", default="console", help="OTEL_TRACES_EXPORTER of the proxy (default console)")
    ap.add_argument("--no-census", action="store_true", help="no census segment (spans say no_segment)")
    ap.add_argument("--proxy-args", default="", help="extra proxy options (one string)")
    ap.add_argument("--json", help="write every run and the summary here")
    ap.add_argument("--keep", help="keep the proxy's log (console spans) in this folder")
    ap.add_argument("--server", help="a llama-server binary to load instead of the stand-in")
    ap.add_argument("--model", help="--server: the GGUF model")
    ap.add_argument("--server-args", default="-np 16 -c 32768", help="--server: more arguments (one string)")
    ap.add_argument("--proxy-src", help="run the proxy from this src/ folder (another checkout)")
    ap.add_argument("--serial", type=int, metavar="N", help="N paired single requests instead of loads")
    ap.add_argument("--also-src", help="--serial: a second proxy from this src/ folder, measured alongside")
    ap.add_argument("--loop-lag", type=float, metavar="MS",
                    help="run the proxy's event-loop lag probe at this interval and record its figures per load")
    a = ap.parse_args()
    if a.server and not a.model:
        ap.error("--server needs --model")
    token_delay = 0.0 if a.fast else 1.0 / a.token_rate
    prompt_s = 0.0 if a.fast else a.prompt_s
    py = sys.executable
    work = Path(a.keep or tempfile.mkdtemp(prefix="proxy-overhead-"))
    work.mkdir(parents=True, exist_ok=True)
    cdir = work / "census"
    cdir.mkdir(mode=0o700, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(SUPPORT)]))
    procs = []
    try:
        sport, pport = free_port(), free_port()
        if a.server:
            slog = open(work / "server.log", "w")
            standin = subprocess.Popen([a.server, "-m", a.model, "--host", "127.0.0.1", "--port", str(sport)]
                                       + a.server_args.split(), stdout=slog, stderr=subprocess.STDOUT)
            slog.close()
        else:
            standin = subprocess.Popen([py, str(SUPPORT / "llama_standin.py"), "--port", str(sport), "--tokens",
                                        str(a.tokens), "--token-delay", str(token_delay), "--first-token-delay",
                                        str(prompt_s), "--prompt-tokens", str(a.prompt_tokens), "--forget"],
                                       env=env)
        procs.append(standin)
        _wait_http(f"http://127.0.0.1:{sport}/health", standin, timeout=120)
        if not a.no_census:
            writer = subprocess.Popen([py, __file__, "--_writer", str(cdir), str(standin.pid)], env=env,
                                      stdout=subprocess.PIPE, text=True)
            procs.append(writer)
            if writer.stdout.readline().strip() != "ready":
                raise SystemExit("the census writer did not start")
        penv = dict(env, OTEL_TRACES_EXPORTER=a.exporter, OTEL_METRICS_EXPORTER="none")

        def start_proxy(port: int, src, log_name: str) -> subprocess.Popen:
            """The proxy in front of the upstream, from `src` (a src/ folder) or this checkout."""
            proc_env = dict(penv, PYTHONPATH=os.pathsep.join([str(Path(src).resolve()), str(SUPPORT)])) if src else penv
            with open(work / log_name, "w") as log:
                lag = ["--loop-lag-probe", f"{a.loop_lag:g}"] if a.loop_lag else []
                proc = subprocess.Popen([py, "-m", "otel_gpu_census.cli", "proxy", "--upstream",
                                         f"http://127.0.0.1:{sport}", "--listen", f"127.0.0.1:{port}", "--dir",
                                         str(cdir), "--upstream-pid", str(standin.pid)] + lag + a.proxy_args.split(),
                                        env=proc_env, stdout=log, stderr=subprocess.STDOUT)
            procs.append(proc)
            _wait_http(f"http://127.0.0.1:{port}/health", proc)
            return proc

        proxy = start_proxy(pport, a.proxy_src, "proxy.log")
        targets = {"direct": f"http://127.0.0.1:{sport}", "proxy": f"http://127.0.0.1:{pport}"}
        # one unrecorded warm-up through the proxy (imports, first connections)
        asyncio.run(_load(targets["proxy"], a.clients, a.clients, a.prompt_tokens, a.tokens, 0))
        if a.serial:
            pids = {"proxy": proxy.pid}
            if a.also_src:
                bport = free_port()
                pb = start_proxy(bport, a.also_src, "proxy-b.log")
                targets["proxy-b"] = f"http://127.0.0.1:{bport}"
                pids["proxy-b"] = pb.pid
                asyncio.run(_load(targets["proxy-b"], a.clients, a.clients, a.prompt_tokens, a.tokens, 0))
            res = asyncio.run(_serial(targets, a.serial, a.prompt_tokens, a.tokens, pids))
            res.update(server=a.server, proxy_src=a.proxy_src, also_src=a.also_src, census=not a.no_census,
                       exporter=a.exporter)
            print(json.dumps(res))
            for k in pids:
                r = res[k]
                print(f"{k}: adds {r['added_head_ms']:.2f} ms to the answer's head, {r['added_first_event_ms']:.2f} ms "
                      f"to its first event, {r['added_end_ms']:.2f} ms to its end (medians of {a.serial} pairs); "
                      f"{r['proxy_cpu_ms_per_request']:.2f} ms of proxy CPU per request")
            if a.json:
                Path(a.json).write_text(json.dumps(res, indent=2) + "\n")
            return 0
        runs = []
        lag_url = targets["proxy"] + "/.otel-gpu-census/loop-lag?reset=1" if a.loop_lag else None
        print(f"{'pair':>4} {'via':<7}{'tok/s':>9}{'TTFT p50':>10}{'p90':>8}{'gap p90':>9}{'max':>7}"
              f"{'proxy CPU s':>12}" + (f"{'lag p99 ms':>11}{'max':>8}{'>20ms':>6}" if lag_url else ""), flush=True)
        for pair in range(a.pairs):
            order = ("direct", "proxy") if pair % 2 == 0 else ("proxy", "direct")
            for via in order:
                cpu0 = _cpu_s(proxy.pid)
                if lag_url:
                    _get_json(lag_url)          # a new period for this load
                # distinct prompts on each side: a real server would answer the second from its prompt cache
                seed = 2 * pair + 1 + (via == "proxy")
                r = asyncio.run(_load(targets[via], a.clients, a.requests, a.prompt_tokens, a.tokens, seed))
                r.update(pair=pair, via=via, proxy_cpu_s=round(_cpu_s(proxy.pid) - cpu0, 2))
                lag = ""
                if lag_url:
                    r["loop_lag"] = _get_json(lag_url)
                    lag = (f"{r['loop_lag'].get('p99_ms', 0):>11.2f}{r['loop_lag'].get('max_ms', 0):>8.1f}"
                           f"{r['loop_lag'].get('over_20ms', 0):>6}")
                runs.append(r)
                print(f"{pair:>4} {via:<7}{r['tok_s']:>9.1f}{r['ttft_p50_s']:>10.3f}{r['ttft_p90_s']:>8.3f}"
                      f"{r['gap_p90_s']:>9.3f}{r['gap_max_s']:>7.3f}{r['proxy_cpu_s']:>12.2f}{lag}" + (f"  errors {r['n_errors']}: {r['errors']}" if r['errors'] else ""),
                      flush=True)
        # spans still waiting for the census finish before the proxy stops
        time.sleep(4)
    finally:
        for p in reversed(procs):
            _stop(p)
        spans = (work / "proxy.log").read_text(errors="replace").count('"name": "text_completion') \
            if a.exporter == "console" and (work / "proxy.log").exists() else None
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)

    def med(via, key):
        return statistics.median(r[key] for r in runs if r["via"] == via)
    ratios = [p["tok_s"] / d["tok_s"] for d, p in
              ((next(r for r in runs if r["pair"] == i and r["via"] == "direct"),
                next(r for r in runs if r["pair"] == i and r["via"] == "proxy")) for i in range(a.pairs))]
    summary = {"clients": a.clients, "requests": a.requests, "tokens": a.tokens,
               "token_rate": None if a.fast else a.token_rate, "prompt_s": prompt_s, "exporter": a.exporter,
               "census": not a.no_census, "server": a.server, "proxy_src": a.proxy_src,
               "direct": {k: med("direct", k) for k in ("tok_s", "ttft_p50_s", "ttft_p90_s", "gap_max_s")},
               "proxy": {k: med("proxy", k) for k in ("tok_s", "ttft_p50_s", "ttft_p90_s", "gap_max_s",
                                                      "proxy_cpu_s")},
               "ratio_median": round(statistics.median(ratios), 4), "ratio_min": round(min(ratios), 4)}
    summary["console_spans"] = spans
    if a.loop_lag:
        summary["loop_lag"] = {via: _lag_summary([r["loop_lag"] for r in runs if r["via"] == via and "loop_lag" in r])
                               for via in ("direct", "proxy")}
    print(json.dumps(summary))
    d, p = summary["direct"], summary["proxy"]
    print(f"proxy/direct throughput {summary['ratio_median']:.3f} (median of {a.pairs} pairs, worst "
          f"{summary['ratio_min']:.3f}); TTFT p50 {d['ttft_p50_s']:.3f} -> {p['ttft_p50_s']:.3f} s, "
          f"p90 {d['ttft_p90_s']:.3f} -> {p['ttft_p90_s']:.3f} s")
    if a.loop_lag:
        lp, ld = summary["loop_lag"]["proxy"], summary["loop_lag"]["direct"]
        print(f"proxy event-loop lag during proxied loads: p50 {lp.get('p50_ms_median')} ms, p99 "
              f"{lp.get('p99_ms_median')} ms (medians of the loads), max {lp.get('max_ms')} ms, "
              f"{lp.get('over_20ms')} of {lp.get('wakeups')} wake-ups >= 20 ms late; idle (direct loads): p99 "
              f"{ld.get('p99_ms_median')} ms, max {ld.get('max_ms')} ms")
    if a.json:
        Path(a.json).write_text(json.dumps({"summary": summary, "runs": runs}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--_writer":
        census_writer(sys.argv[2], int(sys.argv[3]), stop_after_s=3600)
        sys.exit(0)
    sys.exit(main())
