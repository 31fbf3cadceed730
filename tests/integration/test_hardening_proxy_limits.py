"""The proxy's resources against clients that stall or pile up, and against odd upstream answers: a
request body announced and never sent (408, the connection freed), a client that never reads its
answer (cut, its buffers bounded and freed), connections past the file-descriptor limit (503 at once,
never accept errors), what the event loop reports (one line, no traceback), an upstream's 101 (502),
and a final event whose numbers are not finite (the span keeps everything else). Real sockets."""
from __future__ import annotations

import http.client
import json
import logging
import os
import re
import resource
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from proxy_client import last_span, read_until_closed
from socket_upstream import SocketUpstream
from otel_gpu_census.integrations.llamacpp import connections, server

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("fresh_standin")]
SRC = Path(__file__).resolve().parents[2] / "src"
SUPPORT = Path(__file__).resolve().parents[1] / "support"


def raw_upstream(answer) -> SocketUpstream:
    """An upstream that answers every connection with `answer(sock)` (after reading the request head)."""
    return SocketUpstream(lambda c, i: (c.recv(65536), answer(c)), backlog=512)


# ---- every read of a client has a deadline --------------------------------------------------------

@pytest.mark.parametrize("length", [100, 4 << 20])         # read whole first / streamed through
def test_a_request_body_announced_and_never_sent_gets_408_and_frees_the_connection(proxy, standin, length):
    h = proxy(client_timeout_s=1.0)
    s = socket.create_connection(("127.0.0.1", h.port))
    s.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n{\"prompt\":" % length)
    t0 = time.monotonic()
    got = read_until_closed(s, 6.0)
    s.close()
    assert got.startswith(b"HTTP/1.1 408 ") and time.monotonic() - t0 < 4
    assert b"no byte of its request body for 1 s (10 of %d bytes came)" % length in got
    span = last_span(h)
    assert span.attributes["gpu_census.proxy.outcome"] == "client_timeout"
    assert span.attributes["http.response.status_code"] == 408


def test_a_chunked_request_body_that_stalls_gets_408(proxy):
    h = proxy(client_timeout_s=1.0)
    s = socket.create_connection(("127.0.0.1", h.port))
    s.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"pro\r\n")
    assert read_until_closed(s, 6.0).startswith(b"HTTP/1.1 408 ")
    s.close()


def test_a_slow_but_steady_request_body_is_not_cut(proxy, standin):
    h = proxy(client_timeout_s=1.0)
    body = json.dumps({"prompt": "x" * 40}).encode()
    s = socket.create_connection(("127.0.0.1", h.port))
    s.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body))
    for i in range(0, len(body), 10):             # 2.5 s in all, never 1 s without a byte
        s.sendall(body[i:i + 10])
        time.sleep(0.5)
    assert read_until_closed(s, 10.0).startswith(b"HTTP/1.1 200 ")
    s.close()


def _big_stream(c):
    event = b'data: {"content":"' + b"x" * 4000 + b'","stop":false}\n\n'
    c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
    for _ in range(5000):                          # 20 MB, as fast as the proxy takes it
        c.sendall(event)


def _non_reader(port) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.sendall(b'POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n'
              b'Content-Length: 28\r\n\r\n{"prompt":"x","stream":true}')
    return s


def test_a_client_that_never_reads_its_answer_is_cut_and_frees_the_upstream(proxy):
    up = raw_upstream(_big_stream)
    try:
        h = proxy(upstream=up.url, client_timeout_s=1.0)
        s = _non_reader(h.port)
        t0 = time.monotonic()
        deadline = t0 + 15
        span = None
        while span is None and time.monotonic() < deadline:
            spans = h.spans.get_finished_spans()
            span = spans[-1] if spans else None
            time.sleep(0.1)
        assert span is not None, "the client was never cut"
        assert span.attributes["gpu_census.proxy.outcome"] == "client_timeout"
        assert "took no byte of the answer for 1 s" in span.status.description
        deadline = time.monotonic() + 5
        while up.closed < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert up.closed == 1                        # the upstream's slot is free again
        s.close()
    finally:
        up.close()


