"""KV offloading: the transfers vLLM's OffloadingConnector launches belong to the requests whose blocks
they move, not to the step's batch.

vLLM 0.25's ``OffloadingConnector`` (``--kv-offloading-size``) runs one *transfer job* per request
and direction: the scheduler puts a request's new prompt blocks in ``store_jobs`` and the blocks it
finds offloaded in ``load_jobs`` of the step's ``OffloadingConnectorMetadata`` (``{job id:
TransferJob(req_id, src_spec, dst_spec)}``). On the worker (``OffloadingConnectorWorker``), inside
``execute_model`` and on its thread:

- ``prepare_store_kv(metadata)`` (from ``get_finished``, after the forward pass) defers the step's
  store jobs to the next step, keeping only their job ids;
- ``handle_preemptions(metadata)`` (first thing in the next ``execute_model``) and
  ``start_kv_transfers(metadata)`` (before the forward pass) submit them, and the step's load jobs,
  each through ``OffloadingWorker.submit_store(job_id, gpu_spec, dst)`` /
  ``submit_load(job_id, src, gpu_spec)``, which launch the copies on a CUDA stream of their own,
  asynchronously, from this thread.

So the job id -> request map comes from the metadata (stores: when they are deferred; loads: in
the call that submits them), and the launches happen on the engine thread: a sub-step id pushed
there (``injector.step_begin``, nested inside the step's own) tags them, however late the copies run.
Each connector call gets at most one sub-step per direction (consecutive submits of one direction
share it: ring slots stay few), and the :class:`~otel_gpu_census.attribution.steps.StepLedger`
splits it among the jobs' requests by the GPU blocks each moves (``len(gpu_spec.block_ids)``; equal
bytes per block within one KV layout, so the bytes' split is exact up to largest remainder).

A request whose last blocks are stored after it ended (the store is deferred to the next step) is
told to wait for that transfer: :meth:`KvTransfers.awaits`.

Only where the requests live in this process (tensor and pipeline parallel 1): elsewhere the
transfers stay in the step that launched them.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Dict, Optional, Tuple

import wrapt

from otel_gpu_census import injector

log = logging.getLogger("otel_gpu_census.vllm")

STORE, LOAD = "kv_store", "kv_load"          # the sub-steps' kinds (StepLedger weights by kind)
MAX_JOBS = 1 << 16                            # job ids remembered (stores never submitted: shutdown)
UNKNOWN_JOB = ("otel-gpu-census", "unknown transfer job")   # a job the metadata did not name: unclaimed
UNSIZED = "a transfer job's block count could not be read and was weighed as 1 block"


class KvTransfers:
    """The job -> request map and the open transfer sub-step of one engine (its engine thread)."""

    def __init__(self, eng):
        self.eng = eng                        # EngineTelemetry: step ids, ledger, clock
        self._jobs: Dict[int, str] = {}       # job id -> request id, until submitted
        self._thread: Optional[int] = None    # the thread inside a connector call
        self._open: Optional[Tuple[str, int]] = None    # (kind, sub-step id) open on it
        self.sub_steps = 0

    @property
    def on(self) -> bool:
        return self.eng.has_scheduler and self.eng.tagging

    def _remember(self, jobs) -> None:
        if len(self._jobs) > MAX_JOBS:
            self._jobs.clear()
        for job_id, job in (jobs or {}).items():
            rid = getattr(job, "req_id", None)
            if rid is not None:
                self._jobs[job_id] = rid

    def stores_deferred(self, metadata) -> None:
        """After OffloadingConnectorWorker.prepare_store_kv: these store jobs go out next step."""
        if self.on:
            self._remember(getattr(metadata, "store_jobs", None))

    def call_begin(self, metadata, loads: bool) -> bool:
        """Before start_kv_transfers (loads=True) or handle_preemptions: submits may follow."""
        if not self.on:
            return False
        if loads:
            self._remember(getattr(metadata, "load_jobs", None))
        else:
            # vLLM 0.27 on: handle_preemptions itself submits the store jobs in jobs_to_flush (taken out of
            # store_jobs before prepare_store_kv sees them)
            flush = getattr(metadata, "jobs_to_flush", None)
            if flush:
                stores = getattr(metadata, "store_jobs", None) or {}
                self._remember({j: stores[j] for j in flush if j in stores})
        self._thread = threading.get_ident()
        return True

    def submit(self, kind: str, job_id: int, gpu_spec) -> None:
        """Before OffloadingWorker.submit_store / submit_load of one job, inside a connector call."""
        if self._thread != threading.get_ident():
            return
        sid = self._sub_step(kind)
        if not sid:
            return
        blocks = _blocks(gpu_spec)
        rid = self._jobs.pop(job_id, None)
        self.eng.ledger.step_claimed(sid, rid if rid is not None else UNKNOWN_JOB, blocks or 1,
                                     "" if blocks else UNSIZED)

    def _sub_step(self, kind: str) -> int:
        if self._open is not None:
            if self._open[0] == kind:
                return self._open[1]
            self._close()
        sid = self.eng.next_sid()
        if not injector.step_begin(sid):
            return 0
        self.eng.ledger.step_opened(sid, {}, self.eng.clock(), kind=kind)
        self._open = (kind, sid)
        self.sub_steps += 1
        return sid

    def _close(self) -> None:
        kind, sid = self._open
        self._open = None
        injector.step_end()
        self.eng.ledger.step_touched(sid, self.eng.clock())

    def call_end(self) -> None:
        """After the connector call, whatever it raised."""
        self._thread = None
        if self._open is not None:
            self._close()

    def awaits(self, rid: str) -> bool:
        """Whether a store job of `rid` is deferred and not yet submitted."""
        return bool(self._jobs) and rid in self._jobs.values()


def _blocks(gpu_spec) -> int:
    """The GPU blocks a job moves; 0 when they cannot be read."""
    try:
        ids = getattr(gpu_spec, "block_ids", None)        # a GPULoadStoreSpec: a numpy array
        # else DevicePointers (vLLM 0.34, not 0.30): blocks per group
        n = len(ids) if ids is not None else int(sum(getattr(gpu_spec, "group_block_counts", None) or ()))
    except (TypeError, ValueError):
        return 0
    return max(n, 0)


# -- the hooks (instrumentor.HOOKS) ---------------------------------------------------------------------

def _metadata(args, kwargs):
    return args[0] if args else next(iter(kwargs.values()), None)


def prepare_store_kv(guard, engine):
    def hook(wrapped, instance, args, kwargs):
        out = wrapped(*args, **kwargs)
        guard("kv stores", lambda: engine().kv.stores_deferred(_metadata(args, kwargs)))
        return out
    return hook


def transfers(guard, engine, loads: bool):
    """start_kv_transfers (loads) / handle_preemptions: the calls that submit the jobs."""
    def hook(wrapped, instance, args, kwargs):
        on = guard("kv transfers", lambda: _begin(guard, engine(), instance, _metadata(args, kwargs), loads), default=False)
        try:
            return wrapped(*args, **kwargs)
        finally:
            if on:
                guard("kv transfers end", lambda: engine().kv.call_end(), closing=True)
    return hook


def _begin(guard, eng, connector_worker, metadata, loads: bool) -> bool:
    if not eng.kv.call_begin(metadata, loads):
        return False
    wrap_submits(type(getattr(connector_worker, "worker", None)), guard)
    return True


WRAPPED: Dict[type, bool] = {}      # OffloadingWorker classes whose submit_* we wrapped (uninstrument)


def wrap_submits(cls, guard) -> None:
    """Wrap cls.submit_store / submit_load (the OffloadingWorker the connector made: CPU, tiering ...)
    once; outside a connector call the wrappers only pass through."""
    if cls is None or cls is type(None) or cls in WRAPPED:
        return
    WRAPPED[cls] = True
    for name, kind, gpu_arg in (("submit_store", STORE, 1), ("submit_load", LOAD, 2)):
        if isinstance(vars(cls).get(name), wrapt.FunctionWrapper) or not callable(getattr(cls, name, None)):
            continue
        wrapt.wrap_function_wrapper(cls, name, _submit(kind, gpu_arg, guard))


def _submit(kind: str, gpu_arg: int, guard):
    def hook(wrapped, instance, args, kwargs):
        if guard.current is not None and not guard.off:
            guard("kv submit", _note_submit, guard.current, kind, gpu_arg, args, kwargs)
        return wrapped(*args, **kwargs)
    return hook


def _note_submit(eng, kind: str, gpu_arg: int, args, kwargs: Dict[str, Any]) -> None:
    """The job id and the GPU side of submit_store (argument 1) / submit_load (argument 2): vLLM 0.25's
    (job_id, src_spec, dst_spec), a GPULoadStoreSpec (0.27 and 0.30 too); submit_store(job_id, device_ptrs,
    dst_spec) and submit_load(job_id, src_spec, device_ptrs, expedited=False) in 0.34 (not yet in 0.30),
    a DevicePointers."""
    names = ("job_id", "src_spec", "dst_spec")
    job_id = args[0] if args else kwargs.get("job_id")
    if len(args) > gpu_arg:
        gpu = args[gpu_arg]
    else:
        gpu = kwargs.get("device_ptrs", kwargs.get(names[gpu_arg]))
    eng.kv.submit(kind, job_id, gpu)


def unwrap_submits() -> None:
    for cls in list(WRAPPED):
        for name in ("submit_store", "submit_load"):
            if isinstance(vars(cls).get(name), wrapt.FunctionWrapper):
                setattr(cls, name, vars(cls)[name].__wrapped__)
        del WRAPPED[cls]
