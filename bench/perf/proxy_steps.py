"""Where a proxied request's extra time goes, from a `run_server_bench.py --proxy-pairs` result (not a
pytest test: run it).

    python bench/perf/proxy_steps.py RESULT.json [--slow-ms 60]

Per target (direct, proxy), from each request's token-event arrival times (`ev`) and, when recorded,
llama-server's own timings of the request (`prompt_ms`, `predicted_ms`):

  e2e, ttft           the load client's figures (means)
  decode_s            first token event -> last token event, as the client saw them
  step_ms             mean interval between two token events of one request that were not held up by
                      another request's prompt (intervals up to --slow-ms): the decode step
  slow_steps          intervals over --slow-ms per request (a prompt processed in between)
  server_decode_s     llama-server's predicted_ms (its own decode time of the request), when recorded
  transport_s         decode_s - server_decode_s: what the path between server and client added to the
                      decode phase (a proxy that falls behind mid-stream shows here)
  last_to_end_ms      last token event -> the final event (the request's end at the client), p50
  client_gap_ms       a client's request end -> its next request sent, p50
                      (in a waves load: mostly the wait for the wave's slowest request)

A proxy that leaves slots idle between requests shows in ttft and last_to_end_ms (and in the
server-side gaps); one that slows llama-server itself shows in
step_ms and server_decode_s with transport_s unchanged.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from event_times import decode_times  # noqa: E402  (not load's: this runs without aiohttp)


def _mean(xs: Iterable[float]) -> Optional[float]:
    xs = list(xs)
    return statistics.fmean(xs) if xs else None


def _p50(xs: Iterable[float]) -> Optional[float]:
    xs = list(xs)
    return statistics.median(xs) if xs else None


def _r(v: Optional[float], n: int = 4) -> Optional[float]:
    return None if v is None else round(v, n)


def per_target(loads: List[Dict[str, Any]], slow_s: float = 0.06) -> Dict[str, Dict[str, Any]]:
    """The figures above for each `via` of `loads` (each {"via", "per_request": [...]})."""
    acc: Dict[str, Dict[str, list]] = {}
    for load in loads:
        a = acc.setdefault(load["via"], {})
        reqs = [r for r in load.get("per_request", []) if not r.get("error")]
        for r in reqs:
            ev = decode_times(r.get("ev"))
            if len(ev) < 2:
                continue
            iv = [b - x for x, b in zip(ev, ev[1:])]
            fast = [x for x in iv if x <= slow_s]
            a.setdefault("e2e", []).append(r["e2e_s"])
            a.setdefault("ttft", []).append(r["ttft_s"])
            a.setdefault("decode", []).append(ev[-1] - ev[0])
            a.setdefault("steps", []).extend(fast)
            a.setdefault("slow", []).append(len(iv) - len(fast))
            a.setdefault("last_to_end", []).append(r["end"] - ev[-1] if "end" in r else None)   # both after t0
            if isinstance(r.get("predicted_ms"), (int, float)):
                # predicted_ms spans the first token to the last (llama-server times the n-1 decode steps
                # after the first token, which prompt processing produced)
                a.setdefault("server_decode", []).append(r["predicted_ms"] / 1e3)
                a.setdefault("transport", []).append((ev[-1] - ev[0]) - r["predicted_ms"] / 1e3)
        by_client: Dict[Any, list] = {}
        for r in reqs:
            by_client.setdefault(r.get("client"), []).append(r)
        for rs in by_client.values():
            rs.sort(key=lambda r: r["start"])
            a.setdefault("gap", []).extend(y["start"] - x["end"] for x, y in zip(rs, rs[1:]))
    out = {}
    for via, a in acc.items():
        lte = [x for x in a.get("last_to_end", []) if x is not None]
        out[via] = {"requests": len(a.get("e2e", [])), "e2e_s": _r(_mean(a.get("e2e", []))),
                    "ttft_s": _r(_mean(a.get("ttft", []))), "decode_s": _r(_mean(a.get("decode", []))),
                    "step_ms": _r(None if not a.get("steps") else _mean(a["steps"]) * 1e3, 2),
                    "slow_steps": _r(_mean(a.get("slow", [])), 2),
                    "server_decode_s": _r(_mean(a.get("server_decode", []))),
                    "transport_s": _r(_mean(a.get("transport", []))),
                    "last_to_end_ms": _r(None if not lte else _p50(lte) * 1e3, 2),
                    "client_gap_ms": _r(None if not a.get("gap") else _p50(a["gap"]) * 1e3, 2)}
    return out


def loads_of(result: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Every load of a run_server_bench result's proxy sessions."""
    return [ld for run in result.get("runs", []) for ld in run.get("loads", []) if "via" in ld]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("result", help="a run_server_bench.py --proxy-pairs result JSON")
    ap.add_argument("--slow-ms", type=float, default=60.0,
                    help="intervals between token events longer than this held a prompt (default 60)")
    a = ap.parse_args()
    figs = per_target(loads_of(json.loads(Path(a.result).read_text())), a.slow_ms / 1e3)
    print(json.dumps(figs, indent=2))
    d, p = figs.get("direct"), figs.get("proxy")
    if d and p:
        for k in ("e2e_s", "ttft_s", "decode_s", "step_ms", "slow_steps", "server_decode_s", "transport_s",
                  "last_to_end_ms", "client_gap_ms"):
            if d.get(k) is not None and p.get(k) is not None:
                print(f"{k:<16} direct {d[k]:>9} proxy {p[k]:>9}  ({p[k] - d[k]:+.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
