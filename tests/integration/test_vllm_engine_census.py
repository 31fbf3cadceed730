"""The vLLM engine side reading a real census segment (written by the native tally) from its settling
thread while the 'engine' thread keeps stepping: what runs inside EngineCore, minus vLLM and the GPU."""
from __future__ import annotations

import json
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


def test_steps_whose_records_one_flush_held_back_are_split_when_they_come(segments, records, tmp_path,
                                                                             monkeypatch):
    """CUPTI's periodic flush (not forced) keeps back a buffer that holds a record still in flight,
    with the finished records before it, and the injector publishes complete_wall_ns all the same: the
    steps in that buffer are not in the census when their turn comes, only after the next flush. Split
    as missing, they left requests of vLLM on a GPU with no steps and their kernels no one's."""
    from segments import map_segment
    T = 1_700_000_000_000_000_000
    path = tmp_path / "gpu-census-1-1.seg"
    mm, seg = map_segment(path, b"engine", gpu_ref_ns=T)
    now = [T]
    waiting = []                                             # GPU work launched, not yet in the census

    def flush(hold=False):                                   # the injector's flusher, one period
        now[0] += 300_000_000                                # (past every step's COMPLETE_SLACK_NS)
        if not hold:
            segments.tally(seg, list(waiting), final=False)
            waiting.clear()
        seg.complete_wall_ns = now[0]

    monkeypatch.setattr(injector, "segment_path", lambda: str(path))
    monkeypatch.setattr(injector, "step_begin", lambda sid: True)
    monkeypatch.setattr(injector, "step_end", lambda: None)
    monkeypatch.setattr(injector, "finish", lambda: True)
    tp = TracerProvider()
    eng = EngineTelemetry(telemetry=RequestTelemetry(tp, None, provider_name="vllm"), clock=lambda: now[0],
                          settle_period_s=3600)              # settled here, by the test
    sched = SimpleNamespace(vllm_config=None)

    def request(rid):
        r = SimpleNamespace(request_id=rid, arrival_time=now[0] / 1e9, trace_headers=None, num_prompt_tokens=4,
                            num_output_tokens=10, status=SimpleNamespace(name="FINISHED_LENGTH_CAPPED"),
                            get_finished_reason=lambda: "length")
        eng.request_added(sched, r)
        return r

    def steps(rids, n):
        for _ in range(n):
            now[0] += 5_000_000
            sid = eng.begin_execute(SimpleNamespace(num_scheduled_tokens={r: 1 for r in rids}))
            waiting.extend([records.external(sid, sid), records.kernel(now[0], now[0] + 100, corr=sid)])
            eng.end_step(sid)

    a, b = request("cmpl-a-0-abcdefgh"), request("cmpl-b-0-abcdefgh")
    steps([a.request_id], 10)
    eng.request_freed(a)
    flush()
    assert eng.settle() == 1                                 # a, its 10 steps counted
    steps([b.request_id], 10)
    eng.request_freed(b)
    flush(hold=True)                                         # complete past b's steps, their buffer held
    assert eng.settle() == 0                                 # b waits ...
    flush()
    assert eng.settle() == 1                                 # ... for the next flush, which brings them
    eng.shutdown()
    lines = [json.loads(x) for x in path.with_suffix(".requests.jsonl").read_text().splitlines()]
    summary = [x["summary"] for x in lines if "summary" in x][0]
    by_id = {x["id"]: x for x in lines if "id" in x}
    assert {k: (v["steps"], v["gpu"]["kernel.count"]) for k, v in by_id.items()} == \
        {"cmpl-a-0": (10, 10), "cmpl-b-0": (10, 10)}
    assert summary["steps_missing"] == 0 and summary["total"]["kernel.count"] == 20
    del mm
