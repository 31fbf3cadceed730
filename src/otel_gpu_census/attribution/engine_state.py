"""The engine's own state, step by step, summed per second for the report's diagnoses.

An engine hook reads a few integers from its scheduler as each step opens (:data:`FIELDS`: requests
running and waiting, the configured cap on running requests, KV-cache blocks (SGLang: tokens) used and free, requests
preempted since the last step and prompt tokens this step recomputes) and hands them to the ledger
with the step, one tuple. Where settling runs, :class:`StateBuckets` takes each split step with its
priced kernel time and the kernel time of its recomputed tokens (the preempted requests' parts of it)
and sums them per wall-clock second, each step's state weighted by how long it held: from its open to
the next step's open, at most HOLD_NS past its own end (an engine with nothing to do opens no step; its
state then is not this step's). A bucket is one JSON object of integers in the request log
(``{"engine_state": ...}``), written when a later second's step comes (and at the end): what
``report`` reads to tell a concurrency cap, a front end and KV-cache exhaustion apart.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

FIELDS = ("running", "waiting", "cap", "kv_used", "kv_free", "preempted", "recomputed")
RUNNING, WAITING, CAP, KV_USED, KV_FREE, PREEMPTED, RECOMPUTED = range(len(FIELDS))
BUCKET_NS = 1_000_000_000
HOLD_NS = 100_000_000               # a step's state holds at most this long after its end
MAX_BUCKETS = 100_000               # kept unwritten (a writer that never drains)


def valid(state: Any) -> bool:
    """`state` is what a hook records: len(FIELDS) non-negative ints."""
    return (isinstance(state, tuple) and len(state) == len(FIELDS)
            and all(type(x) is int and x >= 0 for x in state))


def _bucket(t: int) -> Dict[str, int]:
    return {"t": t, "steps": 0, "step_ns": 0, "running_ns": 0, "waiting_ns": 0, "cap": 0, "at_cap_ns": 0,
            "at_cap_running_ns": 0, "at_cap_waiting_ns": 0, "at_cap_kv_used_ns": 0, "kv_total": 0,
            "kv_used_max": 0, "preempted": 0, "recomputed_tokens": 0, "recompute_kernel_ns": 0, "kernel_ns": 0}


class StateBuckets:
    """Split steps' states summed per second (see the module docstring). Fed in step order."""

    def __init__(self) -> None:
        self._held: Optional[tuple] = None          # (opened, closed, state, kernel ns, recompute ns), unweighed
        self._cur: Optional[Dict[str, int]] = None
        self._done: List[Dict[str, int]] = []
        self.steps = 0
        self.dropped = 0
        self.invalid = 0                # states that were not len(FIELDS) counts (left out)

    def add(self, opened_ns: int, closed_ns: int, state: Sequence[int], kernel_ns: int, recompute_ns: int) -> None:
        if not valid(state):
            self.invalid += 1
            return
        if self._held is not None:
            self._weigh(*self._held, next_open=opened_ns)
        self._held = (opened_ns, closed_ns, state, kernel_ns, recompute_ns)

    def _weigh(self, opened: int, closed: int, s: tuple, kernel_ns: int, recompute_ns: int,
               next_open: Optional[int]) -> None:
        end = max(closed, opened + 1) + HOLD_NS
        if next_open is not None:
            end = min(end, max(next_open, opened + 1))
        dur = end - opened
        t = opened - opened % BUCKET_NS
        b = self._cur
        if b is None or b["t"] != t:
            if b is not None:
                self._emit(b)
            b = self._cur = _bucket(t)
        running, waiting, cap = s[RUNNING], s[WAITING], s[CAP]
        self.steps += 1
        b["steps"] += 1
        b["step_ns"] += dur
        b["running_ns"] += running * dur
        b["waiting_ns"] += waiting * dur
        b["cap"] = max(b["cap"], cap)
        if cap and running >= cap:
            b["at_cap_ns"] += dur
            b["at_cap_running_ns"] += running * dur
            b["at_cap_waiting_ns"] += waiting * dur
            b["at_cap_kv_used_ns"] += s[KV_USED] * dur
        b["kv_total"] = max(b["kv_total"], s[KV_USED] + s[KV_FREE])
        b["kv_used_max"] = max(b["kv_used_max"], s[KV_USED])
        b["preempted"] += s[PREEMPTED]
        b["recomputed_tokens"] += s[RECOMPUTED]
        b["recompute_kernel_ns"] += recompute_ns
        b["kernel_ns"] += kernel_ns

    def _emit(self, b: Dict[str, int]) -> None:
        if len(self._done) >= MAX_BUCKETS:
            self.dropped += 1
            return
        self._done.append(b)

    def drain(self, final: bool = False) -> List[Dict[str, int]]:
        """The buckets complete so far (`final`: every bucket, the last step held HOLD_NS past its end)."""
        if final:
            if self._held is not None:
                self._weigh(*self._held, next_open=None)
                self._held = None
            if self._cur is not None:
                self._emit(self._cur)
                self._cur = None
        out, self._done = self._done, []
        return out
