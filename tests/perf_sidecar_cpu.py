"""CPU cost of the metrics sidecar following N census segments (not a pytest test: run it).

    .venv/bin/python tests/perf_sidecar_cpu.py [--processes 8] [--interval 1] [--seconds 30]
                                                 [--exporter otlp|prometheus] [--nvml]

N `sleep` processes stand for CUDA processes of the run's tree; each has a census segment, mapped
and updated once a second by a separate writer process through the native tally (real CUPTI
records: ~1000 kernels and 50 copies per process per second, window ring full from the start), so
the sidecar reads live segments, as in a run. The sidecar exports over OTLP/gRPC to a receiver in
another process (or serves Prometheus, scraped by another process at the same interval). Only this
process's CPU is counted (time.process_time: all its threads), over `--seconds` of wall time.
Prints one line of JSON and a sentence; the target is < 1% of one core at 8 processes and 1 s.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

T0 = 1_000_000_000_000
WINDOW_NS = 20_000_000


def _writer(directory: str, pids: list, root: int) -> None:
    """Child process: create one mapped segment per pid and keep updating them once a second.

    With real CUPTI records (tests/cupti_records.py compiles their structs from <cupti.h>) the
    native tally counts them. Where <cupti.h> cannot be compiled (a GPU machine with only a
    prebuilt library, $OTEL_GPU_CENSUS_LIB, and CUDA headers without crt/), the totals and the
    window ring are written directly under the same seqlock: the sidecar reads the same bytes."""
    import cupti_records as cr
    from otel_gpu_census import reader
    ffi, lib, _ = cr.native()        # $OTEL_GPU_CENSUS_LIB when set, else built from native/
    try:
        cr.records()
        real = True
    except Exception as e:
        print(f"writer: no CUPTI record structs here ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
              "writing the totals directly", file=sys.stderr, flush=True)
        real = False
    segs = []
    for i, pid in enumerate(pids):
        ticks = reader.proc_start_ticks(pid) or 0
        mm, seg = cr.map_segment(Path(directory) / f"gpu-census-{pid}-{ticks}.seg", f"worker{i}".encode())
        seg.pid, seg.ppid, seg.proc_start_ticks = pid, root, ticks
        seg.state = 1
        segs.append((mm, seg, lib.gc_tally_create(seg) if real else None))
    update = _tally_update if real else _direct_update
    # Fill the window ring: one kernel per 20 ms bucket over 42 s of GPU time, each under a step.
    state = {"corr": 1, "gpu_ns": T0}
    for mm, seg, tally in segs:
        lib.gc_segment_begin_update(seg)
        _fill_rings(cr, lib, seg, tally, state) if real else _fill_rings_direct(seg)
        lib.gc_segment_end_update(seg)
    state["gpu_ns"] = T0 + 2100 * WINDOW_NS
    print("ready", flush=True)
    while True:
        t = time.monotonic()
        for mm, seg, tally in segs:
            lib.gc_segment_begin_update(seg)
            update(cr, lib, seg, tally, state)
            seg.wall_update_ns = time.time_ns()
            lib.gc_segment_end_update(seg)
        state["gpu_ns"] += 1_000_000_000
        time.sleep(max(0.0, 1.0 - (time.monotonic() - t)))


def _fill_rings(cr, lib, seg, tally, state) -> None:
    for k in range(2100):
        lib.gc_tally_record(tally, cr.external(state["corr"], 1 + k // 2))
        lib.gc_tally_record(tally, cr.kernel(T0 + k * WINDOW_NS, T0 + k * WINDOW_NS + 1_000_000, corr=state["corr"]))
        state["corr"] += 1
    lib.gc_tally_publish(tally, 0)


def _fill_rings_direct(seg) -> None:
    for k in range(2100):
        w = seg.windows[(T0 // WINDOW_NS + k) % len(seg.windows)]
        w.index, w.kernel_count, w.kernel_ns, w.device_mask = T0 // WINDOW_NS + k, 1, 1_000_000, 1
    for k in range(1050):
        st = seg.steps[(1 + k) % len(seg.steps)]
        st.id, st.kernel_count, st.kernel_ns, st.device_mask = 1 + k, 2, 2_000_000, 1
    _direct_totals(seg, kernels=2100, kernel_ns=2100 * 1_000_000, copies=0)


_BATCH = {}


def _tally_update(cr, lib, seg, tally, state) -> None:
    """~1000 kernels and 50 device-to-host copies of one second, through the tally."""
    batch = _BATCH.setdefault("k", [cr.kernel(0, 0, corr=0) for _ in range(1000)])
    gpu_ns = state["gpu_ns"]
    for j, rec in enumerate(batch):
        rec.start = gpu_ns + j * 1_000_000
        rec.end = rec.start + 400_000
        rec.correlationId = state["corr"]
        state["corr"] += 1
        lib.gc_tally_record(tally, rec)
    for j in range(50):
        lib.gc_tally_record(tally, cr.memcpy("dtoh", 65536, gpu_ns + j * 2_000_000,
                                             gpu_ns + j * 2_000_000 + 10_000, dst="pageable"))
    lib.gc_tally_publish(tally, 0)


def _direct_update(cr, lib, seg, tally, state) -> None:
    """The same second of work as _tally_update, added to the totals by hand."""
    _direct_totals(seg, kernels=1000, kernel_ns=1000 * 400_000, copies=50)
    d = seg.devices[0]
    d.first_ns = d.first_ns or T0
    d.last_ns = state["gpu_ns"] + 999 * 1_000_000 + 400_000
    seg.last_gpu_ns = d.last_ns


def _direct_totals(seg, kernels: int, kernel_ns: int, copies: int) -> None:
    d = seg.devices[0]
    d.in_use, d.device_id = 1, 0
    d.kernel_count += kernels
    d.kernel_ns += kernel_ns
    d.busy_ns += kernel_ns
    c = d.copy[1][0]                      # GC_DIR_DTOH, GC_MEM_PAGEABLE
    c.count += copies
    c.bytes += copies * 65536
    c.ns += copies * 10_000
    seg.records += kernels + copies


def _receiver() -> None:
    from otlp_receiver import OtlpReceiver
    rx = OtlpReceiver(http_enabled=False)
    print(rx.grpc_port, flush=True)
    while True:
        time.sleep(3600)
        rx.clear()


def _scraper(port: int, interval: float) -> None:
    import urllib.request
    while True:
        try:
            urllib.request.urlopen(f"http://localhost:{port}/metrics", timeout=5).read()
        except OSError:
            pass
        time.sleep(interval)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=8)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--exporter", choices=("otlp", "prometheus"), default="otlp")
    ap.add_argument("--nvml", action="store_true", help="also sample NVML (on a GPU machine)")
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("args", nargs="*", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.role == "writer":
        _writer(a.args[0], [int(x) for x in a.args[2:]], int(a.args[1]))
        return 0
    if a.role == "receiver":
        _receiver()
        return 0
    if a.role == "scraper":
        _scraper(int(a.args[0]), float(a.args[1]))
        return 0

    for k in list(os.environ):      # the OTel SDK's settings, not the census's own (OTEL_GPU_CENSUS_LIB)
        if k.startswith("OTEL_") and not k.startswith("OTEL_GPU_CENSUS_"):
            del os.environ[k]
    children = []
    me = [sys.executable, __file__]
    try:
        sleepers = [subprocess.Popen(["sleep", str(a.seconds + 120)]) for _ in range(a.processes)]
        children += sleepers
        tmp = tempfile.mkdtemp(prefix="census-perf-")
        os.chmod(tmp, 0o700)
        writer = subprocess.Popen(me + ["--role", "writer", tmp, str(os.getpid())] + [str(p.pid) for p in sleepers],
                                  stdout=subprocess.PIPE, text=True)
        children.append(writer)
        if writer.stdout.readline().strip() != "ready":
            print("the segment writer failed (its error is above)", file=sys.stderr)
            return 1
        from otel_gpu_census import metrics, reader
        if a.exporter == "otlp":
            rx = subprocess.Popen(me + ["--role", "receiver"], stdout=subprocess.PIPE, text=True)
            children.append(rx)
            os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{rx.stdout.readline().strip()}"
        handle = metrics.start_sidecar(tmp, root_pid=os.getpid(), exporter=a.exporter, prometheus_port=0,
                                       interval_s=a.interval, nvml=a.nvml)
        if a.exporter == "prometheus":
            children.append(subprocess.Popen(me + ["--role", "scraper", str(handle.prometheus_port), str(a.interval)]))
        time.sleep(2 * a.interval)                        # warm up: imports, first exports
        reads0 = handle.census.reads
        c0, w0 = time.process_time(), time.monotonic()
        time.sleep(a.seconds)
        cpu, wall = time.process_time() - c0, time.monotonic() - w0
        reads = handle.census.reads - reads0
        followed = len(handle.census.processes())
        otlp = handle._exporting.otlp
        exports_ok = otlp.successes if otlp else None
        handle.stop()
        # For comparison: one full reader.scan (windows and steps parsed) of the same folder.
        t = time.process_time()
        for _ in range(5):
            reader.scan(tmp)
        full_scan_ms = (time.process_time() - t) / 5 * 1000
        result = {
            "processes": a.processes, "followed": followed, "interval_s": a.interval, "exporter": a.exporter,
            "nvml": a.nvml, "wall_s": round(wall, 2), "cpu_s": round(cpu, 4),
            "cpu_pct_of_one_core": round(100 * cpu / wall, 3), "census_reads": reads,
            "otlp_exports_ok": exports_ok, "full_scan_ms_for_comparison": round(full_scan_ms, 2),
        }
        print(json.dumps(result))
        print(f"sidecar following {followed} processes at {a.interval:g} s ({a.exporter}): "
              f"{result['cpu_pct_of_one_core']}% of one core over {wall:.0f} s "
              f"({reads} census reads; a full scan with windows would cost {full_scan_ms:.1f} ms each)")
        return 0 if followed == a.processes else 1
    finally:
        for c in children:
            c.kill()
            c.wait()


if __name__ == "__main__":
    sys.exit(main())
