#!/usr/bin/env python3
"""How well a run's throughput ratios pin the census's cost: their median, geometric mean and a
bootstrap 95 % interval of the geometric mean (resampling rounds, fixed seed: the same figures every time).

    python bench/ratio_interval.py RAW.json [--key launch/off] [--under phases]

RAW.json is a raw results file under bench/results/: a phase run (control_phases: `rounds`, each with
`KEY`, optionally inside `--under`; llama_phases.py, vllm_e2e.py --only phases) or a pairs run
(run_server_bench.py: `rows[0].pair_ratios`). Prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from typing import Callable, List, Sequence, Tuple

RESAMPLES = 20_000
SEED = 1


def ratios(raw: dict, key: str = "launch/off", under: str = "") -> List[float]:
    if under:
        raw = raw[under]
    if "rounds" in raw:
        return [float(r[key]) for r in raw["rounds"] if r.get(key)]
    return [float(x) for x in raw["rows"][0]["pair_ratios"]]


def gmean(xs: Sequence[float]) -> float:
    return math.exp(sum(map(math.log, xs)) / len(xs))


def interval(xs: Sequence[float], resamples: int = RESAMPLES, seed: int = SEED,
             stat: Callable[[Sequence[float]], float] = gmean) -> Tuple[float, float]:
    """The 2.5th and 97.5th percentiles of `stat` (the geometric mean of ratios; statistics.fmean for
    differences) over `resamples` resamplings of xs."""
    rnd = random.Random(seed)
    means = sorted(stat([rnd.choice(xs) for _ in xs]) for _ in range(resamples))
    return means[int(0.025 * resamples)], means[int(0.975 * resamples)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("raw")
    ap.add_argument("--key", default="launch/off", help="the ratio of each round (phase runs)")
    ap.add_argument("--under", default="", help="the key the phase run sits under (vllm_e2e.py: phases)")
    a = ap.parse_args()
    try:
        with open(a.raw) as f:
            xs = ratios(json.load(f), a.key, a.under)
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        print(f"ratio_interval: {a.raw}: no ratios ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    if len(xs) < 2:
        print(f"ratio_interval: {a.raw}: {len(xs)} ratio(s), need 2 or more", file=sys.stderr)
        return 2
    lo, hi = interval(xs)
    print(json.dumps({"n": len(xs), "median": round(statistics.median(xs), 4), "min": min(xs), "max": max(xs),
                      "gmean": round(gmean(xs), 4), "gmean_95": [round(lo, 3), round(hi, 3)]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
