"""One set-up of the tracer and meter providers, configured the way OTel users expect.

Which exporters, one table per signal (first match wins):

==========  ====================================================  ===========================================
            metrics (the sidecar of ``run``, the proxy)           traces (the proxy's spans)
==========  ====================================================  ===========================================
1. flag     ``run --exporter otlp|prometheus|console|none``        —
2. env      ``OTEL_METRICS_EXPORTER`` (otlp, prometheus,          ``OTEL_TRACES_EXPORTER`` (otlp, console,
            console, none; comma-separated)                        none; comma-separated)
3. implied  ``otlp`` when ``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT``  —
            or ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set
4. default  none: the end-of-run report is the output (the SDK   ``otlp``: spans are what the proxy is for
            would try localhost; a census run nobody asked to
            export should not try a network)
==========  ====================================================  ===========================================

OTLP follows ``OTEL_EXPORTER_OTLP_[METRICS_|TRACES_]PROTOCOL`` (``grpc``, the default, or
``http/protobuf``); endpoint, headers, timeout, compression and TLS variables are read by the
OTel exporters themselves. ``OTEL_METRIC_EXPORT_INTERVAL`` (ms) sets the export period unless the
caller gives one. Prometheus serves on ``OTEL_EXPORTER_PROMETHEUS_HOST``:``_PORT`` (localhost:9464)
unless the caller gives a port. The resource comes from ``OTEL_SERVICE_NAME`` and
``OTEL_RESOURCE_ATTRIBUTES``, with ``service.name`` defaulting to ``otel-gpu-census``.

A collector that is down costs one warning per outage and signal (and a note when it is back), never
an exception or a log line per retry: the OTel exporters' own per-attempt messages are filtered by one
filter for both signals.

:func:`build_telemetry` makes both providers at once and says where each signal goes
(``Telemetry.descriptions``: ``traces → …``, ``metrics → …``); a caller that already has a meter
provider (``run`` with its sidecar) passes it, so one process never serves two Prometheus endpoints.
"""
from __future__ import annotations

import importlib
import logging
import os
import re
import sys
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Mapping, Optional, Set, Tuple

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

EXPORTER_NAMES = ("otlp", "prometheus", "console", "none")
TRACE_EXPORTER_NAMES = ("otlp", "console", "none")
PROTOCOLS = ("grpc", "http/protobuf")
DEFAULT_SERVICE_NAME = "otel-gpu-census"
DEFAULT_PROMETHEUS_HOST = "localhost"
DEFAULT_PROMETHEUS_PORT = 9464

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


class ExporterUnavailable(RuntimeError):
    """An exporter package that cannot be imported here; the message says what is missing."""


# (module to import, the distribution that provides it) per exporter.
OTLP_MODULES = {
    "grpc": ("opentelemetry.exporter.otlp.proto.grpc.metric_exporter", "opentelemetry-exporter-otlp-proto-grpc"),
    "http/protobuf": ("opentelemetry.exporter.otlp.proto.http.metric_exporter",
                      "opentelemetry-exporter-otlp-proto-http"),
}
OTLP_TRACE_MODULES = {
    "grpc": ("opentelemetry.exporter.otlp.proto.grpc.trace_exporter", "opentelemetry-exporter-otlp-proto-grpc"),
    "http/protobuf": ("opentelemetry.exporter.otlp.proto.http.trace_exporter",
                      "opentelemetry-exporter-otlp-proto-http"),
}
OTLP_DEFAULT_TARGETS = {
    ("grpc", "metrics"): "localhost:4317", ("http/protobuf", "metrics"): "http://localhost:4318/v1/metrics",
    ("grpc", "traces"): "localhost:4317", ("http/protobuf", "traces"): "http://localhost:4318/v1/traces",
}
PROMETHEUS_MODULE = ("opentelemetry.exporter.prometheus", "opentelemetry-exporter-prometheus")


# -------------------------------------------------------------------------------------------
# why an exporter cannot be imported
#
# The OTel exporters are split over many distributions that must match exactly (1.45.2 of
# opentelemetry-exporter-otlp-proto-grpc needs opentelemetry-exporter-otlp-common==0.66b2, a
# distribution older releases did not have). Installed with --no-deps, or next to an old protobuf
# or grpcio, the import fails deep inside; the dependency metadata says what is actually wrong.

def _packaging():
    """packaging's Requirement and Version classes, from the package or pip's copy; None if neither."""
    for base in ("packaging", "pip._vendor.packaging"):
        try:
            req = importlib.import_module(base + ".requirements")
            ver = importlib.import_module(base + ".version")
            return req.Requirement, ver.Version
        except Exception:
            continue
    return None


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _installed_version(name: str) -> Optional[str]:
    from importlib import metadata
    try:
        return metadata.version(name)
    except Exception:
        return None


