"""The census switched inside one running load, in slots, and each slot rated by a token count.

Phases of a few seconds, each its own load, spread more than the census costs (vLLM ±15 % a 3 s window on the
H200, §27; llama-server ±5 % a round, §26): ramps, tails and which requests happen to start. Here one load runs
on, and only the census changes: slot after slot, in pairs whose order alternates (ABBA), each rated by a meter
read once the switch has taken and again as the slot ends, so a switch's own time is in neither. A drift slower
than a pair falls mostly inside it. Used by bench/device/vllm_e2e.py (`--only toggle`: vLLM's own counter) and
bench/server/llama_toggle.py (llama-server: the tokens its clients receive).

    slots = await toggle_slots(meter, seconds, slot_s, switch)      # meter.mark() -> (tokens so far, when)
    toggle_pairs(slots)                                               # events/off: median, spread, gmean [95 %]
"""
from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]


async def toggle_slots(meter, seconds: float, slot_s: float, switch, modes=("off", "events"), root=None) -> list:
    """For `seconds`, `switch(mode)` (blocking: run in a thread; True once the census shows the mode) slot after
    slot of slot_s, pair by pair, the order alternating. Each slot: its mode, whether the switch took, the tokens
    `meter.mark()` counted over it and their rate. root: a pid whose process tree's CPU a slot is added per role
    (bench/device/proc_cpu.py), per 1,000 tokens."""
    if root:
        sys.path.insert(0, str(BENCH / "device"))
        import proc_cpu
    slots = []
    t_end = time.perf_counter() + seconds
    pair = 0
    while time.perf_counter() + 2 * slot_s < t_end:
        for m in (modes if pair % 2 == 0 else modes[::-1]):
            ok = await asyncio.to_thread(switch, m)
            c0 = await asyncio.to_thread(proc_cpu.snapshot, root) if root else None
            n0, w0 = await meter.mark()
            await asyncio.sleep(slot_s)
            n1, w1 = await meter.mark()
            c1 = await asyncio.to_thread(proc_cpu.snapshot, root) if root else None
            slot = {"pair": pair, "mode": m, "switched": ok, "tokens": n1 - n0, "s": round(w1 - w0, 4),
                    "tok_s": (n1 - n0) / (w1 - w0)}
            if root:
                cpu = proc_cpu.delta(c0, c1)
                k = 1e6 / max(n1 - n0, 1)
                slot["cpu_ms_per_ktok"] = {r: {"all": round(v["cpu_s"] * k, 2),
                                               **{t: round(x * k, 2) for t, x in v["threads"].items()}}
                                           for r, v in cpu.items()}
            slots.append(slot)
        pair += 1
    return slots


def toggle_pairs(slots: list, modes=("off", "events")) -> dict:
    """Each pair's second mode's tok/s over its first's (events/off); a pair whose switch did not take is left
    out. Median, spread, geometric mean and its bootstrap 95 % interval; and how much a slot's rate varies
    (coefficient of variation of each mode's slots), which says how many pairs a given interval needs."""
    sys.path.insert(0, str(BENCH))
    from ratio_interval import gmean, interval
    by = {}
    for sl in slots:
        by.setdefault(sl["pair"], {})[sl["mode"]] = sl
    a, b = modes
    kept = [p for _, p in sorted(by.items())
            if a in p and b in p and p[a]["switched"] and p[b]["switched"] and p[a]["tok_s"] > 0]
    r = [p[b]["tok_s"] / p[a]["tok_s"] for p in kept]
    out = {"pairs": len(r), "left_out": len(by) - len(r)}
    if r:
        lo, hi = interval(r)
        out.update({f"{b}/{a}": {"median": round(statistics.median(r), 4), "min": round(min(r), 4),
                                 "max": round(max(r), 4), "gmean": round(gmean(r), 4),
                                 "gmean_95": [round(lo, 4), round(hi, 4)], "all": [round(x, 4) for x in r]}})
    if len(kept) > 1:
        out["slot_cv"] = {m: round(statistics.stdev(x) / statistics.fmean(x), 4)
                          for m in modes for x in [[p[m]["tok_s"] for p in kept]]}
    return out
