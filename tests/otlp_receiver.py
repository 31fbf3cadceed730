"""A real OTLP metrics receiver for tests: gRPC and HTTP/protobuf on 127.0.0.1, in-process.

Both servers decode ``ExportMetricsServiceRequest`` with the opentelemetry-proto classes and keep
every data point as a plain :class:`Point`, so tests assert on what actually crossed the wire.

    with OtlpReceiver() as rx:
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = rx.grpc_endpoint
        ...
        rx.wait_for(lambda pts: any(p.name == "gpu_census.kernel.count" for p in pts))
"""
from __future__ import annotations

import gzip
import threading
import time
import zlib
from concurrent import futures
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Dict, List, Optional

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.metrics.v1 import metrics_pb2

TEMPORALITY = {
    metrics_pb2.AGGREGATION_TEMPORALITY_UNSPECIFIED: "unspecified",
    metrics_pb2.AGGREGATION_TEMPORALITY_DELTA: "delta",
    metrics_pb2.AGGREGATION_TEMPORALITY_CUMULATIVE: "cumulative",
}


@dataclass(frozen=True)
class Point:
    """One number data point as it arrived."""

    transport: str          # "grpc" | "http"
    name: str
    unit: str
    kind: str               # "sum" | "gauge"
    monotonic: bool         # sums only
    temporality: str        # sums only
    attributes: Dict[str, object]
    value: float            # as_int or as_double
    is_int: bool
    start_ns: int
    time_ns: int
    resource: Dict[str, object]
    scope: str


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
                if which not in ("sum", "gauge"):
                    continue        # histograms are not used by the census
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


class OtlpReceiver:
    """gRPC on `grpc_port` and HTTP/protobuf on `http_port` on 127.0.0.1 (0: pick a free port)."""

    def __init__(self, grpc_enabled: bool = True, http_enabled: bool = True, grpc_port: int = 0, http_port: int = 0):
        self._lock = threading.Condition()
        self.points: List[Point] = []
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
        pts = decode(request, transport)
        with self._lock:
            self.points.extend(pts)
            self.requests += 1
            self._lock.notify_all()

    def snapshot(self) -> List[Point]:
        with self._lock:
            return list(self.points)

    def clear(self) -> None:
        with self._lock:
            self.points.clear()
            self.requests = 0

    def wait_for(self, pred: Callable[[List[Point]], bool], timeout: float = 20.0) -> List[Point]:
        """Block until pred(points) holds; return the points, or raise AssertionError on timeout."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while not pred(self.points):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted({p.name for p in self.points})
                    raise AssertionError(f"OTLP receiver: condition not met in {timeout}s; "
                                         f"{self.requests} requests, metric names {names}")
                self._lock.wait(left)
            return list(self.points)

    # -- gRPC ---------------------------------------------------------------------------
    def _start_grpc(self, port: int) -> None:
        receiver = self

        class Servicer(metrics_service_pb2_grpc.MetricsServiceServicer):
            def Export(self, request, context):
                receiver._add(request, "grpc")
                return metrics_service_pb2.ExportMetricsServiceResponse()

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Servicer(), server)
        self.grpc_port = server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        self._grpc_server = server

    @property
    def grpc_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.grpc_port}"

    # -- HTTP ---------------------------------------------------------------------------
    def _start_http(self, port: int) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                enc = (self.headers.get("Content-Encoding") or "").lower()
                if enc == "gzip":
                    body = gzip.decompress(body)
                elif enc == "deflate":
                    body = zlib.decompress(body)
                if self.path != "/v1/metrics" or self.headers.get("Content-Type") != "application/x-protobuf":
                    self.send_error(404 if self.path != "/v1/metrics" else 415)
                    return
                req = metrics_service_pb2.ExportMetricsServiceRequest()
                try:
                    req.ParseFromString(body)
                except Exception:      # a malformed body is the client's bug: say 400, keep serving
                    self.send_error(400)
                    return
                receiver._add(req, "http")
                resp = metrics_service_pb2.ExportMetricsServiceResponse().SerializeToString()
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
        """Base URL, as OTEL_EXPORTER_OTLP_ENDPOINT takes it (the exporter appends /v1/metrics)."""
        return f"http://127.0.0.1:{self.http_port}"

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
