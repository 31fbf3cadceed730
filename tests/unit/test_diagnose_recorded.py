"""The diagnoses on census folders recorded on a GPU, each rule with a run that shows it and runs that do not.

Dense 8B archive (bench/explain_evidence.sh as it was, bench/results/explain/explain.tgz; recorded under CUPTI,
every kernel traced, layout 3, upgraded to today's by ``segments.upgrade``):

  default  llama-server 8B, default flags, 16 clients x 64 requests: its prompt cache saves a slot's
           state (~183 MB a request, pageable) each time a request reuses the slot -> state saved, server-bound
  nocache  --cache-ram 0 --ctx-checkpoints 0, same load: no state save (only logits come back)
  client1  the same server, one client at a time: the clients are the bottleneck
  offload  -ngl 16: half the layers' weights copied in for every batch
  matmul / tiny  busy loops with NVML GPM's SM occupancy: the matmul fills 14 % of the warp slots
           while busy 98 % of the time; the tiny kernels leave the GPU idle (no occupancy diagnosis)

The same runs are read again as the default census would have counted them (counted_at_calls: the same
counts and bytes, no copy time), with request records, with only their count, and with neither.

Hybrid archive (bench/explain_evidence.sh now: ``bench/results/*-h200-explain-hybrid.tgz``; its tests skip
until it is there): llama-server b11434 with a random 7.9B granitehybrid and the dense 8B, 16 clients x 64
requests each, under the default census, CUPTI (`run --precise`, or `--activity on` before it) and the proxy.
"""
from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest

from otel_gpu_census.report import render as report
from otel_gpu_census.census.reader import scan
from otel_gpu_census.report.diagnose import Facts, diagnose
from otel_gpu_census.report.request_log import load
from segments import upgrade
from sentences import problems
from serving_census import counted_at_calls

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "explain"
ARCHIVE = RESULTS / "explain.tgz"
HYBRID_ARCHIVES = sorted(RESULTS.glob("explain-hybrid*.tgz"))
OCCUPANCY = {"matmul": 0.14130060040920422, "tiny": 7.714970587925094e-06}   # busy/busy_gap.json
FLAGS = "`--cache-ram 0 --ctx-checkpoints 0`"


