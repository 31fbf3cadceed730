"""Segment consistency under a live writer, after a writer crash, and for damaged files.

A writer process maps a real segment and tallies real CUPTI records through the native library,
as the injector's buffer thread does, in batches of a fixed make-up: per batch one kernel-less
"unknown" record, 8 launches (4 kernels, an HtoD, a DtoH and a DtoD copy, a memset), each with its
external-correlation record naming the batch as its step. So every consistent read satisfies exact
relations (records = 17 x batches, kernels = 4 x batches, bytes per direction = fixed x batches,
windows summing to the device totals, every step in the ring complete); a torn copy breaks them.
Readers (this process and a second process) read in a loop while it writes.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from otel_gpu_census.census import reader
from otel_gpu_census._native import SEGMENT_SIZE
from otel_gpu_census.census import ZERO

TESTS = Path(__file__).resolve().parents[1] / "support"   # helpers the subprocesses import
HTOD, DTOH, DTOD, MEMSET = 4096, 1000, 64, 256      # bytes per batch
RECORDS_PER_BATCH = 17                              # 8 external + 8 activity + 1 unknown

# The writer: `run SECONDS BATCHES_PER_UPDATE [STALL_S]` or `hold` (stops inside an update, seq odd).
_WRITER = r"""
import mmap, os, sys, time
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/../../src"]
import cupti_records as cr
import segments
ffi, lib, _ = cr.native()
m, seg = segments.open_segment(sys.argv[2])
seg.pid = os.getpid()                         # this process owns the segment, as the injector would
seg.proc_start_ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
tally = lib.gc_tally_create(seg)
rffi, rlib = cr.records()
other_buf = rffi.new("char[64]")                 # owned here: the record must outlive its use
OTHER = rffi.cast("CUpti_Activity *", other_buf)
OTHER.kind = rlib.CUPTI_ACTIVITY_KIND_NAME       # a kind the census does not count
T0, US = 50_000 * 20_000_000, 1_000          # bucket 50000 of 20 ms; all work stays within the ring
corr = [0]
def launch(rec_fn, *a, **k):
    corr[0] += 1
    return rec_fn(*a, corr=corr[0], **k)
def batch(b):
    t = T0 + b * 10 * US
    acts = [launch(cr.kernel, t, t + 3 * US),              # overlapping pair on one device
            launch(cr.kernel, t + US, t + 4 * US, stream=8),
            launch(cr.kernel, t + 5 * US, t + 6 * US),
            launch(cr.kernel, t + 9 * US, t + 12 * US),     # spans into the next batch's time
            launch(cr.memcpy, "htod", %(htod)d, t, t + US, src="pinned"),
            launch(cr.memcpy, "dtoh", %(dtoh)d, t + 2 * US, t + 3 * US, dst="pageable"),
            launch(cr.memcpy, "dtod", %(dtod)d, t + 4 * US, t + 5 * US),
            launch(cr.memset, %(memset)d, t + 6 * US, t + 7 * US)]
    first = corr[0] - len(acts) + 1
    return [cr.external(first + i, b) for i in range(len(acts))] + acts + [OTHER]
mode = sys.argv[3]
b = 0
if mode == "hold":
    lib.gc_segment_begin_update(seg)
    for r in batch(1):
        lib.gc_tally_record(tally, r)
    print("mid-update", flush=True)
    time.sleep(600)
per_update = int(sys.argv[5])
stall = float(sys.argv[6]) if len(sys.argv) > 6 else 0.0   # a slow writer: more time mid-update
end = time.time() + float(sys.argv[4])
print("ready", flush=True)
while time.time() < end:
    recs = []
    for _ in range(per_update):
        b += 1
        recs += batch(b)
    lib.gc_segment_begin_update(seg)
    for r in recs:
        lib.gc_tally_record(tally, r)
    if stall:
        time.sleep(stall)
    lib.gc_tally_publish(tally, 0)
    lib.gc_segment_end_update(seg)
print("batches", b, flush=True)
""" % {"htod": HTOD, "dtoh": DTOH, "dtod": DTOD, "memset": MEMSET}

# A reader in another process: reads in a loop and prints what it checked.
_READER = r"""
import json, sys, time
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/../integration", sys.argv[1] + "/../../src"]
import test_segment_consistency as t
from otel_gpu_census.census import reader
end = time.time() + float(sys.argv[3])
reads, torn, problems, last = 0, 0, [], None
while time.time() < end:
    c = reader.read_segment(sys.argv[2])
    reads += 1
    torn += c.torn
    problems += t.violations(c, last)
    last = c
