"""Dual-batch overlap: a step's GPU work launched on vLLM's micro-batch threads belongs to the step.

With ``--enable-dbo`` (or a micro-batch size above one) vLLM's ``UBatchWrapper`` runs the model of one
``execute_model`` as two micro-batches, each on a thread of its own that enters a
``UBatchContext`` (``vllm/v1/worker/ubatching.py``) and launches its kernels there, while the engine
thread waits for both. The census tags GPU work by the launching thread's open step, so without this
the model's work of such a step would be no step's. Each micro-batch thread, once inside its context
and while a step is open on the engine's thread, pushes that step's id on itself and pops it when it
leaves (after vLLM's own ``__exit__``, which may launch the micro-batch's last receive). Contexts
entered with no step open (CUDA-graph capture at start-up) are left untagged, as the engine thread's
own capture is.
"""
from __future__ import annotations

import threading

from otel_gpu_census import injector

_pushed = threading.local()          # whether this thread pushed a step on entering its context


def enter(guard, engine):
    """UBatchContext.__enter__: after vLLM's, the engine thread's open step tagged on this thread."""
    def hook(wrapped, instance, args, kwargs):
        out = wrapped(*args, **kwargs)
        _pushed.sid = guard("micro-batch step", lambda: engine().micro_batch_begin(), default=0)
        return out
    return hook


def leave(guard, engine):
    """UBatchContext.__exit__: after vLLM's, the step popped again on this thread."""
    def hook(wrapped, instance, args, kwargs):
        try:
            return wrapped(*args, **kwargs)
        finally:
            if getattr(_pushed, "sid", 0):
                _pushed.sid = 0
                guard("micro-batch step end", injector.step_end, closing=True)
    return hook
