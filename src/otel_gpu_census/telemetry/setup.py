"""The tracer and meter providers, configured by the OpenTelemetry SDK's own environment handling.

Exporter names come from ``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER`` (comma-separated) and are
found as the SDK's configurator (and ``opentelemetry-instrument``) finds them: in the
``opentelemetry_traces_exporter`` / ``opentelemetry_metrics_exporter`` entry points, ``otlp`` as
``OTEL_EXPORTER_OTLP_[TRACES_|METRICS_]PROTOCOL`` says (``grpc`` by default, ``http/protobuf``), so any
exporter installed for the SDK works here. Each exporter reads its own ``OTEL_EXPORTER_*`` variables
(endpoint, headers, timeout, TLS); the periodic reader ``OTEL_METRIC_EXPORT_INTERVAL``; the resource
``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES``. ``OTEL_SDK_DISABLED=true``: nothing is exported
and nothing is announced but that.

Where this differs from the SDK, and why:

- unset variables: traces go by ``otlp`` (spans are what the proxy and the engine hooks are for);
  metrics go nowhere unless ``OTEL_EXPORTER_OTLP_[METRICS_]ENDPOINT`` is set (a census run nobody
  asked to export should not try a network). ``run --exporter`` wins over ``OTEL_METRICS_EXPORTER``;
- ``prometheus`` is a scrape endpoint of our own on ``OTEL_EXPORTER_PROMETHEUS_HOST``:``_PORT``
  (localhost:9464) or ``run --prometheus-port``, with a registry of its own, rather than the SDK's
  reader, which serves prometheus_client's global registry on a port nobody is told about;
- a collector that is down costs one warning per outage and signal (and a note when it is back),
  never a log line per retry, and a stop never waits out the exporter's retries;
- ``service.name`` defaults to the server the telemetry describes (``vllm``, ``sglang``, the proxy's upstream
  process), else ``otel-gpu-census`` (``run``'s census metrics).

:func:`build_telemetry` makes both providers and says where each signal goes (``traces → …``,
``metrics → …``); :func:`engine_telemetry` takes the providers an instrumentor was given, else the
application's (an SDK provider set globally, as ``opentelemetry-instrument`` does), else builds them.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Callable, List, Mapping, Optional, Tuple

from opentelemetry.sdk.metrics.export import (
    MetricExporter,
    MetricExportResult,
    MetricReader,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

log = logging.getLogger("otel_gpu_census.metrics")
trace_log = logging.getLogger("otel_gpu_census.traces")

# `run --exporter`'s choices; OTEL_METRICS_EXPORTER takes any name the SDK knows
EXPORTER_NAMES = ("otlp", "prometheus", "console", "none")
DEFAULT_SERVICE_NAME = "otel-gpu-census"
DEFAULT_PROMETHEUS_HOST = "localhost"
DEFAULT_PROMETHEUS_PORT = 9464
ENV_BY_SIGNAL = {"traces": "OTEL_TRACES_EXPORTER", "metrics": "OTEL_METRICS_EXPORTER"}
OTLP_PROTOCOL_BY_ENTRY_POINT = {"otlp_proto_grpc": "grpc", "otlp_proto_http": "http/protobuf"}

# Loggers of the OTel OTLP exporters (both signals) whose per-attempt failure lines the quiet
# exporters replace with one warning per outage.
_OTLP_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.proto.http.metric_exporter",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http._common",
    "opentelemetry.exporter.http_transport",
)
_FAILURE_PREFIXES = ("Failed to export", "Transient error", "Shutdown in progress", "Exporter already shutdown",
                     "Request failed", "Failed to send")


class ConfigError(ValueError):
    """An exporter setting that cannot be honoured; the message says which and what is allowed."""


def sdk_disabled(env: Mapping[str, str] = os.environ) -> bool:
    """OTEL_SDK_DISABLED=true, as the SDK reads it (its providers then hand out no-op tracers and meters)."""
    return env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


def exporter_names(signal: str, explicit: Optional[str] = None, env: Mapping[str, str] = os.environ) -> List[str]:
    """The exporters asked for `signal` ("traces" or "metrics"), in order, without repeats; [] for none
    (``none`` anywhere in the list, as the SDK reads it). The defaults in the module docstring."""
    if sdk_disabled(env):
        return []
    if explicit:
        name = explicit.strip().lower()
        if name not in EXPORTER_NAMES:
            raise ConfigError(f"unknown metrics exporter {explicit!r}; choose one of {', '.join(EXPORTER_NAMES)}")
        return [] if name == "none" else [name]
    raw = env.get(ENV_BY_SIGNAL[signal], "").strip()
    if not raw:
        if signal == "traces" or env.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            return ["otlp"]
        return []
    names = list(dict.fromkeys(n.strip().lower() for n in raw.split(",") if n.strip()))
    return [] if "none" in names else names


def choose_exporters(explicit: Optional[str] = None, env: Mapping[str, str] = os.environ) -> List[str]:
    """The metrics exporters (``run``'s sidecar): :func:`exporter_names` of metrics."""
    return exporter_names("metrics", explicit, env)


def exporter_class(name: str, signal: str):
    """(the class the SDK's configurator would use for exporter `name` of `signal`, its entry point name).
    Raises RuntimeError for a name no installed package provides or an unknown OTLP protocol, ImportError
    for an exporter package that is installed but broken."""
    from opentelemetry.sdk._configuration import _get_exporter_entry_point, _import_exporters
    entry = _get_exporter_entry_point(name, signal)
    traces, metrics, _ = _import_exporters([entry] if signal == "traces" else [],
                                           [entry] if signal == "metrics" else [], [])
    return (traces if signal == "traces" else metrics)[entry], entry


def make_resource(service_name: str = DEFAULT_SERVICE_NAME) -> Resource:
    """OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME (via the SDK), service.name defaulting to `service_name`."""
    resource = Resource.create()       # reads both variables from os.environ
    # Without either, the SDK names the service "unknown_service[:<executable>]".
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: service_name or DEFAULT_SERVICE_NAME}))
    return resource


