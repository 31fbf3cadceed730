"""CPU cost of the metrics sidecar following N censused processes (not a pytest test: run it).

    .venv/bin/python bench/perf/perf_sidecar_cpu.py [--processes 8] [--interval 1] [--seconds 30]
                     [--exporter otlp|prometheus] [--workload synthetic|cuda] [--nvml|--no-nvml] [--out DIR]

On the H200, one command (`bash bench/device/run.sh setup sidecar`; ~60 s: 8 torch processes
start CUDA in ~10-20 s, 2 s warm-up, 30 s measured, teardown), which runs:

    timeout 150 python3 bench/perf/perf_sidecar_cpu.py --workload cuda --seconds 30 --out $OUT/sidecar_cpu

Expected: one JSON line and a sentence, e.g. "sidecar following 8 processes at 1 s (otlp, NVML on,
GPM on 1 GPU, PCIe counters): 0.6% of one core over 30 s"; the JSON has the census reads, OTLP exports that
succeeded, kernels and D2H bytes the 8 processes did in the window, and the metric names the
receiver got (`hw.gpu.utilization`, `gpu_census.sm.occupancy` among them). Target: < 1 % of one
core. Exit 1 if fewer processes were followed than started (or a worker failed). The JSON also has
`stage_cpu_ms_per_collection` (census read, NVML callbacks, the SDK's collection, OTLP encoding and
export, each timed on warm caches after the window), `nvml_cpu_us_per_call` (and `pcie_mode`:
`counters` where NVML has the PCIe byte counter fields, else `sample`), and `package`: the
otel_gpu_census it measured (this checkout's src/, which comes first on sys.path). `--profile FILE`
cProfiles the collections (CPU time of the collecting thread) and prints the top functions.

On the CPU machine (~35 s):

    .venv/bin/python bench/perf/perf_sidecar_cpu.py --seconds 30 [--exporter prometheus]

--workload synthetic (the default): N `sleep` processes stand for CUDA processes of the run's
tree; each has a census segment, mapped and updated once a second by a separate writer process
through the native tally (real CUPTI records: ~1000 kernels and 50 copies per process per second,
window ring full from the start), so the sidecar reads live segments, as in a run.
--workload cuda: N Python processes (--python, with torch) each run a small CUDA loop (1024²
matmuls and a small device-to-host copy, ~100 times a second) under the census injector (the
environment `otel-gpu-census run` gives its command), children of this process as a server's
workers are of `run`; NVML and GPM sampling are on unless --no-nvml.
The sidecar exports over OTLP/gRPC to a receiver in another process (or serves Prometheus, scraped
by another process at the same interval). Only this process's CPU is counted (time.process_time:
all its threads), over `--seconds` of wall time. With --out: sidecar_cpu.json there (and the
workers' stderr in cuda mode).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))     # the segment writer, the OTLP receiver
sys.path.insert(0, str(ROOT / "src"))

T0 = 1_000_000_000_000
WINDOW_NS = 20_000_000


def _writer(directory: str, pids: list, root: int) -> None:
    """Child process: create one mapped segment per pid and keep updating them once a second.

    With real CUPTI records (tests/support/cupti_records.py compiles their structs from <cupti.h>) the
    native tally counts them. Where <cupti.h> cannot be compiled (a GPU machine with only a
    prebuilt library, $OTEL_GPU_CENSUS_LIB, and CUDA headers without crt/), the totals and the
    window ring are written directly under the same seqlock: the sidecar reads the same bytes."""
    import cupti_records as cr
    import segments
    from otel_gpu_census.census import proctree
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
        ticks = proctree.proc_start_ticks(pid) or 0
        mm, seg = segments.map_segment(Path(directory) / f"gpu-census-{pid}-{ticks}.seg", f"worker{i}".encode())
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
    """Receive until stdin closes, then print what arrived (names, not every point: runs can be long)."""
    import threading
    from otlp_receiver import OtlpReceiver
    rx = OtlpReceiver(http_enabled=True)
    names: set = set()
    got = {"requests": 0, "points": 0}
    lock = threading.Lock()

    def fold() -> None:
        with lock:
            pts = rx.snapshot()
            got["requests"] += rx.requests
            rx.clear()
            got["points"] += len(pts)
            names.update(p.name for p in pts)

    def fold_every_minute() -> None:
        while True:
            time.sleep(60)
            fold()
    threading.Thread(target=fold_every_minute, daemon=True).start()
    print(rx.grpc_port, rx.http_port, flush=True)
    sys.stdin.read()                    # until the parent closes our stdin
    fold()
    print(json.dumps({**got, "names": sorted(names)}), flush=True)
    rx.close()


def _cuda_worker(seconds: float) -> None:
    """A small CUDA loop (the process a GPU server's worker would be): matmuls and a small D2H copy."""
    import torch
    x = torch.randn(1024, 1024, device="cuda")
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(4):
            y = x @ x
        y[:4, :4].cpu()                 # device-to-host, and a sync
        time.sleep(0.008)


def _start_cuda_workers(a, census_dir: str, children: list, out) -> list:
    """N censused CUDA processes, children of this one; returns them once each has a segment."""
    from otel_gpu_census.cli import launcher
    from otel_gpu_census.census import reader
    plan = launcher.build_env(census_dir)
    for w in plan.warnings:
        print(f"census: {w}", file=sys.stderr)
    if not plan.census_on:
        raise RuntimeError("the census is off (see above): nothing to follow")
    life = a.seconds + a.start_timeout + 60
    workers = []
    for i in range(a.processes):
        err = open(os.path.join(out, f"worker{i}.stderr"), "w") if out else None   # else on our stderr
        p = subprocess.Popen([a.python, __file__, "--role", "cuda-worker", str(life)], env=plan.env,
                             stdout=subprocess.DEVNULL, stderr=err)
        if err:
            err.close()
        children.append(p)
        workers.append(p)
    pids = {p.pid for p in workers}
    deadline = time.monotonic() + a.start_timeout
    where = os.path.join(out, "worker*.stderr") if out else "above"
    while True:
        dead = [p for p in workers if p.poll() is not None]
        if dead:
            raise RuntimeError(f"{len(dead)} CUDA worker(s) exited (status {dead[0].returncode}) before the "
                               f"measurement; their stderr: {where}")
        procs, _ = reader.scan(census_dir, detail=False)
        have = {c.pid for c in procs} & pids
        if have == pids:
            return workers
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(have)} of {len(pids)} CUDA workers wrote a census segment within "
                               f"{a.start_timeout:g} s (is the census on? the workers' stderr: {where})")
        time.sleep(0.5)


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
    ap.add_argument("--workload", choices=("synthetic", "cuda"), default="synthetic",
                    help="synthetic segments (any machine) or real CUDA processes under the census (GPU machine)")
    ap.add_argument("--nvml", action=argparse.BooleanOptionalAction, default=None,
                    help="sample NVML and GPM too (default: on with --workload cuda, off otherwise)")
    ap.add_argument("--python", default=sys.executable, help="the Python with torch for --workload cuda")
    ap.add_argument("--start-timeout", type=float, default=120.0,
                    help="seconds for the CUDA workers to write their segments (default 120)")
    ap.add_argument("--out", help="folder for sidecar_cpu.json (and the workers' stderr)")
    ap.add_argument("--profile", metavar="FILE",
                    help="cProfile every periodic collection (census read, NVML, SDK, export) into FILE "
                         "(pstats) and print the top functions; the profiler inflates the CPU figure")
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("args", nargs="*", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.role == "cuda-worker":
        _cuda_worker(float(a.args[0]))
        return 0
    if a.role == "writer":
        _writer(a.args[0], [int(x) for x in a.args[2:]], int(a.args[1]))
        return 0
    if a.role == "receiver":
        _receiver()
        return 0
    if a.role == "scraper":
        _scraper(int(a.args[0]), float(a.args[1]))
        return 0

    if a.nvml is None:
        a.nvml = a.workload == "cuda"
    # An outer `timeout` sends SIGTERM: unwind through `finally`, so no CUDA worker outlives us.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out = a.out
    if out:
        os.makedirs(out, exist_ok=True)
    for k in list(os.environ):      # the OTel SDK's settings, not the census's own (OTEL_GPU_CENSUS_LIB)
        if k.startswith("OTEL_") and not k.startswith("OTEL_GPU_CENSUS_"):
            del os.environ[k]
    children = []
    me = [sys.executable, __file__]
    tmp = tempfile.mkdtemp(prefix="census-perf-")
    os.chmod(tmp, 0o700)
    rx = None
    try:
        if a.workload == "cuda":
            try:
                _start_cuda_workers(a, tmp, children, out)
            except RuntimeError as e:
                print(f"perf_sidecar_cpu: {e}", file=sys.stderr)
                return 1
        else:
            sleepers = [subprocess.Popen(["sleep", str(a.seconds + 120)]) for _ in range(a.processes)]
            children += sleepers
            writer = subprocess.Popen(me + ["--role", "writer", tmp, str(os.getpid())] + [str(p.pid) for p in sleepers],
                                      stdout=subprocess.PIPE, text=True)
            children.append(writer)
            if writer.stdout.readline().strip() != "ready":
                print("the segment writer failed (its error is above)", file=sys.stderr)
                return 1
        from otel_gpu_census.telemetry import sidecar
        from otel_gpu_census.census import reader
        if a.exporter == "otlp":
            rx = subprocess.Popen(me + ["--role", "receiver"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            children.append(rx)
            grpc_port, http_port = rx.stdout.readline().split()
            http = os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") == "http/protobuf"
            os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{http_port if http else grpc_port}"
        handle = sidecar.start_sidecar(tmp, root_pid=os.getpid(), exporter=a.exporter, prometheus_port=0,
                                       interval_s=a.interval, nvml=a.nvml)
        prof = _profile_collections(handle) if a.profile else None
        if a.exporter == "prometheus":
            children.append(subprocess.Popen(me + ["--role", "scraper", str(handle.prometheus_port), str(a.interval)]))
        time.sleep(2 * a.interval)                        # warm up: imports, first exports
        reads0 = handle.census.reads
        work0 = _work(handle)
        t0 = _thread_cpu()
        c0, w0 = time.process_time(), time.monotonic()
        time.sleep(a.seconds)
        cpu, wall = time.process_time() - c0, time.monotonic() - w0
        t1 = _thread_cpu()
        threads = {f"{n} ({tid})": round((t1[tid][1] - t0.get(tid, (n, 0))[1]) / wall * 100, 3)
                   for tid, (n, _) in t1.items() if t1[tid][1] - t0.get(tid, (n, 0))[1] > 0}
        reads = handle.census.reads - reads0
        handle.census.refresh()
        work1 = _work(handle)
        followed = len(handle.census.processes())
        otlp = handle._exporting.otlp
        exports_ok = otlp.successes if otlp else None
        sampler = handle.nvml
        gpm_gpus = sum(1 for d in sampler.devices if d.gpm) if sampler else 0
        nvml_cost = _nvml_call_costs(sampler, a.interval) if sampler else None
        stages = _stage_costs(handle)
        handle.stop()
        if prof is not None:
            _report_profile(prof, a.profile, reads)
        received = None
        if rx is not None:
            try:
                rx_out, _ = rx.communicate(timeout=15)     # closes its stdin: it prints what it received
                received = json.loads(rx_out.strip().splitlines()[-1])
            except (subprocess.TimeoutExpired, ValueError, IndexError):
                received = {"error": "the receiver did not report"}
        # For comparison: one full reader.scan (windows and steps parsed) of the same folder.
        t = time.process_time()
        for _ in range(5):
            reader.scan(tmp)
        full_scan_ms = (time.process_time() - t) / 5 * 1000
        result = {
            "workload": a.workload, "processes": a.processes, "followed": followed, "interval_s": a.interval,
            "exporter": a.exporter, "nvml": a.nvml, "nvml_open": sampler is not None, "gpm_gpus": gpm_gpus,
            "pcie_modes": {d.uuid: d.pcie for d in sampler.devices} if sampler else None,
            "package": str(Path(sys.modules["otel_gpu_census"].__file__).parent),   # this tree's src/?
            "wall_s": round(wall, 2), "cpu_s": round(cpu, 4),
            "cpu_pct_of_one_core": round(100 * cpu / wall, 3), "census_reads": reads,
            "otlp_exports_ok": exports_ok, "full_scan_ms_for_comparison": round(full_scan_ms, 2),
            "kernels_in_window": work1[0] - work0[0], "d2h_bytes_in_window": work1[1] - work0[1],
            "received": received, "nvml_cpu_us_per_call": nvml_cost, "cpu_pct_by_thread": threads,
            "stage_cpu_ms_per_collection": stages,
        }
        print(json.dumps(result))
        pcie = sorted({d.pcie for d in sampler.devices}) if sampler else []
        nv = "" if not a.nvml else (", NVML off: unusable here" if sampler is None else
                                    f", NVML on, GPM on {gpm_gpus} of {len(sampler.devices)} GPU(s), "
                                    f"PCIe {'/'.join(pcie)}")
        print(f"sidecar following {followed} processes at {a.interval:g} s ({a.exporter}{nv}): "
              f"{result['cpu_pct_of_one_core']}% of one core over {wall:.0f} s "
              f"({reads} census reads; a full scan with windows would cost {full_scan_ms:.1f} ms each)")
        if out:
            with open(os.path.join(out, "sidecar_cpu.json"), "w") as f:
                json.dump(result, f, indent=1)
        return 0 if followed == a.processes else 1
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()
            c.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def _profile_collections(handle):
    """Run each periodic reader's collect() (its callbacks, the SDK's aggregation and the export)
    under one cProfile.Profile, in the reader's own thread."""
    import cProfile
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    prof = cProfile.Profile(time.thread_time)     # CPU of the reader thread, not wall time
    for r in handle._exporting.readers:
        if isinstance(r, PeriodicExportingMetricReader):
            inner = r.collect

            def collect(*args, _inner=inner, **kw):
                prof.enable()
                try:
                    return _inner(*args, **kw)
                finally:
                    prof.disable()
            r.collect = collect
    return prof


def _report_profile(prof, path: str, collections: int) -> None:
    import pstats
    prof.dump_stats(path)
    st = pstats.Stats(path, stream=sys.stderr)
    print(f"profile of ~{collections} collections ({path}; CPU time of the collecting thread), by cumulative time:", file=sys.stderr)
    st.sort_stats("cumulative").print_stats(30)
    st.sort_stats("tottime").print_stats(20)


def _thread_cpu() -> dict:
    """{tid: (thread name, CPU seconds)} for this process's threads, from /proc (which thread costs)."""
    out, tick = {}, os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                st = f.read()
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        fields = st[st.rindex(")") + 2:].split()
        out[tid] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def _nvml_call_costs(sampler, interval_s: float = 1.0, n: int = 50) -> dict:
    """CPU microseconds per call of each NVML query the sampler can make once per collection (first
    GPU), and the sum of those it does make: how much of the sidecar's CPU is NVML's. `pcie_mode`:
    counters (one field-values call for both directions) or sample (the 20 ms throughput call, once
    per direction: where the counters are missing; taken every `pcie_sample_every_s`, so it counts
    for interval / that share of a collection)."""
    import time as _t
    nv, d = sampler._nvml, sampler.devices[0]
    calls = {
        "utilization": lambda: nv.nvmlDeviceGetUtilizationRates(d.handle),
        "memory_info": lambda: nv.nvmlDeviceGetMemoryInfo(d.handle),
        "pcie_rx": lambda: nv.nvmlDeviceGetPcieThroughput(d.handle, nv.NVML_PCIE_UTIL_RX_BYTES),
        "pcie_tx": lambda: nv.nvmlDeviceGetPcieThroughput(d.handle, nv.NVML_PCIE_UTIL_TX_BYTES),
    }
    if d.pcie_ids:
        calls["pcie_counters"] = lambda: nv.nvmlDeviceGetFieldValues(d.handle, list(d.pcie_ids))
    if d.gpm:
        def gpm():
            d.prev_t = 0.0
            sampler._gpm_sample(d)
        calls["gpm_sample_and_metrics"] = gpm
    out = {"pcie_mode": d.pcie, "pcie_why_not_counters": d.pcie_why}
    for name, fn in calls.items():
        c0, w0 = _t.process_time(), _t.monotonic()
        try:
            for _ in range(10 if name in ("pcie_rx", "pcie_tx") else n):   # 20 ms of wall each
                fn()
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {e}"}
            continue
        k = 10 if name in ("pcie_rx", "pcie_tx") else n
        out[name] = {"cpu_us": round((_t.process_time() - c0) / k * 1e6, 1),
                     "wall_us": round((_t.monotonic() - w0) / k * 1e6, 1)}
    # per collection now: utilization, memory once (the limit is read once), PCIe as its mode says
    # (the 20 ms sample only every pcie_sample_every_s: its share of a collection), GPM once
    per = {"utilization": 1, "memory_info": 1, "gpm_sample_and_metrics": 1}
    every = getattr(sampler, "pcie_sample_every_s", 0.0)
    share = min(1.0, interval_s / every) if every > 0 else 1.0
    out["pcie_sample_every_s"] = every or None
    per.update({"pcie_counters": 1} if d.pcie == "counters" else {"pcie_rx": share, "pcie_tx": share})
    out["per_collection_cpu_us"] = round(sum(out[k]["cpu_us"] * per[k] for k in per
                                             if isinstance(out.get(k), dict) and "cpu_us" in out[k]), 1)
    return out


def _stage_costs(handle, n: int = 20) -> dict:
    """CPU milliseconds per collection, stage by stage, on warm caches (each stage n times in a
    row, in this thread): the census read of the segments; the NVML callbacks; the SDK's
    collection (every callback, census reads excluded: they are fresh); OTLP encoding; the export
    (encoding and the gRPC call). The running sidecar pays more (cold caches once a second). The NVML
    stage takes the PCIe 20 ms sample (where there are no counters) once in its n rounds, not every
    pcie_sample_every_s: nvml_cpu_us_per_call's per_collection_cpu_us weighs it as the sidecar does."""
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    def per(fn) -> float:
        c = time.process_time()
        for _ in range(n):
            fn()
        return round((time.process_time() - c) / n * 1000, 3)

    out = {"census_read": per(handle.census.refresh)}
    sampler = handle.nvml
    if sampler is not None:
        cbs = sampler.callbacks()
        names = [s.name for s in sampler.specs()]
        out["nvml_callbacks"] = per(lambda: [cbs[k](None) for k in names])
    reader = next((r for r in handle._exporting.readers if isinstance(r, PeriodicExportingMetricReader)), None)
    if reader is None:
        return out
    handle.census.refresh()       # the SDK's callbacks below find a fresh snapshot and do not read
    data = reader._collect(reader, timeout_millis=10_000)
    out["sdk_collect"] = per(lambda: (handle.census.refresh(force=False), reader._collect(reader, timeout_millis=10_000)))
    out["points"] = sum(len(m.data.data_points) for rm in data.resource_metrics for sm in rm.scope_metrics
                        for m in sm.metrics)
    exporter = getattr(reader._exporter, "_inner", reader._exporter)
    if hasattr(exporter, "_translate_data"):
        out["otlp_encode"] = per(lambda: exporter._translate_data(data))
        out["otlp_export"] = per(lambda: reader._exporter.export(data))
    return out


def _work(handle) -> tuple:
    """(kernels, device-to-host bytes) the followed processes did so far, all GPUs."""
    totals = handle.census.device_totals().values()
    return (sum(d.kernel_count for d in totals), sum(d.copies.get("dtoh").bytes for d in totals))

if __name__ == "__main__":
    sys.exit(main())
