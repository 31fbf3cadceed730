"""What the census costs torch's launching thread in each way of counting, processes side by side (§21).

§20 found that CUPTI's activity API, once set up, makes every CUDA call of the process slower (a torch
in-place add 22-42 %), paused or not. OTEL_GPU_CENSUS_ACTIVITY=off counts at the calls instead, with no
activity API. This runs the same torch workload in separate processes, one per mode, their order rotating
every round, each pinned to the same core:
  plain     no injector
  preload   the injector preloaded (LD_PRELOAD) too, OTEL_GPU_CENSUS_ACTIVITY=off: the calls are its own
            wrappers', CUPTI never loaded (interpose.c)
  calls     the injector, OTEL_GPU_CENSUS_ACTIVITY=off, not preloaded: CUPTI's callbacks
  windows   preloaded, OTEL_GPU_CENSUS_ACTIVITY=windows: as preload, and CUPTI set up at the first window for
            kernel durations ($CALLS_TAX_WINDOWS, default the shipped 200 ms of every 5 s), its kinds off between
  events    preloaded, OTEL_GPU_CENSUS_ACTIVITY=events: as preload, and kernel durations from CUDA event pairs
            around 1 of every 128 eager and every graph launch ($CALLS_TAX_EVENT_EVERY=EAGER/GRAPH), no CUPTI
  pairs     events with every eager and graph launch paired (EVENT_EVERY=1/1): a pair's own price
  default   the injector as shipped (counted kernels, the activity API for durations and copies)
Each process times, after a warm-up, ROUNDS rounds of: in-place adds on a 1-element tensor (one eager
launch each, torch's own CUDA calls around it); replays of a captured CUDA graph of 64 adds (CPU time to
issue, and to finish); pairs of 4 KiB pinned copies HtoD + DtoH (async, synchronised); a pure-Python loop
(the host's speed, the control). Ratios are per rotation (mode / plain of the same rotation), median and
range over the rotations, and the ns a call each mode adds (`MODE-plain`). The census processes also
report what they counted (read from their segments after the last round): `calls` and `default` must agree
on every count and byte of the same workload.

--child c runs bench/floor/launch_price.cu instead (`make -C bench/floor launch_price`): the same workloads
from C through the CUDA runtime, an empty kernel for torch's add, so that Python's own spread (the torch
child's pure-Python control moved 0.80-1.48 between processes in §22) does not hide a price of tens of ns;
it says what it launched and copied, and `census_exact_MODE` counts the rotations whose census counted
exactly that.

    python3 bench/perf/calls_tax.py --rotations 6 --out calls_tax.json     (on a GPU, after run.sh setup)
    python3 bench/perf/calls_tax.py --child c --modes plain,preload,events,pairs --rounds 21 --out price.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, os, statistics, sys, time
import torch
rounds, adds, replays, pairs = map(int, sys.argv[1:5])
torch.cuda.init()
x = torch.zeros(1, device="cuda")
if os.environ.get("CUDA_INJECTION64_PATH"):
    from otel_gpu_census import injector
    attached = injector.wait_attached()
else:
    attached = None
s = torch.cuda.Stream()
y = torch.zeros(1, device="cuda")
with torch.cuda.stream(s):
    y.add_(1)
torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g, stream=s):
    for _ in range(64):
        y.add_(1)
h = torch.zeros(1024, dtype=torch.float32).pin_memory()
d = torch.zeros(1024, device="cuda")

def eager():
    t = time.perf_counter_ns()
    for _ in range(adds):
        x.add_(1)
    torch.cuda.synchronize()
    return (time.perf_counter_ns() - t) / adds

def graph():
    t = time.perf_counter_ns()
    for _ in range(replays):
        g.replay()
    issued = time.perf_counter_ns()
    torch.cuda.synchronize()
    return (issued - t) / replays, (time.perf_counter_ns() - t) / replays

def copies():
    t = time.perf_counter_ns()
    for _ in range(pairs):
        d.copy_(h, non_blocking=True)
        h.copy_(d, non_blocking=True)
    torch.cuda.synchronize()
    return (time.perf_counter_ns() - t) / pairs

def control():
    t = time.perf_counter_ns()
    a = 0
    for i in range(200_000):
        a += i
    return (time.perf_counter_ns() - t) / 1e6

for _ in range(2):            # warm-up
    eager(), graph(), copies()
out = {"eager_ns": [], "graph_issue_ns": [], "graph_ns": [], "copy_pair_ns": [], "control_ms": []}
for _ in range(rounds):
    out["eager_ns"].append(eager())
    gi, gt = graph()
    out["graph_issue_ns"].append(gi)
    out["graph_ns"].append(gt)
    out["copy_pair_ns"].append(copies())
    out["control_ms"].append(control())
res = {k: statistics.median(v) for k, v in out.items()}
res["attached"] = attached
if attached:
    import ctypes
    sys.path.insert(0, os.environ["CALLS_TAX_DIR"])
    from calls_tax import census_fields
    lib = ctypes.CDLL(os.environ["CUDA_INJECTION64_PATH"])
    lib.gc_segment_path.restype = ctypes.c_char_p
    lib.gc_finish()           # the final flush: every record of the process in
    res["census"] = census_fields(lib.gc_segment_path().decode())
print("RESULT " + json.dumps(res), flush=True)
"""

