#!/usr/bin/env python3
"""PyTorch workloads for the reliability suite; each prints one JSON line ``RESULT {...}``.

  python workloads.py fork [--child-exit sys|os]  fork without exec after CUDA init; the child does
                                                   CPU work and exits; the parent keeps using CUDA
  python workloads.py profiler [--n N]             torch.profiler inside a censused process: what the
                                                   profiler and the census each count, before, during
                                                   and after profiling
  python workloads.py touch                        import torch, one tensor on the GPU, exit
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from pathlib import Path


def emit(res: dict) -> None:
    print("RESULT " + json.dumps(res), flush=True)


def fork_case(a: argparse.Namespace) -> None:
    import torch
    x = torch.zeros(1024, device="cuda")
    for _ in range(a.n):
        x.add_(1)
    torch.cuda.synchronize()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        s = sum(i * i for i in range(300_000))   # CPU work only: CUDA is unusable after fork
        if a.child_exit == "sys":
            sys.exit(0 if s > 0 else 1)           # runs atexit handlers, the injector's included
        os._exit(0 if s > 0 else 1)
    child_rc, hang = None, False
    while time.monotonic() - t0 < a.child_timeout:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            child_rc = os.waitstatus_to_exitcode(status)
            break
        time.sleep(0.01)
    else:
        hang = True
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    child_s = time.monotonic() - t0
    for _ in range(a.n):
        x.add_(1)
    torch.cuda.synchronize()
    emit({"parent_pid": os.getpid(), "child_pid": pid, "child_rc": child_rc, "child_hang": hang,
          "child_s": round(child_s, 3), "adds": 2 * a.n, "value_ok": float(x[0].item()) == 2.0 * a.n})


def _census_handle():
    """The injector already loaded in this process (same path: dlopen returns it), or None."""
    path = os.environ.get("CUDA_INJECTION64_PATH")
    if not path:
        return None
    try:
        lib = ctypes.CDLL(path)
        lib.gc_segment_path.restype = ctypes.c_char_p
        lib.gc_active.restype = ctypes.c_int
        return lib
    except (OSError, AttributeError):
        return None


def _census_count(lib) -> dict:
    """Kernels the census has tallied so far (after a flush and CUPTI's 1 s period)."""
    if lib is None:
        return {"error": "no injector"}
    lib.gc_flush()
    time.sleep(1.6)
    path = (lib.gc_segment_path() or b"").decode()
    out = {"active": lib.gc_active(), "segment": path}
    if not path:
        return out
    try:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
        from otel_gpu_census.census import reader
        pc = reader.read_segment(path)
        out.update(kernels=sum(d.kernel_count for d in pc.devices.values()), flags=pc.flags,
                   state=pc.state_name, dropped=pc.dropped, records=pc.records)
    except Exception as e:  # reader not importable here: the suite reads the file after exit
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def profiler_case(a: argparse.Namespace) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile
    lib = _census_handle()
    x = torch.zeros(1, device="cuda")
    res: dict = {"n": a.n}

    def work() -> None:
        for _ in range(a.n):
            x.add_(1)
        torch.cuda.synchronize()

    work()
    res["census_before"] = _census_count(lib)
    t0 = time.monotonic()
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            work()
        events = prof.events()
        res["profiler_cuda_kernels"] = sum(
            1 for e in events if str(getattr(e, "device_type", "")).endswith("CUDA") and "add" in e.name.lower())
        res["profiler_cuda_events"] = sum(1 for e in events if str(getattr(e, "device_type", "")).endswith("CUDA"))
    except Exception as e:
        res["profiler_error"] = f"{type(e).__name__}: {e}"
    res["profiler_s"] = round(time.monotonic() - t0, 3)
    res["census_during"] = _census_count(lib)
    work()
    res["census_after"] = _census_count(lib)
    res["value_ok"] = float(x.item()) == 3.0 * a.n
    emit(res)


def touch_case(a: argparse.Namespace) -> None:
    import torch
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    emit({"ok": True})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("case", choices=("fork", "profiler", "touch"))
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--child-exit", choices=("sys", "os"), default="sys")
    ap.add_argument("--child-timeout", type=float, default=30)
    a = ap.parse_args()
    {"fork": fork_case, "profiler": profiler_case, "touch": touch_case}[a.case](a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
