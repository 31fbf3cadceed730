"""The proxy against a hostile or broken client and upstream: a chunked encoding broken mid-answer,
deeply nested JSON, malformed requests and oversized baggage (one short line each, rate-limited),
slowloris connections, paths that climb out of the upstream's prefix, and a stop with the collector
unreachable. Real sockets, a real upstream, spans from the SDK's in-memory exporter."""
from __future__ import annotations

import http.client
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from proxy_client import last_span, send_raw
from socket_upstream import SocketUpstream
from otel_gpu_census.integrations.llamacpp import clientlog, server

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("fresh_standin")]
SRC = Path(__file__).resolve().parents[2] / "src"


# ---- an upstream that breaks the chunked encoding mid-answer ------------------------------------

def _broken_chunks(c, i):
    """Answers with a valid first chunk, then a chunk-size line that is not hex, then stays silent."""
    c.recv(65536)
    event = b'data: {"content":"a","stop":false}\n\n'
    c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
              + b"%x\r\n%s\r\n" % (len(event), event))
    time.sleep(0.1)
    c.sendall(b"zz-not-hex\r\ngarbage\r\n")


def test_broken_chunked_encoding_cuts_the_client_and_ends_the_span_with_upstream_error(proxy):
    up = SocketUpstream(_broken_chunks, keep_open=True)
    try:
        h = proxy(upstream=up.url, upstream_timeout_s=30)
        c = http.client.HTTPConnection("127.0.0.1", h.port, timeout=10)
        t0 = time.monotonic()
        c.request("POST", "/completion", json.dumps({"prompt": "x", "stream": True}).encode())
        r = c.getresponse()
        assert r.status == 200
        with pytest.raises(http.client.IncompleteRead):
            r.read()
        assert time.monotonic() - t0 < 5          # well before --upstream-timeout
        s = last_span(h)
        assert s.attributes["gpu_census.proxy.outcome"] == "upstream_error"
        assert s.status.status_code.name == "ERROR" and "mid-answer" in s.status.description
    finally:
        up.close()


# ---- deeply nested JSON ----------------------------------------------------------------------------

def test_deeply_nested_json_body_gets_a_span_with_status_and_outcome_and_no_traceback(proxy, caplog):
    h = proxy()
    body = b"[" * 100_000 + b"]" * 100_000
    with caplog.at_level(logging.WARNING):
        c = http.client.HTTPConnection("127.0.0.1", h.port, timeout=10)
        c.request("POST", "/completion", body, {"Content-Type": "application/json"})
        status = c.getresponse().status
        s = last_span(h)
    assert s.attributes["gpu_census.proxy.outcome"] == "complete"
    assert s.attributes["http.response.status_code"] == status
    # (the stand-in upstream's own aiohttp logs its RecursionError: only the proxy's records count)
    proxy_records = [r for r in caplog.records if r.name.startswith("otel_gpu_census")]
    assert not any(r.exc_info for r in proxy_records)
    assert not any("RecursionError" in r.getMessage() for r in proxy_records)


def test_deeply_nested_json_answer_is_counted_as_unparsed():
    from otel_gpu_census.integrations.llamacpp.stream import BodyReader
    r = BodyReader("text/event-stream")
    r.feed(b"data: " + b"[" * 100_000 + b"]" * 100_000 + b"\n\n", 1)
    r.feed(b'data: {"content":"a","stop":false}\n\n', 2)
    f = r.close(3)
    assert f.unparsed == 1 and f.token_events == 1 and f.note is None


# ---- malformed requests and baggage: one short line, rate-limited ------------------------------

