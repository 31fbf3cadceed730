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

import cffi
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


# ---- segments recorded in earlier layouts ------------------------------------------------------------------------
# Recorded archives (bench/results) and the examples were written in layouts 3 and 4. Each step below moves the bytes
# to the next layout; every field the later layout added reads 0, as a census of that time wrote none (it counted no
# managed memory, no eager launches). Offsets come from the current header, and layout 4's header is spelled out below.
_F = _native.ffi
_NDIR4, _NMEM = 6, 4                                   # layout 4: six copy directions (layout 5 added managed_*)
_CELL = _F.sizeof("gc_stat")
_DEV4_COPY = _NDIR4 * _NMEM * _CELL                   # gc_device.copy in layout 4
_DEV_MORE = (_F.sizeof("gc_stat") * (_native.consts.GC_NDIR - _NDIR4) * _NMEM)   # bytes layout 5 added to copy
_ROW_MORE = _CELL * (_native.consts.GC_NDIR - _NDIR4)                           # ... to a window's or step's
_HEAD5 = _F.offsetof("gc_segment", "devices")
_DEV4 = _F.sizeof("gc_device") - _DEV_MORE - _F.sizeof("gc_managed") + 8       # the managed block was reserved[1]
_WIN4, _STEP4 = _F.sizeof("gc_window") - _ROW_MORE, _F.sizeof("gc_step") - _ROW_MORE
SLOTS = ((_native.consts.GC_MAX_DEVICES, "gc_device"), (_native.consts.GC_WINDOW_SLOTS, "gc_window"),
         (_native.consts.GC_STEP_SLOTS, "gc_step"))

# Layout 4's header, the part before the devices (layout 3's is the same size: launches_lost was reserved). Its way of
# counting was kernel_mode (0 every kernel traced, 1 sampled, 2 off, 3 counted) with flags 0x20 (counted at the calls),
# 0x40 (preloaded), 0x80 (timed) and 0x100 (by event pairs); layout 5 names the collector instead.
_HEAD4_CDEF = """typedef struct {
    uint64_t magic; uint32_t layout_version, segment_size, pid, ppid;
    uint64_t proc_start_ticks, wall_start_ns, clock_ref_gpu_ns, clock_ref_wall_ns;
    uint32_t cupti_version, window_ns_div; char comm[64];
    uint64_t seq, wall_update_ns; uint32_t state, flags;
    uint64_t records, records_unknown, dropped, buffers, buffers_refused, step_unmatched, window_late, step_max,
             last_gpu_ns, complete_wall_ns, timing_windows, timing_failed, timing_attach_ns, timing_detach_ns;
    uint32_t events_every_eager, events_every_graph;
    uint64_t events_timed, events_missed, events_failed, events_idle, events_idle_ns, events_gated, events_forced;
    uint32_t events_gate, events_pad; uint64_t events_lead, events_lead_ns, unsized_calls, unwrapped;
    char unsized_name[48]; char reserved_text[8];
    uint32_t kernel_mode, kernel_on_ms, kernel_period_ms, kernel_tracing;
    uint64_t kernel_origin_gpu_ns, kernel_traced_ns, kernel_outside;
    uint32_t graph_mode, paused; uint64_t graph_unknown, graph_inexact, paused_ns, attach_wall_ns, attach_after_ns;
    uint32_t attach_mode, contexts_late; uint64_t launches_lost, calls_lost, graph_untimed;
} head4;"""
_F4 = cffi.FFI()
_F4.cdef(_HEAD4_CDEF)
_HEAD4 = _F4.sizeof("head4")
_RETIRED = 0x20 | 0x40 | 0x80 | 0x100
_SAME = ("magic", "pid", "ppid", "proc_start_ticks", "wall_start_ns", "clock_ref_gpu_ns", "clock_ref_wall_ns",
         "cupti_version", "window_ns_div", "seq", "wall_update_ns", "state", "records", "records_unknown", "dropped",
         "buffers", "buffers_refused", "step_unmatched", "window_late", "step_max", "last_gpu_ns", "complete_wall_ns",
         "unsized_calls", "unwrapped", "graph_mode", "paused", "graph_unknown", "graph_inexact", "paused_ns",
         "contexts_late", "launches_lost", "calls_lost", "graph_untimed")
_TIMING = ("every_eager", "every_graph", "timed", "missed", "failed", "idle", "idle_ns", "gated", "forced", "gate",
           "lead", "lead_ns")


class RetiredMode(ValueError):
    """A segment of an earlier layout counted in a way no layout-5 segment can say (sampled, off, CUPTI's windows,
    counted through CUPTI's callbacks)."""