def test_clients_that_never_read_cost_a_bounded_buffer_each_and_give_it_back(proxy):
    """Each such client holds at most the buffer budget of its two stream readers, its write buffer and the
    chunk kept for reading, under the README's half a MiB (aiohttp's own 256 KiB reads let one pin about
    1.5 MiB); all of it goes when they leave."""
    import tracemalloc
    up = raw_upstream(_big_stream)
    n = 40
    tracemalloc.start()
    try:
        h = proxy(upstream=up.url, client_timeout_s=60)
        time.sleep(0.3)
        base = tracemalloc.get_traced_memory()[0]
        socks = [_non_reader(h.port) for _ in range(n)]
        deadline = time.monotonic() + 20
        while len(h.proxy._relays) < n and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(4)                                # every buffer filled up to where reading stops
        held = tracemalloc.get_traced_memory()[0] - base
        for s in socks:
            s.close()
        deadline = time.monotonic() + 20
        while h.proxy._relays and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        left = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
        up.close()
    assert held / n < 512 << 10, f"{held / n / 1024:.0f} KiB per client that never reads"
    assert left < 8 << 20, f"{left >> 20} MiB still held after they left"


def test_memory_goes_back_once_a_burst_of_connections_has_gone():
    gb = connections.MemoryGiveBack()
    calls = []
    gb._trim = calls.append
    assert [gb.seen(n) for n in (10, 40, 20, 5)] == [False] * 4          # never a burst worth it
    assert [gb.seen(n) for n in (100, 80, 51)] == [False] * 3
    assert gb.seen(50) and calls == [0]                                   # half of the peak gone
    assert not gb.seen(30) and gb.seen(0) is False                        # a new peak must build up again


# ---- connections past the descriptor limit ------------------------------------------------------

def test_connection_cap_is_below_the_descriptor_limit():
    for limit in (256, 1024, 65536):
        cap = connections.connection_cap(limit)
        assert 2 * cap + connections.FD_RESERVE <= limit
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert connections.connection_cap() == connections.connection_cap(soft)


def test_connections_past_the_cap_get_503_at_once_and_one_log_line(proxy, monkeypatch, caplog):
    monkeypatch.setattr(connections, "connection_cap", lambda limit=0: 4)
    h = proxy(client_timeout_s=30)
    held = [socket.create_connection(("127.0.0.1", h.port)) for _ in range(4)]
    for s in held:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")       # a head never finished: the slot stays taken
    time.sleep(0.3)
    with caplog.at_level(logging.WARNING):
        for _ in range(5):
            s = socket.create_connection(("127.0.0.1", h.port))
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            t0 = time.monotonic()
            got = read_until_closed(s, 3.0)
            s.close()
            assert time.monotonic() - t0 < 1.5
            assert got.startswith(b"HTTP/1.1 503 ") and b"Retry-After: 1" in got
            assert json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["code"] == 503
    lines = [r.getMessage() for r in caplog.records if "client connections open" in r.getMessage()]
    assert len(lines) == 1 and "4 client connections open" in lines[0]
    held[0].close()                                   # a slot frees: the next client is served
    time.sleep(0.3)
    c = http.client.HTTPConnection("127.0.0.1", h.port, timeout=5)
    c.request("GET", "/health")
    assert c.getresponse().status == 200
    for s in held[1:]:
        s.close()


_LOW_FD_PROXY = textwrap.dedent("""
    import resource, sys, time
    sys.path[:0] = [{src!r}, {support!r}]
    resource.setrlimit(resource.RLIMIT_NOFILE, ({fds}, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    import logging
    logging.basicConfig(level=logging.WARNING, format="LOG %(message)s")
    from otel_gpu_census.integrations.llamacpp import connections
    if {uncapped}:
        connections.connection_cap = lambda limit=0: 100000
    from llama_standin import Standin
    from proxy_process import in_thread_proxies
    st = Standin().start()
    with in_thread_proxies(st.url) as make:
        h = make(client_timeout_s=60)
        print("PORT", h.port, flush=True)
        time.sleep({stay})
""")


def _low_fd_proxy(uncapped: bool, fds: int = 256, stay: float = 6.0):
    code = _LOW_FD_PROXY.format(src=str(SRC), support=str(SUPPORT), fds=fds, uncapped=uncapped, stay=stay)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    p = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    port = int(re.match(r"PORT (\d+)", p.stdout.readline()).group(1))
    return p, port


