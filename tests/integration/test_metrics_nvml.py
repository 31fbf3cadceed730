"""NVML instruments on a real GPU (skipped without one): every NVML name the docs list is emitted,
with the GPU's UUID as hw.id and values in range; GPM ones where the GPU supports GPM."""
from __future__ import annotations

import importlib.util
import os
import selectors
import subprocess
import sys
import tempfile
import time

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel_gpu_census.telemetry import nvml
from otel_gpu_census.telemetry.sidecar import start_sidecar
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


# The load: warm up (cuBLAS init, first kernels), say "busy <uuid>", then matmuls back to back
# until killed (at most argv[1] seconds). Python and torch start-up take seconds on a fresh
# machine: sampling must start after "busy", not after a guessed sleep.
_MATMUL_LOOP = r"""
import sys, time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
for _ in range(5):
    a @ a
torch.cuda.synchronize()
uuid = getattr(torch.cuda.get_device_properties(0), "uuid", "")
print("busy", f"GPU-{uuid}" if uuid else "?", flush=True)
end = time.time() + float(sys.argv[1])
while time.time() < end:
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
"""


def _wait_line(proc, timeout_s: float) -> str:
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        return proc.stdout.readline().strip() if sel.select(timeout_s) else ""
    finally:
        sel.close()


def _nvidia_smi_util() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=uuid,utilization.gpu", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return f"(nvidia-smi: {e})"


def test_gpm_sees_a_matmul_loop(sampler_rig):
    """A bf16 matmul loop in a child process: nvidia-smi's utilisation and GPM's SM utilisation
    are both clearly above idle over an interval in which the loop is known to run. (The numbers
    are evidence for docs/measurements.md; run with -s to see them.)"""
    sampler, reader = sampler_rig
    if not any(d.gpm for d in sampler.devices):
        pytest.skip("no GPU here supports GPM")
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed: no load to measure")
    t0 = time.monotonic()
    errors = tempfile.TemporaryFile("w+")     # a file, not a pipe: warnings can never block the load
    load = subprocess.Popen([sys.executable, "-c", _MATMUL_LOOP, "120"], stdout=subprocess.PIPE,
                            stderr=errors, text=True)
    diag = {}
    try:
        line = _wait_line(load, 180)
        diag["load start-up s"] = round(time.monotonic() - t0, 2)
        if not line.startswith("busy"):
            load.kill()
            load.wait()
            errors.seek(0)
            pytest.fail(f"the matmul loop never got busy ({diag}); its stderr:\n{errors.read()[-3000:]}")
        load_uuid = line.split()[1]
        time.sleep(0.5)
        _collect(reader)                   # the GPM interval starts here, with the loop running
        t1 = time.monotonic()
        time.sleep(2.0)
        smi = _nvidia_smi_util()
        data = _collect(reader)
        diag["sampled interval s"] = round(time.monotonic() - t1, 2)
        diag["loop still running at the end"] = load.poll() is None
    finally:
        if load.poll() is None:
            load.kill()
        load.wait()
        errors.seek(0)
        err = errors.read()
        errors.close()
    values = {}
    for name in ("hw.gpu.utilization", "gpu_census.sm.utilization", "gpu_census.sm.occupancy"):
        for attrs, v, _ in data.get(name, []):
            values.setdefault(attrs["hw.id"], {})[name] = v
    gpu = load_uuid if load_uuid in values else max(
        values, key=lambda u: values[u].get("hw.gpu.utilization", 0), default=None)
    got = values.get(gpu, {})
    util, sm, occ = (got.get(k) for k in ("hw.gpu.utilization", "gpu_census.sm.utilization",
                                           "gpu_census.sm.occupancy"))
    report = (f"matmul loop on {gpu} (the load said {load_uuid}): hw.gpu.utilization {util}  SM utilisation {sm}  "
              f"SM occupancy {occ}\n  every GPU: {values}\n  nvidia-smi during the interval: {smi}\n"
              f"  {diag}\n  GPM: " + "; ".join(f"{d.uuid} gpm={d.gpm} {d.gpm_why}" for d in sampler.devices)
              + (f"\n  load stderr: {err[-1500:]}" if err.strip() else ""))
    print(report)
    assert diag["loop still running at the end"], report
    assert util is not None and sm is not None and occ is not None, report
    assert util > 0.5 and sm > 0.3 and 0 < occ <= 1, report


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
