"""Each diagnosis on synthetic serving segments that show it, and on ones that do not.

The segments are written by the native tally from CUPTI records (serving_census.py); the request
logs are what the clients of those runs would have written."""
from __future__ import annotations

import pytest

from otel_gpu_census.census import reader
from otel_gpu_census.diagnose import Facts, diagnose, low_occupancy
from otel_gpu_census.request_log import parse
from serving_census import GPU0, MS, S, clocks, serve

MB = 1_000_000


@pytest.fixture
def census(census_dir, segments):
    def make(serving=None, comm="llama-server", extra=(), edit=None):
        recs = list(serving.records if serving else []) + list(extra)
        ed = clocks()

        def both(seg):
            ed(seg)
            if edit:
                edit(seg)
        return reader.read_segment(segments.segment(census_dir, recs, comm=comm, edit=both))
    return make


def kinds(found):
    return [d.kind for d in found]


def with_log(serving, **kw):
    return Facts(records=parse(serving.log_lines()), **kw)


def one(found, kind):
    hits = [d for d in found if d.kind == kind]
    assert len(hits) == 1, [d.text for d in found]
    return hits[0]


# ---- state saved at request boundaries --------------------------------------------------------

def test_state_save_one_client(census, records):
    sv = serve(records, clients=1, requests=8, save_bytes=225 * MB)
    d = one(diagnose([census(sv)], with_log(sv)), "state_save")
    # the excess over the background is the save, give or take the logits of the 11 windows near an
    # arrival (at most 2 steps x 513 kB each; the prompt steps have none, so the estimate runs low)
    assert 225 * MB - 11.3 * MB <= d.figures["dtoh_bytes_per_request"] <= 225 * MB + 11.3 * MB
    assert d.figures["arrivals"] == 8 and d.figures["density_ratio"] > 3
    assert "`--cache-ram 0 --ctx-checkpoints 0`" in d.text and "llama-server's prompt cache" in d.text
    assert "device-to-host per request above the background" in d.text
    assert "100.0% of all its device-to-host bytes went to pageable memory" in d.text


def test_state_save_sixteen_clients(census, records):
    sv = serve(records, clients=16, requests=32, step_ns=40 * MS, kernel_ns=38 * MS, save_bytes=225 * MB,
               stagger_ns=150 * MS)
    d = one(diagnose([census(sv)], with_log(sv)), "state_save")
    assert d.figures["arrivals"] == 32
    assert 200 * MB <= d.figures["dtoh_bytes_per_request"] <= 230 * MB


@pytest.mark.parametrize("clients", [1, 16])
def test_no_state_save_when_only_logits_are_copied(census, records, clients):
    """The same loads without the save: their device->host bytes (logits, 32.8 MB a request) are
    spread over every decode step, so nothing follows request boundaries."""
    kw = dict(step_ns=40 * MS, kernel_ns=38 * MS, stagger_ns=150 * MS) if clients == 16 else {}
    sv = serve(records, clients=clients, requests=2 * clients if clients > 1 else 8, **kw)
    found = diagnose([census(sv)], with_log(sv))
    assert "state_save" not in kinds(found)


def test_state_save_needs_a_request_log(census, records):
    sv = serve(records, clients=1, requests=8, save_bytes=225 * MB)
    assert "state_save" not in kinds(diagnose([census(sv)], Facts(requests=8)))


def test_state_save_of_another_server_names_the_llama_flags_as_an_example(census, records):
    sv = serve(records, clients=1, requests=6, save_bytes=100 * MB)
    d = one(diagnose([census(sv, comm="python3")], with_log(sv)), "state_save")
    assert d.text.startswith("state saved to the host at request boundaries")
    assert "for llama-server `--cache-ram 0 --ctx-checkpoints 0`" in d.text


def test_small_saves_are_not_a_diagnosis(census, records):
    sv = serve(records, clients=1, requests=8, save_bytes=2 * MB, save_copies=4)
    assert "state_save" not in kinds(diagnose([census(sv)], with_log(sv)))


# ---- pageable memory on a hot path -------------------------------------------------------------

