"""The census as the proxy needs it, read fast: a segment's header and the windows of one time range.

``reader.read_segment`` builds every window and step of a segment as Python objects (2048 + 1024 of
them, ~15 ms of CPU per segment, holding the GIL the proxy's event loop needs). Attributing
requests needs only the buckets of the last few seconds. This takes the same consistent copy
(reader's seqlock snapshot), lets reader parse the header and device totals, and picks the window
slots in range straight out of the bytes: well under a millisecond for a full ring.
"""
from __future__ import annotations

import dataclasses
from typing import List

from .. import reader
from .._native import SEGMENT_SIZE, consts, ffi
from ..census import DIRECTIONS, ProcessCensus, Stat, Window

_U64 = 8
_WIN_OFF = ffi.offsetof("gc_segment", "windows")
_WIN_SIZE = ffi.sizeof("gc_window")
_WIN_END = _WIN_OFF + _WIN_SIZE * consts.GC_WINDOW_SLOTS
_WINDOW_NS_DIV = ffi.offsetof("gc_segment", "window_ns_div")


def _field(name: str) -> int:
    return ffi.offsetof("gc_window", name) // _U64


# gc_window is made of uint64 fields only (gpu_census.h); read it as a row of them.
_STRIDE = _WIN_SIZE // _U64
_INDEX, _KCOUNT, _KNS, _COPY, _MEMSET, _MASK = (_field(n) for n in ("index", "kernel_count", "kernel_ns", "copy",
                                                                     "memset", "device_mask"))
_STAT = [ffi.offsetof("gc_stat", n) // _U64 for n in ("count", "bytes", "ns")]
_STAT_WIDTH = ffi.sizeof("gc_stat") // _U64
LAYOUT_OK = (_WIN_SIZE % _U64 == 0 and _WIN_OFF % _U64 == 0 and _STAT == [0, 1, 2] and _STAT_WIDTH == 3
             and ffi.sizeof("gc_window") == _U64 * (_MASK + 1) and len(DIRECTIONS) == consts.GC_NDIR
             and hasattr(reader, "_snapshot") and hasattr(reader, "_parse"))


def _window(row: List[int], window_ns: int) -> Window:
    copies = {}
    for i, d in enumerate(DIRECTIONS):
        c, b, n = row[_COPY + 3 * i: _COPY + 3 * i + 3]
        if c or n:                      # as reader does: absent means zero
            copies[d] = Stat(c, b, n)
    idx = row[_INDEX]
    return Window(start_ns=idx * window_ns, end_ns=(idx + 1) * window_ns, kernel_count=row[_KCOUNT],
                  kernel_ns=row[_KNS], copies=copies, memset=Stat(*row[_MEMSET:_MEMSET + 3]),
                  device_mask=row[_MASK])


def read_range(path, wall_lo_ns: int, wall_hi_ns: int) -> ProcessCensus:
    """The segment at `path` with only the windows that overlap wall time [lo, hi) (no steps).
    Raises reader.SegmentError like reader.read_segment."""
    if not LAYOUT_OK:       # a layout this fast path was not written for: take the slow, sure one
        c = reader.read_segment(path)
        return dataclasses.replace(c, windows=c.windows_between(c.wall_to_gpu_ns(wall_lo_ns),
                                                                c.wall_to_gpu_ns(wall_hi_ns)), steps={})
    data, torn = reader._snapshot(path, SEGMENT_SIZE)
    head = reader._parse(path, bytes(data[:reader.TOTALS_SIZE]), torn)
    window_ns = int.from_bytes(data[_WINDOW_NS_DIV:_WINDOW_NS_DIV + 4], "little") * 1000 or consts.GC_WINDOW_NS
    lo = head.wall_to_gpu_ns(wall_lo_ns) // window_ns
    hi = (head.wall_to_gpu_ns(wall_hi_ns) - 1) // window_ns
    ring = memoryview(data)[_WIN_OFF:_WIN_END].cast("Q")
    try:
        windows = [_window(ring[s * _STRIDE:(s + 1) * _STRIDE].tolist(), window_ns)
                   for s, idx in enumerate(ring[_INDEX::_STRIDE].tolist()) if idx and lo <= idx <= hi]
    finally:
        ring.release()
    windows.sort(key=lambda w: w.start_ns)
    return dataclasses.replace(head, windows=windows)
