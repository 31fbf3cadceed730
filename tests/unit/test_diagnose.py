"""Each diagnosis on synthetic serving segments that show it, and on ones that do not: under CUPTI
(copy time measured) and under the default census (copies counted at their calls, no copy time), with
request records, with only a request count, and with neither.

The segments are written by the native tally from CUPTI records (serving_census.py); the request
logs are what the clients of those runs would have written."""
from __future__ import annotations

import pytest

from otel_gpu_census.report import serving
from otel_gpu_census.census import reader
from otel_gpu_census.report.diagnose import Facts, diagnose, low_occupancy
from otel_gpu_census.report.request_log import parse
from serving_census import DENSE, GPU0, HYBRID, MS, S, WALL0, clocks, counted_at_calls, llama_run, model_load, serve

MB = 1_000_000

NO_SAVE = {}


@pytest.fixture
def census(census_dir, segments):
    def make(serving=None, comm="llama-server", extra=(), calls=False):
        recs = list(serving.records if serving else []) + list(extra)
        c = reader.read_segment(segments.segment(census_dir, recs, comm=comm, edit=clocks()))
        return counted_at_calls(c) if calls else c
    return make


def kinds(found):
    return [d.kind for d in found]


def facts_of(sv, boundaries):
    """What the report knows of the requests: their records, their count, or nothing."""
    if boundaries == "records":
        return Facts(records=parse(sv.log_lines()))
    return Facts(requests=len(sv.log)) if boundaries == "count" else Facts()


def one(found, kind):
    hits = [d for d in found if d.kind == kind]
    assert len(hits) == 1, [d.text for d in found]
    return hits[0]


def served(records, census, save, clients, calls, comm="llama-server"):
    """A llama-server's run: start-up (weights, warm-up, a pause), then `clients` clients."""
    sv, load = llama_run(records, save, clients)
    return sv, census(sv, comm=comm, extra=load, calls=calls)


# ---- state saved to the host ----------------------------------------------------------------------

@pytest.mark.parametrize("calls", [False, True], ids=["cupti", "calls"])
@pytest.mark.parametrize("boundaries", ["records", "count", "none"])
@pytest.mark.parametrize("clients", [1, 4, 16, 32])
@pytest.mark.parametrize("model", ["dense", "hybrid"])
def test_llama_servers_state_save_names_the_flags(census, records, model, clients, boundaries, calls):
    save = DENSE if model == "dense" else HYBRID
    sv, c = served(records, census, save, clients, calls)
    d = one(diagnose([c], facts_of(sv, boundaries)), "state_save")
    assert d.text.startswith("llama-server's prompt cache and context checkpoints saved slot state to host memory")
    assert "start llama-server with `--cache-ram 0 --ctx-checkpoints 0`" in d.text
    f = d.figures
    assert f["share"] > 0.8 and f["whole_period"]
    per_request = save["save_bytes"] + save.get("checkpoints", 0) * save.get("checkpoint_bytes", 0)
    if boundaries == "none":
        assert "per request" not in d.text and f["dtoh_bytes_in_bursts"] >= len(sv.log) * per_request
    else:
        # the bursts' windows hold the saves and the logits copied beside them (here steps go on during a
        # save; llama-server's one thread saves between its steps)
        assert per_request <= f["dtoh_bytes_in_bursts_per_request"] <= per_request * 1.05
        assert f"{f['dtoh_bytes_in_bursts_per_request']:,} bytes" in d.text
    assert ("the bursts' copies taking" in d.text) is (not calls)      # copy time only where measured


@pytest.mark.parametrize("calls", [False, True], ids=["cupti", "calls"])
@pytest.mark.parametrize("boundaries", ["records", "count", "none"])
@pytest.mark.parametrize("clients", [1, 4, 16, 32])
def test_no_state_save_when_only_logits_are_copied(census, records, clients, boundaries, calls):
    """`--cache-ram 0 --ctx-checkpoints 0`: device->host bytes are the logits, one copy a step."""
    sv, c = served(records, census, NO_SAVE, clients, calls)
    assert "state_save" not in kinds(diagnose([c], facts_of(sv, boundaries)))


def test_small_saves_are_not_a_diagnosis(census, records):
    sv, c = served(records, census, dict(save_bytes=2 * MB, save_copies=4), 1, False)
    assert "state_save" not in kinds(diagnose([c], facts_of(sv, "records")))


