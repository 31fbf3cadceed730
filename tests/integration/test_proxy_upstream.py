"""Upstream connections: reused where the upstream keeps them, never reused dead, retried only when the
upstream cannot have read the request, and the end of an answer never waits for the upstream's close."""
from __future__ import annotations

import http.client
import json
import socket
import struct
import threading
import time

import pytest

from proxy_client import finished_spans
from proxy_process import in_thread_proxies
from socket_upstream import SocketUpstream

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def make_proxy(fresh_standin):
    with in_thread_proxies(fresh_standin.url) as make:
        yield make


def request(port, path, body=None, headers=None, method="POST", chunked=False):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    if chunked:
        conn.request(method, path, body=iter([body]), headers=headers or {}, encode_chunked=True)
    else:
        conn.request(method, path, body=body, headers=headers or {"Content-Type": "application/json"})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, data


# ---------------------------------------------------------------------------------------------
# reuse on the stand-in

def test_connections_are_reused_after_answers_with_a_length(make_proxy, standin):
    p = make_proxy()
    for i in range(4):
        status, data = request(p.port, "/completion", {"prompt": str(i), "n_predict": 2})
        assert status == 200 and json.loads(data)["stop"] is True
    assert len({s.peer for s in standin.seen}) == 1


def test_keepalive_zero_opens_a_connection_per_request(make_proxy, standin):
    p = make_proxy(upstream_keepalive_s=0)
    for i in range(3):
        assert request(p.port, "/completion", {"prompt": str(i)})[0] == 200
    assert len({s.peer for s in standin.seen}) == 3


def test_a_connection_that_carried_a_stream_is_not_reused(make_proxy, standin):
    p = make_proxy()
    for i in range(3):
        status, data = request(p.port, "/completion", {"prompt": str(i), "stream": True})
        assert status == 200 and data.endswith(b"\n\n")
    assert len({s.peer for s in standin.seen}) == 3


