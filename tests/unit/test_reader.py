"""The segment round trip: the C tally writes real CUPTI records into a segment, the reader reads it."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from otel_gpu_census._native import LAYOUT_VERSION, SEGMENT_SIZE
from otel_gpu_census.census import FLAG_GRAPH_LAUNCHES, STATE_EXITED, Stat, folder, proctree, reader

MS = 1_000_000
WINDOW = 20 * MS
T0 = 5_000 * WINDOW          # a CUPTI timestamp well away from zero (bucket 5000)


def test_overlapping_kernels_count_each_and_busy_once(census_dir, segments, records):
    # two streams overlap for 1 ms; a third kernel later on another device
    recs = [records.kernel(T0, T0 + 2 * MS, stream=1), records.kernel(T0 + 1 * MS, T0 + 4 * MS, stream=2),
            records.kernel(T0 + 10 * MS, T0 + 11 * MS, device=1)]
    c = reader.read_segment(segments.segment(census_dir, recs))
    d0, d1 = c.devices[0], c.devices[1]
    assert (d0.kernel_count, d0.kernel_ns, d0.busy_ns) == (2, 5 * MS, 4 * MS)
    assert (d0.first_ns, d0.last_ns) == (T0, T0 + 4 * MS)
    assert (d1.kernel_count, d1.kernel_ns, d1.busy_ns) == (1, MS, MS)
    assert c.records == 3 and c.state == STATE_EXITED and c.state_name == "exited"
    assert c.last_gpu_ns == T0 + 11 * MS


def test_every_copy_direction_and_host_memory_kind(census_dir, segments, records):
    copies = [  # (copyKind, bytes, src, dst, expected direction, expected host memory)
        ("htod", 1_000_003, "pageable", "device", "htod", "pageable"),
        ("htod", 2_000_000, "pinned", "device", "htod", "pinned"),
        ("dtoh", 3_000_001, "device", "pageable", "dtoh", "pageable"),
        ("dtoh", 4_000_000, "device", "pinned", "dtoh", "pinned"),
        ("dtoh", 5, "device", "managed", "dtoh", "other"),
        ("dtod", 6_000_000, "device", "device", "dtod", "device"),
        ("htoh", 7_000, "pinned", "pageable", "htoh", "pinned"),
    ]
    recs = [records.memcpy(k, n, T0 + i * MS, T0 + i * MS + 100 + i, src=s, dst=d)
            for i, (k, n, s, d, _, _) in enumerate(copies)]
    recs.append(records.peer(8_000_000, T0 + 20 * MS, T0 + 21 * MS, src_device=0, dst_device=1))
    recs.append(records.memset(4096, T0 + 30 * MS, T0 + 30 * MS + 50))
    recs.append(records.memset(4096, T0 + 31 * MS, T0 + 31 * MS + 70))
    c = reader.read_segment(segments.segment(census_dir, recs))
    d = c.devices[0]
    for i, (_, n, _, _, direction, mem) in enumerate(copies):
        assert d.copies.get(direction, mem) == Stat(1, n, 100 + i), (direction, mem)
    dtoh = [(n, 100 + i) for i, (_, n, _, _, direction, _) in enumerate(copies) if direction == "dtoh"]
    assert d.copies.get("dtoh") == Stat(3, sum(n for n, _ in dtoh), sum(ns for _, ns in dtoh))
    assert d.copies.get("ptop") == Stat(1, 8_000_000, MS)
    assert d.memset == Stat(2, 8192, 120)
    assert d.copies.total().bytes == sum(n for _, n, *_ in copies) + 8_000_000
    # the receiving side of the peer copy: received there, not a copy that device made
    assert c.devices[1].peer_recv == Stat(1, 8_000_000, MS) and d.peer_recv == Stat()
    assert c.devices[1].copies.total() == Stat()


def test_peer_copies_both_ways_add_up_per_device_and_per_process(census_dir, segments, records):
    recs = [records.peer(64 * MS, T0, T0 + MS, src_device=0, dst_device=1),
            records.peer(5, T0 + 2 * MS, T0 + 2 * MS + 10, src_device=1, dst_device=0),
            records.peer(7, T0 + 3 * MS, T0 + 3 * MS + 20, src_device=0, dst_device=1)]
    c = reader.read_segment(segments.segment(census_dir, recs))
    d0, d1 = c.devices[0], c.devices[1]
    assert d0.copies.get("ptop") == Stat(2, 64 * MS + 7, MS + 20) and d0.peer_recv == Stat(1, 5, 10)
    assert d1.copies.get("ptop") == Stat(1, 5, 10) and d1.peer_recv == Stat(2, 64 * MS + 7, MS + 20)
    total = c.totals()
    # every peer copy is sent once and received once
    assert total.copies.get("ptop") == total.peer_recv == Stat(3, 64 * MS + 12, MS + 30)
    assert (d1 - d1).peer_recv == Stat()


def test_graph_launches_and_unknown_records(census_dir, segments, records):
    recs = [records.graph_trace(T0, T0 + 3 * MS), records.graph_trace(T0 + 5 * MS, T0 + 6 * MS),
            records.other("NAME")]
    c = reader.read_segment(segments.segment(census_dir, recs))
    d = c.devices[0]
    assert (d.graph_launches, d.graph_ns, d.busy_ns, d.kernel_count) == (2, 4 * MS, 4 * MS, 0)
    assert c.flags & FLAG_GRAPH_LAUNCHES
    assert (c.records, c.records_unknown) == (3, 1)


def test_windows_sorted_with_empty_slots_skipped(census_dir, segments, records):
    buckets = [5007, 5003, 5005]
    recs = [records.kernel(b * WINDOW + MS, b * WINDOW + 3 * MS) for b in buckets]
    recs.append(records.memcpy("dtoh", 999, 5005 * WINDOW + 5 * MS, 5005 * WINDOW + 6 * MS, dst="pinned"))
    c = reader.read_segment(segments.segment(census_dir, recs))
    assert [w.start_ns // WINDOW for w in c.windows] == sorted(buckets)
    assert all(w.end_ns - w.start_ns == WINDOW for w in c.windows)
    w5 = c.windows[1]
    assert (w5.kernel_count, w5.kernel_ns) == (1, 2 * MS)
    assert w5.copies == {"dtoh": Stat(1, 999, MS)}      # absent directions are zero
    assert c.windows_between(5004 * WINDOW, 5006 * WINDOW) == [w5]


def test_steps_keyed_by_external_id(census_dir, segments, records):
    recs = [records.external(corr=11, external_id=42), records.external(corr=12, external_id=43),
            records.kernel(T0, T0 + MS, corr=11), records.kernel(T0 + MS, T0 + 3 * MS, corr=11),
            records.memcpy("dtoh", 777, T0 + 4 * MS, T0 + 5 * MS, dst="pageable", corr=12),
            records.kernel(T0 + 6 * MS, T0 + 7 * MS, corr=99)]       # launched outside any step
    c = reader.read_segment(segments.segment(census_dir, recs))
    assert sorted(c.steps) == [42, 43]
    assert (c.steps[42].kernel_count, c.steps[42].kernel_ns) == (2, 3 * MS)
    assert (c.steps[42].first_ns, c.steps[42].last_ns) == (T0, T0 + 3 * MS)
    assert c.steps[43].copies == {"dtoh": Stat(1, 777, MS)}
    assert (c.step_max, c.step_unmatched) == (43, 1)


def test_read_steps_gives_the_steps_of_an_id_range(census_dir, segments, records):
    recs = []
    for sid in (5, 6, 7, 9):
        recs += [records.external(corr=100 + sid, external_id=sid),
                 records.kernel(T0 + sid * MS, T0 + sid * MS + 1000 * sid, corr=100 + sid)]
    path = segments.segment(census_dir, recs)
    full = reader.read_segment(path).steps
    assert [s.id for s in reader.read_steps(path, 6, 9)] == [6, 7]          # [lo, hi): 9 is out
    assert reader.read_steps(path, 0, 2**64) == [full[k] for k in sorted(full)]
    assert reader.read_steps(path, 6, 7)[0].kernel_ns == 6000
    assert reader.read_steps(path, 10, 20) == [] and reader.read_steps(path, 7, 7) == []


def test_rings_read_as_rows_match_the_struct_fields(census_dir, segments, records):
    """The window and step rings are read as rows of integers; every field must land where the
    header's struct puts it (read here field by field through cffi)."""
    from otel_gpu_census._native import ffi
    from otel_gpu_census.census import DIRECTIONS
    recs = [records.external(corr=3, external_id=77)]
    for k in range(6):
        t = T0 + k * WINDOW
        recs += [records.kernel(t, t + MS + k, corr=3), records.memset(64 + k, t + 2 * MS, t + 3 * MS, corr=3),
                 records.memcpy(("dtoh", "htod", "dtod")[k % 3], 1000 + k, t, t + 5000 + k, corr=3)]
    path = segments.segment(census_dir, recs)
    c = reader.read_segment(path)
    data = path.read_bytes()            # held: the cast pointer does not keep the bytes alive
    seg = ffi.cast("gc_segment *", ffi.from_buffer(data))

    def stat(x):
        return Stat(x.count, x.bytes, x.ns)

    def copies(arr):
        return {d: stat(arr[i]) for i, d in enumerate(DIRECTIONS) if arr[i].count or arr[i].ns}
    win_ns = seg.window_ns_div * 1000
    want = sorted(((w.index * win_ns, (w.index + 1) * win_ns, w.kernel_count, w.kernel_ns, copies(w.copy),
                    stat(w.memset), w.device_mask, w.eager_launches, w.eager_traced, w.eager_traced_ns)
                   for w in seg.windows if w.index))
    got = [(w.start_ns, w.end_ns, w.kernel_count, w.kernel_ns, w.copies, w.memset, w.device_mask, w.eager_launches,
            w.eager_traced, w.eager_traced_ns) for w in c.windows]
    assert got == want and len(got) == 6 and all(w[4] for w in got)
    assert [(w[8], w[9]) for w in got] == [(1, MS + k) for k in range(6)]     # eager kernel records (ALL)
    (s,) = [s for s in seg.steps if s.id]
    st = c.steps[77]
    assert (st.kernel_count, st.kernel_ns, st.first_ns, st.last_ns, st.copies, st.memset, st.device_mask,
            st.eager_launches, st.eager_traced, st.eager_traced_ns) == (
        s.kernel_count, s.kernel_ns, s.first_ns, s.last_ns, copies(s.copy), stat(s.memset), s.device_mask,
        s.eager_launches, s.eager_traced, s.eager_traced_ns)
    assert st.kernel_count == 6 and st.memset.count == 6 and len(st.copies) == 3
    assert (st.eager_launches, st.eager_traced, st.eager_traced_ns) == (0, 6, 6 * MS + 15)


