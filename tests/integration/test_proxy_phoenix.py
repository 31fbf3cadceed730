"""Spans in a real trace store: the proxy (started as a user starts it, configured by OTEL_* variables)
in front of the llama-server stand-in exports to Arize Phoenix, and the test reads the trace back
through Phoenix's own REST API: our span sits in the client's trace under the client's span, with its
GPU cost from a census segment, TTFT and token counts, and nothing of the prompt or the answer. Then
Phoenix goes away mid-run: the proxy keeps serving and says so once.

Phoenix comes from its own venv (tests/support_phoenix.sh); without it the module skips and says why.
With PHOENIX_SCREENSHOT=FILE.png (and Debian's chromium) the trace's page in Phoenix's UI is saved
there too (docs/phoenix_screenshot.sh).
"""
from __future__ import annotations

import http.client
import ipaddress
import json
import os
import signal
import threading
import time
import uuid
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

import phoenix_server
from proxy_process import listening_port, start_proxy

PHOENIX, WHY_NOT = phoenix_server.find()
if PHOENIX is None:
    pytest.skip(WHY_NOT, allow_module_level=True)

# Phoenix takes 25-50 s to start on 2 cores (imports, then its database migrations)
pytestmark = [pytest.mark.timeout(420), pytest.mark.usefixtures("fresh_standin")]

MS = 1_000_000
# keys that would carry a request's or an answer's text (GenAI, OpenInference and HTTP body names)
CONTENT_KEYS = ("gen_ai.prompt", "gen_ai.completion", "gen_ai.input.messages", "gen_ai.output.messages",
                "gen_ai.system_instructions", "input.value", "llm.input_messages", "llm.output_messages",
                "llm.prompts", "http.request.body.content", "http.response.body.content")


@pytest.fixture(scope="module")
def phoenix(tmp_path_factory):
    ph = phoenix_server.Phoenix(PHOENIX, tmp_path_factory.mktemp("phoenix")).start()
    yield ph
    ph.stop()


@pytest.fixture
def client_tracer(phoenix):
    """The caller's own tracing: its spans go to Phoenix too, so the trace there has both."""
    tp = TracerProvider(resource=Resource.create({"service.name": "chat-client"}))
    tp.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"{phoenix.otlp_http}/v1/traces")))
    yield tp.get_tracer("chat-client")
    tp.shutdown()


def _proxy_env(phoenix, protocol: str) -> dict:
    # The traces endpoint only: Phoenix takes no metrics, and the proxy sends none without an endpoint.
    endpoint = phoenix.otlp_grpc if protocol == "grpc" else f"{phoenix.otlp_http}/v1/traces"
    return {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": protocol,
            "OTEL_SERVICE_NAME": "llama-front", "OTEL_BSP_SCHEDULE_DELAY": "100"}


def _stop(proc, timeout=30):
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return rc, proc.stderr.read()


def _chat(port, body, headers=None, timeout=30):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request("POST", "/v1/chat/completions", json.dumps(body).encode(),
              {"Content-Type": "application/json", **(headers or {})})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, data


def _publish(segments, seg, path: Path) -> None:
    """The segment's new bytes in one step, as the injector's mapped page changes under a seqlock (a
    rewrite in place would let the proxy read a file cut short)."""
    tmp = path.with_name(path.name + ".new")
    segments.write(path.parent, seg, name=tmp.name)
    os.replace(tmp, path)


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