print(json.dumps({"reads": reads, "torn": torn, "problems": problems[:5]}))
"""


def start_writer(path: Path, *args: str) -> subprocess.Popen:
    w = subprocess.Popen([sys.executable, "-c", _WRITER, str(TESTS), str(path), *args],
                         stdout=subprocess.PIPE, text=True)
    line = w.stdout.readline().strip()
    assert line in ("ready", "mid-update"), f"writer did not start (said {line!r})"
    return w


def violations(c, prev=None) -> list:
    """What is wrong with one read of a segment the writer above filled (empty when consistent).
    `prev`, an earlier read of the same segment, adds the check that nothing went backwards."""
    out = []

    def need(cond, what):
        if not cond:
            out.append(what)

    n = c.records_unknown
    dev = c.devices.get(0)
    need(c.records == RECORDS_PER_BATCH * n, f"records {c.records} != 17 x {n}")
    need(c.step_max == n, f"step_max {c.step_max} != batches {n}")
    if n == 0:
        return out
    need(dev is not None and set(c.devices) == {0}, f"devices {sorted(c.devices)}")
    if dev is None:
        return out
    need(dev.kernel_count == 4 * n, f"kernels {dev.kernel_count} != 4 x {n}")
    need(dev.kernel_ns == 10_000 * n, f"kernel_ns {dev.kernel_ns} != 10 us x {n}")
    for direction, mem, size in (("htod", "pinned", HTOD), ("dtoh", "pageable", DTOH), ("dtod", "device", DTOD)):
        s = dev.copies.get(direction, mem)
        need(s.count == n and s.bytes == size * n, f"{direction}/{mem} {s} for {n} batches")
    need(dev.copies.total().count == 3 * n, f"copies {dev.copies.total()}")
    need(dev.memset.count == n and dev.memset.bytes == MEMSET * n, f"memset {dev.memset}")
    need(0 < dev.busy_ns <= dev.kernel_ns, f"busy {dev.busy_ns} vs kernel {dev.kernel_ns}")
    need(dev.busy_ns <= dev.last_ns - dev.first_ns, "busy longer than the span of activity")
    # The windows hold every record (nothing is older than the ring), so they add up to the totals.
    need(c.window_late == 0, f"window_late {c.window_late}")
    need(sum(w.kernel_count for w in c.windows) == dev.kernel_count, "window kernel counts")
    need(sum(w.kernel_ns for w in c.windows) == dev.kernel_ns, "window kernel time")
    for direction in ("htod", "dtoh", "dtod"):
        need(sum(w.copies.get(direction, ZERO).bytes for w in c.windows)
             == dev.copies.get(direction).bytes, f"window {direction} bytes")
    need(sum(w.memset.bytes for w in c.windows) == dev.memset.bytes, "window memset bytes")
    # Every step still in the ring was tallied whole: a batch is never split across updates.
    need(len(c.steps) == min(n, 1024), f"{len(c.steps)} steps in the ring for {n} batches")
    bad = [s.id for s in c.steps.values()
           if s.kernel_count != 4 or s.copies.get("dtoh", ZERO).bytes != DTOH
           or s.memset.bytes != MEMSET]
    need(not bad, f"incomplete steps {bad[:3]}")
    need(c.step_unmatched == 0, f"step_unmatched {c.step_unmatched}")
    if prev is not None and prev.devices.get(0):
        p = prev.devices[0]
        need(c.records >= prev.records and dev.kernel_count >= p.kernel_count
             and dev.busy_ns >= p.busy_ns and dev.copies.total().bytes >= p.copies.total().bytes
             and c.wall_update_ns >= prev.wall_update_ns, "a total went backwards")
    return out


@pytest.fixture
def live_segment(census_dir, segments):
    return segments.segment(census_dir, [], final=False)


def test_readers_see_only_whole_updates_of_a_busy_writer(live_segment):
    w = start_writer(live_segment, "run", "3", "4")
    other = subprocess.Popen([sys.executable, "-c", _READER, str(TESTS), str(live_segment), "2.5"],
                             stdout=subprocess.PIPE, text=True)
    try:
        last, seen = None, set()
        deadline = time.time() + 2.5
        while time.time() < deadline:
            c = reader.read_segment(live_segment)
            assert not c.torn, "a live writer's segment was reported torn"
            assert violations(c, last) == []
            assert c.alive and c.state_name == "active"
            seen.add(c.records_unknown)
            last = c
        assert len(seen) > 5, f"the writer made no visible progress while read ({sorted(seen)})"
        out, _ = other.communicate(timeout=30)
        theirs = json.loads(out.strip().splitlines()[-1])
        assert theirs["reads"] > 5 and theirs["problems"] == [] and theirs["torn"] == 0
    finally:
        for p in (w, other):
            if p.poll() is None:
                p.kill()
            p.wait()
    assert w.returncode in (0, -signal.SIGKILL)


def test_final_state_after_the_writer_finishes_is_consistent(live_segment):
    w = start_writer(live_segment, "run", "0.5", "1")
    out, _ = w.communicate(timeout=60)
    assert w.returncode == 0
    batches = int(out.split()[-1])
    c = reader.read_segment(live_segment)
    assert not c.torn and not c.alive
    assert c.records_unknown == batches and violations(c) == []


def test_writer_killed_at_random_moments_leaves_torn_or_consistent_never_garbage(census_dir, segments):
    rng = random.Random(7)
    for k in range(5):
        path = segments.segment(census_dir, [], final=False)
        # Big, slow updates: the writer spends most of its time between begin and end of an update.
        w = start_writer(path, "run", "30", "64", "0.01")
        time.sleep(rng.uniform(0.2, 0.6))
        w.send_signal(signal.SIGKILL)
        w.wait()
        c = reader.read_segment(path)
        assert c.pid == w.pid and c.comm == "worker", "identity fields damaged"
        assert c.state_name == "active" and not c.alive   # killed: no final flush marked it exited
        if c.torn:
            # Mid-update values: partial, but never below a batch count it had finished before.
            assert c.records >= RECORDS_PER_BATCH * (c.records_unknown - 1)
        else:
            assert violations(c) == []
        print(f"kill {k}: {'torn' if c.torn else 'consistent'} after {c.records_unknown} batches")
        path.unlink()


def test_writer_dead_inside_an_update_is_read_as_torn(live_segment, monkeypatch):
    monkeypatch.setattr(reader, "READ_TRIES", 5)
    w = start_writer(live_segment, "hold")
    try:
        c = reader.read_segment(live_segment)
        assert c.torn, "seq is odd: the copy must be flagged torn while the writer sits mid-update"
    finally:
        w.kill()
        w.wait()
    c = reader.read_segment(live_segment)
    assert c.torn and not c.alive
    assert c.records == RECORDS_PER_BATCH and c.devices[0].kernel_count == 4


@pytest.mark.parametrize("region", ["identity", "live", "rings"])
def test_random_damage_gives_a_census_or_a_segment_error_never_another_exception(census_dir, segments, records, region):
    """Flip random bytes of a good segment: the reader returns values or says why it cannot."""
    good = segments.segment(census_dir, [records.kernel(10**12, 10**12 + 5000),
                                         records.memcpy("dtoh", 64, 10**12, 10**12 + 100, dst="pinned")])
    data = bytearray(good.read_bytes())
    lo, hi = {"identity": (0, 24), "live": (128, 700), "rings": (700, SEGMENT_SIZE)}[region]
    rng = random.Random(region)
    for trial in range(40):
        bad = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            bad[rng.randrange(lo, hi)] = rng.randrange(256)
        path = census_dir / f"gpu-census-9{trial}-1.seg"
        path.write_bytes(bytes(bad))
        try:
            c = reader.read_segment(path)
        except reader.SegmentError as e:
            assert str(path) in str(e)
        else:
            c.totals(), c.state_name, c.windows_between(0, 2**63)   # usable as values
        path.unlink()


_LOOP_READER = r"""
import sys, time
sys.path[:0] = [sys.argv[1] + "/../../src"]
from otel_gpu_census.census import reader
end, reads, refused = time.time() + float(sys.argv[3]), 0, 0
while time.time() < end:
    try:
        reader.read_segment(sys.argv[2])
        reads += 1
    except reader.SegmentError:
        refused += 1
print(reads, refused)
"""


def test_reader_survives_a_segment_truncated_while_it_reads(census_dir, segments):
    """Someone truncates a segment (a full disk, a stray tool) while a reader copies it: the
    reader must refuse that file, not die."""
    path = segments.segment(census_dir, [])
    good = path.read_bytes()
    r = subprocess.Popen([sys.executable, "-c", _LOOP_READER, str(TESTS), str(path), "1.5"],
                         stdout=subprocess.PIPE, text=True)
    fd = os.open(path, os.O_RDWR)
    try:
        deadline = time.time() + 5
        while r.poll() is None and time.time() < deadline:
            os.ftruncate(fd, 4096)
            os.ftruncate(fd, len(good))
            os.pwrite(fd, good, 0)
    finally:
        os.close(fd)
        if r.poll() is None:
            r.kill()
        out, _ = r.communicate(timeout=10)
    assert r.returncode == 0, f"the reader died (exit status {r.returncode}; -7 is SIGBUS)"
    reads, refused = map(int, out.split())
    assert reads > 0