def test_identity_fields(census_dir, segments):
    path = segments.segment(census_dir, [], comm="llama-server", gpu_ref_ns=123_456_789)
    c = reader.read_segment(path)
    assert (c.pid, c.ppid, c.comm) == (os.getpid(), os.getppid(), "llama-server")
    assert c.proc_start_ticks == proctree.proc_start_ticks(os.getpid())
    assert c.alive and not c.torn and c.path == str(path)
    assert c.clock_ref_gpu_ns == 123_456_789
    assert c.gpu_to_wall_ns(123_456_789 + 5) == c.clock_ref_wall_ns + 5
    assert abs(c.wall_start_ns - time.time_ns()) < 60 * 10**9
    assert c.devices == {} and c.windows == [] and c.steps == {}


def test_uuid_formatted_like_nvidia_smi(census_dir, segments, records):
    raw = bytes.fromhex("8c1f3a2b4d5e6f708192a3b4c5d6e7f8")

    def set_uuid(seg):
        seg.devices[0].uuid = list(raw)
    c = reader.read_segment(segments.segment(census_dir, [records.kernel(T0, T0 + 1)], edit=set_uuid))
    assert c.devices[0].uuid == "GPU-8c1f3a2b-4d5e-6f70-8192-a3b4c5d6e7f8"
    assert reader.format_uuid(bytes(16)) == ""