def _is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def test_phoenix_listens_on_the_loopback_only(phoenix):
    socks = phoenix.listening()
    assert {port for _, port in socks} >= {phoenix.http_port, phoenix.grpc_port}
    assert all(_is_loopback(a) for a, _ in socks), socks


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_span_in_phoenix_under_the_callers_span_with_its_gpu_cost(protocol, phoenix, standin, client_tracer,
                                                                   segments, records, census_dir):
    standin.opts.first_token_delay = 0.4
    standin.opts.token_delay = 0.1
    standin.opts.tokens = 3
    seg = segments.new("llama-server", gpu_ref_ns=0)      # CUPTI clock == wall clock
    segments.tally(seg, [], final=False, state=1)
    path = segments.write(census_dir, seg)
    proc = start_proxy(["--upstream", standin.url, "--listen", "127.0.0.1:0", "--dir", str(census_dir),
                        "--upstream-pid", str(os.getpid()), "--gpu-wait", "5"], _proxy_env(phoenix, protocol))
    try:
        port, _ = listening_port(proc)
        prompt = f"the secret prompt {uuid.uuid4().hex}"
        body = {"model": "standin-8b", "stream": True, "stream_options": {"include_usage": True},
                "messages": [{"role": "system", "content": "system words " + uuid.uuid4().hex},
                             {"role": "user", "content": prompt}]}
        with client_tracer.start_as_current_span("client chat", kind=trace.SpanKind.CLIENT) as client:
            headers = {}
            TraceContextTextMapPropagator().inject(headers)
            t_send = time.time_ns()
            status, data = _chat(port, body, headers)
            t_recv = time.time_ns()
        assert status == 200 and data.endswith(b"data: [DONE]\n\n")
        answer = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                         for line in data.decode().split("\n\n")
                         if line.startswith("data: {") and json.loads(line[6:])["choices"])
        assert answer == "tok" * 3
        # The GPU's work in that time, as the injector would publish it a moment later, placed from when
        # the server had the request (after the span began): prompt state saved and one kernel before
        # the first token (sent 0.4 s later), logits and an upload while the last tokens go out, and a
        # copy after the end that belongs to nobody.
        t_up = standin.seen[-1].received_ns
        state_save, logits = 200 * 1024 * 1024 + 7, 3 * 128256 * 4
        recs = [records.memcpy("dtoh", state_save, t_up + 100 * MS, t_up + 130 * MS, dst="pageable"),
                records.kernel(t_up + 200 * MS, t_up + 250 * MS),
                records.memcpy("dtoh", logits, t_up + 550 * MS, t_up + 551 * MS, dst="pageable"),
                records.memcpy("htod", 4096, t_up + 560 * MS, t_up + 561 * MS, src="pinned"),
                records.memcpy("dtoh", 5, t_recv + 2000 * MS, t_recv + 2001 * MS, dst="pageable")]
        time.sleep(0.3)
        segments.tally(seg, recs, final=False, state=1)
        _publish(segments, seg, path)

        ctx = client.get_span_context()
        trace_id, client_id = f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"
        for _ in range(40):        # the injector's flusher goes on publishing (empty) updates every period
            time.sleep(0.25)
            segments.tally(seg, [], final=False, state=1)
            _publish(segments, seg, path)
            if len(phoenix.spans(trace_id)) >= 2:
                break
        spans = phoenix.wait_for_spans(trace_id, lambda ss: len(ss) >= 2)
        rc, err = _stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0 and "Traceback" not in err and "cannot export" not in err, err

    by_name = {s["name"]: s for s in spans}
    assert set(by_name) == {"client chat", "chat standin-8b"}, list(by_name)
    ours, caller = by_name["chat standin-8b"], by_name["client chat"]
    assert ours["context"]["trace_id"] == caller["context"]["trace_id"] == trace_id
    assert ours["parent_id"] == client_id and caller["context"]["span_id"] == client_id
    assert caller["parent_id"] is None
    sent = standin.seen[-1].headers["traceparent"].split("-")
    assert sent[1] == trace_id and sent[2] == ours["context"]["span_id"]       # the server's parent is our span
    # (Phoenix keeps no OTel span kind: it shows OpenInference kinds, and ours as "unknown")

    a = ours["attributes"]
    G = "gpu_census."
    assert a[G + "attribution.status"] == "complete"
    assert a[G + "copy.dtoh.bytes"] == state_save + logits and a[G + "copy.dtoh.count"] == 2
    assert a[G + "prefill.copy.dtoh.bytes"] == state_save                     # before the first token
    assert a[G + "copy.htod.bytes"] == 4096
    assert a[G + "kernel.count"] == 1 and round(a[G + "kernel.time"] * 1e9) == 50 * MS
    assert a[G + "window.copy.dtoh.bytes"] == state_save + logits             # the late copy is outside
    assert a[G + "process.pids"] == [os.getpid()]
    ttft, e2e = a["gen_ai.response.time_to_first_chunk"], _seconds(ours["end_time"]) - _seconds(ours["start_time"])
    assert 0.4 <= ttft < e2e < (t_recv - t_send) / 1e9 + 0.1
    assert a["gen_ai.usage.input_tokens"] == 7 and a["gen_ai.usage.output_tokens"] == 3
    assert a["gen_ai.request.model"] == "standin-8b"

    # nothing of what was asked or answered: no content attribute, no value holding a piece of it
    assert not [k for k in a if k.startswith(CONTENT_KEYS)]
    # Phoenix derives OpenInference names from the gen_ai.* ones; its output.value is the answer's id and
    # model (JSON), never its text
    assert set(json.loads(a.get("output.value", "{}"))) <= {"id", "model"}
    assert a["llm.token_count.completion"] == 3
    texts = [m["content"] for m in body["messages"]] + [answer, "tok"]
    leaked = [(k, v) for k, v in a.items() for s in _strings(v) for t in texts if t in s]
    assert not leaked, leaked

    out = os.environ.get("PHOENIX_SCREENSHOT")
    if out and protocol == "grpc":
        _screenshot(phoenix.span_url(ours["context"]["span_id"]), Path(out))


