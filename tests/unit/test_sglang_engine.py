"""The SGLang integration's scheduler side on CPU: batches as steps, requests, the caller's trace, exact
conservation, and the guards, with the census and SGLang's objects stood in for (the real classes are
checked in tests/integration/test_sglang_classes.py where SGLang imports: `make test-sglang`)."""
from __future__ import annotations

import pickle
import random
from types import SimpleNamespace

import pytest

from otel_gpu_census import injector
from otel_gpu_census.attribution.shares import Share
from otel_gpu_census.census import Stat, Step
from otel_gpu_census.integrations.sglang import instrumentor as si
from otel_gpu_census.integrations.sglang.engine import CARRY_KEY, SchedulerTelemetry, operation_for, step_tokens
from engine_standins import Census, Clock, in_memory_telemetry  # tests/support


def make(census, clock, reports=True):
    rt, spans, reader = in_memory_telemetry("sglang")
    eng = SchedulerTelemetry(telemetry=rt if reports else None, read=census.read, clock=clock,
                             settle_period_s=3600, reports=reports)
    return eng, spans, reader


class Mode:
    def __init__(self, extend):
        self.extend = extend

    def is_extend(self):
        return self.extend


class FakeReq:
    """The Req fields the hooks read (the real Req: tests/integration/test_sglang_classes.py)."""

    def __init__(self, rid, prompt=16, trace=None, op=None, start_ns=None):
        self.rid = rid
        self.origin_input_ids = list(range(prompt))
        self.output_ids = []
        self.finished_reason = None
        self.finished_output = None
        self.cached_tokens = 4
        carried = {}
        if trace:
            carried["traceparent"] = f"00-{trace[0]}-{trace[1]}-01"
        if op:
            carried["operation"] = op
        if start_ns:
            carried["start_ns"] = start_ns
        self.time_stats = SimpleNamespace(**({CARRY_KEY: carried} if carried else {}))

    def finished(self):
        return self.finished_reason is not None


class Length:
    def to_json(self):
        return {"type": "length", "length": 9}


class FINISH_ABORT:                        # the name SGLang gives an aborted request's reason
    def to_json(self):
        return {"type": "abort"}


SCHED = SimpleNamespace(server_args=SimpleNamespace(served_model_name="m1", model_path="/models/m1"))


def batch(reqs, extend_lens=None):
    return SimpleNamespace(reqs=list(reqs), forward_mode=Mode(extend_lens is not None), extend_lens=extend_lens)


def test_step_tokens_are_extend_lens_on_extend_batches_and_one_each_in_decode():
    a, b = FakeReq("a"), FakeReq("b")
    assert step_tokens(batch([a, b], [30, 7])) == {"a": 30, "b": 7}
    assert step_tokens(batch([a, b])) == {"a": 1, "b": 1}
    assert step_tokens(batch([])) == {}
    mixed = batch([a, b], [12, 1])                 # mix_with_running: running requests extend by one token
    assert step_tokens(mixed) == {"a": 12, "b": 1}
    assert operation_for("/v1/chat/completions") == "chat"
    assert operation_for("/v1/completions") == operation_for("/generate") == "text_completion"


