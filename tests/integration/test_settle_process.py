"""Settling in a process of its own (integrations/engine/settle_process.py): the vLLM engine side records,
a real child process replays the records, reads the engine's real census segment (written by the
native tally), ends the spans and exports them over real OTLP/HTTP, and writes the request log."""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from otel_gpu_census import injector
from otel_gpu_census.integrations.engine import settle_process
from otel_gpu_census.integrations.vllm.engine import EngineTelemetry

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from otlp_receiver import OtlpReceiver  # noqa: E402
from stepped_census import one_kernel_per_step, stopped_request  # noqa: E402

N_STEPS = 300
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.fixture
def census(segments, records, tmp_path, monkeypatch):
    """An engine whose census segment holds one kernel per step (1..N_STEPS), live and complete up to
    an hour from now. (Not exited: an exited census means a stopping engine, whose settling does its
    final round at once, while these tests' engine still steps.)"""
    path = one_kernel_per_step(segments, records, tmp_path, monkeypatch, N_STEPS)
    monkeypatch.setattr(injector, "finish", lambda: True)
    return path


@pytest.fixture
def otlp(monkeypatch):
    with OtlpReceiver(grpc_enabled=False) as rx:
        for k, v in {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "none",
                     "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "100",
                     "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{rx.http_port}",
                     "OTEL_SERVICE_NAME": "vllm-settle-test"}.items():
            monkeypatch.setenv(k, v)
        monkeypatch.delenv(settle_process.SETTLE_ENV, raising=False)
        yield rx


def serve(eng, steps=N_STEPS, every=10, hook=None):
    """vLLM's hooks for `steps` steps: a request added every `every` steps, one freed every `every`."""
    sched = SimpleNamespace(vllm_config=None)
    live = {}
    for sid in range(1, steps + 1):
        if sid % every == 1:
            rid = f"cmpl-{sid}-0-abcdefgh"
            live[rid] = request(rid, sid)
            eng.request_added(sched, live[rid])
        got = eng.begin_execute(SimpleNamespace(num_scheduled_tokens={r: 1 for r in live}))
        eng.end_step(got)
        eng.outputs({0: SimpleNamespace(outputs=[SimpleNamespace(request_id=r, new_token_ids=[1]) for r in live])})
        if sid % every == 0:
            for r in list(live)[:1]:
                eng.request_freed(live.pop(r))
        if hook:
            hook(sid)
    for r in list(live):
        eng.request_freed(live.pop(r))


def request_log(seg: Path):
    lines = [json.loads(x) for x in seg.with_suffix(".requests.jsonl").read_text().splitlines()]
    return [x for x in lines if "summary" not in x], [x["summary"] for x in lines if "summary" in x]


def test_the_child_settles_the_engines_requests_into_spans_in_their_callers_traces(census, otlp):
    eng = EngineTelemetry()
    serve(eng)
    child = eng.remote.proc
    assert child is not None and child.pid != os.getpid()
    # it yields to the engine on the CPUs they share: every thread of it NICE steps nicer than this process (once it
    # runs its main: it may still be importing)
    nice = lambda pid, tid: int(Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[16])  # noqa: E731
    want, t0 = {min(19, nice(os.getpid(), os.getpid()) + settle_process.NICE)}, time.time()
    while {nice(child.pid, t) for t in os.listdir(f"/proc/{child.pid}/task")} != want and time.time() - t0 < 10:
        time.sleep(0.05)
    assert {nice(child.pid, t) for t in os.listdir(f"/proc/{child.pid}/task")} == want
    assert eng.ledger.pending() == 0 and not hasattr(eng.ledger, "settle")   # no ledger of its own here
    eng.shutdown()
    assert child.returncode == 0                              # it waited for the child to finish
    spans = otlp.wait_for_spans(lambda s: len(s) >= 30)
    assert len(spans) == 30 and {s.trace_id for s in spans} == {TRACE}
    assert sorted(int(s.parent_span_id, 16) for s in spans) == list(range(1, N_STEPS, 10))
    assert all(s.attributes["gpu_census.attribution.status"] == "complete" for s in spans)
    assert all(s.resource["service.name"] == "vllm-settle-test" for s in spans)
    assert all(s.attributes["gen_ai.request.id"] == s.attributes["vllm.request.id"][:-9] for s in spans)
    lines, summary = request_log(census)
    assert len(lines) == 30 and len(summary) == 1
    # conservation: every step's kernel is a request's or unattributed, once
    assert sum(x["gpu"]["kernel.count"] for x in lines) + summary[0]["unattributed"]["kernel.count"] == N_STEPS
    by_id = {x["id"]: x for x in lines}
    for s in spans:
        assert s.attributes["gpu_census.kernel.count"] == by_id[s.attributes["gen_ai.request.id"]]["gpu"]["kernel.count"]
        assert s.attributes["gen_ai.response.time_to_first_chunk"] >= 0


