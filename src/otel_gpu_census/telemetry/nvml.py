"""What NVML says about each GPU, as OTel instruments next to the census's numbers.

* ``hw.gpu.utilization`` (``hw.gpu.task=general``) is nvidia-smi's "GPU-Util": the fraction of
  time *any* kernel ran. It reads 90%+ for a loop of tiny kernels that leave the SMs idle.
* ``gpu_census.sm.utilization`` and ``gpu_census.sm.occupancy`` come from NVML GPM (GPU
  Performance Monitoring, Hopper and newer): the fraction of SMs busy, and of warp slots
  occupied, averaged between two samples — here, between two collections.
* memory used and total (``hw.gpu.memory.usage``/``.limit``; the total is read once), the GPU's PCIe
  traffic as a counter (``hw.gpu.io``, only where those counters are 64-bit) and PCIe throughput
  (``gpu_census.pcie.throughput``): from NVML's cumulative PCIe byte counters
  (``NVML_FI_DEV_PCIE_COUNT_TX_BYTES``/``RX_BYTES``, both in one ``nvmlDeviceGetFieldValues`` call),
  averaged between two collections like GPM; where a GPU or driver lacks those fields (decided once,
  at start), ``nvmlDeviceGetPcieThroughput``'s 20 ms sample instead, which costs ~1 ms of CPU (and
  20 ms of wall time) per direction: it is taken at most every ``PCIE_SAMPLE_EVERY_S`` (5 s), and the
  collections in between re-report the last sample.

NVML missing or failing costs one warning; the instruments it would feed are simply absent (or
skip the failing GPU), the census's own instruments are unaffected. Nothing here raises.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Dict, List, Optional, Tuple

from opentelemetry.metrics import CallbackOptions, Observation

from otel_gpu_census.version import __version__
from otel_gpu_census.telemetry.specs import GPU, HW_DRIVER, HW_MODEL, HW_NAME, IO_DIRECTION, METER_NAME, Spec, create_observable, \
    gpu_attributes

log = logging.getLogger("otel_gpu_census.metrics")

HW_GPU_TASK = "hw.gpu.task"

BASE_INSTRUMENTS: Tuple[Spec, ...] = (
    Spec("hw.gpu.utilization", "gauge", "1", GPU + (HW_GPU_TASK,),
         "nvidia-smi's GPU utilisation: fraction of the last sample period in which any kernel ran."),
    Spec("hw.gpu.memory.usage", "updowncounter", "By", GPU, "GPU memory in use (NVML)."),
    Spec("hw.gpu.memory.limit", "updowncounter", "By", GPU, "GPU memory size (NVML)."),
    Spec("gpu_census.pcie.throughput", "gauge", "By/s", GPU + (IO_DIRECTION,),
         "PCIe traffic, all processes (receive = into the GPU): NVML's byte counters averaged since the "
         "previous collection, or where the GPU lacks them NVML's 20 ms sample, taken at most every 5 s "
         "(the collections in between repeat the last one)."),
)
# Only where NVML has 64-bit PCIe byte counters (a narrower one wraps too often to make a counter)
IO_INSTRUMENTS: Tuple[Spec, ...] = (
    Spec("hw.gpu.io", "counter", "By", GPU + (IO_DIRECTION,),
         "Bytes the GPU received (receive) and transmitted (transmit) over PCIe, all processes: NVML's "
         "cumulative byte counters."),
)
GPM_INSTRUMENTS: Tuple[Spec, ...] = (
    Spec("gpu_census.sm.utilization", "gauge", "1", GPU,
         "NVML GPM: fraction of SMs busy, averaged since the previous collection."),
    Spec("gpu_census.sm.occupancy", "gauge", "1", GPU,
         "NVML GPM: fraction of the SMs' warp slots occupied, averaged since the previous collection."),
)
NVML_INSTRUMENTS = BASE_INSTRUMENTS + IO_INSTRUMENTS + GPM_INSTRUMENTS

GPM_MIN_INTERVAL_S = 0.1     # NVML wants GPM samples at least this far apart
# The cumulative PCIe byte counters, by the name nvidia-ml-py gives their field ids, and the
# direction each is (NVML's transmit is out of the GPU).
PCIE_FIELDS = (("NVML_FI_DEV_PCIE_COUNT_RX_BYTES", "receive"), ("NVML_FI_DEV_PCIE_COUNT_TX_BYTES", "transmit"))
PCIE_COUNTERS, PCIE_SAMPLE = "counters", "sample"     # _Device.pcie: how its PCIe traffic is read
# Where the counters are missing: the 20 ms throughput sample (~1 ms of CPU per direction, the largest
# NVML cost of a collection) is taken at most this often; the collections in between repeat it.
PCIE_SAMPLE_EVERY_S = 5.0


def _text(v) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


# nvmlValue_t's member for each nvmlValueType_t
_VALUE_MEMBER = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}
_WIDE = (2, 3, 4)      # unsigned long (64-bit on Linux), unsigned and signed long long


def _field_value(f) -> int:
    """The number in an nvmlFieldValue_t, by its value type."""
    return int(getattr(f.value, _VALUE_MEMBER.get(f.valueType, "ullVal")))


class _Device:
    __slots__ = ("index", "handle", "uuid", "name", "node", "gpm", "gpm_why", "prev", "cur", "prev_t", "gpm_values",
                 "memory_total", "pcie", "pcie_why", "pcie_ids", "pcie_prev", "pcie_t", "pcie_values",
                 "pcie_sample_t", "pcie_read_at")

    def __init__(self, index, handle, uuid, name, node: str = ""):
        self.index, self.handle, self.uuid, self.name = index, handle, uuid, name
        self.node = node                            # "nvidia<minor>" ("" when NVML did not say)
        self.gpm = False
        self.gpm_why = ""
        self.prev = self.cur = None
        self.prev_t = 0.0
        self.gpm_values: Dict[int, float] = {}
        self.memory_total: Optional[int] = None     # read once: it does not change
        self.pcie = PCIE_SAMPLE
        self.pcie_why = ""                          # why the counters are not used
        self.pcie_ids: Tuple[int, ...] = ()
        self.pcie_prev: Tuple[int, ...] = ()        # the counters at pcie_t
        self.pcie_t = 0.0
        self.pcie_values: Dict[str, float] = {}     # direction -> bytes/s over the last interval
        self.pcie_sample_t: Optional[float] = None  # monotonic time of the last 20 ms sample (PCIE_SAMPLE)
        self.pcie_read_at: Optional[float] = None   # monotonic time of the last counter read of a collection


class NvmlSampler:
    """NVML handles, GPM samples, and the callbacks that read them. Use :func:`open_nvml`."""

    def __init__(self, nvml, devices: List[_Device], driver: str, pcie_sample_every_s: float = PCIE_SAMPLE_EVERY_S):
        self._nvml = nvml
        self.pcie_sample_every_s = pcie_sample_every_s
        self.devices = devices
        self.driver = driver
        self._lock = threading.Lock()
        self._warned: set = set()
        self._closed = False
        self._known = self.known_gpus()
        for d in devices:
            self._init_gpm(d)
            self._init_pcie(d)

    # -- PCIe byte counters ---------------------------------------------------------------
    def _read_pcie_counters(self, d: _Device, got=None) -> Tuple[Tuple[int, ...], float]:
        """(RX, TX byte counters, when NVML read them in seconds) in one call (or from `got`, that
        call's answer); raises when either field failed."""
        n = self._nvml
        if got is None:
            got = n.nvmlDeviceGetFieldValues(d.handle, list(d.pcie_ids))
        for f in got:
            if f.nvmlReturn != n.NVML_SUCCESS:
                raise getattr(n, "NVMLError", RuntimeError)(f.nvmlReturn)
        ts = [f.timestamp for f in got]
        # NVML stamps each value (µs, wall clock); without stamps, now
        t = max(ts) / 1e6 if all(x > 0 for x in ts) else time.time()
        return tuple(_field_value(f) for f in got), t

    def _init_pcie(self, d: _Device) -> None:
        """Counters where this nvidia-ml-py knows the fields and the GPU answers both, else the
        20 ms throughput sample. Decided once per GPU."""
        n = self._nvml
        ids = tuple(getattr(n, name, None) for name, _ in PCIE_FIELDS)
        if None in ids or not hasattr(n, "nvmlDeviceGetFieldValues"):
            d.pcie_why = "this nvidia-ml-py has no PCIe byte counter fields"
            return
        d.pcie_ids = ids
        try:
            got = n.nvmlDeviceGetFieldValues(d.handle, list(ids))
            narrow = [f.valueType for f in got if f.nvmlReturn == n.NVML_SUCCESS and f.valueType not in _WIDE]
            d.pcie_prev, d.pcie_t = self._read_pcie_counters(d, got)
        except Exception as e:
            d.pcie_why = f"PCIe byte counters not readable: {_text(e)}"
            return
        if narrow:     # a 32-bit byte counter wraps every ~0.1 s at PCIe Gen5 speed: useless at 1 s
            d.pcie_why = f"PCIe byte counters are not 64-bit (NVML value type {narrow[0]})"
            return
        d.pcie = PCIE_COUNTERS

    def _pcie_counters(self, d: _Device) -> Dict[str, float]:
        """Bytes/s per direction between the previous read and now (the counters themselves: d.pcie_prev).
        Within GPM_MIN_INTERVAL_S of the previous read (another instrument or reader collected just now)
        NVML is not asked again; a read NVML did not stamp that much later keeps the previous values; a
        direction whose counter went back (wrapped) is left out for that interval."""
        now = time.monotonic()
        if d.pcie_read_at is not None and now - d.pcie_read_at < GPM_MIN_INTERVAL_S:
            return d.pcie_values
        d.pcie_read_at = now
        cur, t = self._read_pcie_counters(d)
        dt = t - d.pcie_t
        if dt < GPM_MIN_INTERVAL_S:
            return d.pcie_values
        d.pcie_values = {direction: (c - p) / dt
                         for (_, direction), c, p in zip(PCIE_FIELDS, cur, d.pcie_prev) if c >= p}
        d.pcie_prev, d.pcie_t = cur, t
        return d.pcie_values

    def _pcie_sample(self, d: _Device) -> Dict[str, float]:
        """NVML's 20 ms throughput sample per direction (bytes/s), taken again only once
        `pcie_sample_every_s` has passed since the last one; in between, the last one. A failed
        sample raises and is retried at the next collection."""
        now = time.monotonic()
        if d.pcie_sample_t is not None and now - d.pcie_sample_t < self.pcie_sample_every_s:
            return d.pcie_values
        n = self._nvml       # NVML reports KB/s (1 KB = 1024 bytes)
        d.pcie_values = {"receive": n.nvmlDeviceGetPcieThroughput(d.handle, n.NVML_PCIE_UTIL_RX_BYTES) * 1024,
                         "transmit": n.nvmlDeviceGetPcieThroughput(d.handle, n.NVML_PCIE_UTIL_TX_BYTES) * 1024}
        d.pcie_sample_t = now
        return d.pcie_values

    # -- GPM ------------------------------------------------------------------------------
    def _init_gpm(self, d: _Device) -> None:
        n = self._nvml
        try:
            if not n.nvmlGpmQueryDeviceSupport(d.handle).isSupportedDevice:
                d.gpm_why = "this GPU does not support GPM (it needs Hopper or newer)"
                return
            d.prev, d.cur = n.nvmlGpmSampleAlloc(), n.nvmlGpmSampleAlloc()
            n.nvmlGpmSampleGet(d.handle, d.prev)
            d.prev_t = time.monotonic()
            d.gpm = True
        except Exception as e:
            d.gpm_why = f"GPM not usable: {_text(e)}"
            self._free(d)

    def _free(self, d: _Device) -> None:
        for s in (d.prev, d.cur):
            if s is not None:
                try:
                    self._nvml.nvmlGpmSampleFree(s)
                except Exception:
                    pass
        d.prev = d.cur = None

    def _gpm_sample(self, d: _Device) -> None:
        """Average SM utilisation and occupancy between the previous sample and now."""
        n = self._nvml
        now = time.monotonic()
        if now - d.prev_t < GPM_MIN_INTERVAL_S:
            return                    # another reader collected just now: keep those values
        n.nvmlGpmSampleGet(d.handle, d.cur)
        mg = n.c_nvmlGpmMetricsGet_t()
        mg.version = n.NVML_GPM_METRICS_GET_VERSION
        mg.numMetrics = 2
        mg.sample1, mg.sample2 = d.prev, d.cur
        ids = (n.NVML_GPM_METRIC_SM_UTIL, n.NVML_GPM_METRIC_SM_OCCUPANCY)
        for i, mid in enumerate(ids):
            mg.metrics[i].metricId = mid
        n.nvmlGpmMetricsGet(mg)
        values = {}
        for i, mid in enumerate(ids):
            if mg.metrics[i].nvmlReturn == n.NVML_SUCCESS:
                values[mid] = max(0.0, min(1.0, mg.metrics[i].value / 100.0))
        d.gpm_values = values
        d.prev, d.cur, d.prev_t = d.cur, d.prev, now

    # -- callbacks ------------------------------------------------------------------------
    def known_gpus(self) -> Dict[str, Dict[str, str]]:
        """{hw.id: the recommended hw.* attributes NVML knows of that GPU}: for every series of it."""
        out = {}
        for d in self.devices:
            known = {HW_MODEL: d.name, HW_NAME: d.node, HW_DRIVER: self.driver}
            out[d.uuid] = {k: v for k, v in known.items() if v}
        return out

    def _gpu(self, d: _Device) -> Dict[str, str]:
        return gpu_attributes(d.uuid, self._known)

    def _warn_once(self, key: str, msg: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    def _each(self, what: str, fn, gpm: bool = False) -> List[Observation]:
        out: List[Observation] = []
        with self._lock:
            if self._closed:
                return out
            for d in self.devices:
                if gpm and not d.gpm:
                    continue
                try:
                    out.extend(fn(d))
                except Exception as e:       # one GPU failing must not hide the others
                    self._warn_once(f"{what}:{d.index}", "metrics: NVML %s on GPU %d (%s) failed: %s",
                                    what, d.index, d.uuid, _text(e))
        return out

    def _utilization(self, options: CallbackOptions) -> List[Observation]:
        return self._each("utilization", lambda d: [Observation(
            self._nvml.nvmlDeviceGetUtilizationRates(d.handle).gpu / 100.0,
            {**self._gpu(d), HW_GPU_TASK: "general"})])

    def _memory_usage(self, options: CallbackOptions) -> List[Observation]:
        return self._each("memory", lambda d: [Observation(
            int(self._nvml.nvmlDeviceGetMemoryInfo(d.handle).used), self._gpu(d))])

    def _memory_limit(self, options: CallbackOptions) -> List[Observation]:
        def read(d):
            if d.memory_total is None:
                d.memory_total = int(self._nvml.nvmlDeviceGetMemoryInfo(d.handle).total)
            return [Observation(d.memory_total, self._gpu(d))]
        return self._each("memory", read)

    def _pcie(self, options: CallbackOptions) -> List[Observation]:
        def read(d):
            values = self._pcie_counters(d) if d.pcie == PCIE_COUNTERS else self._pcie_sample(d)
            return [Observation(v, {**self._gpu(d), IO_DIRECTION: k}) for k, v in values.items()]
        return self._each("PCIe throughput", read)

    def _io(self, options: CallbackOptions) -> List[Observation]:
        def read(d):
            if d.pcie != PCIE_COUNTERS:
                return []
            self._pcie_counters(d)          # the counters as last read (at most GPM_MIN_INTERVAL_S old)
            return [Observation(v, {**self._gpu(d), IO_DIRECTION: direction})
                    for (_, direction), v in zip(PCIE_FIELDS, d.pcie_prev)]
        return self._each("PCIe byte counters", read)

    def _gpm(self, metric_attr: str):
        def cb(options: CallbackOptions) -> List[Observation]:
            mid = getattr(self._nvml, metric_attr)

            def read(d):
                self._gpm_sample(d)
                v = d.gpm_values.get(mid)
                return [] if v is None else [Observation(v, self._gpu(d))]
            return self._each("GPM", read, gpm=True)
        return cb

    def callbacks(self):
        return {
            "hw.gpu.utilization": self._utilization,
            "hw.gpu.memory.usage": self._memory_usage,
            "hw.gpu.memory.limit": self._memory_limit,
            "gpu_census.pcie.throughput": self._pcie,
            "hw.gpu.io": self._io,
            "gpu_census.sm.utilization": self._gpm("NVML_GPM_METRIC_SM_UTIL"),
            "gpu_census.sm.occupancy": self._gpm("NVML_GPM_METRIC_SM_OCCUPANCY"),
        }

    def specs(self) -> Tuple[Spec, ...]:
        """The instruments this machine can feed: hw.gpu.io only if some GPU has 64-bit PCIe byte counters,
        GPM ones only if some GPU supports GPM."""
        return BASE_INSTRUMENTS + (IO_INSTRUMENTS if any(d.pcie == PCIE_COUNTERS for d in self.devices) else ()) \
            + (GPM_INSTRUMENTS if any(d.gpm for d in self.devices) else ())

    def register(self, meter_provider) -> List[str]:
        meter = meter_provider.get_meter(METER_NAME + ".nvml", __version__)
        cbs = self.callbacks()
        names = []
        for spec in self.specs():
            create_observable(meter, spec, cbs[spec.name])
            names.append(spec.name)
        return names

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for d in self.devices:
                self._free(d)
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass


def _node(n, handle) -> str:
    """The GPU's device node name, "nvidia<minor>"; "" where NVML cannot say (it is only a name)."""
    try:
        return f"nvidia{int(n.nvmlDeviceGetMinorNumber(handle))}"
    except Exception:
        return ""


def open_nvml() -> Tuple[Optional[NvmlSampler], str]:
    """(sampler, "") or (None, why NVML cannot be used here). Never raises."""
    try:
        import pynvml as n
    except Exception as e:
        return None, f"the nvidia-ml-py package is not importable ({type(e).__name__}: {e})"
    try:
        n.nvmlInit()
    except Exception as e:
        return None, f"NVML cannot start: {_text(e)} (no NVIDIA driver here?)"
    try:
        driver = _text(n.nvmlSystemGetDriverVersion())
        devices = []
        for i in range(n.nvmlDeviceGetCount()):
            h = n.nvmlDeviceGetHandleByIndex(i)
            devices.append(_Device(i, h, _text(n.nvmlDeviceGetUUID(h)), _text(n.nvmlDeviceGetName(h)), _node(n, h)))
    except Exception as e:
        try:
            n.nvmlShutdown()
        except Exception:
            pass
        return None, f"NVML cannot list the GPUs: {_text(e)}"
    if not devices:
        n.nvmlShutdown()
        return None, "NVML sees no GPU"
    return NvmlSampler(n, devices, driver), ""


def register_nvml_instruments(meter_provider) -> Optional[NvmlSampler]:
    """Register the NVML instruments this machine supports; None (one warning) when NVML is unusable.
    Call ``.close()`` on the result when done."""
    sampler, why = open_nvml()
    if sampler is None:
        log.warning("metrics: NVML instruments off: %s; census metrics still flow", why)
        return None
    try:
        sampler.register(meter_provider)
    except Exception as e:
        log.warning("metrics: NVML instruments off: %s: %s", type(e).__name__, e)
        sampler.close()
        return None
    for d in sampler.devices:
        if not d.gpm:
            log.info("metrics: no SM utilisation/occupancy for GPU %d (%s): %s", d.index, d.uuid, d.gpm_why)
        if d.pcie != PCIE_COUNTERS:
            log.info("metrics: no hw.gpu.io for GPU %d (%s), and its PCIe throughput is NVML's 20 ms sample, taken "
                     "every %g s (~2 ms of CPU each): %s", d.index, d.uuid, sampler.pcie_sample_every_s, d.pcie_why)
    return sampler
