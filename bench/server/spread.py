#!/usr/bin/env python3
"""How noisy were the loads of a server benchmark? Whole-load vs steady-state throughput.

  python bench/server/spread.py bench/results/2026-11-29-h200-server-llamacpp-*.json

For every (flag set, variant) of a run_server_bench.py result (restart mode: one load per fresh
server; --proxy-pairs: direct and proxy loads on one server) it prints the loads' whole-load and
steady-state tok/s with their coefficients of variation, and the pair ratios of both figures. A
result written before load.py kept token event times has no steady-state figure: it is rebuilt from
each request's TTFT and end-to-end time (clients take the next request when they finish one; tokens
spread evenly between first token and end), which is close but approximate ("rebuilt" in the output).
Loads run in waves (--load-mode waves) also show the median, over the loads, of the CV across a
load's waves: the spread inside one load, beside the spread between loads.
"""
from __future__ import annotations

import heapq
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import load  # noqa: E402


def rebuild(per_request: List[Dict[str, Any]], clients: int) -> List[Dict[str, Any]]:
    """Client, start, end and evenly spread token times from i, ttft_s, e2e_s, tokens_out."""
    free = [(0.0, c) for c in range(clients)]
    out = []
    for r in sorted(per_request, key=lambda r: r["i"]):
        t, c = heapq.heappop(free)
        end, n = t + r["e2e_s"], r.get("tokens_out") or 0
        first = t + (r.get("ttft_s") or 0.0)
        times = [first + (end - first) * k / max(n - 1, 1) for k in range(n)]
        out.append({"client": c, "start": t, "end": end, "ev": load.encode_times(times, 0.0)})
        heapq.heappush(free, (end, c))
    return out


def steady_of(ld: Dict[str, Any], per_request: List[Dict[str, Any]], clients: int) -> Tuple[Optional[float], bool]:
    """(steady tok/s, rebuilt?)."""
    if "steady_tok_s" in ld:
        return ld["steady_tok_s"], False
    if not per_request or any(r.get("e2e_s") is None for r in per_request):
        return None, True
    return load.steady_state(rebuild(per_request, clients)).get("steady_tok_s"), True


def cv(xs: List[float]) -> str:
    xs = [x for x in xs if x]
    return f"{statistics.stdev(xs) / statistics.mean(xs):.4f}" if len(xs) > 1 else "-"


def loads_of(d: Dict[str, Any]) -> List[Tuple[str, str, Any, Dict[str, Any], List[Dict[str, Any]]]]:
    """(flags, variant, pair key, load summary, per-request) of every complete load."""
    out = []
    for r in d.get("runs", []):
        if "loads" in r:      # --proxy-pairs session
            for x in r["loads"]:
                out.append((r["flags"], "direct" if x["via"] == "direct" else "proxy", x["pair"], x["load"],
                            x.get("per_request", [])))
        elif r.get("load"):
            out.append((r["flags"], r["variant"], r["round"], r["load"], r.get("per_request", [])))
    return [x for x in out if x[3].get("ok") == x[3].get("requests") and x[3].get("output_tok_s")]


def main() -> int:
    if len(sys.argv) < 2:
        print("usage: " + __doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    for f in sys.argv[1:]:
        try:
            d = json.loads(Path(f).read_text())
        except (OSError, ValueError) as e:
            print(f"{f}: cannot read: {e}", file=sys.stderr)
            return 1
        clients = d.get("config", {}).get("clients", 16)
        print(f"== {f}")
        table: Dict[Tuple[str, str], Dict[Any, Tuple[float, Optional[float]]]] = {}
        wave_cvs: Dict[Tuple[str, str], List[float]] = {}
        rebuilt = False
        for flags, variant, key, ld, per in loads_of(d):
            st, rb = steady_of(ld, per, clients)
            rebuilt |= rb
            table.setdefault((flags, variant), {})[key] = (ld["output_tok_s"], st)
            if ld.get("wave_tok_s_cv") is not None:
                wave_cvs.setdefault((flags, variant), []).append(ld["wave_tok_s_cv"])
        for (flags, variant), by in table.items():
            w = [v[0] for v in by.values()]
            s = [v[1] for v in by.values() if v[1]]
            wc = wave_cvs.get((flags, variant))
            print(f"{flags:<8} {variant:<19} n={len(w)}  whole {[round(x) for x in w]} cv {cv(w)}  "
                  f"steady{' (rebuilt)' if rebuilt else ''} {[round(x) for x in s]} cv {cv(s)}"
                  + (f"  waves: cv inside a load (median) {statistics.median(wc):.4f}" if wc else ""))
        for (flags, variant), by in table.items():
            ref = table.get((flags, "direct" if variant == "proxy" else "plain"))
            if variant in ("plain", "direct") or not ref:
                continue
            keys = [k for k in by if k in ref]
            rw = [by[k][0] / ref[k][0] for k in keys]
            rs = [by[k][1] / ref[k][1] for k in keys if by[k][1] and ref[k][1]]
            print(f"{flags:<8} {variant:<19} pair ratios whole {[round(x, 3) for x in rw]} "
                  f"(range {max(rw) - min(rw):.3f}), steady {[round(x, 3) for x in rs]}"
                  + (f" (range {max(rs) - min(rs):.3f})" if rs else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