def test_batches_of_requests_get_spans_in_their_callers_traces_with_exact_shares(tagged):
    rnd = random.Random(7)
    census, clock = Census(), Clock()
    eng, spans, _ = make(census, clock)
    traces, live, done, step_values = {}, {}, [], []
    for it in range(1, 150):
        if len(traces) < 14 and rnd.random() < 0.4:
            rid = f"{rnd.getrandbits(128):032x}"
            traces[rid] = (f"{rnd.getrandbits(128):032x}", f"{rnd.getrandbits(64):016x}")
            req = FakeReq(rid, prompt=rnd.randint(5, 60), trace=traces[rid],
                          op="chat" if len(traces) % 2 else None, start_ns=clock.t - 1_000_000)
            eng.request_queued(SCHED, req)
            live[rid] = req
        reqs = list(live.values())
        prefill = [r for r in reqs if not r.output_ids]
        b = batch(prefill, [len(r.origin_input_ids) for r in prefill]) if prefill else batch(reqs)
        sid = eng.batch_begin(b)
        assert tagged == [sid]
        eng.end_step(sid)
        s2 = eng.sample_begin(b)                      # overlap: the batch's delayed sampling, same step
        assert s2 == sid and tagged == [sid]
        eng.end_step(s2)
        assert eng.sample_begin(batch(reqs)) == 0     # another batch's sampling: not this step
        clock.t += 10_000_000
        census.steps[sid] = Step(id=sid, kernel_count=rnd.randint(40, 90), kernel_ns=rnd.randint(10**6, 8 * 10**6),
                                 copies={"htod": Stat(2, 8 * len(b.reqs) + rnd.randint(0, 5), 300),
                                         "dtoh": Stat(1, 4 * len(b.reqs) + rnd.randint(0, 3), 900)},
                                 memset=Stat(1, 64, 10))
        step_values.append(census.steps[sid])
        for r in b.reqs:
            r.output_ids.append(1)
        ending = []
        for r in b.reqs:
            if len(r.output_ids) >= rnd.randint(6, 25):
                r.finished_reason = Length()
                ending.append(r)
        eng.outputs(b.reqs)
        for r in ending:
            r.finished_output = True
            live.pop(r.rid)
            done.append(r.rid)
        eng.outputs(ending)                           # streamed again (overlap): no second end
        if it % 10 == 0:
            census.complete = clock.t - 400_000_000
            eng.settle()
    for r in list(live.values()):
        r.finished_reason = FINISH_ABORT()
        eng.outputs([r])
        done.append(r.rid)
    census.complete = clock.t + 10**9
    eng.settle()
    got = {s.attributes["sglang.request.id"]: s for s in spans.get_finished_spans()}
    assert set(got) == set(done) == set(traces)
    for rid, sp in got.items():
        tid, psid = traces[rid]
        assert format(sp.context.trace_id, "032x") == tid and format(sp.parent.span_id, "016x") == psid
        assert sp.attributes["gen_ai.response.id"] == rid and sp.attributes["gen_ai.provider.name"] == "sglang"
        assert "gen_ai.request.id" not in sp.attributes           # the response id is the one id it has
        assert sp.attributes["gpu_census.attribution.method"] == "step_tokens"
        assert sp.attributes["gpu_census.attribution.status"] == "complete"
        assert sp.attributes["gen_ai.response.time_to_first_chunk"] > 0
        assert sp.attributes["gen_ai.usage.cache_read.input_tokens"] == 4
        assert sp.name in ("chat m1", "text_completion m1")
        if "error.type" in sp.attributes:
            assert sp.attributes["error.type"] == "aborted" and sp.status.status_code.name == "ERROR"
        else:
            assert sp.attributes["gen_ai.response.finish_reasons"] == ("length",)
    # conservation: the requests' shares + what no request claimed == the steps' census, every field
    una = Share.from_row(eng.ledger.unattributed)
    total = Share.from_row(eng.ledger.total)
    shares = [s for s in got.values()]
    assert sum(s.attributes["gpu_census.kernel.count"] for s in shares) + una.kernel_count == \
        sum(s.kernel_count for s in step_values) == total.kernel_count
    assert sum(round(s.attributes["gpu_census.kernel.time"] * 1e9) for s in shares) + una.kernel_ns == \
        sum(s.kernel_ns for s in step_values)
    for d in ("htod", "dtoh"):
        assert sum(s.attributes[f"gpu_census.copy.{d}.bytes"] for s in shares) + una.copy(d).bytes == \
            sum(s.copies[d].bytes for s in step_values)
        assert sum(s.attributes[f"gpu_census.copy.{d}.count"] for s in shares) + una.copy(d).count == \
            sum(s.copies[d].count for s in step_values)
    assert total.as_row() == [sum(x) for x in zip(*(Share(s.kernel_count, s.kernel_ns, dict(s.copies), s.memset).as_row()
                                                     for s in step_values))]


def test_a_rank_that_does_not_report_emits_no_spans_but_splits_the_same(tagged):
    census, clock = Census(), Clock()
    eng, spans, _ = make(census, clock, reports=False)
    r = FakeReq("r1", trace=("1" * 32, "2" * 16))
    eng.request_queued(SCHED, r)
    sid = eng.batch_begin(batch([r], [16]))
    eng.end_step(sid)
    census.steps[sid] = Step(id=sid, kernel_count=5, kernel_ns=50)
    r.output_ids.append(1)
    r.finished_reason = Length()
    eng.outputs([r])
    census.complete = clock.t + 10**9
    assert eng.settle() == 1 and spans.get_finished_spans() == ()
    assert Share.from_row(eng.ledger.total).kernel_count == 5 and Share.from_row(eng.ledger.unattributed).kernel_count == 0


def test_the_trace_context_travels_in_sglangs_time_stats_and_survives_its_conversions(monkeypatch):
    """The HTTP side's hooks on a stand-in of SGLang's time stats (the real class: the integration test)."""
    monkeypatch.setattr(si.GUARD, "off", False)
    class TimeStats:
        def __init__(self):
            self.created_time = 0.0

        def __getstate__(self):
            return {"created_time": self.created_time}            # SGLang lists its keys

        def __setstate__(self, state):
            self.__dict__.update(state)

        @classmethod
        def new_from_obj(cls, obj):
            new = cls()
            for k, v in obj.__dict__.items():
                if hasattr(new, k):
                    setattr(new, k, v)
            return new

    ts = TimeStats()
    tm = SimpleNamespace(rid_to_state={"r1": SimpleNamespace(time_stats=ts)})
    obj = SimpleNamespace(rid="r1", external_trace_header=None)
    request = SimpleNamespace(headers={"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01", "x": "y"},
                              url=SimpleNamespace(path="/v1/chat/completions"))
    si._init_req_state(lambda self, obj, request=None: None, tm, obj, request)
    assert obj.external_trace_header["traceparent"].startswith("00-aaa")
    state = si._getstate(ts.__getstate__(), ts)
    back = TimeStats.__new__(TimeStats)
    back.__setstate__(pickle.loads(pickle.dumps(state)))
    sched = si._new_from_obj(TimeStats.new_from_obj(back), TimeStats, back)
    carried = sched.__dict__[CARRY_KEY]
    assert carried["traceparent"] == request.headers["traceparent"] and carried["operation"] == "chat"
    assert carried["start_ns"] > 0 and "x" not in carried


