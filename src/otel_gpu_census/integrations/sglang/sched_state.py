"""SGLang's scheduler state at each step, and the tokens retracted requests compute again.

Read as each batch runs (scheduler thread): requests running (the running batch's, plus a prefill batch's new
ones), waiting (``waiting_queue``), the cap (``max_running_requests``, from ``--max-running-requests``), the
KV pool's tokens used and free (``max_total_num_tokens``, ``token_to_kv_pool_allocator.available_size()``:
SGLang's pool counts tokens, not blocks, and what the prefix cache could evict counts as used; read every
KV_EVERY steps, the figures in between as of that read, since the pool's free size is a tensor's length, slow
to read), and the retractions since the last step (``ScheduleBatch.retract_decode``, counted by its hook). The
fields are checked once, on the first read: an SGLang whose scheduler has other fields gets no state (one log
line).

A retracted request loses its KV cache (SGLang frees it at once, without keeping it in the prefix cache) and is
prefilled again from its prompt and the tokens it had generated: :class:`Recompute` keeps how far each had
computed and counts the tokens of its next extend batches below that mark (``prefix_lens``, ``extend_lens``).
Only retracted requests are looked at, so a step with none costs one truth test.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

log = logging.getLogger("otel_gpu_census.sglang")

MAX_OWED = 1 << 14
KV_EVERY = 16                       # steps between reads of the KV pool's free size


def state_reader(sched) -> Callable[[Any, int, int], Tuple[int, ...]]:
    """`sched`'s reader: read(batch, preempted, recomputed) -> attribution/engine_state.FIELDS. Raises
    (AttributeError, TypeError) where `sched` is not the scheduler it knows."""
    alloc, total, cap = sched.token_to_kv_pool_allocator, sched.max_total_num_tokens, sched.max_running_requests
    available = alloc.available_size
    for v in (total, cap, available()):
        if type(v) is not int or v < 0:
            raise TypeError(f"not a count: {v!r}")
    len(sched.waiting_queue), len(sched.running_batch.reqs)
    kv = [0, 0]                              # [steps until the next read, free tokens as of the last]

    def read(batch, preempted: int, recomputed: int) -> Tuple[int, ...]:
        rb = sched.running_batch
        running = len(rb.reqs)
        if batch is not rb:                  # a prefill batch beside the running one (mixed: both in it)
            running = len(batch.reqs) if batch.forward_mode.is_mixed() else running + len(batch.reqs)
        if kv[0]:
            kv[0] -= 1
        else:
            kv[0], kv[1] = KV_EVERY - 1, available()
        free = kv[1]
        return running, len(sched.waiting_queue), cap, total - free, free, preempted, recomputed
    return read


def reader(sched) -> Optional[Callable[[Any, int, int], Tuple[int, ...]]]:
    try:
        return state_reader(sched)
    except Exception as e:
        log.warning("otel-gpu-census: this SGLang's scheduler has no fields the engine state is read from (%s: %s); "
                    "the report's diagnoses go without it", type(e).__name__, e)
        return None


class Recompute:
    """Retracted requests, how far each had computed, and the tokens of later extend batches below that mark."""

    def __init__(self) -> None:
        self.owed: Dict[str, Tuple[Any, int]] = {}   # rid -> (its Req, tokens whose KV it had)
        self.preempted = 0

    def retracted(self, reqs) -> None:
        """ScheduleBatch.retract_decode returned these (their KV freed, back to the queue)."""
        for req in reqs or ():
            self.preempted += 1
            mark = len(req.origin_input_ids) + len(req.output_ids) - 1    # the last token's KV is the next step's
            if mark <= 0:
                continue
            if len(self.owed) >= MAX_OWED:
                self.owed.pop(next(iter(self.owed)))
            old = self.owed.get(req.rid)
            self.owed[req.rid] = (req, max(mark, old[1]) if old else mark)

    def step(self, batch, tokens: Mapping[str, int]) -> Tuple[int, Optional[Dict[str, int]]]:
        """(retractions since the last step, {rid: tokens this batch computes again} or None)."""
        n, self.preempted = self.preempted, 0
        if not self.owed:
            return n, None
        reqs = batch.reqs
        mode = batch.forward_mode
        pre, ext = getattr(batch, "prefix_lens", None), getattr(batch, "extend_lens", None)
        extend = mode.is_extend() and pre is not None and ext is not None
        redo: Dict[str, int] = {}
        for rid, (req, mark) in list(self.owed.items()):
            if rid not in tokens:
                if req.finished():
                    del self.owed[rid]
                continue
            if not extend:                   # decoding again: its prefill is past
                del self.owed[rid]
                continue
            i = next((j for j, r in enumerate(reqs) if r is req), None)
            if i is None:
                continue
            before, after = int(pre[i]), int(pre[i]) + int(ext[i])
            if before < mark:
                redo[rid] = min(after, mark) - before
            if after >= mark:
                del self.owed[rid]
        return n, redo or None
