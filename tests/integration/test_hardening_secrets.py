"""What a user, client or upstream supplied reaches spans, logs and clients only made safe
(telemetry.redact): credentials in the upstream's URL never (spans, status messages, the start-up
line, 502/503/504 bodies, config errors), secret query values never, headers and prompts never,
non-printable characters escaped. Real sockets, a real upstream, spans from the SDK's in-memory exporter."""
from __future__ import annotations

import http.client
import json
import logging
import socket
import subprocess
import sys
import time

import pytest

from proxy_client import finished_spans
from proxy_process import listening_port, start_proxy

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("fresh_standin")]
PASSWORD = "s3cret-Pw"


def _everything(spans) -> str:
    """All a trace backend would see of these spans, as text."""
    return "\n".join(f"{s.name} {dict(s.attributes)} {s.status.description} {[e.attributes for e in s.events]}"
                     for s in spans)


def _post(port, path, body, headers=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json", **(headers or {})})
    r = c.getresponse()
    return r.status, r.read()


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_upstream_credentials_reach_the_upstream_only(proxy, standin, caplog):
    with_creds = standin.url.replace("http://", f"http://alice:{PASSWORD}@")
    with caplog.at_level(logging.DEBUG):
        h = proxy(upstream=with_creds, upstream_timeout_s=1.0)
        assert PASSWORD not in h.describe() and "REDACTED:REDACTED@" in h.describe()
        status, _ = _post(h.port, "/completion", {"prompt": "x"})
        assert status == 200
        seen = standin.seen[-1].headers
        assert seen["Authorization"] == "Basic YWxpY2U6czNjcmV0LVB3"     # alice:s3cret-Pw, as the URL said
        # a client's own Authorization goes through as sent (it used to end in a 500)
        status, _ = _post(h.port, "/completion", {"prompt": "x"}, {"Authorization": "Bearer client-key"})
        assert status == 200 and standin.seen[-1].headers["Authorization"] == "Bearer client-key"
        standin.opts.drop_before_headers = True                  # 502
        bodies = [_post(h.port, "/completion", {"prompt": "x"})]
        standin.opts.drop_before_headers, standin.opts.hang_before_headers = False, 5.0     # 504
        bodies.append(_post(h.port, "/completion", {"prompt": "x"}))
        down = proxy(upstream=f"http://alice:{PASSWORD}@127.0.0.1:{_closed_port()}")      # 503
        bodies.append(_post(down.port, "/completion", {"prompt": "x"}))
        spans = finished_spans(h, 4) + finished_spans(down, 1)
    assert [b[0] for b in bodies] == [502, 504, 503]
    for _, body in bodies:
        assert PASSWORD not in body.decode() and "REDACTED:REDACTED@127.0.0.1" in body.decode()
    text = _everything(spans)
    assert PASSWORD not in text and "alice" not in text and "upstream" in text
    assert {s.attributes["gpu_census.proxy.upstream"].split(":")[0:2] == ["http", "//REDACTED"] for s in spans} \
        == {True}
    assert [s.status.description for s in spans if s.status.description]       # the messages are there
    assert PASSWORD not in caplog.text


def test_the_proxy_command_never_prints_the_upstream_password(standin):
    p = start_proxy(["--upstream", standin.url.replace("http://", f"http://bob:{PASSWORD}@"),
                     "--listen", "127.0.0.1:0", "--no-gpu"], {"OTEL_TRACES_EXPORTER": "none",
                                                               "OTEL_METRICS_EXPORTER": "none"})
    try:
        port, lines = listening_port(p)
        assert _post(port, "/completion", {"prompt": "x"})[0] == 200
    finally:
        p.terminate()
        out, err = p.communicate(timeout=20)
    text = "".join(lines) + out + err
    assert "REDACTED:REDACTED@127.0.0.1" in text and PASSWORD not in text and "bob" not in text


@pytest.mark.parametrize("upstream", [f"http://u:{PASSWORD}@host:99999", f"http://u:{PASSWORD}/x@host:80",
                                      f"ftp://u:{PASSWORD}@host"])
def test_a_bad_upstream_with_credentials_is_refused_without_repeating_them(upstream):
    p = start_proxy(["--upstream", upstream, "--listen", "127.0.0.1:0", "--no-gpu"])
    out, err = p.communicate(timeout=20)
    assert p.returncode == 2 and "--upstream" in err
    assert PASSWORD not in err and "Traceback" not in err


def test_secret_query_values_are_redacted_and_the_rest_kept(proxy, standin):
    h = proxy()
    qs = "api_key=K1&key=K2&token=K3&x-goog-signature=K4&hf_token=K5&model=m1&temperature=0.5&flag"
    _post(h.port, f"/completion?{qs}", {"prompt": "x"})
    (span,) = finished_spans(h)
    assert span.attributes["url.query"] == ("api_key=REDACTED&key=REDACTED&token=REDACTED&x-goog-signature=REDACTED"
                                            "&hf_token=REDACTED&model=m1&temperature=0.5&flag")
    assert standin.seen[-1].raw_path == f"/completion?{qs}"          # forwarded as sent


def test_headers_and_prompts_stay_out_of_spans_and_logs(proxy, caplog):
    h = proxy()
    secrets = ["HDR-AUTH-SECRET", "HDR-APIKEY-SECRET", "PROMPT-SECRET", "COOKIE-SECRET"]
    with caplog.at_level(logging.DEBUG):
        _post(h.port, "/completion", {"prompt": "PROMPT-SECRET", "stream": True},
              {"Authorization": "Bearer HDR-AUTH-SECRET", "X-Api-Key": "HDR-APIKEY-SECRET",
               "Cookie": "s=COOKIE-SECRET"})
        _post(h.port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "PROMPT-SECRET"}]},
              {"Authorization": "Bearer HDR-AUTH-SECRET"})
        # a malformed request quoting a secret header: the log line says why, never what it quoted
        for raw in (b"GET / HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer HDR-AUTH-SECRET\x01\r\n\r\n",
                    b"GET /?token=HDR-AUTH-SECRET\x01 HTTP/1.1\r\nHost: x\r\n\r\n"):
            s = socket.create_connection(("127.0.0.1", h.port), timeout=5)
            s.sendall(raw)
            assert s.recv(100).startswith(b"HTTP/1.")
            s.close()
        spans = finished_spans(h, 2)
        time.sleep(0.2)
    text = _everything(spans) + caplog.text
    assert "bad request from 127.0.0.1" in caplog.text
    assert not [x for x in secrets if x in text]


