"""Which part of a CUPTI window a failure needs (OTEL_GPU_CENSUS_ACTIVITY=windows): tests/gpu/steady.cu and a
torch program of five launching threads, each under the windows as shipped (CUPTI kept set up between windows)
and as probed (OTEL_GPU_CENSUS_WINDOWS_PROBE=detach: cuptiFinalize between windows, as designed; nograph: no
GRAPH_TRACE). The 2026-12-03 run (measurements §23) named the probes as they were then: "" detached, "nodetach"
did not.

    python3 bench/perf/windows_probe.py --out probe.json     (on a GPU, after bench/device/run.sh setup)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests" / "gpu"))


def run(cmd, probe, kernels, timeout=120):
    from otel_gpu_census.census import reader
    with tempfile.TemporaryDirectory() as d:
        lib = os.environ["OTEL_GPU_CENSUS_LIB"]
        env = dict(os.environ, CUDA_INJECTION64_PATH=lib, LD_PRELOAD=lib, OTEL_GPU_CENSUS_DIR=d,
                   OTEL_GPU_CENSUS_ACTIVITY="windows", OTEL_GPU_CENSUS_KERNELS=kernels,
                   OTEL_GPU_CENSUS_WINDOWS_PROBE=probe)
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        out = {"probe": probe, "kernels": kernels, "rc": p.returncode, "stdout": p.stdout[-400:],
               "stderr": p.stderr[-1200:]}
        for s in Path(d).glob("*.seg"):
            c = reader.read_segment(str(s))
            dv = c.devices[0] if c.devices else None
            k = c.kernels
            out["census"] = {"windows": [k.windows_opened, k.windows_failed, k.attach_ns, k.detach_ns, k.graph_untimed],
                             "eager_launches": dv and dv.eager_launches, "eager_traced": dv and dv.eager_traced,
                             "graph_launches": dv and dv.graph_launches, "kernel_ns": dv and dv.kernel_ns,
                             "state": c.state_name}
        return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--probes", default=",detach,nograph,detach+nograph")
    a = ap.parse_args()
    steady = "/tmp/steady"
    subprocess.run(["nvcc", "-O2", "-arch=sm_90", "-o", steady, str(ROOT / "tests/gpu/steady.cu"), "-ldl"], check=True)
    from test_gpu_census import THREADS_WORK
    threads = Path(tempfile.mkdtemp()) / "threads.py"
    threads.write_text(THREADS_WORK)
    res = []
    for probe in a.probes.split(","):
        for name, cmd in (("steady", [steady, "3", "20"]), ("threads", [sys.executable, str(threads), "4"])):
            r = {"workload": name, **run(cmd, probe, "counted:100/500" if name == "steady" else "counted:40/100")}
            print(json.dumps(r)[:900], flush=True)
            res.append(r)
            Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
