"""A process's 20 ms windows kept over several reads of its segment, reaching further back than its ring.

A segment's window ring holds the newest GC_WINDOW_SLOTS buckets (~41 s). A server's start-up is
older than that after its first minute, so a report made from one read at the end cannot tell it
apart from serving. `run` reads its command's segments every READ_EVERY_S (well inside the ring's
reach) and keeps every bucket it saw, at most MAX_KEPT_NS back, so the report at the end sees the
whole run. A bucket read twice keeps its later copy (records still arriving add to it). Where two
reads came too far apart for the ring to have kept everything between them, the windows kept start
again after the gap: nothing is ever stitched across time the ring may have lost.
"""
from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass, field
from typing import Dict, Tuple

from otel_gpu_census.census import DIRECTIONS, ProcessCensus, Stat, Window

READ_EVERY_S = 10.0
MAX_KEPT_NS = 30 * 60 * 1_000_000_000      # ~90,000 buckets, ~25 MB at most
RING_SLOTS = 2048                           # GC_WINDOW_SLOTS

_ROW = struct.Struct("<" + "Q" * (4 + 3 * len(DIRECTIONS) + 3 + 4))   # a Window, packed: 280 bytes


def _pack(w: Window) -> bytes:
    copies = []
    for d in DIRECTIONS:
        s = w.copies.get(d, Stat())
        copies += [s.count, s.bytes, s.ns]
    return _ROW.pack(w.start_ns, w.end_ns, w.kernel_count, w.kernel_ns, *copies, w.memset.count, w.memset.bytes,
                     w.memset.ns, w.device_mask, w.eager_launches, w.eager_traced, w.eager_traced_ns)


def _unpack(b: bytes) -> Window:
    v = _ROW.unpack(b)
    copies = {}
    for i, d in enumerate(DIRECTIONS):
        c, n, t = v[4 + 3 * i:7 + 3 * i]
        if c or n or t:
            copies[d] = Stat(c, n, t)
    m = 4 + 3 * len(DIRECTIONS)
    return Window(v[0], v[1], kernel_count=v[2], kernel_ns=v[3], copies=copies, memset=Stat(*v[m:m + 3]),
                  device_mask=v[m + 3], eager_launches=v[m + 4], eager_traced=v[m + 5], eager_traced_ns=v[m + 6])


@dataclass
class _Kept:
    width: int
    since: int                     # first bucket index from which every bucket with activity is kept
    seen_to: int                   # last bucket index the reads so far are known complete up to
    rows: Dict[int, bytes] = field(default_factory=dict)


def _reach(c: ProcessCensus, width: int) -> Tuple[int, int, int]:
    """(first bucket the read is complete from, newest bucket, bucket it is complete up to)."""
    hi = max(w.start_ns // width for w in c.windows)
    since = c.windows_since_ns // width if c.windows_since_ns else hi - RING_SLOTS + 1
    # complete_wall_ns: work that finished before it is in the segment, so the quiet buckets up to it were quiet
    done = c.wall_to_gpu_ns(c.complete_wall_ns) // width if c.complete_wall_ns else hi
    return since, hi, max(hi, done)


class WindowHistory:
    """Windows of processes, by (pid, start ticks), kept over reads (`add`), handed back on the last
    read (`extend`)."""

    def __init__(self, max_kept_ns: int = MAX_KEPT_NS):
        self.max_kept_ns = max_kept_ns
        self._kept: Dict[Tuple[int, int], _Kept] = {}

    def add(self, c: ProcessCensus) -> None:
        if not c.windows:
            return
        key = (c.pid, c.proc_start_ticks)
        width = c.windows[0].end_ns - c.windows[0].start_ns
        since, hi, seen_to = _reach(c, width)
        k = self._kept.get(key)
        if k is None or k.width != width or since > k.seen_to + 1:     # first read, or a gap the ring may have lost
            k = self._kept[key] = _Kept(width, since, seen_to)
        for w in c.windows:
            i = w.start_ns // width
            if i >= since:
                k.rows[i] = _pack(w)
        k.seen_to = max(k.seen_to, seen_to)
        oldest = hi - self.max_kept_ns // width + 1
        if k.since < oldest:
            k.since = oldest
            for i in [i for i in k.rows if i < oldest]:
                del k.rows[i]

    def extend(self, c: ProcessCensus) -> ProcessCensus:
        """`c` (the last read) with every window kept before it and how far back they reach."""
        self.add(c)
        k = self._kept.get((c.pid, c.proc_start_ticks))
        if k is None:
            return c
        windows = [_unpack(k.rows[i]) for i in sorted(k.rows)]
        return dataclasses.replace(c, windows=windows, windows_since_ns=k.since * k.width)
