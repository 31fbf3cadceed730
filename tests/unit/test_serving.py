"""Start-up apart from serving: the period (request records, else the first pause after start-up), the split
of every count and byte into start-up, serving and after, exact against the totals; the report's lines and
JSON; what happens when the windows do not reach back, and the windows `run` keeps over the run."""
from __future__ import annotations

import dataclasses

from otel_gpu_census.report import render as report

from otel_gpu_census.report import serving
from otel_gpu_census.census import reader
from otel_gpu_census.census.history import WindowHistory
from otel_gpu_census.report.diagnose import Facts
from otel_gpu_census.report.request_log import parse
from serving_census import DENSE, GPU0, MS, S, clocks, model_load, serve

MB = 1_000_000


def _read(segments, census_dir, recs, comm="llama-server"):
    return reader.read_segment(segments.segment(census_dir, recs, comm=comm, edit=clocks()))


def _run(records, requests=8, **kw):
    load, start = model_load(records, n=100)            # 5 GB of weights, a warm-up, 0.5 s of nothing
    return load, serve(records, clients=1, requests=requests, start_ns=start, **kw)


def _adds_up(sv, c):
    """start-up + serving + after = the process's totals, in every direction, kernels and memsets."""
    ps = sv.processes[0]
    t = c.totals()
    whole = ps.startup + ps.serving + ps.after
    for d, st in t.copies.by_direction().items():
        assert (whole.copy(d).count, whole.copy(d).bytes) == (st.count, st.bytes), d
    assert whole.kernel_count == t.kernel_count and whole.memset.count == t.memset.count


def test_the_first_pause_ends_start_up(census_dir, segments, records):
    load, sv = _run(records)
    c = _read(segments, census_dir, load + sv.records)
    split = serving.split([c])
    assert split.ok and split.period.basis == "pause"
    startup, serve_ = split.total("startup"), split.total("serving")
    assert startup.copy("htod").bytes == 100 * 50 * MB and startup.kernel_count == 1      # weights and warm-up
    assert startup.copy("dtoh").count == 1 and serve_.copy("htod").count == 0
    assert serve_.copy("dtoh").count == 8 * 64 and split.total("after").empty
    _adds_up(split, c)


def test_a_load_that_pauses_between_reads_stays_start_up(census_dir, segments, records):
    """The hybrid llama-server on a GPU: a memset, then its weights uploaded in pieces with pauses of a disk
    read between them, a warm-up, then the wait for the first request. Start-up ends at its last pause (the
    kernels before it are a small share of the run's), not at its first, so the weights are not served work."""
    first, t = model_load(records, n=40, pause_ns=400 * MS)           # 2 GB, then a pause (reading from disk)
    rest, start = model_load(records, n=60, start=t, pause_ns=600 * MS)   # 3 GB more, warm-up, the wait
    rest = [r for r in rest]
    sv = serve(records, clients=1, requests=8, start_ns=start)
    c = _read(segments, census_dir, first + rest + sv.records)
    split = serving.split([c])
    assert split.ok and split.period.basis == "pause"
    assert split.total("startup").copy("htod").bytes == 100 * 50 * MB and split.total("serving").copy("htod").count == 0
    assert split.total("serving").copy("dtoh").count == 8 * 64
    _adds_up(split, c)


def test_request_records_give_the_period(census_dir, segments, records):
    load, sv = _run(records)
    c = _read(segments, census_dir, load + sv.records)
    split = serving.split([c], parse(sv.log_lines()))
    assert split.ok and split.period.basis == "requests" and split.period.requests == 8
    assert (split.period.start_ns, split.period.end_ns) == (sv.log[0][0], sv.log[-1][1])
    assert split.total("startup").copy("htod").bytes == 100 * 50 * MB
    # the last step's logits copy starts after the last request ended: after serving, not in it
    assert split.total("after").copy("dtoh").count == 1
    _adds_up(split, c)


def test_no_pause_no_split(census_dir, segments, records):
    sv = serve(records, clients=1, requests=4)
    split = serving.split([_read(segments, census_dir, sv.records)])
    assert not split.ok and "no pause of 0.25 s or more" in split.why


def test_per_request_figures_leave_start_up_out(census_dir, segments, records):
    load, sv = _run(records, **DENSE)
    c = _read(segments, census_dir, load + sv.records)
    text = report.render_text([c], requests=8)
    assert "start-up, before it (weights, compilation, graph capture, warm-up): 5,000,000,000 bytes (5.00 GB) " \
           "host-to-device in 100 copies, 513,000 bytes (513.0 kB) device-to-host in 1 copy, 1 kernel" in text
    assert "per request while serving (8 requests; all devices above, start-up left out):" in text
    assert "host-to-device per request" not in text                          # the weights are not a request's
    assert f"{225 * MB + 64 * 513_000:,} bytes (257.8 MB) device-to-host per request, in 112 copies" in text
    out = report.to_dict([c], requests=8)
    assert out["serving"]["basis"] == "pause" and out["serving"]["pause_ns"] == serving.PAUSE_NS
    assert out["serving"]["startup"]["copies"]["htod"] == {"count": 100, "bytes": 5 * 10**9, "ns": 100 * 10 * MS}
    assert out["per_request"]["scope"] == "serving" and "htod" not in out["per_request"]["copies"]


