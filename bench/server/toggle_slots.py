"""The census switched inside one running load, in slots, and each slot rated by a token count.

Phases of a few seconds, each its own load, spread more than the census costs (vLLM ±15 % a 3 s window on
the GPU machine; llama-server ±5 % a round): ramps, tails and which requests happen to start. Here one load runs
on, and only the census changes: slot after slot, in pairs, each rated by a meter read once the switch has taken
and again as the slot ends, so a switch's own time is in neither. A drift slower than a pair falls mostly inside
it. The order inside a pair is drawn at random (seeded) by default: in ABBA order, a load with a period near four
slots (llama-server's 16 clients in step) or a transient after each switch lands on the same modes every
time; `by_position` in toggle_pairs shows it. With tick_s, each slot also keeps its meter's reading every tick_s
(`marks`), so the pairs can be rated again leaving out the first settle_s after each slot's start. Used by bench/device/vllm_e2e.py (`--only toggle`: vLLM's own counter) and
bench/server/llama_toggle.py (llama-server: the tokens its clients receive).

    slots = await toggle_slots(meter, seconds, slot_s, switch)      # meter.mark() -> (tokens so far, when)
    toggle_pairs(slots)                                               # events/off: median, spread, gmean [95 %]
"""
from __future__ import annotations

import asyncio
import math
import random
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
ORDERS = ("random", "abba")      # each pair's order drawn at random (seeded), or alternating


async def toggle_slots(meter, seconds: float, slot_s: float, switch, modes=("off", "events"), root=None,
                       order: str = "random", seed: int = 0, tick_s: float = 0.0) -> list:
    """For `seconds`, `switch(mode)` (blocking: run in a thread; True once the census shows the mode) slot after
    slot of slot_s, pair by pair, in `order`: "random" (each pair's order drawn from random.Random(seed)) or "abba"
    (alternating). Each slot: its mode, whether the switch took, the tokens `meter.mark()` counted over it and their
    rate; with tick_s > 0 also `marks`, [seconds, tokens] since the slot's start every tick_s. root: a pid whose
    process tree's CPU a slot is added per role (bench/device/proc_cpu.py), per 1,000 tokens."""
    if order not in ORDERS:
        raise ValueError(f"order: random or abba, not {order!r}")
    if root:
        sys.path.insert(0, str(BENCH / "device"))
        import proc_cpu
    rng = random.Random(seed)
    slots = []
    t_end = time.perf_counter() + seconds
    pair = 0
    while time.perf_counter() + 2 * slot_s < t_end:
        flip = rng.random() < 0.5 if order == "random" else pair % 2 == 1
        for m in (modes[::-1] if flip else modes):
            ok = await asyncio.to_thread(switch, m)
            c0 = await asyncio.to_thread(proc_cpu.snapshot, root) if root else None
            n0, w0 = await meter.mark()
            marks = []
            while tick_s > 0 and (left := w0 + slot_s - time.perf_counter()) > tick_s / 2:
                await asyncio.sleep(min(tick_s, left))
                n, w = await meter.mark()
                marks.append([round(w - w0, 4), n - n0])
            await asyncio.sleep(max(0.0, w0 + slot_s - time.perf_counter()))
            n1, w1 = await meter.mark()
            c1 = await asyncio.to_thread(proc_cpu.snapshot, root) if root else None
            slot = {"pair": pair, "mode": m, "switched": ok, "tokens": n1 - n0, "s": round(w1 - w0, 4),
                    "tok_s": (n1 - n0) / (w1 - w0)}
            if tick_s > 0:
                slot["marks"] = marks + [[round(w1 - w0, 4), n1 - n0]]
            if root:
                cpu = proc_cpu.delta(c0, c1)
                k = 1e6 / max(n1 - n0, 1)
                slot["cpu_ms_per_ktok"] = {r: {"all": round(v["cpu_s"] * k, 2),
                                               **{t: round(x * k, 2) for t, x in v["threads"].items()}}
                                           for r, v in cpu.items()}
            slots.append(slot)
        pair += 1
    return slots


def toggle_summary(res: dict) -> dict:
    """What a toggled load's line in its log shows: the ratios and what says how far to trust them."""
    return {k: v for k, v in res.items()
            if "/" in k or k in ("pairs", "slot_cv", "by_position", "settled", "tick_noise")}


def settled_rate(slot: dict, settle_s: float):
    """The slot's tokens a second after its first settle_s (from its marks: the first mark at or past settle_s to
    the slot's end); None without marks reaching past it."""
    marks = slot.get("marks") or []
    start = next((m for m in marks if m[0] >= settle_s), None)
    end = marks[-1] if marks else None
    if start is None or end is None or end[0] - start[0] <= 0:
        return None
    return (end[1] - start[1]) / (end[0] - start[0])


