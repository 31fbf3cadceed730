"""What the census instruments report as processes come and go, and how the busy ratio is derived.
Collected through the OTel SDK's own in-memory reader; processes are real segments read by the
real reader where the reader's view matters (liveness), census values built directly elsewhere."""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel_gpu_census import census
from otel_gpu_census.telemetry import census_metrics as metrics
from otel_gpu_census.census import CopyTable, DeviceTotals, ProcessCensus, Stat

HW = "GPU-00000000-0000-0000-0000-000000000001"
S = 1_000_000_000


def proc(pid, busy_ns=0, htod=0, kernels=1, start_ticks=100, wall_start_ns=0, alive=True,
         state=census.STATE_ACTIVE, hw=HW, comm="srv", tracing=census.KernelTracing(),
         complete_wall_ns=0) -> ProcessCensus:
    d = DeviceTotals(0, hw, kernel_count=kernels, kernel_ns=busy_ns, busy_ns=busy_ns,
                     copies=CopyTable({("htod", "pinned"): Stat(1, htod, 10)} if htod else {}))
    return ProcessCensus(
        path=f"/x/{pid}", pid=pid, ppid=1, comm=comm, proc_start_ticks=start_ticks, wall_start_ns=wall_start_ns,
        wall_update_ns=0, clock_ref_gpu_ns=0, clock_ref_wall_ns=0, cupti_version=1, state=state, flags=0,
        records=0, records_unknown=0, dropped=0, buffers=0, buffers_refused=0, step_unmatched=0,
        window_late=0, step_max=0, last_gpu_ns=0, devices={0: d}, alive=alive, kernels=tracing,
        complete_wall_ns=complete_wall_ns)


class Rig:
    """A MeterProvider with an in-memory reader over a source the test edits, and a clock it steps."""

    def __init__(self, procs, retain_exited=256):
        self.procs = list(procs)
        self.now = 10 * S
        self.reader = InMemoryMetricReader()
        self.provider = MeterProvider(metric_readers=[self.reader])
        self.state = metrics.register_census_instruments(
            self.provider, lambda: self.procs, min_refresh_s=0, retain_exited=retain_exited, clock=lambda: self.now)

    def collect(self):
        """{name: {frozenset(attributes): value}}"""
        out = {}
        for rm in self.reader.get_metrics_data().resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    for dp in m.data.data_points:
                        out.setdefault(m.name, {})[frozenset(dp.attributes.items())] = dp.value
        return out


def val(data, name, **attrs):
    rows = [v for a, v in data.get(name, {}).items() if all(dict(a).get(k) == x for k, x in attrs.items())]
    assert len(rows) <= 1, (name, attrs, rows)
    return rows[0] if rows else None


def io(data, direction="receive"):
    return val(data, "gpu_census.host.io", **{"hw.id": HW, "network.io.direction": direction})


def test_exited_process_keeps_its_totals_and_device_sums_never_drop():
    rig = Rig([proc(10, busy_ns=S, htod=1000)])
    d = rig.collect()
    assert val(d, "gpu_census.copy.bytes", **{"process.pid": 10}) == 1000
    assert io(d) == 1000
    # The process exits and its segment is removed; a new process starts.
    rig.procs = [proc(11, busy_ns=0, htod=50, wall_start_ns=rig.now)]
    d = rig.collect()
    assert val(d, "gpu_census.copy.bytes", **{"process.pid": 10}) == 1000       # last totals kept
    assert val(d, "gpu_census.process.counting", **{"process.pid": 10}) == 0
    assert val(d, "gpu_census.copy.bytes", **{"process.pid": 11}) == 50
    assert val(d, "gpu_census.process.counting", **{"process.pid": 11}) == 1
    assert io(d) == 1050


