"""CPU time of a server's whole process tree over a load window, per process role and per thread.

A launch-bound server's throughput moves with the host (a plain vLLM's 3 s windows ranged 11,000-18,500
tok/s on the H200 host, 2026-12-02), but the CPU each of its processes spends per generated token
moves far less: comparing it between servers and census modes says which process (API server,
EngineCore, the settling child, the launcher) pays for what, where the throughput ratios cannot.

    before = snapshot(root_pid); ...load...; cpu = delta(before, snapshot(root_pid))

Each role also says how long its threads waited on a run queue (`wait_s`, /proc/.../schedstat): a thread
that is ready but has no CPU, because another thread of this machine holds it. `host()` / `host_delta()`
say what the whole machine did over a window, steal time too: the share of its CPUs' time the hypervisor
gave to others, which no pinning inside the machine can take back.

Linux only (/proc); a process or thread that ends within the window counts up to its last snapshot.
"""
from __future__ import annotations

import os
from typing import Dict, Tuple

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01

# (cmdline word, role): the first that occurs in a process's command line names it; else its comm
ROLES = (("otel_gpu_census.integrations.engine.settle_process", "settle"), ("otel_gpu_census.cli", "launcher"),
         ("otel_gpu_census.telemetry.sidecar", "sidecar"), ("vllm.entrypoints", "api_server"))


def _stat(path: str) -> Tuple[str, int, int]:
    """(comm, parent pid, utime + stime in ticks) from a /proc/.../stat line; comm may hold spaces or ')'."""
    with open(path, "rb") as f:
        s = f.read().decode(errors="replace")
    l, r = s.index("("), s.rindex(")")
    rest = s[r + 2:].split()
    return s[l + 1:r], int(rest[1]), int(rest[11]) + int(rest[12])


def role(pid: int, comm: str) -> str:
    if comm.startswith("VLLM::") or comm.startswith("sglang::"):
        return comm                     # vLLM's own process titles (EngineCore, APIServer, Worker)
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return comm
    for word, name in ROLES:
        if word in cmd:
            return name
    return comm


def tree(root: int) -> Dict[int, str]:
    """The pids of root and every descendant (sessions of their own included), with their roles."""
    parent: Dict[int, int] = {}
    comm: Dict[int, str] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                c, pp, _ = _stat(f"/proc/{d}/stat")
            except (OSError, ValueError, IndexError):
                continue
            parent[int(d)], comm[int(d)] = pp, c
    keep = {root} if root in parent else set()
    grew = True
    while grew:
        grew = False
        for p, pp in parent.items():
            if pp in keep and p not in keep:
                keep.add(p)
                grew = True
    return {p: role(p, comm[p]) for p in keep}


def _run_delay_ns(path: str) -> int:
    """A thread's time ready to run but waiting for a CPU (schedstat's second field), 0 where not kept."""
    try:
        with open(path, "rb") as f:
            return int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def snapshot(root: int) -> Dict[int, dict]:
    """{pid: {"role", "threads": {tid: (thread comm, ticks, run-queue wait ns)}}} for root's process tree, now."""
    out: Dict[int, dict] = {}
    for pid, r in tree(root).items():
        threads = {}
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for t in tids:
            try:
                c, _, ticks = _stat(f"/proc/{pid}/task/{t}/stat")
            except (OSError, ValueError, IndexError):
                continue
            threads[int(t)] = (c, ticks, _run_delay_ns(f"/proc/{pid}/task/{t}/schedstat"))
        out[pid] = {"role": r, "threads": threads}
    return out


def delta(before: Dict[int, dict], after: Dict[int, dict], top: int = 3) -> Dict[str, dict]:
    """CPU seconds spent between two snapshots, per role (processes of one role summed): the total,
    the busiest threads (the main thread named "main"), how many processes had the role, and the
    seconds its threads waited on a run queue."""
    roles: Dict[str, dict] = {}
    for pid, a in after.items():
        b = before.get(pid, {"threads": {}})["threads"]
        r = roles.setdefault(a["role"], {"cpu_s": 0.0, "wait_s": 0.0, "processes": 0, "_threads": {}})
        r["processes"] += 1
        for tid, (c, ticks, wait) in a["threads"].items():
            was = b.get(tid, (c, 0, 0))
            r["wait_s"] += max(wait - was[2], 0) / 1e9
            d = (ticks - was[1]) * TICK_S
            if d <= 0:
                continue
            r["cpu_s"] += d
            name = "main" if tid == pid else c
            r["_threads"][name] = r["_threads"].get(name, 0.0) + d
    for r in roles.values():
        th = r.pop("_threads")
        r["cpu_s"] = round(r["cpu_s"], 3)
        r["wait_s"] = round(r["wait_s"], 3)
        r["threads"] = {k: round(v, 3) for k, v in sorted(th.items(), key=lambda kv: -kv[1])[:top]}
    return roles


def host() -> Tuple[int, ...]:
    """The machine's CPU ticks now, all CPUs summed: /proc/stat's first line (user nice system idle iowait
    irq softirq steal ...)."""
    with open("/proc/stat") as f:
        return tuple(int(x) for x in f.readline().split()[1:])


def host_delta(before: Tuple[int, ...], after: Tuple[int, ...]) -> Dict[str, float]:
    """Over a window: the share of all CPU time that was busy, idle, and stolen by the hypervisor (%)."""
    d = [a - b for a, b in zip(after, before)]
    d += [0] * (8 - len(d))
    total = sum(d[:8]) or 1                    # guest time is already inside user
    idle, steal = d[3] + d[4], d[7]
    return {"busy_pct": round(100 * (total - idle - steal) / total, 2), "idle_pct": round(100 * idle / total, 2),
            "steal_pct": round(100 * steal / total, 2)}
