"""Low utilisation's causes that only the engine's own state tells apart, and what preemption cost.

The vLLM and SGLang integrations log the scheduler's state per second of stepping beside the requests
(``engine_state`` lines: requests running and waiting, the cap on running requests, KV-cache blocks,
preemptions and the kernel time of recomputed tokens; ``attribution/engine_state.py``). Over the serving
period they tell apart, where the census alone sees "many requests in flight, the GPU half idle":

- the engine's cap: running sat at it while requests waited inside the engine (``cap_bound``);
- the front end: the requests in flight (arrival to end, from the request records) were mostly not in
  the engine at all, neither running nor waiting (``front_end_bound``): by Little's law, the mean time a
  request spent in front of the scheduler is (in flight - in the engine) x serving time / requests. What
  "arrival" covers is the records': a client's log (``--request-log``) or the proxy sees the whole front end;
  the engine's own log starts a request where the engine stamped it (vLLM: before tokenising; SGLang: as its
  HTTP side took it in), so an HTTP server saturated before that point reads as fewer requests in flight;

and, whatever the utilisation, sequences preempted for want of KV cache and computed again
(``preemption``). Without state lines (an engine version whose scheduler fields differ, or no integration)
nothing here is said, and the census's own diagnoses stand.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from otel_gpu_census.report.engine_requests import STATE_FIELDS, EngineRequests
from otel_gpu_census.report.figures import plural, seconds, share

BUCKET_NS = 1_000_000_000
CAP_SHARE = 0.5             # running at the cap for at least this share of serving...
CAP_WAITING = 1.0           # ...with at least this many waiting on average meanwhile: the cap binds
FRONT_SHARE = 0.5           # at least this share of the requests in flight were not in the engine yet
PREEMPT_MIN_SHARE = 0.01    # recomputation at least this share of the kernel time while serving...
PREEMPT_MIN = 1             # ...after at least this many preemptions

FLAGS = {"vllm": ("vLLM", "`--max-num-seqs`", "`--gpu-memory-utilization`",
                  "more API-server processes (`--api-server-count`)"),
         "sglang": ("SGLang", "`--max-running-requests`", "`--mem-fraction-static`",
                    "more tokenizer workers (`--tokenizer-worker-num`)")}
ANY = ("the engine", "its cap on running requests (vLLM `--max-num-seqs`, SGLang `--max-running-requests`)",
       "its KV-cache memory (vLLM `--gpu-memory-utilization`, SGLang `--mem-fraction-static`)",
       "more API-server processes (vLLM `--api-server-count`, SGLang `--tokenizer-worker-num`)")


@dataclass(frozen=True)
class EngineState:
    """The state lines over a period, summed (cap and KV blocks: their largest)."""

    engine: Optional[str]
    sums: Dict[str, int]

    def __getitem__(self, k: str) -> int:
        return self.sums[k]

    def words(self) -> tuple:
        return FLAGS.get(self.engine or "", ANY)


def over(logs: Sequence[EngineRequests], lo_ns: int, hi_ns: int) -> Optional[EngineState]:
    """The state of the logs' engine(s) over [lo_ns, hi_ns): the seconds that overlap it. None: no state."""
    sums = {k: 0 for k in STATE_FIELDS if k != "t"}
    engine, n = None, 0
    for log in logs:
        for b in log.states:
            if b["t"] + BUCKET_NS <= lo_ns or b["t"] >= hi_ns:
                continue
            n += 1
            engine = engine or log.engine
            for k in sums:
                sums[k] = max(sums[k], b[k]) if k in ("cap", "kv_total", "kv_used_max") else sums[k] + b[k]
    return EngineState(engine, sums) if n and sums["steps"] else None