def test_beyond_retention_series_stop_but_sums_hold():
    rig = Rig([proc(10, htod=1000), proc(11, htod=7)], retain_exited=1)
    rig.collect()
    rig.procs = [proc(12, htod=5)]            # 10 and 11 gone; only one exited process is kept
    d = rig.collect()
    kept = [p for p in (10, 11) if val(d, "gpu_census.copy.bytes", **{"process.pid": p}) is not None]
    assert len(kept) == 1
    assert io(d) == 1012                      # 10 and 11 still in the per-device sum
    # The evicted one's segment reappearing (still on disk) does not bring its series back.
    rig.procs = [proc(10, htod=1000), proc(11, htod=7), proc(12, htod=5)]
    d = rig.collect()
    assert io(d) == 1012


def test_reused_pid_starts_new_totals_without_double_counting():
    rig = Rig([proc(10, htod=1000, start_ticks=100, alive=False, state=census.STATE_EXITED)])
    rig.collect()
    # A new process got pid 10; the old segment file is still there.
    rig.procs = [proc(10, htod=1000, start_ticks=100, alive=False, state=census.STATE_EXITED),
                 proc(10, htod=30, start_ticks=200, wall_start_ns=rig.now)]
    d = rig.collect()
    assert val(d, "gpu_census.copy.bytes", **{"process.pid": 10}) == 30        # the new process's
    assert io(d) == 1030
    rig.procs = [proc(10, htod=40, start_ticks=200)]
    d = rig.collect()
    assert io(d) == 1040