# ---- liveness, torn copies -----------------------------------------------------------------

def test_alive_needs_same_pid_and_start_time(census_dir, segments, dead_pid):
    me = reader.read_segment(segments.segment(census_dir, []))
    assert me.alive
    other_start = reader.read_segment(segments.segment(census_dir, [], start_ticks=me.proc_start_ticks + 1))
    assert not other_start.alive          # our pid, but a different process once had it
    dead = reader.read_segment(segments.segment(census_dir, [], pid=dead_pid))
    assert not dead.alive


def test_odd_seq_of_dead_writer_is_read_and_marked_torn(census_dir, segments, records, dead_pid, monkeypatch):
    monkeypatch.setattr(reader, "READ_TRIES", 3)

    def die_mid_update(seg):
        segments.lib.gc_segment_begin_update(seg)
        seg.records = 77
    path = segments.segment(census_dir, [records.kernel(T0, T0 + MS)], pid=dead_pid, edit=die_mid_update)
    c = reader.read_segment(path)
    assert c.torn and not c.alive
    assert c.records == 77 and c.devices[0].kernel_count == 1


_WRITER = r"""
import mmap, os, sys, time
sys.path[:0] = [sys.argv[2], sys.argv[2] + "/../../src"]
import cupti_records
import segments
ffi, lib, _ = cupti_records.native()
m, seg = segments.open_segment(sys.argv[1])
seg.steps[1023].id = 1023
print("ready", flush=True)
i = 0
end = time.time() + float(sys.argv[3])
while time.time() < end:
    i += 1
    lib.gc_segment_begin_update(seg)
    seg.records = i                      # header ...
    seg.steps[1023].kernel_count = i     # ... and the last bytes of the segment: a torn copy differs
    lib.gc_segment_end_update(seg)
    time.sleep(0.0003)                   # updates far more often than CUPTI's ~1 s, yet with gaps
"""


