"""The proxy in front of a real llama-server (b11434, CPU build) running a tiny random-weight model.

Needs a llama-server binary: $LLAMA_SERVER_BIN, else the default output of
``examples/llamacpp/build_llama_server.sh --cpu`` (~5 min on 2 cores; it prints the binary's path).
The vocabulary comes from $LLAMA_VOCAB_GGUF, else from the llama.cpp source tree that build used.
Without them the tests are skipped, saying which command to run.
"""
from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

import llama_cpu
from otlp_receiver import OtlpReceiver
from otel_gpu_census.integrations.llamacpp import ProxyConfig, start_proxy_in_thread

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "llamacpp"

pytestmark = pytest.mark.timeout(300)








@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    binary, vocab = llama_cpu.binary_and_vocab()
    d = tmp_path_factory.mktemp("llama")
    model = d / "tiny.gguf"
    subprocess.run([sys.executable, str(EXAMPLE / "make_random_gguf.py"), "--vocab-from", vocab, "-o", str(model)],
                   check=True, capture_output=True)
    proc, port = llama_cpu.start(binary, model, d / "server.log")
    yield proc, port, d / "server.log"
    llama_cpu.stop(proc)


@pytest.fixture(scope="module")
def rx():
    with OtlpReceiver(grpc_enabled=False) as r:
        yield r


@pytest.fixture(scope="module")
def proxy(llama, rx):
    _, port, _ = llama
    tp = TracerProvider()
    tp.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=rx.traces_endpoint), schedule_delay_millis=50))
    h = start_proxy_in_thread(ProxyConfig(upstream=f"http://127.0.0.1:{port}", listen_port=0, gpu=False),
                              tp, MeterProvider())
    h.tp = tp
    yield h
    h.stop()
    tp.shutdown()


@pytest.fixture(autouse=True)
def _clear(request, rx):
    yield
    if "proxy" in request.fixturenames:      # spans of this test must not reach the next one
        time.sleep(0.2)
        request.getfixturevalue("proxy").tp.force_flush()
    rx.clear()


def _post(port, path, body, headers=None, conn=None):
    c = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json", **(headers or {})})
    r = c.getresponse()
    return r.status, r.headers, r.read()


def _events(data: bytes):
    return [json.loads(line[6:]) for line in data.split(b"\n") if line.startswith(b"data: {")]


def test_completion_stream_through_the_proxy(proxy, rx):
    tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    status, headers, data = _post(proxy.port, "/completion", {"prompt": "Hello there", "n_predict": 6,
                                                              "stream": True}, {"traceparent": tp})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    ev = _events(data)
    last = ev[-1]
    assert last["stop"] is True and not data.rstrip().endswith(b"[DONE]")
    s = rx.wait_for_spans(lambda ss: ss)[0]
    a = s.attributes
    assert s.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736" and s.parent_span_id == "00f067aa0ba902b7"
    assert a["llamacpp.id_slot"] == last["id_slot"]
    for k in ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "cache_n"):
        assert a[f"llamacpp.timings.{k}"] == last["timings"][k]
    assert a["gen_ai.usage.output_tokens"] == last["tokens_predicted"] == 6
    assert a["gen_ai.usage.input_tokens"] == last["tokens_evaluated"]
    assert 0 < a["gen_ai.response.time_to_first_chunk"] < (s.end_ns - s.start_ns) / 1e9
    assert a["http.response.body.size"] == len(data)


def test_chat_stream_and_ids(proxy, rx):
    status, _, data = _post(proxy.port, "/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True})
    assert status == 200 and data.rstrip().endswith(b"data: [DONE]")
    ev = _events(data)
    a = rx.wait_for_spans(lambda ss: ss)[0].attributes
    assert a["gen_ai.response.id"] == ev[0]["id"] and "gen_ai.request.id" not in a
    assert a["gen_ai.usage.output_tokens"] == ev[-1]["timings"]["predicted_n"]
    assert "gen_ai.response.time_to_first_chunk" in a


def test_one_client_connection_many_streams(proxy):
    c = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=60)
    for i in range(6):
        status, _, data = _post(proxy.port, "/completion", {"prompt": f"n{i}", "n_predict": 2, "stream": True},
                                conn=c)
        assert status == 200 and _events(data)[-1]["stop"] is True
    c.close()


def test_concurrent_requests(proxy, rx):
    out = []

    def one(i):
        out.append(_post(proxy.port, "/completion", {"prompt": f"q{i}", "n_predict": 4, "stream": True})[0])
    ts = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert out == [200] * 4
    spans = rx.wait_for_spans(lambda ss: len(ss) == 4)
    assert {s.attributes["llamacpp.id_slot"] for s in spans} <= {0, 1}


def _slots_busy(port):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    c.request("GET", "/slots")
    r = c.getresponse()
    body = r.read()
    if r.status != 200:
        return None
    return any(s.get("is_processing") for s in json.loads(body))


def test_client_hangup_stops_generation(proxy, llama, rx):
    _, port, _ = llama
    sock = socket.create_connection(("127.0.0.1", proxy.port))
    body = json.dumps({"prompt": "Go on", "n_predict": 5000, "stream": True}).encode()
    sock.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    got = b""
    while got.count(b"data: ") < 2:
        got += sock.recv(4096)
    sock.close()
    s = rx.wait_for_spans(lambda ss: ss)[0]
    assert s.attributes["gpu_census.proxy.outcome"] == "client_disconnected"
    busy = _slots_busy(port)
    if busy is None:
        pytest.skip("/slots not available on this llama-server")
    deadline = time.monotonic() + 10
    while _slots_busy(port) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _slots_busy(port), "llama-server kept generating after the client left"
