"""How far each step-attribution method puts a request's kernel time from what the request costs alone.

A request's share of an engine step is an allocation of the step's measured totals (by scheduled
tokens, ``step_tokens``, by estimated FLOPs, ``step_flops``, or by each part's cost alone,
``step_alone``: OTEL_GPU_CENSUS_ATTRIBUTION). The reference is the request served alone, where every
step is its own and every method gives it the step's whole kernel time. The same requests mixed (C
clients at once, short and long prompts, short and long answers) are shared steps: the closer a
method's shares follow the alone costs, the better it holds in mixed batches.

    python3 bench/device/attribution_error.py --out RESULT.json [--per-class 12] [--mixed 16,48]

starts a vLLM server per method (--methods) on the GPU under ``otel-gpu-census run`` (the
integration loads through vLLM's plugin entry point; bench/device/vllm_e2e.py's Server, the random
160M Llama), with prefix caching off; on each it runs every request alone (one at a time), then all of them mixed at
each concurrency of --mixed, each phase with prompts of its own (random token ids of the class's
length, so no phase reuses another's KV cache), and reads each request's kernel time from the
engine's request log (``gpu-census-*.requests.jsonl``: the span's figures). ``--servers
tokens=URL,DIR;flops=URL,DIR`` (with --methods naming them) uses servers that already run (their
census folders given): the CPU test runs this against stand-ins (tests/support/vllm_steps_standin.py).

Error, per request of a mixed phase: mixing makes every request cheaper (the steps are shared), so
shares are compared after scaling them to the alone costs' total, s = sum(mixed) / sum(alone):
e = mixed / s / alone - 1. Per class of request and over all: the mean |e| (``mae``), the mean e
(``bias``: + overcharged, - undercharged), the median unscaled mixed / alone. Requests whose share
was not complete are left out and counted. The alone phases of the servers measure the same
requests again: each one's difference per class from the first server's (``alone_agreement``, by
method) is the noise floor of comparing the two. JSON after every phase; the checks that fail are
listed and the exit code is 1.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_e2e  # noqa: E402  (bench/device: Server, read_census, random_model, check)

# class -> (prompt tokens, output tokens); --long-prompt sets the long classes' prompts
CLASSES = {"short-short": (48, 16), "short-long": (48, 192), "long-short": (1536, 16), "long-long": (1536, 192)}
METHODS = ("tokens", "flops", "alone")      # --methods: the servers, one a method
VOCAB = (100, 30000)                 # prompt token ids are drawn from here (the random Llama has 32,000)
PORTS = {"tokens": 8111, "flops": 8112, "alone": 8113}
T0 = time.time()


def plan(per_class: int, seed: int) -> List[dict]:
    """The requests, classes interleaved in a seeded order (the same in every phase and server)."""
    specs = [{"cls": c, "prompt": p, "max_tokens": n} for c, (p, n) in CLASSES.items() for _ in range(per_class)]
    random.Random(seed).shuffle(specs)
    return specs


async def _one(session, url: str, spec: dict, rnd: random.Random) -> dict:
    body = {"model": "m", "prompt": [rnd.randrange(*VOCAB) for _ in range(spec["prompt"])],
            "max_tokens": spec["max_tokens"], "ignore_eos": True, "temperature": 0.0, "stream": False}
    t0 = time.time()
    try:
        async with session.post(f"{url}/v1/completions", json=body) as r:
            ans = await r.json(content_type=None)
            if r.status != 200:
                return {"error": f"HTTP {r.status}: {str(ans)[:200]}"}
    except Exception as e:
        return {"error": repr(e)[:200]}
    return {"id": ans.get("id"), "tokens": (ans.get("usage") or {}).get("completion_tokens"), "s": round(time.time() - t0, 4)}


async def run_phase(url: str, specs: List[dict], concurrency: int, seed: int) -> List[dict]:
    """Every request of `specs` through `concurrency` clients (1: one at a time); their answers, in order."""
    import aiohttp
    rnd = random.Random(seed)
    rnds = [random.Random(rnd.getrandbits(64)) for _ in specs]
    out: List[Optional[dict]] = [None] * len(specs)
    todo = list(range(len(specs)))

    async def client(s):
        while todo:
            i = todo.pop(0)
            out[i] = {**await _one(s, url, specs[i], rnds[i]), "cls": specs[i]["cls"]}

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        await asyncio.gather(*(client(s) for _ in range(max(1, concurrency))))
    return out


def logged(census_dir: Path) -> Dict[str, dict]:
    """The engine's request log lines, by the id of the response their client got."""
    _, lines = vllm_e2e.read_census(census_dir)
    return {x.get("response_id") or x.get("id"): x for x in lines if "gpu" in x}


