"""vLLM's scheduler state at each step, and the tokens preempted requests compute again.

Read as each step opens (engine thread): requests running (``Scheduler.running``) and waiting
(``waiting`` and, where vLLM has it, ``skipped_waiting``), the cap (``max_num_running_reqs``, from
``--max-num-seqs``), KV-cache blocks used and free (``kv_cache_manager.block_pool``), and the
preemptions since the last step (``Scheduler._preempt_request``, counted by its hook): a handful of
attribute reads, the queues' lengths through ``deque.__len__`` where they are deques (vLLM's FCFS
queue wraps it in a Python ``__len__``). The fields are checked once, on the first read: a vLLM whose
scheduler has other fields gets no state (one log line), and the report keeps its other diagnoses.

A preempted request loses its KV blocks and its computed tokens (``num_computed_tokens`` is reset; the
prefix cache may give some back when it resumes): :class:`Recompute` keeps, for each one, how far it had
computed, and counts the tokens its later steps schedule below that mark as recomputed. Only preempted
requests are looked at, so a step with none costs one truth test.
"""
from __future__ import annotations

import logging
from collections import deque
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

log = logging.getLogger("otel_gpu_census.vllm")

_dlen = deque.__len__
MAX_OWED = 1 << 14                  # preempted requests followed at once (beyond: the oldest is dropped)


def _length(q) -> Callable[[], int]:
    """q's length as a call of no arguments: deque's own slot, bound, where q is one (no Python frame)."""
    return _dlen.__get__(q) if isinstance(q, deque) else q.__len__


def state_reader(sched) -> Callable[[int, int], Tuple[int, ...]]:
    """`sched`'s state reader: read(preempted, recomputed) -> attribution/engine_state.FIELDS (a closure: its
    cells are read faster than an object's attributes). Raises (AttributeError, TypeError) where `sched` is not
    the scheduler it knows."""
    pool = sched.kv_cache_manager.block_pool
    queue, total, cap = pool.free_block_queue, pool.num_gpu_blocks, sched.max_num_running_reqs
    for v in (total, cap, queue.num_free_blocks):
        if type(v) is not int or v < 0:
            raise TypeError(f"not a count: {v!r}")
    skipped = getattr(sched, "skipped_waiting", None)
    wlen = _length(sched.waiting)
    slen = _length(skipped) if skipped is not None else int      # int(): 0
    len(sched.running) + wlen() + slen()

    def read(preempted: int, recomputed: int) -> Tuple[int, ...]:
        free = queue.num_free_blocks
        return len(sched.running), wlen() + slen(), cap, total - free, free, preempted, recomputed
    return read


def reader(sched) -> Optional[Callable[[int, int], Tuple[int, ...]]]:
    """The scheduler's state reader, or None (one log line) where its fields are not the ones known."""
    try:
        return state_reader(sched)
    except Exception as e:
        log.warning("otel-gpu-census: this vLLM's scheduler has no fields the engine state is read from (%s: %s); "
                    "the report's diagnoses go without it", type(e).__name__, e)
        return None


class Recompute:
    """Preempted requests, how far each had computed, and the tokens of later steps below that mark."""

    def __init__(self) -> None:
        self.owed: Dict[str, Tuple[Any, int]] = {}   # request id -> (its Request, tokens it had computed)
        self.preempted = 0                           # preemptions since the last step

    def preempting(self, request) -> None:
        """Scheduler._preempt_request(request), before it resets the request's computed tokens."""
        self.preempted += 1
        rid = request.request_id
        mark = int(request.num_computed_tokens or 0)
        old = self.owed.pop(rid, None)
        if old is not None:
            mark = max(mark, old[1])
        if mark <= 0:
            return
        if len(self.owed) >= MAX_OWED:
            self.owed.pop(next(iter(self.owed)))
        self.owed[rid] = (request, mark)

    def step(self, tokens: Mapping[str, int]) -> Tuple[int, Optional[Dict[str, int]]]:
        """A step opens with `tokens` ({request: scheduled}; vLLM has already advanced each request's computed
        tokens past them): (preemptions since the last step, {request: tokens it recomputes in it} or None)."""
        n, self.preempted = self.preempted, 0
        if not self.owed:
            return n, None
        redo: Dict[str, int] = {}
        for rid, (req, mark) in list(self.owed.items()):
            k = tokens.get(rid)
            if not k:
                if req.is_finished():
                    del self.owed[rid]
                continue
            after = int(req.num_computed_tokens)
            before = after - k
            if before < mark:
                redo[rid] = min(after, mark) - max(before, 0)
            if after >= mark:
                del self.owed[rid]
        return n, redo or None
