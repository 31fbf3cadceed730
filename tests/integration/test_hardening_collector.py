"""A collector (or whatever answers at its address) that answers an OTLP/HTTP export with a huge body:
the exporter reads a bounded start of it and drops the connection, instead of reading it all into
memory. A real HTTP server on a socket, the SDK's exporter as the census makes it."""
from __future__ import annotations

import socket
import threading
import tracemalloc

import pytest

from otel_gpu_census.telemetry import bounded_http, setup

pytestmark = pytest.mark.timeout(60)
ANSWER = 300 << 20                    # what the "collector" says it sends


class HugeAnswers:
    def __init__(self):
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(4)
        self.port = self.srv.getsockname()[1]
        self.sent, self.requests = 0, 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(c,), daemon=True).start()

    def _one(self, c):
        with c:
            head = b""
            while b"\r\n\r\n" not in head:
                head += c.recv(65536)
            length = int([h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")][0].split(b":")[1])
            body = head.split(b"\r\n\r\n", 1)[1]
            while len(body) < length:
                body += c.recv(65536)
            self.requests += 1
            c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\nContent-Length: %d\r\n\r\n" % ANSWER)
            block = b"\0" * (1 << 20)
            try:
                while self.sent < ANSWER:
                    c.sendall(block)
                    self.sent += len(block)
            except OSError:
                pass

    def close(self):
        self.srv.close()


def test_a_huge_answer_from_the_collector_is_read_only_up_to_the_bound(monkeypatch):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    col = HugeAnswers()
    for k in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_TRACES_EXPORTER"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://127.0.0.1:{col.port}/v1/traces")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    try:
        exporter, target = setup._made("otlp", "traces")
        assert "http/protobuf" in target
        tp = TracerProvider()
        tp.add_span_processor(SimpleSpanProcessor(exporter))
        tracemalloc.start()
        try:
            tp.get_tracer("t").start_span("s").end()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        tp.shutdown()
    finally:
        col.close()
    assert col.requests == 1
    assert peak < 32 << 20, f"{peak >> 20} MiB to read the collector's answer"
    assert col.sent < 64 << 20            # the rest was never read: the connection went


def test_a_small_answer_reads_whole(monkeypatch):
    import http.server

    class H(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Length", "5")
            self.end_headers()
            self.wfile.write(b"hello")

        def log_message(self, *a):
            pass
    srv = http.server.HTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        r = bounded_http.BoundedSession().post(f"http://127.0.0.1:{srv.server_address[1]}/", data=b"x", timeout=5)
    finally:
        srv.shutdown()
    assert r.status_code == 200 and r.content == b"hello"