def test_one_dump_is_not_a_recurring_save(census, records):
    sv = serve(records, clients=1, requests=8)
    dump = [records.memcpy("dtoh", 4 * MB, GPU0 + S + 50 * MS + i, GPU0 + S + 50 * MS + i + 1, src="device",
                           dst="pageable", corr=90_000 + i) for i in range(100)]
    assert "state_save" not in kinds(diagnose([census(sv, extra=dump)], facts_of(sv, "records")))


def test_state_save_of_another_server_names_the_llama_flags_as_an_example(census, records):
    sv, c = served(records, census, DENSE, 1, False, comm="python3")
    d = one(diagnose([c], facts_of(sv, "records")), "state_save")
    assert d.text.startswith("state saved to host memory in bursts")
    assert "(llama-server: `--cache-ram 0 --ctx-checkpoints 0`)" in d.text
    assert "pageable_hot_path" not in kinds(diagnose([c], facts_of(sv, "records")))   # one cause, named once


def test_state_save_over_the_windows_kept_when_start_up_is_out_of_reach(census, records):
    """Serving longer than the ring: the windows hold its last ~41 s, start-up is out of reach; the
    diagnosis says what it saw and over which time, and serving's bytes per request come from the
    records' period (the split: serving is the windows inside it)."""
    sv = serve(records, clients=1, requests=60, **DENSE)      # 60 x 0.74 s: longer than the ring
    c = census(sv)
    d = one(diagnose([c], facts_of(sv, "none")), "state_save")
    assert "the last 40.960 s of its GPU work, as far back as the 20 ms windows kept reach" in d.text
    assert not d.figures["whole_period"]


# ---- pageable host memory, where the user owns the buffer -------------------------------------------

@pytest.mark.parametrize("calls", [False, True], ids=["cupti", "calls"])
@pytest.mark.parametrize("boundaries", ["records", "count", "none"])
def test_pageable_copies_of_the_users_own_program(census, records, boundaries, calls):
    sv, c = served(records, census, NO_SAVE, 1, calls, comm="python3")
    d = one(diagnose([c], facts_of(sv, boundaries)), "pageable_hot_path")
    assert d.figures["direction"] == "dtoh"
    # the warm-up's copy is start-up's; the records end before the last step's copy
    assert d.figures["copies_serving_at_least"] == 8 * 64 - (boundaries == "records")
    assert f"at least {d.figures['copies_serving_at_least']} device-to-host copies with pageable host memory over" in d.text
    assert ("copies per request" in d.text) is (boundaries != "none")
    assert "pin_memory" in d.text and ("GB/s" in d.text) is (not calls)


def test_a_servers_pageable_copies_are_not_the_users_to_pin(census, records):
    """llama-server copies its logits to pageable memory: the user cannot pin that buffer."""
    sv, c = served(records, census, NO_SAVE, 1, False)
    assert "pageable_hot_path" not in kinds(diagnose([c], facts_of(sv, "records")))


def test_pinned_copies_are_not_a_hot_path(census, records):
    sv = serve(records, clients=1, requests=8, logits_mem="pinned")
    assert "pageable_hot_path" not in kinds(diagnose([census(sv, comm="python3")], facts_of(sv, "records")))


@pytest.mark.parametrize("boundaries", ["records", "count", "none"])
def test_a_pageable_model_load_is_not_a_hot_path(census, records, boundaries):
    load, start = model_load(records)
    sv = serve(records, clients=1, requests=8, logits_mem="pinned", start_ns=start)
    c = census(sv, comm="python3", extra=load)
    assert c.totals().copies.get("htod", "pageable").count == 300
    found = diagnose([c], facts_of(sv, boundaries))
    assert "pageable_hot_path" not in kinds(found) and "weights_copied" not in kinds(found), [d.text for d in found]


def test_a_hot_path_needs_start_up_told_apart(census, records):
    """No pause and no records: start-up and serving are one, and a model load could be the copies."""
    sv = serve(records, clients=1, requests=8)
    assert "pageable_hot_path" not in kinds(diagnose([census(sv, comm="python3")], Facts(requests=8)))


# ---- weights copied to the GPU for every batch ---------------------------------------------------

