"""Do the default collector's event pairs time eager kernels? (native/src/events.c)

tests/gpu/steady.cu with kernels that spin a known time on the GPU's timer, run under two censuses one after
another, per spin: every kernel traced through CUPTI (the answer) and the event pairs (gated: the stream waits
for the launch's submission before the first event). Per run: the eager mean per timed launch, the graph span per timed
launch, the counts against what the program did, and the pairs' accounting (gated, forced, idle, missed, failed).

    python3 bench/perf/event_gate_probe.py --out gate.json [--spins 0,3000,20000] [--seconds 3] [--rounds 2]
                                           [--neighbour]

--neighbour: every run twice, alone and beside a second process on the same GPU (steady.cu spinning 20 us kernels,
40 a millisecond, no census): do pairs hold the other process's time on the GPU (time-sliced between contexts)?

Needs OTEL_GPU_CENSUS_LIB (the injector; bench/device/run.sh setup exports it), nvcc and a GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

MODES = {
    "all": {"OTEL_GPU_CENSUS_COLLECTOR": "precise"},                       # CUPTI: every kernel traced
    "gated": {"OTEL_GPU_CENSUS_COLLECTOR": "default", "OTEL_GPU_CENSUS_EVENT_GATE": "on", "PRELOAD": "1"},
}


def build(tmp: Path) -> Path:
    exe = tmp / "steady"
    subprocess.run(["nvcc", "-O2", "-arch=sm_90", "-o", str(exe), str(ROOT / "tests/gpu/steady.cu"), "-ldl"],
                   check=True)
    return exe


def one(exe: Path, lib: str, mode: str, spin: int, seconds: float, every: str, tmp: Path,
        neighbour: bool = False) -> dict:
    from otel_gpu_census.census import reader
    d = Path(tempfile.mkdtemp(dir=tmp))
    env = dict(os.environ, CUDA_INJECTION64_PATH=lib, OTEL_GPU_CENSUS_DIR=str(d), OTEL_GPU_CENSUS_EVENT_EVERY=every)
    env.update({k: v for k, v in MODES[mode].items() if k != "PRELOAD"})
    if MODES[mode].get("PRELOAD"):
        env["LD_PRELOAD"] = lib
    other = subprocess.Popen([str(exe), str(seconds + 2), "40", "20000"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL) if neighbour else None
    p = subprocess.run([str(exe), str(seconds), "20", str(spin)], env=env, capture_output=True, text=True, timeout=120)
    if other:
        other.wait(timeout=60)
    out = {"mode": mode + ("+neighbour" if neighbour else ""), "spin_ns": spin, "rc": p.returncode,
           "stderr": p.stderr[-2000:]}
    segs = sorted(d.glob("*.seg"))
    if p.returncode != 0 or len(segs) != 1:
        return out
    want = json.loads(p.stdout)
    c = reader.read_segment(str(segs[0]))
    dev, k = c.devices[0], c.kernels
    graph_ns = dev.kernel_ns - dev.eager_traced_ns
    timed_graphs = dev.graph_launches - k.graph_untimed
    out.update(
        expected=want, kernels=dev.kernel_count, eager_launches=dev.eager_launches, graph_launches=dev.graph_launches,
        graph_kernels=dev.graph_kernel_count, dtoh_pinned_bytes=dev.copies.get("dtoh", "pinned").bytes,
        exact=(dev.kernel_count == want["kernels"] and dev.graph_launches == want["graph_launches"]
               and dev.copies.get("dtoh", "pinned").bytes == want["dtoh_pinned_bytes"]
               and dev.copies.get("htod", "pageable").bytes == want["htod_pageable_bytes"]),
        eager_timed=dev.eager_traced, eager_mean_ns=dev.eager_traced_ns / dev.eager_traced if dev.eager_traced else None,
        graph_span_ns=graph_ns / timed_graphs if timed_graphs > 0 and graph_ns > 0 else None,
        pairs={"timed": k.events_timed, "gated": k.events_gated, "forced": k.events_forced, "idle": k.events_idle,
               "lead_mean_ns": k.events_lead_ns / k.events_lead if k.events_lead else None,
               "idle_mean_ns": k.events_idle_ns / k.events_idle if k.events_idle else None,
               "missed": k.events_missed, "failed": k.events_failed, "graph_untimed": k.graph_untimed},
        mode_name=k.name)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--spins", default="0,3000,20000")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--every", default="4/1", help="OTEL_GPU_CENSUS_EVENT_EVERY of the event modes")
    ap.add_argument("--neighbour", action="store_true", help="each run also beside a busy second process")
    a = ap.parse_args()
    lib = os.environ["OTEL_GPU_CENSUS_LIB"]
    tmp = Path(tempfile.mkdtemp(prefix="gate-probe-"))
    exe = build(tmp)
    runs = []
    for r in range(a.rounds):
        for spin in (int(s) for s in a.spins.split(",")):
            for mode in MODES:
                for beside in ((False, True) if a.neighbour else (False,)):
                    res = one(exe, lib, mode, spin, a.seconds, a.every, tmp, beside)
                    res["round"] = r
                    runs.append(res)
                print(json.dumps({k: res.get(k) for k in ("round", "mode", "spin_ns", "rc", "exact", "eager_mean_ns",
                                                           "graph_span_ns", "pairs")}), flush=True)
    summary = {}
    for spin in (int(s) for s in a.spins.split(",")):
        row = {}
        for mode in [m + n for m in MODES for n in (("", "+neighbour") if a.neighbour else ("",))]:
            rs = [x for x in runs if x["spin_ns"] == spin and x["mode"] == mode and x.get("exact") is not None]
            e = [x["eager_mean_ns"] for x in rs if x["eager_mean_ns"]]
            g = [x["graph_span_ns"] for x in rs if x["graph_span_ns"]]
            row[mode] = {"eager_mean_ns": statistics.median(e) if e else None,
                         "graph_span_ns": statistics.median(g) if g else None,
                         "exact": all(x["exact"] for x in rs) if rs else None}
        for mode in row:
            ref = row["all+neighbour" if mode.endswith("+neighbour") else "all"]
            for f in ("eager_mean_ns", "graph_span_ns"):
                if mode.startswith("all") or not (row[mode][f] and ref[f]):
                    continue
                row[mode][f.replace("_ns", "_vs_all")] = row[mode][f] / ref[f]
        summary[str(spin)] = row
    Path(a.out).write_text(json.dumps({"args": vars(a), "summary": summary, "runs": runs}, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
