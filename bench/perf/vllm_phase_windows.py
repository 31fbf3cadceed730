"""Two questions §19 asked of a `vllm_e2e.py --only phases` run, answered from its raw files (not a pytest
test: run it).

    python bench/perf/vllm_phase_windows.py RAW.json CENSUS.tgz

1. Do CUDA-graph launches take longer on the GPU while CUPTI's kernel records are on? The census's own
   20 ms windows (the segment keeps the run's last ~40 s) are put in three classes by their eager
   records: `all` (records for every eager launch over a run of >= 400 ms: an every-kernel phase),
   `counted-on` (records in a shorter run: the duty cycle's traced part), `counted-off` (eager launches,
   no record). Per class: the graph kernels' span time over their count (kernel time less eager
   records' time, over kernels less eager ones).
2. Which requests have steps but no kernel, and in which phase did each start (the request log against
   the rounds' phase start and end times)?

RAW.json is the run's results file; CENSUS.tgz the archive of its census folders (`e2e/R/*.seg`,
`*.requests.jsonl`). Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import sys
import tarfile
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

ALL_RUN_NS = 400_000_000     # a run of traced windows this long is an every-kernel phase, not a duty cycle
GAP_NS = 40_000_000          # windows with no eager launch inside a run do not end it


def classify(windows: Sequence[Any]) -> List[str]:
    """One class a window (those with kernels), in order: all, counted-on, counted-off or unknown."""
    st = ["T" if w.eager_traced > 0 else ("U" if w.eager_launches > 0 else "?") for w in windows]
    cls = [""] * len(windows)
    i = 0
    while i < len(windows):
        if st[i] != "T":
            i += 1
            continue
        j = i
        while j + 1 < len(windows) and st[j + 1] in "T?" and windows[j + 1].start_ns - windows[j].end_ns <= GAP_NS:
            j += 1
        c = "all" if windows[j].end_ns - windows[i].start_ns >= ALL_RUN_NS else "counted-on"
        for x in range(i, j + 1):
            cls[x] = c
        i = j + 1
    return [c or ("counted-off" if s == "U" else "unknown") for c, s in zip(cls, st)]


def graph_span_per_kernel(windows: Sequence[Any]) -> Dict[str, Dict[str, float]]:
    ws = [w for w in windows if w.kernel_count]
    out: Dict[str, Dict[str, float]] = {}
    for w, c in zip(ws, classify(ws)):
        a = out.setdefault(c, {"windows": 0, "graph_kernels": 0, "graph_ns": 0})
        a["windows"] += 1
        # every kernel traced: kernel_count is records (eager ones among them); counted: launches + graph kernels
        a["graph_kernels"] += w.kernel_count - (w.eager_traced if c == "all" else w.eager_launches)
        a["graph_ns"] += w.kernel_ns - w.eager_traced_ns
    for a in out.values():
        a["graph_ns_per_kernel"] = round(a["graph_ns"] / a["graph_kernels"], 1) if a["graph_kernels"] else None
    return out


def empty_requests(requests: Sequence[Dict[str, Any]], rounds: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    phases = [(r[m]["t0_ns"], r[m]["t1_ns"], i, m) for i, r in enumerate(rounds) for m in r["order"]]
    empty = [q for q in requests if q.get("steps", 0) > 0 and not q.get("gpu", {}).get("kernel.count", 0)]
    where: Counter = Counter()
    for q in empty:
        t = q.get("start_time_unix_nano", 0)
        hit = [f"round {i} {m}" for a, b, i, m in phases if a <= t <= b]
        where[hit[0] if hit else "between phases"] += 1
    return {"requests": len(requests), "with_steps_no_kernel": len(empty), "by_phase": dict(where)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("raw")
    ap.add_argument("census_tgz")
    ap.add_argument("--server", default="R")
    a = ap.parse_args()
    from otel_gpu_census.census.reader import read_segment
    raw = json.loads(Path(a.raw).read_text())
    with tempfile.TemporaryDirectory() as d:
        with tarfile.open(a.census_tgz) as t:
            t.extractall(d, filter="data")
        folder = next(Path(d).rglob(a.server))
        seg = read_segment(str(next(folder.glob("*.seg"))))
        requests = [json.loads(line) for p in folder.glob("*.requests.jsonl") for line in p.open() if line.strip()]
    print(json.dumps({"graph_span_per_kernel": graph_span_per_kernel(seg.windows),
                      "requests": empty_requests(requests, raw["phases"]["rounds"])}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
