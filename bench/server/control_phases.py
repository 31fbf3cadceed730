"""Census modes side by side on one running server, through the census's control file.

A server started under `otel-gpu-census run` keeps one segment per CUDA process; beside each, the
injector reads `<segment>.control` at every flush (native/src/injector.c, control_poll). Writing
`census=off` or `census=on` there switches the running census,
so throughput of the modes can be compared on one server, in alternating phases, without the
restart-to-restart spread of separate servers (±15 % seen with vLLM on the H200).

    phases = Phases(census_dir)
    phases.set("events")          # every segment's control file; waits until each segment says so
    before = phases.totals(); ...load...; delta = phases.totals() - before
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Dict

MODES = {      # the whole state each phase runs in
    "off": "census=off\n",                                        # paused: nothing counted
    "events": "census=on\n",                                      # the default collector counting, event pairs timing
}


# segment counters of where records went (not work done): summed, never divided per token
DIAGNOSTICS = ("records", "buffers", "dropped", "buffers_refused", "records_unknown",
               "launches_lost")


class Phases:
    def __init__(self, census_dir):
        self.dir = Path(census_dir)

    def segments(self):
        return sorted(self.dir.glob("*.seg"))

    def set(self, mode: str, timeout: float = 10.0) -> bool:
        """Write the mode to every segment's control file and wait until each segment shows it. False
        when it did not show in time, or when there is no segment to switch (no CUDA work yet)."""
        from otel_gpu_census.census.reader import read_segment
        want = MODES[mode]
        if not self.segments():
            return False
        for seg in self.segments():
            seg.with_suffix(".control").write_text(want)
        # what the segment shows once the mode is in force, read off the mode's own words
        words = dict(w.split("=", 1) for w in want.split())
        paused = words.get("census") == "off"
        graph_mode = {"launch": 1, "node": 0}.get(words.get("graphs"))
        kernels = words.get("kernels")
        t0 = time.time()
        while time.time() - t0 < timeout:
            ok = True
            for seg in self.segments():
                c = read_segment(str(seg), detail=False)
                if c.graphs.paused != paused or (graph_mode is not None and c.graphs.mode != graph_mode) \
                        or (kernels is not None and c.kernels.name != kernels):
                    ok = False
            if ok:
                return True
            time.sleep(0.1)
        return False

    def totals(self) -> Dict[str, int]:
        """Summed figures of every segment's devices: kernels, kernel time, copies per direction and
        host memory kind (count and bytes), memsets, graph launches."""
        from otel_gpu_census.census.reader import read_segment
        out: Dict[str, int] = {}

        def add(k, v):
            out[k] = out.get(k, 0) + int(v)
        for seg in self.segments():
            c = read_segment(str(seg), detail=False)
            for d in c.devices.values():
                add("kernel_count", d.kernel_count)
                add("kernel_ns", d.kernel_ns)
                # the census's kernel time: under the default collector eager launches priced
                # at the sample's mean, which the raw kernel_ns leaves out (events: graph spans only). A phase's
                # delta of it prices the phase's launches at the mean as it stood at each end.
                add("kernel_time_ns", c.kernel_time(d).ns)
                add("busy_ns", d.busy_ns)
                add("graph_launches", d.graph_launches)
                add("graph_kernel_count", d.graph_kernel_count)
                add("eager_launches", d.eager_launches)
                add("eager_traced", d.eager_traced)
                add("eager_traced_ns", d.eager_traced_ns)
                add("memset_count", d.memset.count)
                add("memset_bytes", d.memset.bytes)
                for (direction, mem), s in d.copies.cells.items():
                    add(f"copy.{direction}.{mem}.count", s.count)
                    add(f"copy.{direction}.{mem}.bytes", s.bytes)
            add("graph_unknown", c.graphs.unknown)
            add("graph_inexact", c.graphs.inexact)
            # where records can go missing: CUPTI's drops, refused buffers, records left out of the
            # sample or of unknown kind, launches not placed
            add("records", c.records)
            add("buffers", c.buffers)
            add("dropped", c.dropped)
            add("buffers_refused", c.buffers_refused)
            add("records_unknown", c.records_unknown)
            add("launches_lost", c.launches_lost)
        return out


def phase_seed(base: int, round_no: int, mode: str, modes) -> int:
    """A load seed of its own for every phase: the same seed in two phases would let the later one
    find its prompts in the server's prefix cache (llama-server's slots, vLLM's prefix caching) and
    skip their prefill, a bias for whichever mode runs second."""
    modes = list(modes)
    return base + round_no * (len(modes) + 1) + (modes.index(mode) if mode in modes else len(modes))


def delta(after: Dict[str, int], before: Dict[str, int]) -> Dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def run_rounds(phases: Phases, rounds: int, load, modes=("off", "events"), after=None,
               settle_s: float = 1.5, deadline: float = float("inf")) -> list:
    """`rounds` rounds; in each, every mode in turn (rotating who goes first) runs load(mode, round)
    -> {"tok_s", "tokens", ...}. Each phase gets the census's figures for its load (`census`) and
    whether the switch took (`switched`); each round its ratios mode/off. after(round_dict) is called
    once a round is done (to keep partial results). No round starts that would end past `deadline`
    (time.time(), judged by the longest round so far): a call cut short keeps whole rounds only."""
    out = []
    modes = list(modes)
    longest = 0.0
    for i in range(rounds):
        if out and time.time() + longest > deadline:
            print(f"rounds: {i} of {rounds}, the next would pass the deadline", flush=True)
            break
        r0 = time.time()
        order = modes[i % len(modes):] + modes[:i % len(modes)]
        rnd = {"order": order}
        for m in order:
            ok = phases.set(m)
            before = phases.totals()
            t0 = time.time_ns()
            got = load(m, i)
            t1 = time.time_ns()
            time.sleep(settle_s)    # the flusher's period: this phase's records into the totals
            # the load's wall times: requests logged by the engine are placed in their phase by them
            rnd[m] = {**got, "switched": ok, "t0_ns": t0, "t1_ns": t1, "census": delta(phases.totals(), before)}
        for m in modes:
            if m != "off" and rnd[m].get("tok_s") and rnd.get("off", {}).get("tok_s"):
                rnd[f"{m}/off"] = round(rnd[m]["tok_s"] / rnd["off"]["tok_s"], 4)
        out.append(rnd)
        print("round", i, {k: v for k, v in rnd.items() if "/" in k}, flush=True)
        if after:
            after(rnd)
        longest = max(longest, time.time() - r0)
    return out


def summarise(rounds: list, modes=("off", "events")) -> dict:
    """Median and spread of every ratio the rounds hold, every phase switched, and per output token
    and mode the census's figures (copies must not depend on the mode)."""
    import statistics
    res: dict = {"all_switched": all(x[m]["switched"] for x in rounds for m in modes)}
    for k in sorted({k for x in rounds for k in x if "/" in k}):
        r = [x[k] for x in rounds if x.get(k)]
        if r:
            res[k] = {"median": statistics.median(r), "min": min(r), "max": max(r), "all": r}
    per_tok, diag = {}, {}
    for m in modes:
        tot: Dict[str, int] = {}
        toks = sum(x[m].get("tokens") or 0 for x in rounds)
        for x in rounds:
            for k, v in x[m]["census"].items():
                tot[k] = tot.get(k, 0) + v
        per_tok[m] = {"_tokens": toks, **({k: v / toks for k, v in tot.items() if k not in DIAGNOSTICS}
                                           if toks else {})}
        diag[m] = {k: v for k, v in tot.items() if k in DIAGNOSTICS}
    res["per_output_token"] = per_tok
    res["diagnostics"] = diag     # summed over the rounds, not per token
    return res
