"""Process trees from /proc and from segments: which censuses belong to a server and its children.

A pid alone does not name a process for long (pids are reused), so a process is (pid, start time in
clock ticks since boot), as the segment file name and ``ProcessCensus.proc_start_ticks`` carry it.
"""
from __future__ import annotations

import os
from typing import Dict, Iterable, List, Mapping, Optional

from otel_gpu_census.census import ProcessCensus


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