def cause(st: EngineState, span_ns: int, mean_in_flight: float, requests: int, head: str,
          few: float) -> Optional[tuple]:
    """(kind, text, figures) of the cause the state names for a GPU busy as `head` says, or None (the
    census's own rules decide). `few`: the mean in flight at or below which the clients are the cause."""
    if not span_ns or mean_in_flight <= few:
        return None
    name, cap_flag, kv_flag, front_flag = st.words()
    # the seconds of state overlap the serving period's edges (and a last step holds a little past it): their
    # time, where it is longer, is what the means are over
    span = max(span_ns, st["step_ns"])
    at_cap = st["at_cap_ns"] / span
    figures = {"engine": st.engine, "cap": st["cap"], "at_cap_share": at_cap,
               "mean_running": st["running_ns"] / span, "mean_waiting": st["waiting_ns"] / span,
               "mean_in_engine": (st["running_ns"] + st["waiting_ns"]) / span, "steps": st["steps"]}
    if st["cap"] and at_cap >= CAP_SHARE and st["at_cap_ns"]:
        waiting = st["at_cap_waiting_ns"] / st["at_cap_ns"]
        if waiting >= CAP_WAITING:
            room = None
            if st["at_cap_kv_used_ns"] and st["kv_total"]:
                room = int(st["at_cap_running_ns"] / st["at_cap_kv_used_ns"] * st["kv_total"])
            figures.update(waiting_at_cap=waiting, kv_room_requests=room, kv_total_blocks=st["kv_total"])
            if room is not None and room > st["cap"] * 1.1:
                action = (f"the KV cache had room for ~{room} at this context length: raise {cap_flag} toward it")
            elif room is not None:
                action = (f"the KV cache is nearly full at the cap (room for ~{room}): raising {cap_flag} needs "
                          f"more KV memory ({kv_flag}, a smaller model or KV-cache dtype)")
            else:
                action = f"raise {cap_flag} as far as the KV cache allows"
            text = (f"{name}'s cap on running requests is the bottleneck, not the GPU: running sat at "
                    f"{cap_flag} {st['cap']} for {share(at_cap)} of serving while {waiting:.1f} requests waited "
                    f"on average; {head}; {action}.")
            return "cap_bound", text, figures
    in_engine = figures["mean_in_engine"]
    front = mean_in_flight - in_engine
    if front >= FRONT_SHARE * mean_in_flight and requests:
        wait_ns = int(front * span_ns / requests)
        figures.update(front_end_ns_per_request=wait_ns, mean_in_front=front)
        text = (f"the front end (tokenising, the API server) is the bottleneck, not the GPU: requests waited "
                f"{wait_ns / 1e6:.0f} ms on average between arrival and {name}'s scheduler, {front:.1f} of the "
                f"{mean_in_flight:.1f} in flight on average were not in the engine yet while {head}; run "
                f"{front_flag} or tokenise on the client.")
        return "front_end_bound", text, figures
    return None


def preemption(st: EngineState) -> Optional[tuple]:
    """(kind, text, figures) when sequences were preempted and their recomputation cost a share of the GPU's
    work while serving worth naming."""
    n, cost, total = st["preempted"], st["recompute_kernel_ns"], st["kernel_ns"]
    if n < PREEMPT_MIN or not total or cost < PREEMPT_MIN_SHARE * total:
        return None
    name, cap_flag, kv_flag, _ = st.words()
    figures = {"engine": st.engine, "preempted": n, "recomputed_tokens": st["recomputed_tokens"],
               "recompute_kernel_ns": cost, "kernel_ns": total, "recompute_share": cost / total,
               "kv_total_blocks": st["kv_total"], "kv_used_max_blocks": st["kv_used_max"], "cap": st["cap"]}
    cap = f" ({st['cap']})" if st["cap"] else ""
    unit = "tokens" if st.engine == "sglang" else "blocks"        # SGLang's KV pool counts tokens
    text = (f"{plural(n, 'sequence')} preempted, their recomputation ({st['recomputed_tokens']:,} tokens) cost "
            f"{seconds(cost)} s of kernel time ({share(cost / total)} of the GPU's work while serving): "
            f"{name}'s KV cache ran out at this concurrency ({st['kv_used_max']} of {st['kv_total']} {unit} "
            f"used at most); lower {cap_flag}{cap} or "
            f"add KV memory ({kv_flag}).")
    return "preemption", text, figures


def logs_of(paths: Sequence[str]) -> List[EngineRequests]:
    from otel_gpu_census.report.engine_requests import for_segments
    return [x for x in for_segments(paths) if x.states]
