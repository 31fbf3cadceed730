"""Read census segments into :class:`census.ProcessCensus` values, and find and tidy them.

A segment is mapped shared by the process it describes; this side only ever copies it and checks
the writer's sequence counter (odd while an update is in progress), like a perf_event page reader.
Nothing here can block or change a writer.
"""
from __future__ import annotations

import os
import stat
import time
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Optional, Tuple

from ._native import LAYOUT_VERSION, MAGIC, SEGMENT_SIZE, SEQ_OFFSET, consts, ffi
from .census import (DIRECTIONS, MEMORY_KINDS, ZERO, CopyTable, DeviceTotals, KernelTracing, ProcessCensus, Stat,
                     Step, Window)

SEGMENT_GLOB = "gpu-census-*.seg"
READ_TRIES = 50           # seqlock attempts before settling for a possibly torn copy
READ_RETRY_SLEEP_S = 0.001

assert (len(DIRECTIONS), len(MEMORY_KINDS)) == (consts.GC_NDIR, consts.GC_NMEM), "census.py and gpu_census.h disagree"


class SegmentError(Exception):
    """A file that is not a readable census segment; ``reason`` says why in plain words."""

    def __init__(self, path, reason: str, unpublished: bool = False):
        super().__init__(f"{path}: {reason}")
        self.path = str(path)
        self.reason = reason
        self.unpublished = unpublished    # zero magic: possibly a writer still setting it up


class CensusDirError(Exception):
    """The census folder cannot be used (message says why and what to do)."""


# ---------------------------------------------------------------------------------------------
# processes

