"""Busy is not full, measured live on a GPU (not a pytest test): once a second, nvidia-smi's
utilisation, the census busy ratio, GPM SM utilisation and SM occupancy, for a loop of bf16
matmuls and a loop of tiny kernels (tests/gpu/busy_loops.py).

    PYTHONPATH=/tmp/site:$PWD/src OTEL_GPU_CENSUS_LIB=$PWD/native/build/libotel_gpu_census.so \\
        python3 bench/perf/gpu_busy_gap.py [--seconds 12] [--loops matmul,tiny] [--out DIR]

Each loop runs under the census (the environment `otel-gpu-census run` gives a command) in a
fresh census folder. This process reads that loop's census segments and NVML through the same
instruments the metrics sidecar exports, collecting into memory every --interval seconds until
the loop exits, and once more after. Printed per loop: the table of bench/perf/perf_busy_gap.py, the
medians while the loop ran, and the census report. With --out: <loop>.metrics (the console
exporter's format, so `python bench/perf/perf_busy_gap.py <loop>.metrics` reads it again),
<loop>.report, <loop>.stderr and busy_gap.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
if not any((Path(p) / "otel_gpu_census").is_dir() for p in sys.path if p):
    sys.path.insert(0, str(ROOT / "src"))          # a checkout without PYTHONPATH set

import perf_busy_gap  # noqa: E402

BUSY_LOOPS = ROOT / "tests" / "gpu" / "busy_loops.py"
COLUMNS = perf_busy_gap.GAUGES            # metric name -> column title


def steady(table: List[dict]) -> Dict[str, Tuple[Optional[float], int]]:
    """(median, samples) of each gauge over the rows while the loop ran: rows with any utilisation
    or busy above zero, without the first and the last of them (start-up and exit straddle those)."""
    active = [r for r in table if (r.get("hw.gpu.utilization") or 0) > 0 or (r.get("gpu_census.busy.ratio") or 0) > 0]
    core = active[1:-1] if len(active) > 2 else active
    out = {}
    for name in COLUMNS:
        vals = [r[name] for r in core if r.get(name) is not None]
        out[name] = (statistics.median(vals) if vals else None, len(vals))
    return out


def run_loop(loop: str, seconds: float, interval: float, python: str, out: Optional[Path]) -> dict:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from otel_gpu_census.cli import launcher

    from otel_gpu_census.report import render as report
    from otel_gpu_census.telemetry import census_metrics as metrics, nvml
    from otel_gpu_census.census import reader

    census_dir = Path(tempfile.mkdtemp(prefix=f"busy-{loop}-"))
    os.chmod(census_dir, 0o700)
    plan = launcher.build_env(census_dir)
    notes = list(plan.warnings)
    err_path = (out / f"{loop}.stderr") if out else census_dir / "loop.stderr"
    with open(err_path, "w") as err:
        child = subprocess.Popen([python, str(BUSY_LOOPS), loop, str(seconds)], env=plan.env,
                                 stdout=subprocess.DEVNULL, stderr=err)
    mem = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[mem])
    metrics.register_census_instruments(provider, metrics.segment_source(census_dir, root_pid=child.pid))
    sampler = nvml.register_nvml_instruments(provider)
    if sampler is None:
        notes.append("NVML unusable: " + nvml.open_nvml()[1])
    elif not any(d.gpm for d in sampler.devices):
        notes.append("no GPM: " + "; ".join(d.gpm_why for d in sampler.devices))
    docs, after_exit = [], 0
    deadline = time.monotonic() + seconds + 180
    next_t = time.monotonic() + interval
    try:
        while after_exit < 1 and time.monotonic() < deadline:
            time.sleep(max(0.0, next_t - time.monotonic()))
            next_t += interval
            exited = child.poll() is not None      # decided before collecting: this one has the final totals
            data = mem.get_metrics_data()
            if data is not None:
                docs.append(json.loads(data.to_json()))
            after_exit += exited
    finally:
        if child.poll() is None:
            child.kill()
            notes.append(f"the loop did not end within {seconds + 180:.0f} s: killed")
        child.wait()
        provider.shutdown()
        if sampler is not None:
            sampler.close()
    if child.returncode:
        notes.append(f"the loop exited with status {child.returncode} (its stderr: {err_path})")
    table = perf_busy_gap.rows(docs)
    procs, errors = reader.scan(census_dir)
    text = report.render_text(procs, census_dir=str(census_dir))
    if not procs:
        notes.append(f"no census segment was written in {census_dir}: census column empty"
                     + ("" if plan.census_on else " (census off, see above)"))
    notes += [f"unreadable segment: {e}" for e in errors]
    if out:
        (out / f"{loop}.metrics").write_text("".join(json.dumps(d, indent=4) + "\n" for d in docs))
        (out / f"{loop}.report").write_text(text)
    return {"loop": loop, "rows": table, "steady": steady(table), "report": text, "notes": notes}


def _pct(cell: Tuple[Optional[float], int]) -> str:
    v, n = cell
    return "n/a" if v is None else f"{100 * v:.1f}% (n={n})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=12.0, help="how long each loop runs (default 12)")
    ap.add_argument("--loops", default="matmul,tiny", help="comma-separated: matmul, tiny")
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between collections (default 1)")
    ap.add_argument("--python", default=sys.executable, help="the Python with torch that runs the loops")
    ap.add_argument("--out", help="folder for the exports, reports and busy_gap.json")
    a = ap.parse_args()
    loops = [x.strip() for x in a.loops.split(",") if x.strip()]
    bad = [x for x in loops if x not in ("matmul", "tiny")]
    if bad or not loops:
        print(f"--loops: unknown loop(s) {', '.join(bad) or '(none)'}; choose from matmul, tiny", file=sys.stderr)
        return 2
    out = Path(a.out) if a.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    try:
        import otel_gpu_census.telemetry.census_metrics  # noqa: F401  (the OTel SDK and the package, before any loop)
    except ImportError as e:
        print(f"cannot import the package or the OpenTelemetry SDK: {e}", file=sys.stderr)
        return 1
    results = []
    for loop in loops:
        r = run_loop(loop, a.seconds, a.interval, a.python, out)
        results.append(r)
        print(f"\n## {loop} loop ({a.seconds:g} s)\n")
        print(perf_busy_gap.markdown(r["rows"]) if r["rows"] else "(no collections with a GPU in them)")
        for n in r["notes"]:
            print(f"note: {n}")
        print("\n" + r["report"])
    print("## medians while each loop ran (n: samples)\n")
    print("| loop | " + " | ".join(COLUMNS.values()) + " |")
    print("|---|" + "---|" * len(COLUMNS))
    for r in results:
        print(f"| {r['loop']} | " + " | ".join(_pct(r["steady"][k]) for k in COLUMNS) + " |")
    if out:
        (out / "busy_gap.json").write_text(json.dumps(
            [{k: r[k] for k in ("loop", "rows", "steady", "notes")} for r in results], indent=1))
    return 0 if all(r["rows"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