# -------------------------------------------------------------------------------------------
# OTLP with one warning per outage

class _DropRetryChatter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        try:
            msg = str(record.msg)
        except Exception:       # never let a log filter raise
            return True
        return not msg.startswith(_FAILURE_PREFIXES)


_chatter_filter = _DropRetryChatter()
_filter_lock = threading.Lock()


def _install_chatter_filter() -> None:
    with _filter_lock:
        for name in _OTLP_LOGGERS:
            lg = logging.getLogger(name)
            if _chatter_filter not in lg.filters:
                lg.addFilter(_chatter_filter)


class _Outage:
    """One warning when a collector stops answering, one when it is back: never one per batch."""

    def __init__(self, what: str, items: str, target: str, logger: logging.Logger, carry_on: str = ""):
        self.what, self.items, self.target, self.log, self.carry_on = what, items, target, logger, carry_on
        self.down = False

    def result(self, ok: bool, err: str = "") -> None:
        if ok:
            if self.down:
                self.log.warning("%s: export to %s works again", self.what, self.target)
            self.down = False
        else:
            if not self.down:
                self.log.warning("%s: cannot export to %s%s; dropping %s until it answers%s", self.what,
                                 self.target, f" ({err})" if err else "", self.items, self.carry_on)
            self.down = True


class QuietExporter(MetricExporter):
    """Delegates to an OTLP exporter; turns failures into one warning per outage.

    At stop (:meth:`stopping`), an exporter that is down or stuck retrying is shut down at once
    (its retry ladder can take the whole OTLP timeout) and the final export is skipped: a run
    should not wait on a collector that is not there.
    """

    def __init__(self, inner: MetricExporter, target: str):
        super().__init__(preferred_temporality=inner._preferred_temporality,
                         preferred_aggregation=inner._preferred_aggregation)
        self._inner = inner
        self.target = target
        self._outage = _Outage("metrics", "metrics", target, log, " (the run carries on)")
        self.failures = 0
        self.successes = 0
        self._stopping = False
        self._inner_closed = False
        self._idle = threading.Event()
        self._idle.set()
        self._close_lock = threading.Lock()

    def _close_inner(self, timeout_millis: float = 30_000) -> None:
        with self._close_lock:
            if self._inner_closed:
                return
            self._inner_closed = True
        try:
            self._inner.shutdown(timeout_millis=timeout_millis)
        except Exception:
            pass

    def stopping(self, wait_s: float = 2.0) -> None:
        """The run is ending: let an export in flight finish briefly, else abandon it."""
        self._stopping = True
        if not self._idle.wait(wait_s) or self.down:
            self._close_inner()

    def export(self, metrics_data, timeout_millis: float = 10_000, **kwargs) -> MetricExportResult:
        if self._inner_closed or (self._stopping and self.down):
            return MetricExportResult.FAILURE
        self._idle.clear()
        try:
            result = self._inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
            err = ""
        except Exception as e:       # an exporter bug must not reach the SDK's thread as a traceback
            result = MetricExportResult.FAILURE
            err = f"{type(e).__name__}: {e}"
        finally:
            self._idle.set()
        ok = result == MetricExportResult.SUCCESS
        if ok:
            self.successes += 1
        else:       # also an export abandoned at stop: its values did not arrive either
            self.failures += 1
        self._outage.result(ok, err)
        return result

    @property
    def down(self) -> bool:
        return self._outage.down

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        try:
            return self._inner.force_flush(timeout_millis=timeout_millis)
        except Exception:
            return False

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        self._close_inner(timeout_millis)


