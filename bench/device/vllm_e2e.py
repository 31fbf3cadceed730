"""vLLM under the census, end to end, on the GPU machine: spans in the caller's trace, exact
conservation, per-request copies with and without KV offloading, throughput beside plain vLLM, and
start/stop cycles. One command (bench/device/run.sh vllm, after the wheel set is in place):

    python3 bench/device/vllm_e2e.py --out DIR [--only spans,traced,throughput,cycles,phases,toggle,kv,kv-plain,tp]

Three servers share the GPU (a random 160M Llama is small): P plain vLLM, C vLLM under
`otel-gpu-census run` (the integration loads itself through vLLM's plugin entry point), K the same
with --kv-offloading-size, V the census with vLLM's own tracing on (`traced`: vLLM's llm_request span under
ours, one SERVER span a request). `phases`: one server under the census (R) whose census modes are switched
in alternating phases through the control file (off / events), beside plain vLLM (P) for the fixed
cost of the integration; `--phase-beside P,Q,N,S,X` loads more servers after each round (BESIDE says
what each is), so that a fixed cost splits into its parts: two plain servers' own spread, the
launcher, the paused injector, the integration, its export. `toggle`: R alone under one long load, its census switched
(--phase-modes) every --toggle-slot seconds in pairs (random order), each slot rated by the server's own token
counter: vLLM's 3 s windows spread ±15 % from one to the next on the GPU machine, which phases of a few
seconds apart cannot average away; adjacent slots of one load share whatever drifts slower than a pair.
Every figure lands in DIR/vllm_e2e.json; the checks that fail are listed in it and the exit code is 1.
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import proc_cpu  # noqa: E402  (bench/device/proc_cpu.py)
sys.path.insert(0, str(ROOT / "bench" / "server"))
from toggle_slots import ORDERS, toggle_pairs, toggle_slots, toggle_summary  # noqa: E402,F401  (toggle_pairs: vllm_e2e.toggle_pairs)

VLLM_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()
FAILS: list = []
T0 = time.time()     # --budget-s counts from here


def random_model(path: str = "/tmp/vllm-model", size: str = "small") -> str:
    """A random-weight Llama, made once: the 160M one (../shared/vllm-offline/vllm_model.py, carried as
    .vllm/part3), or a larger `size` of vllm_model_sizes.py (beside this file) in `path`-`size`."""
    if size != "small":
        path = f"{path}-{size}"
    if not Path(path, "config.json").exists():
        writer = [str(ROOT / ".vllm/part3/vllm_model.py")] if size == "small" else \
            [str(Path(__file__).resolve().parent / "vllm_model_sizes.py"), "--size", size]
        subprocess.run([sys.executable, writer[0], path, *writer[1:]], check=True)
    return path


def check(ok: bool, what: str) -> bool:
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        FAILS.append(what)
    return ok


def otlp_receiver():
    from otlp_receiver import OtlpReceiver      # tests/support: the tests' one receiver, both signals
    return OtlpReceiver(grpc_enabled=False)


class Server:
    def __init__(self, name, port, model, out: Path, census_dir=None, extra=(), env=None, gpu_mem=0.2, cache=None,
                 cpus=None, run_args=()):
        self.name, self.port, self.census_dir = name, port, census_dir
        e = dict(os.environ, **VLLM_ENV, **(env or {}))
        e["OTEL_SERVICE_NAME"] = f"vllm-{name}"
        # servers started together must not compile into one cache (a cycle slot reuses its own wave after wave)
        cache = cache or f"/tmp/vc-{name}"
        e.update(VLLM_CACHE_ROOT=cache, TRITON_CACHE_DIR=cache + "/triton")
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, "--port", str(port),
               "--host", "127.0.0.1", "--gpu-memory-utilization", str(gpu_mem), "--max-model-len", "2048",
               "--served-model-name", "m", *extra]
        if census_dir is not None:
            e["OTEL_GPU_CENSUS_DIR"] = str(census_dir)
            cmd = [sys.executable, "-m", "otel_gpu_census.cli", "run", "--exporter", "none", *run_args, "--"] + cmd
        if cpus:                        # --pin: the server's whole tree on CPUs of its own (children inherit it)
            cmd = ["taskset", "-c", cpus] + cmd
        self.cpus = cpus
        self.log = open(out / f"server-{name}.log", "w")
        self.proc = subprocess.Popen(cmd, env=e, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.t0 = time.time()

    def wait(self, timeout=420) -> bool:
        import urllib.request
        while time.time() - self.t0 < timeout:
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        self.ready_s = time.time() - self.t0
                        return True
            except Exception:
                time.sleep(1)
        return False

    def stop(self, sig=signal.SIGINT, timeout=90) -> dict:
        t = time.time()
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)         # to `run` (or vllm): run forwards it
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            rc = "hung"
        if sig == signal.SIGKILL:       # the whole group: vLLM's own processes too (a port left taken
            try:                        # made the next call's benchmark measure a stale server)
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.log.close()
        return {"rc": rc, "stop_s": round(time.time() - t, 2)}


async def _request(s, port, rnd, max_tokens, prompt_words, stream, results, errors):
    """One /v1/completions with its own traceparent; its record into results, or its error into errors."""
    tid, sid = f"{rnd.getrandbits(128):032x}", f"{rnd.getrandbits(64):016x}"
    body = {"model": "m", "prompt": " ".join(rnd.choice(WORDS) for _ in range(prompt_words)),
            "max_tokens": max_tokens, "stream": stream, "ignore_eos": True}
    t0 = time.time_ns()
    first, ntok, rid = None, 0, None
    try:
        async with s.post(f"http://127.0.0.1:{port}/v1/completions", json=body,
                          headers={"traceparent": f"00-{tid}-{sid}-01"}) as r:
            if r.status != 200:
                errors.append(r.status)
                return
            if not stream:
                ans = await r.json()
                rid, ntok = ans.get("id"), int((ans.get("usage") or {}).get("completion_tokens") or 0)
            else:
                async for line in r.content:
                    if line.startswith(b"data: ") and b"[DONE]" not in line:
                        ev = json.loads(line[6:])
                        rid = rid or ev.get("id")
                        if ev.get("choices") and ev["choices"][0].get("text") is not None:
                            first = first or time.time_ns()
                            ntok += 1
    except Exception as e:
        errors.append(repr(e)[:200])
        return
    results.append({"trace_id": tid, "span_id": sid, "id": rid, "tokens": ntok, "max_tokens": max_tokens,
                    "start_ns": t0, "end_ns": time.time_ns(), "ttft_s": (first - t0) / 1e9 if first else None})


async def load(port, clients, per_client, max_tokens, seed=0, prompt_words=64, stream=True):
    """Concurrent /v1/completions. stream=False: one JSON answer per request (tokens from its usage),
    so the client parses 1 event a request instead of 1 a token: at ~7,000 tokens a second a Python
    streaming client on the server's own cores is a bottleneck of its own (no TTFT then)."""
    import aiohttp
    results, errors = [], []

    async def client(s, cid):
        rnd = random.Random(seed * 1000 + cid)
        for _ in range(per_client):
            await _request(s, port, rnd, max_tokens, prompt_words, stream, results, errors)

    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        await asyncio.gather(*(client(s, c) for c in range(clients)))
    el = time.perf_counter() - t0
    toks = sum(r["tokens"] for r in results)
    return {"requests": results, "errors": errors, "elapsed_s": el, "tok_per_s": toks / el if el else 0.0}


GENERATED = "vllm:generation_tokens_total"      # vLLM's counter of output tokens, updated every step


async def generated_tokens(s, port) -> float:
    """The server's own count of the tokens it generated (summed over engines), from /metrics."""
    async with s.get(f"http://127.0.0.1:{port}/metrics") as r:
        text = await r.text()
    got = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
           if line.startswith(GENERATED + "{") or line.startswith(GENERATED + " ")]
    if not got:
        raise RuntimeError(f"{GENERATED} not in the server's /metrics")
    return sum(got)


