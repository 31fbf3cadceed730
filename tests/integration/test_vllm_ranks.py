"""Tensor/pipeline parallel on CPU: EngineCore's ledger settles its requests from its workers' census
segments (written by the native tally for two live child processes standing in for the ranks), each
rank's step n split by step n's tokens; a request's share is the sum over ranks; conservation holds
per rank. What runs inside EngineCore with `--tensor-parallel-size 2`, minus vLLM and the GPU."""
from __future__ import annotations

import os
import subprocess
import time
from types import SimpleNamespace

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel_gpu_census import injector
from otel_gpu_census.attribution.shares import Share
from otel_gpu_census.census import proctree
from otel_gpu_census.integrations.vllm.engine import EngineTelemetry
from otel_gpu_census.integrations.vllm.ranks import RankCensus
from otel_gpu_census.telemetry.request import RequestTelemetry

T = 1_700_000_000_000_000_000
STEPS = 30


@pytest.fixture
def workers():
    """Two live children of this process (EngineCore's workers are its children)."""
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def rank_segment(segments, records, d, proc, kernels_per_step, dtoh, missing=()):
    recs = []
    corr = 0
    for sid in range(1, STEPS + 1):
        if sid in missing:
            continue
        for _ in range(kernels_per_step):
            corr += 1
            recs.append(records.external(corr, sid))
            recs.append(records.kernel(T + corr * 1000, T + corr * 1000 + 100 + sid, corr=corr))
        corr += 1
        recs.append(records.external(corr, sid))
        recs.append(records.memcpy("dtoh", dtoh, T + corr * 1000, T + corr * 1000 + 50, corr=corr))
    return segments.segment(d, recs, final=True, pid=proc.pid, ppid=os.getpid(),
                            start_ticks=proctree.proc_start_ticks(proc.pid))


def test_requests_get_the_sum_of_their_shares_over_ranks_conserved_per_rank(segments, records, workers,
                                                                            tmp_path, monkeypatch):
    d = tmp_path / "census"
    d.mkdir(mode=0o700)
    rank_segment(segments, records, d, workers[0], 7, 1000)
    rank_segment(segments, records, d, workers[1], 5, 999)
    # an unrelated process's segment in the same folder is not a rank
    segments.segment(d, [records.external(1, 1), records.kernel(T, T + 10, corr=1)], pid=1, ppid=0, start_ticks=1)
    monkeypatch.setattr(injector, "segment_path", lambda: "")
    monkeypatch.setattr(injector, "finish", lambda: True)
    monkeypatch.setattr(RankCensus, "_directory", lambda self: d)
    spans = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(spans))
    eng = EngineTelemetry(telemetry=RequestTelemetry(tp, None, provider_name="vllm"), settle_period_s=3600)
    sched = SimpleNamespace(vllm_config=None)
    executor = SimpleNamespace(local_world_size=2, world_size=2)
    live, done = {}, []
    for sid in range(1, STEPS + 1):
        if sid % 5 == 1:
            rid = f"cmpl-{sid}-0-abcdefgh"
            live[rid] = SimpleNamespace(request_id=rid, arrival_time=time.time(), trace_headers=None,
                                        num_prompt_tokens=4, num_output_tokens=2,
                                        status=SimpleNamespace(name="FINISHED_STOPPED"), get_finished_reason=lambda: "stop")
            eng.request_added(sched, live[rid])
        so = SimpleNamespace(num_scheduled_tokens={r: (4 if i == len(live) - 1 and sid % 5 == 1 else 1)
                                                   for i, r in enumerate(live)})
        eng.executor_step(executor, so)                  # MultiprocExecutor.execute_model
        eng.step_output(so)                              # Scheduler.update_from_output
        if sid % 5 == 0:
            rid = next(iter(live))
            eng.request_freed(live.pop(rid))
            done.append(rid)
    for rid in list(live):
        eng.request_freed(live.pop(rid))
        done.append(rid)
    assert eng.settle() == len(done) == 6
    got = {s.attributes["vllm.request.id"]: s.attributes for s in spans.get_finished_spans()}
    assert all(a["gpu_census.attribution.status"] == "complete" for a in got.values())
    assert all(sorted(a["gpu_census.process.pids"]) == sorted(p.pid for p in workers) for a in got.values())
    led = eng.ledger
    assert led.steps_missing == 0 and set(led.per_process) == {p.pid for p in workers}
    for pid, kernels, dtoh in ((workers[0].pid, 7, 1000), (workers[1].pid, 5, 999)):
        per = {k: Share.from_row(v) for k, v in led.per_process[pid].items()}
        assert per["total"].kernel_count == kernels * STEPS and per["total"].copy("dtoh").bytes == dtoh * STEPS
        assert per["unattributed"].is_zero()                # every step served someone
    assert sum(a["gpu_census.kernel.count"] for a in got.values()) == (7 + 5) * STEPS
    assert sum(a["gpu_census.copy.dtoh.bytes"] for a in got.values()) == (1000 + 999) * STEPS
    assert all(a["gpu_census.attribution.steps"] >= 5 for a in got.values())   # counted once, not per rank
    eng.shutdown()                    # EngineCore has no segment here: its log goes beside its workers'
    (log,) = d.glob(f"gpu-census-{os.getpid()}-*.requests.jsonl")
    lines = [__import__("json").loads(x) for x in log.read_text().splitlines()]
    summ = lines[-1]["summary"]
    assert len(lines) == 7 and set(summ["ranks"]) == {str(p.pid) for p in workers}
    assert summ["ranks"][str(workers[0].pid)]["total"]["kernel.count"] == 7 * STEPS