def test_client_text_is_escaped_and_bounded_in_spans(proxy):
    h = proxy()
    _post(h.port, "/completion%1b%5B2J", {"prompt": "x"})
    _post(h.port, "/completion", {"prompt": "x", "model": "m\x1b[31m\u202e" + "y" * 5000,
                                   "max_tokens": 10 ** 30})
    plain, model = finished_spans(h, 2)
    assert plain.attributes["url.path"] == "/completion\\x1b[2J" and "\x1b" not in plain.name
    m = model.attributes["gen_ai.request.model"]
    assert m.startswith("m\\x1b[31m\\u202e") and len(m) < 300 and "\x1b" not in model.name
    assert "gen_ai.request.max_tokens" not in model.attributes     # past int64: OTLP could not carry it
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    assert encode_spans([plain, model]).SerializeToString()


def test_run_proxy_start_up_line_hides_the_password(tmp_path, standin):
    """`run --proxy --upstream URL` says where the proxy forwards: without the credentials."""
    import os
    from pathlib import Path
    src = Path(__file__).resolve().parents[2] / "src"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "CUDA_INJECTION"))}
    env.update(PYTHONPATH=str(src), OTEL_TRACES_EXPORTER="none", XDG_RUNTIME_DIR=str(tmp_path))
    p = subprocess.run([sys.executable, "-m", "otel_gpu_census.cli", "run", "--dir", str(tmp_path / "c"),
                        "--proxy", f"127.0.0.1:{_closed_port()}", "--upstream",
                        standin.url.replace("http://", f"http://u:{PASSWORD}@"), "--", "true"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "proxy: listening on" in p.stderr and "REDACTED:REDACTED@127.0.0.1" in p.stderr
    assert PASSWORD not in p.stderr + p.stdout