def test_pageable_copies_while_serving(census, records):
    sv = serve(records, clients=1, requests=8)
    d = one(diagnose([census(sv)], with_log(sv)), "pageable_hot_path")
    assert d.figures["direction"] == "dtoh"
    assert d.figures["copies_serving_at_least"] == d.figures["pageable_count"] == 8 * 64
    assert "at least 512 device-to-host copies with pageable memory while serving" in d.text
    assert "64 per request" in d.text and "pin_memory" in d.text


def test_pageable_copies_counted_without_time_are_named_without_a_bandwidth(census, records):
    """A census at the calls (OTEL_GPU_CENSUS_ACTIVITY=off) has the copies and their bytes, no time: the
    diagnosis stands, with no "0.0 GB/s"."""
    from dataclasses import replace
    from otel_gpu_census.census import CopyTable
    sv = serve(records, clients=1, requests=8)
    c = census(sv)
    devices = {k: replace(dv, copies=CopyTable({key: replace(st, ns=0) for key, st in dv.copies.cells.items()}))
               for k, dv in c.devices.items()}
    d = one(diagnose([replace(c, devices=devices)], with_log(sv)), "pageable_hot_path")
    assert "at least 512 device-to-host copies with pageable memory while serving" in d.text
    assert "GB/s" not in d.text and " in 0.000000 s" not in d.text and d.figures["pageable_ns"] == 0


def test_pinned_copies_are_not_a_hot_path(census, records):
    sv = serve(records, clients=1, requests=8, logits_mem="pinned")
    assert "pageable_hot_path" not in kinds(diagnose([census(sv)], with_log(sv)))