def unmet_requirements(dist: str, limit: int = 100) -> List[str]:
    """The requirements in `dist`'s dependency closure that are missing or at a version outside
    their range, as sentences; [] when all hold (or nothing can be learnt). Never raises."""
    from importlib import metadata
    tools = _packaging()
    out: List[str] = []
    seen: Set[str] = set()
    todo: List[Tuple[str, frozenset]] = [(dist, frozenset())]
    while todo and len(seen) < limit:
        name, extras = todo.pop(0)
        key = f"{_norm(name)}[{','.join(sorted(extras))}]"
        if key in seen:
            continue
        seen.add(key)
        version = _installed_version(name)
        if version is None:
            continue
        try:
            lines = metadata.requires(name) or []
        except Exception:
            continue
        for line in lines:
            for problem, dep, dep_extras in _check_requirement(line, extras, tools):
                if problem:
                    out.append(f"{problem} (needed by {name} {version})")
                elif dep:
                    todo.append((dep, dep_extras))
    return list(dict.fromkeys(out))


def _check_requirement(line: str, extras: frozenset, tools) -> Iterator[Tuple[str, str, frozenset]]:
    """(problem, "", _) for an unmet requirement line, ("", name, extras) for a met one to walk
    into; nothing for a line that does not apply (another extra, another Python)."""
    if tools is not None:
        Requirement, Version = tools
        try:
            req = Requirement(line)
            if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in (extras | {""})):
                return
            have = _installed_version(req.name)
            if have is None:
                yield f"{req.name}{req.specifier} is not installed", "", frozenset()
            elif req.specifier and not req.specifier.contains(Version(have), prereleases=True):
                yield f"{req.name}{req.specifier} is needed but {have} is installed", "", frozenset()
            else:
                yield "", req.name, frozenset(req.extras)
            return
        except Exception:
            pass             # an odd line: fall through to the name-only check
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*([^;]*)(;\s*(.*))?$", line)
    if not m:
        return
    marker = m.group(5) or ""
    wanted = re.findall(r"extra\s*==\s*[\'\"]([^\'\"]+)", marker)
    if wanted and not (set(wanted) & extras):
        return
    if "python_version" in marker:
        return               # cannot evaluate it without packaging: do not guess
    if _installed_version(m.group(1)) is None:
        yield f"{m.group(1)}{m.group(3).strip()} is not installed", "", frozenset()
    else:
        yield "", m.group(1), frozenset(x.strip() for x in (m.group(2) or "[]")[1:-1].split(",") if x.strip())


def why_not_importable(module: str, dist: str, exc: BaseException) -> str:
    """One sentence: what is wrong with the installation of `dist` that made importing `module` fail."""
    version = _installed_version(dist)
    if version is None:
        return f"the {dist} package is not installed (pip install {dist})"
    what = f"{dist} {version} cannot be imported ({type(exc).__name__}: {exc})"
    unmet = unmet_requirements(dist)
    if unmet:
        return (f"{what}: " + "; ".join(unmet) + f". Install {'it' if len(unmet) == 1 else 'them'}, or install "
                f"{dist}=={version} with its dependencies (pip without --no-deps)")
    missing = getattr(exc, "name", None) if isinstance(exc, ImportError) else None
    if missing:
        return f"{what}, though its declared dependencies are installed: module {missing} is missing or shadowed"
    return f"{what}, though its declared dependencies are installed: one of them is broken"


def import_exporter(module: str, dist: str):
    """The exporter module, or ExporterUnavailable saying precisely why it cannot be imported."""
    try:
        return importlib.import_module(module)
    except Exception as e:      # not only ImportError: an old protobuf fails with TypeError inside
        raise ExporterUnavailable(why_not_importable(module, dist, e)) from e


def choose_exporters(explicit: Optional[str] = None, env: Mapping[str, str] = os.environ) -> List[str]:
    """Exporter names to use (``[]`` means none), by the precedence in the module docstring."""
    if explicit:
        name = explicit.strip().lower()
        if name not in EXPORTER_NAMES:
            raise ConfigError(f"unknown metrics exporter {explicit!r}; choose one of {', '.join(EXPORTER_NAMES)}")
        return [] if name == "none" else [name]
    raw = env.get("OTEL_METRICS_EXPORTER", "").strip()
    if raw:
        names = []
        for part in raw.split(","):
            name = part.strip().lower()
            if not name:
                continue
            if name not in EXPORTER_NAMES:
                log.warning("OTEL_METRICS_EXPORTER: ignoring unknown exporter %r (known: %s)",
                            name, ", ".join(EXPORTER_NAMES))
                continue
            if name == "none":
                return []
            if name not in names:
                names.append(name)
        return names
    if env.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return ["otlp"]
    return []


