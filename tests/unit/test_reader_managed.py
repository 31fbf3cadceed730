"""Managed-memory migrations in a segment (CUPTI's unified-memory counters, counted by the native tally) as every
reader sees them: their own copy rows beside the copies in the device totals and the windows, so the proxy's window
shares split them as they split copies; never in a step (no correlation id), which a step-attributed span says."""
from __future__ import annotations

from otel_gpu_census import census
from otel_gpu_census.attribution.steps import StepLedger
from otel_gpu_census.attribution.windows import Interval, attribute
from otel_gpu_census.census import Stat, Step, reader

MiB = 1 << 20
T = 1_700_000_000_000_000_000
W = 20_000_000     # one window


def measured(seg):
    seg.flags |= census.FLAG_UM_COUNTERS


def test_migrations_are_copy_rows_of_their_own_in_totals_and_windows(segments, records, census_dir):
    r = records
    recs = [r.unified("BYTES_TRANSFER_HTOD", 2 * MiB, T + 100, T + 600, 0, 0),
            r.unified("BYTES_TRANSFER_HTOD", 6 * MiB, T + W + 100, T + W + 900, 0, 0),
            r.unified("BYTES_TRANSFER_DTOH", 8 * MiB, T + 2 * W, T + 2 * W + 500, 0, 0),
            r.unified("BYTES_TRANSFER_DTOD", 4096, T + 5, T + 10, 1, 0),
            r.unified("GPU_PAGE_FAULT", 5, T + 50, T + 60, 0, 0),
            r.unified("CPU_PAGE_FAULT_COUNT", 0, T + 70),
            r.unified("REMOTE_MAP", 65536, T + 80, 0, 0, 0),
            r.memcpy("htod", 4096, T + 200, T + 300, src="pinned")]
    p = reader.read_segment(segments.segment(census_dir, recs, edit=measured))
    d = p.devices[0]
    assert d.copies.get("managed_htod", "other") == Stat(2, 8 * MiB, 500 + 800)
    assert d.copies.get("managed_dtoh", "other") == Stat(1, 8 * MiB, 500)
    assert d.copies.get("htod") == Stat(1, 4096, 100)                    # the real copy, apart
    assert (d.managed.migrated_dtod, d.managed.gpu_faults, d.managed.remote_maps) == (Stat(1, 4096, 5), 5, 1)
    assert p.um_cpu_faults == 1 and p.managed_in_use and p.migrations_measured and p.gaps == []
    by_start = {w.start_ns - (T - T % W): w.copies for w in p.windows}
    assert by_start[0]["managed_htod"] == Stat(1, 2 * MiB, 500) and by_start[W]["managed_htod"].bytes == 6 * MiB
    assert by_start[2 * W]["managed_dtoh"].bytes == 8 * MiB
    # the proxy's windows: two requests over the first window share its migration as they share its copy
    to_wall = p.gpu_to_wall_ns
    w0 = [w for w in p.windows if w.start_ns <= T < w.end_ns]
    a = attribute(w0, to_wall, [Interval("a", to_wall(T - W)), Interval("b", to_wall(T - W))])
    got = [a.share(k).copy("managed_htod").bytes for k in ("a", "b")]
    assert sum(got) == 2 * MiB and got[0] and got[1], got
    # steps: none of it, and a step-attributed share says so
    assert "not per step" in " ".join(p.step_gaps) and not p.gaps


def test_the_default_census_reads_as_not_measured_and_old_flags_stay_exact(segments, records, census_dir):
    def managed(seg):
        seg.flags |= census.FLAG_MANAGED
        seg.devices[0].in_use = 1
        seg.devices[0].managed.allocs, seg.devices[0].managed.alloc_bytes = 1, 8 * MiB
    p = reader.read_segment(segments.segment(census_dir, [records.kernel(T, T + 10)], edit=managed))
    assert p.managed_in_use and not p.migrations_measured
    assert p.gaps == [p.managed_gap] and "1 allocations, 8,388,608 bytes" in p.managed_gap
    q = reader.read_segment(segments.segment(census_dir / "..", [records.kernel(T, T + 10)], pid=4242))
    assert not q.managed_in_use and q.gaps == [] and q.step_gaps == []


