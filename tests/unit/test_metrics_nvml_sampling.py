"""The NVML sampler's arithmetic on a CPU, against a stand-in for pynvml whose GPM samples are
cumulative counters on a controlled clock: SM utilisation and occupancy are averages over the
interval between two collections (older sample first), utilisation is a fraction, and both GPM
instruments of one collection share one interval."""
from __future__ import annotations

import types

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

    def __init__(self, clock, load, occupancy=0.14, gpm=True):
        self.clock, self.load, self.occupancy, self.gpm = clock, load, occupancy, gpm
        self.metric_calls = []

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

    def nvmlDeviceGetPcieThroughput(self, handle, which):
        return 1000

    def nvmlShutdown(self):
        pass


def _rig(monkeypatch, load, gpm=True):
    clock = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(nvml, "time", types.SimpleNamespace(monotonic=lambda: clock.now))
    fake = FakeNvml(clock, load, gpm=gpm)
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
        return out
    return fake, collect


def test_gpm_values_average_the_interval_between_collections(monkeypatch):
    fake, collect = _rig(monkeypatch, load=lambda t: 1.0 if 1.0 <= t < 3.0 else 0.0)   # busy from 1 s to 3 s
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
    fake, collect = _rig(monkeypatch, load=lambda t: 1.0 if t >= 1.0 else 0.0)
    assert collect(2.0)["gpu_census.sm.utilization"] == 0.5
    assert collect(2.0 + nvml.GPM_MIN_INTERVAL_S / 2)["gpu_census.sm.utilization"] == 0.5
    assert len(fake.metric_calls) == 1
    assert collect(4.0)["gpu_census.sm.utilization"] == 1.0       # measured from 2.0, not from 2.05


def test_no_gpm_no_sm_instruments(monkeypatch):
    _, collect = _rig(monkeypatch, load=lambda t: 1.0, gpm=False)
    got = collect(1.0)
    assert "gpu_census.sm.utilization" not in got and got["hw.gpu.utilization"] == 1.0