def choose_span_exporter(env: Mapping[str, str] = os.environ) -> Optional[str]:
    """The trace exporter's name by the table in the module docstring; None means none."""
    names = [n.strip().lower() for n in (env.get("OTEL_TRACES_EXPORTER") or "otlp").split(",") if n.strip()]
    for n in names:
        if n not in TRACE_EXPORTER_NAMES:
            trace_log.warning("OTEL_TRACES_EXPORTER: ignoring unknown exporter %r (known: %s)",
                              n, ", ".join(TRACE_EXPORTER_NAMES))
    if "none" in names:
        return None
    return "console" if "console" in names else "otlp"


def otlp_protocol(env: Mapping[str, str] = os.environ, signal: str = "metrics") -> str:
    raw = (env.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
           or "grpc")
    proto = raw.strip().lower()
    if proto not in PROTOCOLS:
        (trace_log if signal == "traces" else log).warning(
            "OTLP protocol %r is not supported here (use grpc or http/protobuf); using grpc", raw)
        proto = "grpc"
    return proto


def export_interval_ms(interval_s: Optional[float], env: Mapping[str, str] = os.environ) -> float:
    if interval_s is not None:
        if not interval_s > 0:
            raise ConfigError(f"metrics export interval must be > 0 seconds, got {interval_s}")
        return float(interval_s) * 1000.0
    raw = env.get("OTEL_METRIC_EXPORT_INTERVAL")
    if raw:
        try:
            ms = float(raw)
            if ms > 0:
                return ms
        except ValueError:
            pass
        log.warning("OTEL_METRIC_EXPORT_INTERVAL=%r is not a positive number of milliseconds; using 60000", raw)
    return 60000.0


def make_resource() -> Resource:
    """OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME (via the SDK), service.name defaulting to ours."""
    resource = Resource.create()       # reads both variables from os.environ
    # Without either, the SDK names the service "unknown_service[:<executable>]".
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
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


def _otlp_exporter(env: Mapping[str, str], signal: str = "metrics"):
    """(the OTel OTLP exporter of `signal`, "OTLP <protocol> <endpoint>"), chatter filter installed."""
    proto = otlp_protocol(env, signal)
    module = import_exporter(*(OTLP_MODULES if signal == "metrics" else OTLP_TRACE_MODULES)[proto])
    exporter = module.OTLPMetricExporter() if signal == "metrics" else module.OTLPSpanExporter()
    endpoint = getattr(exporter, "_endpoint", None) or OTLP_DEFAULT_TARGETS[(proto, signal)]
    _install_chatter_filter()
    return exporter, f"OTLP {proto} {endpoint}"


def span_exporter(env: Mapping[str, str] = os.environ) -> Optional[SpanExporter]:
    """The span exporter the traces table picks (None: none); its ``target`` says where spans go."""
    name = choose_span_exporter(env)
    if name is None:
        return None
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter
        exporter = ConsoleSpanExporter(out=sys.stderr)
        exporter.target = "console (stderr)"
        return exporter
    inner, target = _otlp_exporter(env, "traces")
    return QuietSpanExporter(inner, target)


# -------------------------------------------------------------------------------------------
# everything together

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


def build_readers(names: List[str], prometheus_port: Optional[int] = None, interval_s: Optional[float] = None,
                  env: Mapping[str, str] = os.environ, console_out=None) -> Exporting:
    """Metric readers for `names`. An exporter that cannot start (a port in use, a missing
    package) is left out with one warning; the others still run."""
    out = Exporting()
    interval = export_interval_ms(interval_s, env)
    for name in names:
        try:
            if name == "otlp":
                inner, target = _otlp_exporter(env)
                quiet = QuietExporter(inner, target)
                out.otlp = quiet
                out.readers.append(PeriodicExportingMetricReader(quiet, export_interval_millis=interval))
                out.descriptions.append(f"{target} every {interval / 1000:g} s")
            elif name == "console":
                from opentelemetry.sdk.metrics.export import ConsoleMetricExporter
                # stdout, as the OTel SDK does; `run` prints its report on stderr.
                exporter = ConsoleMetricExporter(out=console_out or sys.stdout)
                out.readers.append(PeriodicExportingMetricReader(exporter, export_interval_millis=interval))
                out.descriptions.append(f"console (stdout) every {interval / 1000:g} s")
            elif name == "prometheus":
                _add_prometheus(out, prometheus_port, env)
        except ConfigError:
            raise
        except ExporterUnavailable as e:
            log.warning("metrics: %s exporter not started: %s", name, e)
        except Exception as e:
            log.warning("metrics: %s exporter not started: %s: %s", name, type(e).__name__, e)
    return out