@pytest.mark.parametrize("calls", [False, True], ids=["cupti", "calls"])
@pytest.mark.parametrize("boundaries", ["records", "count", "none"])
def test_weights_copied_for_every_request(census, records, boundaries, calls):
    load, start = model_load(records, n=80)
    sv = serve(records, clients=1, requests=6, htod_bytes=8_000 * MB, htod_chunk=40 * MB, start_ns=start)
    c = census(sv, extra=load, calls=calls)
    d = one(diagnose([c], facts_of(sv, boundaries)), "weights_copied")
    assert d.figures["htod_bytes_per_s"] >= 2e9
    if boundaries != "none":
        assert d.figures["htod_bytes_per_request"] == 8_000 * MB
        assert "8,000,000,000 bytes (8.00 GB) host-to-device per request" in d.text
    assert "`-ngl`/`--n-gpu-layers`" in d.text and "PCIe" in d.text
    assert ("of the time" in d.text) is (not calls)


@pytest.mark.parametrize("boundaries", ["records", "count", "none"])
def test_a_model_load_before_serving_is_not_weights_copied(census, records, boundaries):
    load, start = model_load(records, n=320)                # 16 GB before the first request
    sv = serve(records, clients=1, requests=6, start_ns=start, htod_bytes=30 * MB)   # prompt inputs
    found = diagnose([census(sv, extra=load)], facts_of(sv, boundaries))
    assert "weights_copied" not in kinds(found)


# ---- client or server: busy far below 100 % -----------------------------------------------------

@pytest.mark.parametrize("calls", [False, True], ids=["cupti", "calls"])
def test_one_client_at_a_time_is_client_bound(census, records, calls):
    sv = serve(records, clients=1, requests=8, kernel_ns=5 * MS, gap_ns=60 * MS)
    found = diagnose([census(sv, calls=calls)], facts_of(sv, "records"))
    d = one(found, "client_bound")
    assert d.figures["peak_in_flight"] == 1
    assert 0.4 <= d.figures["busy_share"] <= 0.5
    assert d.figures["idle_ns_none_in_flight"] > 0        # the gaps between one client's requests
    assert d.text.startswith("the clients are the bottleneck, not the GPU")
    assert "no request was in flight at all" in d.text
    assert ("kernel time estimated" in d.text) is calls
    assert "server_bound" not in kinds(found)


@pytest.mark.parametrize("calls", [False, True], ids=["cupti", "calls"])
def test_many_in_flight_and_a_half_idle_gpu_is_server_bound(census, records, calls):
    sv = serve(records, clients=16, requests=32, step_ns=40 * MS, kernel_ns=20 * MS, stagger_ns=20 * MS)
    found = diagnose([census(sv, calls=calls)], facts_of(sv, "records"))
    d = one(found, "server_bound")
    assert d.figures["peak_in_flight"] == 16 and d.figures["mean_in_flight"] >= 4
    assert "`--parallel`" in d.text
    assert "client_bound" not in kinds(found)


def test_a_server_bound_llama_server_with_state_saves_is_told_to_turn_them_off_first(census, records):
    sv = serve(records, clients=16, requests=48, step_ns=40 * MS, kernel_ns=20 * MS, stagger_ns=60 * MS, **DENSE)
    d = one(diagnose([census(sv)], facts_of(sv, "records")), "server_bound")
    assert "turn off the state saves above first" in d.text


@pytest.mark.parametrize("clients", [1, 16])
def test_a_busy_gpu_is_neither(census, records, clients):
    sv = serve(records, clients=clients, requests=2 * clients, step_ns=40 * MS, kernel_ns=38 * MS,
               stagger_ns=20 * MS)
    found = kinds(diagnose([census(sv)], facts_of(sv, "records")))
    assert "client_bound" not in found and "server_bound" not in found


@pytest.mark.parametrize("boundaries", ["count", "none"])
def test_concurrency_needs_request_records(census, records, boundaries):
    sv = serve(records, clients=1, requests=8, kernel_ns=5 * MS)
    found = kinds(diagnose([census(sv)], facts_of(sv, boundaries)))
    assert "client_bound" not in found and "server_bound" not in found