def test_busy_ratio_is_busy_gained_over_wall_time():
    rig = Rig([proc(10, busy_ns=5 * S)])      # registration: the ratio's starting point
    rig.now += 2 * S
    rig.procs = [proc(10, busy_ns=5 * S + S // 2)]
    assert val(rig.collect(), "gpu_census.busy.ratio", **{"hw.id": HW}) == pytest.approx(0.25)
    rig.now += 1 * S
    rig.procs = [proc(10, busy_ns=5 * S + S // 2 + 3 * S // 4),
                 # started after the previous collection: all its busy time is new
                 proc(11, busy_ns=S // 8, wall_start_ns=rig.now - S // 2),
                 # already running before it and first seen now: its past is not in this interval
                 proc(12, busy_ns=50 * S, wall_start_ns=1)]
    assert val(rig.collect(), "gpu_census.busy.ratio", **{"hw.id": HW}) == pytest.approx(0.875)
    rig.now += 1 * S
    rig.procs = [proc(11, busy_ns=S // 8, wall_start_ns=1), proc(12, busy_ns=50 * S + S // 10, wall_start_ns=1)]
    assert val(rig.collect(), "gpu_census.busy.ratio", **{"hw.id": HW}) == pytest.approx(0.1)
    rig.now += 1 * S                          # overlapping processes can add past 1: clamped
    rig.procs = [proc(11, busy_ns=S // 8 + S), proc(12, busy_ns=50 * S + S // 10 + S)]
    assert val(rig.collect(), "gpu_census.busy.ratio", **{"hw.id": HW}) == 1.0


def test_traced_time_of_a_fully_traced_process_is_its_life_so_far():
    rig = Rig([proc(10, busy_ns=S, wall_start_ns=3 * S, complete_wall_ns=8 * S)])
    assert val(rig.collect(), "gpu_census.kernel.traced.time", **{"process.pid": 10}) == pytest.approx(5.0)


def test_source_failure_keeps_last_values_with_one_warning(caplog):
    rig = Rig([proc(10, htod=1000)])
    rig.collect()

    def broken():
        raise OSError("census folder vanished")
    rig.state._source = broken
    with caplog.at_level(logging.WARNING):
        d1 = rig.collect()
        d2 = rig.collect()
    assert val(d1, "gpu_census.copy.bytes", **{"process.pid": 10}) == 1000
    assert val(d2, "gpu_census.copy.bytes", **{"process.pid": 10}) == 1000
    assert len(caplog.records) == 1 and "census folder vanished" in caplog.text


def test_one_read_serves_a_whole_collection():
    rig = Rig([proc(10)])
    rig.state._min_refresh_ns = 10 * S
    before = rig.state.reads
    rig.now += 20 * S
    rig.collect()
    assert rig.state.reads == before + 1


# ---- real segments: liveness as the reader sees it, and the run's process tree ------------------

def test_real_process_exit_is_seen_and_totals_stay(segments, records, census_dir):
    from otel_gpu_census.census import proctree
    child = subprocess.Popen(["sleep", "60"])
    try:
        r = records
        segments.segment(census_dir, [r.memcpy("htod", 4096, 10, 20, src="pageable")], comm="w",
                         final=True, state=census.STATE_ACTIVE, pid=child.pid, ppid=os.getpid(),
                         start_ticks=proctree.proc_start_ticks(child.pid))
        rig_reader = InMemoryMetricReader()
        provider = MeterProvider(metric_readers=[rig_reader])
        metrics.register_census_instruments(provider, metrics.segment_source(census_dir, os.getpid()),
                                            min_refresh_s=0)

        def collect():
            out = {}
            for rm in rig_reader.get_metrics_data().resource_metrics:
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        for dp in m.data.data_points:
                            out.setdefault(m.name, {})[frozenset(dp.attributes.items())] = dp.value
            return out
        d = collect()
        assert val(d, "gpu_census.process.counting", **{"process.pid": child.pid}) == 1
        assert val(d, "gpu_census.copy.bytes", **{"process.pid": child.pid}) == 4096
    finally:
        child.kill()
        child.wait()
    d = collect()
    assert val(d, "gpu_census.process.counting", **{"process.pid": child.pid}) == 0
    assert val(d, "gpu_census.copy.bytes", **{"process.pid": child.pid}) == 4096
    for p in census_dir.iterdir():
        p.unlink()
    d = collect()
    assert val(d, "gpu_census.copy.bytes", **{"process.pid": child.pid}) == 4096


def test_process_tree_follows_links_through_processes_without_segments():
    from otel_gpu_census.census import proctree
    # this test -> sh (no segment) -> sleep (has a segment)
    sh = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(sh.stdout.readline())
        me = proc(os.getpid(), start_ticks=proctree.proc_start_ticks(os.getpid()))
        gc = dataclasses.replace(proc(grandchild, start_ticks=proctree.proc_start_ticks(grandchild)), ppid=sh.pid)
        stranger = dataclasses.replace(proc(1, start_ticks=1), ppid=0)
        keep = metrics.ProcessTreeFilter(os.getpid())([me, gc, stranger])
        assert [p.pid for p in keep] == [os.getpid(), grandchild]
        # the tree of the shell alone does not include this test process
        assert [p.pid for p in metrics.ProcessTreeFilter(sh.pid)([me, gc, stranger])] == [grandchild]
    finally:
        os.kill(grandchild, signal.SIGKILL)
        sh.kill()
        sh.wait()


def test_totals_read_matches_the_reader(segments, records, census_dir, dead_pid):
    """The sidecar's totals-only read (detail=False) gives the full read's values for everything
    but the rings, peer copies received included."""
    from otel_gpu_census.census import reader
    r = records

    def edit(seg):
        seg.dropped, seg.flags, seg.step_max = 9, 0x5, 77
        for i, b in enumerate(bytes(range(16))):
            seg.devices[0].uuid[i] = b
    t = 10**12          # window index 0 means an empty slot: start well after it
    segments.segment(census_dir, [r.kernel(t + 10, t + 20), r.kernel(t + 15, t + 40, device=1),
                                  r.memcpy("htod", 4096, t + 50, t + 60, src="pinned"), r.memset(8, t + 70, t + 80),
                                  r.graph_trace(t + 90, t + 100), r.peer(64, t + 110, t + 120, 0, 1)],
                     comm="worker-ü", final=False, edit=edit)
    segments.segment(census_dir, [r.kernel(t, t + 20)], pid=dead_pid, ppid=1, final=True)
    paths = reader.segment_paths(census_dir)
    assert len(paths) == 2
    for path in paths:
        full = reader.read_segment(path)
        fast = reader.read_segment(path, detail=False)
        assert full.windows and not fast.windows
        assert dataclasses.replace(full, windows=[], steps={}) == fast
    assert any(d.peer_recv.bytes == 64 for c in [reader.read_segment(p) for p in paths] for d in c.devices.values())


def test_tree_link_through_an_exited_parent_comes_from_the_launcher(dead_pid):
    """A worker whose parent (not censused) already exited: placed once the launcher's record of
    the tree says where that parent hung, and not ruled out before."""
    from otel_gpu_census.census import proctree
    me = proctree.proc_start_ticks(os.getpid())
    worker = dataclasses.replace(proc(dead_pid + 100000, start_ticks=me + 1), ppid=dead_pid)
    parents = {}
    tree = metrics.ProcessTreeFilter(os.getpid(), parents)
    assert tree([worker]) == []
    parents[dead_pid] = os.getpid()
    assert tree([worker]) == [worker]


def test_own_segment_source_for_in_process_hooks(segments, records, census_dir, caplog):
    """A hook registers before CUDA made its segment: no warning, no series; then the totals."""
    path = census_dir / "own.seg"
    reader_ = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader_])
    with caplog.at_level(logging.WARNING):
        metrics.register_census_instruments(provider, metrics.segment_file_source(path), min_refresh_s=0)
        assert reader_.get_metrics_data() is None          # nothing to report yet
    assert not caplog.records
    segments.segment(census_dir, [records.kernel(10**12, 10**12 + 100)], final=True, state=census.STATE_ACTIVE).rename(path)
    values = [dp.value for rm in reader_.get_metrics_data().resource_metrics for sm in rm.scope_metrics
              for m in sm.metrics if m.name == "gpu_census.kernel.count" for dp in m.data.data_points]
    assert values == [1]


def test_census_series_name_their_gpu_as_the_hardware_conventions_ask():
    """hw.type and hw.vendor on every GPU series; the recommended hw.* where NVML knows the GPU."""
    other = "cuda:1"                                    # a GPU whose UUID the census could not learn
    known = {HW: {"hw.model": "NVIDIA H200", "hw.name": "nvidia0", "hw.driver_version": "580.159.04"}}
    reader = InMemoryMetricReader()
    metrics.register_census_instruments(MeterProvider(metric_readers=[reader]),
                                        lambda: [proc(10, busy_ns=S, htod=1000), proc(11, hw=other, htod=5)],
                                        min_refresh_s=0, known_gpus=known)
    seen = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for dp in m.data.data_points:
                    a = dict(dp.attributes)
                    if "hw.id" in a:
                        seen.setdefault(a["hw.id"], set()).add(frozenset((k, v) for k, v in a.items()
                                                                         if k.startswith("hw.")))
    assert seen[HW] == {frozenset({"hw.id": HW, "hw.type": "gpu", "hw.vendor": "NVIDIA", **known[HW]}.items())}
    assert seen[other] == {frozenset({"hw.id": other, "hw.type": "gpu", "hw.vendor": "NVIDIA"}.items())}


def test_the_sidecar_gives_census_series_what_nvml_knows(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from otel_gpu_census.telemetry import nvml, sidecar
    known = {HW: {"hw.model": "NVIDIA H200", "hw.name": "nvidia0", "hw.driver_version": "580"}}
    monkeypatch.setattr(nvml, "register_nvml_instruments",
                        lambda provider: SimpleNamespace(known_gpus=lambda: known, close=lambda: None))
    handle = sidecar.start_sidecar(tmp_path, exporter="console", interval_s=3600,
                                   source=lambda: [proc(10, htod=1000)])
    try:
        assert handle.census.gpu(HW)["hw.model"] == "NVIDIA H200"
    finally:
        handle.stop()
