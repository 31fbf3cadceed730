"""The census folder: where segments are written and read, its safety checks, and its tidying.

The injector writes ``gpu-census-<pid>-<starttime>.seg`` into one folder per user; the same default
is computed here (``native/src/core/segment.c`` has the C side).
"""
from __future__ import annotations

import os
import stat
import time
from pathlib import Path
from typing import List, Optional

from otel_gpu_census.census.proctree import is_alive
from otel_gpu_census.census.reader import SegmentError, read_segment, segment_file_pid, segment_paths


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
    if xdg:                     # same choice as the injector (native/src/core/segment.c)
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
