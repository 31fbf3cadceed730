"""What a client writes into the proxy's log (round 3): a tracestate header that is malformed, has too
many members or is too long is dropped whole and costs one short line per LOG_EVERY_S, never the
client's text; plain paths do not become span names; a compressed answer is inflated up to a byte
budget, off the event loop. Real sockets, a real upstream."""
from __future__ import annotations

import http.client
import json
import logging
import threading
import time
import zlib

import pytest

from proxy_client import finished_spans
from socket_upstream import SocketUpstream
from otel_gpu_census.integrations.llamacpp import clientlog

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("fresh_standin")]
PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
FORGED = "ERROR forged by the client"

BAD_TRACESTATES = {
    "malformed member": "Bad Key=" + FORGED + "y" * 7900,
    "over 32 members": ",".join(f"k{i}=v{i}" for i in range(33)) + ",k99=" + FORGED.replace(" ", "_"),
    "over 8192 characters": ",".join(f"k{i}={FORGED.replace(' ', '_')}{'z' * 200}" for i in range(40)),
}


def _echo(port, headers):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/echo", headers=headers)
    r = c.getresponse()
    body = r.read()
    c.close()
    return r.status, {k.lower(): v for k, v in json.loads(body)["headers"].items()}


@pytest.mark.parametrize("case", sorted(BAD_TRACESTATES))
def test_a_bad_tracestate_is_dropped_and_many_cost_one_line_without_the_clients_text(proxy, caplog, case):
    h = proxy()
    with caplog.at_level(logging.DEBUG):
        for _ in range(200):
            status, seen = _echo(h.port, {"traceparent": PARENT, "tracestate": BAD_TRACESTATES[case]})
            assert status == 200
            assert "tracestate" not in seen                      # neither read nor forwarded
            assert seen["traceparent"].split("-")[1] == PARENT.split("-")[1]   # still the client's trace
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) <= 2, lines[:3]
    assert "forged" not in caplog.text and "zzzz" not in caplog.text
    assert all(len(x) <= clientlog.LINE_LIMIT + 60 and "\n" not in x for x in lines)
    assert any("tracestate" in x for x in lines)


def test_a_valid_tracestate_goes_upstream(proxy):
    h = proxy()
    status, seen = _echo(h.port, {"traceparent": PARENT, "tracestate": "vendor=abc,other@sys=1 2"})
    assert status == 200 and seen["tracestate"] == "vendor=abc,other@sys=1 2"


def test_the_client_log_escapes_cuts_and_rate_limits_by_kind(caplog, monkeypatch):
    monkeypatch.setattr(clientlog, "LOG_EVERY_S", 60.0)
    cl = clientlog.ClientLog(logging.getLogger("otel_gpu_census.proxy.test"))
    with caplog.at_level(logging.WARNING):
        for _ in range(50):
            cl.warning("a", "x\n2026-01-01 ERROR forged\x1b[2J" + "y" * 5000)
        cl.warning("b", "another kind")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and lines[1] == "another kind"
    assert "\n" not in lines[0] and "\x1b" not in lines[0] and len(lines[0]) <= clientlog.LINE_LIMIT + 30


def test_plain_paths_share_one_span_name_per_method(proxy):
    h = proxy()
    for i in range(5):
        c = http.client.HTTPConnection("127.0.0.1", h.port, timeout=10)
        c.request("GET", f"/echo/user-{i}")
        c.getresponse().read()
        c.close()
    spans = finished_spans(h, 5)
    assert {s.name for s in spans} == {"GET"}
    assert sorted(s.attributes["url.path"] for s in spans)[0] == "/echo/user-0"


# ---- a compressing upstream: a byte budget on the inflated copy, read off the event loop ------------

def _gzip(data_parts, level=9) -> bytes:
    z = zlib.compressobj(level, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    return b"".join(z.compress(p) for p in data_parts) + z.flush()


BLANK_BOMB = _gzip([b'data: {"content":"a","stop":false}\n\n'] + [b"\n" * (1 << 20)] * 64)   # 64 MiB inflated


def _bomb_upstream():
    def answer(c, i):
        head = c.recv(65536)
        if b" /health " in head:
            c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 15\r\n"
                      b"Connection: close\r\n\r\n{\"status\":\"ok\"}")
            return
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Encoding: gzip\r\n"
                  b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(BLANK_BOMB), BLANK_BOMB))
    return SocketUpstream(answer, backlog=64)


