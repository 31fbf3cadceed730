"""How steady this host's CPU is: a fixed pure-Python loop timed again and again (wall and thread CPU
time), the host's steal time over the same seconds, and whether the CPU's instruction counter can be
read (perf_event_open): a launch-bound server's throughput moves with the first, and only the last
measures work independently of the CPU's speed.

    python3 bench/perf/host_noise.py --seconds 40 [--busy N]  ->  JSON on stdout
--busy N runs N more spinning processes beside it (a host with other work on it).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import struct
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from ballast import Ballast  # noqa: E402  (bench/server/ballast.py)


def instructions_counter():
    """A perf_event fd counting this thread's user-space instructions, or (None, why)."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return None, "not Linux x86_64"
    libc = ctypes.CDLL(None, use_errno=True)
    attr = bytearray(128)
    struct.pack_into("IIQ", attr, 0, 0, 128, 1)            # PERF_TYPE_HARDWARE, PERF_COUNT_HW_INSTRUCTIONS
    struct.pack_into("Q", attr, 40, (1 << 5) | (1 << 6))     # exclude_kernel, exclude_hv
    buf = ctypes.create_string_buffer(bytes(attr))
    fd = libc.syscall(298, buf, 0, -1, -1, 0)                # perf_event_open(attr, this thread, any cpu)
    if fd < 0:
        return None, os.strerror(ctypes.get_errno())
    return fd, ""


def steal_ticks() -> int:
    with open("/proc/stat") as f:
        cpu = f.readline().split()
    return int(cpu[8])


def work(n=200_000):
    s = 0
    for i in range(n):
        s += i * i % 7
    return s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=40)
    ap.add_argument("--busy", type=int, default=0)
    a = ap.parse_args()
    fd, why = instructions_counter()
    rows = []
    with Ballast(a.busy):
        t_end = time.time() + a.seconds
        while time.time() < t_end:
            i0 = struct.unpack("Q", os.read(fd, 8))[0] if fd is not None else 0
            s0, w0, c0 = steal_ticks(), time.perf_counter(), time.thread_time()
            work()
            w1, c1, s1 = time.perf_counter(), time.thread_time(), steal_ticks()
            i1 = struct.unpack("Q", os.read(fd, 8))[0] if fd is not None else 0
            rows.append((w1 - w0, c1 - c0, s1 - s0, i1 - i0))
    wall = [r[0] for r in rows]
    cpu = [r[1] for r in rows]
    q = statistics.quantiles(wall, n=20)
    out = {"loops": len(rows), "busy_beside": a.busy, "cpus": os.cpu_count(),
           "wall_ms": {"median": round(statistics.median(wall) * 1e3, 2), "p5": round(q[0] * 1e3, 2),
                       "p95": round(q[-1] * 1e3, 2), "max_over_min": round(max(wall) / min(wall), 3)},
           "thread_cpu_ms": {"median": round(statistics.median(cpu) * 1e3, 2),
                             "max_over_min": round(max(cpu) / min(cpu), 3)},
           "steal_ticks": sum(r[2] for r in rows),
           "instructions": ({"median": statistics.median(r[3] for r in rows),
                             "max_over_min": round(max(r[3] for r in rows) / min(r[3] for r in rows), 4)}
                            if fd is not None else {"unavailable": why})}
    for span in (1.0, 3.0):      # loops a second over consecutive bins of `span` s (as a load window sees it)
        rates, acc, n = [], 0.0, 0
        for r in rows:
            acc, n = acc + r[0], n + 1
            if acc >= span:
                rates.append(n / acc)
                acc, n = 0.0, 0
        if len(rates) >= 2:
            out[f"bins_{span:g}s"] = {"n": len(rates), "max_over_min": round(max(rates) / min(rates), 3),
                                      "cv_pct": round(100 * statistics.pstdev(rates) / statistics.mean(rates), 2)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
