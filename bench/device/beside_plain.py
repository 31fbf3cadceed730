#!/usr/bin/env python3
"""The census beside a plain vLLM, as a product of factors, from one phase run of vllm_e2e.py.

    python3 bench/device/beside_plain.py RUN/vllm_e2e.json [--md]

The run loads R (the full census: preloaded, the integration on; its census paused in `off` phases, counting in
`events` phases) AT THE SAME TIME as the servers of --phase-together, each by clients of its own, so that whatever
moves the host moves every server of a window alike (one window's ratios cancel it):

    P, Q  plain vLLM, twice: Q/P is the A/A spread, what two identical servers differ by
    N     under `run` with OTEL_GPU_CENSUS_DISABLED=1: the launcher and a library that does nothing
    E     the default census counting, the integration disabled

Factors, each a ratio of two servers in the same windows (geometric mean over windows, bootstrap 95 % interval):
N/P the launcher; E/N the census counting; R off/N the integration with the census paused; R events/R off (through
N) switching the census on inside R; R events/P the whole, which a user compares. Throughput is the servers' own
generated-token counters; CPU per 1,000 tokens is each server's whole process tree (proc_cpu.py), which moves far
less with the host than throughput does, so it decides a factor where throughput's interval is too wide.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ratio_interval import gmean, interval  # noqa: E402  (bench/ratio_interval.py)

# (name, numerator, denominator, what it isolates); a load is "P" (a together server in any window of R's), or
# "R:off" / "R:events" (R in that mode, with the together servers of the same window)
FACTORS = (
    ("A/A", "Q", "P", "two plain servers: the spread any other factor must beat"),
    ("launcher", "N", "P", "under `run` with the census disabled"),
    ("counting", "E", "N", "the default census counting, no integration"),
    ("integration, census paused", "R:off", "N", "the integration with the census paused in R"),
    ("census switched on in R", "R:events", "R:off", "R's own phases, each through N in its window"),
    ("the whole, beside plain", "R:events", "P", "what a user compares: full census against plain vLLM"),
    ("the whole paused, beside plain", "R:off", "P", "the census paused, all else on"),
)


def _windows(run: dict) -> List[Dict[str, dict]]:
    """Each window of the run: {load: its summary} for R's mode and every together server loaded with it."""
    out = []
    for rnd in run.get("rounds", []):
        for m in rnd.get("order", []):
            w = {f"R:{m}": rnd[m]}
            w.update(rnd[m].get("together", {}))
            out.append(w)
    return out


def _cpu(summary: dict) -> Optional[float]:
    """CPU ms per 1,000 generated tokens of the server's whole process tree (every role)."""
    roles = summary.get("cpu_ms_per_ktok")
    if not roles:
        return None
    return sum(v["all"] for r, v in roles.items() if r != "bench")


def _pairs(ws, num: str, den: str, what: str) -> List[float]:
    """Per-window ratios num/den; R's modes against each other go through N (R:m/N over R:off/N of the same round's
    other window), since R is never in two modes at once."""
    out = []
    if num.startswith("R:") and den.startswith("R:"):
        rounds: Dict[int, Dict[str, float]] = {}
        for i, w in enumerate(ws):
            r = next((k for k in w if k.startswith("R:")), None)
            n = w.get("N")
            if r is None or n is None:
                continue
            a, b = (w[r].get("tok_per_s"), n.get("tok_per_s")) if what == "tok" else (_cpu(w[r]), _cpu(n))
            if a and b:
                rounds.setdefault(i // 2, {})[r] = a / b
        return [x[num] / x[den] for x in rounds.values() if num in x and den in x]
    for w in ws:
        if num not in w or den not in w:
            continue
        a, b = ((w[num].get("tok_per_s"), w[den].get("tok_per_s")) if what == "tok"
                else (_cpu(w[num]), _cpu(w[den])))
        if a and b:
            out.append(a / b)
    return out


def _stat(xs: List[float]) -> dict:
    if len(xs) < 2:
        return {"n": len(xs)}
    lo, hi = interval(xs)
    return {"n": len(xs), "gmean": round(gmean(xs), 4), "ci95": [round(lo, 4), round(hi, 4)]}


def factors(run: dict) -> dict:
    """Each factor's throughput ratio and CPU-per-token ratio (num over den; for CPU, >1 means num spends more)."""
    ws = _windows(run)
    out = {"windows": len(ws), "factors": []}
    for name, num, den, what in FACTORS:
        tok, cpu = _pairs(ws, num, den, "tok"), _pairs(ws, num, den, "cpu")
        if not tok and not cpu:
            continue
        out["factors"].append({"factor": name, "ratio": f"{num}/{den}", "what": what,
                               "throughput": _stat(tok), "cpu_per_token": _stat(cpu)})
    if run.get("pin_swap"):
        out["pin_swap"] = run["pin_swap"]
    return out


def markdown(f: dict) -> str:
    def cell(s):
        return f"{s['gmean']:.3f} [{s['ci95'][0]:.3f}, {s['ci95'][1]:.3f}]" if "gmean" in s else f"n={s['n']}"
    rows = ["| factor | ratio | throughput (gmean [95 %]) | CPU per token | windows |", "|---|---|---:|---:|---:|"]
    for x in f["factors"]:
        rows.append(f"| {x['factor']} | {x['ratio']} | {cell(x['throughput'])} | {cell(x['cpu_per_token'])} | "
                    f"{x['throughput'].get('n', 0)} |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("raw", help="vllm_e2e.json of a phase run with --phase-together")
    ap.add_argument("--md", action="store_true", help="a markdown table instead of JSON")
    a = ap.parse_args()
    try:
        run = json.loads(Path(a.raw).read_text())["phases"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"beside_plain: {a.raw}: no phase run ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    f = factors(run)
    if not f["factors"]:
        print(f"beside_plain: {a.raw}: no window holds two of the servers this needs (--phase-together P,Q,N,E)",
              file=sys.stderr)
        return 2
    print(markdown(f) if a.md else json.dumps(f, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
