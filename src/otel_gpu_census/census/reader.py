"""The one reader of census segments: files into :class:`census.ProcessCensus` values.

A segment is mapped shared by the process it describes; this side only ever copies it and checks
the writer's sequence counter (odd while an update is in progress), like a perf_event page reader.
Nothing here can block or change a writer.

Public reads (every other module uses these, never the private helpers):

- :func:`read_segment` — everything (``detail=False``: header and device totals only, ~12 KiB);
- :func:`read_windows` — header, totals and only the time buckets of one wall-clock range (what a
  request's attribution needs: well under a millisecond for a full ring);
- :func:`read_steps` — the steps whose correlation ids fall in one range;
- :func:`scan` — every segment of a folder, unreadable ones returned as errors.
"""
from __future__ import annotations

import dataclasses
import os
import stat
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from otel_gpu_census._native import LAYOUT_VERSION, MAGIC, SEGMENT_SIZE, SEQ_OFFSET, consts, ffi
from otel_gpu_census.census import (ATTACH_CUINIT, COLLECTOR_DEFAULT, DIRECTIONS, KERNELS_ALL, KERNELS_COUNTED,
                                    MEMORY_KINDS, NO_MANAGED, ZERO, Attach, CopyTable, DeviceTotals, GraphTracing,
                                    KernelTracing, Managed, ProcessCensus, Stat, Step, Window)
from otel_gpu_census.census.proctree import is_alive

SEGMENT_GLOB = "gpu-census-*.seg"
READ_TRIES = 500          # seqlock attempts (~0.5 s) before settling for a possibly torn copy: a live
READ_RETRY_SLEEP_S = 0.001  # writer preempted mid-update on a loaded machine can take tens of ms
ALIVE_CHECK_EVERY = 20    # ... but a writer that died inside an update is given up on at once

assert (len(DIRECTIONS), len(MEMORY_KINDS)) == (consts.GC_NDIR, consts.GC_NMEM), "census/__init__.py and gpu_census.h disagree"


class SegmentError(Exception):
    """A file that is not a readable census segment; ``reason`` says why in plain words."""

    def __init__(self, path, reason: str, unpublished: bool = False):
        super().__init__(f"{path}: {reason}")
        self.path = str(path)
        self.reason = reason
        self.unpublished = unpublished    # zero magic: possibly a writer still setting it up


# ---------------------------------------------------------------------------------------------
# one segment

def _check_identity(path, head: bytes, length: int) -> None:
    """Refuse anything that is not a complete segment of this layout, saying which.
    `head` holds at least the first 16 bytes (magic, version, size) when the file has them."""
    if length < 16:
        raise SegmentError(path, f"truncated: {length} bytes, too short for a census segment header")
    magic = int.from_bytes(head[0:8], "little")
    version = int.from_bytes(head[8:12], "little")
    size = int.from_bytes(head[12:16], "little")
    if magic == 0 and length >= SEGMENT_SIZE:     # the writer reserves the whole file before it fills it
        raise SegmentError(path, "not initialised (magic is zero): its writer had not published it yet, "
                                 "or died while creating it", unpublished=True)
    if magic == 0:
        raise SegmentError(path, f"truncated: {length} of {SEGMENT_SIZE} bytes, and no identity written")
    if magic != MAGIC:
        raise SegmentError(path, f"not a census segment (wrong magic 0x{magic:016x})")
    if version != LAYOUT_VERSION:
        raise SegmentError(path, f"layout version {version}; this reader reads version {LAYOUT_VERSION} (read it "
                                 f"with the otel-gpu-census that wrote it, {'an older' if version < LAYOUT_VERSION else 'a newer'} one)")
    if size != SEGMENT_SIZE:
        raise SegmentError(path, f"segment_size says {size} bytes but a version-{LAYOUT_VERSION} segment is "
                                 f"{SEGMENT_SIZE} bytes (corrupt)")
    if length < SEGMENT_SIZE:
        raise SegmentError(path, f"truncated: {length} of {SEGMENT_SIZE} bytes")


