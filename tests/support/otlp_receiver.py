"""The one OTLP receiver of the tests: metrics and traces, gRPC and HTTP/protobuf on 127.0.0.1, in-process.

Both transports decode ``ExportMetricsServiceRequest`` / ``ExportTraceServiceRequest`` with the
opentelemetry-proto classes and keep every data point as a plain :class:`Point` and every span as a
plain :class:`Span`, so tests assert on what actually crossed the wire.

    with OtlpReceiver() as rx:
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = rx.grpc_endpoint      # or rx.http_endpoint
        ...
        rx.wait_for(lambda pts: any(p.name == "gpu_census.kernel.count" for p in pts))
        spans = rx.wait_for_spans(lambda ss: len(ss) >= 2)
    OTLPSpanExporter(endpoint=rx.traces_endpoint)                       # HTTP, the full traces URL
"""
from __future__ import annotations

import gzip
import threading
import time
import zlib
from concurrent import futures
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Tuple, Callable, Dict, List, Optional

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.metrics.v1 import metrics_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

TEMPORALITY = {
    metrics_pb2.AGGREGATION_TEMPORALITY_UNSPECIFIED: "unspecified",
    metrics_pb2.AGGREGATION_TEMPORALITY_DELTA: "delta",
    metrics_pb2.AGGREGATION_TEMPORALITY_CUMULATIVE: "cumulative",
}


@dataclass(frozen=True)
class Point:
    """One data point as it arrived: a number (sums, gauges) or a histogram (value = its sum)."""

    transport: str          # "grpc" | "http"
    name: str
    unit: str
    kind: str               # "sum" | "gauge" | "histogram"
    monotonic: bool         # sums only
    temporality: str        # sums only
    attributes: Dict[str, object]
    value: float            # as_int or as_double
    is_int: bool
    start_ns: int
    time_ns: int
    resource: Dict[str, object]
    scope: str
    count: int = 0          # histograms: how many values were recorded
    exemplars: Tuple = ()   # histograms: the trace ids (hex) of their exemplars


