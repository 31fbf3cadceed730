"""The engine state (issue 62) against vLLM's own scheduler objects: a Scheduler whose running list, waiting
queues, cap and KV-cache manager are vLLM's (its block pool allocating real blocks), whose preemption is
vLLM's Scheduler._preempt_request through the hook, and whose computed tokens advance by vLLM's
_update_after_schedule. What stands in for vLLM is its schedule() loop: the test picks each step's
tokens. The census is a real segment (one kernel per step); settling runs here, to the end."""
from __future__ import annotations

import json
import logging
import time

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (make test-vllm installs it)")
import torch  # noqa: E402

import support_vllm  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from stepped_census import one_kernel_per_step  # noqa: E402
from vllm.v1.core.encoder_cache_manager import EncoderCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.sched.request_queue import SchedulingPolicy, create_request_queue  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from otel_gpu_census import injector  # noqa: E402
from otel_gpu_census.attribution.engine_state import FIELDS  # noqa: E402
from otel_gpu_census.integrations.vllm import instrumentor as vi  # noqa: E402
from otel_gpu_census.integrations.vllm.engine import EngineTelemetry  # noqa: E402
from otel_gpu_census.telemetry.request import RequestTelemetry  # noqa: E402

BLOCKS, BLOCK = 64, 16


def scheduler(cap: int) -> Scheduler:
    """vLLM's Scheduler with vLLM's own parts for what the state reads and what preemption and
    _update_after_schedule touch (its __init__ needs a whole model config)."""
    cfg = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["l0"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float16))])
    s = Scheduler.__new__(Scheduler)
    s.kv_cache_manager = KVCacheManager(cfg, max_model_len=1024, scheduler_block_size=BLOCK, hash_block_size=BLOCK,
                                        enable_caching=False)
    s.max_num_running_reqs = cap
    s.waiting = create_request_queue(SchedulingPolicy.FCFS)
    s.skipped_waiting = create_request_queue(SchedulingPolicy.FCFS)
    s.running, s.requests = [], {}
    s.defer_block_free, s.log_stats, s.enable_return_routed_experts = False, False, False
    s.encoder_cache_manager = EncoderCacheManager(cache_size=0)
    s._inflight_prefills, s.reset_preempted_req_ids, s.finished_req_ids = set(), set(), set()
    # what newer vLLMs' preemption and _update_after_schedule read too (0.25 has none of them)
    s.aux_output_connector, s._pending_encoder_input_ids, s.sched_step_seq = None, {}, 0
    return s


@pytest.fixture
def hooked():
    inst = vi.VllmInstrumentor()
    inst.instrument()
    try:
        yield
    finally:
        inst.uninstrument()


def engine(monkeypatch, segments, records, tmp_path, n_steps):
    path = one_kernel_per_step(segments, records, tmp_path, monkeypatch, n_steps)
    monkeypatch.setattr(injector, "finish", lambda: True)
    spans = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(spans))
    eng = EngineTelemetry(telemetry=RequestTelemetry(tp, None, provider_name="vllm"), settle_period_s=3600)
    monkeypatch.setattr(vi.GUARD, "current", eng)
    monkeypatch.setattr(vi.GUARD, "off", False)
    return eng, spans, path


def step(eng, s, tokens, new=()):
    """One step as EngineCore runs it: vLLM's scheduler output, computed tokens advanced
    (_update_after_schedule), then execute_model's hook."""
    for r in new:
        s.waiting.remove_requests([r]) if r in s.waiting else None
        r.status = RequestStatus.RUNNING
        s.running.append(r)
    for rid, n in tokens.items():
        r = s.requests[rid]
        if r.status == RequestStatus.PREEMPTED:
            s.waiting.remove_requests([r])
            r.status = RequestStatus.RUNNING
            s.running.append(r)
        assert s.kv_cache_manager.allocate_slots(r, n) is not None
    so = support_vllm.make_scheduler_output(tokens, new_requests=new)
    s._update_after_schedule(so)
    sid = eng.begin_execute(so)
    eng.end_step(sid)
    eng.step_output(so, s)                       # Scheduler.update_from_output's hook
    return so