def test_past_the_descriptor_limit_clients_get_503_not_a_hang():
    p, port = _low_fd_proxy(uncapped=False)
    socks = []
    try:
        for _ in range(300):                          # more than the 256 descriptors the proxy may open
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            socks.append(s)
        time.sleep(0.5)
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        t0 = time.monotonic()
        assert read_until_closed(s, 3.0).startswith(b"HTTP/1.1 503 ") and time.monotonic() - t0 < 1
        s.close()
        served = 0
        for s in socks:                               # the rest were answered 503 (or reset, in the rush)
            s.settimeout(0.01)
            try:
                served += s.recv(100) == b""
            except socket.timeout:
                served += 1
            except OSError:
                pass
        assert served == connections.connection_cap(256)
    finally:
        for s in socks:
            s.close()
        out, err = p.communicate(timeout=30)
    assert "Traceback" not in err and "Too many open files" not in err
    assert len([x for x in err.splitlines() if "client connections open" in x]) == 1


def test_accept_errors_cost_one_line_not_a_traceback_each():
    """Descriptors run out anyway (here: the cap lifted): asyncio reports each failed accept with a
    traceback; the proxy turns them into one line every LOG_EVERY_S."""
    p, port = _low_fd_proxy(uncapped=True, stay=5.0)
    socks = []
    try:
        for _ in range(320):                          # past the 256 descriptors, nothing refuses them
            try:
                socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            except OSError:                           # the listen queue is full: the proxy accepts no more
                break
        time.sleep(3)                                 # asyncio retries accept every second
    finally:
        for s in socks:
            s.close()
        out, err = p.communicate(timeout=30)
    assert "Traceback" not in err
    lines = [x for x in err.splitlines() if "cannot accept connections" in x]
    assert len(lines) == 1 and "Too many open files" in lines[0] and "descriptor limit 256" in lines[0]


# ---- odd upstream answers ---------------------------------------------------------------------------

def test_an_upstream_101_is_refused(proxy):
    up = raw_upstream(lambda c: (c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                                          b"Connection: Upgrade\r\n\r\nraw bytes of another protocol"),
                                time.sleep(0.5)))
    try:
        h = proxy(upstream=up.url)
        s = socket.create_connection(("127.0.0.1", h.port))
        s.sendall(b"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
        got = read_until_closed(s, 5.0)
        s.close()
        assert got.startswith(b"HTTP/1.1 502 ") and b"raw bytes" not in got
        assert b"upstream answered 101" in got
        span = last_span(h)
        assert span.attributes["gpu_census.proxy.outcome"] == "upstream_error"
    finally:
        up.close()


def test_a_final_event_with_non_finite_timings_keeps_the_rest_of_the_span(proxy):
    final = (b'data: {"content":"","stop":true,"stop_type":"eos","tokens_predicted":3,"tokens_evaluated":5,'
             b'"model":"m","timings":{"prompt_n":5,"prompt_ms":Infinity,"predicted_n":1e400,"predicted_ms":NaN,'
             b'"cache_n":-Infinity}}\n\n')

    def answer(c):
        body = b'data: {"content":"a","stop":false}\n\n' + final
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n%s"
                  % (len(body), body))
    up = raw_upstream(answer)
    try:
        h = proxy(upstream=up.url)
        c = http.client.HTTPConnection("127.0.0.1", h.port, timeout=10)
        c.request("POST", "/completion", b'{"prompt":"x","stream":true}')
        assert c.getresponse().read().endswith(final)
        a = last_span(h).attributes
    finally:
        up.close()
    assert a["gen_ai.usage.input_tokens"] == 5 and a["gen_ai.usage.output_tokens"] == 3
    assert a["gen_ai.response.finish_reasons"] == ("eos",) and a["llamacpp.timings.prompt_n"] == 5
    assert "gpu_census.attribution.status" in a                      # the GPU cost came too
    assert not [k for k in a if k.startswith("llamacpp.timings.") and k != "llamacpp.timings.prompt_n"]
    assert "gen_ai.latency.time_in_model_prefill" not in a