def test_a_step_share_of_a_server_whose_migrations_were_measured_says_it_holds_none(segments, records, census_dir):
    p = reader.read_segment(segments.segment(
        census_dir, [records.unified("BYTES_TRANSFER_HTOD", 2 * MiB, T + 100, T + 600, 0, 0)], edit=measured))
    steps = {1: Step(id=1, kernel_count=4, kernel_ns=400)}
    head = census.dataclasses.replace(p, complete_wall_ns=4 * 10**9, state=census.STATE_ACTIVE, step_max=1, alive=True)
    led = StepLedger(lambda lo, hi: (head, {i: s for i, s in steps.items() if lo <= i <= hi}),
                     clock=lambda: 5 * 10**9, follows=True)
    led.request_started("a")
    led.step_opened(1, {"a": 1}, 10**9)
    led.step_touched(1, 10**9)
    led.request_done("a", None, 10**9)
    (a,) = led.settle()
    assert a.share.kernel_count == 4 and a.status == "partial"
    assert any("not per step" in n for n in a.notes), a.notes


def test_a_segment_of_the_previous_layout_is_refused_in_one_line_and_upgrades(tmp_path):
    """A layout-4 segment (recorded on a GPU before managed memory was counted) is not read as layout 5: one line
    says which layout it is; moved to layout 5 by segments.upgrade it reads with every figure it had."""
    import tarfile
    from pathlib import Path

    import pytest
    import segments
    from segments import upgrade
    archives = sorted((Path(__file__).resolve().parents[2] / "bench" / "results" / "explain").glob("explain-hybrid*.tgz"))
    if not archives:
        pytest.skip("no layout-4 archive")
    with tarfile.open(archives[-1]) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(".seg"))
        data = tar.extractfile(member).read()
    assert int.from_bytes(data[8:12], "little") == 4
    old = tmp_path / "gpu-census-1-1.seg"
    old.write_bytes(data)
    with pytest.raises(reader.SegmentError) as e:
        reader.read_segment(old)
    assert "layout version 4; this reader reads version 5" in e.value.reason and "\n" not in e.value.reason
    old.write_bytes(upgrade(data))
    p = reader.read_segment(old)
    assert p.devices and not p.managed_in_use and not p.migrations_measured
    d = p.devices[0]
    assert d.copies.get("managed_htod").count == 0 and d.managed == census.NO_MANAGED
    # the collector it ran and its event-pair figures, moved from the old header into gc_timing
    h = segments._F4.from_buffer("head4 *", bytearray(data[:segments._HEAD4]))
    k = p.kernels
    assert h.kernel_mode == 3 and k.counted and k.events and not k.untimed
    assert (k.events_every_eager, k.events_timed, k.events_gated) == (h.events_every_eager, h.events_timed,
                                                                      h.events_gated) and k.events_timed > 0
    # figures read straight from the old bytes: device 0's kernel count and its first copy cell (htod, pageable)
    # sit where they did (layout 5 gave the header its own size and appended to the copy table)
    from otel_gpu_census._native import ffi
    at = segments._HEAD4
    word = lambda off: int.from_bytes(data[at + off:at + off + 8], "little")   # noqa: E731
    assert d.kernel_count == word(ffi.offsetof("gc_device", "kernel_count")) > 0
    htod = d.copies.get("htod", "pageable")
    cell = ffi.offsetof("gc_device", "copy")
    assert (htod.count, htod.bytes) == (word(cell), word(cell + 8))
    dtoh = d.copies.get("dtoh")                               # direction 1: the second row of four memory kinds
    assert dtoh.bytes == sum(word(cell + (4 + m) * 24 + 8) for m in range(4)) > 0
    grown = 2 * 4 * 24                                        # the two managed_* rows of four cells
    assert d.eager_launches == word(ffi.offsetof("gc_device", "eager_launches") - grown)
    assert d.memset.bytes == word(ffi.offsetof("gc_device", "memset") - grown + 8)


def test_a_segment_of_a_retired_way_of_counting_does_not_upgrade():
    """A layout-4 header that counted kernels on a schedule (sampled), or not at all, names no collector of layout 5:
    upgrade refuses it rather than read a sample as a whole."""
    import pytest
    import segments
    for mode, flags in ((1, 0), (2, 0), (3, 0), (3, 0x20 | 0x40 | 0x80)):       # sampled, off, CUPTI-counted, windows
        h = segments._F4.new("head4 *", {"kernel_mode": mode, "flags": flags, "layout_version": 4})
        with pytest.raises(segments.RetiredMode):
            segments._head4_to_5(bytes(segments._F4.buffer(h)))
    ok = segments._F4.new("head4 *", {"kernel_mode": 0, "flags": 0x2, "layout_version": 4, "pid": 7})
    out = segments._head4_to_5(bytes(segments._F4.buffer(ok)))
    from otel_gpu_census._native import ffi, consts
    seg = ffi.from_buffer("gc_segment *", bytearray(out) + bytearray(ffi.sizeof("gc_segment") - len(out)))
    assert (seg.collector, seg.flags, seg.pid, seg.timing.on) == (consts.GC_COLLECTOR_PRECISE, 0x2, 7, 0)
