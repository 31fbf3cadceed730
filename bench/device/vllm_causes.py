"""Issue 62 on the GPU: vLLM under the census in the two states the engine-state diagnoses tell apart, each
named by `report --json` from the engine's own log, and only that cause. One command on the GPU machine (after
bench/device/run.sh vllm-install):

    python3 bench/device/vllm_causes.py --out DIR [--only cap,preempt]

- cap: `--max-num-seqs 4` and 32 clients: running sits at the cap while requests wait; `report` must name
  cap_bound (cap 4), not server_bound or client_bound, and its engine_state lines must say running 4 most of
  the time.
- preempt: a KV cache of --blocks blocks (`--num-gpu-blocks-override`) under 32 clients with long outputs: vLLM
  preempts and recomputes; the request log must price it (requests with a `preemption` figure, the summary's
  `recomputed`, each request's recompute kernel time within its own kernel time) and `report` must name
  preemption with the same count of preemptions as the state lines.

Every figure lands in DIR/vllm_causes.json; failed checks are listed there and the exit code is 1.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_e2e as e2e  # noqa: E402  (bench/device/vllm_e2e.py: the server, the load, the model)

FAILS: list = []


def check(ok: bool, what: str) -> bool:
    if not ok:
        FAILS.append(what)
        print("FAIL:", what, flush=True)
    return ok


def report_json(census_dir: Path) -> dict:
    p = subprocess.run([sys.executable, "-m", "otel_gpu_census.cli", "report", str(census_dir), "--json"],
                       capture_output=True, text=True, timeout=300)
    check("Traceback" not in p.stderr, f"report: {p.stderr[-500:]}")
    return json.loads(p.stdout) if p.stdout.strip() else {}


def serve(name, port, model, out, census_dir, extra, clients, per_client, max_tokens, prompt_words) -> dict:
    srv = e2e.Server(name, port, model, out, census_dir=census_dir, extra=extra, gpu_mem=0.3)
    if not check(srv.wait(), f"{name}: the server did not start (server-{name}.log)"):
        srv.stop()
        return {}
    res = asyncio.run(e2e.load(port, clients, per_client, max_tokens, prompt_words=prompt_words, stream=False))
    stop = srv.stop()
    segs, lines = e2e.read_census(census_dir)
    states = [x["engine_state"] for x in lines if "engine_state" in x]
    reqs = [x for x in lines if "id" in x]
    summary = next((x["summary"] for x in lines if "summary" in x), {})
    rep = report_json(census_dir)
    kinds = [d["kind"] for d in rep.get("diagnoses", [])]
    return {"load": {k: res[k] for k in ("elapsed_s", "tok_per_s")}, "errors": res["errors"][:5], "stop": stop,
            "requests": len(reqs), "state_lines": len(states), "states": states, "reqs": reqs, "summary": summary,
            "diagnoses": rep.get("diagnoses", []), "kinds": kinds}


def cap_case(a, model, out) -> dict:
    d = out / "census-cap"
    r = serve("cap", 8301, model, out, d, ["--max-num-seqs", "4"], 32, 4, 64, 64)
    if not r:
        return r
    check(r["requests"] == 128 and not r["errors"], f"cap: {r['requests']} requests logged, errors {r['errors']}")
    steps = sum(b["steps"] for b in r["states"])
    check(steps > 0 and {b["cap"] for b in r["states"]} == {4}, "cap: state lines with the cap 4")
    at_cap = sum(b["at_cap_ns"] for b in r["states"]) / max(1, sum(b["step_ns"] for b in r["states"]))
    r["at_cap_share_of_steps"] = at_cap
    check(at_cap > 0.5, f"cap: running at the cap for {at_cap:.2f} of the steps' time")
    concurrency = [k for k in r["kinds"] if k in ("cap_bound", "front_end_bound", "client_bound", "server_bound")]
    check(concurrency == ["cap_bound"], f"cap: the concurrency diagnoses are {concurrency}")
    found = [x for x in r["diagnoses"] if x["kind"] == "cap_bound"]
    check(bool(found) and found[0]["figures"].get("cap") == 4, "cap: cap_bound names the cap 4")
    r.pop("states"), r.pop("reqs")
    return r


def preempt_case(a, model, out) -> dict:
    d = out / "census-preempt"
    # (vLLM wants a whole --max-model-len sequence to fit the KV cache: 1024 tokens in 96 blocks of 16)
    r = serve("preempt", 8302, model, out, d, ["--max-num-seqs", "64", "--num-gpu-blocks-override", str(a.blocks),
                                               "--max-model-len", "1024"], 32, 2, 384, 128)
    if not r:
        return r
    pre = sum(b["preempted"] for b in r["states"])
    priced = [x for x in r["reqs"] if "preemption" in x]
    r.update(preempted=pre, requests_priced=len(priced),
             recomputed=r["summary"].get("recomputed"))
    check(pre > 0, "preempt: no preemption in the state lines (a smaller --blocks?)")
    check(bool(priced) and all(0 < x["preemption"]["recompute_kernel_time_ns"] <= x["gpu"]["kernel.time_ns"]
                               for x in priced), "preempt: each priced request's recompute time within its kernel time")
    check(sum(x["preemption"]["recomputed_tokens"] for x in priced)
          == (r["recomputed"] or {}).get("tokens", -1), "preempt: the requests' recomputed tokens are the summary's")
    check(sum(b["recomputed_tokens"] for b in r["states"]) >= sum(x["preemption"]["recomputed_tokens"] for x in priced),
          "preempt: the state lines count every recomputed token")
    found = [x for x in r["diagnoses"] if x["kind"] == "preemption"]
    check(bool(found) and found[0]["figures"]["preempted"] == pre, f"preempt: report names preemption ({r['kinds']})")
    r.pop("states"), r.pop("reqs")
    return r


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="cap,preempt")
    ap.add_argument("--blocks", type=int, default=96, help="KV-cache blocks of the preempt case (16 tokens each)")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model = e2e.random_model()
    res = {}
    for name, fn in (("cap", cap_case), ("preempt", preempt_case)):
        if name in a.only.split(","):
            res[name] = fn(a, model, out)
    res["fails"] = FAILS
    (out / "vllm_causes.json").write_text(json.dumps(res, indent=2, default=str))
    print(json.dumps({k: v for k, v in res.items() if k != "fails"}, default=str)[:4000])
    print("FAILS:", FAILS)
    return 1 if FAILS else 0


if __name__ == "__main__":
    os.environ.setdefault("OTEL_GPU_CENSUS_SETTLE", "process")
    sys.exit(main())
