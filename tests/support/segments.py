"""The one census-segment writer of the tests and tools: segments written by the C code itself.

A segment is made by ``gc_segment_init`` (the injector's identity and clocks), filled by
``gc_tally_record`` from real CUPTI activity records (``cupti_records``) and published with the
writer's seqlock helpers, so the bytes are what the injector would have mapped; readers under test
see only the file.

- :class:`SegmentWriter` — a finished segment in one call (``segment(dir, records, ...)``), or the
  steps (``new``, ``tally``, ``write``) for tests that change fields in between;
- :func:`map_segment` — a live segment, mapped shared and initialised, for writers that stand in for
  a censused process (keep the mmap alive while writing);
- :func:`open_segment` — an existing segment file mapped shared, for a second writer process.
"""
from __future__ import annotations

import mmap
import os
from pathlib import Path

import cupti_records
from otel_gpu_census import _native

GC_STATE_ACTIVE, GC_STATE_EXITED = 1, 2


class SegmentWriter:
    """Writes census segments through the native tally, as the injector would."""

    def __init__(self, native=None):
        self.ffi, self.lib, self.path = native or cupti_records.native()

    def new(self, comm="worker", gpu_ref_ns=0):
        seg = self.ffi.new("gc_segment *")
        self.lib.gc_segment_init(seg, comm.encode() if comm is not None else self.ffi.NULL, 0, gpu_ref_ns)
        return seg

    def tally(self, seg, recs, final=True, state=None):
        """Count `recs` into `seg` inside one seqlock update, as one buffer completion does."""
        t = self.lib.gc_tally_create(seg)
        try:
            self.lib.gc_segment_begin_update(seg)
            for r in recs:
                self.lib.gc_tally_record(t, r)
            self.lib.gc_tally_publish(t, 1 if final else 0)
            seg.state = state if state is not None else (GC_STATE_EXITED if final else GC_STATE_ACTIVE)
            self.lib.gc_segment_end_update(seg)
        finally:
            self.lib.gc_tally_destroy(t)
        return seg

    def write(self, directory, seg, name=None) -> Path:
        directory = Path(directory)
        name = name or f"gpu-census-{seg.pid}-{seg.proc_start_ticks}.seg"
        p = directory / name
        p.write_bytes(bytes(self.ffi.buffer(seg)))
        return p

    def segment(self, directory, recs=(), comm="worker", final=True, state=None, pid=None, ppid=None,
                start_ticks=None, gpu_ref_ns=0, edit=None) -> Path:
        """One segment file holding `recs`; pid/ppid/start_ticks override the identity (to stand for
        other processes); `edit(seg)` may change anything before it is written."""
        seg = self.new(comm, gpu_ref_ns)
        self.tally(seg, recs, final=final, state=state)
        if pid is not None:
            seg.pid = pid
        if ppid is not None:
            seg.ppid = ppid
        if start_ticks is not None:
            seg.proc_start_ticks = start_ticks
        if edit is not None:
            edit(seg)
        return self.write(directory, seg)


def open_segment(path):
    """An existing segment file mapped shared: (mmap, gc_segment *)."""
    ffi = _native.ffi
    fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, ffi.sizeof("gc_segment"))
    finally:
        os.close(fd)
    return mm, ffi.from_buffer("gc_segment *", mm)


def map_segment(path, comm: bytes, wall_start_ns: int = 0, gpu_ref_ns: int = 0, lib=None):
    """A segment file created, mapped shared and initialised as the injector does: (mmap, gc_segment *).

    For writers that stand in for a censused process; keep the mmap alive while writing. `lib`: a
    native library already loaded (default: the one the tests build)."""
    lib = lib if lib is not None else cupti_records.native()[1]
    with open(path, "wb") as f:
        f.truncate(_native.ffi.sizeof("gc_segment"))
    mm, seg = open_segment(path)
    lib.gc_segment_init(seg, comm, wall_start_ns, gpu_ref_ns)
    return mm, seg
