"""NVML instruments on a real GPU (skipped without one): every NVML name the docs list is emitted,
with the GPU's UUID as hw.id and values in range; GPM ones where the GPU supports GPM."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel_gpu_census import nvml
from otel_gpu_census.metrics import start_sidecar
from otlp_receiver import OtlpReceiver

pytestmark = pytest.mark.gpu


@pytest.fixture
def sampler_rig():
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    sampler = nvml.register_nvml_instruments(provider)
    assert sampler is not None, f"NVML unusable on a GPU machine: {nvml.open_nvml()[1]}"
    yield sampler, reader
    provider.shutdown()
    sampler.close()


def _collect(reader):
    out = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for dp in m.data.data_points:
                    out.setdefault(m.name, []).append((dict(dp.attributes), dp.value, m.unit))
    return out


def test_every_nvml_instrument_emitted_per_gpu(sampler_rig):
    sampler, reader = sampler_rig
    _collect(reader)              # GPM: the first collection pairs with the sample taken at start
    time.sleep(0.5)
    data = _collect(reader)
    uuids = {d.uuid for d in sampler.devices}
    assert all(u.startswith("GPU-") for u in uuids)
    want = [s for s in nvml.NVML_INSTRUMENTS if s in sampler.specs()]
    if any(d.gpm for d in sampler.devices):
        assert want == list(nvml.NVML_INSTRUMENTS)
    for spec in want:
        rows = data.get(spec.name)
        assert rows, f"{spec.name} not emitted"
        gpus = {a["hw.id"] for a, _, _ in rows}
        expect = {d.uuid for d in sampler.devices if d.gpm} if spec in nvml.GPM_INSTRUMENTS else uuids
        assert gpus == expect, spec.name
        for attrs, value, unit in rows:
            assert unit == spec.unit and set(attrs) == set(spec.attributes), spec.name
            if spec.unit == "1":
                assert 0.0 <= value <= 1.0, (spec.name, value)
            else:
                assert value >= 0, (spec.name, value)
    util = data["hw.gpu.utilization"]
    assert all(a["hw.gpu.task"] == "general" for a, _, _ in util)
    limit = {a["hw.id"]: v for a, v, _ in data["hw.gpu.memory.limit"]}
    used = {a["hw.id"]: v for a, v, _ in data["hw.gpu.memory.usage"]}
    assert all(0 <= used[u] <= limit[u] and limit[u] > 2**30 for u in uuids)


def test_gpm_sees_a_matmul_loop(sampler_rig):
    """A bf16 matmul loop in a child process: nvidia-smi's utilisation and GPM's SM utilisation
    are both clearly above idle. (The numbers themselves are evidence for docs/measurements.md.)"""
    sampler, reader = sampler_rig
    if not any(d.gpm for d in sampler.devices):
        pytest.skip("no GPU here supports GPM")
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed: no load to measure")
    load = subprocess.Popen([sys.executable, "-c",
                             "import torch,time\n"
                             "a=torch.randn(8192,8192,device='cuda',dtype=torch.bfloat16)\n"
                             "t=time.time()\n"
                             "while time.time()-t<4: a@a\n"
                             "torch.cuda.synchronize()\n"])
    try:
        time.sleep(1.5)
        _collect(reader)
        time.sleep(1.5)
        data = _collect(reader)
    finally:
        load.wait(30)
    d0 = sampler.devices[0].uuid
    util = next(v for a, v, _ in data["hw.gpu.utilization"] if a["hw.id"] == d0)
    sm = next(v for a, v, _ in data["gpu_census.sm.utilization"] if a["hw.id"] == d0)
    occ = next(v for a, v, _ in data["gpu_census.sm.occupancy"] if a["hw.id"] == d0)
    print(f"matmul loop: hw.gpu.utilization {util:.3f}  SM utilisation {sm:.3f}  SM occupancy {occ:.3f}")
    assert util > 0.5 and sm > 0.3 and 0 < occ <= 1


def test_sidecar_exports_nvml_next_to_census(census_dir, monkeypatch):
    for k in list(os.environ):
        if k.startswith("OTEL_"):
            monkeypatch.delenv(k)
    with OtlpReceiver(http_enabled=False) as rx:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rx.grpc_endpoint)
        handle = start_sidecar(census_dir, interval_s=0.3)
        try:
            pts = rx.wait_for(lambda p: {"hw.gpu.utilization", "hw.gpu.memory.usage"} <= {x.name for x in p})
        finally:
            handle.stop()
    assert all(p.attributes["hw.id"].startswith("GPU-") for p in pts if p.name == "hw.gpu.utilization")