def _stat_fields(pid: int) -> Optional[List[bytes]]:
    """/proc/<pid>/stat from field 3 on (index 0 is field 3); None if no such process.
    comm (field 2) may hold spaces and parentheses, so fields are counted from the last ')'."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rfind(b")") + 2:].split()


def _stat_field(pid: int, field: int) -> Optional[int]:
    fields = _stat_fields(pid)
    try:
        return int(fields[field - 3]) if fields is not None else None
    except (IndexError, ValueError):
        return None


def proc_start_ticks(pid: int) -> Optional[int]:
    """Field 22 of /proc/<pid>/stat (start time in clock ticks since boot); None if no such process."""
    return _stat_field(pid, 22)


def proc_ppid(pid: int) -> Optional[int]:
    return _stat_field(pid, 4)


def is_alive(pid: int, start_ticks: int) -> bool:
    """The process runs and is the one that wrote the segment (not a later process with its pid)."""
    if pid <= 0:
        return False
    now = proc_start_ticks(pid)
    if now is None:
        return False
    return start_ticks == 0 or now == start_ticks


def live_descendants(root_pid: int) -> Dict[int, int]:
    """{pid: ppid} for the running descendants of root_pid, read from /proc now."""
    out: Dict[int, int] = {}
    todo = [root_pid]
    have_children_files = os.path.exists(f"/proc/{root_pid}/task/{root_pid}/children")
    if not have_children_files:        # kernel without CONFIG_PROC_CHILDREN: one pass over /proc
        kids: Dict[int, List[int]] = {}
        for name in os.listdir("/proc"):
            if name.isdigit():
                pp = proc_ppid(int(name))
                if pp is not None:
                    kids.setdefault(pp, []).append(int(name))
    while todo:
        pid = todo.pop()
        if have_children_files:
            children: List[int] = []
            try:
                for tid in os.listdir(f"/proc/{pid}/task"):
                    with open(f"/proc/{pid}/task/{tid}/children") as f:
                        children.extend(int(x) for x in f.read().split())
            except (OSError, ValueError):
                pass
        else:
            children = kids.get(pid, [])
        for child in children:
            if child not in out:
                out[child] = pid
                todo.append(child)
    return out


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
        raise SegmentError(path, f"layout version {version}; this reader reads version {LAYOUT_VERSION} "
                                 "(read it with the otel-gpu-census that wrote it)")
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

        for attempt in range(READ_TRIES):
            before = seq()
            if before % 2 == 0 and copy() == before and seq() == before:
                return data, False
            time.sleep(READ_RETRY_SLEEP_S)
        # Still mid-update: the writer died inside an update (or is stopped there). Its last
        # values are still the best there is; hand them over marked torn.
        copy()
        return data, True
    except OSError as e:
        raise SegmentError(path, f"cannot read: {e.strerror}") from None
    finally:
        os.close(fd)


def _cstr(arr) -> str:
    return ffi.string(arr).decode("utf-8", "replace")


def format_uuid(raw: bytes) -> str:
    """'GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx' as nvidia-smi prints it; '' when all zero."""
    if not any(raw):
        return ""
    h = raw.hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _stat(s) -> Stat:
    return Stat(s.count, s.bytes, s.ns)


def _by_direction(arr) -> Dict[str, Stat]:
    """Nonzero directions only: absent means zero, as in CopyTable."""
    out = {}
    for i, d in enumerate(DIRECTIONS):
        if arr[i].count or arr[i].ns:
            out[d] = _stat(arr[i])
    return out


def _device(d) -> DeviceTotals:
    cells = {}
    for i, direction in enumerate(DIRECTIONS):
        for j, mem in enumerate(MEMORY_KINDS):
            s = _stat(d.copy[i][j])
            if s != ZERO:
                cells[(direction, mem)] = s
    return DeviceTotals(
        device_id=d.device_id,
        uuid=format_uuid(bytes(ffi.buffer(d.uuid))),
        kernel_count=d.kernel_count,
        kernel_ns=d.kernel_ns,
        busy_ns=d.busy_ns,
        first_ns=d.first_ns,
        last_ns=d.last_ns,
        graph_launches=d.graph_launches,
        graph_ns=d.graph_ns,
        copies=CopyTable(cells),
        memset=_stat(d.memset),
        peer_recv=_stat(d.peer_recv),
    )


def _parse(path, data, torn: bool) -> ProcessCensus:
    """A ProcessCensus from a copy _snapshot took (and checked); a copy cut at TOTALS_SIZE gives the
    header and device totals, with no windows or steps."""
    seg = ffi.cast("gc_segment *", ffi.from_buffer(data))
    detail = len(data) >= SEGMENT_SIZE
    window_ns = (seg.window_ns_div * 1000) or consts.GC_WINDOW_NS
    windows = []
    for w in seg.windows if detail else ():
        if w.index:
            windows.append(Window(
                start_ns=w.index * window_ns, end_ns=(w.index + 1) * window_ns,
                kernel_count=w.kernel_count, kernel_ns=w.kernel_ns,
                copies=_by_direction(w.copy), memset=_stat(w.memset), device_mask=w.device_mask))
    windows.sort(key=lambda w: w.start_ns)
    steps = {}
    for s in seg.steps if detail else ():
        if s.id:
            steps[s.id] = Step(
                id=s.id, kernel_count=s.kernel_count, kernel_ns=s.kernel_ns,
                first_ns=s.first_ns, last_ns=s.last_ns,
                copies=_by_direction(s.copy), memset=_stat(s.memset), device_mask=s.device_mask)
    devices = {d.device_id: _device(d) for d in seg.devices if d.in_use}
    return ProcessCensus(
        path=str(path), pid=seg.pid, ppid=seg.ppid, comm=_cstr(seg.comm),
        proc_start_ticks=seg.proc_start_ticks,
        wall_start_ns=seg.wall_start_ns, wall_update_ns=seg.wall_update_ns,
        clock_ref_gpu_ns=seg.clock_ref_gpu_ns, clock_ref_wall_ns=seg.clock_ref_wall_ns,
        cupti_version=seg.cupti_version, state=seg.state, flags=seg.flags,
        records=seg.records, records_unknown=seg.records_unknown, dropped=seg.dropped,
        buffers=seg.buffers, buffers_refused=seg.buffers_refused, step_unmatched=seg.step_unmatched,
        window_late=seg.window_late, step_max=seg.step_max, last_gpu_ns=seg.last_gpu_ns,
        complete_wall_ns=seg.complete_wall_ns,
        kernels=KernelTracing(mode=seg.kernel_mode, on_ms=seg.kernel_on_ms, period_ms=seg.kernel_period_ms,
                              origin_gpu_ns=seg.kernel_origin_gpu_ns, traced_ns=seg.kernel_traced_ns,
                              tracing=bool(seg.kernel_tracing), outside=seg.kernel_outside),
        note=_cstr(seg.note), devices=devices, windows=windows, steps=steps,
        torn=torn, alive=is_alive(seg.pid, seg.proc_start_ticks),
    )


def read_segment(path, detail: bool = True) -> ProcessCensus:
    """One consistent read of the segment at `path`; SegmentError says why when it cannot be read.
    detail=False copies only the header and device totals (no windows, no steps): ~12 KiB instead
    of ~630 KiB, for readers that export totals often."""
    data, torn = _snapshot(path, SEGMENT_SIZE if detail else TOTALS_SIZE)
    return _parse(path, data, torn)


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


def process_tree(root_pid: int, censuses: Iterable[ProcessCensus],
                 parents: Optional[Mapping[int, int]] = None,
                 root_start_ticks: Optional[int] = None) -> List[ProcessCensus]:
    """The censuses of `root_pid` and its descendants, following ppid links between segments.

    `parents` ({pid: ppid}) fills links through processes that wrote no segment (a shell between
    the launcher and the CUDA program). With `root_start_ticks`, segments of processes started
    before the root are ignored, so an old segment whose pid was reused cannot join the tree.
    """
    censuses = list(censuses)
    if root_start_ticks is not None:
        censuses = [c for c in censuses if c.proc_start_ticks >= root_start_ticks or c.pid == root_pid]
    link: Dict[int, int] = dict(parents or {})
    link.update({c.pid: c.ppid for c in censuses})

    def descends(pid: int) -> bool:
        seen = set()
        while pid and pid not in seen:
            if pid == root_pid:
                return True
            seen.add(pid)
            pid = link.get(pid, 0)
        return False

    return [c for c in censuses if descends(c.pid)]


def segment_file_pid(path) -> Optional[Tuple[int, int]]:
    """(pid, start ticks) from a name gpu-census-<pid>-<starttime>.seg, None if it is not one."""
    parts = Path(path).name[len("gpu-census-"):-len(".seg")].split("-")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def cleanup(directory, older_than_s: float = 3600.0, now: Optional[float] = None) -> List[Path]:
    """Remove segments of processes that no longer run and were last written more than
    `older_than_s` ago. A live process's segment is never removed. Returns the removed paths."""
    now = time.time() if now is None else now
    removed = []
    for p in segment_paths(directory):
        ident = segment_file_pid(p)
        try:
            if not stat.S_ISREG(os.lstat(p).st_mode):
                continue        # not a file the census wrote: leave it for a person to look at
        except OSError:
            continue
        try:
            c = read_segment(p)
            pid, ticks, last = c.pid, c.proc_start_ticks, c.wall_update_ns / 1e9
        except SegmentError:
            if ident is None:
                continue        # unknown owner: leave it for a person to look at
            pid, ticks = ident
            last = 0.0
        try:
            last = max(last, p.stat().st_mtime)
        except OSError:
            continue
        if is_alive(pid, ticks) or now - last < older_than_s:
            continue
        try:
            p.unlink()
            removed.append(p)
        except OSError:
            pass
    return removed


