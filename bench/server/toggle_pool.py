"""Several toggled loads (runs of bench/server/llama_toggle.py or of bench/device/vllm_e2e.py --only toggle) as one
sample of pairs. One run of vLLM's load gives ~100 pairs in a call's 10 minutes, and a pair of its slots spreads
±10 %, so ±1 % needs runs pooled. Each run keeps its own pairs (no pair spans two runs: each had its own
server start) and its own summary; the pooled ratio is toggle_pairs over every run's pairs, and its checks are every
run's. Tick noise is left per run (runs ticked at different rates do not pool).

    python3 bench/server/toggle_pool.py RUN.json [RUN.json ...] --out POOLED.json [--settle S] [--command TEXT]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from toggle_slots import toggle_pairs  # noqa: E402

PER_RUN = ("pairs", "left_out", "slot_cv", "tick_noise", "settled", "by_position", "load")


class PoolError(Exception):
    """A file that is not a toggled load's result: one line, exit status 2."""


def one_run(path: Path) -> dict:
    """The toggle part of a run's result, whichever script wrote it, and whether its checks passed."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PoolError(f"{path}: {e}") from None
    if not isinstance(raw, dict):
        raise PoolError(f"{path}: not a JSON object")
    t = raw.get("toggle", raw)                       # vllm_e2e.py nests it; llama_toggle.py does not
    if not isinstance(t, dict) or not isinstance(t.get("slots"), list) or not t["slots"]:
        raise PoolError(f"{path}: no toggled slots (a run of llama_toggle.py or vllm_e2e.py --only toggle?)")
    if "checks" in raw:
        failed = [c.get("what", "?") for c in raw["checks"] if not c.get("ok")]
    elif "checks_failed" in raw:
        failed = list(raw["checks_failed"])
    else:
        raise PoolError(f"{path}: no checks recorded")
    return {"raw": raw, "toggle": t, "failed": failed}


def pool(paths: list, modes=("off", "events"), settle_s: float = 0.0) -> dict:
    runs, slots, base = [], [], 0
    for p in paths:
        r = one_run(Path(p))
        t = r["toggle"]
        ids = {k: base + i for i, k in enumerate(sorted({s["pair"] for s in t["slots"]}))}
        slots += [{**s, "pair": ids[s["pair"]]} for s in t["slots"]]
        base += len(ids)
        key = f"{modes[1]}/{modes[0]}"
        runs.append({"source": Path(p).name, "date": r["raw"].get("date"), "checks_failed": r["failed"],
                     **({key: t[key]} if key in t else {}), **{k: t[k] for k in PER_RUN if k in t}})
    out = {"runs": runs, **toggle_pairs(slots, modes, settle_s=settle_s)}
    out.pop("tick_noise", None)                      # per run only (ticks of different lengths)
    out["checks"] = [{"what": f"{r['source']}: every check passed", "ok": not r["checks_failed"]} for r in runs]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="results of toggled loads (JSON)")
    ap.add_argument("--out", required=True, help="the pooled result (JSON)")
    ap.add_argument("--modes", default="off,events", help="the two modes, the ratio's denominator first")
    ap.add_argument("--settle", type=float, default=0.0,
                    help="also rate the pairs leaving out each slot's first SETTLE s (runs with marks)")
    ap.add_argument("--date", default=None, help="the runs' date (else the first run's)")
    ap.add_argument("--command", default=None, help="the commands that made the runs (kept in the result)")
    a = ap.parse_args(argv)
    modes = tuple(a.modes.split(","))
    if len(modes) != 2 or not all(modes):
        print(f"toggle_pool: --modes A,B, not {a.modes!r}", file=sys.stderr)
        return 2
    try:
        out = pool(a.runs, modes, a.settle)
    except PoolError as e:
        print(f"toggle_pool: {e}", file=sys.stderr)
        return 2
    out = {"date": a.date or out["runs"][0]["date"], **({"command": a.command} if a.command else {}), **out}
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    key = f"{modes[1]}/{modes[0]}"
    print(json.dumps({"pairs": out["pairs"], key: {k: v for k, v in out.get(key, {}).items() if k != "all"},
                      "checks": out["checks"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
