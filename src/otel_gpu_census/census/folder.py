"""The census folder: where segments are written and read, its safety checks, and its tidying.

The injector writes ``gpu-census-<pid>-<starttime>.seg`` into one folder per user; the same default
is computed here (``native/src/segment.c`` has the C side).
"""
from __future__ import annotations

import os
import stat
import time
from pathlib import Path
from typing import List, Optional

from .proctree import is_alive
from .reader import SegmentError, read_segment, segment_file_pid, segment_paths


class CensusDirError(Exception):
    """The census folder cannot be used (message says why and what to do)."""



def cleanup(directory, older_than_s: float = 3600.0, now: Optional[float] = None) -> List[Path]:
    """Remove segments of processes that no longer run and were last written more than
    `older_than_s` ago. A live process's segment is never removed. Returns the removed paths."""
    now = time.time() if now is None else now
    removed = []
    for p in segment_paths(directory):
        ident = segment_file_pid(p)
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



def default_census_dir() -> Path:
    """$OTEL_GPU_CENSUS_DIR, else $XDG_RUNTIME_DIR/otel-gpu-census, else /tmp/otel-gpu-census-<uid>."""
    env = os.environ.get("OTEL_GPU_CENSUS_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:                     # same choice as the injector (native/src/segment.c)
        return Path(xdg) / "otel-gpu-census"
    return Path(f"/tmp/otel-gpu-census-{os.getuid()}")


def check_private_dir(path: Path) -> None:
    """Refuse a folder another user could plant files in: it must be ours and not group/world writable."""
    st = os.stat(path)     # follows a symlink on purpose: what matters is the folder written into
    if not stat.S_ISDIR(st.st_mode):
        raise CensusDirError(f"census folder {path} is not a folder")
    if st.st_uid != os.getuid():
        raise CensusDirError(f"census folder {path} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}): "
                             "another user could plant or read segments there; choose another with --dir "
                             "or OTEL_GPU_CENSUS_DIR")
    if st.st_mode & 0o022:
        raise CensusDirError(f"census folder {path} is writable by group or others (mode "
                             f"{stat.S_IMODE(st.st_mode):04o}); fix with `chmod 700 {path}` or choose another")


def census_dir(path=None) -> Path:
    """The census folder to write into: `path` or the default, created mode 0700 when missing,
    checked to be private and writable. CensusDirError says what is wrong."""
    p = Path(path) if path is not None else default_census_dir()
    p = Path(os.path.abspath(p))
    if not p.exists():
        try:
            os.makedirs(p, mode=0o700, exist_ok=True)
            os.chmod(p, 0o700)        # makedirs' mode is filtered by the umask
        except OSError as e:
            raise CensusDirError(f"cannot create census folder {p}: {e.strerror}") from None
    try:
        check_private_dir(p)
    except FileNotFoundError:
        raise CensusDirError(f"census folder {p} vanished while being checked") from None
    if not os.access(p, os.W_OK | os.X_OK):
        raise CensusDirError(f"census folder {p} is not writable by you")
    return p


def readable_dir(path=None) -> Path:
    """A folder to read segments from (report): it must exist and be listable; others' folders are fine."""
    p = Path(os.path.abspath(Path(path) if path is not None else default_census_dir()))
    if not p.exists():
        raise CensusDirError(f"census folder {p} does not exist (nothing was recorded there yet)")
    if not p.is_dir():
        raise CensusDirError(f"{p} is not a folder")
    if not os.access(p, os.R_OK | os.X_OK):
        raise CensusDirError(f"census folder {p} is not readable by you")
    return p
