"""The cost of kernel tracing on ONE llama-server: loads in traced and untraced phases of the census's
sampled kernel schedule (run_server_bench.py --kernel-phase-pairs N).

The server runs under the census with OTEL_GPU_CENSUS_KERNELS=ON_MS/PERIOD_MS (--phase-ms). The
injector traces kernels during [origin + k*P, origin + k*P + ON) of the CUPTI clock and leaves them
out during the rest of every period (copies are always traced); origin and the clock pair that maps
CUPTI time to wall time are in the server's census segment. Each pair runs one load inside a traced
phase and one inside an untraced phase, in ABBA order across pairs (traced first, untraced first,
untraced first, traced first, ...). A load starts at least --phase-lead-s after its phase began and
must end before the phase ends; one that overruns is kept in the results, marked invalid and left
out of the ratios. Reads of the segment before and after every load check that kernels were counted
in traced loads and not (at most --edge-kernels) in untraced ones, and that device-to-host bytes
grew in both. Restart-to-restart spread of the server (±5 % on the H200) is gone from the pairs.

Default load: 48 requests (~9 s on the random 8B model on an H200) in phases of 14 s (14000/28000):
the load takes ~64 % of a phase, 0.5 s lead included ~68 %. Pairs need 1.25 periods each on average
(a same-side step waits a whole period): 8 pairs ~290 s, ~5.5 min with start and warm-up. With
--load-mode waves a load is its waves back to back (3 waves of 16, ~2.8 s each: ~8.4 s) and is
placed and checked as a whole: the phase must hold every wave and the gaps between them.
"""
from __future__ import annotations

import argparse
import re
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import benchlib as bl

SIDES = ("traced", "untraced")
SETTLE_GUESS_S = 1.2       # CUPTI delivers records about a second late: the after-read waits for them


def phase_ms_arg(s: str) -> str:
    """argparse type of --phase-ms: ON_MS/PERIOD_MS as the injector takes it (multiples of 20 ms,
    0 < ON < PERIOD); anything else the injector ignores, and traces every kernel."""
    m = re.fullmatch(r"(\d+)/(\d+)", s.strip())
    on, period = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
    if not m or not 0 < on < period or on % 20 or period % 20 or period > 3_600_000:
        raise argparse.ArgumentTypeError(
            f"{s!r}: want ON_MS/PERIOD_MS, multiples of 20 ms, 0 < ON_MS < PERIOD_MS, e.g. 14000/28000")
    return f"{on}/{period}"


def pair_order(k: int) -> Tuple[str, str]:
    """ABBA across pairs: traced first, untraced first, untraced first, traced first, ..."""
    return SIDES if k % 4 in (0, 3) else SIDES[::-1]


@dataclass(frozen=True)
class Slot:
    """Where a load goes: phase k of `side`, [phase_start, phase_end) and the load's start (wall ns)."""
    side: str
    k: int
    phase_start: int
    phase_end: int
    start: int