def test_concurrency_needs_the_kernels_time(census, records):
    """Counted at the calls with no duration at all (OTEL_GPU_CENSUS_ACTIVITY=off): no busy share."""
    import dataclasses
    sv = serve(records, clients=1, requests=8, kernel_ns=5 * MS, gap_ns=60 * MS)
    c = counted_at_calls(census(sv))
    c = dataclasses.replace(c, kernels=dataclasses.replace(c.kernels, untimed=True, events=False))
    assert "client_bound" not in kinds(diagnose([c], facts_of(sv, "records")))


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
    assert "SM occupancy NVML GPM measured was 14.2% of the warp slots" in d.text
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
    activity its kernels ran under half the time, while serving 95 %; the request records decide."""
    load, end = model_load(records, n=240, each=250 * MB)            # 12 s of copies
    sv = serve(records, clients=4, requests=8, step_ns=40 * MS, kernel_ns=38 * MS, start_ns=end + S)
    c = census(sv, extra=load)
    assert low_occupancy([c], 0.1) is None
    d = low_occupancy([c], 0.1, facts_of(sv, "records").records)
    assert d is not None and d.figures["while_serving"] and 0.94 < d.figures["busy_share"] < 0.96
    assert f"on pid {c.pid} kernels ran {100 * d.figures['busy_share']:.1f}% of the time while serving (the " in d.text


def test_an_idle_census_has_no_diagnoses(census):
    assert diagnose([census()], Facts(sm_occupancy=0.1, requests=3)) == []


def test_the_serving_split_is_what_the_rules_see(census, records):
    sv, c = served(records, census, DENSE, 1, False)
    split = serving.split([c])
    assert split.ok and split.period.basis == "pause"
    assert split.total("startup").copy("htod").count == 300       # the weights are start-up's
    assert split.total("serving").copy("htod").count == 0


@pytest.mark.parametrize("calls", [False, True], ids=["cupti", "calls"])
@pytest.mark.parametrize("boundaries", ["records", "count", "none"])
def test_the_hybrid_at_sixteen_clients_that_the_old_rule_missed(census, records, boundaries, calls):
    """Shaped like the GPU run of the issue: 64 requests on 16 slots, 185 ms steps, the checkpoints copied while
    the prompt is processed (0.25-0.5 s after the request arrived), serving longer than the ring reaches. The old
    rule needed request records (`run` gave it none) and, given them, found 49 % of the bytes near arrivals and
    ~3.4 runs of copies a request; the bursts are there either way."""
    load, start = model_load(records)
    sv = serve(records, clients=16, requests=64, start_ns=start, step_ns=185 * MS, kernel_ns=60 * MS, prefill_steps=4,
               stagger_ns=5 * MS, **HYBRID)
    found = diagnose([census(sv, extra=load, calls=calls)], facts_of(sv, boundaries))
    d = one(found, "state_save")
    assert "start llama-server with `--cache-ram 0 --ctx-checkpoints 0`" in d.text and d.figures["share"] > 0.9
    assert "the last 40.960 s of" in d.text                 # what the ring holds, said
    assert "pageable_hot_path" not in kinds(found)


def test_a_paused_census_is_not_an_idle_gpu(census, records):
    """Time a control file paused the census has no counts: it must not read as the GPU doing nothing."""
    import dataclasses
    from otel_gpu_census.report import render as report
    sv = serve(records, clients=1, requests=8, kernel_ns=5 * MS, gap_ns=60 * MS)
    c = census(sv)
    paused = dataclasses.replace(c, graphs=dataclasses.replace(c.graphs, paused_ns=3 * S))
    assert "client_bound" in kinds(diagnose([c], facts_of(sv, "records")))
    assert "client_bound" not in kinds(diagnose([paused], facts_of(sv, "records")))
    text = report.render_text([paused], facts=facts_of(sv, "records"))
    assert "note: a control file paused the census for 3.000000 s: the work of that time is in none" in text
    assert "the census was paused 3.000000 s by a control file: that time reads as nothing" in text
    assert report.to_dict([paused], facts=facts_of(sv, "records"))["per_request"]["census_paused_ns"] == 3 * S


# ---- managed (unified) memory migrated to the GPU ------------------------------------------------

def _managed_census(census_dir, segments, sv, extra, flags, allocs=0, alloc_bytes=0):
    """A llama-server's segment as a census of managed memory would have written it: `flags` (census.FLAG_*), the
    allocations the calls reported."""
    from otel_gpu_census import census as cz
    base = clocks()

    def edit(seg):
        base(seg)
        seg.flags |= flags
        seg.devices[0].managed.allocs, seg.devices[0].managed.alloc_bytes = allocs, alloc_bytes
        seg.devices[0].managed.live_bytes = alloc_bytes
    census_dir.mkdir(parents=True, exist_ok=True)
    return reader.read_segment(segments.segment(census_dir, list(sv.records) + list(extra), comm="llama-server",
                                                edit=edit))


def _paging(records, sv, per_step=8 * MB):
    """Pages of weights migrated host->device under each request's steps: one migration per 10 ms step."""
    out = []
    for i, (s, e, _) in enumerate(sorted(sv.log)):
        g0 = s - WALL0 + GPU0
        for k in range(0, e - s, 10 * MS):
            out.append(records.unified("BYTES_TRANSFER_HTOD", per_step, g0 + k, g0 + k + 2 * MS, 0, 0))
    return out


