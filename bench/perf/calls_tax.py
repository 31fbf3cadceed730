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
  default   the injector as shipped (counted kernels, the activity API for durations and copies)
Each process times, after a warm-up, ROUNDS rounds of: in-place adds on a 1-element tensor (one eager
launch each, torch's own CUDA calls around it); replays of a captured CUDA graph of 64 adds (CPU time to
issue, and to finish); pairs of 4 KiB pinned copies HtoD + DtoH (async, synchronised); a pure-Python loop
(the host's speed, the control). Ratios are per rotation (mode / plain of the same rotation), median and
range over the rotations. The census processes also report what they counted (read from their segments
after the last round): `calls` and `default` must agree on every count and byte of the same workload.

    python3 bench/perf/calls_tax.py --rotations 6 --out calls_tax.json     (on a GPU, after run.sh setup)
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
    from otel_gpu_census.census.reader import read_segment
    lib = ctypes.CDLL(os.environ["CUDA_INJECTION64_PATH"])
    lib.gc_segment_path.restype = ctypes.c_char_p
    lib.gc_finish()           # the final flush: every record of the process in
    c = read_segment(lib.gc_segment_path().decode())
    dv = c.devices[0]
    res["census"] = {"kernels": c.kernels.name, "preloaded": bool(c.flags & 0x40), "eager_launches": dv.eager_launches, "kernel_count": dv.kernel_count,
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
print("RESULT " + json.dumps(res), flush=True)
"""

MODES = ("plain", "preload", "calls", "default", "windows", "events")
KEYS = ("eager_ns", "graph_issue_ns", "graph_ns", "copy_pair_ns", "control_ms")


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
        if mode in ("preload", "windows", "events"):
            env["LD_PRELOAD"] = os.environ["OTEL_GPU_CENSUS_LIB"]
    return env


def run_child(mode: str, a) -> dict:
    with tempfile.TemporaryDirectory() as d:
        cmd = ["taskset", "-c", str(a.core), sys.executable, "-c", CHILD,
               str(a.rounds), str(a.adds), str(a.replays), str(a.pairs)]
        p = subprocess.run(cmd, env=child_env(mode, d), capture_output=True, text=True, timeout=300)
    line = next((l for l in p.stdout.splitlines() if l.startswith("RESULT ")), None)
    if p.returncode != 0 or line is None:
        return {"mode": mode, "error": p.stderr[-2000:]}
    return {"mode": mode, **json.loads(line[7:]), "stderr": p.stderr[-500:]}


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
    for m in modes:
        out[f"{m} medians"] = {k: round(statistics.median(rot[m][k] for rot in rotations if k in rot.get(m, {})), 1)
                               for k in KEYS if any(k in rot.get(m, {}) for rot in rotations)}
    def counts(c):        # what the census modes must agree on: every count and byte, not durations or the mode
        return {k: v for k, v in c.items()
                if k not in ("kernels", "kernel_ns", "kernel_time_ns", "preloaded", "windows", "events")}
    for m in ("calls", "preload", "windows", "events"):
        same = [counts(rot[m]["census"]) == counts(rot["default"]["census"]) for rot in rotations
                if rot.get(m, {}).get("census") and rot.get("default", {}).get("census")]
        out[f"census_counts_agree_{m}"] = {"rotations": len(same), "agree": sum(same)}
    return out


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