def _head4_to_5(old: bytes) -> bytes:
    """Layout 4's header in layout 5's: the collector named, the event-pair figures in gc_timing, the retired fields
    (schedule, windows, attach mode) gone."""
    h = _F4.from_buffer("head4 *", bytearray(old))
    calls, timed, events = h.flags & 0x20, h.flags & 0x80, h.flags & 0x100
    if h.kernel_mode == 0 and not h.flags & _RETIRED:
        collector = _native.consts.GC_COLLECTOR_PRECISE
    elif h.kernel_mode == 3 and calls and (events or not timed):
        collector = _native.consts.GC_COLLECTOR_DEFAULT
    else:
        raise RetiredMode(f"kernel_mode {h.kernel_mode}, flags 0x{h.flags:x}: a way of counting layout 5 has no "
                          "collector for")
    seg = _F.new("gc_segment *")
    for name in _SAME:
        setattr(seg, name, getattr(h, name))
    _F.memmove(seg.comm, h.comm, len(h.comm))
    _F.memmove(seg.unsized_name, h.unsized_name, len(h.unsized_name))
    seg.flags = h.flags & ~_RETIRED
    seg.collector = collector
    if events:
        seg.timing.on = 1
        for name in _TIMING:
            setattr(seg.timing, name, getattr(h, "events_" + name))
    return bytes(_F.buffer(seg)[:_HEAD5])


def _v3_to_v4(data: bytes) -> bytes:
    """Layout 3 to 4: gc_device's eager_* fields took its two reserved words and one more, gc_window and gc_step got
    them before device_mask (their last field), and the header's launches_lost took a reserved word."""
    head = _HEAD4
    out, at = bytearray(data[:head]), head
    # (slots, size in layout 4, its size in layout 3, where eager_launches sits in layout 4, bytes kept at its end)
    for n, new, old, keep, tail in (
            (16, _DEV4, _DEV4 - 16, _F.offsetof("gc_device", "eager_launches") - _DEV_MORE, 0),
            (2048, _WIN4, _WIN4 - 24, _F.offsetof("gc_window", "eager_launches") - _ROW_MORE, 8),
            (1024, _STEP4, _STEP4 - 24, _F.offsetof("gc_step", "eager_launches") - _ROW_MORE, 8)):
        for _ in range(n):
            row = data[at:at + old]
            out += row[:keep] + bytes(new - keep - tail) + row[old - tail:]
            at += old
    assert at == len(data), (at, len(data))
    out[8:12] = (4).to_bytes(4, "little")
    return bytes(out)


def _v4_to_v5(data: bytes) -> bytes:
    """Layout 4 to 5: the header names its collector (_head4_to_5), two copy directions (managed_htod, managed_dtoh)
    in every copy table, and gc_device's reserved word became its gc_managed block."""
    head = _HEAD4
    out, at = bytearray(_head4_to_5(data[:head])), head
    dev_copy = _F.offsetof("gc_device", "copy")
    mid = _F.offsetof("gc_device", "managed") - _F.offsetof("gc_device", "memset")
    for _ in range(_native.consts.GC_MAX_DEVICES):
        row = data[at:at + _DEV4]
        out += (row[:dev_copy + _DEV4_COPY] + bytes(_DEV_MORE) + row[dev_copy + _DEV4_COPY:dev_copy + _DEV4_COPY + mid]
                + bytes(_F.sizeof("gc_managed")))
        at += _DEV4
    for ctype, n, old in (("gc_window", _native.consts.GC_WINDOW_SLOTS, _WIN4),
                          ("gc_step", _native.consts.GC_STEP_SLOTS, _STEP4)):
        cut = _F.offsetof(ctype, "copy") + _NDIR4 * _CELL
        for _ in range(n):
            row = data[at:at + old]
            out += row[:cut] + bytes(_ROW_MORE) + row[cut:]
            at += old
    assert at == len(data) and len(out) == _native.SEGMENT_SIZE, (at, len(data), len(out))
    out[8:16] = _native.LAYOUT_VERSION.to_bytes(4, "little") + _native.SEGMENT_SIZE.to_bytes(4, "little")
    return bytes(out)


def upgrade(data: bytes) -> bytes:
    """A segment of layout 3 or 4 in today's layout (one of today's is returned as it is); RetiredMode when it counted
    in a way today's layout cannot say."""
    version = int.from_bytes(data[8:12], "little")
    if version == 3:
        data, version = _v3_to_v4(data), 4
    if version == 4:
        data = _v4_to_v5(data)
    return data