def wait_logged(census_dir: Path, ids: List[str], timeout_s: float = 30.0) -> Dict[str, dict]:
    """The log lines of `ids`, once all are there (or the timeout)."""
    deadline = time.time() + timeout_s
    while True:
        got = logged(census_dir)
        if all(i in got for i in ids) or time.time() > deadline:
            return got
        time.sleep(0.2)


def phase_rows(answers: List[dict], lines: Dict[str, dict]) -> List[dict]:
    """Per request: its class, response id, and the share its log line gives (None where missing)."""
    rows = []
    for a in answers:
        line = lines.get(a.get("id")) if a.get("id") else None
        rows.append({"cls": a["cls"], "id": a.get("id"), "error": a.get("error"),
                     "kernel_ns": (line or {}).get("gpu", {}).get("kernel.time_ns"),
                     "status": (line or {}).get("status"), "steps": (line or {}).get("steps"),
                     "method": (line or {}).get("method")})
    return rows


def _usable(r: dict) -> bool:
    return r.get("status") == "complete" and isinstance(r.get("kernel_ns"), int) and r["kernel_ns"] > 0


def errors(alone: List[dict], mixed: List[dict]) -> dict:
    """The error of each mixed request's share against its alone cost (module docstring), per class and all."""
    pairs = [(a, m) for a, m in zip(alone, mixed) if _usable(a) and _usable(m)]
    out: dict = {"requests": len(pairs), "left_out": len(mixed) - len(pairs)}
    if not pairs:
        return out
    scale = sum(m["kernel_ns"] for _, m in pairs) / sum(a["kernel_ns"] for a, _ in pairs)
    per = [(a["cls"], m["kernel_ns"] / scale / a["kernel_ns"] - 1, m["kernel_ns"] / a["kernel_ns"]) for a, m in pairs]

    def stats(xs):
        es = [e for _, e, _ in xs]
        return {"n": len(xs), "mae": round(statistics.fmean(abs(e) for e in es), 4), "bias": round(statistics.fmean(es), 4),
                "ratio_median": round(statistics.median(r for _, _, r in xs), 4)}
    out["scale"] = round(scale, 4)
    out["all"] = stats(per)
    out["by_class"] = {c: stats([x for x in per if x[0] == c]) for c in dict.fromkeys(x[0] for x in per)}
    return out


def agreement(a: List[dict], b: List[dict]) -> dict:
    """Per class, the median relative difference of one request's alone cost on two servers."""
    out = {}
    for c in CLASSES:
        d = [abs(x["kernel_ns"] - y["kernel_ns"]) / y["kernel_ns"] for x, y in zip(a, b)
             if x["cls"] == c and _usable(x) and _usable(y)]
        if d:
            out[c] = round(statistics.median(d), 4)
    return out


def start_servers(out: Path, census_base: Path, run_args: List[str], gpu_mem: float, size: str = "small",
                  max_len: int = 2048) -> Dict[str, tuple]:
    model = vllm_e2e.random_model(size=size)
    servers = {}
    for method in METHODS:
        env = {"OTEL_GPU_CENSUS_ATTRIBUTION": method, "OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none"}
        servers[method] = vllm_e2e.Server(f"attr-{method}", PORTS[method], model, out, census_dir=census_base / method,
                                          extra=["--no-enable-prefix-caching", "--max-model-len", str(max_len)],
                                          env=env, gpu_mem=gpu_mem,
                                          run_args=run_args)
        time.sleep(3)                    # not both measuring free GPU memory at the same moment
    return servers