def _unpack(archive: Path, root: Path) -> Path:
    with tarfile.open(archive) as tar:
        tar.extractall(root, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    for seg in root.rglob("*.seg"):      # recorded in layouts 3 and 4: the fields added since read 0
        seg.write_bytes(upgrade(seg.read_bytes()))
    return root


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _unpack(ARCHIVE, tmp_path_factory.mktemp("explain"))


def census_of(d: Path, calls: bool = False):
    censuses, errors = scan(d / "census")
    assert censuses and not errors, errors
    return [counted_at_calls(c) for c in censuses] if calls else censuses


def facts_of(d: Path, boundaries: str, occupancy=None) -> Facts:
    log = d / "requests.jsonl"
    records = load(str(log)) if log.exists() else None
    if boundaries == "records":
        return Facts(records=records, sm_occupancy=occupancy)
    if boundaries == "count" and records:
        return Facts(requests=len(records), sm_occupancy=occupancy)
    return Facts(sm_occupancy=occupancy)


def found(runs, name, boundaries="records", calls=False):
    d = runs / name
    got = diagnose(census_of(d, calls), facts_of(d, boundaries, OCCUPANCY.get(name)))
    for x in got:
        assert problems(x.text) == [], x.text
    return {x.kind: x for x in got}


BOUNDARIES = pytest.mark.parametrize("boundaries", ["records", "count", "none"])
CENSUS = pytest.mark.parametrize("calls", [False, True], ids=["cupti", "calls"])


# ---- the dense 8B archive ------------------------------------------------------------------------

@CENSUS
@BOUNDARIES
def test_the_prompt_cache_of_the_default_llama_server_is_found_as_a_state_save(runs, boundaries, calls):
    save = found(runs, "default", boundaries, calls)["state_save"]
    f = save.figures
    # one burst per request that reused a slot: 64 requests on 16 slots, the first use of each saves nothing
    assert 40 <= f["bursts"] <= 52 and f["share"] > 0.8 and f["whole_period"]
    if boundaries != "none":
        # default less nocache, per request while serving: 183,140,352 bytes (the saves); the bursts hold them
        assert 175_000_000 <= f["dtoh_bytes_in_bursts_per_request"] <= 190_000_000
    assert FLAGS in save.text and save.text.startswith("llama-server's prompt cache and context checkpoints")


@CENSUS
@BOUNDARIES
@pytest.mark.parametrize("name", ["nocache", "client1", "offload"])
def test_no_state_save_without_the_prompt_cache(runs, name, boundaries, calls):
    assert "state_save" not in found(runs, name, boundaries, calls)


@BOUNDARIES
@pytest.mark.parametrize("name", ["default", "nocache", "client1", "offload"])
def test_a_llama_servers_pageable_copies_and_model_load_are_not_a_hot_path(runs, name, boundaries):
    """Its logits and state go to pageable memory it allocates; its model load is start-up."""
    assert "pageable_hot_path" not in found(runs, name, boundaries)


@CENSUS
def test_one_client_at_a_time_is_the_clients_fault_and_sixteen_are_the_servers(runs, calls):
    assert "client_bound" in found(runs, "client1", calls=calls) and "server_bound" not in found(runs, "client1", calls=calls)
    assert "server_bound" in found(runs, "nocache", calls=calls) and "client_bound" not in found(runs, "nocache", calls=calls)
    assert "turn off the state saves above first" in found(runs, "default", calls=calls)["server_bound"].text


@BOUNDARIES
def test_concurrency_needs_request_records(runs, boundaries):
    if boundaries != "records":
        assert not {"client_bound", "server_bound"} & set(found(runs, "client1", boundaries))


@CENSUS
@BOUNDARIES
def test_half_the_layers_on_the_cpu_copy_weights_for_every_batch(runs, boundaries, calls):
    got = found(runs, "offload", boundaries, calls)
    assert "weights_copied" in got and got["weights_copied"].figures["htod_bytes_per_s"] > 3e9


@CENSUS
@BOUNDARIES
@pytest.mark.parametrize("name", ["default", "nocache", "client1"])
def test_no_weights_copied_with_every_layer_on_the_gpu(runs, name, boundaries, calls):
    """Their 15 GB model load is start-up; serving copies ~97 MB a request of inputs (0.3-0.5 GB/s)."""
    assert "weights_copied" not in found(runs, name, boundaries, calls)


def test_the_busy_matmul_fills_little_of_the_chip_and_the_idle_tiny_loop_is_not_called_busy(runs):
    assert "low_occupancy" in found(runs, "matmul")
    assert "low_occupancy" not in found(runs, "tiny")


@pytest.mark.parametrize("boundaries", ["records", "count"])
def test_per_request_figures_leave_the_model_load_out(runs, boundaries):
    d = runs / "default"
    out = report.to_dict(census_of(d), facts=facts_of(d, boundaries))
    sv, pr = out["serving"], out["per_request"]
    assert sv["basis"] == ("requests" if boundaries == "records" else "pause")
    assert sv["startup"]["copies"]["htod"]["bytes"] >= 15_010_381_824      # the 290 pageable copies of the weights
    assert pr["scope"] == "serving" and pr["copies"]["htod"]["bytes"] < 100_000_000
    whole = out["processes"][0]["devices"][0]["copies"]["htod"]["bytes"]
    assert whole / 64 > 300_000_000                                          # what the whole run divided would say


# ---- the hybrid archive --------------------------------------------------------------------------

hybrid = pytest.mark.skipif(not HYBRID_ARCHIVES, reason="no bench/results/*-h200-explain-hybrid.tgz yet "
                            "(bench/explain_evidence.sh records it on the H200)")


@pytest.fixture(scope="module")
def hyb(tmp_path_factory):
    return _unpack(HYBRID_ARCHIVES[-1], tmp_path_factory.mktemp("explain-hybrid"))


def _run_report(d: Path) -> dict:
    """The report `run` itself wrote at the end of the run (--json), with the windows it kept over the run."""
    return json.loads((d / "run.json").read_text())


@hybrid
@BOUNDARIES
@pytest.mark.parametrize("name", ["hybrid-default", "dense-default", "hybrid-default-precise", "hybrid-default-proxy"])
def test_recorded_state_saves_name_the_flags(hyb, name, boundaries):
    save = found(hyb, name, boundaries)["state_save"]
    assert FLAGS in save.text and save.figures["share"] > 0.8
    assert ("the bursts' copies taking" in save.text) is name.endswith("precise")   # copy time under CUPTI only


@hybrid
@BOUNDARIES
def test_recorded_hybrid_without_the_prompt_cache_has_no_state_save(hyb, boundaries):
    assert "state_save" not in found(hyb, "hybrid-nocache", boundaries)


@hybrid
@pytest.mark.parametrize("name", ["hybrid-default", "dense-default", "hybrid-default-precise", "hybrid-default-proxy"])
def test_the_report_run_printed_names_the_state_save_and_leaves_start_up_out(hyb, name):
    """What `run` printed on the GPU. The dense model and the proxy's run (request records) put the weights in
    start-up; the hybrid's two runs without records were split by the first rule (start-up up to the first pause),
    and the hybrid's load pauses between reads of its 15.85 GB file: its weights fell in serving. The rule now ends
    start-up at its last pause (test_serving's load that pauses between reads); these two stay as recorded until
    they are recorded again."""
    out = _run_report(hyb / name)
    kinds = {d["kind"]: d for d in out["diagnoses"]}
    assert "state_save" in kinds and FLAGS in kinds["state_save"]["text"]
    assert "pageable_hot_path" not in kinds
    assert out["per_request"]["scope"] == "serving"
    first_rule_missed = name in ("hybrid-default", "hybrid-default-precise")
    startup_htod = out["serving"]["startup"]["copies"].get("htod", {}).get("bytes", 0)
    assert (startup_htod > 10**10) is not first_rule_missed                        # the weights, ~16 GB
    assert out["per_request"]["copies"].get("htod", {}).get("bytes", 0) < 10**9
    for d in out["diagnoses"]:
        assert problems(d["text"]) == [], d["text"]


@hybrid
def test_the_report_run_printed_without_the_prompt_cache_names_no_state_save(hyb):
    out = _run_report(hyb / "hybrid-nocache")
    assert "state_save" not in {d["kind"] for d in out["diagnoses"]} and out["per_request"]["scope"] == "serving"


@hybrid
def test_under_the_proxy_the_report_knew_every_request(hyb):
    out = _run_report(hyb / "hybrid-default-proxy")
    assert out["serving"]["basis"] == "requests"
    assert out["serving"]["requests_in_records"] == len(load(str(hyb / "hybrid-default-proxy" / "requests.jsonl")))
    save = next(d for d in out["diagnoses"] if d["kind"] == "state_save")
    assert "per request" in save["text"]


@hybrid
@BOUNDARIES
def test_recorded_pageable_copies_of_the_users_own_program(hyb, boundaries):
    """bench/server/own_program.py: a torch loop copying its logits with `.cpu()` (pageable) while serving, after a
    1 GB load from pageable memory; the same loop into a pinned buffer names nothing."""
    d = found(hyb, "own-pageable", boundaries)["pageable_hot_path"]
    assert d.figures["direction"] == "dtoh" and d.figures["copies_serving_at_least"] >= 24 * 32
    assert "pin_memory" in d.text
    assert not {"pageable_hot_path", "weights_copied", "state_save"} & set(found(hyb, "own-pinned", boundaries))


@hybrid
def test_the_report_run_printed_for_the_users_own_program(hyb):
    assert "pageable_hot_path" in {d["kind"] for d in _run_report(hyb / "own-pageable")["diagnoses"]}
    out = _run_report(hyb / "own-pinned")
    assert not out["diagnoses"] and out["serving"]["startup"]["copies"]["htod"]["bytes"] >= 2**30