class QuietSpanExporter(SpanExporter):
    """Delegates to an OTLP span exporter; turns failures into one warning per outage."""

    def __init__(self, inner: SpanExporter, target: str):
        self.inner, self.target = inner, target
        self._outage = _Outage("traces", "spans", target, trace_log)

    @property
    def down(self) -> bool:
        return self._outage.down

    def export(self, spans) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
            err = ""
        except Exception as e:
            result, err = SpanExportResult.FAILURE, f"{type(e).__name__}: {e}"
        self._outage.result(result == SpanExportResult.SUCCESS, err)
        return result

    def shutdown(self) -> None:
        try:
            self.inner.shutdown()
        except Exception:
            pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        try:
            return self.inner.force_flush(timeout_millis)
        except Exception:
            return False


def _made(name: str, signal: str):
    """(the exporter or reader for `name`, where it sends): the SDK's class, made as the SDK makes it;
    OTLP wrapped to warn once per outage."""
    cls, entry = exporter_class(name, signal)
    # the console exporters' default stream is sys.stdout as it was when the SDK was imported
    proto = OTLP_PROTOCOL_BY_ENTRY_POINT.get(entry)
    if entry == "console":
        exporter = cls(out=sys.stdout)
    elif proto is not None and proto.startswith("http"):
        from otel_gpu_census.telemetry.bounded_http import session_kwargs
        exporter = cls(**session_kwargs())          # a collector's answer read up to a bound
    else:
        exporter = cls()
    if proto is None:
        return exporter, "console (stdout)" if entry == "console" else entry
    target = f"OTLP {proto} {getattr(exporter, '_endpoint', '') or 'default endpoint'}"
    _install_chatter_filter()
    quiet = QuietExporter(exporter, target) if signal == "metrics" else QuietSpanExporter(exporter, target)
    return quiet, target


# -------------------------------------------------------------------------------------------
# metrics