def _any(v: AnyValue):
    which = v.WhichOneof("value")
    if which == "array_value":
        return tuple(_any(x) for x in v.array_value.values)
    if which == "kvlist_value":
        return {kv.key: _any(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, which) if which else None


def _attrs(kvs) -> Dict[str, object]:
    return {kv.key: _any(kv.value) for kv in kvs}


def decode(request: metrics_service_pb2.ExportMetricsServiceRequest, transport: str) -> List[Point]:
    out = []
    for rm in request.resource_metrics:
        resource = _attrs(rm.resource.attributes)
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                which = m.WhichOneof("data")
                if which == "histogram":
                    out.extend(_histogram_points(m, transport, resource, sm.scope.name))
                    continue
                if which not in ("sum", "gauge"):
                    continue
                data = getattr(m, which)
                for dp in data.data_points:
                    is_int = dp.WhichOneof("value") == "as_int"
                    out.append(Point(
                        transport=transport, name=m.name, unit=m.unit, kind=which,
                        monotonic=bool(which == "sum" and data.is_monotonic),
                        temporality=TEMPORALITY.get(data.aggregation_temporality, "?") if which == "sum" else "",
                        attributes=_attrs(dp.attributes),
                        value=dp.as_int if is_int else dp.as_double, is_int=is_int,
                        start_ns=dp.start_time_unix_nano, time_ns=dp.time_unix_nano,
                        resource=resource, scope=sm.scope.name))
    return out


def _histogram_points(m, transport: str, resource, scope: str) -> List[Point]:
    h = m.histogram
    return [Point(transport=transport, name=m.name, unit=m.unit, kind="histogram", monotonic=False,
                  temporality=TEMPORALITY.get(h.aggregation_temporality, "?"), attributes=_attrs(dp.attributes),
                  value=dp.sum, is_int=False, start_ns=dp.start_time_unix_nano, time_ns=dp.time_unix_nano,
                  resource=resource, scope=scope, count=dp.count,
                  exemplars=tuple(e.trace_id.hex() for e in dp.exemplars))
            for dp in h.data_points]


KINDS = {trace_pb2.Span.SPAN_KIND_SERVER: "server", trace_pb2.Span.SPAN_KIND_CLIENT: "client",
         trace_pb2.Span.SPAN_KIND_INTERNAL: "internal", trace_pb2.Span.SPAN_KIND_PRODUCER: "producer",
         trace_pb2.Span.SPAN_KIND_CONSUMER: "consumer"}
STATUS = {trace_pb2.Status.STATUS_CODE_UNSET: "unset", trace_pb2.Status.STATUS_CODE_OK: "ok",
          trace_pb2.Status.STATUS_CODE_ERROR: "error"}


@dataclass(frozen=True)
class Span:
    transport: str
    name: str
    trace_id: str           # 32 hex digits
    span_id: str            # 16 hex digits
    parent_span_id: str     # "" for a root
    kind: str
    start_ns: int
    end_ns: int
    attributes: Dict[str, object]
    status: str
    status_message: str
    resource: Dict[str, object]
    scope: str


def decode_spans(req: trace_service_pb2.ExportTraceServiceRequest, transport: str) -> List[Span]:
    out = []
    for rs in req.resource_spans:
        resource = _attrs(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(Span(transport, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                KINDS.get(s.kind, str(s.kind)), s.start_time_unix_nano, s.end_time_unix_nano,
                                _attrs(s.attributes), STATUS.get(s.status.code, "?"), s.status.message,
                                resource, ss.scope.name))
    return out


class OtlpReceiver:
    """Both signals on gRPC (`grpc_port`) and HTTP/protobuf (`http_port`, paths /v1/metrics and
    /v1/traces) on 127.0.0.1; port 0 picks a free one."""

    def __init__(self, grpc_enabled: bool = True, http_enabled: bool = True, grpc_port: int = 0, http_port: int = 0):
        self._lock = threading.Condition()
        self.points: List[Point] = []
        self.spans: List[Span] = []
        self.requests = 0
        self._grpc_server: Optional[grpc.Server] = None
        self._http: Optional[ThreadingHTTPServer] = None
        self.grpc_port = self.http_port = 0
        if grpc_enabled:
            self._start_grpc(grpc_port)
        if http_enabled:
            self._start_http(http_port)

    # -- collection ---------------------------------------------------------------------
    def _add(self, request, transport: str) -> None:
        is_traces = isinstance(request, trace_service_pb2.ExportTraceServiceRequest)
        got = decode_spans(request, transport) if is_traces else decode(request, transport)
        with self._lock:
            (self.spans if is_traces else self.points).extend(got)
            self.requests += 1
            self._lock.notify_all()

    def snapshot(self) -> List[Point]:
        with self._lock:
            return list(self.points)

    def span_snapshot(self) -> List[Span]:
        with self._lock:
            return list(self.spans)

    def clear(self) -> None:
        with self._lock:
            self.points.clear()
            self.spans.clear()
            self.requests = 0

    def _wait(self, items: list, pred, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        with self._lock:
            while not pred(list(items)):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted({x.name for x in items})
                    raise AssertionError(f"OTLP receiver: condition not met in {timeout}s; "
                                         f"{self.requests} requests, {what} {names}")
                self._lock.wait(left)
            return list(items)

    def wait_for(self, pred: Callable[[List[Point]], bool], timeout: float = 20.0) -> List[Point]:
        """Block until pred(points) holds; return the points, or raise AssertionError on timeout."""
        return self._wait(self.points, pred, timeout, "metric names")

    def wait_for_spans(self, pred: Callable[[List[Span]], bool], timeout: float = 10.0) -> List[Span]:
        """Block until pred(spans) holds; return the spans, or raise AssertionError on timeout."""
        return self._wait(self.spans, pred, timeout, "span names")

    # -- gRPC ---------------------------------------------------------------------------
    def _start_grpc(self, port: int) -> None:
        receiver = self

        class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
            def Export(self, request, context):
                receiver._add(request, "grpc")
                return metrics_service_pb2.ExportMetricsServiceResponse()

        class Traces(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                receiver._add(request, "grpc")
                return trace_service_pb2.ExportTraceServiceResponse()

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), server)
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), server)
        self.grpc_port = server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        self._grpc_server = server

    @property
    def grpc_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.grpc_port}"

    # -- HTTP ---------------------------------------------------------------------------
    def _start_http(self, port: int) -> None:
        receiver = self
        kinds = {"/v1/metrics": (metrics_service_pb2.ExportMetricsServiceRequest,
                                 metrics_service_pb2.ExportMetricsServiceResponse),
                 "/v1/traces": (trace_service_pb2.ExportTraceServiceRequest,
                                trace_service_pb2.ExportTraceServiceResponse)}

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                enc = (self.headers.get("Content-Encoding") or "").lower()
                if enc == "gzip":
                    body = gzip.decompress(body)
                elif enc == "deflate":
                    body = zlib.decompress(body)
                if self.path not in kinds or self.headers.get("Content-Type") != "application/x-protobuf":
                    self.send_error(404 if self.path not in kinds else 415)
                    return
                request_type, response_type = kinds[self.path]
                req = request_type()
                try:
                    req.ParseFromString(body)
                except Exception:      # a malformed body is the client's bug: say 400, keep serving
                    self.send_error(400)
                    return
                receiver._add(req, "http")
                resp = response_type().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(resp)))
                self.end_headers()
                self.wfile.write(resp)

            def log_message(self, *args):     # keep test output clean
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._http.daemon_threads = True
        self.http_port = self._http.server_address[1]
        threading.Thread(target=self._http.serve_forever, name="otlp-http-rx", daemon=True).start()

    @property
    def http_endpoint(self) -> str:
        """Base URL, as OTEL_EXPORTER_OTLP_ENDPOINT takes it (the exporters append /v1/metrics, /v1/traces)."""
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def traces_endpoint(self) -> str:
        """The full traces URL, as OTEL_EXPORTER_OTLP_TRACES_ENDPOINT and OTLPSpanExporter(endpoint=) take it."""
        return f"http://127.0.0.1:{self.http_port}/v1/traces"

    # -- lifetime -----------------------------------------------------------------------
    def close(self) -> None:
        if self._grpc_server is not None:
            self._grpc_server.stop(grace=0).wait(5)
            self._grpc_server = None
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    def __enter__(self) -> "OtlpReceiver":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def latest(points: List[Point], name: str, attrs: Optional[Dict[str, object]] = None) -> Optional[Point]:
    """The newest point of `name` whose attributes include `attrs`."""
    want = attrs or {}
    best = None
    for p in points:
        if p.name == name and all(p.attributes.get(k) == v for k, v in want.items()):
            if best is None or p.time_ns >= best.time_ns:
                best = p
    return best