MODES = ("plain", "preload", "calls", "default", "windows", "events", "pairs")
KEYS = ("eager_ns", "graph_issue_ns", "graph_ns", "copy_pair_ns", "control_ms")


def census_fields(segment: str) -> dict:
    """What a child's census counted (its segment, read after its final flush): every count and byte, and
    the mode's timing fields, which the modes need not agree on."""
    from otel_gpu_census.census.reader import read_segment
    c = read_segment(segment)
    dv = c.devices[0]
    return {"kernels": c.kernels.name, "preloaded": bool(c.flags & 0x40), "eager_launches": dv.eager_launches,
            "kernel_count": dv.kernel_count,
            "windows": [c.kernels.windows_opened, c.kernels.windows_failed, c.kernels.attach_ns, c.kernels.detach_ns,
                        c.kernels.graph_untimed, dv.eager_traced, dv.eager_traced_ns],
            "graph_launches": dv.graph_launches, "graph_kernel_count": dv.graph_kernel_count,
            "htod_pinned": [dv.copies.get("htod", "pinned").count, dv.copies.get("htod", "pinned").bytes],
            "dtoh_pinned": [dv.copies.get("dtoh", "pinned").count, dv.copies.get("dtoh", "pinned").bytes],
            "htod_pageable": [dv.copies.get("htod", "pageable").count, dv.copies.get("htod", "pageable").bytes],
            "dtoh_pageable": [dv.copies.get("dtoh", "pageable").count, dv.copies.get("dtoh", "pageable").bytes],
            "dtod": [dv.copies.get("dtod").count, dv.copies.get("dtod").bytes],
            "memset": [dv.memset.count, dv.memset.bytes],
            "events": [c.kernels.events_timed, c.kernels.events_missed, c.kernels.events_failed,
                       c.kernels.graph_untimed, dv.eager_traced, dv.eager_traced_ns, c.kernels.events_idle,
                       c.kernels.events_idle_ns],
            "kernel_time_ns": c.kernel_time(dv).ns,
            "graph_unknown": c.graphs.unknown, "launches_lost": c.launches_lost,
            "calls_lost": c.calls_lost, "kernel_ns": dv.kernel_ns}


def child_env(mode: str, census_dir: str) -> dict:
    env = dict(os.environ)
    env.pop("CUDA_INJECTION64_PATH", None)
    env.pop("OTEL_GPU_CENSUS_ACTIVITY", None)
    env.pop("LD_PRELOAD", None)
    if mode != "plain":
        env["CUDA_INJECTION64_PATH"] = os.environ["OTEL_GPU_CENSUS_LIB"]
        env["OTEL_GPU_CENSUS_DIR"] = census_dir
        if mode in ("calls", "preload"):
            env["OTEL_GPU_CENSUS_ACTIVITY"] = "off"
        if mode == "windows":
            env["OTEL_GPU_CENSUS_ACTIVITY"] = "windows"
            if os.environ.get("CALLS_TAX_WINDOWS"):
                env["OTEL_GPU_CENSUS_KERNELS"] = "counted:" + os.environ["CALLS_TAX_WINDOWS"]
        if mode == "events":
            env["OTEL_GPU_CENSUS_ACTIVITY"] = "events"
            if os.environ.get("CALLS_TAX_EVENT_EVERY"):
                env["OTEL_GPU_CENSUS_EVENT_EVERY"] = os.environ["CALLS_TAX_EVENT_EVERY"]
        if mode == "pairs":     # every eager and graph launch paired: a pair's own price (events samples 1 in 128)
            env["OTEL_GPU_CENSUS_ACTIVITY"] = "events"
            env["OTEL_GPU_CENSUS_EVENT_EVERY"] = "1/1"
        if mode in ("preload", "windows", "events", "pairs"):
            env["LD_PRELOAD"] = os.environ["OTEL_GPU_CENSUS_LIB"]
    return env