def _screenshot(url: str, out: Path) -> None:
    """The span's page with its Attributes tab open, tall enough for every attribute."""
    import chromium_shot
    chromium_shot.shoot(url, out, width=1500, height=2950, click="Attributes",
                        wait_for="gpu_census.copy.dtoh.bytes", timeout=180)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size < 1 << 20


def test_phoenix_going_away_mid_run_costs_one_warning_and_no_request(phoenix, standin):
    """Runs last in this module: it stops the module's Phoenix."""
    standin.opts.token_delay = 0.01
    env = _proxy_env(phoenix, "grpc")
    env["OTEL_EXPORTER_OTLP_TIMEOUT"] = "2"          # the exporter gives up on a dead backend after 2 s
    proc = start_proxy(["--upstream", standin.url, "--listen", "127.0.0.1:0", "--no-gpu"], env)
    results, stop_sending = [], threading.Event()
    phoenix_gone = threading.Event()

    def client():
        for _ in range(400):                            # bounded: ~0.1 s a request
            if stop_sending.is_set():
                return
            t0 = time.monotonic()
            status, data = _chat(port, {"model": "m", "messages": [], "stream": True}, timeout=10)
            results.append((phoenix_gone.is_set(), status, data.endswith(b"data: [DONE]\n\n"),
                            time.monotonic() - t0))
            time.sleep(0.05)
    try:
        port, _ = listening_port(proc)
        tid = uuid.uuid4().hex
        status, _ = _chat(port, {"model": "before", "messages": [], "stream": True},
                          {"traceparent": f"00-{tid}-{uuid.uuid4().hex[:16]}-01"})
        assert status == 200
        assert [s["name"] for s in phoenix.wait_for_spans(tid, bool)] == ["chat before"]   # it was exporting
        sender = threading.Thread(target=client)
        sender.start()
        time.sleep(0.5)
        phoenix.stop()
        phoenix_gone.set()
        time.sleep(5)                                   # batches fail and time out meanwhile
        stop_sending.set()
        sender.join(30)
        rc, err = _stop(proc)
    finally:
        stop_sending.set()
        if proc.poll() is None:
            proc.kill()
    after = [r for r in results if r[0]]
    assert len(after) >= 10, results
    assert all(status == 200 and whole for _, status, whole, _ in results), results
    assert max(t for *_, t in results) < 2.0, results    # no request waits on the dead backend
    assert rc == 0 and "Traceback" not in err, err
    assert err.count("traces: cannot export") == 1, err
    assert f"127.0.0.1:{phoenix.grpc_port}" in err


def _seconds(iso: str) -> float:
    """A Phoenix span time (ISO 8601) as Unix seconds."""
    from datetime import datetime
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()
