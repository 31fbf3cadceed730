"""The tally on a CPU: real CUPTI record structs (tests/support/cupti_records.py) into gc_tally_record, and
the segment fields checked against what the records say. Every number is derived from the records
the test builds, never copied from a run."""
from __future__ import annotations

import random

import pytest

from otel_gpu_census import _native

MiB = 1 << 20
T0 = 1_700_000_000_000_000_000  # a CUPTI-like timestamp (ns since the epoch)
W = 20_000_000                   # GC_WINDOW_NS
DIR = {"htod": 0, "dtoh": 1, "dtod": 2, "ptop": 3, "htoh": 4, "other": 5}
MEM = {"pageable": 0, "pinned": 1, "device": 2, "other": 3}


@pytest.fixture
def census(native):
    ffi, lib, _ = native
    seg = ffi.new("gc_segment *")
    lib.gc_segment_init(seg, b"tally-test", 0, T0)
    t = lib.gc_tally_create(seg)
    yield seg, t, lib, ffi
    lib.gc_tally_destroy(t)


def feed(census, *recs, final=False):
    seg, t, lib, _ = census
    lib.gc_segment_begin_update(seg)
    for r in recs:
        lib.gc_tally_record(t, r)
    lib.gc_tally_publish(t, 1 if final else 0)
    lib.gc_segment_end_update(seg)


def union_length(intervals):
    total, cur_s, cur_e = 0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + ((cur_e - cur_s) if cur_e is not None else 0)


def test_busy_is_the_union_of_overlapping_kernels(census, records):
    seg = census[0]
    ivs = [(T0 + 0, T0 + 100), (T0 + 50, T0 + 150), (T0 + 40, T0 + 60), (T0 + 300, T0 + 400), (T0 + 150, T0 + 160)]
    # arrival order is not start order: streams and per-thread buffers interleave
    feed(census, *[records.kernel(s, e, stream=i) for i, (s, e) in enumerate(reversed(ivs))])
    d = seg.devices[0]
    assert d.kernel_count == 5
    assert d.kernel_ns == sum(e - s for s, e in ivs)
    assert d.busy_ns == union_length(ivs) == 260
    assert (d.first_ns, d.last_ns) == (T0, T0 + 400)
    assert seg.seq % 2 == 0 and seg.seq > 0


def test_busy_union_random_against_python(census, records):
    rng = random.Random(7)
    ivs = []
    for _ in range(2000):  # more than the frontier holds: exercises commits
        s = T0 + rng.randrange(0, 50_000_000)
        ivs.append((s, s + rng.randrange(1, 200_000)))
    ivs.sort()
    # mild reordering (within a few hundred records), as CUPTI delivers them
    shuffled = ivs[:]
    for i in range(0, len(shuffled), 50):
        chunk = shuffled[i:i + 50]
        rng.shuffle(chunk)
        shuffled[i:i + 50] = chunk
    for i in range(0, len(shuffled), 100):
        feed(census, *[records.kernel(s, e) for s, e in shuffled[i:i + 100]])
    feed(census, final=True)
    assert census[0].devices[0].busy_ns == union_length(ivs)


def test_interval_arriving_after_commit_is_clipped_not_double_counted(census, records):
    seg = census[0]
    # 300 disjoint kernels: the frontier (256) commits the oldest
    recs = [records.kernel(T0 + i * 1000, T0 + i * 1000 + 500) for i in range(300)]
    feed(census, *recs)
    # a late record overlapping committed ones must not add their time again: the frontier
    # committed the 44 oldest (300 - 256), so everything before their end is past the watermark
    feed(census, records.kernel(T0, T0 + 2500), final=True)
    truth = union_length([(T0 + i * 1000, T0 + i * 1000 + 500) for i in range(300)] + [(T0, T0 + 2500)])
    assert seg.devices[0].busy_ns == 300 * 500 < truth  # clipped: at worst under, never double
    assert seg.devices[0].kernel_count == 301


def test_graph_nodes_count_one_by_one(census, records):
    seg = census[0]
    # one graph launch (one correlation id) of 100 kernel nodes, replayed 3 times
    recs = []
    for launch in range(3):
        for node in range(100):
            s = T0 + launch * 1_000_000 + node * 1000
            recs.append(records.kernel(s, s + 800, corr=10 + launch, graph_id=5, graph_node=node))
    feed(census, *recs)
    d = seg.devices[0]
    assert d.kernel_count == 300
    assert d.kernel_ns == 300 * 800
    assert d.graph_launches == 0