def run_child(mode: str, a) -> dict:
    """One process of `mode` pinned to a.core: torch's workload (CHILD), or with --child c
    bench/floor/launch_price.cu's, whose census is read from its segment once it has exited (its
    final flush is the injector's atexit)."""
    with tempfile.TemporaryDirectory() as d:
        counts = [str(a.rounds), str(a.adds), str(a.replays), str(a.pairs)]
        child = [a.binary] if a.child == "c" else [sys.executable, "-c", CHILD]
        env = dict(child_env(mode, d), CALLS_TAX_DIR=os.path.dirname(os.path.abspath(__file__)))
        p = subprocess.run(["taskset", "-c", str(a.core), *child, *counts], env=env,
                           capture_output=True, text=True, timeout=300)
        line = next((l for l in p.stdout.splitlines() if l.startswith("RESULT ")), None)
        if p.returncode != 0 or line is None:
            return {"mode": mode, "error": p.stderr[-2000:]}
        res = {"mode": mode, **json.loads(line[7:]), "stderr": p.stderr[-500:]}
        if a.child == "c" and mode != "plain":
            from otel_gpu_census.census.reader import segment_paths
            segs = segment_paths(d)
            res["census"] = census_fields(str(segs[0])) if len(segs) == 1 else {"segments": len(segs)}
    return res


def summarise(rotations: list) -> dict:
    out: dict = {}
    modes = [m for m in MODES if any(m in rot for rot in rotations)]
    for m in modes[1:]:
        for k in KEYS:
            r = [rot[m][k] / rot["plain"][k] for rot in rotations
                 if m in rot and "error" not in rot[m] and "error" not in rot["plain"] and rot["plain"].get(k)]
            if r:
                out[f"{m}/plain {k}"] = {"median": round(statistics.median(r), 4), "min": round(min(r), 4),
                                         "max": round(max(r), 4), "all": [round(x, 4) for x in r]}
            dn = [rot[m][k] - rot["plain"][k] for rot in rotations
                  if m in rot and "error" not in rot[m] and "error" not in rot["plain"] and k in rot["plain"]]
            if dn and k.endswith("_ns"):     # what the mode adds a call, ns (the same rotation's plain taken off)
                out[f"{m}-plain {k}"] = {"median": round(statistics.median(dn), 1), "min": round(min(dn), 1),
                                         "max": round(max(dn), 1)}
    for m in modes:
        out[f"{m} medians"] = {k: round(statistics.median(rot[m][k] for rot in rotations if k in rot.get(m, {})), 1)
                               for k in KEYS if any(k in rot.get(m, {}) for rot in rotations)}
    def counts(c):        # what the census modes must agree on: every count and byte, not durations or the mode
        return {k: v for k, v in c.items()
                if k not in ("kernels", "kernel_ns", "kernel_time_ns", "preloaded", "windows", "events")}
    for m in ("calls", "preload", "windows", "events", "pairs"):
        same = [counts(rot[m]["census"]) == counts(rot["default"]["census"]) for rot in rotations
                if rot.get(m, {}).get("census") and rot.get("default", {}).get("census")]
        out[f"census_counts_agree_{m}"] = {"rotations": len(same), "agree": sum(same)}
    for m in modes[1:]:           # the C child says what it did: every count and byte must be the census's
        exact = [census_did(rot[m]) for rot in rotations if rot.get(m, {}).get("did") and rot[m].get("census")]
        if exact:
            out[f"census_exact_{m}"] = {"rotations": len(exact), "exact": sum(exact)}
    return out


def census_did(res: dict) -> bool:
    """The census counted exactly what launch_price did: its eager launches, graph launches and their
    kernels, and its pinned copies each way (count and bytes)."""
    did, c = res["did"], res["census"]
    return (c.get("eager_launches") == did["eager_launches"] and c.get("graph_launches") == did["graph_launches"]
            and c.get("graph_kernel_count") == did["graph_kernels"]
            and c.get("kernel_count") == did["eager_launches"] + did["graph_kernels"]
            and list(c.get("htod_pinned", ())) == did["htod_pinned"] and list(c.get("dtoh_pinned", ())) == did["dtoh_pinned"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rotations", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--adds", type=int, default=20000)
    ap.add_argument("--replays", type=int, default=2000)
    ap.add_argument("--pairs", type=int, default=2000)
    ap.add_argument("--core", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--modes", default=",".join(MODES), help="plain first, then any of " + ",".join(MODES[1:]))
    ap.add_argument("--child", choices=("torch", "c"), default="torch",
                    help="the workload: torch's (CHILD) or bench/floor/launch_price.cu's (--binary), no Python")
    ap.add_argument("--binary", default="/tmp/floor/launch_price", help="--child c: the built launch_price")
    a = ap.parse_args()
    if not os.environ.get("OTEL_GPU_CENSUS_LIB"):
        raise SystemExit("OTEL_GPU_CENSUS_LIB: the built injector (bench/device/run.sh setup sets it)")
    rotations = []
    modes = tuple(a.modes.split(","))
    for i in range(a.rotations):
        order = modes[i % len(modes):] + modes[:i % len(modes)]
        rot = {"order": list(order)}
        for m in order:
            rot[m] = run_child(m, a)
            print(m, {k: round(v, 1) for k, v in rot[m].items() if k in KEYS}, rot[m].get("error", "")[-300:], flush=True)
        rotations.append(rot)
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "rotations": rotations}, f, indent=1)
    res = {"args": vars(a), "rotations": rotations, "summary": summarise(rotations)}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
