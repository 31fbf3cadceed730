"""Does CUPTI keep recording eager kernels through the census's switches? (docs/measurements.md §17)

On llama-server, whole phases of a counted census, and of every-kernel phases switched to from it,
had no eager kernel record although the census had the kernel kind enabled. This runs
tests/gpu/steady.cu (every millisecond a burst of eager kernels, every 10 ms a graph and copies) under
the census and walks its control file through a fixed cycle of states (every kernel, counted, paused,
in every order), holding each for --hold-s. In each state, after a short settle, it takes the steady
rates from the segment: eager launches counted, eager kernel records, graph kernels, copies. A state
whose kernel kind is on (every kernel; counted, whose duty cycle records part of the time) that counted
launches and got no eager record is a gap.

    python3 bench/perf/kind_toggle.py --steady BIN --out kind_toggle.json [--seconds 60] [--hold-s 2]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from control_phases import Phases, delta  # noqa: E402

# every pair of the three states follows every other one at least once
CYCLE = ("launch", "counted", "off", "launch", "off", "counted", "launch", "counted", "counted20", "off",
         "counted20", "launch")


def gaps(states: list) -> list:
    """The states with the kernel kind on (every kernel, or a counted duty cycle) that counted eager
    launches and got no eager kernel record."""
    return [s for s in states if s["mode"] != "off" and s["census"].get("eager_launches", 0) > 0
            and s["census"].get("eager_traced", 0) == 0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steady", required=True, help="tests/gpu/steady.cu built (nvcc)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=60.0, help="how long steady runs")
    ap.add_argument("--hold-s", type=float, default=2.0, help="how long each state is measured")
    ap.add_argument("--settle-s", type=float, default=1.2, help="after a switch, before measuring")
    a = ap.parse_args(argv)
    census = Path(tempfile.mkdtemp(prefix="kind-toggle-"))
    cmd = [sys.executable, "-m", "otel_gpu_census.cli", "run", "--dir", str(census), "--exporter", "none", "--",
           a.steady, str(a.seconds), "20"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ph = Phases(census)
    res: dict = {"command": " ".join(cmd), "states": [],
                 "env": {k: v for k, v in os.environ.items() if k.startswith("OTEL_GPU_CENSUS_")}}
    t_end = time.time() + a.seconds - 1.0
    try:
        while not ph.segments() and proc.poll() is None:
            time.sleep(0.05)
        i = 0
        while time.time() + a.settle_s + a.hold_s < t_end and proc.poll() is None:
            mode = CYCLE[i % len(CYCLE)]
            ok = ph.set(mode)
            time.sleep(a.settle_s)      # records of the state before are in by now (flush period 1 s)
            before = ph.totals()
            time.sleep(a.hold_s)
            res["states"].append({"mode": mode, "switched": ok, "census": delta(ph.totals(), before)})
            s = res["states"][-1]["census"]
            print(i, mode, ok, {k: s.get(k, 0) for k in ("eager_launches", "eager_traced", "graph_kernel_count",
                                                           "records", "buffers", "dropped", "buffers_refused",
                                                           "kernel_outside", "records_unknown")}, flush=True)
            i += 1
        last = ph.totals()
        out, err = proc.communicate(timeout=a.seconds + 60)
        # what the final flush at exit brought that no state had: records CUPTI held back
        res["at_exit"] = delta(ph.totals(), last)
        print("at exit:", {k: v for k, v in res["at_exit"].items() if v}, flush=True)
        res["steady"] = out.strip().splitlines()[-1] if out.strip() else None
        res["stderr"] = err[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    res["gaps"] = [i for i, s in enumerate(res["states"]) if s in gaps(res["states"])]
    Path(a.out).write_text(json.dumps(res, indent=1))
    print("gaps:", res["gaps"], "of", len(res["states"]), "states", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
