"""How far a request's kernel time under sampled kernels is from the all-kernels mode, per request,
from a phases run on one server (bench/device/vllm_e2e.py --only phases): the engine's request log,
the server's census segment (its kernel schedule and clock) and the phases' wall times.

    python3 bench/server/sampled_error.py --phases vllm_e2e.json --census DIR [--sampled sampled --exact launch]

A request of a sampled phase had its kernels counted only inside the schedule's traced windows; its
estimate is the counted kernel time over the share of its life [start, end] that was traced (what
``gpu_census.kernel.traced_ratio`` carries on engine spans). Every phase of a round runs the same load
shape, so a round's exact phase gives the reference: the median per-request kernel time there. The
error of an estimate is its distance from that reference, relative; the exact phase's own requests
measured the same way give the spread that is no error at all (requests of one load differ).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Dict, List


def _quantiles(xs: List[float]) -> Dict[str, float]:
    xs = sorted(xs)
    if not xs:
        return {}
    q = lambda p: xs[min(len(xs) - 1, int(p * len(xs)))]     # noqa: E731
    return {"n": len(xs), "p50": round(q(0.5), 4), "p90": round(q(0.9), 4), "max": round(xs[-1], 4)}


def analyse(rounds: list, log: List[dict], census, sampled: str, exact: str) -> dict:
    k = census.kernels
    per_round = []
    est_err: List[float] = []
    ref_err: List[float] = []
    untraced = 0
    for r in rounds:
        if sampled not in r or exact not in r:
            continue
        def inside(m):
            lo, hi = r[m]["t0_ns"], r[m]["t1_ns"]
            return [x for x in log if lo <= x["start_time_unix_nano"] and x["end_time_unix_nano"] <= hi
                    and x.get("status") == "complete"]
        ex = [x["gpu"]["kernel.time_ns"] for x in inside(exact)]
        if not ex:
            continue
        ref = statistics.median(ex)
        ests = []
        for x in inside(sampled):
            lo, hi = x["start_time_unix_nano"], x["end_time_unix_nano"]
            traced = k.traced_between(census.wall_to_gpu_ns(lo), census.wall_to_gpu_ns(hi))
            ratio = traced / (hi - lo) if hi > lo else 0.0
            if ratio <= 0:
                untraced += 1              # no traced window in its life: no estimate
                continue
            ests.append(x["gpu"]["kernel.time_ns"] / ratio)
        est_err += [abs(e - ref) / ref for e in ests]
        ref_err += [abs(e - ref) / ref for e in ex]
        per_round.append({"exact_median_ns": ref, "exact_requests": len(ex), "sampled_requests": len(ests),
                          "sampled_median_estimate_ns": statistics.median(ests) if ests else None})
    return {"schedule": k.name, "sampled_mode": sampled, "exact_mode": exact, "rounds": per_round,
            "relative_error_of_estimates": _quantiles(est_err),
            "relative_spread_of_exact_requests": _quantiles(ref_err),
            "sampled_requests_without_a_traced_window": untraced,
            "median_estimate_over_exact": round(statistics.median(
                [p["sampled_median_estimate_ns"] / p["exact_median_ns"] for p in per_round
                 if p["sampled_median_estimate_ns"]]), 4) if per_round else None}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phases", required=True, help="vllm_e2e.json of a --only phases run (or its phases part)")
    ap.add_argument("--census", required=True, help="the phases server's census folder (segment + request log)")
    ap.add_argument("--sampled", default="sampled")
    ap.add_argument("--exact", default="launch")
    a = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
    from otel_gpu_census.census.reader import scan
    raw = json.loads(Path(a.phases).read_text())
    rounds = (raw.get("phases") or raw)["rounds"]
    censuses, _ = scan(a.census)
    if len(censuses) != 1:
        print(f"sampled_error: expected one segment in {a.census}, found {len(censuses)}", file=sys.stderr)
        return 2
    log = [json.loads(l) for p in sorted(Path(a.census).glob("*.requests.jsonl"))
           for l in p.read_text().splitlines() if l.strip().startswith("{") and '"gpu"' in l]
    print(json.dumps(analyse(rounds, log, censuses[0], a.sampled, a.exact), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
