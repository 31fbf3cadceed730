"""Spinning processes that keep the host's other cores busy while a benchmark measures.

On the H200 host (KVM, 16 vCPUs) a fixed single-threaded loop ran at rates that spread 1.83x from one
3 s bin to the next (CV 20 %) with the other cores idle, and 1.14x (CV 4.5 %) with six spinning
processes beside it (bench/perf/host_noise.py, 2026-12-02): the CPU's speed follows how busy the
host is. A launch-bound server is a single-threaded loop of that kind, so its loads are measured
with the ballast on.

    with Ballast(6):
        ...loads...
"""
from __future__ import annotations

import multiprocessing as mp
from typing import List


def _spin(stop) -> None:
    x = 0
    while not stop.is_set():
        for i in range(20_000):
            x = (x + i * i) % 1_000_003


class Ballast:
    def __init__(self, n: int):
        self.n = max(0, int(n))
        self._ctx = mp.get_context("spawn")     # no copy of the caller's threads or sockets
        self._stop = self._ctx.Event()
        self.procs: List = []

    def __enter__(self) -> "Ballast":
        for _ in range(self.n):
            p = self._ctx.Process(target=_spin, args=(self._stop,), daemon=True)
            p.start()
            self.procs.append(p)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
        self.procs = []

    def alive(self) -> int:
        return sum(p.is_alive() for p in self.procs)