def test_graph_trace_records_of_unknown_graphs_count_their_span_only(census, records):
    """A launch whose graph the census never saw made (graphs.c learned nothing for its correlation id):
    its span is GPU time, but no kernel or copy can be claimed, and the segment says so."""
    seg = census[0]
    feed(census, records.graph_trace(T0, T0 + 5000), records.graph_trace(T0 + 4000, T0 + 9000, corr=2))
    d = seg.devices[0]
    assert (d.graph_launches, d.graph_ns, d.busy_ns, d.kernel_count, d.kernel_ns) == (2, 10000, 9000, 0, 10000)
    assert seg.graph_unknown == 2 and seg.graph_inexact == 0
    assert seg.flags & 0x8 and seg.flags & 0x10


def contents(ffi, kernels=0, copies=(), memsets=(), inexact=False):
    """A gc_graph_contents: copies as (direction, memory kind, bytes) per copy node."""
    c = ffi.new("gc_graph_contents *")
    c.kernels = kernels
    for direction, mem, nbytes in copies:
        c.copies[DIR[direction]][MEM[mem]] += 1
        c.copy_bytes[DIR[direction]][MEM[mem]] += nbytes
    for nbytes in memsets:
        c.memsets += 1
        c.memset_bytes += nbytes
    c.flags = 1 if inexact else 0
    return c


def launch(census, record, c):
    seg, t, lib, _ = census
    lib.gc_segment_begin_update(seg)
    lib.gc_tally_graph_launch(t, record, c)
    lib.gc_tally_publish(t, 0)
    lib.gc_segment_end_update(seg)