def test_a_stop_sent_to_the_whole_group_leaves_the_child_to_finish_the_engines_last_requests(census, otlp):
    eng = EngineTelemetry()
    serve(eng, steps=150)
    child = eng.remote.proc
    assert os.getpgid(child.pid) != os.getpgid(0)            # a stop sent to the engine's group misses it
    eng.remote.ship()
    deadline = time.monotonic() + 20                          # running (its first request settled) ...
    while not census.with_suffix(".requests.jsonl").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    child.send_signal(signal.SIGINT)                          # ... a stop sent to it as well
    child.send_signal(signal.SIGTERM)
    serve(eng, steps=150)
    time.sleep(0.3)
    assert child.poll() is None
    eng.shutdown()
    assert child.returncode == 0
    lines, summary = request_log(census)
    assert len(lines) == 30 and len(summary) == 1


def test_requests_recorded_before_any_step_still_get_their_spans_at_shutdown(census, otlp):
    eng = EngineTelemetry()
    sched = SimpleNamespace(vllm_config=None)
    req = SimpleNamespace(request_id="cmpl-early-0-abcdefgh", arrival_time=time.time(), num_prompt_tokens=4,
                          num_output_tokens=0, status=SimpleNamespace(name="FINISHED_ABORTED"),
                          trace_headers={"traceparent": f"00-{TRACE}-{1:016x}-01"}, get_finished_reason=lambda: None)
    eng.request_added(sched, req)
    eng.request_freed(req)                                    # aborted before any step ran
    assert eng.remote.proc is None
    eng.shutdown()
    assert eng.remote.proc is not None and eng.remote.proc.returncode == 0
    spans = otlp.wait_for_spans(lambda s: len(s) >= 1)
    assert [s.attributes["error.type"] for s in spans] == ["aborted"]


def test_no_child_the_engine_settles_itself_and_loses_nothing(census, otlp, monkeypatch, caplog):
    def refuse(*a, **k):
        raise OSError("no processes left")
    monkeypatch.setattr(settle_process.subprocess, "Popen", refuse)
    eng = EngineTelemetry()
    serve(eng)
    assert eng.remote is None and "settling in a thread of the engine" in caplog.text
    eng.shutdown()
    spans = otlp.wait_for_spans(lambda s: len(s) >= 30)
    assert len(spans) == 30 and all(s.attributes["gpu_census.attribution.status"] == "complete" for s in spans)
    lines, summary = request_log(census)
    assert len(lines) == 30 and sum(x["gpu"]["kernel.count"] for x in lines) + \
        summary[0]["unattributed"]["kernel.count"] == N_STEPS


def test_an_engine_killed_without_shutdown_still_gets_what_its_census_counted_settled(census, otlp):
    """The engine's end without shutdown (SIGKILL): the child's stdin closes; it settles, writes the
    summary and exports before it exits, and acknowledges every request it settled."""
    eng = EngineTelemetry()
    serve(eng)
    assert eng.remote.ship()
    child = eng.remote.proc
    child.stdin.close()                                       # what the kernel does when the engine dies
    assert child.wait(20) == 0
    lines, summary = request_log(census)
    assert len(lines) == 30 and len(summary) >= 1
    assert len(otlp.wait_for_spans(lambda s: len(s) >= 30)) == 30
    t0 = time.monotonic()
    eng.shutdown()                                            # its child gone, nothing left to settle:
    assert time.monotonic() - t0 < 1.0 and eng.remote.dead   # no wait, and no second child
    assert eng.remote.restarts == 0 and eng.remote._acked == 30


def request(rid, sid):
    """A stopped request in the caller's trace TRACE, under its span `sid`."""
    return stopped_request(rid, {"traceparent": f"00-{TRACE}-{sid:016x}-01"})


def step(eng, live):
    sid = eng.begin_execute(SimpleNamespace(num_scheduled_tokens={r: 1 for r in live}))
    eng.end_step(sid)
    return sid


