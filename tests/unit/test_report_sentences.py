"""Every sentence the report prints holds together: each diagnosis one sentence, no part larger than its
whole, no share above 100 %, no count without its unit. Each template is run over runs that fill it
in every way it can be (request records, a count, neither; CUPTI and the default census; 1 to 32
clients; dense and hybrid saves; weights, pageable copies, the clients or the server at fault), and
over the report's start-up and per-request lines."""
from __future__ import annotations

import pytest

from otel_gpu_census.report import render as report
from otel_gpu_census.census import reader
from otel_gpu_census.report.diagnose import Facts, diagnose, low_occupancy
from otel_gpu_census.report.request_log import parse
from sentences import problems
from serving_census import (DENSE, GPU0, HYBRID, MS, S, clocks, counted_at_calls, llama_run, model_load,
                            serve)

MB = 1_000_000
PROSE = ("start-up and serving", "  serving:", "  start-up, before it", "  after it:", "per request")


@pytest.mark.parametrize("text, wrong", [
    ("spread over 41 of the 33 seconds with GPU activity, 120.3 a second.", "a part larger than its whole"),
    ("spread over 16 of 14 seconds.", "a part larger than its whole"),
    ("with 15.87 requests in flight on average (at most 16), kernels ran 31.4% of it.", "a count without its unit"),
    ("busy 120.5% of the time.", "a share above 100%"),
    ("the cause. The action.", "more than one sentence"),
])
def test_the_checks_catch_what_they_are_for(text, wrong):
    assert any(p.startswith(wrong) for p in problems(text)), problems(text)


def test_the_checks_pass_a_good_sentence():
    assert problems("llama-server saved 486,770,848 bytes (486.8 MB) device-to-host per request in 3 bursts, 95.0% "
                    "of the device-to-host bytes over the 40.960 s of serving, 1 of the 2 requests, at most 16 "
                    "requests; start it with `--cache-ram 0 --ctx-checkpoints 0` on cuda:0 (GPU-4b60-33) of pid 7.") == []


def _census(segments, census_dir, recs, comm="llama-server", calls=False):
    c = reader.read_segment(segments.segment(census_dir, recs, comm=comm, edit=clocks()))
    return counted_at_calls(c) if calls else c


def _facts(sv, boundaries):
    if boundaries == "records":
        return Facts(records=parse(sv.log_lines()))
    return Facts(requests=len(sv.log)) if boundaries == "count" else Facts()


def _runs(records):
    """(name, serving, start-up records, comm): every diagnosis's template, filled every way."""
    for clients in (1, 4, 16, 32):
        for save, name in ((DENSE, "dense"), (HYBRID, "hybrid"), ({}, "nocache")):
            sv, load = llama_run(records, save, clients)
            yield f"{name}-{clients}", sv, load, "llama-server"
    sv, load = llama_run(records, DENSE, 1)
    yield "another-server", sv, load, "python3"
    sv, load = llama_run(records, {}, 1)
    yield "own-program", sv, load, "python3"
    load, start = model_load(records, n=80)
    yield "weights", serve(records, clients=1, requests=6, htod_bytes=8_000 * MB, start_ns=start), load, "llama-server"
    yield "one-client", serve(records, clients=1, requests=8, kernel_ns=5 * MS, gap_ns=60 * MS), [], "llama-server"
    yield "server-bound", serve(records, clients=16, requests=48, step_ns=40 * MS, kernel_ns=20 * MS,
                                stagger_ns=60 * MS, **DENSE), [], "llama-server"
    yield "server-bound-nocache", serve(records, clients=16, requests=32, step_ns=40 * MS, kernel_ns=20 * MS,
                                       stagger_ns=20 * MS), [], "python3"


def test_every_diagnosis_is_one_consistent_sentence(segments, census_dir, records):
    seen, bad = set(), []
    for name, sv, load, comm in _runs(records):
        for calls in (False, True):
            c = _census(segments, census_dir, sv.records + load, comm, calls)
            for boundaries in ("records", "count", "none"):
                facts = _facts(sv, boundaries)
                for d in diagnose([c], facts):
                    seen.add(d.kind)
                    bad += [(name, calls, boundaries, p, d.text) for p in problems(d.text)]
                lines = [ln for ln in report.render_text([c], facts=facts).splitlines()
                         if ln.startswith(PROSE) or " per request" in ln]
                bad += [(name, calls, boundaries, p, ln) for ln in lines for p in problems(ln, one_sentence=False)]
    assert not bad, bad[:5]
    assert seen == {"state_save", "pageable_hot_path", "weights_copied", "client_bound", "server_bound"}


def test_the_occupancy_sentence(segments, census_dir, records):
    recs, t = [], GPU0 + S
    for i in range(300):
        recs.append(records.kernel(t, t + 9_900_000, corr=i + 1))
        t += 10 * MS
    d = low_occupancy([_census(segments, census_dir, recs, "python3")], 0.142)
    assert d is not None and problems(d.text) == []
