"""The NVML sampler's arithmetic on a CPU, against a stand-in for pynvml whose GPM samples are
cumulative counters on a controlled clock: SM utilisation and occupancy are averages over the
interval between two collections (older sample first), utilisation is a fraction, and both GPM
instruments of one collection share one interval. PCIe throughput comes from the cumulative byte
counters (one field-values call a collection), or from the 20 ms sample where they are missing, taken
at most every PCIE_SAMPLE_EVERY_S and repeated by the collections in between."""
from __future__ import annotations

import collections
import types

import pytest

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel_gpu_census.telemetry import nvml


class FakeNvml:
    """What NvmlSampler calls of pynvml. `load(t)` is the GPU's busy fraction at time t."""

    NVML_SUCCESS = 0
    NVML_GPM_METRICS_GET_VERSION = 1
    NVML_GPM_METRIC_SM_UTIL = 2
    NVML_GPM_METRIC_SM_OCCUPANCY = 3
    NVML_PCIE_UTIL_TX_BYTES, NVML_PCIE_UTIL_RX_BYTES = 0, 1
    NVML_FI_DEV_PCIE_COUNT_TX_BYTES, NVML_FI_DEV_PCIE_COUNT_RX_BYTES = 197, 198
    NVML_ERROR_NOT_SUPPORTED = 3

    def __init__(self, clock, load, occupancy=0.14, gpm=True, pcie_fields=True, value_type=3):
        self.clock, self.load, self.occupancy, self.gpm = clock, load, occupancy, gpm
        self.metric_calls = []
        self.calls = collections.Counter()
        self.pcie_fields, self.value_type = pcie_fields, value_type
        # cumulative bytes at time t: 1 GB/s into the GPU and 2 MB/s out of it
        self.rx_bytes = lambda t: int(1e9 * t)
        self.tx_bytes = lambda t: int(2e6 * t)

    def __getattribute__(self, name):
        attr = object.__getattribute__(self, name)
        if not name.startswith("nvml"):
            return attr
        calls = object.__getattribute__(self, "calls")

        def counted(*args, **kwargs):       # calls counted, not look-ups
            calls[name] += 1
            return attr(*args, **kwargs)
        return counted

    def _busy_integral(self, t):          # seconds of busy time up to t, in 1 ms steps
        return sum(self.load(i / 1000) for i in range(int(t * 1000))) / 1000

    # GPM
    def nvmlGpmQueryDeviceSupport(self, handle):
        return types.SimpleNamespace(isSupportedDevice=int(self.gpm))

    def nvmlGpmSampleAlloc(self):
        return types.SimpleNamespace(t=None, busy=None)

    def nvmlGpmSampleFree(self, sample):
        pass

    def nvmlGpmSampleGet(self, handle, sample):
        sample.t = self.clock.now
        sample.busy = self._busy_integral(self.clock.now)

    def c_nvmlGpmMetricsGet_t(self):
        metric = lambda: types.SimpleNamespace(metricId=0, nvmlReturn=None, value=None)   # noqa: E731
        return types.SimpleNamespace(version=0, numMetrics=0, sample1=None, sample2=None,
                                     metrics=[metric() for _ in range(4)])

    def nvmlGpmMetricsGet(self, mg):
        assert mg.version == self.NVML_GPM_METRICS_GET_VERSION
        s1, s2 = mg.sample1, mg.sample2
        self.metric_calls.append((s1.t, s2.t))
        if s2.t <= s1.t:
            raise RuntimeError("NVML: samples out of order")
        util = (s2.busy - s1.busy) / (s2.t - s1.t)
        for m in mg.metrics[:mg.numMetrics]:
            m.nvmlReturn = self.NVML_SUCCESS
            m.value = 100 * (util if m.metricId == self.NVML_GPM_METRIC_SM_UTIL else util * self.occupancy)
        return mg

    # the rest
    def nvmlDeviceGetUtilizationRates(self, handle):
        return types.SimpleNamespace(gpu=round(100 * self.load(self.clock.now)))

    def nvmlDeviceGetMemoryInfo(self, handle):
        return types.SimpleNamespace(used=2**30, total=141 * 2**30)

    pcie_kbps = 1000          # what the 20 ms sample says, KB/s

    def nvmlDeviceGetPcieThroughput(self, handle, which):
        return self.pcie_kbps

    def nvmlDeviceGetFieldValues(self, handle, field_ids):
        out = []
        for fid in field_ids:
            ok = self.pcie_fields and fid in (self.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, self.NVML_FI_DEV_PCIE_COUNT_RX_BYTES)
            v = (self.rx_bytes if fid == self.NVML_FI_DEV_PCIE_COUNT_RX_BYTES else self.tx_bytes)(self.clock.now)
            out.append(types.SimpleNamespace(
                fieldId=fid, timestamp=int(self.clock.now * 1e6) + 1_700_000_000_000_000, valueType=self.value_type,
                nvmlReturn=self.NVML_SUCCESS if ok else self.NVML_ERROR_NOT_SUPPORTED,
                value=types.SimpleNamespace(ullVal=v if ok else 0, uiVal=(v if ok else 0) % 2**32)))
        return out

    def nvmlShutdown(self):
        pass