def test_state_per_step_and_a_preempted_requests_recomputation_priced(hooked, segments, records, tmp_path,
                                                                       monkeypatch):
    eng, spans, path = engine(monkeypatch, segments, records, tmp_path, 8)
    s = scheduler(cap=2)
    a, b, c = (support_vllm.make_request(x, 40) for x in ("a", "b", "c"))
    for r in (a, b, c):
        s.requests[r.request_id] = r
        s.waiting.add_request(r)
        eng.request_added(s, r)
    eng.step_output(support_vllm.make_scheduler_output({}), s)    # the scheduler's first output (nothing ran)
    states = []
    monkeypatch.setattr(eng.ledger, "step_opened", _spy(eng.ledger.step_opened, states))
    step(eng, s, {"a": 40, "b": 40}, new=[a, b])                 # 1: both prefill; c waits at the cap
    step(eng, s, {"a": 1, "b": 1})                               # 2
    s.running.remove(b)
    s._preempt_request(b, time.time())                           # vLLM's own preemption, through the hook
    assert b.num_computed_tokens == 0 and b.status == RequestStatus.PREEMPTED
    step(eng, s, {"a": 1})                                       # 3: b waits with c
    step(eng, s, {"a": 1, "b": 41})                              # 4: b computes its 41 tokens again
    step(eng, s, {"a": 1, "b": 1})                               # 5: b is past its mark
    for r in (a, b, c):
        r.status = RequestStatus.FINISHED_STOPPED
        eng.request_freed(r)
    eng.shutdown()

    got = [dict(zip(FIELDS, st)) for st in states]
    assert [g["running"] for g in got] == [2, 2, 1, 2, 2]
    assert [g["waiting"] for g in got] == [1, 1, 2, 1, 1]
    assert {g["cap"] for g in got} == {2}
    assert all(g["kv_used"] + g["kv_free"] == BLOCKS for g in got)
    assert got[0]["kv_used"] == 1 + 2 * 3                        # the null block, 3 blocks each for 40 tokens
    assert got[2]["kv_used"] == 1 + 3                            # b's blocks freed by its preemption
    assert [g["preempted"] for g in got] == [0, 0, 1, 0, 0]
    assert [g["recomputed"] for g in got] == [0, 0, 0, 41, 0]

    lines = [json.loads(x) for x in open(str(path)[:-4] + ".requests.jsonl")]
    reqs = {x["id"]: x for x in lines if "id" in x}
    # b's part of step 4 (1 kernel of 100 ns split 1:41 with a), all of it for recomputed tokens
    assert reqs["b"]["preemption"]["recomputed_tokens"] == 41
    assert reqs["b"]["preemption"]["recompute_kernel_time_ns"] in (97, 98)
    assert "preemption" not in reqs["a"] and "preemption" not in reqs["c"]
    span = {sp.attributes["vllm.request.id"]: sp for sp in spans.get_finished_spans()}["b"]
    assert span.attributes["gpu_census.preemption.recomputed_tokens"] == 41
    assert span.attributes["gpu_census.preemption.kernel.time"] == reqs["b"]["preemption"][
        "recompute_kernel_time_ns"] / 1e9
    buckets = [x["engine_state"] for x in lines if "engine_state" in x]
    assert sum(x["steps"] for x in buckets) == 5
    assert sum(x["preempted"] for x in buckets) == 1 and sum(x["recomputed_tokens"] for x in buckets) == 41
    assert sum(x["recompute_kernel_ns"] for x in buckets) == reqs["b"]["preemption"]["recompute_kernel_time_ns"]
    summary = lines[-1]["summary"]
    assert summary["recomputed"] == {"tokens": 41, "kernel_time_ns": reqs["b"]["preemption"][
        "recompute_kernel_time_ns"]}
    from otel_gpu_census.report import engine_requests, render
    log = engine_requests.read(str(path)[:-4] + ".requests.jsonl")
    assert engine_requests.recomputed(log) == (41, reqs["b"]["preemption"]["recompute_kernel_time_ns"])
    assert len(log.states) == len(buckets) and log.engine == "vllm"
    text = "\n".join(render._engine_request_lines([type("C", (), {"path": str(path)})()]))
    assert "recomputed after preemptions: 41 tokens" in text


def _spy(fn, into):
    def opened(*args, **kw):
        st = args[5] if len(args) > 5 else kw.get("state")
        if st is not None:
            into.append(st)
        return fn(*args, **kw)
    return opened


def test_a_scheduler_without_the_fields_leaves_the_state_out_with_one_line(hooked, segments, records, tmp_path,
                                                                            monkeypatch, caplog):
    eng, spans, path = engine(monkeypatch, segments, records, tmp_path, 3)
    s = scheduler(cap=2)
    del s.kv_cache_manager                       # a release that keeps its KV cache elsewhere
    a = support_vllm.make_request("a", 8)
    s.requests["a"] = a
    eng.request_added(s, a)
    with caplog.at_level(logging.WARNING, logger="otel_gpu_census.vllm"):
        eng.step_output(support_vllm.make_scheduler_output({}), s)
        a.status = RequestStatus.RUNNING
        s.running.append(a)
        so = support_vllm.make_scheduler_output({"a": 8}, new_requests=[a])
        eng.end_step(eng.begin_execute(so))
        eng.end_step(eng.begin_execute(support_vllm.make_scheduler_output({"a": 1})))
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "engine state" in caplog.records[0].message
    a.status = RequestStatus.FINISHED_STOPPED
    eng.request_freed(a)
    eng.shutdown()
    lines = [json.loads(x) for x in open(str(path)[:-4] + ".requests.jsonl")]
    assert [x for x in lines if "engine_state" in x] == []
    assert [x["id"] for x in lines if "id" in x] == ["a"]          # the request is served as before
    assert len(spans.get_finished_spans()) == 1