class ClosedLoop:
    """`clients` closed-loop clients of /v1/completions (each sends its next request once its last is answered,
    non-streaming, each request its own length in `tokens`) while the block runs; mark() reads the server's own
    generated-token counter (and when). On leaving, no new request is sent and the ones in flight finish."""

    def __init__(self, port, clients, tokens, seed, prompt_words):
        self.port, self.clients, self.tokens, self.seed, self.words = port, clients, tokens, seed, prompt_words
        self.results: list = []
        self.errors: list = []
        self._stop = asyncio.Event()

    async def _client(self, cid):
        rnd = random.Random(self.seed * 1000 + cid)
        while not self._stop.is_set():
            await _request(self._s, self.port, rnd, rnd.randint(*self.tokens), self.words, False, self.results,
                           self.errors)

    async def mark(self):
        t = time.perf_counter()
        n = await generated_tokens(self._s, self.port)
        return n, (t + time.perf_counter()) / 2

    async def __aenter__(self):
        import aiohttp
        self._s = await aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)).__aenter__()
        self._tasks = [asyncio.create_task(self._client(c)) for c in range(self.clients)]
        return self

    async def __aexit__(self, *exc):
        self._stop.set()
        try:
            await asyncio.gather(*self._tasks)
        finally:
            await self._s.__aexit__(*exc)


async def window_load(port, clients, ramp_s, window_s, tokens=(64, 192), seed=0, prompt_words=64, root=None):
    """Closed-loop clients (each sends its next request when its last is answered, non-streaming) for
    ramp_s + window_s, then each finishes the request it has in flight (none is cut). The rate is the
    server's own generated-token counter over the window alone, read at its two ends: no ramp, no tail.
    Each request asks for its own number of tokens (uniform in `tokens`), so that the clients do not
    move in waves that end together (with one length for all, a window holds whole waves or not).
    root: the server's pid; its process tree's CPU over the window is added (proc_cpu.py), per role."""
    t0 = time.perf_counter()
    async with ClosedLoop(port, clients, tokens, seed, prompt_words) as cl:
        await asyncio.sleep(ramp_s)
        c0 = proc_cpu.snapshot(root) if root else None
        h0 = proc_cpu.host()
        p0 = time.process_time()        # this process: the clients (and the OTLP receiver's threads)
        (n0, w0) = await cl.mark()
        await asyncio.sleep(window_s)
        (n1, w1) = await cl.mark()
        c1 = proc_cpu.snapshot(root) if root else None
        h1 = proc_cpu.host()
        p1 = time.process_time()
    results, errors = cl.results, cl.errors
    el = time.perf_counter() - t0
    toks = sum(r["tokens"] for r in results)
    return {"requests": results, "errors": errors, "elapsed_s": el, "tok_per_s": (n1 - n0) / (w1 - w0),
            "window": {"tokens": n1 - n0, "s": w1 - w0}, "client_tok_per_s": toks / el if el else 0.0,
            "host": proc_cpu.host_delta(h0, h1),
            **({"cpu": {**proc_cpu.delta(c0, c1), "bench": {"cpu_s": p1 - p0, "processes": 1, "threads": {}}}}
               if root else {})}


async def toggle_load(port, clients, ramp_s, seconds, slot_s, switch, modes=("off", "events"), seed=0, root=None,
                      tokens=(64, 192), prompt_words=64, order="random", tick_s=0.0):
    """One closed-loop load (window_load's clients) for ramp_s, then for `seconds` the server's census switched
    between `modes` in slots of slot_s (bench/server/toggle_slots.py: pairs in `order`, `switch(mode)` blocks until the
    segment shows it), each slot rated by the server's own token counter between the switch having taken and the
    slot's end (and every tick_s inside it: `marks`). root: the server's pid; its tree's CPU a slot is added per role
    (proc_cpu)."""
    async with ClosedLoop(port, clients, tokens, seed, prompt_words) as cl:
        await asyncio.sleep(ramp_s)
        slots = await toggle_slots(cl, seconds, slot_s, switch, modes, root=root, order=order, seed=seed,
                                   tick_s=tick_s)
    return {"slots": slots, "requests": cl.results, "errors": cl.errors}


def tokens_arg(v: str):
    """--toggle-tokens LO,HI: 1 <= LO <= HI <= 1,900 (the prompt's ~100 tokens beside them fit 2,048)."""
    try:
        lo, hi = (int(x) for x in v.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"LO,HI of whole numbers, not {v!r}") from None
    if not 1 <= lo <= hi <= 1900:
        raise argparse.ArgumentTypeError(f"1 <= LO <= HI <= 1900, not {v!r}")
    return lo, hi


def toggle_run(a, out, base, servers, rx=None) -> dict:
    """R alone, one long load, its census switched off / events in slots (toggle_load); then R stopped and its
    spans conserved (requests that ran across switches included)."""
    sys.path.insert(0, str(ROOT / "bench" / "server"))
    from control_phases import Phases
    r = servers["R"]
    asyncio.run(load(r.port, 4, 2, 16))
    check(counter_readable(r.port), f"R: {GENERATED} counts (--only toggle)")
    res = {"waited_for_quiet_s": wait_quiet()}
    ph = Phases(base / "R")
    modes = tuple(a.phase_modes.split(","))
    ramp_s = a.phase_window[0] if a.phase_window else 2.0
    left = a.budget_s - (time.time() - T0) - 60        # the stop and the checks
    seconds = max(min(a.toggle_s, left), 4 * a.toggle_slot)
    lo, hi = a.toggle_tokens
    got = asyncio.run(toggle_load(r.port, a.phase_clients, ramp_s, seconds, a.toggle_slot, ph.set, modes=modes,
                                  seed=a.toggle_seed, root=r.proc.pid, tokens=(lo, hi), order=a.toggle_order,
                                  tick_s=a.toggle_tick))
    res.update(slots=got["slots"], requests=len(got["requests"]), errors=len(got["errors"]),
               load=f"{a.phase_clients} closed-loop non-streaming clients, each request {lo}-{hi} tokens, one load of "
                    f"{seconds:.0f} s after {ramp_s} s of ramp; R's census switched {'/'.join(modes)} every "
                    f"{a.toggle_slot} s, pairs in {a.toggle_order} order; tok/s = the server's {GENERATED} over each slot",
               **toggle_pairs(got["slots"], modes, settle_s=a.toggle_settle))
    check(all(sl["switched"] for sl in got["slots"]), "R: every slot switched the census")
    check(not got["errors"], f"R: load without errors ({len(got['errors'])})")
    print("toggle", toggle_summary(res), flush=True)
    res["stop_R"] = servers.pop("R").stop()
    if rx is not None:
        res["spans_R"] = {"_out": str(out)}
        time.sleep(2)
        conservation_check("R", base / "R", [s for s in rx.span_snapshot()
                                             if s.resource.get("service.name") == "vllm-R"], res["spans_R"])
    return res


