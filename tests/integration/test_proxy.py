"""The proxy against the llama-server / Ollama stand-in, spans checked over OTLP with a real receiver."""
from __future__ import annotations

import gzip
import http.client
import json
import socket
import threading
import time

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from llama_standin import Opts, Standin
from otlp_receiver import OtlpReceiver
from otel_gpu_census.integrations.llamacpp import ProxyConfig, start_proxy_in_thread

pytestmark = pytest.mark.timeout(60)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def standin():
    st = Standin().start()
    yield st
    st.stop()


@pytest.fixture(scope="module")
def receiver():
    with OtlpReceiver(grpc_enabled=False) as rx:
        yield rx


@pytest.fixture(autouse=True)
def _fresh(standin, receiver):
    standin.opts = Opts()
    standin.seen.clear()
    receiver.clear()


class Running:
    def __init__(self, handle, tp, metrics):
        self.handle, self.tp, self.metrics = handle, tp, metrics

    @property
    def port(self):
        return self.handle.port

    def stop(self):
        self.handle.stop()
        self.tp.shutdown()


@pytest.fixture
def make_proxy(standin, receiver):
    running = []

    def make(upstream=None, census_source=None, **cfg):
        tp = TracerProvider()
        tp.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=receiver.traces_endpoint),
                                                 schedule_delay_millis=50))
        metrics = InMemoryMetricReader()
        cfg.setdefault("gpu", census_source is not None)
        config = ProxyConfig(upstream=upstream or standin.url, listen_port=0, **cfg)
        h = start_proxy_in_thread(config, tp, MeterProvider(metric_readers=[metrics]), census_source)
        r = Running(h, tp, metrics)
        running.append(r)
        return r
    yield make
    for r in running:
        r.stop()