def _rig(monkeypatch, load, gpm=True, pcie_fields=True, fake_hook=None):
    clock = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(nvml, "time", types.SimpleNamespace(monotonic=lambda: clock.now,
                                                            time=lambda: 1_700_000_000 + clock.now))
    fake = FakeNvml(clock, load, gpm=gpm, pcie_fields=pcie_fields)
    if fake_hook is not None:
        fake_hook(fake)
    sampler = nvml.NvmlSampler(fake, [nvml._Device(0, "h0", "GPU-0", "H200")], driver="580")
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    sampler.register(provider)

    def collect(at):
        clock.now = at
        out = {}
        for rm in reader.get_metrics_data().resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    for dp in m.data.data_points:
                        out[m.name] = dp.value
                        if "network.io.direction" in dp.attributes:
                            out[(m.name, dp.attributes["network.io.direction"])] = dp.value
        return out
    return fake, collect, sampler


def test_gpm_values_average_the_interval_between_collections(monkeypatch):
    fake, collect, _ = _rig(monkeypatch, load=lambda t: 1.0 if 1.0 <= t < 3.0 else 0.0)   # busy from 1 s to 3 s
    first = collect(2.0)              # pairs with the sample taken at registration (t=0)
    assert first["gpu_census.sm.utilization"] == 0.5
    assert abs(first["gpu_census.sm.occupancy"] - 0.07) < 1e-9
    assert first["hw.gpu.utilization"] == 1.0
    second = collect(3.0)
    assert second["gpu_census.sm.utilization"] == 1.0
    third = collect(5.0)
    assert third["gpu_census.sm.utilization"] == 0.0 and third["hw.gpu.utilization"] == 0.0
    # one GPM interval per collection (both instruments share it), older sample first
    assert fake.metric_calls == [(0.0, 2.0), (2.0, 3.0), (3.0, 5.0)]


def test_collections_closer_than_the_gpm_minimum_keep_the_previous_values(monkeypatch):
    fake, collect, _ = _rig(monkeypatch, load=lambda t: 1.0 if t >= 1.0 else 0.0)
    assert collect(2.0)["gpu_census.sm.utilization"] == 0.5
    assert collect(2.0 + nvml.GPM_MIN_INTERVAL_S / 2)["gpu_census.sm.utilization"] == 0.5
    assert len(fake.metric_calls) == 1
    assert collect(4.0)["gpu_census.sm.utilization"] == 1.0       # measured from 2.0, not from 2.05


def test_no_gpm_no_sm_instruments(monkeypatch):
    _, collect, _ = _rig(monkeypatch, load=lambda t: 1.0, gpm=False)
    got = collect(1.0)
    assert "gpu_census.sm.utilization" not in got and got["hw.gpu.utilization"] == 1.0


PCIE = "gpu_census.pcie.throughput"


def test_pcie_throughput_is_the_byte_counters_averaged_between_collections(monkeypatch):
    fake, collect, sampler = _rig(monkeypatch, load=lambda t: 0.0)
    assert sampler.devices[0].pcie == nvml.PCIE_COUNTERS
    # 1 GB/s in for the first 2 s, then 3 GB/s
    fake.rx_bytes = lambda t: int(1e9 * t) if t <= 2.0 else int(2e9 + 3e9 * (t - 2.0))
    first = collect(2.0)
    assert first[(PCIE, "receive")] == pytest.approx(1e9) and first[(PCIE, "transmit")] == pytest.approx(2e6)
    second = collect(4.0)
    assert second[(PCIE, "receive")] == pytest.approx(3e9)
    # never the 20 ms throughput sample; one field-values call a collection for both directions
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 0
    assert fake.calls["nvmlDeviceGetFieldValues"] == 3          # at start, then once a collection


