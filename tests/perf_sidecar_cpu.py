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
import mmap
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
    """Child process: create one mapped segment per pid and keep tallying records into them."""
    import cupti_records as cr
    from otel_gpu_census import reader
    ffi, lib, _ = cr.native()
    segs = []
    for i, pid in enumerate(pids):
        ticks = reader.proc_start_ticks(pid) or 0
        path = Path(directory) / f"gpu-census-{pid}-{ticks}.seg"
        size = ffi.sizeof("gc_segment")
        with open(path, "wb") as f:
            f.truncate(size)
        fd = os.open(path, os.O_RDWR)
        mm = mmap.mmap(fd, size)
        os.close(fd)
        seg = ffi.from_buffer("gc_segment *", mm)
        lib.gc_segment_init(seg, f"worker{i}".encode(), 0, 0)
        seg.pid, seg.ppid, seg.proc_start_ticks = pid, root, ticks
        seg.state = 1
        segs.append((mm, seg, lib.gc_tally_create(seg)))
    # Fill the window ring: one kernel per 20 ms bucket over 42 s of GPU time, each under a step.
    gpu_ns = T0
    corr = 1
    for mm, seg, tally in segs:
        lib.gc_segment_begin_update(seg)
        for k in range(2100):
            lib.gc_tally_record(tally, cr.external(corr, 1 + k // 2))
            lib.gc_tally_record(tally, cr.kernel(T0 + k * WINDOW_NS, T0 + k * WINDOW_NS + 1_000_000, corr=corr))
            corr += 1
        lib.gc_tally_publish(tally, 0)
        lib.gc_segment_end_update(seg)
    gpu_ns = T0 + 2100 * WINDOW_NS
    batch_k = [cr.kernel(0, 0, corr=0) for _ in range(1000)]
    print("ready", flush=True)
    while True:
        t = time.monotonic()
        for mm, seg, tally in segs:
            lib.gc_segment_begin_update(seg)
            for j, rec in enumerate(batch_k):
                rec.start = gpu_ns + j * 1_000_000
                rec.end = rec.start + 400_000
                rec.correlationId = corr
                corr += 1
                lib.gc_tally_record(tally, rec)
            for j in range(50):
                lib.gc_tally_record(tally, cr.memcpy("dtoh", 65536, gpu_ns + j * 2_000_000,
                                                     gpu_ns + j * 2_000_000 + 10_000, dst="pageable"))
            lib.gc_tally_publish(tally, 0)
            seg.wall_update_ns = time.time_ns()
            lib.gc_segment_end_update(seg)
        gpu_ns += 1_000_000_000
        time.sleep(max(0.0, 1.0 - (time.monotonic() - t)))


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

    for k in list(os.environ):
        if k.startswith("OTEL_"):
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
        assert writer.stdout.readline().strip() == "ready", "writer failed"
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
