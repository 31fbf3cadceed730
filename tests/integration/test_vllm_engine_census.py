"""The vLLM engine side reading a real census segment (written by the native tally) from its settling
thread while the 'engine' thread keeps stepping: what runs inside EngineCore, minus vLLM and the GPU."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel_gpu_census import injector
from otel_gpu_census.integrations.vllm.engine import EngineTelemetry
from otel_gpu_census.telemetry.request import RequestTelemetry


def test_spans_settle_from_a_real_segment_while_steps_go_on(segments, records, tmp_path, monkeypatch):
    T = 1_700_000_000_000_000_000
    recs = []
    n_steps = 300
    for sid in range(1, n_steps + 1):
        recs.append(records.external(sid, sid))
        recs.append(records.kernel(T + sid * 1000, T + sid * 1000 + 100, corr=sid))
    # live, complete up to an hour from now (an exited census would mean a stopping engine: its
    # settler's final round would race the steps this test still takes)
    path = segments.segment(tmp_path, recs, final=False,
                            edit=lambda seg: setattr(seg, "complete_wall_ns", time.time_ns() + 3600 * 10**9))
    monkeypatch.setattr(injector, "segment_path", lambda: str(path))
    monkeypatch.setattr(injector, "step_begin", lambda sid: True)
    monkeypatch.setattr(injector, "step_end", lambda: None)
    monkeypatch.setattr(injector, "finish", lambda: True)
    spans = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(spans))
    eng = EngineTelemetry(telemetry=RequestTelemetry(tp, None, provider_name="vllm"), settle_period_s=0.01)
    sched = SimpleNamespace(vllm_config=None)
    live = {}
    for sid in range(1, n_steps + 1):
        if sid % 10 == 1:
            rid = f"cmpl-{sid}-0-abcdefgh"
            live[rid] = SimpleNamespace(request_id=rid, arrival_time=time.time(), trace_headers=None,
                                        num_prompt_tokens=4, num_output_tokens=3, num_cached_tokens=0,
                                        status=SimpleNamespace(name="FINISHED_STOPPED"),
                                        get_finished_reason=lambda: "stop")
            eng.request_added(sched, live[rid])
        got = eng.begin_execute(SimpleNamespace(num_scheduled_tokens={r: 1 for r in live}))
        eng.end_step(got)
        eng.outputs({0: SimpleNamespace(outputs=[SimpleNamespace(request_id=r, new_token_ids=[1]) for r in live])})
        if sid % 10 == 0:
            for r in list(live)[:1]:
                eng.request_freed(live.pop(r))
        time.sleep(0.0005)                                   # the settler runs between steps
    for r in list(live):
        eng.request_freed(live.pop(r))
    deadline = time.monotonic() + 10
    while len(spans.get_finished_spans()) < 30 and time.monotonic() < deadline:
        time.sleep(0.05)
    done = spans.get_finished_spans()
    assert len(done) == 30
    assert all(s.attributes["gpu_census.attribution.status"] == "complete" for s in done)
    assert sum(s.attributes["gpu_census.kernel.count"] for s in done) + \
        eng.ledger.unattributed[0] == n_steps
    assert eng.ledger.steps_missing == 0
    eng.shutdown()
    assert threading.active_count() >= 1
