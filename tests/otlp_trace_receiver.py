"""A real OTLP traces receiver for tests: HTTP/protobuf and gRPC on 127.0.0.1, in-process.

Decodes ``ExportTraceServiceRequest`` with the opentelemetry-proto classes and keeps every span as a
plain :class:`Span`, so tests assert on what crossed the wire.

    with TraceReceiver() as rx:
        exporter = OTLPSpanExporter(endpoint=rx.http_endpoint)
        ...
        spans = rx.wait_for(lambda ss: len(ss) >= 2)
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

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from otlp_receiver import _attrs  # one decoding of OTLP attributes for metrics and traces

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


def decode(req: trace_service_pb2.ExportTraceServiceRequest, transport: str) -> List[Span]:
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


class TraceReceiver:
    def __init__(self, http_enabled: bool = True, grpc_enabled: bool = False):
        self._cond = threading.Condition()
        self.spans: List[Span] = []
        self._http: Optional[ThreadingHTTPServer] = None
        self._grpc = None
        self.http_port = self.grpc_port = 0
        if http_enabled:
            self._start_http()
        if grpc_enabled:
            self._start_grpc()

    def _add(self, req, transport: str) -> None:
        got = decode(req, transport)
        with self._cond:
            self.spans.extend(got)
            self._cond.notify_all()

    @property
    def http_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v1/traces"

    @property
    def grpc_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.grpc_port}"

    def snapshot(self) -> List[Span]:
        with self._cond:
            return list(self.spans)

    def clear(self) -> None:
        with self._cond:
            self.spans.clear()

    def wait_for(self, pred: Callable[[List[Span]], bool], timeout: float = 10.0) -> List[Span]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not pred(list(self.spans)):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"timed out waiting for spans; have {[s.name for s in self.spans]}")
                self._cond.wait(left)
            return list(self.spans)

    def _start_http(self) -> None:
        rx = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                enc = (self.headers.get("Content-Encoding") or "").lower()
                if enc == "gzip":
                    body = gzip.decompress(body)
                elif enc == "deflate":
                    body = zlib.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                req = trace_service_pb2.ExportTraceServiceRequest()
                req.ParseFromString(body)
                rx._add(req, "http")
                out = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *a):
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http_port = self._http.server_address[1]
        threading.Thread(target=self._http.serve_forever, daemon=True, name="otlp-trace-http").start()

    def _start_grpc(self) -> None:
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
        rx = self

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                rx._add(request, "grpc")
                return trace_service_pb2.ExportTraceServiceResponse()

        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self._grpc)
        self.grpc_port = self._grpc.add_insecure_port("127.0.0.1:0")
        self._grpc.start()

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        if self._grpc is not None:
            self._grpc.stop(0)
            self._grpc = None

    def __enter__(self) -> "TraceReceiver":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