def test_malformed_requests_log_one_short_line_rate_limited(proxy, caplog, monkeypatch):
    monkeypatch.setattr(clientlog, "LOG_EVERY_S", 2.0)
    h = proxy()
    with caplog.at_level(logging.WARNING):
        for _ in range(20):
            assert send_raw(h.port, b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\x1b[2J\r\n\r\n").startswith(b"HTTP/1.")
        time.sleep(0.2)
        first = [r for r in caplog.records if r.name == "otel_gpu_census.proxy.http"]
        time.sleep(2.0)                              # the quiet period is over: the next one is told
        send_raw(h.port, b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n")
        time.sleep(0.2)
    assert len(first) == 1 and first[0].exc_info is None
    text = first[0].getMessage()
    assert text.startswith("bad request from 127.0.0.1: BadHttpMessage: Invalid header token")
    assert "\n" not in text and "\x1b" not in text and len(text) <= 300
    lines = [r.getMessage() for r in caplog.records if r.name == "otel_gpu_census.proxy.http"]
    assert len(lines) == 2 and lines[1].endswith("(19 more since the last such line)")


def test_an_oversized_baggage_header_is_dropped_and_not_logged_verbatim(proxy, standin, caplog):
    h = proxy()
    huge = ",".join(f"k{i}=v" for i in range(6000))      # ~40 kB
    with caplog.at_level(logging.WARNING):
        c = http.client.HTTPConnection("127.0.0.1", h.port, timeout=10)
        c.request("GET", "/echo", headers={"baggage": huge})
        seen = json.loads(c.getresponse().read())
        c.request("GET", "/echo", headers={"baggage": huge})
        c.getresponse().read()
    assert "baggage" not in {k.lower() for k in seen["headers"]}
    assert "k1=v" not in caplog.text and max(len(r.getMessage()) for r in caplog.records) < 300
    dropped = [r.getMessage() for r in caplog.records if "baggage" in r.getMessage()]
    assert len(dropped) == 1 and "over the 8192 W3C Baggage allows" in dropped[0]


def test_baggage_within_the_limits_goes_upstream(proxy):
    h = proxy()
    c = http.client.HTTPConnection("127.0.0.1", h.port, timeout=10)
    c.request("GET", "/echo", headers={"baggage": "tenant=acme,team=ml"})
    seen = {k.lower(): v for k, v in json.loads(c.getresponse().read())["headers"].items()}
    assert sorted(seen["baggage"].split(",")) == ["team=ml", "tenant=acme"]


def test_many_malformed_baggage_entries_cost_one_line(proxy, caplog):
    h = proxy()
    bad = ",".join(["no-equals-sign-here"] * 150)           # inside the limits, every entry refused
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            c = http.client.HTTPConnection("127.0.0.1", h.port, timeout=10)
            c.request("GET", "/echo", headers={"baggage": bad})
            assert c.getresponse().status == 200
    lines = [r.getMessage() for r in caplog.records if "baggage" in r.getMessage().lower()]
    assert len(lines) <= 1 and "no-equals-sign-here" not in caplog.text


# ---- slowloris ----------------------------------------------------------------------------------

def test_connections_that_never_finish_their_headers_are_closed(proxy):
    h = proxy(client_timeout_s=1.0)
    socks = []
    for i in range(30):
        s = socket.create_connection(("127.0.0.1", h.port))
        s.sendall(b"GET /health HTTP/1.1\r\n" if i % 3 else b"")
        s.settimeout(0.2)
        socks.append(s)
    t0 = time.monotonic()
    open_ = set(range(len(socks)))
    while open_ and time.monotonic() - t0 < 5:
        for i in list(open_):
            try:
                if socks[i].recv(100) == b"":
                    open_.discard(i)
            except socket.timeout:
                if i % 3 == 1:                   # drip a header line now and then, as slowloris does
                    socks[i].sendall(b"X-a: b\r\n")
            except OSError:
                open_.discard(i)
    elapsed = time.monotonic() - t0
    for s in socks:
        s.close()
    assert not open_, f"{len(open_)} connections still open after {elapsed:.1f} s"
    assert elapsed < 3


def test_an_idle_keep_alive_connection_is_closed(proxy):
    h = proxy(client_timeout_s=1.0)
    s = socket.create_connection(("127.0.0.1", h.port), timeout=5)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    got = b""
    while b'"ok"}' not in got:
        got += s.recv(65536)
    assert got.startswith(b"HTTP/1.1 200")
    t0 = time.monotonic()
    assert s.recv(100) == b""
    assert 0.5 < time.monotonic() - t0 < 3
    s.close()


def test_client_timeout_option():
    import argparse
    from otel_gpu_census.integrations.llamacpp import add_proxy_arguments, config_from_args
    p = argparse.ArgumentParser()
    add_proxy_arguments(p)
    assert config_from_args(p.parse_args(["--upstream", "http://h:1", "--client-timeout", "2.5"])).client_timeout_s == 2.5
    assert config_from_args(p.parse_args(["--upstream", "http://h:1"])).client_timeout_s == 15.0


# ---- paths that climb out of the upstream's prefix -----------------------------------------

@pytest.mark.parametrize("path", ["/../health", "/%2e%2e/health", "/%2E%2e/health", "/x/../../health",
                                  "/..%2fhealth", "/%2e%2e%5chealth", "/.%2e/health"])
def test_dot_dot_never_leaves_the_upstream_prefix(proxy, standin, path):
    h = proxy(upstream=standin.url + "/prefix")
    status = int(send_raw(h.port, f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()).split()[1])
    assert status == 400 and standin.seen == []


def test_ordinary_paths_with_dots_still_pass(proxy, standin):
    h = proxy()
    for path in ("/echo?x=../y", "/echo"):
        status = int(send_raw(h.port, f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()).split()[1])
        assert status == 200
    assert [s.raw_path for s in standin.seen] == ["/echo?x=../y", "/echo"]


# ---- a bounded stop with the collector unreachable ----------------------------------------------

@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_stop_with_an_unreachable_collector_is_bounded(standin, protocol):
    blackhole = socket.socket()                   # accepts connections, never answers
    blackhole.bind(("127.0.0.1", 0))
    blackhole.listen(64)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(PYTHONPATH=str(SRC), OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{blackhole.getsockname()[1]}",
               OTEL_EXPORTER_OTLP_PROTOCOL=protocol)
    proc = subprocess.Popen([sys.executable, "-m", "otel_gpu_census.integrations.llamacpp", "--upstream", standin.url,
                             "--listen", "127.0.0.1:0", "--no-gpu"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        port = None
        for _ in range(20):
            m = re.search(r"listening on http://[^:]+:(\d+)", proc.stderr.readline())
            if m:
                port = int(m.group(1))
                break
        assert port
        for _ in range(3):
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            c.request("POST", "/completion", b'{"prompt":"x"}')
            assert c.getresponse().status == 200
            c.close()
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        took = time.monotonic() - t0
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        blackhole.close()
    assert took <= 3.5, f"the stop took {took:.1f} s"
    assert "stopping without them" in err and "Traceback" not in err