def test_a_gzip_bomb_answer_leaves_health_responsive_and_is_read_up_to_the_budget(proxy):
    assert len(BLANK_BOMB) < 200_000
    up = _bomb_upstream()
    try:
        h = proxy(upstream=up.url)
        worst, done = [0.0], threading.Event()

        def probe():
            while not done.is_set():
                t0 = time.monotonic()
                c = http.client.HTTPConnection("127.0.0.1", h.port, timeout=30)
                c.request("GET", "/health")
                assert c.getresponse().read() == b'{"status":"ok"}'
                c.close()
                worst[0] = max(worst[0], time.monotonic() - t0)
                time.sleep(0.02)
        t = threading.Thread(target=probe, daemon=True)
        t.start()
        for _ in range(3):
            c = http.client.HTTPConnection("127.0.0.1", h.port, timeout=30)
            c.request("POST", "/completion", b'{"prompt":"x","stream":true}')
            r = c.getresponse()
            assert r.status == 200 and r.read() == BLANK_BOMB       # the client gets the bytes as sent
            c.close()
        spans = finished_spans(h, 3, timeout=60)
        done.set()
        t.join(30)
    finally:
        up.close()
    assert worst[0] < 1.0, f"/health took {worst[0]:.2f} s while a compressed answer was read"
    for s in spans:
        assert "inflates past" in s.attributes["gpu_census.proxy.body.note"]
        assert s.attributes["gpu_census.proxy.outcome"] == "complete"
        assert s.attributes["gen_ai.response.time_to_first_chunk"] >= 0       # the first event was still read


def test_the_inflated_copy_stops_at_the_budget():
    from otel_gpu_census.integrations.llamacpp import stream
    gz = _gzip([b'{"model":"m","x":"'] + [b"0" * (1 << 20)] * 64 + [b'"}'], level=1)
    r = stream.BodyReader("application/json", "gzip")
    fed = []
    real = r.parser.feed
    r.parser.feed = lambda chunk, t: (fed.append(len(chunk)), real(chunk, t))
    for i in range(0, len(gz), 65536):
        r.feed(gz[i:i + 65536], i)
    assert r.heavy and not fed                       # nothing inflated while the answer passes
    f = r.close(1)
    assert sum(fed) <= stream.MAX_INFLATED_BYTES and max(fed) <= stream.INFLATE_SLICE
    assert "inflates past" in f.note


def test_a_compressed_answer_within_the_budget_reads_as_before():
    from otel_gpu_census.integrations.llamacpp import stream
    events = [b'data: {"content":"a","stop":false}\n\n', b'data: {"content":"","stop":true,"tokens_predicted":'
              b'1,"tokens_evaluated":3}\n\n']
    gz = _gzip(events)
    r = stream.BodyReader("text/event-stream", "gzip")
    r.feed(gz[:10], 5)
    r.feed(gz[10:], 7)
    f = r.close(9)
    assert (f.first_token_ns, f.output_tokens, f.input_tokens, f.note) == (7, 1, 3, None)


# ---- figures an upstream gets wrong ----------------------------------------------------------------

def test_negative_token_counts_and_timings_from_the_upstream_are_left_out():
    from otel_gpu_census.integrations.llamacpp import spans as spanattrs
    from otel_gpu_census.integrations.llamacpp.stream import BodyReader
    r = BodyReader("text/event-stream")
    r.feed(b'data: {"content":"a","stop":false}\n\n', 1)
    r.feed(b'data: {"content":"","stop":true,"tokens_predicted":-5,"tokens_evaluated":-1,'
           b'"timings":{"prompt_n":-3,"predicted_ms":-2.5,"predicted_n":4},'
           b'"usage":{"prompt_tokens":-7,"completion_tokens":-9,"prompt_tokens_details":{"cached_tokens":-1}}}\n\n', 2)
    f = r.close(3)
    assert (f.input_tokens, f.output_tokens, f.cached_tokens) == (None, None, None)
    assert f.timings == {"predicted_n": 4}
    attrs = spanattrs.fact_attributes(f)
    assert not [k for k, v in attrs.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and v < 0]
    r = BodyReader("application/x-ndjson")
    r.feed(b'{"done":true,"response":"","prompt_eval_count":-2,"eval_count":3,"eval_duration":-1}\n', 1)
    f = r.close(2)
    assert (f.input_tokens, f.output_tokens, f.ollama) == (None, 3, {"eval_count": 3})
