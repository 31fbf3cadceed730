"""What a client writes into the proxy's log (round 3): a tracestate header that is malformed, has too
many members or is too long is dropped whole and costs one short line per LOG_EVERY_S, never the
client's text; plain paths do not become span names. Real sockets, a real upstream."""
from __future__ import annotations

import http.client
import json
import logging

import pytest

from proxy_client import finished_spans, last_span
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
