"""The report's peer-copy rows and its census-time figures, from real segments."""
from __future__ import annotations

import re

from otel_gpu_census.report import cost

from otel_gpu_census.report import render as report
from otel_gpu_census.census import reader
from otel_gpu_census import census
from otel_gpu_census.census import Stat

T0 = 10**12
MS = 1_000_000
S = 1_000_000_000


def _census(census_dir, segments, recs, start_ns, update_ns):
    def clocks(seg):
        seg.wall_start_ns, seg.wall_update_ns = start_ns, update_ns
    return reader.read_segment(segments.segment(census_dir, recs, edit=clocks))


def test_peer_copies_show_as_sent_on_one_device_and_received_on_the_other(census_dir, segments, records):
    recs = [records.peer(64 * MS, T0, T0 + MS, src_device=0, dst_device=1),
            records.peer(3, T0 + 2 * MS, T0 + 2 * MS + 7, src_device=1, dst_device=0)]
    c = _census(census_dir, segments, recs, 5 * S, 6 * S)
    text = report.render_text([c])
    dev0, dev1 = text.split("  cuda:1")
    sent0 = re.search(r"peer-to-peer sent\s+1\s+64,000,000 ", dev0)
    recv0 = re.search(r"peer-to-peer received\s+1\s+3 ", dev0)
    assert sent0 and recv0, text
    assert re.search(r"peer-to-peer sent\s+1\s+3 ", dev1) and re.search(r"peer-to-peer received\s+1\s+64,000,000 ", dev1)
    assert "no GPU activity" not in text
    devices = report.to_dict([c])["processes"][0]["devices"]
    assert devices[1]["peer_received"] == {"count": 1, "bytes": 64 * MS, "ns": MS}
    assert devices[1]["copies"]["ptop"]["bytes"] == 3
    # the per-GPU sum over processes carries it too
    assert report.to_dict([c])["gpus"]["cuda:0"]["peer_received"]["bytes"] == 3


def test_a_device_that_only_received_has_activity(census_dir, segments, records):
    c = _census(census_dir, segments, [records.peer(4096, T0, T0 + 100, src_device=0, dst_device=2)], 5 * S, 6 * S)
    assert report.has_activity(c.devices[2]) and c.devices[2].copies.total() == Stat()
    assert report.no_activity_reason([c]) is None


def test_busy_share_of_census_time(census_dir, segments, records):
    # 200 ms busy over a census time of 2 s: 10%
    c = _census(census_dir, segments, [records.kernel(T0, T0 + 200 * MS)], 5 * S, 7 * S)
    text = report.render_text([c])
    assert "census time 2.000000 s (CUDA init to last update)" in text and "lifetime" not in text
    assert "busy 0.200000 s = 10.0% of census time" in text
    proc = report.to_dict([c])["processes"][0]
    assert proc["census_time_ns"] == 2 * S
    assert proc["devices"][0]["busy_ratio_of_census_time"] == 0.1
    assert "busy_ratio_of_census_time_unavailable" not in proc["devices"][0]


def test_census_time_shorter_than_the_work_gives_no_busy_share(census_dir, segments, records):
    """A segment created at its first buffer, long after CUDA initialised: 0.11 ms of census time
    for 12 s of kernels. The report says why it gives no share rather than printing 10^7 %."""
    recs = [records.kernel(T0, T0 + 6 * S), records.kernel(T0 + 6 * S, T0 + 12 * S)]
    c = _census(census_dir, segments, recs, 5 * S, 5 * S + 110_000)
    text = report.render_text([c])
    assert "census time 0.000110 s" in text
    line = next(ln for ln in text.splitlines() if "busy 12.000000 s" in ln)
    assert "no share of census time" in line and "shorter than the 12.000000 s" in line
    assert all(float(p) <= 100 for p in re.findall(r"([\d.]+)%", text)), text   # no ratio above 100%
    assert "100.0% of the 12.000000 s from first to last GPU activity" in line
    dev = report.to_dict([c])["processes"][0]["devices"][0]
    assert dev["busy_ratio_of_census_time"] is None
    assert "shorter than" in dev["busy_ratio_of_census_time_unavailable"]


def test_no_census_time_recorded(census_dir, segments, records):
    c = _census(census_dir, segments, [records.kernel(T0, T0 + MS)], 5 * S, 0)
    dev = report.to_dict([c])["processes"][0]["devices"][0]
    assert dev["busy_ratio_of_census_time"] is None
    assert dev["busy_ratio_of_census_time_unavailable"] == "no census time recorded"
    assert "no share of census time: no census time recorded" in report.render_text([c])