def test_a_rank_whose_census_never_appears_leaves_requests_stale_not_wrong(segments, records, workers,
                                                                           tmp_path, monkeypatch):
    d = tmp_path / "census"
    d.mkdir(mode=0o700)
    rank_segment(segments, records, d, workers[0], 3, 10)    # rank 1 never writes a segment
    monkeypatch.setattr(RankCensus, "_directory", lambda self: d)
    clock = [time.time_ns()]
    spans = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(spans))
    eng = EngineTelemetry(telemetry=RequestTelemetry(tp, None, provider_name="vllm"), settle_period_s=3600,
                          clock=lambda: clock[0])
    r = SimpleNamespace(request_id="x-00000001", arrival_time=clock[0] / 1e9, trace_headers=None, num_prompt_tokens=1,
                        num_output_tokens=1, status=SimpleNamespace(name="FINISHED_STOPPED"), get_finished_reason=lambda: "stop")
    eng.request_added(SimpleNamespace(vllm_config=None), r)
    so = SimpleNamespace(num_scheduled_tokens={r.request_id: 1})
    eng.executor_step(SimpleNamespace(local_world_size=2), so)
    eng.step_output(so)
    eng.request_freed(r)
    assert eng.settle() == 0                                  # waiting for the missing rank
    clock[0] += 6 * 10**9
    assert eng.settle() == 1
    (sp,) = spans.get_finished_spans()
    assert sp.attributes["gpu_census.attribution.status"] == "stale" and sp.attributes["gpu_census.kernel.count"] == 0


def test_a_settling_child_reads_the_workers_segments_of_its_engine(segments, records, workers, tmp_path, monkeypatch):
    """The default settling (a child process of EngineCore): EngineCore records that its workers run the
    steps; the child finds their segments (children of EngineCore, not of itself) in the census folder,
    and every request gets the sum of its shares over the ranks, conserved."""
    import json
    import sys
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "support"))
    from otlp_receiver import OtlpReceiver
    d = tmp_path / "census"
    d.mkdir(mode=0o700)
    rank_segment(segments, records, d, workers[0], 7, 1000)
    rank_segment(segments, records, d, workers[1], 5, 999)
    monkeypatch.setattr(injector, "segment_path", lambda: "")
    monkeypatch.setattr(injector, "finish", lambda: True)
    with OtlpReceiver(grpc_enabled=False) as rx:
        for k, v in {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "none", "OTEL_BSP_SCHEDULE_DELAY": "100",
                     "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_GPU_CENSUS_DIR": str(d),
                     "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{rx.http_port}"}.items():
            monkeypatch.setenv(k, v)
        monkeypatch.delenv("OTEL_GPU_CENSUS_SETTLE", raising=False)
        eng = EngineTelemetry()
        sched = SimpleNamespace(vllm_config=None)
        executor = SimpleNamespace(local_world_size=2, world_size=2)
        live = {}
        for sid in range(1, STEPS + 1):
            if sid % 5 == 1:
                rid = f"cmpl-{sid}-0-abcdefgh"
                live[rid] = SimpleNamespace(request_id=rid, arrival_time=time.time(), trace_headers=None,
                                            num_prompt_tokens=4, num_output_tokens=2,
                                            status=SimpleNamespace(name="FINISHED_STOPPED"),
                                            get_finished_reason=lambda: "stop")
                eng.request_added(sched, live[rid])
            so = SimpleNamespace(num_scheduled_tokens={r: 1 for r in live})
            eng.executor_step(executor, so)
            eng.step_output(so)
            if sid % 5 == 0:
                eng.request_freed(live.pop(next(iter(live))))
        for rid in list(live):
            eng.request_freed(live.pop(rid))
        assert eng.remote is not None and eng.remote.proc is not None
        eng.shutdown()
        assert eng.remote.proc.returncode == 0
        spans = rx.wait_for_spans(lambda s: len(s) >= 6)
    assert len(spans) == 6 and all(s.attributes["gpu_census.attribution.status"] == "complete" for s in spans)
    assert sum(s.attributes["gpu_census.kernel.count"] for s in spans) == (7 + 5) * STEPS
    assert sum(s.attributes["gpu_census.copy.dtoh.bytes"] for s in spans) == (1000 + 999) * STEPS
    assert all(sorted(s.attributes["gpu_census.process.pids"]) == sorted(p.pid for p in workers) for s in spans)
    (log,) = d.glob(f"gpu-census-{os.getpid()}-*.requests.jsonl")    # beside the workers', in EngineCore's name
    summ = json.loads(log.read_text().splitlines()[-1])["summary"]
    assert set(summ["ranks"]) == {str(p.pid) for p in workers}
