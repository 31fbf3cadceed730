"""The vLLM integration's engine side on CPU: steps, requests, the join to the caller's trace, and
exact conservation, with the census and vLLM's objects stood in for (the real classes are checked in
tests/integration/test_vllm_hooks.py where vLLM imports)."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from otel_gpu_census import injector
from otel_gpu_census.attribution.shares import Share
from otel_gpu_census.census import Stat, Step
from otel_gpu_census.integrations.vllm.engine import OPERATION_HEADER, EngineTelemetry, external_id, response_id
from engine_standins import Census, Clock, in_memory_telemetry  # tests/support


def make(census, clock):
    rt, spans, reader = in_memory_telemetry("vllm")
    eng = EngineTelemetry(telemetry=rt, read=census.read, clock=clock, settle_period_s=3600)
    return eng, spans, reader


def request(rid, arrival_s, trace=None, prompt=16, op=None):
    headers = {}
    if trace:
        headers["traceparent"] = f"00-{trace[0]}-{trace[1]}-01"
    if op:
        headers[OPERATION_HEADER] = op
    return SimpleNamespace(request_id=rid, arrival_time=arrival_s, trace_headers=headers or None,
                           num_prompt_tokens=prompt, num_output_tokens=0, num_cached_tokens=0,
                           status=SimpleNamespace(name="FINISHED_LENGTH_CAPPED"),
                           get_finished_reason=lambda: "length")


SCHED = SimpleNamespace(vllm_config=SimpleNamespace(model_config=SimpleNamespace(served_model_name=["m1"])))


def outputs(*rids):
    return {0: SimpleNamespace(outputs=[SimpleNamespace(request_id=r, new_token_ids=[1],
                                                        prefill_stats=SimpleNamespace(num_cached_tokens=5))
                                        for r in rids])}


def test_ids_are_vllms_request_id_and_the_response_id_the_client_sees():
    assert external_id("cmpl-3f9a2b-0-1a2b3c4d") == "cmpl-3f9a2b-0"       # as vLLM's llm_request span names it
    assert response_id("cmpl-3f9a2b-0-1a2b3c4d") == "cmpl-3f9a2b"         # the stream's "id"
    assert external_id("chatcmpl-abc-9Zz8Yy7X") == response_id("chatcmpl-abc-9Zz8Yy7X") == "chatcmpl-abc"
    assert external_id("2_cmpl-abc-0-1a2b3c4d", child=True) == "cmpl-abc-0"   # n > 1: a child request
    # a caller's own id that starts like a child's is its own (X-Request-Id, the token API)
    assert external_id("2_my-id-1a2b3c4d") == response_id("2_my-id-1a2b3c4d") == "2_my-id"
    assert external_id("resp_9f8e_0-1a2b3c4d") == "resp_9f8e_0" and response_id("resp_9f8e_0-1a2b3c4d") == "resp_9f8e"
    assert external_id("plain") == response_id("plain") == "plain"


def test_process_shutdown_gives_the_engine_a_grace_period(monkeypatch):
    from otel_gpu_census.integrations.vllm import instrumentor as vi
    monkeypatch.setattr(vi.GUARD, "off", False)
    got = []
    call = lambda procs, timeout=None: got.append(timeout)
    vi._process_shutdown(call, None, (["p"],), {"timeout": 0})
    vi._process_shutdown(call, None, (["p"], 10), {})
    vi._process_shutdown(call, None, (["p"],), {})
    assert got == [vi.SHUTDOWN_GRACE_S, 10, None]


def test_a_batch_of_requests_gets_spans_in_their_callers_traces_with_exact_shares(tagged):
    rnd = random.Random(3)
    census, clock = Census(), Clock()
    eng, spans, _ = make(census, clock)
    traces = {}
    live = {}
    done = []
    step_values = []
    for sid in range(1, 120):
        if len(traces) < 12 and rnd.random() < 0.4:
            rid = f"cmpl-{len(traces)}-0-abcd{len(traces):04d}"
            traces[rid] = (f"{rnd.getrandbits(128):032x}", f"{rnd.getrandbits(64):016x}")
            req = request(rid, clock.t / 1e9, traces[rid], op="chat" if len(traces) % 2 else None)
            eng.request_added(SCHED, req)
            live[rid] = [req, 0]
        tokens = {rid: (16 if n == 0 else 1) for rid, (_, n) in live.items()}
        sid_got = eng.begin_execute(SimpleNamespace(num_scheduled_tokens=tokens))
        assert sid_got == sid and tagged == [sid]
        eng.end_step(sid)
        assert tagged == []
        s2 = eng.begin_sample()
        assert s2 == sid
        eng.end_step(s2)
        clock.t += 12_000_000
        census.steps[sid] = Step(id=sid, kernel_count=rnd.randint(50, 90), kernel_ns=rnd.randint(10**6, 9 * 10**6),
                                 copies={"dtoh": Stat(1, 4 * len(tokens) + rnd.randint(0, 3), 900)})
        step_values.append(census.steps[sid])
        eng.outputs(outputs(*live))
        for rid in list(live):
            live[rid][1] += 1
            if live[rid][1] >= rnd.randint(8, 30):
                req = live.pop(rid)[0]
                req.num_output_tokens = 9
                eng.request_freed(req)
                done.append(rid)
        if sid % 10 == 0:
            census.complete = clock.t - 400_000_000
            eng.settle()
    for rid in list(live):
        req = live.pop(rid)[0]
        req.num_output_tokens = 9
        eng.request_freed(req)
        done.append(rid)
    census.complete = clock.t + 10**9
    eng.settle()
    got = {s.attributes["vllm.request.id"]: s for s in spans.get_finished_spans()}
    assert set(got) == set(done) == set(traces)
    for rid, sp in got.items():
        tid, psid = traces[rid]
        assert format(sp.context.trace_id, "032x") == tid and format(sp.parent.span_id, "016x") == psid
        assert sp.attributes["gen_ai.request.id"] == external_id(rid)
        assert sp.attributes["gpu_census.attribution.method"] == "step_tokens"
        assert sp.attributes["gpu_census.attribution.status"] == "complete"
        assert sp.attributes["gen_ai.usage.output_tokens"] == 9 and sp.attributes["gen_ai.usage.input_tokens"] == 16
        assert sp.attributes["gen_ai.response.time_to_first_chunk"] > 0
        assert sp.attributes["gen_ai.latency.time_in_queue"] >= 0
        assert sp.attributes["gen_ai.usage.cache_read.input_tokens"] == 5      # from the first output's prefill stats
        assert sp.name in ("chat m1", "text_completion m1") and sp.attributes["gen_ai.request.model"] == "m1"
    # conservation: spans + what no request claimed == every step, for every field
    for attr, field, scale in (("gpu_census.kernel.count", "kernel_count", 1), ("gpu_census.kernel.time", "kernel_ns", 1e9)):
        assert sum(round(s.attributes[attr] * scale) for s in got.values()) + getattr(
            Share.from_row(eng.ledger.unattributed), field) == sum(getattr(s, field) for s in step_values)
    assert sum(s.attributes["gpu_census.copy.dtoh.bytes"] for s in got.values()) + Share.from_row(
        eng.ledger.unattributed).copy("dtoh").bytes == sum(s.copies["dtoh"].bytes for s in step_values)


def test_an_aborted_request_ends_in_error_and_its_share_still_counts(tagged):
    census, clock = Census(), Clock()
    eng, spans, _ = make(census, clock)
    a, b = request("a-00000001", clock.t / 1e9), request("b-00000002", clock.t / 1e9)
    eng.request_added(SCHED, a); eng.request_added(SCHED, b)
    sid = eng.begin_execute(SimpleNamespace(num_scheduled_tokens={"a-00000001": 3, "b-00000002": 1}))
    eng.end_step(sid)
    census.steps[sid] = Step(id=sid, kernel_count=8, kernel_ns=800)
    b.status = SimpleNamespace(name="FINISHED_ABORTED")           # the client hung up
    eng.request_freed(b)
    eng.request_freed(a)
    census.complete = clock.t + 10**9
    assert eng.settle() == 2
    got = {s.attributes["vllm.request.id"]: s for s in spans.get_finished_spans()}
    assert got["b-00000002"].status.status_code.name == "ERROR"
    assert got["b-00000002"].attributes["error.type"] == "aborted"
    assert got["a-00000001"].attributes["gpu_census.kernel.count"] == 6
    assert got["b-00000002"].attributes["gpu_census.kernel.count"] == 2


def test_without_steps_in_this_process_spans_carry_no_gpu_cost(monkeypatch):
    """Tensor parallel: the workers are elsewhere, or the census is off: the span says nothing of GPU."""
    monkeypatch.setattr(injector, "step_begin", lambda sid: False)
    census, clock = Census(), Clock()
    eng, spans, _ = make(census, clock)
    r = request("x-00000001", clock.t / 1e9)
    eng.request_added(SCHED, r)
    eng.request_freed(r)
    clock.t += 6 * 10**9                                       # past the ledger's wait
    eng.settle()
    (sp,) = spans.get_finished_spans()
    assert not any(k.startswith("gpu_census.kernel") for k in sp.attributes)


def test_shutdown_finishes_the_census_and_settles_everyone(tagged, monkeypatch):
    finished = []
    monkeypatch.setattr(injector, "finish", lambda: finished.append(1) or True)
    census, clock = Census(), Clock()
    eng, spans, _ = make(census, clock)
    r = request("y-00000001", clock.t / 1e9)
    eng.request_added(SCHED, r)
    sid = eng.begin_execute(SimpleNamespace(num_scheduled_tokens={"y-00000001": 4}))
    eng.end_step(sid)
    census.steps[sid] = Step(id=sid, kernel_count=5, kernel_ns=50)
    eng.request_freed(r)
    eng.shutdown()                                             # census not complete: final settles anyway
    eng.shutdown()
    assert finished == [1]
    (sp,) = spans.get_finished_spans()
    assert sp.attributes["gpu_census.kernel.count"] == 5


def test_shutdown_flushes_the_census_first_before_joining_the_settler_and_settling(tagged, monkeypatch):
    # vLLM SIGKILLs its engine 3 s after SIGTERM: under CPU load joining the settler and settling could
    # take that long, and the segment ended without the census's final flush. The flush comes first.
    census, clock = Census(), Clock()
    eng, spans, _ = make(census, clock)
    order = []
    monkeypatch.setattr(injector, "finish", lambda: order.append("finish") or True)
    settle = eng.settle
    monkeypatch.setattr(eng, "settle", lambda final=False: order.append(("settle", final)) or settle(final))
    r = request("z-00000001", clock.t / 1e9)
    eng.request_added(SCHED, r)
    sid = eng.begin_execute(SimpleNamespace(num_scheduled_tokens={"z-00000001": 4}))
    eng.end_step(sid)                                          # the settler thread runs from here
    assert eng._thread is not None and eng._thread.is_alive()
    thread = eng._thread
    joined = []
    join = thread.join
    monkeypatch.setattr(thread, "join", lambda *a: joined.append(order[:]) or join(*a))
    census.steps[sid] = Step(id=sid, kernel_count=3, kernel_ns=30)
    eng.request_freed(r)
    eng.shutdown()
    assert order[0] == "finish" and joined == [["finish"]]
    assert ("settle", True) in order and order.index(("settle", True)) > 0
    (sp,) = spans.get_finished_spans()
    assert sp.attributes["gpu_census.kernel.count"] == 3


def test_register_never_raises_and_is_idle_outside_the_census(monkeypatch, caplog):
    from otel_gpu_census.integrations.vllm import instrumentor as vi
    calls = []
    monkeypatch.setattr(vi.VllmInstrumentor, "instrument", lambda self, **kw: calls.append(1))
    monkeypatch.delenv("CUDA_INJECTION64_PATH", raising=False)
    with caplog.at_level("INFO", logger="otel_gpu_census.vllm"):
        vi.register()
    assert "idle" in caplog.text and calls == []
    monkeypatch.setenv("CUDA_INJECTION64_PATH", "/opt/x/libotel_gpu_census.so")
    monkeypatch.setenv("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", "flask, vllm")
    vi.register()
    assert calls == []
    monkeypatch.setenv("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", "flask")
    vi.register()
    assert calls == [1]
    monkeypatch.setattr(vi.VllmInstrumentor, "instrument", lambda self, **kw: 1 / 0)
    vi.register()                                               # logs, never raises into vLLM
    assert "could not start" in caplog.text


def test_a_failing_hook_turns_the_integration_off_and_vllm_runs_on(monkeypatch, caplog):
    from otel_gpu_census.integrations.vllm import instrumentor as vi
    monkeypatch.setattr(vi.GUARD, "off", False)

    class Boom:
        def begin_execute(self, so):
            raise RuntimeError("our bug")
    monkeypatch.setattr(vi.GUARD, "current", Boom())
    calls = []
    out = vi._execute_model(lambda so: calls.append(so) or "model output", None, ("so",), {})
    assert out == "model output" and calls == ["so"] and vi.GUARD.off
    assert caplog.text.count("vLLM integration is off") == 1
    out = vi._execute_model(lambda so: "again", None, ("so",), {})   # off: straight through, no new line
    assert out == "again" and caplog.text.count("vLLM integration is off") == 1

    def fails(so):
        raise ValueError("vllm's")
    monkeypatch.setattr(vi.GUARD, "off", False)
    monkeypatch.setattr(vi.GUARD, "current", None)
    monkeypatch.setattr(injector, "step_begin", lambda sid: False)
    with pytest.raises(ValueError, match="vllm's"):            # vLLM's own exception goes through untouched
        vi._execute_model(fails, None, ("so",), {})
    assert not vi.GUARD.off


def test_a_vllm_outside_the_supported_versions_gets_one_line_and_no_hooks(monkeypatch, caplog):
    """BaseInstrumentor's dependency check against _instruments: here vLLM is absent (or of another
    version): instrument() installs nothing and says why once."""
    import importlib.metadata as md
    from otel_gpu_census.integrations.vllm import instrumentor as vi
    try:
        md.version("vllm")
        pytest.skip("vLLM is installed here: tests/integration/test_vllm_hooks.py covers it")
    except md.PackageNotFoundError:
        pass
    hooked = []
    monkeypatch.setattr(vi.wrapt, "when_imported", lambda name: hooked.append(name) or (lambda f: f))
    inst = vi.VllmInstrumentor()
    with caplog.at_level("DEBUG"):
        inst.instrument()
    assert hooked == [] and not inst.is_instrumented_by_opentelemetry
    from otel_gpu_census.integrations.vllm.package import _instruments
    assert caplog.text.count(f"only instruments \"{_instruments[0]}\"") == 1


def test_kv_submits_outside_a_connector_call_pass_through_and_a_failure_never_reaches_vllm(tagged, monkeypatch, caplog):
    """The OffloadingWorker's submit_* wrappers (kv_offload.wrap_submits): outside the connector's
    calls nothing is tagged; our failure inside one switches the integration off, and vLLM's own
    call still runs and returns its result (the real classes: tests/integration/test_vllm_kv_offload.py)."""
    from otel_gpu_census.integrations.vllm import instrumentor as vi, kv_offload

    class Worker:                                   # stands in for vLLM's CPUOffloadingWorker
        def __init__(self):
            self.calls = []

        def submit_store(self, job_id, src_spec, dst_spec):
            self.calls.append(job_id)
            return True

        def submit_load(self, job_id, src_spec, dst_spec):
            self.calls.append(-job_id)
            return True
    census, clock = Census(), Clock()
    eng, spans, _ = make(census, clock)
    monkeypatch.setattr(vi.GUARD, "current", eng)
    monkeypatch.setattr(vi.GUARD, "off", False)
    eng.request_added(SCHED, request("a-00000001", clock.t / 1e9))
    cw = SimpleNamespace(worker=Worker())
    meta = SimpleNamespace(load_jobs={5: SimpleNamespace(req_id="a-00000001")}, store_jobs={})
    spec = SimpleNamespace(block_ids=[1, 2, 3])
    try:
        sid = eng.begin_execute(SimpleNamespace(num_scheduled_tokens={"a-00000001": 4}))
        start = kv_offload.transfers(vi._guard, vi.engine, loads=True)
        start(lambda m: cw.worker.submit_load(5, None, spec), cw, (meta,), {})
        assert tagged == [sid] and eng.kv.sub_steps == 1            # the sub-step closed, the step is open
        assert eng.ledger._book[-1].tokens == {"a-00000001": 3} and eng.ledger._book[-1].kind == kv_offload.LOAD
        assert cw.worker.submit_store(6, spec, None) is True        # outside a connector call: no sub-step
        assert eng.kv.sub_steps == 1
        monkeypatch.setattr(eng.kv, "submit", lambda *a: 1 / 0)
        out = start(lambda m: cw.worker.submit_store(7, spec, None) and "vllm's", cw, (meta,), {})
        assert out == "vllm's" and cw.worker.calls == [-5, 6, 7] and vi.GUARD.off
        assert caplog.text.count("vLLM integration is off") == 1
        assert eng.kv._thread is None and eng.kv._open is None and tagged == [sid]   # the call closed anyway
        vi._execute_model(lambda so: None, None, ("so",), {})      # off: passes through, pushes nothing
        assert tagged == [sid]
        eng.end_step(sid)
    finally:
        kv_offload.unwrap_submits()
    assert tagged == []
    assert "submit_store" in vars(Worker) and not isinstance(vars(Worker)["submit_store"], vi.wrapt.FunctionWrapper)


def test_a_kv_job_whose_blocks_cannot_be_read_makes_its_sub_steps_shares_partial(tagged, monkeypatch):
    """A GPU side of a type the hook does not know (a later vLLM's): the job weighs 1 block, so the
    transfer's bytes are whole but their split is a guess, and both requests that shared it say so."""
    from otel_gpu_census.integrations.vllm import instrumentor as vi, kv_offload

    class Worker:
        def submit_load(self, job_id, src_spec, dst_spec):
            return True
        submit_store = submit_load
    census, clock = Census(), Clock()
    eng, spans, _ = make(census, clock)
    monkeypatch.setattr(vi.GUARD, "current", eng)
    monkeypatch.setattr(vi.GUARD, "off", False)
    a, b = request("a-00000001", clock.t / 1e9), request("b-00000002", clock.t / 1e9)
    eng.request_added(SCHED, a); eng.request_added(SCHED, b)
    cw = SimpleNamespace(worker=Worker())
    meta = SimpleNamespace(load_jobs={1: SimpleNamespace(req_id=a.request_id), 2: SimpleNamespace(req_id=b.request_id)},
                           store_jobs={})
    try:
        sid = eng.begin_execute(SimpleNamespace(num_scheduled_tokens={a.request_id: 4, b.request_id: 4}))
        start = kv_offload.transfers(vi._guard, vi.engine, loads=True)

        def vllm_start(m):
            cw.worker.submit_load(1, None, SimpleNamespace(block_ids=[1, 2, 3]))
            cw.worker.submit_load(2, None, SimpleNamespace(pages="opaque"))       # no block count to read
        start(vllm_start, cw, (meta,), {})
        sub = eng.ledger._book[-1].sid
        eng.end_step(sid)
    finally:
        kv_offload.unwrap_submits()
    census.steps[sid] = Step(id=sid, kernel_count=8, kernel_ns=800)
    census.steps[sub] = Step(id=sub, kernel_count=0, kernel_ns=0, copies={"htod": Stat(2, 4000, 100)})
    eng.request_freed(a); eng.request_freed(b)
    census.complete = clock.t + 10**9
    assert eng.settle() == 2
    got = {s.attributes["vllm.request.id"]: s.attributes for s in spans.get_finished_spans()}
    assert [got[r]["gpu_census.kv_offload.copy.htod.bytes"] for r in (a.request_id, b.request_id)] == [3000, 1000]
    for r in (a.request_id, b.request_id):
        assert got[r]["gpu_census.attribution.status"] == "partial"
        assert kv_offload.UNSIZED in got[r]["gpu_census.attribution.note"]


def test_a_step_begun_before_the_integration_went_off_is_still_ended(tagged, monkeypatch):
    """The hook that turned the integration off ran inside execute_model: the step it pushed on this
    thread is popped anyway, or every later launch of the thread would be tagged with it."""
    from otel_gpu_census.integrations.vllm import instrumentor as vi
    census, clock = Census(), Clock()
    eng, _, _ = make(census, clock)
    monkeypatch.setattr(vi.GUARD, "current", eng)
    monkeypatch.setattr(vi.GUARD, "off", False)

    def body(so):
        vi._guard("something inside the step", lambda: 1 / 0)   # e.g. a KV hook failing mid-step
        assert vi.GUARD.off and tagged == [1]
        return "out"
    assert vi._execute_model(body, None, (SimpleNamespace(num_scheduled_tokens={}),), {}) == "out"
    assert tagged == []


def test_the_engines_shutdown_work_finishes_before_a_sigterm_ends_it(monkeypatch):
    """vLLM resets SIGTERM to its default action before EngineCore.shutdown, and its API server
    SIGTERMs the engine as soon as the census has flushed: the signal waits for our shutdown work
    (request log, spans), then takes effect as it would have."""
    import os
    import signal
    from otel_gpu_census.integrations.vllm import instrumentor as vi
    got = []
    monkeypatch.setattr(vi.GUARD, "off", False)
    prev_term = signal.signal(signal.SIGTERM, lambda s, f: got.append(("SIGTERM delivered", s)))
    prev_int = signal.getsignal(signal.SIGINT)
    try:
        def shutdown():
            got.append("flushed")
            os.kill(os.getpid(), signal.SIGTERM)       # the API server's terminate, mid-way
            got.append("request log written")
        monkeypatch.setattr(vi.GUARD, "current", SimpleNamespace(shutdown=shutdown))
        assert vi._shutdown(lambda: got.append("vllm teardown") or "done", None, (), {}) == "done"
        assert got == ["flushed", "request log written", ("SIGTERM delivered", signal.SIGTERM), "vllm teardown"]
        assert signal.getsignal(signal.SIGINT) is prev_int            # both handlers back as they were
        got.clear()
        def failing():
            raise RuntimeError("boom")
        monkeypatch.setattr(vi.GUARD, "current", SimpleNamespace(shutdown=failing))
        assert vi._shutdown(lambda: "done", None, (), {}) == "done"    # never raises into vLLM
        assert vi.GUARD.off and got == []
    finally:
        signal.signal(signal.SIGTERM, prev_term)


def test_stop_signals_are_left_alone_off_the_main_thread():
    import signal
    import threading
    from otel_gpu_census.integrations.engine import final_flush
    seen = []

    def other():
        with final_flush.stop_signals_deferred():
            seen.append(signal.getsignal(signal.SIGTERM))
    before = signal.getsignal(signal.SIGTERM)
    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen == [before]


def test_when_its_census_is_finished_the_settler_writes_the_summary_and_sends_the_spans(tmp_path, monkeypatch):
    """census=finish from the process about to stop this one: the engine's main thread may never reach
    its shutdown, so the settler thread settles everyone, writes the summary line (what the manager
    waits for) and flushes the spans; a later shutdown() does not write a second summary."""
    import json
    import time as _time
    monkeypatch.setattr(injector, "step_begin", lambda sid: True)
    monkeypatch.setattr(injector, "step_end", lambda: None)
    monkeypatch.setattr(injector, "finish", lambda: True)
    census, clock = Census(), Clock()
    rt, spans, _ = in_memory_telemetry("vllm")
    eng = EngineTelemetry(telemetry=rt, read=census.read, clock=clock, settle_period_s=0.02)
    seg = tmp_path / "gpu-census-7-7.seg"
    eng.log_segment = lambda: str(seg)
    finished = []
    eng.census_finished = lambda: bool(finished)
    req = request("cmpl-a-0-00000001", clock.t / 1e9, ("ab" * 16, "cd" * 8))
    eng.request_added(SCHED, req)
    sid = eng.begin_execute(SimpleNamespace(num_scheduled_tokens={req.request_id: 16}))
    clock.t += 5_000_000
    census.steps[sid] = Step(id=sid, kernel_count=7, kernel_ns=700, copies={})
    eng.end_step(sid)                                  # starts the settler
    req.num_output_tokens = 1
    eng.request_freed(req)
    census.complete = clock.t + 10**9
    log = seg.with_suffix(".requests.jsonl")
    finished.append(True)
    t = _time.monotonic()
    while _time.monotonic() - t < 5 and not (log.exists() and '"summary"' in log.read_text()):
        _time.sleep(0.02)
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [l.get("id") for l in lines if "gpu" in l] == ["cmpl-a-0"] and "summary" in lines[-1]
    assert lines[-1]["summary"]["total"]["kernel.count"] == 7
    assert [s.attributes["gpu_census.kernel.count"] for s in spans.get_finished_spans()] == [7]
    eng.shutdown(timeout_s=0.3)
    assert sum(1 for x in log.read_text().splitlines() if '"summary"' in x) == 1
