#!/usr/bin/env python3
"""Concurrent streaming load against llama-server's /completion.

  python bench/server/load.py --url http://127.0.0.1:8080 [--clients 16] [--requests 64]
         [--prompt-tokens 1800] [--n-predict 64] [--seed 1] [--waves [--wave-gap-s 0]] [--out load.json]

Each request sends a distinct prompt as a list of token ids (exact length, no tokenizer needed),
streams the answer and records TTFT (first SSE event), end-to-end time, output tokens and the
arrival time of every token event. Prompts are distinct so every request brings new context, as in
production, and llama-server's prompt cache and checkpoints do their work (and their copies).
``ignore_eos`` keeps every answer at n_predict tokens even with random weights. Every request and
the whole run are bounded in time.

Two throughputs: ``output_tok_s`` over the whole load (first request sent to last answer done), and
``steady_tok_s``, the token events that arrived while every client was busy: after the last of the
first wave of requests (one per client) got its first token, and before the first client finished
its last request. The steady figure leaves out the ramp-up (all prompts at once) and the tail (fewer
streams than clients); both are reported. Per request, ``ev`` holds the token events' arrival times
compactly (see encode_times).

Two load shapes. Free (the default): a closed loop, each client sends its next request as soon as its
last one ended, so requests drift apart and the server batches them differently every load. Waves
(``--waves``): the requests go in waves of ``--clients`` that start together; a wave starts when every
request of the previous one has ended (and ``--wave-gap-s`` has passed), so every wave is the same
batch: identical prompt length and n_predict, distinct prompts, the same arrival pattern. A waves
load reports every wave's wall time (its first request sent to its last answer) and tok/s, their
CV across waves (``wave_tok_s_cv``), and ``output_tok_s`` = output tokens / the sum of the wave walls
(gaps between waves do not count; ``wall_s`` is still first request to last answer, gaps included).
Its steady figure is the same idea per wave: tokens that arrived while every request of the wave was
streaming (after its last first token, up to its first end), over the sum of those windows.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from typing import Any, Dict, List, Optional

import aiohttp

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))
import benchlib as bl  # noqa: E402

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from event_times import decode_times, encode_times  # noqa: E402,F401  (load.encode_times for its callers)


def prompt_ids(seed: int, i: int, n: int, lo: int = 1000, hi: int = 100000) -> List[int]:
    """A distinct prompt of n ordinary (non-special) token ids for request i."""
    rng = random.Random(seed * 1_000_003 + i)
    return [rng.randrange(lo, hi) for _ in range(n)]


def steady_state(results: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Tokens a second while every client had a request in flight (see the module docstring).

    Needs per request: client, start, end (s after the load's t0), ev (encode_times against the same
    t0). Returns steady_tok_s None (with steady_why) when the window is empty: fewer than two
    requests per client, or a first-wave request without a token."""
    by_client: Dict[int, List[Dict[str, Any]]] = {}
    for r in results:
        by_client.setdefault(r.get("client", 0), []).append(r)
    firsts = [min(rs, key=lambda r: r["start"]) for rs in by_client.values()]
    lasts = [max(rs, key=lambda r: r["start"]) for rs in by_client.values()]
    if any(not r.get("ev") for r in firsts):
        return {"steady_tok_s": None, "steady_why": "a first-wave request got no token"}
    t_a = max(decode_times(r["ev"])[0] for r in firsts)
    t_b = min(r["end"] for r in lasts)
    if t_b <= t_a:
        return {"steady_tok_s": None, "steady_why": "no window with every client busy (too few requests per client)"}
    n = sum(1 for r in results for t in decode_times(r.get("ev")) if t_a < t <= t_b)
    return {"steady_tok_s": round(n / (t_b - t_a), 2), "steady_tokens": n,
            "steady_from_s": round(t_a, 3), "steady_to_s": round(t_b, 3)}


