"""The diagnoses on segments recorded on an H200 (bench/explain_evidence.sh, 2026-12-02; the archive is
bench/results/2026-12-02-h200-explain.tgz): each run's census folder and the clients' request log.

  default  llama-server 8B, default flags, 16 clients x 64 requests: its prompt cache saves a slot's
           state (~250 MB, pageable) each time a request reuses the slot -> state saved, server-bound
  nocache  --cache-ram 0 --ctx-checkpoints 0, same load: no state save (only logits come back)
  client1  the same server, one client at a time: the clients are the bottleneck
  offload  -ngl 16: half the layers' weights copied in for every batch
  matmul / tiny  busy loops with NVML GPM's SM occupancy: the matmul fills 14 % of the warp slots
           while busy 98 % of the time; the tiny kernels leave the GPU idle (no occupancy diagnosis)
"""
from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from otel_gpu_census.census.reader import scan
from otel_gpu_census.diagnose import Facts, diagnose
from otel_gpu_census.request_log import load

ARCHIVE = Path(__file__).resolve().parents[2] / "bench" / "results" / "2026-12-02-h200-explain.tgz"
OCCUPANCY = {"matmul": 0.14130060040920422, "tiny": 7.714970587925094e-06}   # busy/busy_gap.json


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("explain")
    with tarfile.open(ARCHIVE) as tar:
        tar.extractall(root, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    return root


def found(runs, name):
    d = runs / name
    censuses, errors = scan(d / "census")
    assert len(censuses) == 1 and not errors
    log = d / "requests.jsonl"
    facts = Facts(records=load(str(log)) if log.exists() else None, sm_occupancy=OCCUPANCY.get(name))
    return {x.kind: x for x in diagnose(censuses, facts)}


def test_the_prompt_cache_of_the_default_llama_server_is_found_as_a_state_save(runs):
    got = found(runs, "default")
    save = got["state_save"]
    f = save.figures
    # one save per request that reused a slot: 64 requests on 16 slots, the first use of each saves nothing
    assert f["method"] == "bursts" and 40 <= f["bursts"] <= 52 and f["requests"] == 64
    assert f["burst_median_bytes"] > 200_000_000 and f["share"] > 0.8
    assert "--cache-ram 0 --ctx-checkpoints 0" in save.text and "pageable" in save.text
    assert "server_bound" in got and "pageable_hot_path" in got


@pytest.mark.parametrize("name", ["nocache", "client1", "offload"])
def test_no_state_save_without_the_prompt_cache(runs, name):
    assert "state_save" not in found(runs, name)


def test_one_client_at_a_time_is_the_clients_fault_and_sixteen_are_the_servers(runs):
    assert "client_bound" in found(runs, "client1") and "server_bound" not in found(runs, "client1")
    assert "server_bound" in found(runs, "nocache") and "client_bound" not in found(runs, "nocache")


def test_half_the_layers_on_the_cpu_copy_weights_for_every_batch(runs):
    got = found(runs, "offload")
    assert "weights_copied" in got and got["weights_copied"].figures


def test_the_busy_matmul_fills_little_of_the_chip_and_the_idle_tiny_loop_is_not_called_busy(runs):
    assert "low_occupancy" in found(runs, "matmul")
    assert "low_occupancy" not in found(runs, "tiny")