def test_a_failing_hook_turns_the_integration_off_and_sglang_runs_on(monkeypatch, caplog):
    monkeypatch.setattr(si.GUARD, "off", False)

    class Boom:
        def batch_begin(self, b):
            raise RuntimeError("our bug")
    monkeypatch.setattr(si.GUARD, "current", Boom())
    calls = []
    out = si._run_batch(lambda self, b: calls.append(b) or "result", "sched", "batch")
    assert out == "result" and calls == ["batch"] and si.GUARD.off
    assert caplog.text.count("SGLang integration is off") == 1
    out = si._run_batch(lambda self, b: "again", "sched", "batch")
    assert out == "again" and caplog.text.count("SGLang integration is off") == 1
    monkeypatch.setattr(si.GUARD, "off", False)
    monkeypatch.setattr(si.GUARD, "current", None)
    monkeypatch.setattr(injector, "step_begin", lambda sid: False)

    def fails(self, b):
        raise ValueError("sglang's")
    with pytest.raises(ValueError, match="sglang's"):          # SGLang's own exception goes through untouched
        si._run_batch(fails, "sched", "batch")
    assert not si.GUARD.off
    # the HTTP side: a request object we cannot read costs one line, never the request
    monkeypatch.setattr(si.GUARD, "off", False)
    assert si._init_req_state(lambda self, obj, request=None: "state", object(), object(), object()) == "state"
    assert si.GUARD.off and caplog.text.count("SGLang integration is off") == 2
    monkeypatch.setattr(si.GUARD, "off", False)


def test_a_step_begun_before_the_integration_went_off_is_still_ended(tagged, monkeypatch):
    """A hook that turned the integration off inside run_batch (or the delayed sampling): the step pushed
    on the scheduler thread is popped anyway, or every later launch of the thread would carry it."""
    census, clock = Census(), Clock()
    eng, _, _ = make(census, clock)
    monkeypatch.setattr(si.GUARD, "current", eng)
    monkeypatch.setattr(si.GUARD, "off", False)
    batch = SimpleNamespace(reqs=[], forward_mode=None, extend_lens=None)

    def body(self, b):
        si._guard("something inside the step", lambda: 1 / 0)
        assert si.GUARD.off and tagged == [1]
        return "out"
    assert si._run_batch(body, "sched", batch) == "out"
    assert tagged == []
    monkeypatch.setattr(si.GUARD, "off", False)

    def sample(self, result, b):
        assert tagged == [1]                                   # the same step, tagged again
        si._guard("something inside the sampling", lambda: 1 / 0)
        return "sampled"
    assert si._launch_batch_sample(sample, "sched", "result", batch) == "sampled"
    assert tagged == []
    monkeypatch.setattr(si.GUARD, "off", False)


def test_register_never_raises_and_is_idle_outside_the_census(monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(si.SglangInstrumentor, "instrument", lambda self, **kw: calls.append(1))
    monkeypatch.delenv("CUDA_INJECTION64_PATH", raising=False)
    with caplog.at_level("INFO", logger="otel_gpu_census.sglang"):
        si.register()
    assert "idle" in caplog.text and calls == []
    monkeypatch.setenv("CUDA_INJECTION64_PATH", "/opt/x/libotel_gpu_census.so")
    monkeypatch.setenv("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", "vllm, sglang")
    si.register()
    assert calls == []
    monkeypatch.setenv("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", "vllm")
    si.register()
    assert calls == [1]
    monkeypatch.setattr(si.SglangInstrumentor, "instrument", lambda self, **kw: 1 / 0)
    si.register()
    assert "could not start" in caplog.text


def test_an_sglang_outside_the_supported_versions_gets_one_line_and_no_hooks(monkeypatch, caplog):
    import importlib.metadata as md
    try:
        md.version("sglang")
        pytest.skip("SGLang is installed here: tests/integration/test_sglang_classes.py covers it")
    except md.PackageNotFoundError:
        pass
    registered = []
    monkeypatch.setattr(si, "_registry", lambda: (SimpleNamespace(register=lambda *a: registered.append(a)), None))
    inst = si.SglangInstrumentor()
    with caplog.at_level("DEBUG"):
        inst.instrument()
    assert registered == [] and not inst.is_instrumented_by_opentelemetry
    assert caplog.text.count('only instruments "sglang >= 0.5.20, < 0.5.24"') == 1