def wait_acked(eng, n, timeout=20):
    deadline = time.monotonic() + timeout
    while eng.remote._acked < n and time.monotonic() < deadline:
        eng.remote.ship()
        time.sleep(0.05)
    return eng.remote._acked


def test_a_killed_child_is_replaced_its_requests_in_flight_go_on_partial_and_the_lost_are_counted(census, otlp, caplog):
    """The settling child SIGKILLed (the OOM killer): requests the engine had ended and the child had
    settled keep their spans; those it had not are counted as dropped (metric and summary); requests in
    flight get their spans from a new child, partial, saying why; later requests are whole."""
    sched = SimpleNamespace(vllm_config=None)
    eng = EngineTelemetry()
    live = {}
    for i in range(4):                                        # a, b end and are settled by the first child
        r = request(f"cmpl-a{i}-0-abcdefgh", i + 1)
        eng.request_added(sched, r)
        live[r.request_id] = r
    step(eng, live)
    for rid in list(live)[:2]:
        eng.request_freed(live.pop(rid))
    assert wait_acked(eng, 2) == 2
    first = eng.remote.proc
    ended = request("cmpl-lost-0-abcdefgh", 50)               # ends, shipped, killed before it is settled
    eng.request_added(sched, ended)
    step(eng, {**live, ended.request_id: ended})
    eng.request_freed(ended)
    eng.remote.ship()
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    for sid in range(3):                                      # the two in flight go on; a new one comes
        step(eng, live)
    late = request("cmpl-late-0-abcdefgh", 60)
    eng.request_added(sched, late)
    step(eng, {**live, late.request_id: late})
    assert eng.remote.ship()                                  # the shipper finds it gone: a new child
    assert eng.remote.proc is not first and eng.remote.restarts == 1
    assert caplog.text.count("a new one takes over (1 of 5): 2 requests in flight are partial, 1 that had ended") == 1
    step(eng, {**live, late.request_id: late})
    for r in [*live.values(), late]:
        eng.request_freed(r)
    eng.shutdown()
    spans = {s.attributes["vllm.request.id"]: s for s in otlp.wait_for_spans(lambda s: len(s) >= 5)}
    time.sleep(0.3)
    assert len(otlp.span_snapshot()) == 5 and ended.request_id not in spans
    status = {k[5:7]: s.attributes["gpu_census.attribution.status"] for k, s in spans.items()}
    assert status == {"a0": "complete", "a1": "complete", "a2": "partial", "a3": "partial", "la": "complete"}
    assert "settling process was replaced while it was in flight" in spans["cmpl-a2-0-abcdefgh"].attributes[
        "gpu_census.attribution.note"]
    lines, summary = request_log(census)
    assert len(lines) == 5 and summary[-1]["requests_dropped"] == 1 and summary[-1]["requests_partial"] == 2


def test_children_that_keep_dying_leave_the_engine_to_settle_itself_and_it_loses_nothing_more(
        census, otlp, caplog, monkeypatch):
    monkeypatch.setattr(settle_process, "MAX_RESTARTS", 2)
    eng = EngineTelemetry()
    sched = SimpleNamespace(vllm_config=None)
    live = {}
    for kill in range(3):
        r = request(f"cmpl-k{kill}-0-abcdefgh", kill + 1)
        eng.request_added(sched, r)
        live[r.request_id] = r
        step(eng, live)
        eng.remote.ship()
        eng.remote.proc.send_signal(signal.SIGKILL)
        eng.remote.proc.wait(10)
        step(eng, live)
        assert eng.remote.ship() == (kill < 2)                # a new child twice, then none
        assert eng.remote.restarts == min(kill + 1, 2)
    assert eng.remote.dead and "no other takes over; the engine settles its requests itself" in caplog.text
    step(eng, live)                                           # the engine's next step: it settles itself
    assert eng.remote is None and eng._thread is not None
    r = request("cmpl-after-0-abcdefgh", 9)
    eng.request_added(sched, r)
    live[r.request_id] = r
    step(eng, live)
    for r in live.values():
        eng.request_freed(r)
    t0 = time.monotonic()
    eng.shutdown()
    assert time.monotonic() - t0 < 3.0
    spans = {s.attributes["vllm.request.id"][5:7]: s.attributes["gpu_census.attribution.status"]
             for s in otlp.wait_for_spans(lambda s: len(s) >= 4)}
    assert spans == {"k0": "partial", "k1": "partial", "k2": "partial", "af": "complete"}