def _model_load(records, n=300, each=50 * MB, start=GPU0 + S // 2):
    """A model load: n pageable host->device copies back to back, before any request."""
    out, t = [], start
    for i in range(n):
        d = each // 5
        out.append(records.memcpy("htod", each, t, t + d, src="pageable", dst="device", corr=10_000 + i))
        t += d
    return out, t


@pytest.mark.parametrize("log", [True, False])
def test_a_pageable_model_load_is_not_a_hot_path(census, records, log):
    load, end = _model_load(records)
    sv = serve(records, clients=1, requests=8, logits_mem="pinned", start_ns=end + 200 * MS)
    c = census(sv, extra=load)
    assert c.totals().copies.get("htod", "pageable").count == 300
    found = diagnose([c], with_log(sv) if log else Facts(requests=8))
    assert "pageable_hot_path" not in kinds(found), [d.text for d in found]


def test_pageable_hot_path_without_a_log_needs_copies_spread_over_time(census, records):
    sv = serve(records, clients=1, requests=12)          # ~8.9 s of pageable logits copies
    d = one(diagnose([census(sv)], Facts(requests=12)), "pageable_hot_path")
    assert "spread over 9 of the 9 seconds with GPU activity" in d.text


# ---- weights copied to the GPU for every batch ---------------------------------------------------

def test_weights_copied_for_every_request(census, records):
    sv = serve(records, clients=1, requests=6, htod_bytes=8_000 * MB, htod_chunk=40 * MB)
    d = one(diagnose([census(sv)], with_log(sv)), "weights_copied")
    assert d.figures["htod_bytes_per_request"] == 8_000 * MB
    assert d.figures["share"] >= 0.3
    assert "8,000,000,000 bytes (8.00 GB) host-to-device per request" in d.text
    assert "-ngl" in d.text and "PCIe" in d.text


def test_weights_copied_needs_a_request_log(census, records):
    sv = serve(records, clients=1, requests=6, htod_bytes=8_000 * MB)
    assert "weights_copied" not in kinds(diagnose([census(sv)], Facts(requests=6)))


def test_a_model_load_before_serving_is_not_weights_copied(census, records):
    load, end = _model_load(records, n=320)                # 16 GB before the first request
    sv = serve(records, clients=1, requests=6, start_ns=end + 200 * MS)
    found = diagnose([census(sv, extra=load)], with_log(sv))
    assert "weights_copied" not in kinds(found)


# ---- client or server: busy far below 100 % -----------------------------------------------------

def test_one_client_at_a_time_is_client_bound(census, records):
    sv = serve(records, clients=1, requests=8, kernel_ns=5 * MS, gap_ns=60 * MS)
    d = one(diagnose([census(sv)], with_log(sv)), "client_bound")
    assert d.figures["peak_in_flight"] == 1
    assert 0.4 <= d.figures["busy_share"] <= 0.5
    assert d.figures["idle_ns_none_in_flight"] > 0        # the gaps between one client's requests
    assert d.text.startswith("the clients are the bottleneck, not the GPU")
    assert "with no request in flight at all" in d.text
    assert "server_bound" not in kinds(diagnose([census(sv)], with_log(sv)))


def test_many_in_flight_and_a_half_idle_gpu_is_server_bound(census, records):
    sv = serve(records, clients=16, requests=32, step_ns=40 * MS, kernel_ns=20 * MS, stagger_ns=20 * MS)
    found = diagnose([census(sv)], with_log(sv))
    d = one(found, "server_bound")
    assert d.figures["peak_in_flight"] == 16 and d.figures["mean_in_flight"] >= 4
    assert "--max-num-seqs" in d.text
    assert "client_bound" not in kinds(found)


@pytest.mark.parametrize("clients", [1, 16])
def test_a_busy_gpu_is_neither(census, records, clients):
    sv = serve(records, clients=clients, requests=2 * clients, step_ns=40 * MS, kernel_ns=38 * MS,
               stagger_ns=20 * MS)
    found = kinds(diagnose([census(sv)], with_log(sv)))
    assert "client_bound" not in found and "server_bound" not in found


def test_concurrency_needs_a_request_log(census, records):
    sv = serve(records, clients=1, requests=8, kernel_ns=5 * MS)
    found = kinds(diagnose([census(sv)], Facts(requests=8)))
    assert "client_bound" not in found and "server_bound" not in found


# ---- kernels that fill little of the chip ---------------------------------------------------------

def _matmul_loop(records, seconds=3):
    """bf16 matmuls back to back: the GPU 'busy' ~99 % of the time."""
    out, t = [], GPU0 + S
    for i in range(seconds * 100):
        out.append(records.kernel(t, t + 9_900_000, corr=i + 1))
        t += 10 * MS
    return out


def _tiny_loop(records, seconds=3):
    """Tiny kernels with host pauses: busy ~4 %."""
    out, t = [], GPU0 + S
    for i in range(seconds * 500):
        out.append(records.kernel(t, t + 80_000, corr=i + 1))
        t += 2 * MS
    return out


def test_busy_but_low_occupancy(census, records):
    c = census(extra=_matmul_loop(records), comm="python3")
    d = low_occupancy([c], 0.142)
    assert d is not None and d.kind == "low_occupancy"
    assert d.figures["busy_share"] > 0.98
    assert "SM occupancy NVML GPM measured was 14.2%" in d.text
    assert "99.0% of the time from the first GPU activity to the last" in d.text
    assert one(diagnose([c], Facts(sm_occupancy=0.142)), "low_occupancy").text == d.text


@pytest.mark.parametrize("loop, occupancy", [("matmul", 0.6), ("matmul", None), ("tiny", 0.0002)])
def test_no_occupancy_diagnosis(census, records, loop, occupancy):
    recs = _matmul_loop(records) if loop == "matmul" else _tiny_loop(records)
    c = census(extra=recs, comm="python3")
    assert low_occupancy([c], occupancy) is None
    assert "low_occupancy" not in kinds(diagnose([c], Facts(sm_occupancy=occupancy)))


def test_occupancy_while_serving_leaves_the_model_load_out(census, records):
    """A server busy 95 % while serving after a 12 s load of copies only: from first to last GPU
    activity its kernels ran under half the time, while serving 95 %; the request log decides."""
    load, end = _model_load(records, n=240, each=250 * MB)            # 12 s of copies, no kernels
    sv = serve(records, clients=4, requests=8, step_ns=40 * MS, kernel_ns=38 * MS, start_ns=end + S)
    c = census(sv, extra=load)
    assert low_occupancy([c], 0.1) is None
    d = low_occupancy([c], 0.1, with_log(sv).records)
    assert d is not None and d.figures["while_serving"] and 0.94 < d.figures["busy_share"] < 0.96
    assert f"on pid {c.pid} kernels ran 95.0% of the time while serving (the " in d.text


def test_an_idle_census_has_no_diagnoses(census):
    assert diagnose([census()], Facts(sm_occupancy=0.1, requests=3)) == []
