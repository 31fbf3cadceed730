"""NVML instruments on a real GPU (skipped without one): every NVML name the docs list is emitted,
with the GPU's UUID as hw.id and values in range; GPM ones where the GPU supports GPM; PCIe
throughput from NVML's byte counters where the GPU has them, agreeing with a copy loop's own count."""
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

from otel_gpu_census.telemetry import nvml, specs
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
    assert set(nvml.BASE_INSTRUMENTS) <= set(want)
    # GPM and 64-bit PCIe byte counters are each there or not per GPU (one GPU may have GPM and not the counters)
    assert (set(nvml.GPM_INSTRUMENTS) <= set(want)) == any(d.gpm for d in sampler.devices)
    assert (set(nvml.IO_INSTRUMENTS) <= set(want)) == any(d.pcie == nvml.PCIE_COUNTERS for d in sampler.devices)
    for spec in want:
        rows = data.get(spec.name)
        assert rows, f"{spec.name} not emitted"
        gpus = {a["hw.id"] for a, _, _ in rows}
        expect = {d.uuid for d in sampler.devices if d.gpm} if spec in nvml.GPM_INSTRUMENTS else uuids
        assert gpus == expect, spec.name
        for attrs, value, unit in rows:
            # the required attributes, and of the recommended ones only what NVML told of the GPU
            assert unit == spec.unit and set(spec.attributes) <= set(attrs), spec.name
            assert set(attrs) - set(spec.attributes) <= {specs.HW_MODEL, specs.HW_NAME, specs.HW_DRIVER}, spec.name
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


# Host-to-device copies from pinned memory back to back; after warming up it says "busy", then one
# line "<wall time> <bytes copied so far>" per batch, until killed (at most argv[1] seconds).
_COPY_LOOP = r"""
import sys, time, torch
n = 256 << 20
h = torch.empty(n, dtype=torch.uint8).pin_memory()
d = torch.empty(n, dtype=torch.uint8, device="cuda")
for _ in range(3):
    d.copy_(h, non_blocking=True)
torch.cuda.synchronize()
print("busy", flush=True)
end, copied = time.time() + float(sys.argv[1]), 0
print(time.time(), copied, flush=True)
while time.time() < end:
    for _ in range(4):
        d.copy_(h, non_blocking=True)
    torch.cuda.synchronize()
    copied += 4 * n
    print(time.time(), copied, flush=True)
"""


def test_pcie_counters_chosen_where_nvml_has_them(sampler_rig):
    """The once-per-GPU decision agrees with what NVML answers for the two byte-counter fields: counters
    where both answer with a 64-bit value, else the throughput sample (an r580 driver answers
    with 32-bit values, which wrap every 4 GiB)."""
    sampler, _ = sampler_rig
    n = sampler._nvml
    for d in sampler.devices:
        ids = [getattr(n, name, None) for name, _ in nvml.PCIE_FIELDS]
        if None in ids:
            assert d.pcie == nvml.PCIE_SAMPLE, d.pcie_why
            continue
        got = n.nvmlDeviceGetFieldValues(d.handle, ids)
        supported = all(f.nvmlReturn == n.NVML_SUCCESS and f.valueType in nvml._WIDE for f in got)
        print(f"GPU {d.index} {d.name} driver {sampler.driver}: PCIe {d.pcie} {d.pcie_why}")
        assert d.pcie == (nvml.PCIE_COUNTERS if supported else nvml.PCIE_SAMPLE), d.pcie_why


def test_pcie_counters_see_a_host_to_device_copy_loop(sampler_rig):
    """A pinned host-to-device copy loop in a child process: the receive throughput the counters give
    over a 2 s interval is about the bytes the loop copied in it per second (bytes, not KiB; into the
    GPU is receive), and well above transmit. Run with -s to see the figures."""
    sampler, reader = sampler_rig
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed: no load to measure")
    counted = [d for d in sampler.devices if d.pcie == nvml.PCIE_COUNTERS]
    if not counted:
        pytest.skip("no GPU here has NVML's PCIe byte counters: " + "; ".join(d.pcie_why for d in sampler.devices))
    errors = tempfile.TemporaryFile("w+")
    load = subprocess.Popen([sys.executable, "-c", _COPY_LOOP, "120"], stdout=subprocess.PIPE, stderr=errors,
                            text=True)
    try:
        if _wait_line(load, 180) != "busy":
            load.kill()
            load.wait()
            errors.seek(0)
            pytest.fail(f"the copy loop never got busy; its stderr:\n{errors.read()[-3000:]}")
        time.sleep(0.5)
        _collect(reader)
        t1 = time.time()
        time.sleep(2.0)
        data = _collect(reader)
        t2 = time.time()
        running = load.poll() is None
    finally:
        if load.poll() is None:
            load.kill()
        out, _ = load.communicate()
        errors.close()
    marks = [tuple(map(float, line.split())) for line in out.splitlines() if len(line.split()) == 2]
    before = max((m for m in marks if m[0] <= t1), default=None)
    after = min((m for m in marks if m[0] >= t2), default=None)
    assert running and before is not None and after is not None, (running, len(marks))
    loop_rate = (after[1] - before[1]) / (after[0] - before[0])
    rates = {}
    for attrs, value, _ in data.get("gpu_census.pcie.throughput", []):
        rates.setdefault(attrs["hw.id"], {})[attrs["network.io.direction"]] = value
    d = counted[0] if len(counted) == 1 else max(counted, key=lambda g: rates.get(g.uuid, {}).get("receive", 0))
    got = rates.get(d.uuid, {})
    report = (f"copy loop {loop_rate / 1e9:.2f} GB/s host to device; NVML counters on {d.uuid}: receive "
              f"{got.get('receive', 0) / 1e9:.2f} GB/s, transmit {got.get('transmit', 0) / 1e9:.3f} GB/s; every GPU: {rates}")
    print(report)
    assert loop_rate > 1e9, report
    # the counters cover all PCIe traffic (descriptors, the loop's syncs) and an interval a little
    # off the loop's own marks: within 30 % below and 50 % above
    assert 0.7 * loop_rate <= got.get("receive", 0) <= 1.5 * loop_rate, report
    assert got.get("transmit", 0) < 0.2 * got["receive"], report


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
