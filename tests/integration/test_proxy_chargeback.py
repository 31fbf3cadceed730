"""Chargeback through the llama.cpp proxy: the tenant from each client's baggage (or a configured header), the
model from its request, a live census segment (the native tally) split among the requests in flight; per
tenant and per model the chargeback counters = the sum of their requests' span shares, every byte."""
from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from chargeback_sums import check_metrics_equal_spans  # tests/support
from llama_standin import Opts, Standin
from otel_gpu_census.attribution.ledger import CensusSource
from otel_gpu_census.integrations.llamacpp import ProxyConfig, start_proxy_in_thread

pytestmark = pytest.mark.timeout(90)
MS = 1_000_000
TENANTS = ("team-a", "team-b", "team-c")
MODELS = ("sql-lora", "chat-lora")


def _post(port, body, headers):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json", **headers})
    resp = conn.getresponse()
    resp.read()
    conn.close()
    return resp.status


def test_three_tenants_and_two_models_through_the_proxy_add_up_to_their_requests(segments, records, census_dir,
                                                                                  monkeypatch):
    from segments import map_segment
    monkeypatch.setenv("OTEL_GPU_CENSUS_TENANT", "header:x-tenant-id,baggage")
    t0 = time.time_ns()
    mm, seg = map_segment(census_dir / "gpu-census-1-1.seg", b"llama-server", wall_start_ns=t0 - 10**9,
                          gpu_ref_ns=t0 - 10**9)
    # the GPU's work for the next 20 s: a kernel and copies every 5 ms (CUPTI clock == wall clock here)
    recs = []
    for i in range(4000):
        t = t0 + i * 5 * MS
        recs += [records.kernel(t, t + MS, corr=i + 1),
                 records.memcpy("htod", 1000 + i, t + 2 * MS, t + 3 * MS, src="pinned", corr=i + 1),
                 records.memcpy("dtoh", 7 + i % 13, t + 3 * MS, t + 4 * MS, dst="pinned", corr=i + 1)]
    segments.tally(seg, recs, final=False)
    stop = threading.Event()

    def flusher():                          # the injector's flusher: publishes every 20 ms
        while not stop.is_set():
            segments.tally(seg, [], final=False)
            seg.complete_wall_ns = time.time_ns()
            stop.wait(0.02)
    flushing = threading.Thread(target=flusher, daemon=True)
    flushing.start()
    standin = Standin().start()
    standin.opts = Opts()
    standin.opts.first_token_delay = 0.03
    standin.opts.token_delay = 0.01
    spans = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    config = ProxyConfig(upstream=standin.url, listen_port=0, gpu=True, gpu_margin_s=0.05, gpu_max_wait_s=5.0)
    h = start_proxy_in_thread(config, tp, MeterProvider(metric_readers=[reader]), CensusSource(str(census_dir)))
    try:
        jobs = []
        for i in range(18):
            who = TENANTS[i % 3]
            headers = ({"x-tenant-id": who} if i % 2 else {"baggage": f"gpu_census.tenant={who}"}) if i % 6 != 5 else {}
            jobs.append(({"model": MODELS[i % 2], "stream": True, "messages": [{"role": "user", "content": "hi"}]},
                         headers))
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            assert list(pool.map(lambda j: _post(h.port, *j), jobs)) == [200] * 18
        deadline = time.monotonic() + 30
        while len([s for s in spans.get_finished_spans() if "gen_ai.request.model" in s.attributes]) < 18:
            assert time.monotonic() < deadline, "the spans did not end"
            time.sleep(0.05)
    finally:
        h.stop()
        standin.stop()
        stop.set()
        flushing.join()
    done = [s for s in spans.get_finished_spans() if "gen_ai.request.model" in s.attributes]
    assert {s.attributes["gpu_census.attribution.status"] for s in done} <= {"complete", "settled"}
    assert {s.attributes.get("gpu_census.tenant", "unknown") for s in done} == set(TENANTS) | {"unknown"}
    assert sum(s.attributes["gpu_census.copy.htod.bytes"] for s in done) > 0
    by_tenant = check_metrics_equal_spans(done, reader)
    assert by_tenant["unknown"]["requests"] == 3
    by_model = check_metrics_equal_spans(done, reader, key="gen_ai.request.model")
    assert set(by_model) == set(MODELS)
    # without a backend: the spans as the Collector's file exporter writes them, and `report --by`
    from google.protobuf.json_format import MessageToJson
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    log = census_dir.parent / "spans.json"
    log.write_text(MessageToJson(encode_spans(spans.get_finished_spans()), indent=None) + "\n")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2] / "src"))
    for by, want in (("tenant", by_tenant), ("model", by_model)):
        p = subprocess.run([sys.executable, "-m", "otel_gpu_census.cli", "report", str(census_dir), "--by", by,
                            "--request-log", str(log), "--json"], env=env, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        got = json.loads(p.stdout)["request_log"]
        assert got["conserved"] is True and got["spans"] == 18
        rows = {r["name"]: r for r in got["rows"]}
        assert set(rows) == set(want)
        for who, s in want.items():
            assert rows[who]["requests"] == s["requests"]
            for f in ("kernel.count", "kernel.time_ns", "copy.htod.bytes", "copy.dtoh.bytes"):
                assert rows[who][f] == s[f], (who, f)
        # the census as tallied (4000 kernels, their bytes), the rows and the rest adding up to it
        census = {"kernel.count": 4000, "copy.htod.bytes": sum(1000 + i for i in range(4000)),
                  "copy.dtoh.bytes": sum(7 + i % 13 for i in range(4000))}
        for f, v in census.items():
            assert got["census"][f] == v
            assert sum(r[f] for r in got["rows"]) + got["rest"][f] == v and got["rest"][f] > 0
    text = subprocess.run([sys.executable, "-m", "otel_gpu_census.cli", "report", str(census_dir), "--by", "tenant",
                           "--request-log", str(log)], env=env, capture_output=True, text=True, timeout=60).stdout
    assert "from the request log's spans (18 with a GPU share" in text and "rest of the census" in text
    del mm


def test_a_hostile_tenant_at_the_proxy_is_cut_or_dropped_and_the_request_served(monkeypatch):
    """A 10 kB tenant header, one with a byte outside printable ASCII (percent-encoded in baggage), baggage past the
    W3C limits: each request is forwarded; the tenant is cut, escaped, or not read."""
    monkeypatch.setenv("OTEL_GPU_CENSUS_TENANT", "header:x-tenant-id,baggage")
    standin = Standin().start()
    standin.opts = Opts()
    spans = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(spans))
    h = start_proxy_in_thread(ProxyConfig(upstream=standin.url, listen_port=0), tp, MeterProvider(), None)
    body = {"model": "m", "stream": True, "messages": []}
    try:
        # (the stand-in upstream, an aiohttp server, answers 400 to a header line past 8 KiB: relayed as such)
        assert _post(h.port, body, {"x-tenant-id": "t" * 10_240}) in (200, 400)
        assert _post(h.port, body, {"baggage": "gpu_census.tenant=a%0Ab%1B"}) == 200
        assert _post(h.port, body, {"baggage": "gpu_census.tenant=" + "x" * 9000}) == 200
        deadline = time.monotonic() + 10
        while len(spans.get_finished_spans()) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        h.stop()
        standin.stop()
    got = sorted((s.start_time, s.attributes.get("gpu_census.tenant")) for s in spans.get_finished_spans())
    assert [t for _, t in got] == ["t" * 128 + "…", "a\\nb\\x1b", None]