def test_reader_never_sees_a_half_update_of_a_live_writer(census_dir, segments):
    path = segments.segment(census_dir, [])
    tests_dir = str(Path(__file__).resolve().parents[1] / "support")
    w = subprocess.Popen([sys.executable, "-c", _WRITER, str(path), tests_dir, "3"], stdout=subprocess.PIPE, text=True)
    try:
        assert w.stdout.readline().strip() == "ready"
        seen = set()
        for _ in range(200):
            c = reader.read_segment(path)
            assert not c.torn
            assert c.steps[1023].kernel_count == c.records
            seen.add(c.records)
        assert len(seen) > 10, "the writer did not run while reading"
    finally:
        w.kill()
        w.wait()


# ---- what is not a segment ------------------------------------------------------------------

def _bad(census_dir, segments, name, edit=None, cut=None):
    path = segments.segment(census_dir, [], edit=edit)
    data = path.read_bytes()
    target = census_dir / name
    path.rename(target)
    if cut is not None:
        target.write_bytes(data[:cut])
    with pytest.raises(reader.SegmentError) as e:
        reader.read_segment(target)
    assert e.value.path == str(target) and str(target) in str(e.value)
    return e.value.reason


def test_wrong_magic(census_dir, segments):
    def corrupt(seg):
        seg.magic = 0x1122334455667788
    assert "wrong magic" in _bad(census_dir, segments, "gpu-census-1-1.seg", edit=corrupt)


def test_other_layout_version(census_dir, segments):
    def newer(seg):
        seg.layout_version = LAYOUT_VERSION + 1
    reason = _bad(census_dir, segments, "gpu-census-1-1.seg", edit=newer)
    assert f"layout version {LAYOUT_VERSION + 1}" in reason and f"reads version {LAYOUT_VERSION}" in reason


def test_wrong_segment_size(census_dir, segments):
    def resized(seg):
        seg.segment_size = SEGMENT_SIZE - 8
    assert "segment_size" in _bad(census_dir, segments, "gpu-census-1-1.seg", edit=resized)


@pytest.mark.parametrize("cut", [0, 7, 4096, SEGMENT_SIZE - 1])
def test_truncated(census_dir, segments, cut):
    assert "truncated" in _bad(census_dir, segments, "gpu-census-1-1.seg", cut=cut)


