"""Where GPU time goes, from the window ring: exact splits of known patterns, requests in flight,
and the report's table."""
from __future__ import annotations

import re

from otel_gpu_census.report import explain

from otel_gpu_census.report import render as report

from otel_gpu_census.report import timeline
from otel_gpu_census.census import reader
from otel_gpu_census.report.diagnose import Facts
from otel_gpu_census.report.request_log import RequestRecord
from serving_census import GPU0, MS, S, clocks, to_wall

W = 20 * MS


def _census(census_dir, segments, recs):
    return reader.read_segment(segments.segment(census_dir, recs, edit=clocks()))


def _pattern(records, buckets=50, start=GPU0 + 10 * S):
    """In every other 20 ms bucket: 5 ms of kernel, then 5 ms of copy; the buckets between are empty."""
    recs = []
    for i in range(0, buckets, 2):
        t = start + i * W
        recs += [records.kernel(t, t + 5 * MS, corr=i + 1),
                 records.memcpy("dtoh", 1000, t + 5 * MS, t + 10 * MS, src="device", dst="pinned", corr=i + 2)]
    return recs


def test_split_of_a_known_pattern(census_dir, segments, records):
    start = GPU0 + 10 * S
    c = _census(census_dir, segments, _pattern(records))
    t = timeline.build(c)
    assert len(t.slots) == 49                        # 0..48: the empty buckets between are slots too
    assert t.start_ns == to_wall(start)
    sp = timeline.split(t.slots)
    assert sp.span_ns == 49 * W
    assert sp.kernel_ns == 25 * 5 * MS and sp.copy_only_ns == 25 * 5 * MS
    assert sp.idle_ns == 49 * W - 250 * MS
    assert [s.dtoh_count for s in t.slots[:3]] == [1, 0, 1]
    assert t.kernel_time_known and not t.kernel_time_estimated and t.copies_timed


def test_concurrent_kernels_are_capped_at_the_window(census_dir, segments, records):
    t0 = GPU0 + 10 * S
    recs = [records.kernel(t0, t0 + W, corr=1, stream=1), records.kernel(t0, t0 + W, corr=2, stream=2),
            records.memcpy("htod", 10, t0, t0 + W, src="pinned", dst="device", corr=3)]
    s = timeline.build(_census(census_dir, segments, recs)).slots[0]
    assert (s.kernel_ns, s.copy_only_ns, s.idle_ns) == (W, 0, 0)


def test_requests_in_flight_are_request_ns(census_dir, segments, records):
    start = GPU0 + 10 * S
    c = _census(census_dir, segments, _pattern(records))
    w0 = to_wall(start)
    recs = [RequestRecord(w0 + 10 * MS, w0 + 50 * MS), RequestRecord(w0 + 20 * MS, w0 + 980 * MS)]
    t = timeline.build(c, recs)
    assert [s.in_flight_ns for s in t.slots[:4]] == [10 * MS, 40 * MS, 30 * MS, 20 * MS]
    assert sum(s.in_flight_ns for s in t.slots) == 40 * MS + 960 * MS
    serving = t.serving()
    assert serving[0].start_ns == w0 and serving[-1].end_ns == w0 + 980 * MS
    groups = dict(timeline.by_in_flight(serving))
    assert set(groups) == {"1", "2-3"}
    assert groups["2-3"].span_ns == 2 * W     # means 2 and 1.5 (half up); the first slot's 0.5 is 1


def test_intervals_give_at_most_twelve_rows(census_dir, segments, records):
    c = _census(census_dir, segments, _pattern(records, buckets=1500))      # 30 s
    step, rows = timeline.intervals(timeline.build(c).slots)
    assert step == 5 * S and len(rows) == 6
    assert sum(sp.span_ns for _, sp in rows) == 1499 * W


def test_report_prints_the_table_with_a_request_log(census_dir, segments, records):
    start = GPU0 + 10 * S
    c = _census(census_dir, segments, _pattern(records))
    w0 = to_wall(start)
    facts = Facts(records=[RequestRecord(w0, w0 + 49 * W)])
    text = report.render_text([c], facts=facts)
    head = next(i for i, ln in enumerate(text.splitlines()) if ln.startswith("where the GPU time went"))
    lines = text.splitlines()[head:]
    assert "the 0.980000 s from the first request to the last (1 request), by 1 s" in lines[0]
    all_row = next(ln for ln in lines if ln.strip().startswith("all"))
    # 25 x 5 ms of kernels and of copies in 980 ms
    assert re.findall(r"[\d.]+%", all_row) == ["12.8%", "12.8%", "74.5%"] and all_row.endswith("1.00")
    assert explain.SPLIT_NOTE in text and explain.UNTIMED_COPIES_NOTE not in text
    assert "where the GPU time went" not in report.render_text([c])          # no log, no table
    d = report.to_dict([c], facts=facts)
    idle = d["idle_time"][0]
    assert idle["whole"]["kernel_ns"] == 125 * MS and idle["whole"]["nothing_ns"] == 980 * MS - 250 * MS
    assert idle["by_in_flight"] == [dict(idle["whole"], in_flight="1")]
    assert "idle_time" not in report.to_dict([c])


def test_a_log_reaching_before_the_ring_says_what_the_ring_holds(census_dir, segments, records):
    start = GPU0 + 10 * S
    c = _census(census_dir, segments, _pattern(records))
    w0 = to_wall(start)
    facts = Facts(records=[RequestRecord(w0 - 60 * S, w0 - 59 * S), RequestRecord(w0 - 5 * S, w0 + 49 * W)])
    head = next(ln for ln in report.render_text([c], facts=facts).splitlines() if ln.startswith("where the GPU"))
    assert ("the last 0.980000 s of the requests (all the 20 ms windows kept reach; 1 of the 2 requests)"
            in head), head