def test_records_beyond_the_bound_are_dropped_and_counted(census, otlp, monkeypatch, caplog):
    monkeypatch.setattr(settle_process, "MAX_EVENTS", 50)
    monkeypatch.setattr(settle_process, "SHIP_PERIOD_S", 3600.0)  # nobody ships until shutdown
    eng = EngineTelemetry()
    serve(eng, steps=100)
    assert len(eng.remote._events) == 50 and eng.remote.dropped > 0
    eng.shutdown()
    assert eng.remote.proc.returncode == 0


def test_thread_settling_is_one_setting_away(census, otlp, monkeypatch):
    monkeypatch.setenv(settle_process.SETTLE_ENV, "thread")
    eng = EngineTelemetry()
    serve(eng)
    assert eng.remote is None and eng._thread is not None
    eng.shutdown()
    assert len(otlp.wait_for_spans(lambda s: len(s) >= 30)) == 30


def test_an_unknown_settle_mode_says_so_and_settles_in_a_process(monkeypatch, caplog):
    assert settle_process.settle_mode({settle_process.SETTLE_ENV: "fibre"}) == "process"
    assert "neither process nor thread" in caplog.text
    assert settle_process.settle_mode({}) == "process"
    assert settle_process.settle_mode({settle_process.SETTLE_ENV: " Thread "}) == "thread"


@pytest.mark.parametrize("reports", [True, False])
def test_sglangs_scheduler_settles_in_a_child_too_and_a_rank_that_does_not_report_exports_nothing(
        census, otlp, reports):
    """The SGLang integration's StepEngine, in its default (process) settling: the child learns from
    the engine whether this rank reports (SGLang's parallel context lives in the engine)."""
    from otel_gpu_census.integrations.sglang.engine import SchedulerTelemetry
    from otel_gpu_census.integrations.sglang.engine import CARRY_KEY

    class Mode:
        def __init__(self, extend):
            self.extend = extend

        def is_extend(self):
            return self.extend

    class Length:
        def to_json(self):
            return {"type": "length"}
    sched = SimpleNamespace(server_args=SimpleNamespace(served_model_name="m1", model_path="/m1"))
    eng = SchedulerTelemetry(reports=reports)
    live, n_req = {}, 0
    for sid in range(1, N_STEPS + 1):
        if sid % 10 == 1:
            n_req += 1
            req = SimpleNamespace(rid=f"r{n_req}", origin_input_ids=[1] * 8, output_ids=[], finished_reason=None,
                                  finished_output=None, cached_tokens=0,
                                  time_stats=SimpleNamespace(**{CARRY_KEY: {
                                      "traceparent": f"00-{TRACE}-{sid:016x}-01", "start_ns": time.time_ns()}}))
            req.finished = (lambda r=req: r.finished_reason is not None)
            eng.request_queued(sched, req)
            live[req.rid] = req
        prefill = [r for r in live.values() if not r.output_ids]
        b = (SimpleNamespace(reqs=prefill, forward_mode=Mode(True), extend_lens=[8] * len(prefill)) if prefill
             else SimpleNamespace(reqs=list(live.values()), forward_mode=Mode(False), extend_lens=None))
        got = eng.batch_begin(b)
        assert got == sid
        eng.end_step(got)
        for r in b.reqs:
            r.output_ids.append(1)
        if sid % 10 == 0:
            first = next(iter(live.values()))
            first.finished_reason = Length()
        eng.outputs(b.reqs)
        for r in [r for r in live.values() if r.finished_reason is not None]:
            r.finished_output = True
            del live[r.rid]
    for r in list(live.values()):
        r.finished_reason = Length()
        eng.outputs([r])
    child = eng.remote.proc
    eng.shutdown()
    assert child.returncode == 0
    lines, summary = request_log(census)
    assert len(lines) == n_req == 30 and len(summary) == 1
    assert sum(x["gpu"]["kernel.count"] for x in lines) + summary[0]["unattributed"]["kernel.count"] == N_STEPS
    if reports:
        spans = otlp.wait_for_spans(lambda s: len(s) >= 30)
        assert len(spans) == 30 and {s.trace_id for s in spans} == {TRACE}
    else:
        time.sleep(0.5)
        assert otlp.span_snapshot() == []