def test_nvml_calls_per_collection(monkeypatch):
    """Per GPU and collection: utilisation, memory info once (the limit is read once, at the first
    collection), the PCIe counters in one call, a GPM sample and its metrics: nothing else."""
    fake, collect, _ = _rig(monkeypatch, load=lambda t: 0.5)
    collect(1.0)
    fake.calls.clear()
    got = collect(2.0)
    assert got["hw.gpu.memory.limit"] == 141 * 2**30
    assert dict(fake.calls) == {"nvmlDeviceGetUtilizationRates": 1, "nvmlDeviceGetMemoryInfo": 1,
                                "nvmlDeviceGetFieldValues": 1, "nvmlGpmSampleGet": 1, "nvmlGpmMetricsGet": 1}


def test_a_wrapped_counter_leaves_that_direction_out_once(monkeypatch):
    fake, collect, _ = _rig(monkeypatch, load=lambda t: 0.0)
    assert collect(1.0)[(PCIE, "receive")] == pytest.approx(1e9)
    fake.rx_bytes = lambda t: int(1e9 * (t - 1.5))       # went back: wrapped (or the driver reset it)
    got = collect(2.0)
    assert (PCIE, "receive") not in got and got[(PCIE, "transmit")] == pytest.approx(2e6)
    assert collect(3.0)[(PCIE, "receive")] == pytest.approx(1e9)


def test_collections_closer_than_the_minimum_keep_the_previous_pcie_values(monkeypatch):
    fake, collect, _ = _rig(monkeypatch, load=lambda t: 0.0)
    fake.rx_bytes = lambda t: int(1e9 * t) if t <= 2.0 else int(2e9 + 5e9 * (t - 2.0))
    assert collect(2.0)[(PCIE, "receive")] == pytest.approx(1e9)
    assert collect(2.0 + nvml.GPM_MIN_INTERVAL_S / 2)[(PCIE, "receive")] == pytest.approx(1e9)
    assert collect(3.0)[(PCIE, "receive")] == pytest.approx(5e9)         # measured from 2.0


@pytest.mark.parametrize("why", ["unsupported", "old_pynvml", "32-bit"])
def test_without_the_byte_counters_the_20ms_sample_is_used_decided_once(monkeypatch, why):
    def hook(fake):
        if why == "old_pynvml":
            monkeypatch.delattr(FakeNvml, "NVML_FI_DEV_PCIE_COUNT_RX_BYTES")
        if why == "32-bit":
            fake.value_type = 1        # NVML_VALUE_TYPE_UNSIGNED_INT
    fake, collect, sampler = _rig(monkeypatch, load=lambda t: 0.0, pcie_fields=why != "unsupported",
                                  fake_hook=hook)
    d = sampler.devices[0]
    assert d.pcie == nvml.PCIE_SAMPLE and d.pcie_why
    fake.calls.clear()
    for t in (1.0, 2.0, 3.0):
        got = collect(t)
        assert got[(PCIE, "receive")] == 1000 * 1024 and got[(PCIE, "transmit")] == 1000 * 1024
    # sampled once (both directions) at the first collection, repeated within PCIE_SAMPLE_EVERY_S
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 2 and fake.calls["nvmlDeviceGetFieldValues"] == 0


