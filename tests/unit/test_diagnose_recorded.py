"""The diagnoses on segments recorded on an H200 (bench/explain_evidence.sh, 2026-12-02; the archive is
bench/results/explain/explain.tgz): each run's census folder and the clients' request log.

  default  llama-server 8B, default flags, 16 clients x 64 requests: its prompt cache saves a slot's
           state (~250 MB, pageable) each time a request reuses the slot -> state saved, server-bound
  nocache  --cache-ram 0 --ctx-checkpoints 0, same load: no state save (only logits come back)
  client1  the same server, one client at a time: the clients are the bottleneck
  offload  -ngl 16: half the layers' weights copied in for every batch
  matmul / tiny  busy loops with NVML GPM's SM occupancy: the matmul fills 14 % of the warp slots
           while busy 98 % of the time; the tiny kernels leave the GPU idle (no occupancy diagnosis)

The segments were written in layout version 3; they are upgraded to the reader's layout when unpacked
(:func:`upgrade_v3`).
"""
from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from otel_gpu_census._native import LAYOUT_VERSION, SEGMENT_SIZE, ffi
from otel_gpu_census.census.reader import scan
from otel_gpu_census.diagnose import Facts, diagnose
from otel_gpu_census.request_log import load

ARCHIVE = Path(__file__).resolve().parents[2] / "bench" / "results" / "explain" / "explain.tgz"
OCCUPANCY = {"matmul": 0.14130060040920422, "tiny": 7.714970587925094e-06}   # busy/busy_gap.json


def upgrade_v3(data: bytes) -> bytes:
    """A layout-3 segment in layout 4: gc_device's eager_* fields took its two reserved words and one
    more, gc_window and gc_step got them before device_mask (their last field), and the header's
    launches_lost took a reserved word. The new fields read 0, as in a census of that time."""
    head = ffi.offsetof("gc_segment", "devices")
    out = bytearray(data[:head])
    out[8:16] = LAYOUT_VERSION.to_bytes(4, "little") + SEGMENT_SIZE.to_bytes(4, "little")
    at = head
    # (struct, slots, its size in layout 3, bytes kept at its end: device_mask)
    for ctype, n, old, tail in (("gc_device", 16, ffi.sizeof("gc_device") - 16, 0),
                                ("gc_window", 2048, ffi.sizeof("gc_window") - 24, 8),
                                ("gc_step", 1024, ffi.sizeof("gc_step") - 24, 8)):
        keep = ffi.offsetof(ctype, "eager_launches")
        for _ in range(n):
            row = data[at:at + old]
            out += row[:keep] + bytes(ffi.sizeof(ctype) - keep - tail) + row[old - tail:]
            at += old
    assert at == len(data) and len(out) == SEGMENT_SIZE
    return bytes(out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("explain")
    with tarfile.open(ARCHIVE) as tar:
        tar.extractall(root, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    for seg in root.rglob("*.seg"):
        seg.write_bytes(upgrade_v3(seg.read_bytes()))
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
