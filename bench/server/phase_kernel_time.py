#!/usr/bin/env python3
"""Each phase's kernel time a token from a llama_phases.py raw file, priced from the phase's own census figures
as the census prices a scope (otel_gpu_census.census.kernel_time: the raw kernel_ns less the sampled eager
durations, plus every eager launch at the phase's own sample mean), against the every-kernel server loaded after the
same round (--beside-traced). For runs made before the phases' totals carried the priced kernel time (1028927):
their kt: ratios were the raw kernel_ns's, which under events holds the graph spans only.

    python3 bench/server/phase_kernel_time.py RAW.json [--mode events]      prints one JSON line
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from fractions import Fraction
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
from otel_gpu_census.census import kernel_time  # noqa: E402


class Scope:
    def __init__(self, c: dict):
        for k in ("kernel_count", "kernel_ns", "eager_launches", "eager_traced", "eager_traced_ns"):
            setattr(self, k, c.get(k, 0))


def ratios(raw: dict, mode: str) -> list:
    out = []
    for r in raw["rounds"]:
        if mode not in r or "traced" not in r or not r[mode].get("tokens") or not r["traced"].get("tokens"):
            continue
        est = kernel_time(Scope(r[mode]["census"]), counted=True, spans_estimated=True)
        ref = kernel_time(Scope(r["traced"]["census"]), counted=False)
        if est.unknown or not ref.ns:
            continue
        out.append(float(Fraction(est.ns, r[mode]["tokens"]) / Fraction(ref.ns, r["traced"]["tokens"])))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("raw")
    ap.add_argument("--mode", default="events")
    a = ap.parse_args()
    xs = ratios(json.loads(Path(a.raw).read_text()), a.mode)
    if not xs:
        print(f"phase_kernel_time: {a.raw}: no {a.mode} phase with a traced load beside it", file=sys.stderr)
        return 2
    print(json.dumps({"mode": a.mode, "n": len(xs), "median": round(statistics.median(xs), 4),
                      "min": round(min(xs), 4), "max": round(max(xs), 4), "all": [round(x, 4) for x in xs]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
