"""The sidecar of ``otel-gpu-census run``: the census (and NVML) instruments of a server's process
tree, exported from the launcher's own process as the OTEL_* variables and flags say (``setup``)."""
from __future__ import annotations

import logging
from typing import Callable, List, Mapping, Optional

from otel_gpu_census.census import ProcessCensus
from otel_gpu_census.telemetry.census_metrics import CENSUS_INSTRUMENTS, CensusMetrics, register_census_instruments, segment_source
from otel_gpu_census.telemetry.specs import METER_NAME

log = logging.getLogger("otel_gpu_census.metrics")


class Sidecar:
    """Handle on the running exporters; :meth:`stop` sends the last values and closes everything."""

    def __init__(self, provider=None, exporting=None, census: Optional[CensusMetrics] = None, nvml=None):
        self._provider = provider
        self._exporting = exporting
        self.census = census
        self.nvml = nvml
        self._stopped = False

    @property
    def active(self) -> bool:
        return self._provider is not None

    @property
    def meter_provider(self):
        """The provider the sidecar exports through (None when inactive): other instruments of this
        process (the proxy's under ``run --proxy``) go out on it too."""
        return self._provider

    def descriptions(self) -> List[str]:
        """'metrics → …' lines saying where the metrics go."""
        from otel_gpu_census.telemetry.setup import metrics_descriptions
        return metrics_descriptions(self._exporting)

    @property
    def prometheus_port(self) -> Optional[int]:
        return self._exporting.prometheus_port if self._exporting else None

    def describe(self) -> str:
        if not self.active:
            return "metrics: not exported (no exporter configured)"
        return "metrics: " + "; ".join(self._exporting.descriptions)

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self.census is not None:
            self.census.refresh()     # the last export carries the final totals written at exit
        if self._exporting is not None and self._exporting.otlp is not None:
            self._exporting.otlp.stopping()
        try:
            if self._provider is not None:
                self._provider.shutdown(timeout_millis=timeout_s * 1000)
        except Exception as e:
            log.warning("metrics: stopping the exporters: %s: %s", type(e).__name__, e)
        if self._exporting is not None:
            self._exporting.close()
        if self.nvml is not None:
            self.nvml.close()

    def __enter__(self) -> "Sidecar":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def own_views() -> list:
    """Views for the sidecar's own instruments (census and NVML: all observable, read in the
    exporter's thread, outside any span): no exemplar reservoir. The SDK's default one is
    created for every series and collected at every collection although it can never hold an
    exemplar here (~10 % of the SDK's collection). Other instruments on the same provider (the
    proxy's request histograms under ``run --proxy``, recorded inside spans) keep theirs."""
    from opentelemetry.sdk.metrics import ExemplarReservoir
    from opentelemetry.sdk.metrics.view import View
    from otel_gpu_census.telemetry.nvml import NVML_INSTRUMENTS

    class NoExemplars(ExemplarReservoir):
        def offer(self, value, time_unix_nano, attributes, context) -> None:
            pass

        def collect(self, point_attributes) -> list:
            return []

    return [View(instrument_name=spec.name, meter_name=meter, exemplar_reservoir_factory=lambda _agg: NoExemplars)
            for meter, specs in ((METER_NAME, CENSUS_INSTRUMENTS), (METER_NAME + ".nvml", NVML_INSTRUMENTS))
            for spec in specs]


def start_sidecar(census_dir, root_pid: Optional[int] = None, exporter: Optional[str] = None,
                  prometheus_port: Optional[int] = None, interval_s: Optional[float] = None, *,
                  parents: Optional[Mapping[int, int]] = None, nvml: bool = True,
                  source: Optional[Callable[[], List[ProcessCensus]]] = None) -> Sidecar:
    """Export the census of `root_pid`'s process tree (all of `census_dir` when None) from this process.

    `exporter` is ``otlp``, ``prometheus``, ``console``, ``none`` or None (follow OTEL_* env vars;
    see ``telemetry.setup``). With nothing configured the handle is inactive and costs nothing. Readings
    happen in the exporters' background threads (the periodic reader, or the Prometheus scrape).
    An exporter that cannot start, or NVML that cannot be read, costs a warning, never the run.
    `parents` ({pid: ppid}, may keep changing) helps place processes whose parent already exited.
    `source` replaces the segment folder (tests, or a caller with its own census source).
    Raises ``setup.ConfigError`` only for an invalid explicit `exporter` or interval.
    """
    from otel_gpu_census.telemetry import setup as _exp

    names = _exp.choose_exporters(exporter)
    if not names:
        return Sidecar()
    exporting = _exp.build_readers(names, prometheus_port=prometheus_port, interval_s=interval_s)
    if not exporting.readers:
        return Sidecar()
    from opentelemetry.sdk.metrics import MeterProvider
    provider = MeterProvider(metric_readers=exporting.readers, resource=_exp.make_resource(), views=own_views())
    sampler = None
    if nvml:
        from otel_gpu_census.telemetry import nvml as _nvml
        sampler = _nvml.register_nvml_instruments(provider)
    # the GPUs NVML knows get their model, device node and driver on the census series too
    state = register_census_instruments(provider, source or segment_source(census_dir, root_pid, parents),
                                        known_gpus=sampler.known_gpus() if sampler is not None else None)
    handle = Sidecar(provider, exporting, state, sampler)
    log.info("%s", handle.describe())
    return handle