def _add_prometheus(out: Exporting, port: Optional[int], env: Mapping[str, str]) -> None:
    PrometheusMetricReader = import_exporter(*PROMETHEUS_MODULE).PrometheusMetricReader
    from prometheus_client import CollectorRegistry, start_http_server

    host = env.get("OTEL_EXPORTER_PROMETHEUS_HOST") or DEFAULT_PROMETHEUS_HOST
    if port is None:
        raw = env.get("OTEL_EXPORTER_PROMETHEUS_PORT")
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


# -------------------------------------------------------------------------------------------
# both signals

# Longest a stop waits for the last spans and metrics to leave. An OTLP exporter retries for up to
# OTEL_EXPORTER_OTLP_TIMEOUT (10 s) per signal: with the collector down, a proxy's stop took 15-21 s.
SHUTDOWN_S = 2.0


@dataclass
class Telemetry:
    """A tracer provider and a meter provider, where each signal goes, and how to shut them down."""

    tracer_provider: TracerProvider
    meter_provider: object
    descriptions: List[str] = field(default_factory=list)     # one line per signal: "traces → …"
    _closers: List[Callable[[], None]] = field(default_factory=list)

    def shutdown(self, timeout_s: float = SHUTDOWN_S) -> None:
        """Flush and close, for at most `timeout_s`: a collector that is down or does not answer
        costs what was still unsent, never a stuck stop. The flush runs in a daemon thread that is
        left behind (and ends with the process) when it overstays."""
        if not self._closers:
            return
        done = threading.Thread(target=run_closers, args=(self._closers,), name="otel-gpu-census-telemetry-stop",
                                daemon=True)
        done.start()
        done.join(timeout_s)
        if done.is_alive():
            trace_log.warning("telemetry: the collector did not take the last spans and metrics within %g s; "
                              "stopping without them", timeout_s)



def build_telemetry(env: Mapping[str, str] = os.environ, traces: bool = True, metrics: bool = True,
                    exporter: Optional[str] = None, prometheus_port: Optional[int] = None,
                    interval_s: Optional[float] = None) -> Telemetry:
    """Both providers from the tables above. With traces/metrics False that provider exports
    nothing (the caller brings its own); `exporter`, `prometheus_port` and `interval_s` are the
    metrics flags. Raises ConfigError only for an invalid explicit exporter or interval."""
    from opentelemetry.sdk.metrics import MeterProvider

    resource = make_resource()
    # shutdown_on_exit off: Telemetry.shutdown (bounded) is the one shutdown; the SDK's own at exit
    # would wait on the same stuck exporter again, unbounded
    tp = TracerProvider(resource=resource, shutdown_on_exit=False)
    desc: List[str] = []
    closers: List[Callable[[], None]] = [tp.shutdown]
    if traces:
        try:
            exp = span_exporter(env)
        except ExporterUnavailable as e:
            trace_log.warning("traces: exporter not started: %s", e)
            exp = None
            desc.append("traces → none (exporter unavailable)")
        else:
            if exp is not None:
                tp.add_span_processor(BatchSpanProcessor(exp))
                desc.append(f"traces → {exp.target}")
            else:
                desc.append("traces → none (OTEL_TRACES_EXPORTER=none)")
    readers: List[MetricReader] = []
    if metrics:
        out = build_readers(choose_exporters(exporter, env), prometheus_port=prometheus_port,
                            interval_s=interval_s, env=env)
        readers = out.readers
        desc.extend(metrics_descriptions(out))
        closers.append(out.close)
    mp = MeterProvider(resource=resource, metric_readers=readers, shutdown_on_exit=False)
    closers.insert(1, mp.shutdown)
    return Telemetry(tp, mp, desc, closers)


def metrics_descriptions(out: Optional[Exporting]) -> List[str]:
    """'metrics → …' lines for what build_readers made (one line saying none when nothing)."""
    if out is None or not out.readers:
        return ["metrics → none (set OTEL_METRICS_EXPORTER or OTEL_EXPORTER_OTLP_ENDPOINT)"]
    return [f"metrics → {d}" for d in out.descriptions]


def engine_telemetry(env: Mapping[str, str] = os.environ) -> Telemetry:
    """Providers for an engine process (vLLM's EngineCore) under ``run``: traces as configured;
    request metrics by OTLP or the console only, since a Prometheus port is run's sidecar's (which
    serves the census metrics) and a second server on it would fail."""
    names = choose_exporters(None, env)
    if "prometheus" in names:
        log.info("engine: request metrics are not served on the Prometheus port (the sidecar holds "
                 "it); send them by OTLP (OTEL_METRICS_EXPORTER=otlp) to see them")
        names = [n for n in names if n != "prometheus"]
    return build_telemetry(env, exporter=names[0] if len(names) == 1 else ("none" if not names else None))