def test_the_tenant_and_adapter_travel_to_the_child_and_its_log_adds_up_by_tenant(census, otlp):
    """Settling in a real child: each request's tenant (read by the API-server hook, in its trace headers) and LoRA
    adapter reach the child's spans and request log, and `report --by` over that log adds up to its steps."""
    from otel_gpu_census.integrations.vllm.engine import TENANT_HEADER
    from otel_gpu_census.report import chargeback, engine_requests
    eng = EngineTelemetry()
    who = ("team-a", "team-b", "team-c", None)
    made = []

    def tagged_request(rid, sid):
        n = len(made)
        made.append(rid)
        headers = {"traceparent": f"00-{TRACE}-{sid:016x}-01"}
        if who[n % 4]:
            headers[TENANT_HEADER] = who[n % 4]
        req = stopped_request(rid, headers)
        req.lora_request = SimpleNamespace(lora_name="sql-lora") if n % 2 else None
        return req
    global request
    plain, request = request, tagged_request
    try:
        serve(eng)
    finally:
        request = plain
    eng.shutdown()
    spans = otlp.wait_for_spans(lambda s: len(s) >= 30)
    lines, summary = request_log(census)
    assert len(lines) == 30 and len(summary) == 1
    assert {x.get("tenant") for x in lines} == set(who)
    assert {x.get("model") for x in lines} == {"sql-lora", None}          # (no served model named here)
    assert {s.attributes.get("gpu_census.tenant") for s in spans} == set(who)
    cb = chargeback.build([engine_requests.read(str(census.with_suffix(".requests.jsonl")))], "tenant")
    assert cb.summarised and cb.missing is None
    assert sum(x.figures["kernel.count"] for x in cb.rows) + cb.unattributed.figures["kernel.count"] == N_STEPS


def test_the_engine_state_and_a_recomputation_travel_to_the_child_as_records(census, otlp):
    """The scheduler's state rides with each step's record; the child sums it per second into the request log, and
    prices a preempted request's recomputed tokens on its span and log line."""
    from collections import deque
    eng = EngineTelemetry()
    pool = SimpleNamespace(free_block_queue=SimpleNamespace(num_free_blocks=90), num_gpu_blocks=100)
    sched = SimpleNamespace(vllm_config=None, kv_cache_manager=SimpleNamespace(block_pool=pool),
                            max_num_running_reqs=8, waiting=deque([1, 2]), skipped_waiting=deque(), running=[0] * 3)
    eng.step_output(SimpleNamespace(), sched)                   # the scheduler's first update_from_output
    victim = SimpleNamespace(request_id="cmpl-21-0-abcdefgh", num_computed_tokens=5, is_finished=lambda: False)

    def hook(sid):
        if sid == 25:                                           # preempted after its 5th step (5 tokens computed)...
            eng.preempting(sched, victim)
            victim.num_computed_tokens = 0
        if sid >= 25:                                           # ...its next steps (1 token each) compute them again
            victim.num_computed_tokens += 1                     # (advanced as vLLM's schedule() does before a step)
    serve(eng, hook=hook)
    eng.shutdown()
    lines = [json.loads(x) for x in census.with_suffix(".requests.jsonl").read_text().splitlines()]
    states = [x["engine_state"] for x in lines if "engine_state" in x]
    assert {x.get("engine") for x in lines if "engine_state" in x} == {"vllm"}
    assert sum(b["steps"] for b in states) == N_STEPS
    assert {b["cap"] for b in states} == {8} and {b["kv_total"] for b in states} == {100}
    assert sum(b["preempted"] for b in states) == 1 and sum(b["recomputed_tokens"] for b in states) == 5
    assert sum(b["waiting_ns"] for b in states) == 2 * sum(b["step_ns"] for b in states)
    by_id = {x["id"]: x for x in lines if "id" in x}
    assert by_id["cmpl-21-0"]["preemption"]["recomputed_tokens"] == 5
    assert [k for k, x in by_id.items() if "preemption" in x] == ["cmpl-21-0"]
    spans = otlp.wait_for_spans(lambda s: len(s) >= 30)
    span = next(s for s in spans if s.attributes["gen_ai.request.id"] == "cmpl-21-0")
    assert span.attributes["gpu_census.preemption.recomputed_tokens"] == 5
    assert round(span.attributes["gpu_census.preemption.kernel.time"] * 1e9) == \
        by_id["cmpl-21-0"]["preemption"]["recompute_kernel_time_ns"] > 0