def test_graph_launches_count_their_learned_contents_exactly(census, records):
    """Per-launch mode: each GRAPH_TRACE record adds what its graph holds: every kernel node, every copy
    node's bytes by direction and host memory kind, every memset node; kernel time and busy are the
    graph's span; copies inside a graph have no duration of their own."""
    seg, _, _, ffi = census
    c = contents(ffi, kernels=100, copies=[("dtoh", "pinned", MiB), ("dtoh", "pinned", 3), ("htod", "pinned", 4096)],
                 memsets=[512])
    spans = [(T0 + i * 2 * W, T0 + i * 2 * W + 7000) for i in range(3)]
    for i, (s, e) in enumerate(spans):
        launch(census, records.graph_trace(s, e, corr=20 + i), c)
    d = seg.devices[0]
    assert (d.graph_launches, d.kernel_count, d.graph_kernel_count) == (3, 300, 300)
    assert d.kernel_ns == d.graph_ns == d.busy_ns == 3 * 7000
    dtoh = d.copy[DIR["dtoh"]][MEM["pinned"]]
    assert (dtoh.count, dtoh.bytes, dtoh.ns) == (6, 3 * (MiB + 3), 0)
    htod = d.copy[DIR["htod"]][MEM["pinned"]]
    assert (htod.count, htod.bytes) == (3, 3 * 4096)
    assert (d.memset.count, d.memset.bytes) == (3, 3 * 512)
    assert seg.graph_unknown == seg.graph_inexact == 0 and not seg.flags & 0x10
    # the windows: each launch in the bucket it started in, its copies counted there too
    idx = {seg.windows[i].index: seg.windows[i] for i in range(2048) if seg.windows[i].index}
    for s, _ in spans:
        w = idx[s // W]
        assert (w.kernel_count, w.kernel_ns) == (100, 7000)
        assert (w.copy[DIR["dtoh"]].count, w.copy[DIR["dtoh"]].bytes) == (2, MiB + 3)
        assert (w.memset.count, w.memset.bytes) == (1, 512)


def test_graph_of_copies_alone_has_no_kernel_time_and_inexact_graphs_are_counted(census, records):
    seg, _, _, ffi = census
    launch(census, records.graph_trace(T0, T0 + 5000, corr=3), contents(ffi, copies=[("dtod", "device", 64)]))
    d = seg.devices[0]
    assert (d.kernel_count, d.kernel_ns, d.busy_ns, d.graph_ns) == (0, 0, 0, 5000)
    assert d.copy[DIR["dtod"]][MEM["device"]].bytes == 64
    launch(census, records.graph_trace(T0 + W, T0 + W + 10, corr=4), contents(ffi, kernels=2, inexact=True))
    assert (seg.graph_inexact, seg.graph_unknown, d.kernel_count) == (1, 0, 2)
    assert seg.flags & 0x10


def test_graph_launches_land_in_the_step_that_launched_them(census, records):
    """The launch's correlation id names its step (here through EXTERNAL_CORRELATION records, as the CPU
    tests feed steps); all of the graph's kernels and copies are that step's."""
    seg, _, _, ffi = census
    feed(census, records.external(30, 7), records.external(31, 8))
    c = contents(ffi, kernels=40, copies=[("dtoh", "pinned", 1000)])
    launch(census, records.graph_trace(T0, T0 + 900, corr=30), c)
    launch(census, records.graph_trace(T0 + 1000, T0 + 1500, corr=31), c)
    launch(census, records.graph_trace(T0 + 2000, T0 + 2100, corr=32), c)  # launched outside any step
    s7, s8 = seg.steps[7], seg.steps[8]
    assert (s7.id, s7.kernel_count, s7.kernel_ns, s7.copy[DIR["dtoh"]].bytes) == (7, 40, 900, 1000)
    assert (s8.id, s8.kernel_count, s8.kernel_ns, s8.copy[DIR["dtoh"]].count) == (8, 40, 500, 1)
    # one unmatched launch: its kernels and its copy kind each miss a step
    assert seg.step_unmatched == 2


COPY_KINDS = [
    # copyKind, src, dst, expected direction, expected host memory kind
    ("htod", "pageable", "device", "htod", "pageable"),
    ("htod", "pinned", "device", "htod", "pinned"),
    ("htoa", "pinned", "array", "htod", "pinned"),
    ("dtoh", "device", "pageable", "dtoh", "pageable"),
    ("dtoh", "device", "pinned", "dtoh", "pinned"),
    ("atoh", "array", "pageable", "dtoh", "pageable"),
    ("dtod", "device", "device", "dtod", "device"),
    ("atoa", "array", "array", "dtod", "device"),
    ("atod", "array", "device", "dtod", "device"),
    ("dtoa", "device", "array", "dtod", "device"),
    ("htoh", "pageable", "pinned", "htoh", "pageable"),
    ("htod", "managed", "device", "htod", "other"),
    ("dtoh", "device", "unknown", "dtoh", "other"),
    ("unknown", "pinned", "device", "other", "pinned"),
]


@pytest.mark.parametrize("kind,src,dst,direction,mem", COPY_KINDS)
def test_every_copy_kind_and_memory_kind(census, records, kind, src, dst, direction, mem):
    seg = census[0]
    feed(census, records.memcpy(kind, 3 * MiB + 7, T0, T0 + 1234, src=src, dst=dst),
         records.memcpy(kind, 5, T0 + 2000, T0 + 2010, src=src, dst=dst))
    st = seg.devices[0].copy[DIR[direction]][MEM[mem]]
    assert (st.count, st.bytes, st.ns) == (2, 3 * MiB + 12, 1244)
    total = sum(seg.devices[0].copy[d][m].bytes for d in range(6) for m in range(4))
    assert total == 3 * MiB + 12  # nothing counted anywhere else


def test_peer_copies_count_on_both_devices(census, records):
    seg = census[0]
    feed(census, records.peer(64 * MiB, T0, T0 + 10_000, src_device=0, dst_device=1),
         records.peer(MiB, T0 + 20_000, T0 + 21_000, src_device=1, dst_device=0))
    d0, d1 = seg.devices[0], seg.devices[1]
    assert d0.copy[DIR["ptop"]][MEM["device"]].bytes == 64 * MiB and d1.peer_recv.bytes == 64 * MiB
    assert d1.copy[DIR["ptop"]][MEM["device"]].bytes == MiB and d0.peer_recv.bytes == MiB
    assert d0.in_use and d1.in_use and d1.device_id == 1


def test_memsets(census, records):
    seg = census[0]
    feed(census, records.memset(8 * MiB, T0, T0 + 300), records.memset(1, T0 + 400, T0 + 410, device=2))
    assert (seg.devices[0].memset.count, seg.devices[0].memset.bytes, seg.devices[0].memset.ns) == (1, 8 * MiB, 300)
    assert seg.devices[2].memset.bytes == 1


def test_devices_are_kept_apart_and_unknown_kinds_counted(census, records):
    seg = census[0]
    feed(census, records.kernel(T0, T0 + 10, device=0), records.kernel(T0, T0 + 20, device=3),
         records.kernel(T0, T0 + 30, device=99), records.other("NAME"), records.other("DRIVER"))
    assert seg.devices[0].kernel_ns == 10 and seg.devices[3].kernel_ns == 20
    assert seg.records == 5 and seg.records_unknown == 3  # device 99 is out of range, plus two kinds


def test_steps_by_external_correlation(census, records):
    seg = census[0]
    feed(census,
         records.external(corr=100, external_id=7), records.external(corr=101, external_id=7),
         records.external(corr=102, external_id=8),
         records.external(corr=103, external_id=9, custom=0),  # torch/kineto's kind: not ours
         records.kernel(T0, T0 + 100, corr=100), records.kernel(T0 + 100, T0 + 300, corr=101),
         records.memcpy("dtoh", 4096, T0 + 300, T0 + 350, dst="pageable", corr=101),
         records.kernel(T0 + 400, T0 + 450, corr=102),
         records.kernel(T0 + 500, T0 + 600, corr=103),
         records.memset(64, T0 + 700, T0 + 710, corr=102))
    s7, s8 = seg.steps[7], seg.steps[8]
    assert (s7.id, s7.kernel_count, s7.kernel_ns, s7.copy[1].bytes, s7.copy[1].count) == (7, 2, 300, 4096, 1)
    assert (s7.first_ns, s7.last_ns) == (T0, T0 + 350)
    assert (s8.id, s8.kernel_count, s8.memset.bytes) == (8, 1, 64)
    assert seg.steps[9].id == 0 and seg.step_unmatched == 1 and seg.step_max == 8
    # device totals still hold everything
    assert seg.devices[0].kernel_count == 4


def test_step_ring_reuses_slots_for_newer_ids_only(census, records):
    seg = census[0]
    slots = 1024  # GC_STEP_SLOTS
    feed(census, records.external(1, 5), records.kernel(T0, T0 + 1, corr=1),
         records.external(2, 5 + slots), records.kernel(T0 + 2, T0 + 3, corr=2),
         records.external(3, 5), records.kernel(T0 + 4, T0 + 5, corr=3))  # old id after its slot moved on
    assert seg.steps[5].id == 5 + slots and seg.steps[5].kernel_count == 1
    assert seg.flags & 0x4


def test_windows_hold_activity_by_start_time_and_split_durations(census, records):
    seg = census[0]
    b = (T0 // W + 10) * W  # a bucket boundary
    feed(census,
         records.kernel(b + 1000, b + 2000),                     # inside bucket b
         records.kernel(b + W - 500, b + W + 1500),              # spans into b+1
         records.memcpy("htod", 1000, b + 2 * W - 100, b + 4 * W + 100, src="pinned"),  # spans 3 buckets
         records.memset(10, b + 5, b + 15))
    wins = {w.index: w for w in seg.windows if w.index}
    i = b // W
    assert wins[i].kernel_count == 2 and wins[i].kernel_ns == 1000 + 500
    assert wins[i + 1].kernel_count == 0 and wins[i + 1].kernel_ns == 1500
    assert wins[i + 1].copy[0].count == 1 and wins[i + 1].copy[0].bytes == 1000 and wins[i + 1].copy[0].ns == 100
    assert wins[i + 2].copy[0].ns == W and wins[i + 3].copy[0].ns == W and wins[i + 4].copy[0].ns == 100
    assert sum(w.copy[0].ns for w in wins.values()) == seg.devices[0].copy[0][1].ns
    assert sum(w.kernel_ns for w in wins.values()) == seg.devices[0].kernel_ns
    assert wins[i].memset.bytes == 10 and wins[i].device_mask == 1


def test_records_older_than_the_window_ring_are_counted_late(census, records):
    seg = census[0]
    b = (T0 // W) * W
    feed(census, records.kernel(b + 2048 * W + 5, b + 2048 * W + 10))  # same slot, 2048 buckets later
    feed(census, records.kernel(b + 5, b + 10))                        # its slot now holds a newer bucket
    assert seg.window_late == 1 and seg.devices[0].kernel_count == 2


def test_segment_identity(native):
    ffi, lib, _ = native
    seg = ffi.new("gc_segment *")
    lib.gc_segment_init(seg, b"llama-server", 0, 12345)
    import os
    assert seg.magic == 0x53534E4355504743 and seg.layout_version == 5
    assert seg.segment_size == ffi.sizeof("gc_segment") and seg.pid == os.getpid() and seg.ppid == os.getppid()
    assert ffi.string(seg.comm) == b"llama-server" and seg.clock_ref_gpu_ns == 12345
    assert seg.state == 1 and seg.window_ns_div == W // 1000
    start_ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
    assert seg.proc_start_ticks == start_ticks


def counted(seg):
    seg.collector = _native.consts.GC_COLLECTOR_DEFAULT


def test_counted_kernels_take_counts_from_launches_and_time_from_the_sample(census, records):
    """The default collector: the launches counted at the calls are the kernel counts (device, window, step); an
    eager kernel's timing adds its time and the sample (eager_traced), never a second count."""
    seg, t, lib, _ = census
    counted(seg)
    MS = 1_000_000
    lib.gc_segment_begin_update(seg)
    lib.gc_tally_launches_device(t, 0, 500)
    lib.gc_tally_launches_window(t, T0 + 5 * MS, 300)
    lib.gc_tally_launches_window(t, T0 + 500 * MS, 200)
    lib.gc_tally_launches_step(t, 9, 0, 120)
    lib.gc_segment_end_update(seg)
    traced = [T0 + i * 1000 for i in range(30)]
    feed(census, *[records.kernel(s, s + 400, corr=i + 1) for i, s in enumerate(traced)],
         records.kernel(T0 + 500 * MS, T0 + 500 * MS + 400))
    d = seg.devices[0]
    assert (d.kernel_count, d.eager_launches, d.eager_traced) == (500, 500, 31)
    assert d.kernel_ns == d.eager_traced_ns == d.busy_ns == 31 * 400
    w = {seg.windows[i].index: seg.windows[i] for i in range(2048) if seg.windows[i].index}
    first, later = w[T0 // W], w[(T0 + 500 * MS) // W]
    assert (first.kernel_count, first.eager_launches, first.eager_traced, first.eager_traced_ns) == (300, 300, 30, 12_000)
    assert (later.kernel_count, later.eager_launches, later.eager_traced) == (200, 200, 1)
    s = seg.steps[9]
    assert (s.id, s.kernel_count, s.eager_launches, s.device_mask) == (9, 120, 120, 1)


def test_counted_kernels_count_every_graph_launch(census, records):
    """Under the default collector every graph launch counts its kernels and span, and a measured span joins busy."""
    seg, _, _, ffi = census
    counted(seg)
    c = contents(ffi, kernels=10, copies=[("dtoh", "pinned", 77)])
    launch(census, records.graph_trace(T0 + 10 * 1_000_000, T0 + 11 * 1_000_000, corr=1), c)    # traced
    launch(census, records.graph_trace(T0 + 500 * 1_000_000, T0 + 501 * 1_000_000, corr=2), c)  # not
    d = seg.devices[0]
    assert (d.kernel_count, d.graph_kernel_count, d.kernel_ns) == (20, 20, 2_000_000)
    assert d.busy_ns == 2_000_000 and d.eager_traced == d.eager_launches == 0


def test_launches_of_no_device_or_a_reused_step_slot_are_lost_not_misplaced(census, records):
    seg, t, lib, _ = census
    counted(seg)
    lib.gc_segment_begin_update(seg)
    lib.gc_tally_launches_device(t, 99, 4)                 # past GC_MAX_DEVICES
    lib.gc_tally_launches_step(t, 1030, 0, 5)              # slot 6
    lib.gc_tally_launches_step(t, 6, 0, 3)                 # slot 6 again, an older step: refused
    lib.gc_tally_launches_step(t, 0, 0, 2)                 # no step
    lib.gc_segment_end_update(seg)
    assert seg.launches_lost == 4 + 3 + 2 and seg.steps[6].id == 1030 and seg.steps[6].eager_launches == 5


def test_eager_records_fill_the_sample_in_every_mode(census, records):
    """ALL: eager records count as before and also fill eager_traced (graph kernels do not)."""
    seg, _, _, ffi = census
    feed(census, *[records.kernel(T0 + i * 100, T0 + i * 100 + 50) for i in range(4)])
    launch(census, records.graph_trace(T0 + 5000, T0 + 6000, corr=9), contents(ffi, kernels=3))
    d = seg.devices[0]
    assert (d.kernel_count, d.eager_traced, d.eager_traced_ns, d.eager_launches) == (7, 4, 200, 0)