def steady_waves(results: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Waves mode's steady figure: in every wave, the token events after the wave's last first token
    and up to its first request's end (every request of the wave streaming: no prompts, no tail),
    summed over the waves, over the sum of those windows. Needs per request: wave, end, ev (all
    against the load's t0). Waves whose window is empty (or with a request without a token) are
    left out; with none left, steady_tok_s is None (with steady_why)."""
    by_wave: Dict[int, List[Dict[str, Any]]] = {}
    for r in results:
        by_wave.setdefault(r["wave"], []).append(r)
    n, span, used = 0, 0.0, 0
    for rs in by_wave.values():
        evs = [decode_times(r.get("ev")) for r in rs]
        if any(not e for e in evs):
            continue
        t_a, t_b = max(e[0] for e in evs), min(r["end"] for r in rs)
        if t_b <= t_a:
            continue
        n += sum(1 for e in evs for t in e if t_a < t <= t_b)
        span += t_b - t_a
        used += 1
    if not used:
        return {"steady_tok_s": None, "steady_why": "no wave had a window with all its requests streaming"}
    return {"steady_tok_s": round(n / span, 2), "steady_tokens": n, "steady_s": round(span, 3),
            "steady_waves": used}


def wave_figures(results: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Per wave: requests, start and end (s after the load's t0), wall, output tokens, tok/s; the load's
    tok/s over the sum of the wave walls, and the CV of the waves' tok/s. Needs per request: wave,
    start, end (against t0), tokens_out, and "error" for failed ones (their tokens do not count)."""
    by_wave: Dict[int, List[Dict[str, Any]]] = {}
    for r in results:
        by_wave.setdefault(r["wave"], []).append(r)
    waves = []
    for w in sorted(by_wave):
        rs = by_wave[w]
        start, end = min(r["start"] for r in rs), max(r["end"] for r in rs)
        toks = sum(r["tokens_out"] for r in rs if "error" not in r)
        ttft = [r["ttft_s"] for r in rs if "error" not in r and "ttft_s" in r]
        waves.append({"wave": w, "requests": len(rs), "start": round(start, 4), "end": round(end, 4),
                      "wall_s": round(end - start, 4), "output_tokens": toks,
                      "tok_s": round(toks / (end - start), 2) if end > start else None,
                      "ttft_max_s": bl.rnd(max(ttft, default=None))})
    walls = sum(w["end"] - w["start"] for w in waves)
    toks = sum(w["output_tokens"] for w in waves)
    return {"waves": waves, "waves_wall_s": round(walls, 3),
            "output_tok_s": round(toks / walls, 2) if walls > 0 else None,
            "wave_tok_s_cv": bl.cv(w["tok_s"] for w in waves)}


async def one_request(session: aiohttp.ClientSession, url: str, body: Any,
                      timeout_s: float) -> Dict[str, Any]:
    """One streamed /completion; body: a dict, or JSON already encoded (bytes)."""
    post = ({"data": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes)
            else {"json": body})
    t0 = time.monotonic()
    r: Dict[str, Any] = {"start": t0}
    content: List[str] = []
    tokens: List[int] = []
    times: List[float] = []   # arrival of each token event (the final stop event is not a token)
    events = 0
    try:
        async with session.post(url + "/completion", **post,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                r["error"] = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return r
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                now = time.monotonic()
                if "ttft_s" not in r:
                    r["ttft_s"] = now - t0
                ev = json.loads(line[5:])
                events += 1
                if not ev.get("stop"):
                    times.append(now)
                if ev.get("content"):
                    content.append(ev["content"])
                tokens.extend(ev.get("tokens") or [])
                if ev.get("stop"):
                    t = ev.get("timings") or {}
                    r.update(prompt_n=t.get("prompt_n"), cache_n=t.get("cache_n"),
                             prompt_ms=t.get("prompt_ms"), predicted_ms=t.get("predicted_ms"),
                             predicted_n=t.get("predicted_n"), id_slot=ev.get("id_slot"))
                    break
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, ValueError) as e:
        r["error"] = f"{type(e).__name__}: {e}"
    r["e2e_s"] = time.monotonic() - t0
    r["end"] = time.monotonic()
    r["events"] = events
    r["tokens_out"] = r.get("predicted_n") or max(events - 1, 0)
    r["content"] = "".join(content)
    r["token_ids"] = tokens
    r["times"] = times
    return r


async def run_load_async(url: str, clients: int, requests: int, prompt_tokens: int, n_predict: int,
                         seed: int, request_timeout_s: float, extra: Optional[Dict[str, Any]] = None,
                         waves: bool = False, wave_gap_s: float = 0.0) -> Dict[str, Any]:
    results: List[Dict[str, Any]] = []

    def body(i: int) -> Dict[str, Any]:
        return {"prompt": prompt_ids(seed, i, prompt_tokens), "n_predict": n_predict,
                "stream": True, "ignore_eos": True, "seed": seed + i, **(extra or {})}

    # force_close: llama-server may close a connection after a streamed response.
    conn = aiohttp.TCPConnector(limit=clients, force_close=True)
    async with aiohttp.ClientSession(connector=conn) as session:
        async def send(i: int, client: int, b: Any, wave: Optional[int] = None) -> None:
            r = await one_request(session, url, b, request_timeout_s)
            r.update(i=i, client=client)
            if wave is not None:
                r["wave"] = wave
            results.append(r)

        if waves:
            for w, lo in enumerate(range(0, requests, clients)):
                if w and wave_gap_s > 0:
                    await asyncio.sleep(wave_gap_s)
                idx = range(lo, min(lo + clients, requests))
                # bodies encoded before the wave starts, so its requests go out within a millisecond
                bodies = [json.dumps(body(i)).encode() for i in idx]
                await asyncio.gather(*(send(i, i - lo, b, w) for i, b in zip(idx, bodies)))
        else:
            queue: asyncio.Queue = asyncio.Queue()
            for i in range(requests):
                queue.put_nowait(i)

            async def worker(client: int) -> None:
                while True:
                    try:
                        i = queue.get_nowait()
                    except asyncio.QueueEmpty:
                        return
                    await send(i, client, body(i))

            await asyncio.gather(*(worker(c) for c in range(clients)))
    out = summarise(results, waves)
    if waves:
        out["wave_gap_s"] = wave_gap_s
    return out


def summarise(results: List[Dict[str, Any]], waves: bool = False) -> Dict[str, Any]:
    """The load's figures from its requests (monotonic start/end/times; see run_load_async). waves:
    the requests carry "wave", and tok/s and the steady figure are taken per wave (module docstring)."""
    results.sort(key=lambda r: r["i"])
    ok = [r for r in results if "error" not in r]
    t0 = min((r["start"] for r in results), default=0.0)
    wall = max((r["end"] for r in results), default=t0) - t0
    toks = sum(r["tokens_out"] for r in ok)
    for r in results:
        r["start"] = round(r["start"] - t0, 4)
        r["end"] = round(r["end"] - t0, 4)
        r["ev"] = encode_times(r.pop("times", []), t0)
    ttft = [r["ttft_s"] for r in ok if "ttft_s" in r]
    e2e = [r["e2e_s"] for r in ok]
    out = {
        "load_mode": "waves" if waves else "free",
        # the wall clock at t0, so start/end (s after t0) can be placed on the census's clock
        "t0_unix_ns": time.time_ns() - time.monotonic_ns() + round(t0 * 1e9),
        "requests": len(results), "ok": len(ok), "errors": len(results) - len(ok),
        "first_errors": [r["error"] for r in results if "error" in r][:5],
        "wall_s": round(wall, 3), "output_tokens": toks,
        "output_tok_s": round(toks / wall, 2) if wall > 0 else None,
        "prompt_tokens": sum(r.get("prompt_n") or 0 for r in ok),
        "cached_tokens": sum(r.get("cache_n") or 0 for r in ok),
        "ttft_p50_s": bl.rnd(bl.quantile(ttft, 0.5)), "ttft_p90_s": bl.rnd(bl.quantile(ttft, 0.9)),
        "e2e_p50_s": bl.rnd(bl.quantile(e2e, 0.5)), "e2e_p90_s": bl.rnd(bl.quantile(e2e, 0.9)),
    }
    if waves and results:
        out.update(wave_figures(results))
        out.update(steady_waves(results))
    else:
        out.update(steady_state(results))
    out["per_request"] = results
    return out


def request_log(res: Dict[str, Any]) -> List[str]:
    """The load's requests as `otel-gpu-census report --request-log` reads them (JSON lines, Unix ns)."""
    t0 = res.get("t0_unix_ns")
    if t0 is None:
        return []
    out = []
    for r in res.get("per_request", []):
        line = {"start_time_unix_nano": t0 + round(r["start"] * 1e9), "end_time_unix_nano": t0 + round(r["end"] * 1e9)}
        if "ttft_s" in r:
            line["first_token_time_unix_nano"] = line["start_time_unix_nano"] + round(r["ttft_s"] * 1e9)
        out.append(json.dumps(line))
    return out


def run_load(url: str, clients: int = 16, requests: int = 64, prompt_tokens: int = 1800,
             n_predict: int = 64, seed: int = 1, request_timeout_s: float = 120,
             total_timeout_s: float = 300, extra: Optional[Dict[str, Any]] = None,
             waves: bool = False, wave_gap_s: float = 0.0) -> Dict[str, Any]:
    """Run the load (free, or in waves of `clients` requests); never raises for server trouble (errors
    are counted in the result)."""
    try:
        return asyncio.run(asyncio.wait_for(
            run_load_async(url, clients, requests, prompt_tokens, n_predict, seed, request_timeout_s, extra,
                           waves, wave_gap_s),
            timeout=total_timeout_s))
    except asyncio.TimeoutError:
        return {"load_mode": "waves" if waves else "free", "requests": requests, "ok": 0, "errors": requests,
                "first_errors": [f"load did not finish within {total_timeout_s} s"], "wall_s": total_timeout_s,
                "output_tokens": 0, "output_tok_s": None, "per_request": []}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=1800)
    ap.add_argument("--n-predict", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--waves", action="store_true",
                    help="send the requests in waves of --clients that start together, each after the "
                         "previous one ended (--requests must be a multiple of --clients)")
    ap.add_argument("--wave-gap-s", type=float, default=0.0, help="--waves: pause between waves (not counted)")
    ap.add_argument("--temperature", type=float, help="sampling temperature (0: greedy, reproducible)")
    ap.add_argument("--request-timeout", type=float, default=120)
    ap.add_argument("--timeout", type=float, default=300, help="bound on the whole run")
    ap.add_argument("--out", help="write the full result JSON here")
    ap.add_argument("--request-log", help="write the requests here as JSON lines (otel-gpu-census report --request-log)")
    a = ap.parse_args()
    for name in ("clients", "requests", "prompt_tokens", "n_predict"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if a.waves and a.requests % a.clients:
        ap.error(f"--waves: --requests ({a.requests}) must be a multiple of --clients ({a.clients}): "
                 "every wave the same size")
    if a.wave_gap_s < 0:
        ap.error("--wave-gap-s must be at least 0")
    extra = {} if a.temperature is None else {"temperature": a.temperature}
    res = run_load(a.url.rstrip("/"), a.clients, a.requests, a.prompt_tokens, a.n_predict, a.seed,
                   a.request_timeout, a.timeout, extra, a.waves, a.wave_gap_s)
    if a.out:
        bl.write_json(__import__("pathlib").Path(a.out), res)
    if a.request_log:
        with open(a.request_log, "w") as f:
            f.writelines(line + "\n" for line in request_log(res))
    print(json.dumps({k: v for k, v in res.items() if k not in ("per_request", "waves")}))
    return 0 if res["ok"] == res["requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
