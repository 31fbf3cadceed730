"""Tensor and pipeline parallel: EngineCore settles its requests from the census of its worker processes.

With TP x PP > 1 vLLM's ``MultiprocExecutor`` runs one worker process per rank, started by EngineCore
(their parent), each under the census with a segment of its own in the same folder. Every rank gets
every step (``collective_rpc("execute_model")``) and its hook numbers its steps by counting them, so
step n has id n on every rank; EngineCore counts the same calls (the hook on
``MultiprocExecutor.execute_model``) and opens step n in its ledger with the step's scheduled tokens.
:class:`RankCensus` is the ledger's ``read``: one ``(header, steps)`` pair per worker segment, found
by the workers' parent pid; the ledger splits each rank's step by the same tokens (a request's share
is the sum over ranks; conservation holds per rank, ``StepLedger.per_process``) once every rank's
census is complete past the step.

Only the workers on this node (``local_world_size``) are EngineCore's children; ranks on other nodes
are not read. KV-offload transfers stay in the steps that launched them here (the workers do not
know the requests).
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from otel_gpu_census.census import folder, proctree, reader

log = logging.getLogger("otel_gpu_census.vllm")

RESCAN_S = 1.0          # look for missing ranks' segments at most this often


class RankCensus:
    """The segments of EngineCore's worker processes (its children) in the census folder."""

    def __init__(self, parent_pid: int, expected: int, directory: Optional[Path] = None,
                 clock=time.monotonic):
        self.parent = parent_pid
        self.expected = max(1, int(expected))
        self._dir = directory
        self.clock = clock
        self.paths: Dict[int, str] = {}        # pid -> segment path
        self._scanned = float("-inf")
        self._warned = False

    @property
    def pids(self) -> List[int]:
        return sorted(self.paths)

    def _directory(self) -> Path:
        if self._dir is None:
            self._dir = folder.readable_dir()
        return self._dir

    def _discover(self) -> None:
        now = self.clock()
        if len(self.paths) >= self.expected or now - self._scanned < RESCAN_S:
            return
        self._scanned = now
        for p in reader.segment_paths(self._directory()):
            ident = reader.segment_file_pid(p)
            if ident is None or ident[0] in self.paths:
                continue
            pid, ticks = ident
            if proctree.proc_ppid(pid) == self.parent and proctree.is_alive(pid, ticks):
                self.paths[pid] = str(p)

    def read(self, lo: int, hi: int) -> List[Tuple[Optional[object], Dict[int, object]]]:
        """StepLedger's read: (header, {step id: Step}) per rank; a (None, {}) stands for ranks not
        found yet (the ledger waits for them, then settles stale)."""
        self._discover()
        out = []
        for pid, path in list(self.paths.items()):
            try:
                head = reader.read_segment(path, detail=False)
                out.append((head, {s.id: s for s in reader.read_steps(path, lo, hi + 1)}))
            except reader.SegmentError as e:
                if not self._warned:
                    self._warned = True
                    log.warning("otel-gpu-census: cannot read worker pid %d's census (%s)", pid, e.reason)
                out.append((None, {}))
        if len(self.paths) < self.expected:
            out.append((None, {}))
        return out