def _open_segment(path) -> int:
    """A read-only descriptor of the regular file at `path`, never blocking: anyone who can write
    the folder can name a FIFO or a device like a segment, and a plain open() of a FIFO waits for a
    writer forever. O_NONBLOCK makes that open return at once; fstat then refuses it. A symlink is
    refused too (O_NOFOLLOW): a segment is a file its writer created in this folder."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as e:
        try:                     # a symlink (ELOOP) or a socket (ENXIO): say what it is
            mode = os.lstat(path).st_mode
        except OSError:
            mode = None
        if mode is not None and not stat.S_ISREG(mode):
            raise SegmentError(path, f"not a regular file ({_file_kind(mode)}): refused, not read") from None
        raise SegmentError(path, f"cannot open: {e.strerror}") from None
    try:
        st = os.fstat(fd)
    except OSError as e:
        os.close(fd)
        raise SegmentError(path, f"cannot read: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise SegmentError(path, f"not a regular file ({_file_kind(st.st_mode)}): refused, not read")
    return fd


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a folder"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a plain file"


# Header and per-device totals come first; the window and step rings make up the rest (~630 KiB).
TOTALS_SIZE = ffi.offsetof("gc_segment", "windows")


def _snapshot(path, size: int = SEGMENT_SIZE) -> Tuple[bytearray, bool]:
    """A copy of the first `size` bytes of the segment, taken between two equal, even reads of
    `seq`; (copy, torn).

    The copy is read with pread() rather than through a mapping: pread sees the same page-cache
    pages the writer's mapping changes, and a file truncated under it gives a short read (refused
    here) where a mapping would kill the reader with SIGBUS."""
    fd = _open_segment(path)
    try:
        st = os.fstat(fd)
        _check_identity(path, os.pread(fd, 16, 0), st.st_size)
        data = bytearray(size)

        def copy() -> int:
            n = os.preadv(fd, [data], 0)
            if n != size:
                raise SegmentError(path, f"truncated while being read: {n} of {size} bytes")
            return int.from_bytes(data[SEQ_OFFSET:SEQ_OFFSET + 8], "little")

        def seq() -> int:
            raw = os.pread(fd, 8, SEQ_OFFSET)
            if len(raw) != 8:
                raise SegmentError(path, "truncated while being read")
            return int.from_bytes(raw, "little")

        for attempt in range(1, READ_TRIES + 1):
            before = seq()
            if before % 2 == 0 and copy() == before and seq() == before:
                return data, False
            if attempt % ALIVE_CHECK_EVERY == 0 and not _writer_alive(fd):
                break
            time.sleep(READ_RETRY_SLEEP_S)
        # Still mid-update: the writer died inside an update (or is stopped there). Its last
        # values are still the best there is; hand them over marked torn.
        copy()
        return data, True
    except OSError as e:
        raise SegmentError(path, f"cannot read: {e.strerror}") from None
    finally:
        os.close(fd)


_PID_OFF = ffi.offsetof("gc_segment", "pid")
_TICKS_OFF = ffi.offsetof("gc_segment", "proc_start_ticks")


def _writer_alive(fd: int) -> bool:
    """Whether the process that owns the segment (identity fields, written once) still runs."""
    pid = int.from_bytes(os.pread(fd, 4, _PID_OFF), "little")
    ticks = int.from_bytes(os.pread(fd, 8, _TICKS_OFF), "little")
    return is_alive(pid, ticks)


def _cstr(arr) -> str:
    return ffi.string(arr).decode("utf-8", "replace")


def format_uuid(raw: bytes) -> str:
    """'GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx' as nvidia-smi prints it; '' when all zero."""
    if not any(raw):
        return ""
    h = raw.hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


_U64 = 8

# A device's totals are read straight out of the copied bytes too: through cffi its 26 gc_stat cells
# cost most of a totals-only read (what the metrics sidecar does once a collection). From
# kernel_count on, gc_device is uint64 fields only (gpu_census.h); the copy cells follow in
# [direction][memory kind] order, each (count, bytes, ns).
_DEV_OFF = ffi.offsetof("gc_segment", "devices")
_DEV_SIZE = ffi.sizeof("gc_device")
_DEV_U64 = ffi.offsetof("gc_device", "kernel_count")
_DEV_IN_USE = ffi.offsetof("gc_device", "in_use")
_DEV_ID = ffi.offsetof("gc_device", "device_id")
_DEV_UUID = ffi.offsetof("gc_device", "uuid")
_DEV_COL = {name: (ffi.offsetof("gc_device", name) - _DEV_U64) // _U64
            for name in ("kernel_count", "kernel_ns", "busy_ns", "first_ns", "last_ns", "graph_launches",
                         "graph_ns", "copy", "memset", "peer_recv", "graph_kernel_count", "eager_launches",
                         "eager_traced", "eager_traced_ns")}
_DEV_CELLS = [(3 * (i * len(MEMORY_KINDS) + j), (direction, mem))
              for i, direction in enumerate(DIRECTIONS) for j, mem in enumerate(MEMORY_KINDS)]
assert (_DEV_U64 % _U64 == 0 and _DEV_OFF % _U64 == 0 and _DEV_SIZE % _U64 == 0
        and [_DEV_COL[n] for n in list(_DEV_COL)[:8]] == list(range(8)) and _DEV_COL["memset"] == 7 + 3 * len(_DEV_CELLS)
        and _DEV_COL["peer_recv"] == _DEV_COL["memset"] + 3
        and _DEV_COL["graph_kernel_count"] == _DEV_COL["peer_recv"] + 3
        and [_DEV_COL[n] for n in ("eager_launches", "eager_traced", "eager_traced_ns")]
        == [_DEV_COL["graph_kernel_count"] + i for i in (1, 2, 3)]
        and ffi.sizeof(dict(ffi.typeof("gc_device").fields)["copy"].type) == 3 * _U64 * len(_DEV_CELLS)), \
    "gc_device is not what the reader expects: the reader needs changing with gpu_census.h"


# gc_managed: uint64 fields and gc_stat cells, read by name from the device's row
_MANAGED_AT = (ffi.offsetof("gc_device", "managed") - _DEV_U64) // _U64
_MANAGED_FIELDS = [(f, (ffi.offsetof("gc_managed", f) // _U64), ffi.typeof("gc_managed").fields[i][1].type.cname)
                   for i, f in enumerate(n for n, _ in ffi.typeof("gc_managed").fields)]
assert ffi.offsetof("gc_device", "managed") % _U64 == 0 and all(t in ("uint64_t", "gc_stat") for _, _, t in _MANAGED_FIELDS), \
    "gc_managed is not uint64 fields and gc_stat cells: the reader needs changing with gpu_census.h"


def _managed(row: Sequence[int]) -> Managed:
    if not any(row[_MANAGED_AT:]):
        return NO_MANAGED
    out = {}
    for name, at, ctype in _MANAGED_FIELDS:
        i = _MANAGED_AT + at
        out[name] = Stat(*row[i:i + 3]) if ctype == "gc_stat" else row[i]
    return Managed(**out)


def _devices(data) -> Dict[int, DeviceTotals]:
    """The devices in use, by CUDA ordinal, from a copy of the segment (at least TOTALS_SIZE)."""
    out = {}
    view = memoryview(data)
    try:
        for k in range(consts.GC_MAX_DEVICES):
            at = _DEV_OFF + k * _DEV_SIZE
            if not int.from_bytes(view[at + _DEV_IN_USE:at + _DEV_IN_USE + 4], "little"):
                continue
            row = view[at + _DEV_U64:at + _DEV_SIZE].cast("Q").tolist()
            c = _DEV_COL["copy"]
            cells = {}
            for off, key in _DEV_CELLS:
                n, b, t = row[c + off:c + off + 3]
                if n or b or t:
                    cells[key] = Stat(n, b, t)
            m, pr, e = _DEV_COL["memset"], _DEV_COL["peer_recv"], _DEV_COL["eager_launches"]
            device_id = int.from_bytes(view[at + _DEV_ID:at + _DEV_ID + 4], "little")
            out[device_id] = DeviceTotals(
                device_id=device_id,
                uuid=format_uuid(bytes(view[at + _DEV_UUID:at + _DEV_UUID + 16])),
                kernel_count=row[0], kernel_ns=row[1], busy_ns=row[2], first_ns=row[3], last_ns=row[4],
                graph_launches=row[5], graph_ns=row[6], graph_kernel_count=row[_DEV_COL["graph_kernel_count"]],
                copies=CopyTable(cells),
                memset=Stat(*row[m:m + 3]) if any(row[m:m + 3]) else ZERO,
                peer_recv=Stat(*row[pr:pr + 3]) if any(row[pr:pr + 3]) else ZERO,
                eager_launches=row[e], eager_traced=row[e + 1], eager_traced_ns=row[e + 2],
                managed=_managed(row),
            )
    finally:
        view.release()
    return out


# ---------------------------------------------------------------------------------------------
# the window and step rings, read straight out of the copied bytes
#
# Building 2048 + 1024 slots through cffi costs ~15 ms of CPU a segment; gc_window and gc_step are
# made of uint64 fields only (gpu_census.h), so a ring is read as rows of integers instead, and only
# the slots a caller asked for become Python objects.


class _Ring:
    """Where one ring lies in the segment and where each field lies in a slot, in uint64s."""

    def __init__(self, ctype: str, member: str, slots: int):
        self.offset = ffi.offsetof("gc_segment", member)
        self.stride = ffi.sizeof(ctype) // _U64
        self.end = self.offset + ffi.sizeof(ctype) * slots
        fields = [name for name, _ in ffi.typeof(ctype).fields]
        self.col = {name: ffi.offsetof(ctype, name) // _U64 for name in fields}
        # the last field is the uint64 device_mask: then every field before it is uint64s, unpadded
        assert (ffi.sizeof(ctype) % _U64 == 0 and self.offset % _U64 == 0 and fields[-1] == "device_mask"
                and ffi.sizeof(ctype) == _U64 * (self.col["device_mask"] + 1)), \
            f"{ctype} is not a row of uint64 fields: the reader needs changing with gpu_census.h"

    def rows(self, data, keep: Callable[[int], bool]) -> List[List[int]]:
        """The slots whose first field (index / id, 0 = empty) is non-zero and kept, as int lists."""
        ring = memoryview(data)[self.offset:self.end].cast("Q")
        try:
            return [ring[i * self.stride:(i + 1) * self.stride].tolist()
                    for i, key in enumerate(ring[0::self.stride].tolist()) if key and keep(key)]
        finally:
            ring.release()


assert [ffi.offsetof("gc_stat", n) // _U64 for n in ("count", "bytes", "ns")] == [0, 1, 2] \
    and ffi.sizeof("gc_stat") == 3 * _U64, "gc_stat is not (count, bytes, ns) of uint64"
_WINDOWS = _Ring("gc_window", "windows", consts.GC_WINDOW_SLOTS)
_STEPS = _Ring("gc_step", "steps", consts.GC_STEP_SLOTS)
_WINDOW_NS_DIV = ffi.offsetof("gc_segment", "window_ns_div")


def _row_copies(row: Sequence[int], at: int) -> Dict[str, Stat]:
    """Copies by direction from a row; as everywhere, absent means zero."""
    out = {}
    for i, d in enumerate(DIRECTIONS):
        c, b, n = row[at + 3 * i: at + 3 * i + 3]
        if c or n:
            out[d] = Stat(c, b, n)
    return out


def _window(row: Sequence[int], window_ns: int) -> Window:
    col = _WINDOWS.col
    idx, m = row[col["index"]], col["memset"]
    return Window(start_ns=idx * window_ns, end_ns=(idx + 1) * window_ns, kernel_count=row[col["kernel_count"]],
                  kernel_ns=row[col["kernel_ns"]], copies=_row_copies(row, col["copy"]),
                  memset=Stat(*row[m:m + 3]), device_mask=row[col["device_mask"]],
                  eager_launches=row[col["eager_launches"]], eager_traced=row[col["eager_traced"]],
                  eager_traced_ns=row[col["eager_traced_ns"]])


def _step(row: Sequence[int]) -> Step:
    col = _STEPS.col
    m = col["memset"]
    return Step(id=row[col["id"]], kernel_count=row[col["kernel_count"]], kernel_ns=row[col["kernel_ns"]],
                first_ns=row[col["first_ns"]], last_ns=row[col["last_ns"]], copies=_row_copies(row, col["copy"]),
                memset=Stat(*row[m:m + 3]), device_mask=row[col["device_mask"]],
                eager_launches=row[col["eager_launches"]], eager_traced=row[col["eager_traced"]],
                eager_traced_ns=row[col["eager_traced_ns"]])


def _window_ns(data) -> int:
    return int.from_bytes(data[_WINDOW_NS_DIV:_WINDOW_NS_DIV + 4], "little") * 1000 or consts.GC_WINDOW_NS


def _windows(data, keep: Callable[[int], bool] = bool) -> List[Window]:
    """The windows whose bucket index is kept, sorted by start."""
    window_ns = _window_ns(data)
    return sorted((_window(r, window_ns) for r in _WINDOWS.rows(data, keep)), key=lambda w: w.start_ns)


def _steps(data, keep: Callable[[int], bool] = bool) -> List[Step]:
    """The steps whose id is kept, sorted by id."""
    return sorted((_step(r) for r in _STEPS.rows(data, keep)), key=lambda s: s.id)


def _kernels(seg) -> KernelTracing:
    """How the segment's collector counted kernels (gc_collector, gc_timing), in the model's terms."""
    if seg.collector != COLLECTOR_DEFAULT:
        return KernelTracing(mode=KERNELS_ALL)
    tm = seg.timing
    return KernelTracing(mode=KERNELS_COUNTED, preloaded=True, untimed=not tm.on, events=bool(tm.on),
                         graph_untimed=seg.graph_untimed,
                         events_every_eager=tm.every_eager, events_every_graph=tm.every_graph,
                         events_timed=tm.timed, events_missed=tm.missed, events_failed=tm.failed,
                         events_idle=tm.idle, events_idle_ns=tm.idle_ns, events_gate=bool(tm.gate),
                         events_gated=tm.gated, events_forced=tm.forced, events_lead=tm.lead,
                         events_lead_ns=tm.lead_ns)


def _parse(path, data, torn: bool) -> ProcessCensus:
    """A ProcessCensus from a copy _snapshot took (and checked); a copy cut at TOTALS_SIZE gives the
    header and device totals, with no windows or steps."""
    seg = ffi.cast("gc_segment *", ffi.from_buffer(data))
    detail = len(data) >= SEGMENT_SIZE
    windows = _windows(data) if detail else []
    steps = {s.id: s for s in _steps(data)} if detail else {}
    devices = _devices(data)
    return ProcessCensus(
        path=str(path), pid=seg.pid, ppid=seg.ppid, comm=_cstr(seg.comm),
        proc_start_ticks=seg.proc_start_ticks,
        wall_start_ns=seg.wall_start_ns, wall_update_ns=seg.wall_update_ns,
        clock_ref_gpu_ns=seg.clock_ref_gpu_ns, clock_ref_wall_ns=seg.clock_ref_wall_ns,
        cupti_version=seg.cupti_version, state=seg.state, flags=seg.flags,
        records=seg.records, records_unknown=seg.records_unknown, dropped=seg.dropped,
        buffers=seg.buffers, buffers_refused=seg.buffers_refused, step_unmatched=seg.step_unmatched,
        window_late=seg.window_late, step_max=seg.step_max, last_gpu_ns=seg.last_gpu_ns,
        complete_wall_ns=seg.complete_wall_ns, launches_lost=seg.launches_lost, calls_lost=seg.calls_lost,
        unsized_calls=seg.unsized_calls, unwrapped=seg.unwrapped, unsized_name=_cstr(seg.unsized_name),
        kernels=_kernels(seg),
        graphs=GraphTracing(mode=seg.graph_mode, unknown=seg.graph_unknown, inexact=seg.graph_inexact,
                            paused=bool(seg.paused), paused_ns=seg.paused_ns),
        attach=Attach(mode=ATTACH_CUINIT, wall_ns=seg.wall_start_ns, contexts_late=seg.contexts_late),
        um_cpu_faults=seg.um_cpu_faults, um_since_wall_ns=seg.um_since_wall_ns, um_refused_code=seg.um_refused_code,
        devices=devices, windows=windows, steps=steps,
        torn=torn, alive=is_alive(seg.pid, seg.proc_start_ticks),
    )


def read_segment(path, detail: bool = True) -> ProcessCensus:
    """One consistent read of the segment at `path`; SegmentError says why when it cannot be read.
    detail=False copies only the header and device totals (no windows, no steps): ~12 KiB instead
    of ~630 KiB, for readers that export totals often."""
    data, torn = _snapshot(path, SEGMENT_SIZE if detail else TOTALS_SIZE)
    return _parse(path, data, torn)


def read_windows(path, wall_lo_ns: int, wall_hi_ns: int) -> ProcessCensus:
    """The segment at `path` with only the windows that overlap wall time [wall_lo_ns, wall_hi_ns)
    (mapped to the CUPTI clock with the segment's clock reference), and no steps: one consistent copy,
    parsed only as far as that. Raises SegmentError like :func:`read_segment`."""
    data, torn = _snapshot(path, SEGMENT_SIZE)
    head = _parse(path, bytes(data[:TOTALS_SIZE]), torn)
    window_ns = _window_ns(data)
    lo = head.wall_to_gpu_ns(wall_lo_ns) // window_ns
    hi = (head.wall_to_gpu_ns(wall_hi_ns) - 1) // window_ns
    return dataclasses.replace(head, windows=_windows(data, lambda idx: lo <= idx <= hi))


def read_steps(path, lo_id: int, hi_id: int) -> List[Step]:
    """The steps of the segment at `path` whose correlation id is in [lo_id, hi_id), sorted by id
    (ids a step ring slot no longer holds are absent). Raises SegmentError like :func:`read_segment`."""
    data, _torn = _snapshot(path, SEGMENT_SIZE)
    return _steps(data, lambda sid: lo_id <= sid < hi_id)


# ---------------------------------------------------------------------------------------------
# a folder of segments

def segment_paths(directory) -> List[Path]:
    return sorted(Path(directory).glob(SEGMENT_GLOB))


def scan(directory, detail: bool = True) -> Tuple[List[ProcessCensus], List[SegmentError]]:
    """Every segment in the folder; files that cannot be read are returned as errors, not raised."""
    good, bad = [], []
    for p in segment_paths(directory):
        try:
            good.append(read_segment(p, detail))
        except SegmentError as e:
            ident = segment_file_pid(p)
            if e.unpublished and ident is not None and is_alive(*ident):
                continue        # a process creating its segment right now: not an error
            bad.append(e)
    return good, bad


def segment_file_pid(path) -> Optional[Tuple[int, int]]:
    """(pid, start ticks) from a name gpu-census-<pid>-<starttime>.seg, None if it is not one."""
    parts = Path(path).name[len("gpu-census-"):-len(".seg")].split("-")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


