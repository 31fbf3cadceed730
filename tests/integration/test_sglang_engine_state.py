"""The engine state (issue 62) against SGLang's own classes: a Scheduler whose waiting queue, running batch, cap
and KV pool (SGLang's paged token allocator, on the CPU) the state reads, real Reqs and ScheduleBatches run
through the hooks SGLang's plugin loader applied, and a retraction as ScheduleBatch.retract_decode returns it
(its body needs a GPU model's pools). Settling here, from stand-in census steps."""
from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from test_sglang_classes import SCHED, _engine, _http_request, _req, _through_the_http_side, sglang  # noqa: F401
from sglang.srt.managers.schedule_batch import FINISH_LENGTH, ScheduleBatch  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

from engine_standins import Census  # noqa: E402
from otel_gpu_census.attribution.engine_state import FIELDS  # noqa: E402
from otel_gpu_census.census import Step  # noqa: E402
from otel_gpu_census.integrations.sglang import instrumentor as si  # noqa: E402

POOL = 1024


@pytest.fixture(scope="module")
def loaded():
    """Our plugin loaded by SGLang's own loader, once a process (SGLang's registry cannot take hooks back: a
    second load would wrap them twice)."""
    import sglang.srt.plugins as plugins
    mp = pytest.MonkeyPatch()
    if not si._registered:
        mp.setenv("CUDA_INJECTION64_PATH", "/nonexistent/libotel_gpu_census.so")
        mp.setenv("SGLANG_PLUGINS", "otel_gpu_census")
        mp.setattr(plugins, "_plugins_loaded", False)
        plugins.load_plugins()
    si.GUARD.off = False
    yield
    si.GUARD.off = True
    mp.undo()


def scheduler(cap):
    import torch
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    sched = object.__new__(Scheduler)
    sched.server_args = SCHED.server_args
    sched.waiting_queue = []
    sched.running_batch = ScheduleBatch(reqs=[], batch_is_full=False)
    sched.max_running_requests, sched.max_total_num_tokens = cap, POOL
    sched.token_to_kv_pool_allocator = PagedTokenToKVPoolAllocator(POOL, 1, torch.float16, "cpu", None, False)
    return sched


def run(sched, batch, census, tokens_used):
    """Scheduler.run_batch through its hook (the KV pool holding `tokens_used` as it runs)."""
    alloc = sched.token_to_kv_pool_allocator
    alloc.clear()
    alloc.alloc(tokens_used)
    si._run_batch(lambda self, b: None, sched, batch)
    census.steps[max(census.steps, default=0) + 1] = Step(id=max(census.steps, default=0) + 1, kernel_count=1,
                                                          kernel_ns=1000)