def main(argv=None) -> int:
    global T0, METHODS, CLASSES
    T0 = time.time()           # the budget counts from this run, not from the import
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="the JSON result (a .json path)")
    ap.add_argument("--per-class", type=int, default=12, help="requests of each class (four classes)")
    ap.add_argument("--mixed", default="16,48", help="concurrencies of the mixed phases")
    ap.add_argument("--seed", type=int, default=43)
    ap.add_argument("--budget-s", type=float, default=220.0, help="no phase starts past this many seconds")
    ap.add_argument("--servers", default="", help="tokens=URL,DIR;flops=URL,DIR: servers already running")
    ap.add_argument("--run-args", default="", help="more arguments of `otel-gpu-census run` (e.g. --precise)")
    ap.add_argument("--gpu-mem", type=float, default=0.25, help="--gpu-memory-utilization of each server")
    ap.add_argument("--methods", default=",".join(METHODS), help="OTEL_GPU_CENSUS_ATTRIBUTION values, one server each")
    ap.add_argument("--model-size", default="small", help="small (160M, launch-bound) or a size of vllm_model_sizes.py "
                                                           "(1b: attention's growth with context shows)")
    ap.add_argument("--long-prompt", type=int, default=0, help="prompt tokens of the long classes (default 1536)")
    a = ap.parse_args(argv)
    METHODS = tuple(m for m in a.methods.split(",") if m)
    if a.long_prompt:
        CLASSES = {c: (a.long_prompt if c.startswith("long-") else p, n) for c, (p, n) in CLASSES.items()}
    max_len = max(2048, max(p + n for p, n in CLASSES.values()) + 64)   # the longest request fits
    out_path = Path(a.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    levels = [int(x) for x in a.mixed.split(",") if x]
    specs = plan(a.per_class, a.seed)
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv), "classes": CLASSES,
                 "per_class": a.per_class, "mixed": levels, "checks_failed": vllm_e2e.FAILS, "servers": {}}
    started = {}
    if a.servers:
        targets = {}
        for part in a.servers.split(";"):
            method, _, rest = part.partition("=")
            url, _, d = rest.partition(",")
            targets[method.strip()] = (url.strip(), Path(d.strip()))
    else:
        import vllm
        res["versions"] = {"vllm": vllm.__version__}
        census_base = Path("/tmp/attr-census")
        started = start_servers(out_path.parent, census_base, a.run_args.split(), a.gpu_mem, a.model_size,
                                max_len)
        res["model_size"] = a.model_size
        targets = {m: (f"http://127.0.0.1:{PORTS[m]}", census_base / m) for m in started}

    def save():
        out_path.write_text(json.dumps(res, indent=1, default=str))
    try:
        for m, srv in started.items():
            vllm_e2e.check(srv.wait(300), f"{m}: server up")
            res["servers"].setdefault(m, {})["ready_s"] = round(getattr(srv, "ready_s", -1), 1)
        for m, (url, census_dir) in targets.items():
            srv = res["servers"].setdefault(m, {})
            asyncio.run(run_phase(url, plan(1, a.seed + 1), 4, a.seed + 1))     # warm-up: graphs, allocator
            for name, conc in [("alone", 1)] + [(f"mixed@{c}", c) for c in levels]:
                if time.time() - T0 > a.budget_s:
                    srv.setdefault("skipped", []).append(name)
                    continue
                t = time.time()
                answers = asyncio.run(run_phase(url, specs, conc, a.seed * 1000 + conc))
                lines = wait_logged(census_dir, [x["id"] for x in answers if x.get("id")])
                srv[name] = {"s": round(time.time() - t, 2), "rows": phase_rows(answers, lines)}
                rows = srv[name]["rows"]
                vllm_e2e.check(all(r["kernel_ns"] is not None for r in rows), f"{m} {name}: every request answered and logged")
                if name != "alone":         # alone, both methods give a request its steps' whole
                    vllm_e2e.check(all(r["method"] == f"step_{m}" for r in rows if r["method"]),
                                   f"{m} {name}: the engine splits its steps by {m}")
                save()
        for c in levels:
            res.setdefault("errors", {})[f"mixed@{c}"] = {
                m: errors(res["servers"][m]["alone"]["rows"], res["servers"][m][f"mixed@{c}"]["rows"])
                for m in targets if f"mixed@{c}" in res["servers"][m] and "alone" in res["servers"][m]}
            got = res["errors"][f"mixed@{c}"]
            if all(m in got and "all" in got[m] for m in METHODS):
                res.setdefault("closer", {})[f"mixed@{c}"] = min(METHODS, key=lambda m: got[m]["all"]["mae"])
        first = res["servers"].get(METHODS[0], {}).get("alone")
        if first:     # each server's alone phase against the first's: the noise floor of each comparison
            res["alone_agreement"] = {m: agreement(first["rows"], res["servers"][m]["alone"]["rows"])
                                      for m in METHODS[1:] if "alone" in res["servers"].get(m, {})}
    finally:
        for m, srv in started.items():
            res["servers"].setdefault(m, {})["stop"] = srv.stop(signal.SIGINT)
        for m, (_, census_dir) in targets.items():
            summ = [x["summary"] for x in vllm_e2e.read_census(census_dir)[1] if "summary" in x]
            if summ:
                res["servers"].setdefault(m, {})["summary"] = summ[-1]
        save()
    print(json.dumps({"errors": res.get("errors"), "closer": res.get("closer"),
                      "alone_agreement": res.get("alone_agreement")}, indent=1), flush=True)
    return 1 if vllm_e2e.FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