@dataclass(frozen=True)
class Schedule:
    """The census's kernel schedule in wall time (CLOCK_REALTIME ns, time.time_ns())."""
    origin_wall_ns: int
    on_ns: int
    period_ns: int

    @classmethod
    def of(cls, census: Any) -> "Schedule":
        """From a ProcessCensus read of the server's segment."""
        k = census.kernels
        return cls(census.gpu_to_wall_ns(k.origin_gpu_ns), k.on_ms * 1_000_000, k.period_ms * 1_000_000)

    def phase(self, side: str, k: int) -> Tuple[int, int]:
        """[start, end) of period k's traced or untraced phase."""
        p0 = self.origin_wall_ns + k * self.period_ns
        return (p0, p0 + self.on_ns) if side == "traced" else (p0 + self.on_ns, p0 + self.period_ns)

    def side_at(self, t: int) -> str:
        return "traced" if (t - self.origin_wall_ns) % self.period_ns < self.on_ns else "untraced"

    def slot(self, side: str, ready: int, est_ns: int, lead_ns: int) -> Slot:
        """The first phase of `side` a load ready at `ready` can use: it starts `lead_ns` after the
        phase began, or later (at `ready`) if it still ends inside the phase by the estimate."""
        k = max(0, (ready - self.origin_wall_ns) // self.period_ns)
        while True:
            ps, pe = self.phase(side, k)
            start = max(ps + lead_ns, ready)
            if start < pe and (start == ps + lead_ns or start + est_ns <= pe):
                return Slot(side, k, ps, pe, start)
            k += 1

    def simulate(self, sides: Sequence[str], ready: int, est_ns: int, lead_ns: int,
                 settle_ns: int = int(SETTLE_GUESS_S * 1e9)) -> int:
        """When loads of `sides`, in order, would be done (settled) by the estimate."""
        for side in sides:
            ready = self.slot(side, ready, est_ns, lead_ns).start + est_ns + settle_ns
        return ready


def plan_seconds(on_ms: int, period_ms: int, pairs: int, load_s: float, lead_s: float) -> float:
    """Seconds for `pairs` pairs from a random point of the schedule (ready half a period in)."""
    s = Schedule(0, on_ms * 1_000_000, period_ms * 1_000_000)
    ready = s.period_ns // 2
    sides = [side for k in range(pairs) for side in pair_order(k)]
    return (s.simulate(sides, ready, int(load_s * 1e9), int(lead_s * 1e9)) - ready) / 1e9


# ---- census reads ------------------------------------------------------------------------------

def find_segment(reader: Any, cdir: Path, pid: int, timeout_s: float) -> Tuple[Optional[Any], str]:
    """The server's census, once its schedule is published: its own pid's segment, else (census run
    mode: the server is the launcher's child) the one segment in sampled mode. (census, why-not)."""
    from otel_gpu_census.census import KERNELS_SAMPLED
    deadline = time.monotonic() + timeout_s
    why = "no census segment"
    while True:
        try:
            procs, bad = reader.scan(cdir, detail=False)
        except Exception as e:  # a reader bug must not leave the server running
            return None, f"reader.scan failed: {type(e).__name__}: {e}"
        mine = [c for c in procs if c.pid == pid] or [c for c in procs if c.kernels.mode == KERNELS_SAMPLED]
        if mine:
            c = max(mine, key=lambda c: c.records)
            if c.kernels.mode != KERNELS_SAMPLED:
                return None, (f"the census traces kernels in mode {c.kernels.name}, not sampled: the injector "
                              f"ignored OTEL_GPU_CENSUS_KERNELS (see the server log)")
            if c.kernels.origin_gpu_ns:
                return c, ""
            why = "the census segment has no kernel schedule yet"
        elif bad:
            why = f"unreadable segments: {'; '.join(map(str, bad[:3]))}"
        if time.monotonic() > deadline:
            return None, (f"{why} in {cdir} after {timeout_s:.0f} s (the injector starts only with CUDA: "
                          f"no GPU here?)")
        time.sleep(0.2)


def read(reader: Any, path: str) -> Tuple[Optional[Any], Optional[str]]:
    try:
        return reader.read_segment(path, detail=False), None
    except Exception as e:   # SegmentError, or a reader bug: recorded, the load still counts
        return None, f"{type(e).__name__}: {e}"


def settled_read(reader: Any, path: str, done_wall_ns: int, timeout_s: float) -> Tuple[Optional[Any], Dict[str, Any]]:
    """A read whose totals hold all GPU work finished before done_wall_ns (complete_wall_ns past it,
    or the writer exited); after timeout_s the latest read, marked unsettled."""
    t0 = time.monotonic()
    while True:
        c, err = read(reader, path)
        settled = c is not None and (c.complete_wall_ns >= done_wall_ns or c.state_name != "active")
        if settled or time.monotonic() - t0 > timeout_s:
            return c, {"settled": settled, "settle_s": round(time.monotonic() - t0, 2),
                       **({"read_error": err} if err else {})}
        time.sleep(0.1)


def census_delta(before: Any, after: Any) -> Dict[str, Any]:
    """What the census counted between two reads of the server's segment."""
    tb, ta = before.totals(), after.totals()
    out: Dict[str, Any] = {
        "kernels": ta.kernel_count - tb.kernel_count,
        "dtoh_bytes": ta.copies.by_direction()["dtoh"].bytes - tb.copies.by_direction()["dtoh"].bytes,
        "traced_s": round((after.kernels.traced_ns - before.kernels.traced_ns) / 1e9, 3),
        "window_s": round((after.complete_wall_ns - before.complete_wall_ns) / 1e9, 3),
    }
    if before.complete_wall_ns and after.complete_wall_ns:   # the same, by the schedule
        out["traced_s_schedule"] = round(after.kernels.traced_between(
            after.wall_to_gpu_ns(before.complete_wall_ns), after.wall_to_gpu_ns(after.complete_wall_ns)) / 1e9, 3)
    return out


def census_check(side: str, d: Dict[str, Any], edge_kernels: int) -> str:
    """'ok', or what the census counted that a load in this phase should not have."""
    why = []
    if side == "traced" and d["kernels"] <= 0:
        why.append("no kernels counted in a traced phase")
    if side == "untraced" and d["kernels"] > edge_kernels:
        why.append(f"{d['kernels']} kernels counted in an untraced phase (edge allowance {edge_kernels})")
    if d["dtoh_bytes"] <= 0:
        why.append("no device-to-host bytes counted")
    return "; ".join(why) or "ok"


# ---- the session ---------------------------------------------------------------------------------

def run_session(b: Any, flags: str, pairs: int, on_pair: Callable[[Dict[str, Any]], None]) -> Dict[str, Any]:
    """ONE censused server (sampled kernels), warmed up, then `pairs` traced/untraced load pairs placed
    on the census's schedule, until done, the budget, or two overruns in a row."""
    from run_server_bench import log_evidence, wave_note   # it imports this module: take its helpers when used
    a, log = b.a, b.log
    n = b.cycle_no
    b.cycle_no += 1
    rec: Dict[str, Any] = {"session": n, "flags": flags, "variant": "census-sampled", "phase_ms": a.phase_ms,
                           "loads": []}
    pkg, why = bl.import_package()
    if pkg is None:
        rec["error"] = why
        return rec
    from otel_gpu_census.census import reader
    t0 = time.monotonic()
    srv = b.launch("census-sampled", flags, n, rec)
    if srv is None:
        return rec
    proc, url, cdir = srv
    lead_ns = int(a.phase_lead_s * 1e9)
    ok_requests = 0
    try:
        c, why = find_segment(reader, cdir, proc.pid, a.segment_timeout)
        if c is None:
            rec["error"] = why
            return rec
        sched = Schedule.of(c)
        rec["schedule"] = {"kernels": c.kernels.name, "on_ms": c.kernels.on_ms, "period_ms": c.kernels.period_ms,
                           "origin_gpu_ns": c.kernels.origin_gpu_ns, "origin_wall_ns": sched.origin_wall_ns,
                           "origin_wall": time.strftime("%H:%M:%S", time.localtime(sched.origin_wall_ns / 1e9))
                           + f".{sched.origin_wall_ns // 1_000_000 % 1000:03d}",
                           "clock_ref_gpu_ns": c.clock_ref_gpu_ns, "clock_ref_wall_ns": c.clock_ref_wall_ns,
                           "lead_s": a.phase_lead_s, "segment": Path(c.path).name}
        log(f"census segment {Path(c.path).name}: kernels {c.kernels.name}, schedule origin "
            f"{rec['schedule']['origin_wall']} (wall), now {sched.side_at(time.time_ns())}")
        walls: List[float] = []
        if a.warmup_requests:
            w = b.run_load(url, 7, a.warmup_requests)
            ok_requests += w.get("ok") or 0
            rec["warmup"] = {k: w.get(k) for k in ("ok", "requests", "wall_s", "output_tok_s", "first_errors")}
            if w.get("wall_s"):
                walls.append(w["wall_s"])
            log(f"warm-up: {w.get('ok')}/{w.get('requests')} ok, {w.get('wall_s')} s "
                f"(a phase leaves {min(a.on_ms, a.period_ms - a.on_ms) / 1000 - a.phase_lead_s:.1f} s)")
        settled_read(reader, c.path, time.time_ns(), a.settle_timeout)   # warm-up's records in
        overruns = 0
        for k in range(pairs):
            if proc.poll() is not None:
                rec["error"] = f"server exited (rc={proc.returncode}) after {k} pairs"
                break
            est_s = max(walls[-4:]) if walls else a.load_estimate_s
            now = time.time_ns()
            need_s = (sched.simulate(pair_order(k), now, int(est_s * 1e9), lead_ns) - now) / 1e9
            if log.elapsed() + need_s + a.stop_timeout / 3 > a.budget_s:
                rec["stopped_early"] = f"budget: {k} pairs done ({log.elapsed():.0f} s used, next pair ~{need_s:.0f} s)"
                log(rec["stopped_early"])
                break
            for side in pair_order(k):
                x = one_load(b, reader, c.path, url, sched, k, side, est_s, lead_ns)
                rec["loads"].append(x)
                ok_requests += x["load"].get("ok") or 0
                walls.append(x["load"].get("wall_s") or est_s)
                overruns = overruns + 1 if x["overrun"] else 0
                if overruns >= 2:
                    break
            if overruns >= 2:
                rec["stopped_early"] = (f"two loads in a row overran their phase (last {walls[-1]:.1f} s in a "
                                        f"{x['phase_s']:.1f} s phase): use a longer --phase-ms or fewer --requests")
                log(rec["stopped_early"])
                on_pair(rec)
                break
            by = {x["side"]: x for x in rec["loads"] if x["pair"] == k}
            if len(by) == 2 and by["traced"]["valid"] and by["untraced"]["valid"]:
                t, u = by["traced"]["load"], by["untraced"]["load"]
                log(f"pair {k} {flags}: traced {t['output_tok_s']} tok/s, untraced {u['output_tok_s']}, ratio "
                    f"{t['output_tok_s'] / u['output_tok_s']:.4f}; TTFT p50 {u.get('ttft_p50_s')} -> "
                    f"{t.get('ttft_p50_s')} s" + wave_note(t, u))
            on_pair(rec)
    finally:   # also after an early return: the server stops, its last census read is kept
        rec["stop"] = bl.stop(proc, grace_s=a.stop_timeout)
        rec["session_s"] = round(time.monotonic() - t0, 1)
        rec["log_evidence"] = log_evidence(b.work / rec["server_log"])
        b.census_after(rec, cdir, ok_requests)
    return rec


def one_load(b: Any, reader: Any, path: str, url: str, sched: Schedule, k: int, side: str, est_s: float,
             lead_ns: int) -> Dict[str, Any]:
    """Pair k's load on `side`: wait for its slot, read the census, run the load, read the census
    again once the load's records are in; where it ran in its phase, and what the census counted."""
    from run_server_bench import complete, load_record
    a = b.a
    slot = sched.slot(side, time.time_ns(), int(est_s * 1e9), lead_ns)
    time.sleep(max(0.0, (slot.start - time.time_ns()) / 1e9))
    before, berr = read(reader, path)
    t_start = time.time_ns()
    res = b.run_load(url, 1000 * (k + 1) + (500 if side == "traced" else 0))
    t_end = time.time_ns()
    after, settle = settled_read(reader, path, t_end, a.settle_timeout)
    summary, per_request = load_record(res)
    overrun = t_end > slot.phase_end
    x: Dict[str, Any] = {
        "pair": k, "side": side, "phase": slot.k, "start_wall_ns": t_start, "end_wall_ns": t_end,
        "start_after_phase_s": round((t_start - slot.phase_start) / 1e9, 3),
        "end_before_phase_end_s": round((slot.phase_end - t_end) / 1e9, 3),
        "phase_s": round((slot.phase_end - slot.phase_start) / 1e9, 3),
        "overrun": overrun, "complete": complete(summary), "valid": complete(summary) and not overrun,
        "census_read": dict(settle, **({"before_error": berr} if berr else {}))}
    if before is not None and after is not None:
        x["census"] = census_delta(before, after)
        x["census"]["check"] = census_check(side, x["census"], a.edge_kernels)
    cs = x.get("census", {})
    spare = (f"OVERRUN by {-x['end_before_phase_end_s']:.2f} s" if overrun
             else f"{x['end_before_phase_end_s']:.2f} s to spare")
    b.log(f"pair {k} {side:<8} phase {slot.k}: +{x['start_after_phase_s']:.2f} s, {summary.get('output_tok_s')} "
          f"tok/s in {summary.get('wall_s')} s, {spare}; census: {cs.get('kernels')} kernels, "
          f"{cs.get('dtoh_bytes')} B D2H, {cs.get('check', 'no read')}")
    x.update(load=summary, per_request=per_request)
    return x


# ---- rows ----------------------------------------------------------------------------------------

def rows(a: argparse.Namespace, sessions: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One row per session: plain = untraced-phase loads, census = traced-phase loads, ratio = the
    median traced/untraced pair ratio over pairs whose loads both completed inside their phases."""
    from run_server_bench import pair_figures
    out = []
    for s in sessions:
        row: Dict[str, Any] = {"workload": "server/llama.cpp kernel tracing, one server", "flags": s["flags"],
                               "variant": "census-sampled", "phase_ms": s["phase_ms"],
                               "env": s.get("env", {}), "unit": "output tok/s",
                               "reference": "untraced phase (same server)", "schedule": s.get("schedule")}
        by = {(x["pair"], x["side"]): x for x in s.get("loads", [])}
        ks = sorted({k for k, _ in by})
        row["per_pair"] = [pair_entry(k, by.get((k, "traced")), by.get((k, "untraced"))) for k in ks]
        valid = [k for k in ks if all(by.get((k, sd), {}).get("valid") for sd in SIDES)]
        row["invalid_pairs"] = [{"pair": p["pair"], "why": p["why"]} for p in row["per_pair"] if not p["valid"]]
        row["overruns"] = sum(1 for x in by.values() if x["overrun"])
        row["census_checks"] = checks(list(by.values()), a.edge_kernels)
        if s.get("stopped_early"):
            row["stopped_early"] = s["stopped_early"]
        if not valid:
            row["error"] = s.get("error") or "no valid pair (both loads complete and inside their phases)"
            out.append(row)
            continue
        pairs = [(by[(k, "untraced")]["load"], by[(k, "traced")]["load"]) for k in valid]
        pair_figures(row, pairs)
        if "d2h_bytes_per_request" in s:
            row["d2h_bytes_per_request"] = s["d2h_bytes_per_request"]
            row["d2h_mb_per_request"] = round(s["d2h_bytes_per_request"] / 1e6, 1)
        out.append(row)
    return out


def pair_entry(k: int, t: Optional[Dict[str, Any]], u: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    keys = ("output_tok_s", "steady_tok_s", "ttft_p50_s", "ttft_p90_s", "wall_s", "wave_tok_s_cv")

    def side(x: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        if x is None:
            return None
        cs = x.get("census", {})
        return {**{kk: x["load"].get(kk) for kk in keys},
                **{kk: x[kk] for kk in ("phase", "start_after_phase_s", "end_before_phase_end_s", "overrun")},
                "kernels": cs.get("kernels"), "dtoh_bytes": cs.get("dtoh_bytes"), "check": cs.get("check")}

    why = [f"{sd}: {w}" for sd, x in (("traced", t), ("untraced", u))
           for w in ([] if x and x["valid"] else ["not run"] if x is None
                     else ["overran its phase"] if x["overrun"] else ["load incomplete"])]
    e: Dict[str, Any] = {"pair": k, "order": f"{pair_order(k)[0]} first", "traced": side(t), "untraced": side(u),
                         "valid": not why, "why": "; ".join(why) or None, "ratio": None}
    if not why:
        e["ratio"] = bl.rnd(t["load"]["output_tok_s"] / u["load"]["output_tok_s"])
    return e


def checks(loads: List[Dict[str, Any]], edge_kernels: int) -> Dict[str, Any]:
    """The census's view of the loads that stayed inside their phases."""
    inside = [x for x in loads if not x["overrun"] and "census" in x]
    tr = [x["census"]["kernels"] for x in inside if x["side"] == "traced"]
    un = [x["census"]["kernels"] for x in inside if x["side"] == "untraced"]
    d2h = [x["census"]["dtoh_bytes"] for x in inside]
    out = {"traced_loads_with_kernels": f"{sum(1 for v in tr if v > 0)}/{len(tr)}",
           "untraced_loads_without_kernels": f"{sum(1 for v in un if v <= edge_kernels)}/{len(un)}",
           "edge_kernels_allowed": edge_kernels, "untraced_kernels_max": max(un, default=None),
           "traced_kernels_median": bl.median(tr), "loads_with_dtoh": f"{sum(1 for v in d2h if v > 0)}/{len(d2h)}",
           "loads_without_census_read": sum(1 for x in loads if not x["overrun"] and "census" not in x)}
    # None: no load to judge (none stayed inside its phase)
    out["ok"] = (all(x["census"]["check"] == "ok" for x in inside) and not out["loads_without_census_read"]
                 if inside else None)
    return out


# ---- the mode's main ---------------------------------------------------------------------------------

def main(a: argparse.Namespace, b: Any, log: bl.Log, result: Dict[str, Any], out_path: Path) -> int:
    """--kernel-phase-pairs: one session (server, warm-up, N pairs) per flag set."""
    from run_server_bench import load_shape, print_table, run_sessions
    sessions: List[Dict[str, Any]] = result["runs"]
    pairs_s = plan_seconds(a.on_ms, a.period_ms, a.kernel_phase_pairs, a.load_estimate_s, a.phase_lead_s)
    per = 15 + (a.load_estimate_s + SETTLE_GUESS_S if a.warmup_requests else 0) + pairs_s
    log(f"plan: one server per flag set {a.flag_sets}, OTEL_GPU_CENSUS_KERNELS={a.phase_ms} (kernels traced "
        f"{a.on_ms / 1000:g} s of every {a.period_ms / 1000:g} s); start + warm-up ({a.warmup_requests} requests) + "
        f"{a.kernel_phase_pairs} pairs (traced/untraced, ABBA), a load ~{a.load_estimate_s:g} s starting "
        f"{a.phase_lead_s:g} s into its phase: ~{pairs_s:.0f} s of pairs, ~{per / 60:.1f} min each, "
        f"~{per * len(a.flag_sets) / 60:.1f} min in all; {a.requests} requests x {a.prompt_tokens} prompt tokens x "
        f"{a.n_predict} out, {a.clients} clients, {load_shape(a)}; budget {a.budget_s:.0f} s")
    if a.load_estimate_s + a.phase_lead_s > min(a.on_ms, a.period_ms - a.on_ms) / 1000:
        log(f"warning: a load of ~{a.load_estimate_s:g} s does not fit a phase of {a.phase_ms} ms after the "
            f"{a.phase_lead_s:g} s lead: loads will overrun")
    log(f"server: {shlex.join(b.server_cmd(a.port, a.flag_sets[0]))}")

    run_sessions(a, log, result, out_path, lambda ss: rows(a, ss),
                 lambda flags, save: run_session(b, flags, a.kernel_phase_pairs, save))
    print_table(result["rows"])
    bad_checks = False
    for r in result["rows"]:
        if not r["per_pair"]:
            continue
        print(f"\n{r['flags']}: schedule {r['phase_ms']} ms, {len(r['per_pair'])} pairs, {len(r['invalid_pairs'])} "
              f"invalid, {r['overruns']} overruns; census checks {({True: 'ok', False: 'FAILED', None: 'none'})[r['census_checks']['ok']]}: "
              f"{r['census_checks']}")
        print(f"{'pair':>4} {'order':<15}{'traced':>9}{'untraced':>10}{'ratio':>8}{'ttft t':>8}{'ttft u':>8}"
              f"{'kern t':>9}{'kern u':>8}  note")
        for p in r["per_pair"]:
            t, u = p["traced"] or {}, p["untraced"] or {}
            print(f"{p['pair']:>4} {p['order']:<15}{t.get('output_tok_s') or 0:>9.1f}"
                  f"{u.get('output_tok_s') or 0:>10.1f}"
                  f"{'-' if p['ratio'] is None else format(p['ratio'], '.4f'):>8}"
                  f"{t.get('ttft_p50_s') or 0:>8.3f}{u.get('ttft_p50_s') or 0:>8.3f}"
                  f"{t.get('kernels') if t.get('kernels') is not None else '-':>9}"
                  f"{u.get('kernels') if u.get('kernels') is not None else '-':>8}  {p['why'] or ''}")
        if "error" not in r:
            print(f"ratio (median traced/untraced) {r['ratio']}, spread {r['ratio_spread']}; untraced tok/s CV "
                  f"{r['plain_tok_s_cv']}, traced {r['tok_s_cv']}"
                  + (f"; CV across waves (median of loads) untraced {r['plain_wave_tok_s_cv']}, traced "
                     f"{r['wave_tok_s_cv']}" if "wave_tok_s_cv" in r else ""))
        bad_checks |= r["census_checks"]["ok"] is False
    print(f"\nsessions: {len(sessions)}, hangs: {result['hangs']}; results: {out_path}; logs: {b.work}")
    if bad_checks:
        print("census checks FAILED: the census did not count kernels as the schedule says (see census_checks)")
    return 0 if sessions and not bad_checks and not any("error" in r for r in result["rows"]) else 1
