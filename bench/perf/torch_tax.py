"""What CUPTI's set-up costs a torch workload's launching thread, in one process (measurements §20).

kind_cost.cu found an eager launch ~0.65 µs slower, and CUDA calls that nothing traces up to ~0.13 µs
slower each, once CUPTI's activity API is in use, with every kind disabled again (a paused census),
until cuptiFinalize. This times what a framework's thread does (torch in-place adds on a 1-element
tensor: one launch and torch's own CUDA calls each) in three states of one process, in order:
  before     CUPTI not set up (libcupti not even loaded)
  paused     set up as the census sets it up (buffers registered, a subscriber, the census's copy and
             graph kinds enabled once), then every kind disabled again
  finalized  after a forced flush and cuptiFinalize (one thread here: no callback can be running)
A fixed pure-Python loop is timed beside every round: the host's own speed, the control for states that
cannot alternate. Needs a GPU, torch and a libcupti (OTEL_GPU_CENSUS_CUPTI or MICRO_CUPTI_LIB).

    python3 bench/perf/torch_tax.py --rounds 15 --adds 20000 --out torch_tax.json
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time

KINDS = (1, 8, 38)   # CUPTI_ACTIVITY_KIND_MEMCPY, _MEMSET, _GRAPH_TRACE: what a paused census had enabled


def set_up_cupti(lib, keep: list) -> dict:
    """Buffers registered, a subscriber (its callback enabled for nothing), the kinds enabled, then
    disabled: CUPTI as a paused census leaves it."""
    req_t = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t),
                             ctypes.POINTER(ctypes.c_size_t))
    done_t = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t)

    def request(buf, size, max_records):
        b = ctypes.create_string_buffer(1 << 20)
        keep.append(b)
        buf[0] = ctypes.cast(b, ctypes.c_void_p).value
        size[0] = 1 << 20
        max_records[0] = 0

    cb_t = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p)
    req, done, cb = req_t(request), done_t(lambda *_: None), cb_t(lambda *_: None)
    keep += [req, done, cb]
    sub = ctypes.c_void_p()
    keep.append(sub)
    out = {"register": lib.cuptiActivityRegisterCallbacks(req, done),
           "subscribe": lib.cuptiSubscribe(ctypes.byref(sub), cb, None)}
    out["enable"] = [lib.cuptiActivityEnable(k) for k in KINDS]
    out["disable"] = [lib.cuptiActivityDisable(k) for k in KINDS]
    out["_sub"] = sub
    return out


def cpu_loop() -> float:
    t0 = time.perf_counter()
    x = 0
    for i in range(200_000):
        x += i * i
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--adds", type=int, default=20_000, help="in-place adds a round (one launch each)")
    ap.add_argument("--out", default="torch_tax.json")
    a = ap.parse_args()
    if a.rounds < 1 or a.adds < 1:
        print("torch_tax: --rounds and --adds must be positive", file=sys.stderr)
        return 1
    try:
        import torch
        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA GPU")
    except Exception as e:   # noqa: BLE001 - one clear line, no traceback
        print(f"torch_tax: no usable GPU: {e}", file=sys.stderr)
        return 2
    x = torch.zeros(1, device="cuda")

    def rounds() -> dict:
        per_add, cpu = [], []
        for _ in range(a.rounds + 1):      # the first is a warm-up
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(a.adds):
                x.add_(1)
            torch.cuda.synchronize()
            per_add.append((time.perf_counter() - t0) / a.adds * 1e9)
            cpu.append(cpu_loop() * 1e9)
        return {"ns_per_add": per_add[1:], "cpu_loop_ns": cpu[1:]}

    res: dict = {"bench": "torch_tax", "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                 "rounds": a.rounds, "adds": a.adds, "states": {}}
    res["states"]["before"] = rounds()
    path = os.environ.get("MICRO_CUPTI_LIB") or os.environ.get("OTEL_GPU_CENSUS_CUPTI") or "libcupti.so.13"
    lib = ctypes.CDLL(path)
    keep: list = []
    su = set_up_cupti(lib, keep)
    res["set_up"] = {k: v for k, v in su.items() if not k.startswith("_")}
    res["states"]["paused"] = rounds()
    res["finalize"] = {"unsubscribe": lib.cuptiUnsubscribe(su["_sub"]), "flush": lib.cuptiActivityFlushAll(1),
                       "finalize": lib.cuptiFinalize()}
    res["states"]["finalized"] = rounds()
    for s in res["states"].values():
        s["median_ns_per_add"] = statistics.median(s["ns_per_add"])
        s["median_cpu_loop_ns"] = statistics.median(s["cpu_loop_ns"])
    b = res["states"]["before"]
    for name, s in res["states"].items():
        print(f"{name:10s} {s['median_ns_per_add']:8.0f} ns an add ({s['median_ns_per_add'] / b['median_ns_per_add']:.3f}"
              f" of before), cpu loop {s['median_cpu_loop_ns'] / b['median_cpu_loop_ns']:.3f} of before")
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