def test_the_20ms_sample_is_taken_at_most_every_pcie_sample_every_s(monkeypatch):
    fake, collect, sampler = _rig(monkeypatch, load=lambda t: 0.0, pcie_fields=False)
    every = nvml.PCIE_SAMPLE_EVERY_S
    assert sampler.pcie_sample_every_s == every and every > 1.0
    got, calls = {}, []
    for k in range(1, 12):            # one collection a second for 11 s; the traffic changes every second
        fake.pcie_kbps = 1000 * k
        got[k] = collect(float(k))[(PCIE, "receive")]
        calls.append(fake.calls["nvmlDeviceGetPcieThroughput"])
    # sampled at 1 s, 6 s and 11 s (both directions each time); the collections between repeat it
    assert [got[k] // 1024 for k in range(1, 12)] == [1000] * 5 + [6000] * 5 + [11000]
    assert calls == [2] * 5 + [4] * 5 + [6]


def test_a_failed_20ms_sample_is_retried_at_the_next_collection(monkeypatch):
    fake, collect, sampler = _rig(monkeypatch, load=lambda t: 0.0, pcie_fields=False)
    real = FakeNvml.nvmlDeviceGetPcieThroughput
    monkeypatch.setattr(FakeNvml, "nvmlDeviceGetPcieThroughput",
                        lambda self, h, w: (_ for _ in ()).throw(RuntimeError("GPU is lost")))
    assert (PCIE, "receive") not in collect(1.0)
    monkeypatch.setattr(FakeNvml, "nvmlDeviceGetPcieThroughput", real)
    assert collect(2.0)[(PCIE, "receive")] == 1000 * 1024          # not held off for 5 s by the failure


def _points(monkeypatch, **kw):
    """{(name, direction or None): (value, attributes)} of one collection at t = 2 s."""
    fake, _, sampler = _rig(monkeypatch, load=lambda t: 0.5, **kw)
    reader = InMemoryMetricReader()
    sampler.register(MeterProvider(metric_readers=[reader]))
    sampler._nvml.clock.now = 2.0
    out = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for dp in m.data.data_points:
                    out[(m.name, dp.attributes.get("network.io.direction"))] = (dp.value, dict(dp.attributes))
    return fake, out


def test_hw_gpu_io_is_the_gpus_own_pcie_bytes_as_a_counter(monkeypatch):
    """hw.gpu.io as the hardware conventions mean it: what the GPU received and transmitted, all
    processes (NVML's cumulative PCIe byte counters), read with the throughput's one call."""
    fake, got = _points(monkeypatch)
    assert got[("hw.gpu.io", "receive")][0] == 2_000_000_000 and got[("hw.gpu.io", "transmit")][0] == 4_000_000
    assert fake.calls["nvmlDeviceGetFieldValues"] == 2          # at start, then once for both instruments


@pytest.mark.parametrize("kw", [dict(pcie_fields=False), dict(fake_hook=lambda f: setattr(f, "value_type", 1))],
                         ids=["no counters", "32-bit counters"])
def test_no_hw_gpu_io_without_64_bit_counters(monkeypatch, kw):
    _, got = _points(monkeypatch, **kw)
    assert not [k for k in got if k[0] == "hw.gpu.io"] and ("gpu_census.pcie.throughput", "receive") in got


def test_every_nvml_series_names_its_gpu_as_the_hardware_conventions_ask(monkeypatch):
    _, got = _points(monkeypatch)
    assert {k[0] for k in got} >= {"hw.gpu.utilization", "hw.gpu.memory.usage", "hw.gpu.memory.limit", "hw.gpu.io",
                                   "gpu_census.pcie.throughput", "gpu_census.sm.utilization"}
    for (name, _), (_, attrs) in got.items():
        assert {k: v for k, v in attrs.items() if k.startswith("hw.") and k != "hw.gpu.task"} == {
            "hw.id": "GPU-0", "hw.type": "gpu", "hw.vendor": "NVIDIA", "hw.model": "H200",
            "hw.driver_version": "580"}, name


def test_the_device_node_is_the_gpus_hw_name(monkeypatch):
    fake = FakeNvml(types.SimpleNamespace(now=0.0), load=lambda t: 0.0)
    fake.nvmlDeviceGetMinorNumber = lambda h: 3
    assert nvml._node(fake, "h") == "nvidia3"
    sampler = nvml.NvmlSampler(fake, [nvml._Device(0, "h0", "GPU-0", "NVIDIA H200", nvml._node(fake, "h0"))],
                               driver="580.159.04")
    assert sampler.known_gpus() == {"GPU-0": {"hw.model": "NVIDIA H200", "hw.name": "nvidia3",
                                              "hw.driver_version": "580.159.04"}}
    del fake.nvmlDeviceGetMinorNumber                           # an NVML that cannot say: no hw.name
    assert nvml._node(fake, "h") == ""