@dataclass
class Exporting:
    """What build_readers made: readers for the MeterProvider and how to tear down the rest."""

    readers: List[MetricReader] = field(default_factory=list)
    descriptions: List[str] = field(default_factory=list)
    otlp: Optional[QuietExporter] = None
    prometheus_port: Optional[int] = None
    _closers: List[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        run_closers(self._closers)


def run_closers(closers: List[Callable[[], None]]) -> None:
    """Call each closer once, in order; one that fails does not keep the others from running."""
    for fn in closers:
        try:
            fn()
        except Exception:
            pass
    closers.clear()


def build_readers(names: List[str], prometheus_port: Optional[int] = None,
                  interval_s: Optional[float] = None) -> Exporting:
    """Metric readers for `names`. An exporter that cannot start (a port in use, a missing package, a
    name nothing provides) is left out with one warning; the others still run. `interval_s` (else
    OTEL_METRIC_EXPORT_INTERVAL, as the SDK reads it) is the export period."""
    if interval_s is not None and not interval_s > 0:
        raise ConfigError(f"metrics export interval must be > 0 seconds, got {interval_s}")
    out = Exporting()
    interval_ms = None if interval_s is None else float(interval_s) * 1000.0
    for name in names:
        try:
            if name == "prometheus":
                _add_prometheus(out, prometheus_port)
                continue
            made, target = _made(name, "metrics")
            if isinstance(made, MetricReader):       # a pull exporter another package provides
                out.readers.append(made)
                out.descriptions.append(target)
                continue
            reader = PeriodicExportingMetricReader(made, export_interval_millis=interval_ms)
            if isinstance(made, QuietExporter):
                out.otlp = made
            out.readers.append(reader)
            every = getattr(reader, "_export_interval_millis", None)
            out.descriptions.append(target + (f" every {every / 1000:g} s" if every else ""))
        except Exception as e:
            log.warning("metrics: %s exporter not started: %s", name, _why(e))
    return out


def _why(e: BaseException) -> str:
    return str(e) if isinstance(e, RuntimeError) else f"{type(e).__name__}: {e}"


def _add_prometheus(out: Exporting, port: Optional[int]) -> None:
    from otel_gpu_census.extras import missing
    lacking = missing("prometheus")
    if lacking:
        raise RuntimeError(lacking)
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import CollectorRegistry, start_http_server

    host = os.environ.get("OTEL_EXPORTER_PROMETHEUS_HOST") or DEFAULT_PROMETHEUS_HOST
    if port is None:
        raw = os.environ.get("OTEL_EXPORTER_PROMETHEUS_PORT")
        try:
            port = int(raw) if raw else DEFAULT_PROMETHEUS_PORT
        except ValueError:
            log.warning("OTEL_EXPORTER_PROMETHEUS_PORT=%r is not a port number; using %d",
                        raw, DEFAULT_PROMETHEUS_PORT)
            port = DEFAULT_PROMETHEUS_PORT
    if not 0 <= port <= 65535:
        raise ConfigError(f"Prometheus port {port} is out of range 0..65535")
    # A private registry: nothing else in this process ends up on our endpoint, and two sidecars
    # in one process (tests) do not collide in prometheus_client's global one.
    registry = CollectorRegistry(auto_describe=False)
    try:
        httpd, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        log.warning("metrics: Prometheus endpoint not started: cannot listen on %s:%d (%s)",
                    host, port, e.strerror or e)
        return
    reader = PrometheusMetricReader(registry=registry)
    out.readers.append(reader)
    out.prometheus_port = httpd.server_address[1]
    out.descriptions.append(f"Prometheus http://{host}:{out.prometheus_port}/metrics")

    def close() -> None:
        httpd.shutdown()
        httpd.server_close()
    out._closers.append(close)


def metrics_descriptions(out: Optional[Exporting]) -> List[str]:
    """'metrics → …' lines for what build_readers made (one line saying none when nothing)."""
    if sdk_disabled():
        return ["metrics → none (OTEL_SDK_DISABLED=true)"]
    if out is None or not out.readers:
        return ["metrics → none (set OTEL_METRICS_EXPORTER or OTEL_EXPORTER_OTLP_ENDPOINT)"]
    return [f"metrics → {d}" for d in out.descriptions]


# -------------------------------------------------------------------------------------------
# both signals

# Longest a stop waits for the last spans and metrics to leave. An OTLP exporter retries for up to
# OTEL_EXPORTER_OTLP_TIMEOUT (10 s) per signal: with the collector down, a proxy's stop took 15-21 s.
SHUTDOWN_S = 2.0


@dataclass
class Telemetry:
    """A tracer provider and a meter provider, where each signal goes, and how to shut them down."""

    tracer_provider: object
    meter_provider: object
    descriptions: List[str] = field(default_factory=list)     # one line per signal: "traces → …"
    _closers: List[Callable[[], None]] = field(default_factory=list)

    def shutdown(self, timeout_s: float = SHUTDOWN_S) -> None:
        """Flush and close what this set-up made, for at most `timeout_s`: a collector that is down or
        does not answer costs what was still unsent, never a stuck stop. The flush runs in a daemon
        thread that is left behind (and ends with the process) when it overstays."""
        if not self._closers:
            return
        done = threading.Thread(target=run_closers, args=(self._closers,), name="otel-gpu-census-telemetry-stop",
                                daemon=True)
        done.start()
        done.join(timeout_s)
        if done.is_alive():
            trace_log.warning("telemetry: the collector did not take the last spans and metrics within %g s; "
                              "stopping without them", timeout_s)


def _span_processors(tp: TracerProvider) -> List[str]:
    """The span exporters the environment asks for, on `tp`; their 'traces → …' lines."""
    if sdk_disabled():
        return ["traces → none (OTEL_SDK_DISABLED=true)"]
    names = exporter_names("traces")
    if not names:
        return ["traces → none (OTEL_TRACES_EXPORTER=none)"]
    out = []
    for name in names:
        try:
            exporter, target = _made(name, "traces")
        except Exception as e:
            trace_log.warning("traces: %s exporter not started: %s", name, _why(e))
            continue
        tp.add_span_processor(BatchSpanProcessor(exporter))
        out.append(f"traces → {target}")
    return out or ["traces → none (no exporter could start)"]


def build_telemetry(traces: bool = True, metrics: bool = True, metric_names: Optional[List[str]] = None,
                    service_name: str = DEFAULT_SERVICE_NAME) -> Telemetry:
    """Both providers, from the environment. With traces/metrics False that provider exports nothing
    (the caller brings its own); `metric_names` replaces OTEL_METRICS_EXPORTER's choice; `service_name`: the
    service.name where neither OTEL_SERVICE_NAME nor OTEL_RESOURCE_ATTRIBUTES names one."""
    from opentelemetry.sdk.metrics import MeterProvider

    if os.environ.get("OTEL_CONFIG_FILE"):
        log.warning("OTEL_CONFIG_FILE is not read here: the OTEL_* variables configure these providers (under "
                    "opentelemetry-instrument the vLLM and SGLang hooks use the application's, configured from it)")
    resource = make_resource(service_name)
    # shutdown_on_exit off: Telemetry.shutdown (bounded) is the one shutdown; the SDK's own at exit
    # would wait on the same stuck exporter again, unbounded
    tp = TracerProvider(resource=resource, shutdown_on_exit=False)
    desc: List[str] = _span_processors(tp) if traces else []
    closers: List[Callable[[], None]] = [tp.shutdown]
    readers: List[MetricReader] = []
    if metrics:
        out = build_readers(exporter_names("metrics") if metric_names is None else metric_names)
        readers = out.readers
        desc.extend(metrics_descriptions(out))
        closers.append(out.close)
    mp = MeterProvider(resource=resource, metric_readers=readers, shutdown_on_exit=False)
    closers.insert(1, mp.shutdown)
    return Telemetry(tp, mp, desc, closers)


def application_providers() -> Tuple[Optional[object], Optional[object]]:
    """The SDK providers the application set as the global ones (``opentelemetry-instrument`` does, from
    the same OTEL_* variables), else None each."""
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    tp, mp = trace.get_tracer_provider(), metrics.get_meter_provider()
    return (tp if isinstance(tp, TracerProvider) else None, mp if isinstance(mp, MeterProvider) else None)


def providers_in_process(tracer_provider=None, meter_provider=None) -> bool:
    """Whether spans must be made in this process: the providers are objects of this process (given to
    an instrumentor, or the application's), which a settling child process could not reach."""
    return tracer_provider is not None or meter_provider is not None or application_providers() != (None, None)


def engine_telemetry(tracer_provider=None, meter_provider=None, service_name: str = DEFAULT_SERVICE_NAME) -> Telemetry:
    """Providers for an engine process (vLLM's EngineCore, an SGLang scheduler): each signal's provider
    given to the instrumentor, else the application's (:func:`application_providers`), else built from the
    environment. Request metrics built here go by OTLP or the console only: a Prometheus port is ``run``'s
    sidecar's (which serves the census metrics) and a second server on it would fail."""
    app_tp, app_mp = application_providers()
    tp, mp = tracer_provider or app_tp, meter_provider or app_mp
    names = exporter_names("metrics") if mp is None else []
    if "prometheus" in names:
        log.info("engine: request metrics are not served on the Prometheus port (the sidecar holds "
                 "it); send them by OTLP (OTEL_METRICS_EXPORTER=otlp) to see them")
        names = [n for n in names if n != "prometheus"]
    built = build_telemetry(traces=tp is None, metrics=mp is None, metric_names=names, service_name=service_name)
    if tp is None and mp is None:
        return built
    desc = [d for d in built.descriptions if not (tp is not None and d.startswith("traces")
                                                  or mp is not None and d.startswith("metrics"))]
    return Telemetry(tp or built.tracer_provider, mp or built.meter_provider, desc, built._closers)