def test_upstream_closing_after_streams_unannounced_loses_no_request(make_proxy, standin):
    """llama-server's headers say keep-alive, then it closes after every stream: concurrent streamed
    and non-streamed requests, each answered once and completely."""
    standin.opts.close_unannounced = True
    p = make_proxy()
    errors, done = [], []

    def client(k):
        for i in range(6):
            stream = (i + k) % 2 == 0
            try:
                status, data = request(p.port, "/completion", {"prompt": f"{k}-{i}", "stream": stream})
                assert status == 200, (status, data[:200])
                assert data.endswith(b"\n\n") if stream else json.loads(data)["stop"] is True
                done.append(1)
            except Exception as e:       # collected: a thread's assertion would otherwise be lost
                errors.append(f"{type(e).__name__}: {e}")
    threads = [threading.Thread(target=client, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(done) == 36
    prompts = [json.loads(s.body)["prompt"] for s in standin.seen]
    assert len(prompts) == 36 and len(set(prompts)) == 36          # none sent twice


# ---------------------------------------------------------------------------------------------
# a scripted upstream for what the stand-in cannot do: reset or close a kept connection

def _read_request(conn):
    """One request (head + Content-Length or chunked body) off a socket; None at EOF."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        more = conn.recv(65536)
        if not more:
            return None
        buf += more
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    hdrs = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    if "content-length" in hdrs:
        n = int(hdrs["content-length"])
        while len(rest) < n:
            rest += conn.recv(65536)
        return lines[0], rest[:n]
    if hdrs.get("transfer-encoding") == "chunked":
        while not rest.endswith(b"0\r\n\r\n"):
            rest += conn.recv(65536)
    return lines[0], rest


def _answer(conn, body: bytes, chunked_sse: bool = False) -> None:
    if chunked_sse:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
    else:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                     b"Keep-Alive: timeout=5, max=100\r\n\r\n%s" % (len(body), body))


class ScriptedUpstream(SocketUpstream):
    """Connection i runs scripts[i](conn, log) (the last script for any further ones); log collects
    (connection number, request line, body) for every request read."""

    def __init__(self, scripts):
        self.scripts, self.log = scripts, []
        super().__init__(self._run)

    def _run(self, conn, i):
        def log(req):
            self.log.append((i, req[0], req[1]))
        self.scripts[min(i, len(self.scripts) - 1)](conn, log)


def _serve_one_then(then):
    """Answer one request on the connection (keep-alive), then `then(conn, log)` for the next."""
    def script(conn, log):
        req = _read_request(conn)
        log(req)
        _answer(conn, b'{"n":1}')
        then(conn, log)
    return script


def _reset_unread(conn, log):
    # the next request arrives on a socket closed with nothing read: the kernel answers it with RST
    conn.settimeout(10)
    conn.recv(1, socket.MSG_PEEK)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def _serve(conn, log):
    while True:
        req = _read_request(conn)
        if req is None:
            return
        log(req)
        _answer(conn, b'{"n":2}')


def test_a_reset_kept_connection_is_retried_once_on_a_new_one(make_proxy):
    up = ScriptedUpstream([_serve_one_then(_reset_unread), _serve])
    try:
        p = make_proxy(upstream=f"http://127.0.0.1:{up.port}")
        assert request(p.port, "/completion", {"prompt": "a"}) == (200, b'{"n":1}')
        assert request(p.port, "/completion", {"prompt": "b"}) == (200, b'{"n":2}')
        assert [(i, json.loads(b)["prompt"]) for i, _, b in up.log] == [(0, "a"), (1, "b")]
        spans = finished_spans(p, 2, timeout=5.0)
        assert [s.attributes.get("gpu_census.proxy.upstream_retried") for s in spans] == [None, True]
    finally:
        up.close()


def test_a_request_the_upstream_read_before_closing_is_never_sent_twice(make_proxy):
    def read_then_close(conn, log):
        log(_read_request(conn))          # it has the request; then it goes away without answering
    up = ScriptedUpstream([_serve_one_then(read_then_close), _serve])
    try:
        p = make_proxy(upstream=f"http://127.0.0.1:{up.port}")
        assert request(p.port, "/completion", {"prompt": "a"})[0] == 200
        status, data = request(p.port, "/completion", {"prompt": "b"})
        assert status == 502 and json.loads(data)["error"]["type"] == "proxy_error"
        assert [json.loads(b)["prompt"] for _, _, b in up.log] == ["a", "b"]
        time.sleep(0.2)
        assert up.conns == 1                     # no second connection, so no second copy
        span = finished_spans(p, 2, timeout=5.0)[1]
        assert span.attributes["gpu_census.proxy.outcome"] == "upstream_error"
        assert "gpu_census.proxy.upstream_retried" not in span.attributes
    finally:
        up.close()


def test_a_streamed_request_body_is_not_retried(make_proxy):
    up = ScriptedUpstream([_serve_one_then(_reset_unread), _serve])
    try:
        p = make_proxy(upstream=f"http://127.0.0.1:{up.port}")
        assert request(p.port, "/completion", {"prompt": "a"})[0] == 200
        # chunked, no Content-Length: the proxy streams it through and does not hold it to send again
        status, _ = request(p.port, "/completion", json.dumps({"prompt": "b"}).encode(), chunked=True,
                            headers={"Content-Type": "application/json"})
        assert status == 502
        time.sleep(0.2)
        assert up.conns == 1 and len(up.log) == 1
    finally:
        up.close()


def test_the_end_of_an_answer_does_not_wait_for_the_upstream_to_close(make_proxy):
    def answer_and_linger(conn, log):
        log(_read_request(conn))
        _answer(conn, b'data: {"content":"x","stop":true}\n\n', chunked_sse=True)
        time.sleep(5)                        # the connection stays open, with nothing more to say
    up = ScriptedUpstream([answer_and_linger])
    try:
        p = make_proxy(upstream=f"http://127.0.0.1:{up.port}")
        t = time.monotonic()
        status, data = request(p.port, "/completion", {"prompt": "a", "stream": True})
        assert status == 200 and data == b'data: {"content":"x","stop":true}\n\n'
        assert time.monotonic() - t < 2
    finally:
        up.close()


def test_an_idle_connection_closed_by_the_upstream_is_seen_before_the_loop_reads_it():
    """The check before reuse: the upstream's FIN is in the kernel, the event loop has not run since."""
    import asyncio

    from otel_gpu_census.integrations.llamacpp.upstream import _closed_while_idle

    async def main():
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        loop = asyncio.get_running_loop()
        class Keeps(asyncio.Protocol):           # as aiohttp's protocol: it holds its transport
            def connection_made(self, transport):
                self.transport = transport
        transport, proto = await loop.create_connection(Keeps, *srv.getsockname())
        peer, _ = srv.accept()
        assert not _closed_while_idle(proto)            # open and quiet: reusable
        peer.close()
        time.sleep(0.05)                                 # the FIN arrives; the loop does not run
        assert not transport.is_closing()
        assert _closed_while_idle(proto)
        transport.close()
        srv.close()
    asyncio.run(main())