def test_unpublished_segment(census_dir, segments):
    def unpublished(seg):
        seg.magic = 0
    assert "not initialised" in _bad(census_dir, segments, "gpu-census-1-1.seg", edit=unpublished)


@pytest.mark.parametrize("detail", [True, False])
def test_truncated_while_being_read_is_refused(census_dir, segments, monkeypatch, detail):
    """The file shrinks between the reader's size check and its copy: a SegmentError (a mapping
    would have died of SIGBUS here)."""
    path = segments.segment(census_dir, [])
    real_preadv = os.preadv

    def truncate_first(fd, buffers, offset):
        os.truncate(path, 4096)
        return real_preadv(fd, buffers, offset)
    monkeypatch.setattr(os, "preadv", truncate_first)
    with pytest.raises(reader.SegmentError, match="truncated while being read"):
        reader.read_segment(path, detail=detail)


def test_not_a_regular_file_or_missing(census_dir):
    (census_dir / "gpu-census-1-1.seg").mkdir()
    with pytest.raises(reader.SegmentError, match="not a regular file|cannot open"):
        reader.read_segment(census_dir / "gpu-census-1-1.seg")
    with pytest.raises(reader.SegmentError, match="cannot open"):
        reader.read_segment(census_dir / "gpu-census-2-2.seg")


# ---- folders of segments ----------------------------------------------------------------

def test_scan_returns_good_segments_and_reports_bad_ones(census_dir, segments, records, dead_pid):
    def unpublished(seg):
        seg.magic = 0
    # a live process (our parent) still creating its segment is not an error
    parent = os.getppid()
    segments.segment(census_dir, [], edit=unpublished).rename(
        census_dir / f"gpu-census-{parent}-{proctree.proc_start_ticks(parent)}.seg")
    good = segments.segment(census_dir, [records.kernel(T0, T0 + MS)])
    (census_dir / f"gpu-census-{dead_pid}-9.seg").write_bytes(b"\x00" * 100)
    (census_dir / "notes.txt").write_text("not a segment")
    procs, errors = reader.scan(census_dir)
    assert [p.path for p in procs] == [str(good)]
    assert [Path(e.path).name for e in errors] == [f"gpu-census-{dead_pid}-9.seg"]
    assert "truncated" in errors[0].reason


def _census(segments, census_dir, pid, ppid, ticks=10**9):
    return reader.read_segment(segments.segment(census_dir, [], pid=pid, ppid=ppid, start_ticks=ticks))


def test_process_tree_follows_ppid_chains(census_dir, segments):
    cs = [_census(segments, census_dir, pid, ppid) for pid, ppid in
          [(100, 1), (101, 100), (102, 101), (200, 1), (103, 150), (300, 301), (301, 300)]]
    tree = proctree.process_tree(100, cs)
    assert sorted(c.pid for c in tree) == [100, 101, 102]
    # 150 wrote no segment (a shell): a parents map bridges it
    tree = proctree.process_tree(100, cs, parents={150: 100})
    assert sorted(c.pid for c in tree) == [100, 101, 102, 103]
    # a loop in the links ends rather than spinning
    assert proctree.process_tree(999, cs) == []
    # the root need not have a segment of its own
    assert sorted(c.pid for c in proctree.process_tree(101, cs)) == [101, 102]


def test_process_tree_ignores_processes_older_than_the_root(census_dir, segments):
    old = _census(segments, census_dir, 500, 400, ticks=50)     # pid 400 reused: 500 predates the root
    young = _census(segments, census_dir, 501, 400, ticks=200)
    tree = proctree.process_tree(400, [old, young], root_start_ticks=100)
    assert [c.pid for c in tree] == [501]