def test_a_split_that_cannot_be_made_says_so_and_divides_the_whole_run(census_dir, segments, records):
    """Serving longer than the ring (~41 s) after start-up: its windows do not reach back to start-up."""
    load, sv = _run(records, requests=60)            # 60 x 0.74 s
    c = _read(segments, census_dir, load + sv.records)
    text = report.render_text([c], requests=60)
    assert "start-up and serving not told apart: the 20 ms windows of pid" in text
    assert "not to its start-up (`run` keeps them for the whole run)" in text
    assert "per request over the whole run, start-up included (60 requests; all devices above):" in text
    out = report.to_dict([c], requests=60)
    assert out["per_request"]["scope"] == "whole_run" and out["per_request"]["whole_run_because"]
    assert out["per_request"]["copies"]["htod"]["bytes"] == 100 * 50 * MB / 60


def _writer_reads(segments, census_dir, recs, cuts):
    """The census of one process read as its writer went along: the records up to each cut tallied, then read
    (the ring holds the newest 2048 windows at each read)."""
    seg = segments.new("llama-server")
    clocks()(seg)
    done, reads = 0, []
    for cut in cuts + [None]:
        part = [r for r in recs[done:] if cut is None or r.start < cut] if cut is not None else recs[done:]
        segments.tally(seg, part, final=cut is None)
        done += len(part)
        clocks()(seg)
        seg.complete_wall_ns = 0
        reads.append(reader.read_segment(segments.write(census_dir, seg)))
    return reads


def test_windows_kept_over_reads_reach_back_to_start_up(census_dir, segments, records):
    load, sv = _run(records, requests=60)
    recs = sorted(load + sv.records, key=lambda r: r.start)
    t0 = recs[0].start
    reads = _writer_reads(segments, census_dir, recs, [t0 + 10 * S, t0 + 20 * S, t0 + 30 * S, t0 + 40 * S])
    last = reads[-1]
    assert not serving.split([last]).ok                        # alone, the last read's ring misses start-up
    history = WindowHistory()
    for c in reads[:-1]:
        history.add(c)
    whole = history.extend(last)
    assert len(whole.windows) > len(last.windows) and whole.windows_since_ns <= recs[0].start
    split = serving.split([whole])
    assert split.ok and split.total("startup").copy("htod").bytes == 100 * 50 * MB
    _adds_up(split, whole)
    assert "per request while serving (60 requests" in report.render_text([whole], requests=60)


def test_reads_too_far_apart_keep_nothing_across_the_gap(census_dir, segments, records):
    load, sv = _run(records, requests=80)
    recs = sorted(load + sv.records, key=lambda r: r.start)
    t0 = recs[0].start
    first, last = _writer_reads(segments, census_dir, recs, [t0 + 5 * S])       # 55 s between the two reads
    history = WindowHistory()
    history.add(first)
    whole = history.extend(last)
    assert whole.windows_since_ns > first.windows[-1].start_ns              # the ring may have lost the middle
    assert not serving.split([whole]).ok


def test_the_history_keeps_at_most_its_bound(census_dir, segments, records):
    load, sv = _run(records, requests=20)
    recs = sorted(load + sv.records, key=lambda r: r.start)
    t0 = recs[0].start
    reads = _writer_reads(segments, census_dir, recs, [t0 + 5 * S, t0 + 10 * S])
    history = WindowHistory(max_kept_ns=4 * S)
    for c in reads[:-1]:
        history.add(c)
    whole = history.extend(reads[-1])
    width = whole.windows[0].end_ns - whole.windows[0].start_ns
    assert whole.windows_since_ns == whole.windows[-1].start_ns - 4 * S + width      # the newest 200 buckets
    assert whole.windows[0].start_ns >= whole.windows_since_ns


def test_a_census_without_serving_has_no_split_lines(census_dir, segments, records):
    c = _read(segments, census_dir, [records.kernel(GPU0 + S, GPU0 + S + MS)])
    text = report.render_text([c])
    assert "start-up and serving" not in text and "per request" not in text
    assert dataclasses.asdict(Facts()) == {"requests": None, "records": None, "sm_occupancy": None}


def test_run_keeps_the_windows_of_its_commands_segments_while_it_runs(census_dir, segments, records, monkeypatch):
    """cli._WindowKeeper: reads the segments of the command's processes (not others') while the command runs."""
    import threading
    import time

    from otel_gpu_census.cli import main as cli
    from otel_gpu_census.census import history
    monkeypatch.setattr(history, "READ_EVERY_S", 0.05)

    class Child:
        pid, parents, exited = 4_000_001, {4_000_002: 4_000_001}, threading.Event()

    load, sv = _run(records, requests=2)
    segments.segment(census_dir, load, comm="llama-server", pid=4_000_002, edit=clocks())
    segments.segment(census_dir, load, comm="stranger", pid=4_000_009, edit=clocks())
    keeper = cli._WindowKeeper(census_dir, Child)
    time.sleep(0.3)
    Child.exited.set()
    keeper.join()
    kept = keeper.history._kept
    assert {pid for pid, _ in kept} == {4_000_002} and next(iter(kept.values())).rows


def test_request_records_of_another_run_give_no_split(census_dir, segments, records):
    load, sv = _run(records)
    c = _read(segments, census_dir, load + sv.records)
    elsewhere = parse([f'{{"start_time_unix_nano": {sv.log[0][0] + 3600 * S}, "end_time_unix_nano": '
                       f'{sv.log[0][1] + 3600 * S}}}'])
    split = serving.split([c], elsewhere)
    assert not split.ok and split.why == "no GPU work in the serving period (request records of another run?)"