def test_the_census_cost_is_estimated_from_what_it_counted(census_dir, segments, records):
    """4 kernel records, 1,000 graph kernel nodes counted per launch, 2 copies and 1 memset over a 1 s
    census: 4 x (0.902 + 0.654 for CUPTI set up) + 1,000 x 0.119 + 3 x 0.81 = 127.654 µs. Traced node by
    node, graph nodes are kernel records and the line says the figure is an upper bound."""
    recs = [records.kernel(T0 + i * MS, T0 + i * MS + 10) for i in range(4)]
    recs += [records.memcpy("dtoh", 4096, T0, T0 + 5, dst="pinned"), records.memcpy("htod", 8, T0, T0 + 5),
             records.memset(64, T0, T0 + 5)]

    def edit(seg):
        seg.wall_start_ns, seg.wall_update_ns = 5 * S, 6 * S
        seg.graph_mode = 1
        seg.devices[0].kernel_count += 1000
        seg.devices[0].graph_kernel_count = 1000
    c = reader.read_segment(segments.segment(census_dir, recs, edit=edit))
    proc = report.to_dict([c])["processes"][0]["census_cost_estimate"]
    assert (proc["eager_kernels"], proc["graph_nodes"], proc["copies_and_memsets"]) == (4, 1000, 3)
    # (the JSON keeps microseconds: 128 µs)
    assert proc["seconds"] == round(127.654e-6, 6) and proc["share_of_census_time"] == round(127.654e-6, 6)
    assert abs(cost.estimate(c).seconds - 127.654e-6) < 1e-12
    line = next(l for l in report.render_text([c]).splitlines() if "census cost" in l)
    assert "0.000 s" in line and "0.01% of census time" in line and "1,000 graph kernel nodes" in line
    assert "4 eager launches x 0.654 us (CUPTI set up)" in line

    def per_node(seg):
        seg.wall_start_ns, seg.wall_update_ns = 5 * S, 6 * S
    (census_dir / "n").mkdir(mode=0o700)
    c = reader.read_segment(segments.segment(census_dir / "n", recs, edit=per_node))
    line = next(l for l in report.render_text([c]).splitlines() if "census cost" in l)
    assert "4 kernel records" in line and "upper bound" in line


def test_a_paused_census_says_what_a_pause_does_not_take_away(census_dir, segments, records):
    """Paused, nothing is counted, but CUPTI's cost on graph replays goes on (measured at
    0.875 of plain graph throughput with the census paused, docs/measurements.md), and on every
    eager launch and the calls around it: the note says so."""
    def edit(seg):
        seg.wall_start_ns, seg.wall_update_ns = 5 * S, 8 * S
        seg.paused, seg.paused_ns = 1, 2 * S
    c = reader.read_segment(segments.segment(census_dir, [records.kernel(T0, T0 + 10)], edit=edit))
    note = next(l for l in report.render_text([c]).splitlines() if "paused the census" in l)
    assert "paused the census for 2.000000 s (paused now)" in note
    assert "nothing was counted then" in note and "graph replays went on" in note
    assert "OTEL_GPU_CENSUS_DISABLED=1" in note and "the default collector never loads CUPTI" in note
    # the census library preloaded (CUPTI never loaded, attached at cuInit): no CUPTI cost is left behind
    (census_dir / "preloaded").mkdir(mode=0o700)

    def preloaded(seg):
        edit(seg)
        seg.cupti_version, seg.collector = 0, census.COLLECTOR_DEFAULT
    c = reader.read_segment(segments.segment(census_dir / "preloaded", [], edit=preloaded))
    assert c.attach.mode == 0 and cost.cupti_never_loaded(c) and not cost.context_made_under_cupti(c)
    note = next(l for l in report.render_text([c]).splitlines() if "paused the census" in l)
    assert "nothing was counted then; CUPTI was never loaded" in note
    assert "CUPTI stayed" not in note and "graph replays" not in note


def test_no_census_cost_line_without_records(census_dir, segments, records):
    c = _census(census_dir, segments, [], 5 * S, 6 * S)
    assert "census cost" not in report.render_text([c])
    assert report.to_dict([c])["processes"][0]["census_cost_estimate"]["seconds"] == 0