# ---------------------------------------------------------------------------------------------
# the census folder

def default_census_dir() -> Path:
    """$OTEL_GPU_CENSUS_DIR, else $XDG_RUNTIME_DIR/otel-gpu-census, else /tmp/otel-gpu-census-<uid>."""
    env = os.environ.get("OTEL_GPU_CENSUS_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:                     # same choice as the injector (native/src/segment.c)
        return Path(xdg) / "otel-gpu-census"
    return Path(f"/tmp/otel-gpu-census-{os.getuid()}")


def show_path(path) -> str:
    """A path as a message shows it: control characters escaped, a very long one cut in the middle."""
    text = str(path).encode("unicode_escape", "backslashreplace").decode("ascii", "replace") \
        if not str(path).isprintable() else str(path)
    return text if len(text) <= 160 else f"{text[:80]}…{text[-60:]} ({len(text)} characters)"


def named_census_dir(path=None) -> bool:
    """Whether the folder was named by the user (an argument or $OTEL_GPU_CENSUS_DIR) rather than
    the default one: a named folder may be reached through a link the user made; the default path
    may not be a link at all (anyone can plant one under /tmp)."""
    return path is not None or bool(os.environ.get("OTEL_GPU_CENSUS_DIR"))


def check_private_dir(path: Path, follow: bool = True) -> None:
    """Refuse a folder another user could plant files in: it must be ours and not group/world writable.
    follow=False: a symbolic link at `path` is refused too (the default folder)."""
    st = os.stat(path) if follow else os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise CensusDirError(f"census folder {show_path(path)} is a symbolic link: anyone could have put it there to "
                             "send the census elsewhere; remove it, or name a folder with --dir or "
                             "OTEL_GPU_CENSUS_DIR")
    if not stat.S_ISDIR(st.st_mode):
        raise CensusDirError(f"census folder {show_path(path)} is not a folder")
    if st.st_uid != os.getuid():
        raise CensusDirError(f"census folder {show_path(path)} belongs to uid {st.st_uid}, not to you (uid "
                             f"{os.getuid()}): another user could plant or read segments there; choose another with "
                             "--dir or OTEL_GPU_CENSUS_DIR")
    if st.st_mode & 0o022:
        raise CensusDirError(f"census folder {show_path(path)} is writable by group or others (mode "
                             f"{stat.S_IMODE(st.st_mode):04o}); fix with `chmod 700 {show_path(path)}` or choose another")


def census_dir(path=None) -> Path:
    """The census folder to write into: `path` or the default, created mode 0700 when missing,
    checked to be private and writable. CensusDirError says what is wrong.

    A folder the user named is resolved here (links followed once): the injector refuses a census
    folder reached through a link, and gets the real one."""
    named = named_census_dir(path)
    p = Path(path) if path is not None else default_census_dir()
    try:
        p = Path(os.path.realpath(p) if named else os.path.abspath(p))
        if not os.path.lexists(p):
            try:
                os.makedirs(p, mode=0o700, exist_ok=True)
                os.chmod(p, 0o700)        # makedirs' mode is filtered by the umask
            except OSError as e:
                raise CensusDirError(f"cannot create census folder {show_path(p)}: {e.strerror}") from None
        check_private_dir(p, follow=named)
        if not os.access(p, os.W_OK | os.X_OK):
            raise CensusDirError(f"census folder {show_path(p)} is not writable by you")
    except FileNotFoundError:
        raise CensusDirError(f"census folder {show_path(p)} vanished while being checked") from None
    except OSError as e:         # a name too long, a folder above it we cannot enter, ...
        raise CensusDirError(f"cannot use census folder {show_path(p)}: {e.strerror}") from None
    return p


def readable_dir(path=None) -> Path:
    """A folder to read segments from (report): it must exist and be listable. A folder named
    (`path`) may be anyone's: reading another user's census is a choice. The default folder must be
    private and ours, as for `run`: otherwise segments planted there would pass for our processes."""
    named = path is not None
    p = Path(os.path.abspath(Path(path) if named else default_census_dir()))
    try:
        try:
            os.lstat(p)
        except FileNotFoundError:
            raise CensusDirError(f"census folder {show_path(p)} does not exist (nothing was recorded there yet)") \
                from None
        if not named:
            try:
                check_private_dir(p, follow=named_census_dir())
            except CensusDirError as e:
                raise CensusDirError(f"{e}; to read it anyway, name it: report {show_path(p)}") from None
        if not p.is_dir():
            raise CensusDirError(f"{show_path(p)} is not a folder")
        if not os.access(p, os.R_OK | os.X_OK):
            raise CensusDirError(f"census folder {show_path(p)} is not readable by you")
    except OSError as e:
        raise CensusDirError(f"cannot read census folder {show_path(p)}: {e.strerror}") from None
    return p