@pytest.mark.parametrize("boundaries", ["records", "count", "none"])
def test_managed_memory_migrating_while_serving_names_the_setting(census_dir, segments, records, boundaries):
    """The precise census measured managed memory paging in all through serving (llama-server started with
    GGML_CUDA_ENABLE_UNIFIED_MEMORY): the migrated bytes, per request where known, and the variable to unset."""
    from otel_gpu_census import census as cz
    load, start = model_load(records)
    sv = serve(records, clients=1, requests=6, start_ns=start)
    paging = _paging(records, sv)
    c = _managed_census(census_dir, segments, sv, load + paging,
                        cz.FLAG_MANAGED | cz.FLAG_UM_COUNTERS | cz.FLAG_ENV_UNIFIED, 1, 16_000 * MB)
    assert c.migrations_measured and c.gaps == []
    d = one(diagnose([c], facts_of(sv, boundaries)), "managed_migrations")
    moved = sum(r.value for r in paging)
    assert d.figures["migrated_htod_bytes"] == moved
    assert "GGML_CUDA_ENABLE_UNIFIED_MEMORY was set for this process" in d.text and "unset" in d.text
    assert f"{moved:,} bytes" in d.text and "migrated host-to-device through managed memory" in d.text
    if boundaries != "none":
        assert d.figures["migrated_htod_bytes_per_request"] == moved // 6 and "while serving" in d.text
    assert "weights_copied" not in kinds(diagnose([c], facts_of(sv, boundaries)))   # no copy call moved them


def test_migrations_only_at_start_up_are_not_a_diagnosis(census_dir, segments, records):
    """Managed memory that migrated while the model loaded, then stayed: serving moved nothing."""
    from otel_gpu_census import census as cz
    load, start = model_load(records)
    sv = serve(records, clients=1, requests=6, start_ns=start)
    at_load = [records.unified("BYTES_TRANSFER_HTOD", 40 * MB, GPU0 + S // 2 + i * 5 * MS, GPU0 + S // 2 + i * 5 * MS + MS)
               for i in range(50)]
    c = _managed_census(census_dir, segments, sv, load + at_load, cz.FLAG_MANAGED | cz.FLAG_UM_COUNTERS, 1, 2_000 * MB)
    found = diagnose([c], facts_of(sv, "records"))
    assert "managed_migrations" not in kinds(found) and "managed_memory" not in kinds(found), [x.text for x in found]


def test_managed_memory_the_census_did_not_measure_says_how_to(census_dir, segments, records):
    """The default census: managed memory in use, migrations unmeasured: the diagnosis names the setting behind it
    and the precise collector; a few small managed buffers without the setting are no diagnosis."""
    from otel_gpu_census import census as cz
    load, start = model_load(records)
    sv = serve(records, clients=1, requests=6, start_ns=start)
    c = _managed_census(census_dir, segments, sv, load, cz.FLAG_MANAGED | cz.FLAG_ENV_UNIFIED, 3, 9_000 * MB)
    assert not c.migrations_measured and c.managed_gap
    d = one(diagnose([c], facts_of(sv, "records")), "managed_memory")
    assert "9,000,000,000 bytes" in d.text and "3 managed allocations" in d.text
    assert "run --precise" in d.text and "GGML_CUDA_ENABLE_UNIFIED_MEMORY" in d.text
    small = _managed_census(census_dir / "small", segments, sv, load, cz.FLAG_MANAGED, 2, 2 * MB)
    assert "managed_memory" not in kinds(diagnose([small], facts_of(sv, "records")))