def request(port, method, path, body=None, headers=None, timeout=30):
    """(status, headers, body bytes) over a fresh connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    if isinstance(body, dict):
        body = json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **(headers or {})}
    conn.request(method, path, body=body, headers=headers or {})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, resp.headers, data


def one_span(receiver, name_prefix="", timeout=10):
    spans = receiver.wait_for_spans(lambda ss: any(s.name.startswith(name_prefix) for s in ss), timeout)
    return [s for s in spans if s.name.startswith(name_prefix)][0]


# ---------------------------------------------------------------------------------------------
# passthrough

@pytest.mark.parametrize("path,body", [
    ("/completion", {"prompt": "hi", "stream": True}),
    ("/v1/completions", {"prompt": "hi", "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True,
                              "stream_options": {"include_usage": True}}),
    ("/api/generate", {"model": "m", "prompt": "hi"}),
    ("/api/chat", {"model": "m", "messages": []}),
])
def test_streams_pass_byte_for_byte(make_proxy, standin, path, body):
    standin.opts.ping_every_tokens = 2
    p = make_proxy()
    status, headers, data = request(p.port, "POST", path, body)
    assert status == 200
    assert data == standin.seen[-1].sent and len(data) > 100
    assert headers["Content-Type"] == ("application/x-ndjson" if path.startswith("/api") else "text/event-stream")


def test_non_streamed_and_odd_bytes_pass_unchanged(make_proxy, standin):
    p = make_proxy()
    direct = request(standin.port, "POST", "/completion", {"prompt": "hé\u2028", "n_predict": 3})[2]
    via = request(p.port, "POST", "/completion", {"prompt": "hé\u2028", "n_predict": 3})[2]
    assert via == direct
    # a body that is not UTF-8 at all goes both ways untouched
    raw = bytes(range(256)) * 40
    status, _, data = request(p.port, "POST", "/echo", raw, {"Content-Type": "application/octet-stream"})
    assert status == 200 and json.loads(data)["body_len"] == len(raw)
    assert standin.seen[-1].body == raw


def test_compressed_request_body_is_forwarded_as_sent_and_still_read(make_proxy, standin, receiver):
    p = make_proxy()
    raw = json.dumps({"model": "gz-model", "messages": [], "stream": True, "pad": "x" * 4000}).encode()
    gz = gzip.compress(raw)
    status, _, data = request(p.port, "POST", "/v1/chat/completions", gz,
                              {"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert status == 200 and data.endswith(b"data: [DONE]\n\n")
    seen = standin.seen[-1]
    assert seen.headers["Content-Encoding"] == "gzip" and int(seen.headers["Content-Length"]) == len(gz)
    assert seen.body == raw                                # the stand-in (aiohttp) undid the gzip itself
    a = one_span(receiver, "chat").attributes
    assert a["gen_ai.request.model"] == "gz-model" and a["http.request.body.size"] == len(gz)


def test_gzip_stream_passes_compressed_and_is_still_read(make_proxy, standin, receiver):
    standin.opts.gzip = True
    p = make_proxy()
    conn = http.client.HTTPConnection("127.0.0.1", p.port, timeout=10)
    conn.request("POST", "/v1/chat/completions", json.dumps({"messages": [], "stream": True}).encode(),
                 {"Content-Type": "application/json", "Accept-Encoding": "gzip"})
    r = conn.getresponse()
    data = r.read()
    assert r.headers["Content-Encoding"] == "gzip"
    assert data == standin.seen[-1].sent                  # compressed bytes, untouched
    assert gzip.decompress(data).endswith(b"data: [DONE]\n\n")
    a = one_span(receiver, "chat").attributes
    assert a["gen_ai.usage.output_tokens"] == 5 and "gen_ai.response.time_to_first_chunk" in a


def test_proxy_adds_no_default_request_headers(make_proxy, standin):
    p = make_proxy()
    conn = http.client.HTTPConnection("127.0.0.1", p.port, timeout=10)
    conn.putrequest("GET", "/echo", skip_accept_encoding=True)
    conn.endheaders()
    conn.getresponse().read()
    seen = {k.lower() for k in standin.seen[-1].headers}
    assert "accept-encoding" not in seen and "user-agent" not in seen and "content-type" not in seen


def test_hop_by_hop_headers_are_stripped_both_ways(make_proxy, standin):
    p = make_proxy()
    status, headers, data = request(p.port, "GET", "/echo", headers={
        "Connection": "keep-alive, X-Private", "X-Private": "secret", "Keep-Alive": "timeout=5",
        "Proxy-Authorization": "Basic eDp5", "TE": "trailers", "Upgrade": "h2c", "X-Custom": "kept"})
    assert status == 200
    got = {k.lower(): v for k, v in json.loads(data)["headers"].items()}
    for h in ("x-private", "keep-alive", "proxy-authorization", "te", "upgrade"):
        assert h not in got
    assert got["x-custom"] == "kept"
    assert got["host"] == f"127.0.0.1:{standin.port}"
    assert headers["X-Upstream"] == "standin"
    assert "Keep-Alive" not in headers


# ---------------------------------------------------------------------------------------------
# spans

def test_span_joins_incoming_trace_and_forwards_its_own_id(make_proxy, standin, receiver):
    p = make_proxy()
    tp = f"00-{TRACE_ID}-{PARENT_ID}-01"
    request(p.port, "POST", "/v1/chat/completions", {"model": "m7", "messages": [], "stream": True},
            {"traceparent": tp})
    span = one_span(receiver, "chat")
    assert span.trace_id == TRACE_ID and span.parent_span_id == PARENT_ID
    assert span.kind == "server" and span.transport == "http"
    sent = standin.seen[-1].headers["traceparent"]
    assert sent.split("-")[1] == TRACE_ID and sent.split("-")[2] == span.span_id
    assert span.name == "chat m7"
    a = span.attributes
    assert a["gen_ai.request.model"] == "m7"
    # the answer's id is the response's; the proxy's own id of the exchange is never passed off as it
    assert a["gen_ai.response.id"].startswith("chatcmpl-") and "gen_ai.request.id" not in a
    assert len(a["gpu_census.proxy.request.id"]) == 32
    assert a["gen_ai.usage.input_tokens"] == 7 and a["gen_ai.usage.output_tokens"] == 5
    assert a["llamacpp.timings.predicted_n"] == 5 and a["llamacpp.timings.prompt_n"] == 7
    assert a["gpu_census.proxy.outcome"] == "complete" and span.status == "unset"


def test_new_trace_without_traceparent(make_proxy, standin, receiver):
    p = make_proxy()
    request(p.port, "POST", "/completion", {"prompt": "x", "stream": True})
    span = one_span(receiver, "text_completion")
    assert span.parent_span_id == "" and len(span.trace_id) == 32
    assert standin.seen[-1].headers["traceparent"].split("-")[2] == span.span_id
    a = span.attributes
    assert a["llamacpp.id_slot"] == 0 and a["gen_ai.usage.output_tokens"] == 5
    assert len(a["gpu_census.proxy.request.id"]) == 32 and "gen_ai.response.id" not in a   # /completion has no id


def test_ttft_and_latencies_come_from_the_stream(make_proxy, standin, receiver):
    standin.opts.first_token_delay = 0.3
    standin.opts.token_delay = 0.1
    standin.opts.tokens = 4
    p = make_proxy()
    request(p.port, "POST", "/completion", {"prompt": "x", "stream": True})
    a = one_span(receiver, "text_completion").attributes
    sp = one_span(receiver, "text_completion")
    ttft, e2e = a["gen_ai.response.time_to_first_chunk"], (sp.end_ns - sp.start_ns) / 1e9
    assert 0.3 <= ttft < 0.6
    assert e2e >= ttft + 0.3 - 0.01         # three more tokens 0.1 s apart
    assert e2e < 2.0


def test_the_proxy_keeps_when_each_model_request_was_in_flight_for_runs_report(make_proxy, standin):
    """`run --proxy` hands these to its report: the serving period and requests in flight come from them."""
    standin.opts.first_token_delay = 0.2
    p = make_proxy()
    t0 = time.time_ns()
    request(p.port, "POST", "/completion", {"prompt": "x", "stream": True})
    assert request(p.port, "GET", "/slots")[0] == 200 and request(p.port, "GET", "/health")[0] == 200
    t1 = time.time_ns()
    deadline = time.monotonic() + 5
    while not p.handle.served() and time.monotonic() < deadline:
        time.sleep(0.02)
    [(start, end, first)] = p.handle.served()          # the model request only
    assert t0 <= start < first < end <= t1 and first - start >= 200_000_000


def test_ollama_ndjson_usage_and_durations(make_proxy, standin, receiver):
    standin.opts.first_token_delay = 0.2
    p = make_proxy()
    request(p.port, "POST", "/api/generate", {"model": "llama3:8b", "prompt": "x"})
    s = one_span(receiver, "text_completion")
    a = s.attributes
    assert s.name == "text_completion llama3:8b"
    assert a["gen_ai.provider.name"] == "ollama"
    assert a["gen_ai.usage.input_tokens"] == 7 and a["gen_ai.usage.output_tokens"] == 5
    assert a["ollama.eval_duration"] == 15_000_000 and a["ollama.prompt_eval_count"] == 7
    assert a["gen_ai.latency.time_in_model_decode"] == pytest.approx(0.015)
    assert a["gen_ai.response.time_to_first_chunk"] >= 0.2
    assert a["gen_ai.response.finish_reasons"] == ("length",)


def test_non_streamed_answer_has_usage_but_no_ttft(make_proxy, standin, receiver):
    p = make_proxy()
    request(p.port, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 3, "temperature": 0, "top_p": 0.5,
                                                "seed": 7})
    a = one_span(receiver, "text_completion").attributes
    assert a["gen_ai.usage.output_tokens"] == 3 and a["gen_ai.request.max_tokens"] == 3
    assert (a["gen_ai.request.temperature"], a["gen_ai.request.top_p"], a["gen_ai.request.seed"]) == (0.0, 0.5, 7)
    assert a["url.scheme"] == "http" and a["url.path"] == "/v1/completions"
    assert "gen_ai.response.time_to_first_chunk" not in a
    assert a["gen_ai.response.id"].startswith("cmpl-") and "gen_ai.request.id" not in a


def test_embeddings_span(make_proxy, standin, receiver):
    p = make_proxy()
    request(p.port, "POST", "/v1/embeddings", {"input": "x", "model": "e"})
    s = one_span(receiver, "embeddings")
    assert s.attributes["gen_ai.usage.input_tokens"] == 7 and s.name == "embeddings e"


def test_health_is_untraced_other_paths_get_a_plain_span(make_proxy, standin, receiver):
    p = make_proxy()
    assert request(p.port, "GET", "/health")[0] == 200
    assert request(p.port, "GET", "/slots")[0] == 200
    s = one_span(receiver, "GET /slots")
    assert "gen_ai.operation.name" not in s.attributes and s.attributes["http.route"] == "/slots"
    time.sleep(0.3)
    assert not [x for x in receiver.span_snapshot() if "health" in x.name]


def test_upstream_error_status_passes_through_and_marks_the_span(make_proxy, standin, receiver):
    standin.opts.status = 503
    p = make_proxy()
    status, _, data = request(p.port, "POST", "/completion", {"prompt": "x"})
    assert status == 503 and json.loads(data)["error"]["message"] == "Loading model"
    s = one_span(receiver, "text_completion")
    assert s.status == "error" and s.attributes["http.response.status_code"] == 503
    assert s.attributes["error.type"] == "503"


# ---------------------------------------------------------------------------------------------
# faults

def _closed_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_upstream_down_gives_503_json_and_error_span(make_proxy, receiver):
    p = make_proxy(upstream=f"http://127.0.0.1:{_closed_port()}")
    status, headers, data = request(p.port, "POST", "/completion", {"prompt": "x"})
    assert status == 503
    err = json.loads(data)["error"]
    assert err["code"] == 503 and "cannot connect" in err["message"]
    s = one_span(receiver, "text_completion")
    assert s.status == "error" and s.attributes["gpu_census.proxy.outcome"] == "upstream_unavailable"


def test_upstream_closing_without_answer_gives_502(make_proxy, standin, receiver):
    standin.opts.drop_before_headers = True
    p = make_proxy()
    status, _, data = request(p.port, "POST", "/completion", {"prompt": "x"})
    assert status == 502 and json.loads(data)["error"]["type"] == "proxy_error"
    s = one_span(receiver, "text_completion")
    assert s.status == "error" and s.attributes["gpu_census.proxy.outcome"] == "upstream_error"


def test_silent_upstream_gives_504(make_proxy, standin, receiver):
    standin.opts.hang_before_headers = 5
    p = make_proxy(upstream_timeout_s=0.5)
    t = time.monotonic()
    status, _, data = request(p.port, "POST", "/completion", {"prompt": "x"})
    assert status == 504 and time.monotonic() - t < 3
    assert one_span(receiver, "text_completion").attributes["gpu_census.proxy.outcome"] == "upstream_timeout"


def test_upstream_that_closes_after_each_stream_is_never_reused_dead(make_proxy, standin):
    standin.opts.close_after = True
    p = make_proxy()
    conn = http.client.HTTPConnection("127.0.0.1", p.port, timeout=10)   # the client keeps its connection
    for i in range(12):
        conn.request("POST", "/completion", json.dumps({"prompt": str(i), "stream": True}).encode(),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200 and r.read().endswith(b"\n\n")
    conn.close()
    assert len(standin.seen) == 12


def test_upstream_dying_mid_stream_truncates_the_client_and_marks_the_span(make_proxy, standin, receiver):
    standin.opts.drop_after_tokens = 2
    p = make_proxy()
    conn = http.client.HTTPConnection("127.0.0.1", p.port, timeout=10)
    conn.request("POST", "/completion", json.dumps({"prompt": "x", "stream": True}).encode())
    r = conn.getresponse()
    assert r.status == 200
    with pytest.raises(http.client.IncompleteRead):
        r.read()
    s = one_span(receiver, "text_completion")
    assert s.status == "error" and s.attributes["gpu_census.proxy.outcome"] == "upstream_error"
    standin.opts.drop_after_tokens = None
    assert request(p.port, "POST", "/completion", {"prompt": "x", "stream": True})[0] == 200


def test_upstream_silent_mid_stream_times_out(make_proxy, standin, receiver):
    standin.opts.hang_after_tokens = 2
    standin.opts.hang_for = 10
    p = make_proxy(upstream_timeout_s=0.5)
    conn = http.client.HTTPConnection("127.0.0.1", p.port, timeout=10)
    conn.request("POST", "/completion", json.dumps({"prompt": "x", "stream": True}).encode())
    r = conn.getresponse()
    with pytest.raises(http.client.IncompleteRead):
        r.read()
    s = one_span(receiver, "text_completion")
    assert s.attributes["gpu_census.proxy.outcome"] == "upstream_timeout" and s.status == "error"


def _wait(pred, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return False


def test_client_hanging_up_mid_stream_cancels_upstream(make_proxy, standin, receiver):
    standin.opts.tokens = 200
    standin.opts.token_delay = 0.05
    p = make_proxy()
    sock = socket.create_connection(("127.0.0.1", p.port))
    body = json.dumps({"prompt": "x", "stream": True}).encode()
    sock.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    got = b""
    while got.count(b"data: ") < 3:
        got += sock.recv(4096)
    sock.close()
    assert _wait(lambda: standin.seen and standin.seen[-1].cancelled), "upstream kept generating"
    assert not standin.seen[-1].finished
    s = one_span(receiver, "text_completion")
    assert s.attributes["gpu_census.proxy.outcome"] == "client_disconnected" and s.status == "error"
    standin.opts.tokens = 2
    assert request(p.port, "POST", "/completion", {"prompt": "x", "stream": True})[0] == 200


def test_client_hanging_up_while_upstream_is_silent_cancels_upstream(make_proxy, standin, receiver):
    standin.opts.hang_before_headers = 30
    p = make_proxy()
    sock = socket.create_connection(("127.0.0.1", p.port))
    body = b'{"prompt": "x"}'
    sock.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Length: 15\r\n\r\n" + body)
    assert _wait(lambda: len(standin.seen) == 1)
    sock.close()
    assert _wait(lambda: standin.seen[-1].cancelled), "upstream request not cancelled"
    assert one_span(receiver, "text_completion").attributes["gpu_census.proxy.outcome"] == "client_disconnected"


def test_malformed_json_event_passes_and_is_counted(make_proxy, standin, receiver):
    standin.opts.malformed = True
    p = make_proxy()
    status, _, data = request(p.port, "POST", "/completion", {"prompt": "x", "stream": True})
    assert status == 200 and b"data: {not json" in data and data == standin.seen[-1].sent
    s = one_span(receiver, "text_completion")
    assert s.attributes["gpu_census.proxy.body.unparsed_events"] == 1
    assert s.attributes["gen_ai.usage.output_tokens"] == 5 and s.status == "unset"


def test_malformed_request_gets_the_upstreams_answer(make_proxy, standin, receiver):
    p = make_proxy()
    status, _, data = request(p.port, "POST", "/completion", b"{oops", {"Content-Type": "application/json"})
    assert status == 400 and b"prompt" in data
    s = one_span(receiver, "text_completion")
    assert s.attributes["http.response.status_code"] == 400 and s.status == "unset"


def test_body_over_the_limit_is_refused_before_the_upstream_sees_it(make_proxy, standin, receiver):
    p = make_proxy(max_body_bytes=1000)
    status, _, data = request(p.port, "POST", "/completion", b"x" * 5000)
    assert status == 413 and json.loads(data)["error"]["code"] == 413
    assert standin.seen == []
    assert one_span(receiver, "text_completion").attributes["gpu_census.proxy.outcome"] == "body_too_large"


def test_chunked_body_over_the_limit_gets_413(make_proxy, standin):
    p = make_proxy(max_body_bytes=10_000)
    conn = http.client.HTTPConnection("127.0.0.1", p.port, timeout=10)

    def chunks():
        for _ in range(50):
            yield b"y" * 1000
    conn.request("POST", "/slow-upload", body=chunks(), encode_chunked=True)
    assert conn.getresponse().status == 413


def test_large_slow_upload_is_streamed(make_proxy, standin):
    p = make_proxy(max_body_bytes=64 << 20)
    conn = http.client.HTTPConnection("127.0.0.1", p.port, timeout=30)

    def chunks():
        for i in range(40):
            if i % 10 == 0:
                time.sleep(0.05)
            yield b"z" * (1 << 20)
    conn.request("POST", "/slow-upload", body=chunks(), encode_chunked=True)
    r = conn.getresponse()
    assert r.status == 200 and json.loads(r.read())["received"] == 40 << 20


def test_absolute_form_requests_never_leave_for_another_host(make_proxy, standin):
    p = make_proxy()
    for target in (b"http://example.invalid/echo", b"*"):
        sock = socket.create_connection(("127.0.0.1", p.port))
        sock.sendall(b"GET " + target + b" HTTP/1.1\r\nHost: example.invalid\r\n\r\n")
        data = sock.recv(65536)
        sock.close()
        assert data.split(b"\r\n")[0].split(b" ")[1] == b"400", data[:80]
    assert standin.seen == []
    # a path that looks like an authority still goes to the upstream, as a path
    sock = socket.create_connection(("127.0.0.1", p.port))
    sock.sendall(b"GET //example.invalid/echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    data = b""
    while True:
        more = sock.recv(65536)
        if not more:
            break
        data += more
    sock.close()
    assert data.startswith(b"HTTP/1.1 404")          # the stand-in has no such path
    assert standin.seen == [] or standin.seen[-1].raw_path == "//example.invalid/echo"


def test_connect_method_refused(make_proxy, standin):
    p = make_proxy()
    sock = socket.create_connection(("127.0.0.1", p.port))
    sock.sendall(b"CONNECT example.invalid:443 HTTP/1.1\r\nHost: example.invalid:443\r\n\r\n")
    data = sock.recv(65536)
    sock.close()
    assert data.split(b"\r\n")[0].split(b" ")[1] == b"405"
    assert standin.seen == []


def test_concurrent_streams_do_not_mix(make_proxy, standin, receiver):
    standin.opts.token_delay = 0.01
    standin.opts.tokens = 20
    p = make_proxy()
    results = {}

    def one(i):
        results[i] = request(p.port, "POST", "/v1/chat/completions",
                             {"model": f"m{i}", "messages": [], "stream": True})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sent = {s.body: s.sent for s in standin.seen}
    for i, (status, _, data) in results.items():
        assert status == 200
        body = json.dumps({"model": f"m{i}", "messages": [], "stream": True}).encode()
        assert data == sent[body]
    spans = receiver.wait_for_spans(lambda ss: len([s for s in ss if s.name.startswith("chat")]) == 8)
    assert {s.attributes["gen_ai.request.model"] for s in spans} == {f"m{i}" for i in range(8)}
    assert len({s.attributes["gpu_census.proxy.request.id"] for s in spans}) == 8


# ---------------------------------------------------------------------------------------------
# metrics

def _points(reader):
    out = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out[m.name] = (m.unit, list(m.data.data_points))
    return out


def test_metrics(make_proxy, standin):
    standin.opts.first_token_delay = 0.05
    standin.opts.token_delay = 0.02
    p = make_proxy()
    for _ in range(3):
        request(p.port, "POST", "/completion", {"prompt": "x", "stream": True, "model": "mm"})
    # the handler records just after the client has the last byte
    assert _wait(lambda: sum(d.count for d in _points(p.metrics)["gen_ai.server.request.duration"][1]) == 3)
    pts = _points(p.metrics)
    unit, ttft = pts["gen_ai.server.time_to_first_token"]
    assert unit == "s" and sum(d.count for d in ttft) == 3 and min(d.min for d in ttft) >= 0.05
    assert ttft[0].attributes == {"gen_ai.operation.name": "text_completion", "gen_ai.provider.name": "llama.cpp",
                                  "gen_ai.request.model": "mm"}
    _, dur = pts["gen_ai.server.request.duration"]
    assert sum(d.count for d in dur) == 3 and min(d.min for d in dur) >= 0.05 + 4 * 0.02
    _, tpot = pts["gen_ai.server.time_per_output_token"]
    assert sum(d.count for d in tpot) == 3 and 0.015 < max(d.max for d in tpot) < 0.2
    unit, active = pts["gpu_census.requests.in_flight"]
    assert unit == "{request}" and sum(d.value for d in active) == 0


def test_in_flight_counts_requests_in_flight(make_proxy, standin):
    standin.opts.first_token_delay = 1.0
    p = make_proxy()
    t = threading.Thread(target=request, args=(p.port, "POST", "/completion", {"prompt": "x", "stream": True}))
    t.start()
    assert _wait(lambda: len(standin.seen) == 1)
    time.sleep(0.1)
    _, active = _points(p.metrics)["gpu_census.requests.in_flight"]
    assert sum(d.value for d in active) == 1
    t.join()
    # the handler finishes just after the client has the last byte
    assert _wait(lambda: sum(d.value for d in _points(p.metrics)["gpu_census.requests.in_flight"][1]) == 0)


def test_stopping_mid_stream_ends_the_span_and_returns_promptly(make_proxy, standin, receiver):
    standin.opts.tokens = 1000
    standin.opts.token_delay = 0.05
    p = make_proxy()
    got = []

    def client():
        try:
            request(p.port, "POST", "/completion", {"prompt": "x", "stream": True})
        except http.client.HTTPException as e:     # the answer is cut, never ended cleanly
            got.append(e)
    t = threading.Thread(target=client, daemon=True)
    t.start()
    assert _wait(lambda: standin.seen)
    time.sleep(0.2)
    t0 = time.monotonic()
    p.stop()
    assert time.monotonic() - t0 < 6
    t.join(5)
    assert got and isinstance(got[0], http.client.IncompleteRead)
    s = one_span(receiver, "text_completion")
    assert s.attributes["gpu_census.proxy.outcome"] == "proxy_stopped"


def test_unix_socket_upstream(make_proxy, receiver, tmp_path):
    sock = str(tmp_path / "llama.sock")
    st = Standin().start(unix_path=sock)
    try:
        p = make_proxy(upstream="unix:" + sock)
        status, _, data = request(p.port, "POST", "/completion", {"prompt": "x", "stream": True})
        assert status == 200 and data == st.seen[-1].sent
        assert st.seen[-1].headers["Host"] == "localhost"
        assert one_span(receiver, "text_completion").attributes["gpu_census.proxy.upstream"] == "unix:" + sock
    finally:
        st.stop()


def test_loop_lag_probe_is_answered_by_the_proxy_itself(make_proxy, standin, receiver):
    """With --loop-lag-probe the proxy serves its loop's lag at its own path: never forwarded, never
    traced, reset on request. Without it that path is the upstream's like any other."""
    p = make_proxy(loop_lag_s=0.005)
    time.sleep(0.2)
    status, headers, body = request(p.port, "GET", "/.otel-gpu-census/loop-lag?reset=1")
    first = json.loads(body)
    assert status == 200 and first["interval_ms"] == 5 and first["wakeups"] >= 10, first
    assert {"p50_ms", "p99_ms", "max_ms", "over_20ms"} <= set(first)
    assert request(p.port, "GET", "/.otel-gpu-census/loop-lag")[0] == 200
    second = json.loads(request(p.port, "GET", "/.otel-gpu-census/loop-lag")[2])
    assert second["wakeups"] < first["wakeups"] and second["seconds"] < first["seconds"]   # it was reset
    assert request(p.port, "GET", "/slots")[0] == 200
    one_span(receiver, "GET /slots")
    assert not [s for s in receiver.span_snapshot() if "loop-lag" in s.name]
    off = make_proxy()
    assert request(off.port, "GET", "/.otel-gpu-census/loop-lag")[0] == 404     # the stand-in's answer
    receiver.wait_for_spans(lambda ss: any(s.attributes.get("url.path") == "/.otel-gpu-census/loop-lag"
                                           and s.name == "GET" for s in ss), 10)
