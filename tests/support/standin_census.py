"""A stand-in census segment for CPU tests of the kernel-phase bench: what the injector writes in
sampled mode (OTEL_GPU_CENSUS_KERNELS=ON_MS/PERIOD_MS), from a process that has no GPU.

The segment is mapped shared and initialised by the native library (segments.map_segment), so the
package's reader reads it as it reads the injector's. Its "CUPTI clock" is the monotonic clock
moved by GPU_OFFSET_NS (neither wall nor monotonic time, as on a GPU), and the kernel schedule starts
ORIGIN_DELAY_NS after the segment. The owner reports work with add(); like CUPTI's buffers, it
reaches the segment at the next flush (every flush_s), which also publishes complete_wall_ns, the
tracing flag and the traced time, as the injector's flusher does.
"""
from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

from otel_gpu_census import _native
from otel_gpu_census.census import DIRECTIONS, KERNELS_SAMPLED, MEMORY_KINDS, STATE_EXITED
from segments import map_segment

GPU_OFFSET_NS = 1_000_000_000_000
ORIGIN_DELAY_NS = 137_000_000
DTOH = DIRECTIONS.index("dtoh")
PINNED = MEMORY_KINDS.index("pinned")


class StandinCensus:
    def __init__(self, directory: str, lib_path: str, kernels: str, comm: bytes = b"llama-server",
                 flush_s: float = 0.1):
        m = re.fullmatch(r"(\d+)/(\d+)", kernels)
        if not m:
            raise ValueError(f"stand-in census: want OTEL_GPU_CENSUS_KERNELS=ON_MS/PERIOD_MS, got {kernels!r}")
        self.on_ns, self.period_ns = int(m.group(1)) * 1_000_000, int(m.group(2)) * 1_000_000
        self.lib = _native.ffi.dlopen(lib_path)
        tmp = Path(directory) / f".standin-{os.getpid()}"
        self.mm, self.seg = map_segment(tmp, comm, 0, self.gpu_ns(), lib=self.lib)
        seg = self.seg
        self.origin = seg.clock_ref_gpu_ns + ORIGIN_DELAY_NS
        self.lock = threading.Lock()
        self.kernels = self.dtoh_count = self.dtoh_bytes = 0
        self._publish()
        os.rename(tmp, Path(directory) / f"gpu-census-{seg.pid}-{seg.proc_start_ticks}.seg")   # published
        self.flush_s = flush_s
        self.closed = threading.Event()
        threading.Thread(target=self._flusher, daemon=True).start()

    def gpu_ns(self) -> int:
        return time.monotonic_ns() + GPU_OFFSET_NS

    def _on_before(self, t: int) -> int:
        if t <= self.origin:
            return 0
        k, r = divmod(t - self.origin, self.period_ns)
        return k * self.on_ns + min(r, self.on_ns)

    def traced(self) -> bool:
        t = self.gpu_ns()
        return t >= self.origin and (t - self.origin) % self.period_ns < self.on_ns

    def add(self, kernels: int = 0, dtoh_bytes: int = 0) -> None:
        """Work done now: kernels count only while the schedule traces them (as CUPTI records of
        kernels launched in a traced phase); copies always."""
        with self.lock:
            if kernels and self.traced():
                self.kernels += kernels
            if dtoh_bytes:
                self.dtoh_count += 1
                self.dtoh_bytes += dtoh_bytes

    def _publish(self, final: bool = False) -> None:
        wall, gpu = time.time_ns(), self.gpu_ns()
        with self.lock:
            k, n, b = self.kernels, self.dtoh_count, self.dtoh_bytes
            self.kernels = self.dtoh_count = self.dtoh_bytes = 0
        seg = self.seg
        self.lib.gc_segment_begin_update(seg)
        d = seg.devices[0]
        d.in_use = 1
        d.kernel_count += k
        d.copy[DTOH][PINNED].count += n
        d.copy[DTOH][PINNED].bytes += b
        seg.records += k + n
        seg.kernel_mode = KERNELS_SAMPLED
        seg.kernel_on_ms = self.on_ns // 1_000_000
        seg.kernel_period_ms = self.period_ns // 1_000_000
        seg.kernel_origin_gpu_ns = self.origin
        seg.kernel_tracing = int(self.traced())
        seg.kernel_traced_ns = self._on_before(gpu)
        seg.complete_wall_ns = wall
        if final:
            seg.state = STATE_EXITED
        self.lib.gc_segment_end_update(seg)

    def _flusher(self) -> None:
        while not self.closed.wait(self.flush_s):
            self._publish()

    def close(self) -> None:
        """The final flush at exit: totals complete, state exited."""
        if not self.closed.is_set():
            self.closed.set()
            self._publish(final=True)