def test_state_per_batch_and_a_retracted_requests_recomputation_priced(loaded, tagged, tmp_path, monkeypatch):
    from otel_gpu_census.integrations.sglang import sched_state
    monkeypatch.setattr(sched_state, "KV_EVERY", 1)            # the KV pool read every step (below: every 16th)
    census = Census(complete=1 << 62)
    eng, spans = _engine(census)
    sched = scheduler(cap=2)
    a, b, c = (_req(x, _through_the_http_side(x, _http_request()), prompt=30) for x in ("a", "b", "c"))
    states = []
    si.GUARD.current = eng
    try:
        for r in (a, b, c):
            si._add_request_to_queue(lambda self, req, is_retracted=False: None, sched, r)
        sched.waiting_queue = [c]
        opened = eng.ledger.step_opened
        eng.ledger.step_opened = lambda *a_, **k: (states.append(a_[5] if len(a_) > 5 else k.get("state")),
                                                   opened(*a_, **k))[1]
        prefill = ScheduleBatch(reqs=[a, b], forward_mode=ForwardMode.EXTEND, extend_lens=[30, 30], prefix_lens=[0, 0])
        run(sched, prefill, census, 60)                        # 1: a and b prefill, c waits (the cap is 2)
        sched.running_batch = ScheduleBatch(reqs=[a, b], forward_mode=ForwardMode.DECODE)
        for r in (a, b):
            r.output_ids.extend([5, 6, 7])                     # (3 tokens out each by now)
        run(sched, sched.running_batch, census, 66)            # 2: decode
        # the pool is full: SGLang retracts b (retract_decode frees its KV, b goes back to the queue)
        si._retract_decode(([b], 0.5, []), sched.running_batch)
        sched.running_batch = ScheduleBatch(reqs=[a], forward_mode=ForwardMode.DECODE)
        sched.waiting_queue = [b, c]
        run(sched, sched.running_batch, census, 34)            # 3: a alone; b and c wait
        # b prefilled again: its prompt and the 3 tokens out, 32 of which had their KV before
        again = ScheduleBatch(reqs=[b], forward_mode=ForwardMode.EXTEND, extend_lens=[33], prefix_lens=[0])
        sched.waiting_queue = [c]
        run(sched, again, census, 68)                          # 4: beside a's running batch
        sched.running_batch = ScheduleBatch(reqs=[a, b], forward_mode=ForwardMode.DECODE)
        run(sched, sched.running_batch, census, 70)            # 5
        for r in (a, b, c):
            r.finished_reason = FINISH_LENGTH(length=3)
        si._stream_output(lambda self, reqs, lp, skip_req=None: None, None, [a, b, c], False)
    finally:
        si.GUARD.current = None
    seg = tmp_path / "gpu-census-1-1.seg"
    eng._requests_log._segment = lambda: str(seg)
    eng.settle(final=True)
    eng._requests_log.summary(eng.ledger)

    got = [dict(zip(FIELDS, st)) for st in states]
    assert [g["running"] for g in got] == [2, 2, 1, 2, 2]
    assert [g["waiting"] for g in got] == [1, 1, 2, 1, 1]
    assert {g["cap"] for g in got} == {2}
    assert [g["kv_used"] for g in got] == [60, 66, 34, 68, 70]
    assert all(g["kv_used"] + g["kv_free"] == POOL for g in got)
    assert [g["preempted"] for g in got] == [0, 0, 1, 0, 0]    # counted with the step it was made for
    assert [g["recomputed"] for g in got] == [0, 0, 0, 32, 0]

    lines = [json.loads(x) for x in (tmp_path / "gpu-census-1-1.requests.jsonl").read_text().splitlines()]
    reqs = {x["id"]: x for x in lines if "id" in x}
    # step 4 was b's alone: 32 of its 33 tokens recomputed, 32/33 of its 1000 ns
    assert reqs["b"]["preemption"] == {"recomputed_tokens": 32, "recompute_kernel_time_ns": 1000 * 32 // 33}
    assert "preemption" not in reqs["a"] and "preemption" not in reqs["c"]
    span = {s.attributes["sglang.request.id"]: s for s in spans.get_finished_spans()}["b"]
    assert span.attributes["gpu_census.preemption.recomputed_tokens"] == 32
    buckets = [x for x in lines if "engine_state" in x]
    assert {x["engine"] for x in buckets} == {"sglang"}
    assert sum(x["engine_state"]["steps"] for x in buckets) == 5
    assert lines[-1]["summary"]["recomputed"] == {"tokens": 32, "kernel_time_ns": 1000 * 32 // 33}


def test_a_scheduler_without_the_fields_leaves_the_state_out_with_one_line(loaded, tagged, caplog):
    census = Census(complete=1 << 62)
    eng, spans = _engine(census)
    sched = scheduler(cap=2)
    del sched.token_to_kv_pool_allocator
    a = _req("a", _through_the_http_side("a", _http_request()), prompt=8)
    si.GUARD.current = eng
    try:
        si._add_request_to_queue(lambda self, req, is_retracted=False: None, sched, a)
        with caplog.at_level(logging.WARNING, logger="otel_gpu_census.sglang"):
            for _ in range(3):
                si._run_batch(lambda self, b: None, sched, ScheduleBatch(reqs=[a], forward_mode=ForwardMode.DECODE))
        a.finished_reason = FINISH_LENGTH(length=3)
        a.output_ids.append(1)
        si._stream_output(lambda self, reqs, lp, skip_req=None: None, None, [a], False)
    finally:
        si.GUARD.current = None
    assert len([r for r in caplog.records if "engine state" in r.message]) == 1
    assert eng._state is None and not si.GUARD.off
    for sid in range(1, 4):
        census.steps[sid] = Step(id=sid, kernel_count=1, kernel_ns=10)
    assert eng.settle() == 1                                   # the request is served as before
    assert spans.get_finished_spans()[0].attributes["gpu_census.kernel.count"] == 3
    assert eng.ledger.states.steps == 0


def test_the_kv_pool_is_read_every_kv_every_steps_and_held_between(loaded, tagged):
    from otel_gpu_census.integrations.sglang.sched_state import KV_EVERY, state_reader
    sched = scheduler(cap=8)
    read = state_reader(sched)
    alloc = sched.token_to_kv_pool_allocator
    used = []
    for i in range(2 * KV_EVERY + 1):
        alloc.clear()
        alloc.alloc(i + 1)
        used.append(read(sched.running_batch, 0, 0)[3])
    assert used == [1] * KV_EVERY + [KV_EVERY + 1] * KV_EVERY + [2 * KV_EVERY + 1]