def summary(load_res):
    r = load_res["requests"]
    ttft = sorted(x["ttft_s"] for x in r if x["ttft_s"] is not None) or [float("nan")]
    out = {"requests": len(r), "errors": len(load_res["errors"]), "tok_per_s": round(load_res["tok_per_s"], 1),
           "ttft_p50_s": round(ttft[len(ttft) // 2], 4)}
    if "window" in load_res:        # a window load: what the server counted, and the clients' own rate
        out["window"] = {"tokens": load_res["window"]["tokens"], "s": round(load_res["window"]["s"], 4),
                         "client_tok_per_s": round(load_res["client_tok_per_s"], 1)}
        if "host" in load_res:      # the whole machine over the window: busy, idle, stolen by the hypervisor
            out["host"] = load_res["host"]
    if "cpu" in load_res:           # CPU ms per 1,000 generated tokens, per process role and busiest threads
        k = 1e6 / max(load_res["window"]["tokens"], 1)
        out["cpu_ms_per_ktok"] = {r: {"all": round(v["cpu_s"] * k, 2), "n": v["processes"],
                                      **{t: round(x * k, 2) for t, x in v["threads"].items()}}
                                  for r, v in load_res["cpu"].items()}
        out["cpu_cores"] = {r: round(v["cpu_s"] / load_res["window"]["s"], 3) for r, v in load_res["cpu"].items()}
        # seconds a role's threads were ready with no CPU to run on, per second of the window
        out["run_queue_wait"] = {r: round(v.get("wait_s", 0.0) / load_res["window"]["s"], 3)
                                 for r, v in load_res["cpu"].items()}
    return out


def counter_readable(port) -> bool:
    """The server's generated-token counter is there and has counted (called after a warm-up load)."""
    async def read():
        import aiohttp
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            return await generated_tokens(s, port)
    try:
        return asyncio.run(read()) > 0
    except Exception as e:
        print(f"port {port}: {e!r}", flush=True)
        return False


def read_census(census_dir: Path):
    from otel_gpu_census.census import reader
    segs = [reader.read_segment(str(p)) for p in sorted(census_dir.glob("*.seg"))]
    logs = []
    for p in sorted(census_dir.glob("*.requests.jsonl")):
        logs += [json.loads(l) for l in p.read_text().splitlines() if l.strip()]
    return segs, logs


def spans_check(rx, load_res, name, census_dir, res):
    """One span per request, in the client's trace, under the client's span, with GPU attributes."""
    want = {r["id"]: r for r in load_res["requests"] if r["id"]}
    try:
        spans = rx.wait_for_spans(lambda ss: len([s for s in ss if s.resource.get("service.name") == f"vllm-{name}"
                                            and s.attributes.get("gen_ai.response.id") in want]) >= len(want),
                            timeout=30)
    except AssertionError:          # not all came: the checks below say how many did
        spans = rx.span_snapshot()
    res["spans_of_server"] = len([s for s in spans if s.resource.get("service.name") == f"vllm-{name}"])
    ours = {s.attributes.get("gen_ai.response.id"): s for s in spans
            if s.resource.get("service.name") == f"vllm-{name}" and s.attributes.get("gen_ai.response.id") in want}
    res["spans"] = len(ours)
    check(len(ours) == len(want) and len(want) > 0, f"{name}: one span per request ({len(ours)} of {len(want)})")
    joined = [s for rid, s in ours.items() if s.trace_id == want[rid]["trace_id"]
              and s.parent_span_id == want[rid]["span_id"]]
    check(len(joined) == len(ours), f"{name}: every span in its client's trace, under the client's span "
                                    f"({len(joined)} of {len(ours)})")
    k = [s.attributes.get("gpu_census.kernel.count", 0) for s in ours.values()]
    check(all(x > 0 for x in k), f"{name}: every span has kernels attributed")
    check(all(s.attributes.get("gpu_census.attribution.method") == "step_tokens" for s in ours.values()),
          f"{name}: attribution by steps")
    # ignore_eos: every request generates exactly max_tokens (the stream may carry several per event)
    check(all(s.attributes.get("gen_ai.usage.output_tokens") == want[rid]["max_tokens"] for rid, s in ours.items()),
          f"{name}: output tokens as requested (ignore_eos)")
    # one step per output token at least (prefill chunks add steps): a request short of steps lost the
    # share of those it missed (2026-12-02, s4 and s5: steps read before their records came, fixed since)
    short = [rid for rid, s in ours.items()
             if s.attributes.get("gpu_census.attribution.steps", 0) < want[rid]["max_tokens"]]
    res["short_of_steps"] = len(short)
    check(not short, f"{name}: every request served by a step per output token at least ({len(short)} short)")
    res["span_sample"] = {k2: v for k2, v in next(iter(ours.values())).attributes.items()} if ours else {}
    res["per_request_dtoh_bytes"] = [s.attributes.get("gpu_census.copy.dtoh.bytes", 0) for s in ours.values()]
    res["per_request_kernel_ns"] = [span_figure(s.attributes, "kernel.time_ns") for s in ours.values()]
    return ours


def traced_check(rx, ours, res) -> None:
    """vLLM's tracing on: each request's llm_request span (vLLM's, SERVER) is the child of ours (INTERNAL), so
    the client's trace holds one SERVER span a request."""
    def theirs_of(spans):
        return [x for x in spans if x.name == "llm_request" and x.resource.get("service.name") == "vllm-V"]
    try:      # vLLM's batch processor exports on its own schedule
        spans = rx.wait_for_spans(lambda ss: len(theirs_of(ss)) >= len(ours), timeout=30)
    except AssertionError:
        spans = rx.span_snapshot()
    by_parent: dict = {}
    for x in theirs_of(spans):
        by_parent.setdefault((x.trace_id, x.parent_span_id), []).append(x)
    under = [s for s in ours.values() if len(by_parent.get((s.trace_id, s.span_id), [])) == 1]
    res["traced"] = {"ours": len(ours), "llm_request": len(theirs_of(spans)), "llm_request_under_ours": len(under),
                     "kinds": sorted({(s.kind, x.kind) for s in under for x in by_parent[(s.trace_id, s.span_id)]})}
    check(len(under) == len(ours) > 0, f"V: vLLM's llm_request span under ours, one a request ({len(under)} of {len(ours)})")
    servers_a_trace = {}
    for x in spans:
        if x.resource.get("service.name") == "vllm-V" and x.kind == "server":
            servers_a_trace[x.trace_id] = servers_a_trace.get(x.trace_id, 0) + 1
    one = [s for s in ours.values() if s.kind == "internal" and servers_a_trace.get(s.trace_id) == 1]
    check(len(one) == len(ours), f"V: ours INTERNAL, one SERVER span in each request's trace ({len(one)} of {len(ours)})")


FIELDS = ("kernel.count", "kernel.time_ns", "copy.htod.bytes", "copy.dtoh.bytes", "copy.dtod.bytes")


def span_figure(attrs, f: str) -> int:
    """A request-log field (`FIELDS`) as its span carries it: times are ``gpu_census.<what>.time`` in
    seconds there (telemetry/attributes.py), whose round(x * 1e9) is the request log's exact ns."""
    if f.endswith(".time_ns"):
        return round(attrs.get(f"gpu_census.{f[:-3]}", 0) * 1e9)
    return attrs.get(f"gpu_census.{f}", 0)


def conservation_check(name, census_dir, all_spans, res) -> list:
    """Sum of the spans' shares + what no request claimed == the steps the ledger split, every field;
    and those steps + the work outside steps == the census totals. Returns the request log's lines."""
    segs, logs = read_census(census_dir)
    for p in census_dir.glob("*.requests.jsonl"):
        (Path(res.get("_out", "/tmp")) / f"{name}-{p.name}").write_bytes(p.read_bytes())
    summ = [l["summary"] for l in logs if "summary" in l]
    res["segments"] = [{"pid": s.pid, "comm": s.comm, "state": s.state_name, "kernels": s.totals().kernel_count,
                        "step_max": s.step_max, "step_unmatched": s.step_unmatched} for s in segs]
    check(any(s.state_name == "exited" for s in segs), f"{name}: the engine's segment is complete (final flush ran)")
    if not check(len(summ) == 1, f"{name}: the engine wrote its ledger summary"):
        return logs
    sm = summ[0]
    res["ledger"] = sm
    reqs = [l for l in logs if "gpu" in l]
    estimated = sum(1 for l in reqs if l.get("kernel_time_estimated"))
    for f in FIELDS:
        from_spans = sum(span_figure(s.attributes, f) for s in all_spans)
        from_log = sum(l["gpu"].get(f, 0) for l in reqs)
        check(from_spans == from_log, f"{name}: {f}: spans {from_spans:,} == request log {from_log:,}")
        if f == "kernel.time_ns" and estimated and not sm.get("kernel_time_conserved"):
            # a ledger that priced each request's share on its own (before each step was priced once and
            # split): its estimates add up to no step total; its error is checked against the every-kernel
            # phases instead (estimate_check)
            res["kernel_time_estimated_requests"] = estimated
            res["kernel_time_ns_requests_vs_steps_records"] = [from_log, sm["total"].get(f, 0)]
            continue
        if f == "kernel.time_ns" and estimated:
            # each step's kernel time priced once and split: the requests' estimates add up to the steps' exactly
            res["kernel_time_estimated_requests"] = estimated
            res["kernel_time_unpriced"] = sm.get("kernel_time_unpriced", {})
        check(from_log + sm["unattributed"].get(f, 0) == sm["total"].get(f, 0),
              f"{name}: {f}: requests {from_log:,} + unattributed {sm['unattributed'].get(f, 0):,} == steps "
              f"{sm['total'].get(f, 0):,}")
    eng = [s for s in segs if s.step_max]
    if eng:
        t = eng[0].totals()
        res["census_totals"] = {"kernel.count": t.kernel_count, "kernel.time_ns": t.kernel_ns,
                                "copy.dtoh.bytes": t.copies.get("dtoh").bytes, "copy.htod.bytes": t.copies.get("htod").bytes}
        check(sm["total"]["kernel.count"] <= t.kernel_count, f"{name}: steps within the census totals")
        res["outside_steps"] = {k: res["census_totals"][k] - sm["total"].get(k, 0) for k in res["census_totals"]}
    return logs


def wait_quiet(limit_s=420) -> float:
    """Wait until no build runs on the machine (the llama.cpp build may still run in the background):
    throughput is measured on a quiet machine. Returns the seconds waited."""
    t0 = time.time()
    while time.time() - t0 < limit_s:
        if subprocess.run(["pgrep", "-f", "cmake --build|cc1plus|nvcc|ptxas|cicc"], capture_output=True).returncode:
            break
        time.sleep(2)
    return round(time.time() - t0, 1)


# Servers loaded beside R after each round of its phases (--phase-beside): name -> (port, census
# folder or not, environment, what its ratio to the one before it in the chain isolates). R's off
# phases are the census paused with the integration on, exporting.
BESIDE = {
    "P": (8101, False, {}, "plain vLLM"),
    "F": (8113, False, {}, "plain vLLM started before R (every other server starts after it): F/P is what "
                           "starting first does to a server"),
    "Q": (8108, False, {}, "plain vLLM again: Q/P is the spread of two identical servers"),
    "N": (8109, True, {"OTEL_GPU_CENSUS_DISABLED": "1"},
          "under `run` with the census disabled (no injector, so no integration): N/P is the launcher's"),
    "S": (8107, True, {"OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "vllm"},
          "the census paused, the integration disabled: S/N is the paused injector's"),
    "U": (8116, True, {"OTEL_GPU_CENSUS_COLLECTOR": "precise", "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "vllm"},
          "the precise collector (CUPTI set up in cuInit) paused, the integration disabled: U/P is what CUPTI set up "
          "costs vLLM with nothing recorded, the precise collector's floor"),
    "X": (8110, True, {"OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none"},
          "the census paused, the integration on, exporting nothing: X/S is the integration's work, off/X its export"),
    "E": (8115, True, {"OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "vllm"},
          "under `run`, its default census (events) counting through every phase, the integration disabled: E/P "
          "is the census's own cost, R's events / E at once the integration's"),
    "A": (8114, True, {"OTEL_GPU_CENSUS_COLLECTOR": "precise"},
          "the precise collector tracing every kernel, the integration on, never paused: its requests' kernel time is "
          "measured, the reference R's estimates are checked against (reference_check)"),
}

STARTED_BEFORE_R = {"F"}
COUNTING = {"A", "E"}   # beside servers whose census counts through every phase (the others run paused)


def phase_extra(a) -> list:
    """vLLM arguments of R and the servers beside it: --phase-kv-bytes fixes their KV cache, so that
    none profiles its memory (servers profiling at once see each other's allocations as their own:
    one of five or six failed to start in every call of 2026-12-02)."""
    return ["--kv-cache-memory-bytes", str(a.phase_kv_bytes)] if a.phase_kv_bytes else []


def pin_arg(v: str) -> dict:
    """--pin R=0-3,P=4-7,bench=12-15: {name: taskset CPU list}; `bench` is this process (the clients)."""
    out = {}
    for part in filter(None, v.split(",")):
        name, _, cpus = part.partition("=")
        if not name or not cpus or not all(c.isdigit() or c in "-:" for c in cpus.replace(" ", "")):
            raise argparse.ArgumentTypeError(f"--pin wants NAME=CPUS[,...] (taskset -c lists with '-'), not {part!r}")
        out[name] = cpus
    return out


def cpu_set(cpus: str) -> set:
    """A taskset list with '-' ranges ("0-3" or "4-5:6-7", ':' for ',') as a set of CPU numbers."""
    got: set = set()
    for r in cpus.replace(":", ",").split(","):
        lo, _, hi = r.partition("-")
        got.update(range(int(lo), int(hi or lo) + 1))
    return got


def beside_server(name, model, out, base, env, gpu_mem, extra=(), cpus=None):
    port, census, extra_env, _ = BESIDE[name]
    if not census:
        return Server(name, port, model, out, gpu_mem=gpu_mem, extra=extra, cpus=cpus)
    return Server(name, port, model, out, census_dir=base / name, env={**env, **extra_env}, gpu_mem=gpu_mem,
                  extra=extra, cpus=cpus)


def share_compile_cache(first, names) -> None:
    """--phase-shared-cache: `first` (started alone and ready) compiled into its cache; every other server starts from
    a copy of it, so all run the same compiled graphs and autotuned kernels (servers that compile on their own may
    choose differently, a difference between servers that no census setting makes)."""
    src = Path(f"/tmp/vc-{first}")
    for n in names:
        dst = Path(f"/tmp/vc-{n}")
        if dst != src and not dst.exists() and src.is_dir():
            shutil.copytree(src, dst, symlinks=True)


def repin(servers, cpus: dict) -> dict:
    """Every thread of each named server's process tree moved onto `cpus[name]` (a taskset list); {name: threads}."""
    moved = {}
    for n, c in cpus.items():
        want, k = cpu_set(c), 0
        for pid in proc_cpu.tree(servers[n].proc.pid):
            for tid in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else ():
                try:
                    os.sched_setaffinity(int(tid), want)
                    k += 1
                except OSError:          # a thread that ended meanwhile
                    pass
        servers[n].cpus, moved[n] = c, k
    return moved


def start_phase_servers(a, chain, model, out, base, env) -> dict:
    """R and the servers beside it, 3 s apart (not all measuring free GPU memory at one moment); those
    of STARTED_BEFORE_R first. --phase-shared-cache: the first of the chain alone, then the rest from its cache."""
    servers: dict = {}
    pin = getattr(a, "pin", None) or {}
    if getattr(a, "phase_shared_cache", False) and chain:
        n = chain[0]
        servers[n] = beside_server(n, model, out, base, env, a.phase_gpu_mem, phase_extra(a), pin.get(n))
        if not check(servers[n].wait(), f"{n}: server up (the compile cache the others copy)"):
            return servers
        share_compile_cache(n, ["R", *chain])
    first = [n for n in chain if n in STARTED_BEFORE_R and n not in servers]
    for n in first:
        servers[n] = beside_server(n, model, out, base, env, a.phase_gpu_mem, phase_extra(a), pin.get(n))
        time.sleep(3)
    r_env = dict(kv.split("=", 1) for kv in getattr(a, "phase_r_env", "").split(",") if "=" in kv)
    servers["R"] = Server("R", 8105, model, out, census_dir=base / "R", env={**env, **r_env},
                          gpu_mem=a.phase_gpu_mem, extra=phase_extra(a), cpus=pin.get("R"))
    for n in chain:
        if n not in servers:
            time.sleep(3)
            servers[n] = beside_server(n, model, out, base, env, a.phase_gpu_mem, phase_extra(a), pin.get(n))
    return servers


def same_window_ratios(rnd: dict, modes, together) -> None:
    """Ratios of loads that ran at once (--phase-together), added to the round: R's mode / N
    (`m/N@once`), N / M for two together servers (`N/M@once:m`, in the window of R's mode m), and R's
    mode / off through N (`m/off@N` = (m/N) / (off/N)): the host's speed, common to loads at once,
    cancels in the first two, and what differs between N's two windows in the third."""
    for m in modes:
        tg = rnd.get(m, {}).get("together", {})
        rate = {n: tg[n]["tok_per_s"] for n in together if tg.get(n, {}).get("tok_per_s")}
        for i, n in enumerate(together):
            if n not in rate:
                continue
            if rnd[m].get("tok_s"):
                rnd[f"{m}/{n}@once"] = round(rnd[m]["tok_s"] / rate[n], 4)
            for o in together[:i]:
                if o in rate:
                    rnd[f"{n}/{o}@once:{m}"] = round(rate[n] / rate[o], 4)
    for m in modes:
        for n in together:
            if m != "off" and rnd.get(f"{m}/{n}@once") and rnd.get(f"off/{n}@once"):
                rnd[f"{m}/off@{n}"] = round(rnd[f"{m}/{n}@once"] / rnd[f"off/{n}@once"], 4)


def estimate_check(name, logs, rounds, res):
    """Requests (the request log's lines) placed in their phase by start time: kernels and kernel time an output
    token per mode; no request of a counting phase without kernels."""
    phases = [(r[m]["t0_ns"], r[m]["t1_ns"], m) for r in rounds for m in r.get("order", [])]
    per: dict = {}
    for l in logs:
        if "gpu" not in l or not l.get("output_tokens"):
            continue
        mode = next((m for t0, t1, m in phases if t0 <= l["start_time_unix_nano"] <= t1), None)
        if mode is None:
            continue
        a = per.setdefault(mode, {"requests": 0, "tokens": 0, "kernel.count": 0, "kernel.time_ns": 0,
                                  "without_kernels": 0})
        a["requests"] += 1
        a["tokens"] += l["output_tokens"]
        a["kernel.count"] += l["gpu"].get("kernel.count", 0)
        a["kernel.time_ns"] += l["gpu"].get("kernel.time_ns", 0)
        a["without_kernels"] += not l["gpu"].get("kernel.count", 0)
    res["per_mode"] = {m: {**a, "kernels_per_token": a["kernel.count"] / a["tokens"],
                           "kernel_ns_per_token": a["kernel.time_ns"] / a["tokens"]} for m, a in per.items()}
    for m in per:
        if m != "off":
            check(per[m]["without_kernels"] == 0,
                  f"{name}: every request of the {m} phases has kernels ({per[m]['without_kernels']} without)")


def phases_run(a, model, out, base, env, servers, rx=None) -> dict:
    """Census modes in alternating phases on one server (R), each phase the same load; the BESIDE
    servers after each round, their order rotating. With rx (the OTLP receiver R exports to): after R
    stops, its spans and request log checked (one span per request of the traced phases, in its
    client's trace; conservation over every request it served)."""
    sys.path.insert(0, str(ROOT / "bench" / "server"))
    from control_phases import Phases, phase_seed, run_rounds, summarise
    chain = [n for n in BESIDE if n in servers]
    together = [n for n in getattr(a, "phase_together", "").split(",") if n in servers]
    if together and not a.phase_window:
        raise SystemExit("--phase-together needs --phase-window (loads at once are timed by the servers' counters)")
    for n in [x for x in ("R", *chain) if x in servers]:
        check(servers[n].wait(), f"{n}: server up")
        asyncio.run(load(servers[n].port, 4, 2, 16))
        if a.phase_window:
            check(counter_readable(servers[n].port), f"{n}: {GENERATED} counts (--phase-window)")
    res = {"waited_for_quiet_s": wait_quiet(), "beside": {n: BESIDE[n][3] for n in chain if n not in together},
           "together": {n: BESIDE[n][3] for n in together}}
    ph = Phases(base / "R")
    for n in chain:     # the census servers beside R run paused (N has no segment to pause)
        if BESIDE[n][1] and n != "N" and n not in COUNTING:
            check(Phases(base / n).set("off"), f"{n}: census paused")

    clients, per_client, stream = a.phase_clients, a.phase_requests, a.phase_stream

    traced: list = []

    def run_load(port, seed, root=None):   # a fixed number of requests, or closed-loop clients over a timed window
        if a.phase_window:
            ramp_s, window_s = a.phase_window
            return asyncio.run(window_load(port, clients, ramp_s, window_s, seed=seed, root=root))
        return asyncio.run(load(port, clients, per_client, 256, seed=seed, stream=stream))

    def one(mode, i):     # prompts of its own every phase (vLLM's prefix caching would serve a repeat)
        seed = phase_seed(300, i, mode, modes)
        if together:      # R and the together servers loaded at once, by clients of their own
            ramp_s, window_s = a.phase_window

            async def all_at_once():
                return await asyncio.gather(
                    window_load(8105, clients, ramp_s, window_s, seed=seed, root=servers["R"].proc.pid),
                    *[window_load(servers[n].port, clients, ramp_s, window_s, seed=seed + 50_000 + k,
                                  root=servers[n].proc.pid) for k, n in enumerate(together)])
            lr, *others = asyncio.run(all_at_once())
            extra = {"together": {n: summary(o) for n, o in zip(together, others)}}
        else:
            lr, extra = run_load(8105, seed, servers["R"].proc.pid), {}
        if mode != "off":
            traced.extend(lr["requests"])
        return {**summary(lr), "tok_s": lr["tok_per_s"], "tokens": sum(r["tokens"] for r in lr["requests"]), **extra}

    def beside(rnd):      # the beside servers after each round, their order rotating; the round kept if the call is cut
        same_window_ratios(rnd, modes, together)
        rnd["pins"] = {n: servers[n].cpus for n in ("R", *chain)
                       if n in servers and getattr(servers[n], "cpus", None)}
        if getattr(a, "pin_swap", False) and "pin_swap" not in res and len(rnd["pins"]) > 1 and \
                (len(done) + 1 >= a.phase_rounds // 2 or time.time() >= half_time):
            names = list(rnd["pins"])        # halfway: each server onto the next one's CPUs, so no CPU set stays
            rot = {n: rnd["pins"][names[(i + 1) % len(names)]] for i, n in enumerate(names)}   # with one server
            res["pin_swap"] = {"after_round": len(done), "to": rot, "threads_moved": repin(servers, rot)}
        others = [n for n in chain if n not in together and servers[n].proc.poll() is None]
        k = len(done) % len(others) if others else 0
        for n in others[k:] + others[:k]:
            t0 = time.time_ns()
            got = run_load(servers[n].port, phase_seed(300, len(done), n, modes), servers[n].proc.pid)
            # its own load's wall times: A's requests are placed by them when A is loaded beside, not together
            rnd[n] = {**summary(got), "t0_ns": t0, "t1_ns": time.time_ns()}
        rate = {n: rnd[n]["tok_per_s"] for n in others if rnd[n]["tok_per_s"]}
        for i, n in enumerate(others):   # R's modes / every one, and every one / each before it in the chain
            for m in modes:
                if n in rate and rnd[m].get("tok_s"):
                    rnd[f"{m}/{n}"] = round(rnd[m]["tok_s"] / rate[n], 4)
            for m in others[:i]:
                if n in rate and m in rate:
                    rnd[f"{n}/{m}"] = round(rate[n] / rate[m], 4)
        done.append(rnd)
        (out / "phases-partial.json").write_text(json.dumps(done, default=str))
    done: list = []
    half_time = time.time() + (T0 + a.budget_s - time.time()) / 2    # --pin-swap: by rounds or by the budget
    modes = a.phase_modes.split(",")
    rounds = run_rounds(ph, a.phase_rounds, one, modes=modes, after=beside, deadline=T0 + a.budget_s)
    if a.phase_window:
        what = (f"{clients} closed-loop non-streaming clients, each request 64-192 tokens (uniform), for "
                f"{a.phase_window[0]} s of ramp then a {a.phase_window[1]} s window; tok/s = the server's "
                f"{GENERATED} over the window; the requests in flight at its end finished, none cut")
    else:
        what = f"{clients} {'streaming' if stream else 'non-streaming'} clients x {per_client} requests x 256 tokens"
    res["cpu_ms_per_ktok"] = cpu_medians(rounds, [*modes, *chain])
    res = {**res, "modes": modes, "rounds": rounds, **summarise(rounds, modes=modes),
           "load": what + ", ignore_eos, 64-word prompts of its own in every phase (no prefix-cache hits between "
                          "phases); modes rotate who goes first"}
    check(res["all_switched"], "R: every phase switched the census")
    res["stop_R"] = servers.pop("R").stop()
    if rx is not None:
        res["spans_R"] = {"_out": str(out)}
        spans_check(rx, {"requests": traced}, "R", base / "R", res["spans_R"])
        time.sleep(2)
        logs = conservation_check("R", base / "R", [s for s in rx.span_snapshot()
                                                    if s.resource.get("service.name") == "vllm-R"], res["spans_R"])
        estimate_check("R", logs, rounds, res["spans_R"].setdefault("estimate", {}))
        if "A" in servers:
            res["stop_A"] = servers.pop("A").stop()
            time.sleep(1)
            res["reference"] = reference_check(logs, read_census(base / "A")[1], rounds, modes,
                                               a_beside="A" not in together)
    return res


REFERENCE_ERROR_MAX = 0.10  # the stated bound: R's estimated kernel time a token vs A's measured, same windows


def reference_check(logs_r, logs_a, rounds, modes, a_beside=False) -> dict:
    """R's requests (estimated kernel time) against A's (every kernel traced, measured) loaded in the same
    windows by clients of their own: per phase, kernel ns an output token of each and their ratio; per request of
    R, its distance from A's median request of the same phase (relative), beside A's own requests' distance from
    that median (the spread of one load, no error at all). a_beside: A was loaded after R's round, alone on the GPU
    (--phase-beside), so each of R's phases is set against A's load of the same round; event pairs time what the GPU
    ran between their events, other processes' kernels too, so R is only right with the GPU to itself."""
    def per_tok(l):
        return l["gpu"]["kernel.time_ns"] / l["output_tokens"]

    def placed(logs, t0, t1):
        return [l for l in logs if "gpu" in l and l.get("output_tokens") and t0 <= l["start_time_unix_nano"] <= t1]
    out: dict = {}
    for m in modes:
        if m == "off":
            continue
        ratios, err, spread = [], [], []
        for r in rounds:
            if m not in r:
                continue
            t0, t1 = r[m]["t0_ns"], r[m]["t1_ns"]
            rr = placed(logs_r, t0, t1)
            if a_beside:
                if "t0_ns" not in r.get("A", {}):
                    continue
                t0, t1 = r["A"]["t0_ns"], r["A"]["t1_ns"]
            aa = placed(logs_a, t0, t1)
            if not rr or not aa:
                continue
            r_tok = sum(l["gpu"]["kernel.time_ns"] for l in rr) / sum(l["output_tokens"] for l in rr)
            a_tok = sum(l["gpu"]["kernel.time_ns"] for l in aa) / sum(l["output_tokens"] for l in aa)
            ratios.append(r_tok / a_tok)
            ref = statistics.median(per_tok(l) for l in aa)
            err += [abs(per_tok(l) / ref - 1) for l in rr]
            spread += [abs(per_tok(l) / ref - 1) for l in aa]
        if not ratios:
            continue
        q = lambda xs, p: sorted(xs)[min(len(xs) - 1, int(p * len(xs)))]   # noqa: E731
        med = statistics.median(ratios)
        out[m] = {"phases": len(ratios), "kernel_ns_per_token_ratio_median": round(med, 4),
                  "ratio_min": round(min(ratios), 4), "ratio_max": round(max(ratios), 4),
                  "request_error_p50": round(q(err, 0.5), 4), "request_error_p90": round(q(err, 0.9), 4),
                  "reference_spread_p50": round(q(spread, 0.5), 4), "reference_spread_p90": round(q(spread, 0.9), 4),
                  "requests": len(err), "reference_requests": len(spread)}
        check(abs(med - 1) <= REFERENCE_ERROR_MAX,
              f"R's {m} requests' kernel time a token within {REFERENCE_ERROR_MAX:.0%} of A's measured ({med - 1:+.1%})")
    return out


def cpu_medians(rounds, names) -> dict:
    """Per load (R's modes, the servers beside it) and process role: the median over rounds of its CPU
    ms per 1,000 generated tokens (all its threads, then its busiest ones), and of the cores it kept busy."""
    out: dict = {}
    for n in names:
        per = [r[n] for r in rounds if isinstance(r.get(n), dict) and "cpu_ms_per_ktok" in r[n]]
        if not per:
            continue
        got: dict = {}
        for role in sorted({k for p in per for k in p["cpu_ms_per_ktok"]}):
            keys = {k for p in per for k in p["cpu_ms_per_ktok"].get(role, {}) if k != "n"}
            got[role] = {k: round(statistics.median(p["cpu_ms_per_ktok"][role].get(k, 0.0) for p in per), 2)
                         for k in sorted(keys, key=lambda k: k != "all")}
            got[role]["cores"] = round(statistics.median(p["cpu_cores"].get(role, 0.0) for p in per), 3)
        out[n] = got
    return out


def kv_check(name, census_dir, res):
    """KV offloading: the transfers land on the requests whose blocks they moved. From the engine's
    request log: every request that stored blocks carries device->host bytes of its own transfers, the
    same number of bytes per block for every request (one KV layout: a transfer moves blocks x page
    bytes), none for requests that stored nothing, and the requests' transfer bytes add up to the
    transfer sub-steps' census (up to jobs the connector launched for requests already settled)."""
    _, logs = read_census(census_dir)
    reqs = [l for l in logs if "gpu" in l]
    summ = [l["summary"] for l in logs if "summary" in l]
    kv = [(l.get("kv") or {}) for l in reqs]
    stored = [k for k in kv if k.get("stored_blocks")]
    per_block = sorted({k["gpu"].get("copy.dtoh.bytes", 0) / k["stored_blocks"] for k in stored})
    res["kv"] = {"requests": len(reqs), "requests_storing": len(stored),
                 "requests_loading": sum(1 for k in kv if k.get("loaded_blocks")),
                 "blocks_stored": sum(k.get("stored_blocks", 0) for k in kv),
                 "blocks_loaded": sum(k.get("loaded_blocks", 0) for k in kv),
                 "dtoh_bytes_per_stored_block": per_block[:5],
                 "requests_kv_dtoh_bytes": sum(k.get("gpu", {}).get("copy.dtoh.bytes", 0) for k in kv)}
    if summ:
        res["kv"]["sub_steps"] = summ[0].get("kv_sub_steps")
        res["kv"]["sub_steps_dtoh_bytes"] = summ[0].get("kv_total", {}).get("copy.dtoh.bytes")
    check(len(stored) > 0, f"{name}: requests stored KV blocks ({len(stored)} of {len(reqs)})")
    check(all(k["gpu"].get("copy.dtoh.bytes", 0) > 0 for k in stored),
          f"{name}: every request that stored blocks carries the device->host bytes of its own transfers")
    check(len(per_block) == 1, f"{name}: the same bytes per stored block on every request ({per_block[:5]})")
    check(all(not k.get("gpu", {}).get("copy.dtoh.bytes") for k in kv if not k.get("stored_blocks")),
          f"{name}: no transfer bytes on requests that stored nothing")
    if summ:
        got, total = res["kv"]["requests_kv_dtoh_bytes"], res["kv"]["sub_steps_dtoh_bytes"] or 0
        check(bool(per_block) and 0 < got <= total and total - got <= per_block[0] * 64,
              f"{name}: the requests' transfer bytes {got:,} of the sub-steps' {total:,}")


def kv_compare(default_dir, precise_dir, res):
    """The same KV-offloading load under the default census (counted at the calls) and the precise one (CUPTI's
    records): the engine's device->host bytes agree within 0.1 % (the loads' own steps differ a little), and
    neither census knows of work it missed."""
    out = {}
    for name, d in (("default", default_dir), ("precise", precise_dir)):
        segs, _ = read_census(d)
        out[name] = {"dtoh_bytes": sum(s.totals().copies.get("dtoh").bytes for s in segs),
                     "dtoh_copies": sum(s.totals().copies.get("dtoh").count for s in segs),
                     "htod_bytes": sum(s.totals().copies.get("htod").bytes for s in segs),
                     "gaps": [g for s in segs for g in s.gaps], "processes": len(segs)}
    res["kv_compare"] = out
    a, b = out["default"]["dtoh_bytes"], out["precise"]["dtoh_bytes"]
    check(b > 0 and abs(a - b) <= 0.001 * b, f"K/KX: device->host {a:,} B under the default census, {b:,} B under CUPTI")
    check(not out["default"]["gaps"] and not out["precise"]["gaps"],
          f"K/KX: no census knows of work it missed ({out['default']['gaps'][:2]}, {out['precise']['gaps'][:2]})")


def ranks_check(name, census_dir, res, tp):
    """TP > 1: EngineCore settled its requests from every worker's segment: one ledger entry per rank,
    each rank's steps split whole (requests + unattributed == its steps, in the summary's totals)."""
    _, logs = read_census(census_dir)
    summ = [l["summary"] for l in logs if "summary" in l]
    if not check(len(summ) == 1, f"{name}: the engine wrote its ledger summary"):
        return
    ranks = summ[0].get("ranks") or {}
    res["ranks"] = ranks
    check(len(ranks) == tp, f"{name}: the ledger read {len(ranks)} worker segments of {tp}")
    for f in FIELDS:
        check(sum(r["total"].get(f, 0) for r in ranks.values()) == summ[0]["total"].get(f, 0),
              f"{name}: {f}: the ranks' steps add up to the ledger's total")
    check(all(r["total"].get("kernel.count", 0) > 0 for r in ranks.values()), f"{name}: every rank's steps counted")


def cycles_run(a, model, out, base, env) -> list:
    """Start, load, stop: --cycles servers, --cycle-parallel at a time (each its own port, census folder
    and compile cache), waves until done or --budget-s would be passed. Each cycle: up, its 16 requests
    answered, stopped on SIGINT with the run's exit code, its engine's segment complete ("exited": the
    final flush ran) and every request in the engine's request log."""
    cyc, t0, i = [], time.time(), 0
    wave_s = 0.0
    while i < a.cycles:
        if cyc and time.time() - t0 + wave_s > a.budget_s:
            print(f"cycles: stopping after {len(cyc)} (budget {a.budget_s} s)", flush=True)
            break
        w0 = time.time()
        wave = []
        for j in range(i, min(a.cycles, i + a.cycle_parallel)):
            d = base / f"cycle{j}"
            wave.append((j, d, Server(f"cycle{j}", 8110 + j, model, out, census_dir=d, env=env,
                                      extra=["--enforce-eager"], gpu_mem=a.cycle_gpu_mem,
                                      cache=f"/tmp/vc-cycle{j % a.cycle_parallel}")))
            time.sleep(2)
        ups = [s.wait() for _, _, s in wave]

        async def loads():
            return await asyncio.gather(*(load(s.port, 8, 2, 32, seed=200 + j) for (j, _, s), up in zip(wave, ups) if up))
        got = iter(asyncio.run(loads()))
        for (j, d, s), up in zip(wave, ups):
            lr = next(got) if up else {"requests": [], "errors": ["down"]}
            st = s.stop()
            segs, logs = read_census(d)
            cyc.append({"cycle": j, "up": up, "ready_s": round(getattr(s, "ready_s", -1), 1),
                        "requests": len(lr["requests"]), "errors": len(lr["errors"]), **st, "segments": len(segs),
                        "exited": sum(x.state_name == "exited" for x in segs),
                        "logged": len([l for l in logs if "gpu" in l])})
            print("cycle", j, cyc[-1], flush=True)
        i += len(wave)
        wave_s = time.time() - w0
    return cyc


def window_arg(v: str) -> tuple:
    try:
        ramp, window = (float(x) for x in v.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"RAMP,WINDOW in seconds, e.g. 1,3 (got {v!r})")
    if ramp < 0 or window <= 0:
        raise argparse.ArgumentTypeError(f"a ramp >= 0 s and a window > 0 s (got {v!r})")
    return ramp, window


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="spans,throughput,cycles")
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--cycles", type=int, default=4)
    ap.add_argument("--cycle-parallel", type=int, default=1, help="cycles started at once (waves)")
    ap.add_argument("--cycle-gpu-mem", type=float, default=0.2, help="--gpu-memory-utilization of a cycle's server")
    ap.add_argument("--budget-s", type=float, default=1e9,
                    help="phases: no round that would end past this many seconds from the start; cycles: no "
                         "wave that would end past it from the cycles' start")
    ap.add_argument("--phase-rounds", type=int, default=8)
    # phases: non-streaming by default. On the H200 (2026-12-02) 32 streaming clients (one SSE event a
    # token, ~7,000 a second, parsed by one Python process on the server's cores) spread the loads
    # +-20 % from phase to phase, plain vLLM's too: too wide to see 1 %.
    ap.add_argument("--phase-clients", type=int, default=64)
    ap.add_argument("--phase-requests", type=int, default=4, help="requests per client in each phase")
    ap.add_argument("--phase-stream", action="store_true",
                    help="phases with streaming clients (as until 2026-12-02); default one JSON answer a request")
    ap.add_argument("--phase-modes", default="off,events",
                    help="census modes of bench/server/control_phases.py, one phase each per round")
    ap.add_argument("--phase-split", action="store_true",
                    help="phases: also S, under the census (paused) with the integration disabled, loaded after P "
                         "each round: off/S is the integration's own cost, S/P the paused injector's (--phase-beside P,S)")
    ap.add_argument("--phase-beside", default="",
                    help="phases: the servers loaded after each round, in chain order, from " + ",".join(BESIDE)
                         + " (see BESIDE); every ratio of one to each before it is kept")
    ap.add_argument("--phase-r-env", default="", metavar="KEY=VALUE,...",
                    help="more environment for R, e.g. OTEL_GPU_CENSUS_EVENT_EVERY=0")
    ap.add_argument("--phase-together", default="",
                    help="phases: servers from " + ",".join(BESIDE) + " loaded AT THE SAME TIME as each of R's phases, "
                         "each by clients of its own: R's mode / each of them in the same window, and the mode "
                         "ratios from those (m/off@N), cancel the host's CPU speed, which moves every server at once "
                         "(a single-threaded loop ran 1.8x faster from one 3 s window to the next)")
    ap.add_argument("--phase-gpu-mem", type=float, default=0.2,
                    help="phases: --gpu-memory-utilization of R and the servers beside it (0.12 for six)")
    ap.add_argument("--phase-kv-bytes", type=int, default=0,
                    help="phases: --kv-cache-memory-bytes of R and the servers beside it (no memory profiling: "
                         "servers started together then cannot take each other's memory for their own)")
    ap.add_argument("--phase-window", type=window_arg, default=None, metavar="RAMP,WINDOW",
                    help="phases: closed-loop clients for RAMP s, then the server's generated-token counter over "
                         "WINDOW s is the load's rate (instead of --phase-requests requests timed from first to last)")
    ap.add_argument("--toggle-s", type=float, default=240.0,
                    help="--only toggle: seconds of one load on R alone while its census is switched between "
                         "--phase-modes every --toggle-slot seconds (within --budget-s)")
    ap.add_argument("--toggle-slot", type=float, default=2.0, help="--only toggle: seconds a slot")
    ap.add_argument("--toggle-order", choices=ORDERS, default="random",
                    help="--only toggle: each pair's order drawn at random (seeded), or alternating (ABBA)")
    ap.add_argument("--toggle-seed", type=int, default=700,
                    help="--only toggle: the seed of the clients' prompts and lengths and of the pairs' order (a "
                         "second run with another seed is a second sample, not the first again)")
    ap.add_argument("--toggle-tick", type=float, default=0.0,
                    help="--only toggle: seconds between a slot's own reads of the counter (0: none); the reads say "
                         "whether the counter's reads or the load spread a slot (tick_noise, toggle_slots.py)")
    ap.add_argument("--toggle-settle", type=float, default=0.0,
                    help="--only toggle, with --toggle-tick: also rate the pairs leaving out each slot's first SETTLE s")
    ap.add_argument("--toggle-tokens", type=tokens_arg, default=(64, 192), metavar="LO,HI",
                    help="--only toggle: each request's tokens, uniform in LO..HI (long ones: fewer request starts "
                         "a slot, whose prefills spread a short slot's rate; LO + HI / 2 + the prompt must fit "
                         "--max-model-len 2048)")
    ap.add_argument("--pin", type=pin_arg, default={}, metavar="NAME=CPUS,...",
                    help="phases: each named server's process tree on CPUs of its own (taskset -c), `bench` for "
                         "this process and its clients, e.g. R=0-3,P=4-7,E=8-11,bench=12-15: no server's busy thread "
                         "waits for a CPU another holds, and none migrates between windows")
    ap.add_argument("--pin-swap", action="store_true",
                    help="phases with --pin: halfway through the rounds, each pinned server moves onto the next one's "
                         "CPUs (R's onto the first beside server's, ..., the last's onto R's): a CPU set's own speed is "
                         "then in every server's figures alike")
    ap.add_argument("--phase-shared-cache", action="store_true",
                    help="phases: the first server of the chain starts alone; R and the others start from a copy of "
                         "its compile cache (the same compiled graphs and autotuned kernels in every server)")
    ap.add_argument("--tp", type=int, default=2, help="--only tp: tensor parallel size (needs that many GPUs)")
    a = ap.parse_args()
    if a.pin and (os.cpu_count() or 0) < 8:
        print(f"vllm_e2e: {os.cpu_count()} CPUs cannot be split among the servers; --pin ignored, nothing pinned",
              flush=True)
        a.pin = {}
    if "bench" in a.pin:
        os.sched_setaffinity(0, cpu_set(a.pin["bench"]))
    bad = [n for n in (a.phase_beside + "," + a.phase_together).split(",") if n and n not in BESIDE]
    if bad:
        ap.error(f"--phase-beside: unknown {','.join(bad)} (known: {','.join(BESIDE)})")
    from control_phases import MODES as CONTROL_MODES
    bad = [m for m in a.phase_modes.split(",") if m not in CONTROL_MODES]
    if bad:
        ap.error(f"--phase-modes: unknown {','.join(bad)} (known: {','.join(CONTROL_MODES)})")
    out = Path(a.out); out.mkdir(parents=True, exist_ok=True)
    only = set(a.only.split(","))
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "checks_failed": FAILS}
    model = random_model()
    import vllm
    res["versions"] = {"vllm": vllm.__version__}
    base = Path("/tmp/e2e"); base.mkdir(exist_ok=True)
    rx = otlp_receiver().__enter__()
    # traces and the engine's request metrics over OTLP/HTTP; run's sidecar exports nothing (--exporter none)
    env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
           "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{rx.http_port}", "OTEL_BSP_SCHEDULE_DELAY": "500",
           "OTEL_METRIC_EXPORT_INTERVAL": "5000"}
    servers = {}
    try:
        if only & {"spans", "throughput", "kv", "phases", "toggle"}:
            if "throughput" in only:
                servers["P"] = Server("P", 8101, model, out)
                time.sleep(3)       # not all of them measuring free GPU memory at the same moment
            if only & {"spans", "throughput"}:
                servers["C"] = Server("C", 8102, model, out, census_dir=base / "C", env=env)
                time.sleep(3)
            if "traced" in only:       # vLLM's own tracing on: its llm_request spans to the same receiver
                servers["V"] = Server("V", 8107, model, out, census_dir=base / "V",
                                      env={**env, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"},
                                      extra=["--otlp-traces-endpoint", f"http://127.0.0.1:{rx.http_port}/v1/traces"])
                time.sleep(3)
            if only & {"spans", "throughput", "kv"}:
                servers["K"] = Server("K", 8103, model, out, census_dir=base / "K", env=env,
                                      extra=["--kv-offloading-size", "2"])
            if "kv-precise" in only:   # the same engine under the precise census (CUPTI): what K must equal
                time.sleep(3)
                servers["KX"] = Server("KX", 8117, model, out, census_dir=base / "KX",
                                       env={**env, "OTEL_GPU_CENSUS_COLLECTOR": "precise"},
                                       extra=["--kv-offloading-size", "2"])
            if "kv-plain" in only:     # plain vLLM with KV offloading: does it stop in time without us?
                time.sleep(3)
                servers["KP"] = Server("KP", 8106, model, out, extra=["--kv-offloading-size", "2"])
            if "phases" in only:       # R: modes switched in phases on one server; P: plain vLLM beside it
                chain = a.phase_beside.split(",") if a.phase_beside else ["P", "S"] if a.phase_split else \
                    [] if a.phase_together else ["P"]
                chain += [n for n in a.phase_together.split(",") if n and n not in chain]
                servers.update(start_phase_servers(a, [n for n in chain if n not in servers], model, out, base, env))
            if "toggle" in only and "R" not in servers:   # R alone, as the phases start it (--phase-r-env, --pin)
                servers.update(start_phase_servers(a, [], model, out, base, env))
            down = []
            for n, s in servers.items():
                if not check(s.wait(), f"{n}: server up"):
                    down.append(n)
                res.setdefault("ready_s", {})[n] = round(getattr(s, "ready_s", -1), 1)
            if down:                                     # no figure beside a server that is not there
                raise SystemExit(f"vllm_e2e: {', '.join(down)} did not start (server-{down[0]}.log); "
                                 "the others are stopped")
            for srv in servers.values():                 # warm each server once
                asyncio.run(load(srv.port, 4, 2, 16))
        span_servers = [n for n in ("C", "K", "KX", "V") if "spans" in only or (n == "K" and "kv" in only)
                        or (n == "KX" and "kv-precise" in only) or (n == "V" and "traced" in only)]
        if span_servers:
            for n, port in (("C", 8102), ("K", 8103), ("KX", 8117), ("V", 8107)):
                if n not in span_servers:
                    continue
                lr = asyncio.run(load(port, 32, 2, 256, seed=1))
                res[f"spans_{n}"] = {"load": summary(lr), "_out": str(out)}
                check(not lr["errors"], f"{n}: load without errors")
                ours = spans_check(rx, lr, n, base / n, res[f"spans_{n}"])
                if n == "V":
                    traced_check(rx, ours, res[f"spans_{n}"])
        if "throughput" in only:
            rounds = []
            names = [n for n in ("P", "C") if n in servers]
            for i in range(a.pairs):
                order = names[i % len(names):] + names[:i % len(names)]       # rotate who goes first
                got = {n: summary(asyncio.run(load(servers[n].port, 32, 4, 256, seed=100 + i))) for n in order}
                rounds.append({**got, "order": order,
                               **{f"{n}/P": round(got[n]["tok_per_s"] / got["P"]["tok_per_s"], 4) for n in names[1:]}})
            res["throughput"] = {"rounds": rounds,
                                 "load": "32 streaming clients x 4 requests x 256 tokens, ignore_eos, 64-word prompts; "
                                         "P plain, C census + integration; "
                                         "one server each on one GPU, loads in rotating order"}
            for n in names[1:]:
                r = [x[f"{n}/P"] for x in rounds]
                res["throughput"][f"{n}/P"] = {"median": statistics.median(r), "min": min(r), "max": max(r), "all": r}
                print(f"throughput {n}/P:", r, flush=True)
        if "phases" in only:
            res["phases"] = phases_run(a, model, out, base, env, servers, rx)
        if "toggle" in only and "R" in servers:
            res["toggle"] = toggle_run(a, out, base, servers, rx)
        if "KP" in servers:
            res["load_KP"] = summary(asyncio.run(load(8106, 32, 2, 256, seed=1)))
        for n, s in list(servers.items()):
            res.setdefault("stop", {})[n] = s.stop()
            check(res["stop"][n]["rc"] in (0, -2, 130), f"{n}: stopped on SIGINT, rc {res['stop'][n]['rc']}")
            # whether the engine ran its shutdown (on the H200 the KV-offload engine under the census
            # logged nothing after the stop and was killed 3 s later: 2026-12-02)
            log_text = (out / f"server-{n}.log").read_text(errors="replace")
            res["stop"][n]["engine_exited_busy_loop"] = "EngineCore: exiting busy loop" in log_text
            res["stop"][n]["engine_force_killed"] = "force killing remaining processes" in log_text
        if span_servers:
            time.sleep(2)
            for n in span_servers:
                all_spans = [s for s in rx.span_snapshot() if s.resource.get("service.name") == f"vllm-{n}"]
                conservation_check(n, base / n, all_spans, res[f"spans_{n}"])
            for n in ("K", "KX"):
                if n in span_servers:
                    kv_check(n, base / n, res[f"spans_{n}"])
            if "K" in span_servers and "KX" in span_servers:
                kv_compare(base / "K", base / "KX", res)
        if "spans" in only:
            names = sorted({p.name for p in rx.snapshot() if p.resource.get("service.name") == "vllm-C"})
            res["engine_metric_names"] = names
            check("gen_ai.server.time_to_first_token" in names and "gpu_census.request.copy.size" in names,
                  f"C: the engine's request metrics arrived over OTLP ({len(names)} names)")
            traces = {s.trace_id for s in rx.span_snapshot() if s.resource.get("service.name") == "vllm-C"}
            kt = [p for p in rx.snapshot() if p.name == "gpu_census.request.kernel.time"
                  and p.resource.get("service.name") == "vllm-C"]
            ex = {t for p in kt for t in p.exemplars}
            res["kernel_time_exemplar_traces"] = len(ex)
            check(bool(ex) and ex <= traces, f"C: kernel-time exemplars point at request traces ({len(ex)})")
        if "tp" in only:                 # its own server, after the others stopped
            s = Server("T", 8105, model, out, census_dir=base / "T", env=env,
                       extra=["--tensor-parallel-size", str(a.tp)])
            if check(s.wait(), "T: server up (tensor parallel)"):
                lr = asyncio.run(load(s.port, 16, 2, 128, seed=3))
                res["spans_T"] = {"load": summary(lr), "_out": str(out)}
                check(not lr["errors"], "T: load without errors")
                spans_check(rx, lr, "T", base / "T", res["spans_T"])
            res.setdefault("stop", {})["T"] = s.stop()
            time.sleep(2)
            all_spans = [x for x in rx.span_snapshot() if x.resource.get("service.name") == "vllm-T"]
            conservation_check("T", base / "T", all_spans, res.setdefault("spans_T", {}))
            ranks_check("T", base / "T", res["spans_T"], a.tp)
        if "cycles" in only:
            res["cycles"] = cycles_run(a, model, out, base, env)
            cyc = res["cycles"]
            check(len(cyc) == a.cycles, f"{len(cyc)} of {a.cycles} start/load/stop cycles ran (--budget-s {a.budget_s})")
            check(all(c["up"] and not c["errors"] and c["rc"] in (0, -2, 130) and c["exited"] >= 1
                      and c["logged"] == c["requests"] for c in cyc),
                  f"{len(cyc)} start/load/stop cycles: no crash, hang or lost segment")
    finally:
        for s in servers.values():
            if s.proc.poll() is None:
                s.stop(signal.SIGKILL, 10)
        rx.__exit__(None, None, None)
        (out / "vllm_e2e.json").write_text(json.dumps(res, indent=1, default=str))
        # a call brings back at most 8 files: the server logs travel as one archive
        logs = sorted(out.glob("server-*.log"))
        if logs:
            subprocess.run(["tar", "czf", str(out / "server-logs.tgz"), "-C", str(out)] + [p.name for p in logs])
            for p in logs:
                p.unlink()
    print("FAILED:" if FAILS else "all checks passed", FAILS, flush=True)
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