def tick_noise(slots: list):
    """What spreads a slot's rate, from its marks: each tick's rate against the mean tick rate of its mode (all the
    slots'), its coefficient of variation, and the lag-1 autocorrelation of consecutive ticks within a slot. A meter
    whose every read is off by its own error (a server late to answer it) makes consecutive ticks share that read
    with opposite signs: lag1 near -0.5, and a longer slot divides the error by its length. A load whose rate varies
    tick to tick independently gives lag1 near 0, and a longer slot divides it by the root of its length; one that
    drifts over seconds gives lag1 above 0, and a longer slot hardly helps. None without marks."""
    per = []                                   # (mode, [rate a tick, or None for a tick cut short])
    for sl in slots:
        m = [[0.0, 0]] + (sl.get("marks") or [])
        iv = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(m, m[1:])]
        if len(iv) < 3:
            continue
        full = statistics.median(dt for dt, _ in iv) / 2      # a slot's last tick can be cut short: not rated
        per.append((sl.get("mode"), [n / dt if dt >= full and dt > 0 else None for dt, n in iv]))
    mu = {}
    for mode, rates in per:
        mu.setdefault(mode, []).extend(x for x in rates if x is not None)
    mu = {k: statistics.fmean(v) for k, v in mu.items() if v}
    devs, lag = [], []
    for mode, rates in per:
        if mu.get(mode, 0) <= 0:
            continue
        d = [x / mu[mode] - 1 if x is not None else None for x in rates]
        devs += [x for x in d if x is not None]
        lag += [(x, y) for x, y in zip(d, d[1:]) if x is not None and y is not None]
    if len(lag) < 2:
        return None
    var = statistics.fmean([x * x for x in devs])
    return {"ticks": len(devs), "cv": round(math.sqrt(var), 4),
            "lag1": round(statistics.fmean([x * y for x, y in lag]) / var, 4) if var > 0 else None}


def cpu_pairs(kept: list, modes=("off", "events")) -> dict:
    """Each role's CPU a token (slots' cpu_ms_per_ktok: its whole process tree, and its main thread), the second
    mode's over the first's, pair by pair: where the throughput goes when a server's busiest thread is its limit.
    {role: {"all"|"main": summary with each mode's mean ms / 1,000 tokens}}; {} without CPU in the slots."""
    a, b = modes

    def cpu(sl, role, part):
        return ((sl.get("cpu_ms_per_ktok") or {}).get(role) or {}).get(part)
    out = {}
    roles = sorted({r for p in kept for m in modes for r in (p[m].get("cpu_ms_per_ktok") or {})})
    for role in roles:
        for part in ("all", "main"):
            got = [(cpu(p[a], role, part), cpu(p[b], role, part)) for p in kept]
            got = [(x, y) for x, y in got if x and y]      # a role absent or idle in a slot (0 ms) gives no ratio
            if len(got) < 2:
                continue
            out.setdefault(role, {})[part] = {
                **_summary([y / x for x, y in got]),
                f"{a}_ms_per_ktok": round(statistics.fmean(x for x, _ in got), 3),
                f"{b}_ms_per_ktok": round(statistics.fmean(y for _, y in got), 3)}
            out[role][part].pop("all")
    return out


def _summary(r: list) -> dict:
    from ratio_interval import gmean, interval
    lo, hi = interval(r)
    return {"median": round(statistics.median(r), 4), "min": round(min(r), 4), "max": round(max(r), 4),
            "gmean": round(gmean(r), 4), "gmean_95": [round(lo, 4), round(hi, 4)], "all": [round(x, 4) for x in r]}


def toggle_pairs(slots: list, modes=("off", "events"), settle_s: float = 0.0) -> dict:
    """Each pair's second mode's tok/s over its first's (events/off); a pair whose switch did not take is left
    out. Median, spread, geometric mean and its bootstrap 95 % interval; how much a slot's rate varies
    (coefficient of variation of each mode's slots), which says how many pairs a given interval needs; and
    `by_position`: each mode's mean log rate (against all slots') as the first and as the second slot of a pair,
    with its standard error: the second slot always follows a switch, the first does so only when the pair before
    ended in the other mode. With settle_s and slots with marks, `settled`: the same ratio, each slot rated after
    its first settle_s. With marks, `tick_noise`: whether the meter's reads or the load spread a slot's rate. With
    CPU in the slots, `cpu_per_token`: each role's CPU a token, the second mode over the first (cpu_pairs)."""
    sys.path.insert(0, str(BENCH))
    by, first = {}, {}
    for sl in slots:
        by.setdefault(sl["pair"], {})[sl["mode"]] = sl
        first.setdefault(sl["pair"], sl["mode"])
    a, b = modes
    kept_ids = [k for k, p in sorted(by.items())
                if a in p and b in p and p[a]["switched"] and p[b]["switched"] and p[a]["tok_s"] > 0]
    kept = [by[k] for k in kept_ids]
    r = [p[b]["tok_s"] / p[a]["tok_s"] for p in kept]
    out = {"pairs": len(r), "left_out": len(by) - len(r)}
    if r:
        out[f"{b}/{a}"] = _summary(r)
    if len(kept) > 1:
        out["slot_cv"] = {m: round(statistics.stdev(x) / statistics.fmean(x), 4)
                          for m in modes for x in [[p[m]["tok_s"] for p in kept]]}
        logs = [math.log(p[m]["tok_s"]) for p in kept for m in modes if p[m]["tok_s"] > 0]
        mean = statistics.fmean(logs)
        pos = {}
        for k in kept_ids:
            for m in modes:
                if by[k][m]["tok_s"] > 0:
                    pos.setdefault(f"{m} {'first' if first[k] == m else 'second'}", []).append(
                        math.log(by[k][m]["tok_s"]) - mean)
        out["by_position"] = {k: {"n": len(v), "mean_log": round(statistics.fmean(v), 4),
                                  "se": round(statistics.stdev(v) / math.sqrt(len(v)), 4) if len(v) > 1 else None}
                              for k, v in sorted(pos.items())}
    noise = tick_noise([p[m] for p in kept for m in modes])
    if noise:
        out["tick_noise"] = noise
    cpu = cpu_pairs(kept, modes)
    if cpu:
        out["cpu_per_token"] = cpu
    if settle_s > 0 and kept:
        rs = [(settled_rate(p[b], settle_s), settled_rate(p[a], settle_s)) for p in kept]
        rs = [x / y for x, y in rs if x is not None and y]
        if rs:
            out["settled"] = {"settle_s": settle_s, "pairs": len(rs), f"{b}/{a}": _summary(rs)}
    return out