def test_cleanup_removes_only_old_segments_of_dead_processes(census_dir, segments, dead_pid):
    now = time.time()
    hour_ago = now - 3600

    def stale(seg):
        seg.wall_update_ns = int(hour_ago * 1e9)
        seg.wall_start_ns = seg.wall_update_ns
    dead_old = segments.segment(census_dir, [], pid=dead_pid, edit=stale)
    dead_new = segments.segment(census_dir, [], pid=dead_pid, start_ticks=1)
    live_old = segments.segment(census_dir, [], edit=stale)
    corrupt_dead = census_dir / f"gpu-census-{dead_pid}-7.seg"
    corrupt_dead.write_bytes(b"junk")
    corrupt_unknown = census_dir / "gpu-census-junk.seg"
    corrupt_unknown.write_bytes(b"junk")
    for p in (dead_old, live_old, corrupt_dead, corrupt_unknown):
        os.utime(p, (hour_ago, hour_ago))
    removed = folder.cleanup(census_dir, older_than_s=600, now=now)
    assert sorted(removed) == sorted([dead_old, corrupt_dead])
    assert dead_new.exists() and live_old.exists() and corrupt_unknown.exists()


# ---- the census folder ------------------------------------------------------------------

@pytest.fixture
def clean_env(monkeypatch):
    for v in ("OTEL_GPU_CENSUS_DIR", "XDG_RUNTIME_DIR"):
        monkeypatch.delenv(v, raising=False)
    return monkeypatch


def test_default_dir_order(clean_env, tmp_path):
    assert folder.default_census_dir() == Path(f"/tmp/otel-gpu-census-{os.getuid()}")
    clean_env.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert folder.default_census_dir() == tmp_path / "otel-gpu-census"
    clean_env.setenv("OTEL_GPU_CENSUS_DIR", str(tmp_path / "x"))
    assert folder.default_census_dir() == tmp_path / "x"


def test_census_dir_is_created_private(clean_env, tmp_path):
    clean_env.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    old = os.umask(0o022)
    try:
        d = folder.census_dir()
    finally:
        os.umask(old)
    assert d == tmp_path / "otel-gpu-census" and d.is_dir()
    assert d.stat().st_mode & 0o777 == 0o700


def test_census_dir_refuses_shared_folders(tmp_path, monkeypatch):
    d = tmp_path / "shared"
    d.mkdir()
    d.chmod(0o777)
    with pytest.raises(folder.CensusDirError, match="writable by group or others"):
        folder.census_dir(d)
    d.chmod(0o700)
    assert folder.census_dir(d) == d
    monkeypatch.setattr(os, "getuid", lambda: os.stat(d).st_uid + 1)
    with pytest.raises(folder.CensusDirError, match="belongs to uid"):
        folder.census_dir(d)


def test_census_dir_not_a_folder_or_not_creatable(tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(folder.CensusDirError, match="not a folder"):
        folder.census_dir(f)
    with pytest.raises(folder.CensusDirError, match="cannot create"):
        folder.census_dir(f / "sub")


def test_readable_dir_accepts_others_but_needs_existence(tmp_path):
    with pytest.raises(folder.CensusDirError, match="does not exist"):
        folder.readable_dir(tmp_path / "missing")
    d = tmp_path / "open"
    d.mkdir()
    d.chmod(0o777)
    assert folder.readable_dir(d) == d


def test_totals_only_read_matches_the_full_read(census_dir, segments, records):
    recs = [records.external(corr=5, external_id=9), records.kernel(T0, T0 + 2 * MS, corr=5),
            records.memcpy("htod", 4096, T0 + 3 * MS, T0 + 4 * MS, src="pageable", corr=5),
            records.kernel(T0 + MS, T0 + 5 * MS, device=2)]
    path = segments.segment(census_dir, recs, comm="engine")
    full, head = reader.read_segment(path), reader.read_segment(path, detail=False)
    assert head.windows == [] and head.steps == {}
    assert full.windows and full.steps
    assert dataclasses.replace(full, windows=[], steps={}) == head
    procs, errors = reader.scan(census_dir, detail=False)
    assert procs == [head] and errors == []


def test_totals_only_read_still_refuses_bad_files(census_dir, segments):
    path = segments.segment(census_dir, [])
    path.write_bytes(path.read_bytes()[:reader.TOTALS_SIZE])      # long enough for the head, yet truncated
    with pytest.raises(reader.SegmentError, match="truncated"):
        reader.read_segment(path, detail=False)
