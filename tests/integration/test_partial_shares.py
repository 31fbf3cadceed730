"""A share that misses work says so: an engine's requests whose steps the census's step ring no longer
held when settling read them (a real segment written by the native tally, 1,024 slots) end partial,
with the count and the reason on the span and in the request log; the others stay complete."""
from __future__ import annotations

import json
from types import SimpleNamespace

from otel_gpu_census.attribution.steps import RING_SLOTS
from otel_gpu_census.integrations.vllm.engine import EngineTelemetry
from engine_standins import in_memory_telemetry  # tests/support
from stepped_census import one_kernel_per_step, stopped_request

LAP = 76                                     # steps written past one ring: the first LAP are overwritten


def test_steps_the_ring_reused_before_settling_make_their_requests_partial(segments, records, tmp_path, monkeypatch):
    n_steps = RING_SLOTS + LAP
    path = one_kernel_per_step(segments, records, tmp_path, monkeypatch, n_steps)
    rt, spans, _ = in_memory_telemetry("vllm", metrics=False)
    eng = EngineTelemetry(telemetry=rt, settle_period_s=3600)      # settling lags: nothing read until the end
    sched = SimpleNamespace(vllm_config=None)
    early, late = stopped_request("cmpl-early-0-abcdefgh"), stopped_request("cmpl-late-0-abcdefgh")
    eng.request_added(sched, early)
    for sid in range(1, n_steps + 1):
        if sid == LAP + 1:
            eng.request_freed(early)
            eng.request_added(sched, late)
        live = {early.request_id: 1} if sid <= LAP else {late.request_id: 1}
        got = eng.begin_execute(SimpleNamespace(num_scheduled_tokens=live))
        assert got == sid
        eng.end_step(got)
    eng.request_freed(late)
    assert eng.settle() == 2
    got = {s.attributes["vllm.request.id"]: s.attributes for s in spans.get_finished_spans()}
    e, l_ = got[early.request_id], got[late.request_id]
    assert e["gpu_census.attribution.status"] == "partial" and e["gpu_census.kernel.count"] == 0
    assert (f"{LAP} steps that served it are missing from its share (the census's step ring ({RING_SLOTS} slots, "
            "shared with sub-steps) was reused before settling read them); 0 were split") in e["gpu_census.attribution.note"]
    assert l_["gpu_census.attribution.status"] == "complete" and l_["gpu_census.kernel.count"] == RING_SLOTS
    eng._requests_log.summary(eng.ledger)
    lines = [json.loads(x) for x in path.with_suffix(".requests.jsonl").read_text().splitlines()]
    by_id = {x["id"]: x for x in lines if "id" in x}
    assert by_id["cmpl-early-0"]["status"] == "partial" and "step ring" in by_id["cmpl-early-0"]["notes"][0]
    assert lines[-1]["summary"]["steps_missing"] == LAP and lines[-1]["summary"]["requests_partial"] == 1
