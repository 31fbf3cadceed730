"""Ask the census of other processes for something through their control files (native/src/injector/injector.c,
control_poll): here, the final flush of processes about to be killed.

A server's manager that is about to terminate its workers (vLLM's API server stopping its engine, which
it SIGKILLs a few seconds later; SGLang's launcher, which SIGKILLs its whole tree) writes
``census=finish`` beside each of their segments; each worker's flusher thread runs the final flush at
its next wake (within one flush period) and marks the segment exited, even when the worker's own
threads never reach their shutdown code. Never raises."""
from __future__ import annotations

import os
import stat
import time
from pathlib import Path
from typing import Dict, Iterable, List, Set, Tuple

from otel_gpu_census.census import ProcessCensus
from otel_gpu_census.census.reader import SegmentError, read_segment, segment_file_pid, segment_paths

FINISH = "census=finish\n"
SUMMARY_TAIL = 256 * 1024            # the summary line is a few kB; a log's tail of this holds it


def _write_control(seg: Path, text: str) -> bool:
    """The segment's control file, ours and regular: never through a link, never blocking on a FIFO."""
    ctl = seg.with_suffix(".control")
    try:
        fd = os.open(ctl, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     0o600)
    except OSError:
        return False
    try:
        os.write(fd, text.encode())
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _heads_of(directory, pids: Iterable[int]) -> Dict[Path, Tuple[int, ProcessCensus]]:
    """{segment: (its pid, its header)} for `pids` and their descendants (by the parent pid each
    segment records)."""
    want: Set[int] = {p for p in pids if p}
    found: Dict[Path, Tuple[int, ProcessCensus]] = {}
    for p in segment_paths(directory):
        ident = segment_file_pid(p)
        if ident is None:
            continue
        try:
            found[p] = (ident[0], read_segment(p, detail=False))
        except (SegmentError, OSError):
            continue
    grew = True
    while grew:                       # a worker's workers too
        grew = False
        for pid, head in found.values():
            if head.ppid in want and pid not in want:
                want.add(pid)
                grew = True
    return {p: v for p, v in sorted(found.items()) if v[0] in want}


def segments_of(directory, pids: Iterable[int]) -> List[Path]:
    """The segments of `pids` and of their descendants (by the parent pid each segment records)."""
    return list(_heads_of(directory, pids))


def _log_summarised(seg: Path) -> bool:
    """The process's request log (an engine's, beside its segment) is complete: its last line is the
    ledger's summary, which the engine writes once its census has ended. No log: nothing to wait for."""
    log = seg.with_suffix(".requests.jsonl")
    try:
        fd = os.open(log, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    except OSError:
        return True                   # not ours to read (a link, another user's): do not wait on it
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return True
        os.lseek(fd, max(0, st.st_size - SUMMARY_TAIL), os.SEEK_SET)
        tail = os.read(fd, SUMMARY_TAIL)
    except OSError:
        return True
    finally:
        os.close(fd)
    return b'{"summary":' in tail


def finish(directory, pids: Iterable[int], timeout_s: float = 1.5, exclude: Iterable[int] = ()) -> Tuple[int, int]:
    """census=finish for every live segment of `pids` and their descendants, except those of the pids
    in `exclude` (a manager asking for its children's, not its own); wait until each says exited and
    its request log (where it has one) ends with the ledger's summary, at most `timeout_s`. (asked,
    finished)."""
    try:
        skip = set(exclude)
        segs = [s for s, (pid, head) in _heads_of(directory, pids).items()
                if pid not in skip and head.state_name == "active" and _write_control(s, FINISH)]
        deadline = time.monotonic() + timeout_s
        left = list(segs)
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            keep = []
            for s in left:
                try:
                    if read_segment(s, detail=False).state_name != "exited" or not _log_summarised(s):
                        keep.append(s)
                except (SegmentError, OSError):
                    pass              # gone: nothing more to wait for
            left = keep
        return len(segs), len(segs) - len(left)
    except Exception:                 # a manager's shutdown must go on whatever happened here
        return 0, 0
