"""The SGLang hooks against the real SGLang classes (skipped where SGLang does not import: `make
test-sglang` installs SGLang 0.5.23 on a CPU-only machine). An SGLang release that renames a hooked
method, changes its parameters, or the batch, request and time-stats fields the hooks read fails here.

The hooks are loaded the way SGLang loads them: its own plugin loader (``load_plugins``, our
``sglang.srt.plugins`` entry point, ``SGLANG_PLUGINS``) and its ``HookRegistry``, in this test process.
"""
from __future__ import annotations

import importlib.metadata as md
import inspect
import pickle
import pkgutil
import sys
import time
import warnings
from array import array
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
import sglang_cpu  # noqa: E402

sglang_cpu.prepare()
warnings.filterwarnings("ignore", message="Only CUDA")
sglang = pytest.importorskip("sglang", reason="SGLang is not installed here (make test-sglang installs it)")

from sglang.srt.managers.io_struct import GenerateReqInput, unwrap_from_pickle, wrap_as_pickle  # noqa: E402
from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, Req, ScheduleBatch  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.observability.req_time_stats import (  # noqa: E402
    APIServerReqTimeStats,
    DPControllerReqTimeStats,
    SchedulerReqTimeStats,
)
from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from starlette.requests import Request as HttpRequest  # noqa: E402

from otel_gpu_census.attribution.shares import Share  # noqa: E402
from otel_gpu_census.census import Stat, Step  # noqa: E402
from otel_gpu_census.integrations.sglang import instrumentor as si  # noqa: E402
from otel_gpu_census.telemetry import tenant as tenant_mod  # noqa: E402
from otel_gpu_census.integrations.sglang.engine import CARRY_KEY, SchedulerTelemetry  # noqa: E402
from engine_standins import Census, in_memory_telemetry  # noqa: E402  (tests/support)

# the parameters each hook reads, by position or name (after unwrapping SGLang's own decorators)
PARAMS = {
    "TokenizerManager._init_req_state": ["self", "obj", "request"],
    "ReqTimeStatsBase.__getstate__": ["self"],
    "ReqTimeStatsBase.new_from_obj": ["cls", "obj"],
    "Scheduler.run_batch": ["self", "batch"],
    "ScheduleBatch.retract_decode": ["self"],
    "Scheduler.get_next_batch_to_run": ["self", "running_batch", "last_batch"],
    "SchedulerDisaggregationDecodeMixin.get_next_disagg_decode_batch_to_run": ["self", "running_batch"],
    "SchedulerDisaggregationPrefillMixin.get_next_disagg_prefill_batch_to_run": ["self", "running_batch", "last_batch"],
    "Scheduler.send_abort_output": ["self", "abort_req", "req"],
    "Scheduler.launch_batch_sample_if_needed": ["self", "batch_result", "cur_batch"],
    "Scheduler._add_request_to_queue": ["self", "req", "is_retracted"],
    "Scheduler.run_event_loop": ["self"],
    "SchedulerOutputStreamer.stream_output": ["self", "reqs", "return_logprob", "skip_req"],
    "common.kill_process_tree": ["parent_pid", "include_parent", "skip_pid", "wait_timeout"],
}
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _raw(target: str):
    """(owner, attribute, the original function): the owner is a class, or a module for a function."""
    owner, attr = target.rsplit(".", 1)
    cls = pkgutil.resolve_name(owner)
    raw = cls.__dict__[attr]
    fn = raw.__func__ if isinstance(raw, classmethod) else raw
    return cls, attr, inspect.unwrap(fn)


@pytest.fixture(scope="module")
def loaded(monkeypatch_module):
    """Our plugin loaded by SGLang's own loader, as in every SGLang process started under the census."""
    import sglang.srt.plugins as plugins
    monkeypatch_module.setenv("CUDA_INJECTION64_PATH", "/nonexistent/libotel_gpu_census.so")
    monkeypatch_module.setenv("SGLANG_PLUGINS", "otel_gpu_census")
    monkeypatch_module.setattr(plugins, "_plugins_loaded", False)
    plugins.load_plugins()
    yield
    si.GUARD.off = True            # the registry cannot take hooks back: ours pass straight through


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_the_supported_version_is_the_one_installed():
    assert md.version("sglang") == "0.5.23"
    from packaging.requirements import Requirement
    (req,) = [Requirement(r) for r in si._instruments]
    assert req.name == "sglang" and req.specifier.contains(md.version("sglang"))


def test_every_hooked_method_exists_with_the_parameters_the_hooks_read():
    assert {t.split(".", )[-2] + "." + t.split(".")[-1] for t, _, _ in si.HOOKS} == set(PARAMS)
    for target, _, _ in si.HOOKS:
        _, attr, fn = _raw(target)
        name = target.split(".")[-2] + "." + attr
        assert list(inspect.signature(fn).parameters)[:len(PARAMS[name])] == PARAMS[name], name
    assert isinstance(pkgutil.resolve_name("sglang.srt.observability.req_time_stats.ReqTimeStatsBase")
                      .__dict__["new_from_obj"], classmethod)


def test_sglangs_plugin_loader_finds_our_entry_point_and_applies_every_hook(loaded):
    eps = {ep.name: ep.value for ep in md.entry_points(group="sglang.srt.plugins")}
    assert eps.get("otel_gpu_census") == "otel_gpu_census.integrations.sglang:register"
    for target, kind, hook in si.HOOKS:
        assert target in HookRegistry._patched, target
        assert any(h is hook and t.name == kind for t, h, _ in HookRegistry._hooks[target]), target
        cls, attr, _ = _raw(target)
        current = cls.__dict__[attr]
        current = current.__func__ if isinstance(current, classmethod) else current
        assert hasattr(current, "__wrapped__"), target      # SGLang's wrapper around the original


def test_sglangs_process_tree_kill_asks_for_the_final_flush_first_under_every_name(loaded, monkeypatch, tmp_path):
    """The launcher imported kill_process_tree before any plugin loaded; the registry rebinds that name
    too, so a stop goes through our hook: the tree's censuses are asked to finish while it still lives."""
    import subprocess
    import sglang.srt.utils as utils_pkg
    import sglang.srt.utils.common as common
    from otel_gpu_census.census import control
    assert utils_pkg.kill_process_tree is common.kill_process_tree            # one wrapped function
    assert hasattr(common.kill_process_tree, "__wrapped__")
    monkeypatch.setenv("OTEL_GPU_CENSUS_DIR", str(tmp_path))
    seen = []
    child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; "
                              "subprocess.Popen(['sleep', '60']).wait()"])
    try:
        import psutil
        deadline = time.time() + 10
        while not psutil.Process(child.pid).children() and time.time() < deadline:
            time.sleep(0.05)
        grandchild = psutil.Process(child.pid).children()[0]
        monkeypatch.setattr(control, "finish", lambda d, pids, t, exclude=(): seen.append(
            (list(pids), sorted(exclude), child.poll() is None and grandchild.is_running())) or (1, 1))
        utils_pkg.kill_process_tree(child.pid, wait_timeout=10)
        assert seen == [([child.pid], [], True)]      # asked while the tree was alive, then killed
        assert child.wait(5) == -9
        try:                                          # killed (a zombie until some init reaps it)
            assert grandchild.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            pass
    finally:
        if child.poll() is None:
            child.kill()


def _http_request(path="/v1/chat/completions", traceparent=TRACEPARENT):
    headers = [(b"content-type", b"application/json")]
    if traceparent:
        headers.append((b"traceparent", traceparent.encode()))
    return HttpRequest({"type": "http", "method": "POST", "path": path, "headers": headers, "query_string": b""})


def _through_the_http_side(rid, request, dp=False):
    """The request state the TokenizerManager makes (its real _init_req_state with our hook, on a
    stand-in manager), pickled as SGLang sends it to the scheduler (via the DP controller with dp)."""
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    obj = GenerateReqInput(text="hello", rid=rid)
    obj.normalize_batch_and_arguments()
    tm = object.__new__(TokenizerManager)
    tm.rid_to_state, tm.enable_trace, tm.disaggregation_mode = {}, False, None
    from sglang.srt.disaggregation.utils import DisaggregationMode
    tm.disaggregation_mode = DisaggregationMode.NULL
    TokenizerManager._init_req_state(tm, obj, request)             # the hooked method, as SGLang calls it
    ts = tm.rid_to_state[rid].time_stats
    assert isinstance(ts, APIServerReqTimeStats)
    sent = unwrap_from_pickle(pickle.loads(pickle.dumps(wrap_as_pickle(ts))))
    if dp:
        dpc = DPControllerReqTimeStats.new_from_obj(sent)
        sent = unwrap_from_pickle(pickle.loads(pickle.dumps(wrap_as_pickle(dpc))))
    return sent


def _req(rid, time_stats, prompt=12):
    return Req(rid, "hello", array("q", range(prompt)), SamplingParams(max_new_tokens=8), time_stats=time_stats)


def _engine(census):
    rt, spans, _ = in_memory_telemetry("sglang", metrics=False)
    return SchedulerTelemetry(telemetry=rt, read=census.read, settle_period_s=3600, reports=True), spans


SCHED = SimpleNamespace(server_args=SimpleNamespace(served_model_name="qwen", model_path="/m/qwen"))


@pytest.mark.parametrize("dp", [False, True])
def test_the_callers_traceparent_reaches_the_schedulers_req_with_sglang_tracing_off(loaded, dp):
    sent = _through_the_http_side("rid-1", _http_request(), dp=dp)
    req = _req("rid-1", sent)                                       # Req.__init__: SchedulerReqTimeStats.new_from_obj
    assert isinstance(req.time_stats, SchedulerReqTimeStats)
    carried = req.time_stats.__dict__[CARRY_KEY]
    assert carried["traceparent"] == TRACEPARENT and carried["operation"] == "chat" and carried["start_ns"] > 0
    # and nothing of ours goes back to the tokenizer with the scheduler's own stats
    assert CARRY_KEY not in (req.time_stats.__getstate__() or {})


def test_a_request_without_a_traceparent_carries_only_its_operation(loaded):
    sent = _through_the_http_side("rid-2", _http_request("/v1/completions", traceparent=None))
    carried = _req("rid-2", sent).time_stats.__dict__[CARRY_KEY]
    assert "traceparent" not in carried and carried["operation"] == "text_completion"


def test_real_batches_and_requests_give_spans_in_the_callers_trace_with_exact_shares(loaded, tagged):
    census = Census(complete=1 << 62)
    eng, spans = _engine(census)
    a = _req("a", _through_the_http_side("a", _http_request()), prompt=30)
    b = _req("b", _through_the_http_side("b", _http_request("/generate", traceparent=None)), prompt=10)
    si.GUARD.current = eng
    try:
        for r in (a, b):
            si._add_request_to_queue(lambda self, req, is_retracted=False: None, SCHED, r)  # our hook, SGLang's args
        prefill = ScheduleBatch(reqs=[a, b], forward_mode=ForwardMode.EXTEND, extend_lens=[30, 10])
        ran = []
        out = si._run_batch(lambda self, batch: ran.append(list(tagged)) or "result", SCHED, prefill)
        assert out == "result" and ran == [[1]] and tagged == []
        result = SimpleNamespace(delay_sample_func=lambda: None)
        si._launch_batch_sample(lambda self, r, bb: ran.append(list(tagged)), SCHED, result, prefill)
        assert ran[-1] == [1]
        census.steps[1] = Step(id=1, kernel_count=41, kernel_ns=4001, copies={"htod": Stat(3, 161, 30)}, memset=Stat(1, 7, 1))
        for r in (a, b):
            r.output_ids.append(5)
        si._stream_output(lambda self, reqs, lp, skip_req=None: None, None, [a, b], False)
        decode = ScheduleBatch(reqs=[a, b], forward_mode=ForwardMode.DECODE)
        si._run_batch(lambda self, batch: None, SCHED, decode)
        census.steps[2] = Step(id=2, kernel_count=9, kernel_ns=901, copies={"dtoh": Stat(1, 9, 3)})
        a.output_ids.append(6)
        a.finished_reason = FINISH_LENGTH(length=2)
        b.finished_reason = FINISH_ABORT("client went away")
        si._stream_output(lambda self, reqs, lp, skip_req=None: None, None, [a, b], False)
    finally:
        si.GUARD.current = None
    assert eng.settle() == 2
    got = {s.attributes["sglang.request.id"]: s for s in spans.get_finished_spans()}
    assert format(got["a"].context.trace_id, "032x") == TRACEPARENT.split("-")[1]
    assert format(got["a"].parent.span_id, "016x") == TRACEPARENT.split("-")[2]
    assert got["b"].parent is None                                   # no traceparent: a root span
    assert got["a"].name == "chat qwen" and got["b"].name == "text_completion qwen"
    assert got["a"].attributes["gen_ai.usage.input_tokens"] == 30 and got["a"].attributes["gen_ai.usage.output_tokens"] == 2
    assert got["a"].attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert got["b"].attributes["error.type"] == "aborted"
    # step 1 split 30:10 (30.75 : 10.25), step 2 one each (4.5 : 4.5), each request's rounding carried to the next
    # step: a 31 then 4, b 10 then 5, each total within a unit of its exact 35.25 and 14.75; shares + unclaimed ==
    # the census of both steps, every field
    assert got["a"].attributes["gpu_census.kernel.count"] == 31 + 4 and got["b"].attributes["gpu_census.kernel.count"] == 10 + 5
    una = Share.from_row(eng.ledger.unattributed)
    for attr, total, unclaimed in (("gpu_census.kernel.count", 50, una.kernel_count),
                                   ("gpu_census.kernel.time", 4902, una.kernel_ns),
                                   ("gpu_census.copy.htod.bytes", 161, una.copy("htod").bytes),
                                   ("gpu_census.copy.dtoh.bytes", 9, una.copy("dtoh").bytes)):
        scale = 1e9 if attr.endswith(".time") else 1         # span times are seconds: back to integer ns
        assert sum(round(s.attributes.get(attr, 0) * scale) for s in got.values()) + unclaimed == total, attr
    rows = [Share(s.kernel_count, s.kernel_ns, dict(s.copies), s.memset).as_row() for s in census.steps.values()]
    assert eng.ledger.total == [sum(c) for c in zip(*rows)]


# -- every way a request ends: one span, one log line ---------------------------------------------------

class Sent:
    """SGLang's channel to the tokenizer: what the scheduler sent it."""

    def __init__(self):
        self.out = []

    def send_output(self, out, req):
        self.out.append((type(out).__name__, req.rid))


@pytest.fixture
def serving(monkeypatch):
    """SGLang's serving settings as a server publishes them (the weight version an abort reports)."""
    import sglang.srt.managers.scheduler as sm
    monkeypatch.setattr(sm, "get_serving", lambda: SimpleNamespace(weight_version="default"))


def _scheduler(**attrs):
    """A real Scheduler object with only the state the methods under test read."""
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.scheduler import Scheduler
    sched = object.__new__(Scheduler)
    sent = Sent()
    base = dict(rust_server=None, ipc_channels=SimpleNamespace(send_to_tokenizer=sent), waiting_queue=[],
                enable_priority_scheduling=False, abort_on_priority_when_disabled=True, max_queued_requests=None,
                disaggregation_mode=DisaggregationMode.NULL, chunked_req=None, _pending_chunked_abort_req=None,
                tree_cache=SimpleNamespace(finish=lambda *a, **k: None), server_args=SCHED.server_args,
                processed_tokens_counter=0, _prefetch_kvcache=lambda req: None)
    base.update(attrs)
    for k, v in base.items():
        setattr(sched, k, v)
    return sched, sent


def _queued(eng, sched, rid, prompt=12, **req_kw):
    from sglang.srt.managers.scheduler import Scheduler
    req = _req(rid, _through_the_http_side(rid, _http_request()), prompt=prompt)
    for k, v in req_kw.items():
        setattr(req, k, v)
    Scheduler._add_request_to_queue(sched, req)               # the hooked method, SGLang's own body
    return req


def _log_lines(eng, tmp_path):
    import json
    seg = tmp_path / "gpu-census-1-1.seg"
    eng._requests_log._segment = lambda: str(seg)
    eng.settle()
    path = tmp_path / "gpu-census-1-1.requests.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_requests_sglang_rejects_or_drops_outside_the_output_stream_each_end_in_one_span(loaded, tagged, tmp_path,
                                                                                          serving):
    """Priority rejected, the queue full, aborted while queued: SGLang's own code ends each through
    send_abort_output; each gets its one span (error.type aborted) and its one log line."""
    census = Census(complete=1 << 62)
    eng, spans = _engine(census)
    si.GUARD.current = eng
    try:
        sched, sent = _scheduler()
        _queued(eng, sched, "prio", priority=5)                # priority on a server without priorities
        sched.max_queued_requests = 1
        kept = _queued(eng, sched, "kept")
        _queued(eng, sched, "full")                            # the queue holds one: rejected
        assert [r.rid for r in sched.waiting_queue] == ["kept"]
        from sglang.srt.managers.io_struct import AbortReq
        from sglang.srt.managers.scheduler import Scheduler
        sched.mm_receiver, sched.dllm_config = None, None
        sched.beam_coordinator = SimpleNamespace(retire_group=lambda req: None)
        sched.grammar_manager = SimpleNamespace(abort_requests=lambda r: None)
        sched._collect_inflight_batches = lambda: []
        kept.release_mm_inputs_on_abort = lambda: None
        Scheduler.abort_request(sched, AbortReq(rid="kept"))  # aborted while queued
        assert sched.waiting_queue == []
    finally:
        si.GUARD.current = None
    assert [o for o in sent.out] == [("AbortReq", "prio"), ("AbortReq", "full"), ("AbortReq", "kept")]
    lines = _log_lines(eng, tmp_path)
    got = {s.attributes["sglang.request.id"]: s for s in spans.get_finished_spans()}
    assert sorted(got) == sorted(x["id"] for x in lines) == ["full", "kept", "prio"]
    assert all(s.attributes["error.type"] == "aborted" and s.attributes["gen_ai.response.finish_reasons"] == ("abort",)
               for s in got.values())
    assert not eng._open and not eng._tracked                 # nothing left tracked


def test_a_request_aborted_in_its_chunked_prefill_gets_its_chunks_and_the_steps_conserve(loaded, tagged, tmp_path,
                                                                                        monkeypatch, serving):
    """Aborted between chunks of its prefill (SGLang: process_pending_chunked_abort, which ends it through
    send_abort_output): its span holds the chunks it ran, and nothing is left in no one's share."""
    import sglang.srt.managers.scheduler as sm
    monkeypatch.setattr(sm, "release_kv_cache", lambda *a, **k: None)
    census = Census(complete=1 << 62)
    eng, spans = _engine(census)
    si.GUARD.current = eng
    try:
        sched, sent = _scheduler()
        long = _queued(eng, sched, "long", prompt=64)
        short = _queued(eng, sched, "short", prompt=8)
        long.release_mm_inputs_on_abort = lambda: None
        chunk = ScheduleBatch(reqs=[long, short], forward_mode=ForwardMode.EXTEND, extend_lens=[16, 8],
                              prefix_lens=[0, 0])
        si._run_batch(lambda self, batch: None, sched, chunk)
        census.steps[1] = Step(id=1, kernel_count=24, kernel_ns=2400)
        short.output_ids.append(3)
        si._stream_output(lambda self, reqs, lp, skip_req=None: None, None, [short], False)
        second = ScheduleBatch(reqs=[long, short], forward_mode=ForwardMode.EXTEND, extend_lens=[16, 1],
                               prefix_lens=[16, 8])
        si._run_batch(lambda self, batch: None, sched, second)
        census.steps[2] = Step(id=2, kernel_count=17, kernel_ns=1700)
        sched.chunked_req = sched._pending_chunked_abort_req = long
        sm.Scheduler.process_pending_chunked_abort(sched)    # SGLang's own abort of the chunked request
        short.finished_reason = FINISH_LENGTH(length=1)
        si._stream_output(lambda self, reqs, lp, skip_req=None: None, None, [short], False)
    finally:
        si.GUARD.current = None
    assert sent.out == [("AbortReq", "long")]
    lines = _log_lines(eng, tmp_path)
    got = {s.attributes["sglang.request.id"]: s for s in spans.get_finished_spans()}
    assert len(lines) == 2 and got["long"].attributes["error.type"] == "aborted"
    assert got["long"].attributes["gpu_census.kernel.count"] == 16 + 16 and got["long"].attributes[
        "gpu_census.attribution.steps"] == 2
    una = Share.from_row(eng.ledger.unattributed)
    assert sum(s.attributes["gpu_census.kernel.count"] for s in got.values()) + una.kernel_count == 24 + 17
    assert eng.ledger._acc == {} and not eng._open


def test_a_batchs_preparation_is_its_steps_and_an_empty_one_takes_no_id(loaded, tagged):
    """get_next_batch_to_run copies the batch's inputs to the GPU (prepare_for_extend/decode) before
    run_batch: the same step id is tagged around both; a call that returns no batch leaves the id."""
    from sglang.srt.managers.schedule_batch import NextBatchPlan
    census = Census(complete=1 << 62)
    eng, spans = _engine(census)
    si.GUARD.current = eng
    try:
        sched, _ = _scheduler()
        a = _queued(eng, sched, "a", prompt=10)
        seen = []
        empty = ScheduleBatch(reqs=[], forward_mode=ForwardMode.DECODE)
        plan = si._next_batch(lambda self, rb, lb: seen.append(list(tagged)) or NextBatchPlan(
            batch_to_run=None, running_batch=empty), sched, empty, None)
        assert plan.batch_to_run is None and seen == [[1]] and tagged == []
        batch = ScheduleBatch(reqs=[a], forward_mode=ForwardMode.EXTEND, extend_lens=[10], prefix_lens=[0])
        si._next_batch(lambda self, rb, lb: seen.append(list(tagged)) or NextBatchPlan(
            batch_to_run=batch, running_batch=empty), sched, empty, None)
        si._run_batch(lambda self, b: seen.append(list(tagged)), sched, batch)
        assert seen[1:] == [[1], [1]] and tagged == []
        other = ScheduleBatch(reqs=[a], forward_mode=ForwardMode.DECODE)
        si._run_batch(lambda self, b: seen.append(list(tagged)), sched, other)   # not prepared: a new id
        assert seen[-1] == [2]
    finally:
        si.GUARD.current = None
    assert [e.sid for e in eng.ledger._book] == [1, 2]


def test_a_req_sglang_lets_go_of_unseen_is_closed_by_the_sweep(loaded, tagged):
    import gc
    from otel_gpu_census.integrations.engine import steps as engine_steps
    census = Census(complete=1 << 62)
    eng, spans = _engine(census)
    si.GUARD.current = eng
    try:
        sched, _ = _scheduler()
        gone = _queued(eng, sched, "gone")
        sched.waiting_queue.clear()
        del gone
        gc.collect()
        eng._next_sweep = 0
        batch = ScheduleBatch(reqs=[], forward_mode=ForwardMode.DECODE)
        si._run_batch(lambda self, b: None, sched, batch)
    finally:
        si.GUARD.current = None
    eng.settle()
    (sp,) = spans.get_finished_spans()
    assert sp.attributes["gpu_census.attribution.status"] == "partial" and not eng._open
    assert engine_steps.SWEPT in sp.attributes["gpu_census.attribution.note"]


@pytest.mark.parametrize("method", ["flops", "alone", "model"])
def test_the_flops_split_reads_the_context_from_sglangs_batches(loaded, tagged, monkeypatch, method):
    """OTEL_GPU_CENSUS_ATTRIBUTION=flops (and alone, which weighs the same FLOPs, and model, whose attention work
    is computed from the same context): an extend batch's prefix_lens
    and a decode batch's seq_lens_cpu (the new token already counted in) are the context before each request's
    tokens."""
    import torch
    from sglang.srt.configs.model_config import ModelConfig
    from transformers import LlamaConfig
    from otel_gpu_census.attribution.cost_model import ModelShape
    monkeypatch.setenv("OTEL_GPU_CENSUS_ATTRIBUTION", method)
    census = Census(complete=1 << 62)
    eng, spans = _engine(census)
    mc = object.__new__(ModelConfig)
    mc.hf_config = LlamaConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=1000)
    si.GUARD.current = eng
    try:
        sched, _ = _scheduler(model_config=mc)
        a, b = _queued(eng, sched, "a", prompt=40), _queued(eng, sched, "b", prompt=30)
        si._run_batch(lambda self, batch: None, sched, ScheduleBatch(
            reqs=[a, b], forward_mode=ForwardMode.EXTEND, extend_lens=[24, 30], prefix_lens=[16, 0]))
        si._run_batch(lambda self, batch: None, sched, ScheduleBatch(
            reqs=[a, b], forward_mode=ForwardMode.DECODE, seq_lens_cpu=torch.tensor([41, 31])))
    finally:
        si.GUARD.current = None
    assert eng.shape == ModelShape.of(mc.hf_config) and eng.ledger.method == f"step_{method}"
    assert [e.before for e in eng.ledger._book] == [{"a": 16, "b": 0}, {"a": 40, "b": 30}]


@pytest.mark.parametrize("enabled, set_by_user, want", [
    (True, {}, "collector:4317"),                                          # SGLang's tracing on: its endpoint
    (False, {}, None),                                                     # off: SGLang sends nothing anywhere
    (True, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://mine:4318"}, None),     # the user's own OTEL_* wins
    (True, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://mine:4318/v1/traces"}, "http://mine:4318/v1/traces")])
def test_with_sglangs_tracing_on_our_spans_follow_its_endpoint_unless_the_user_named_one(monkeypatch, enabled,
                                                                                          set_by_user, want):
    import sglang.srt.runtime_context as rc
    for k in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in set_by_user.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(rc, "get_observability",
                        lambda: SimpleNamespace(enable_trace=enabled, otlp_traces_endpoint="collector:4317"))
    si._follow_traces_endpoint()
    import os
    assert os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") == want


# -- chargeback: tenants and LoRA adapters --------------------------------------------------------------

def _through_with(rid, headers, lora=None):
    """As _through_the_http_side, for a client's request with these extra headers and LoRA adapter (lora_path,
    the adapter's name as SGLang's OpenAI server resolves it from `model`)."""
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    raw = [(b"content-type", b"application/json")] + [(k.encode(), v.encode()) for k, v in headers]
    request = HttpRequest({"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": raw,
                           "query_string": b""})
    obj = GenerateReqInput(text="hello", rid=rid, lora_path=lora)
    obj.normalize_batch_and_arguments()
    tm = object.__new__(TokenizerManager)
    tm.rid_to_state, tm.enable_trace, tm.disaggregation_mode = {}, False, DisaggregationMode.NULL
    TokenizerManager._init_req_state(tm, obj, request)
    ts = tm.rid_to_state[rid].time_stats
    return unwrap_from_pickle(pickle.loads(pickle.dumps(wrap_as_pickle(ts))))


def test_the_tenant_and_the_adapter_reach_the_scheduler_and_a_client_cannot_forge_ours(loaded, monkeypatch):
    monkeypatch.setattr(tenant_mod, "_configured", None)
    carried = _req("t1", _through_with("t1", [("baggage", "gpu_census.tenant=team-a")], lora="sql-lora")) \
        .time_stats.__dict__[CARRY_KEY]
    assert carried["tenant"] == "team-a" and carried["lora"] == "sql-lora"
    forged = _req("t2", _through_with("t2", [(si.TENANT_KEY, "someone")])).time_stats.__dict__[CARRY_KEY]
    assert "tenant" not in forged and "lora" not in forged
    monkeypatch.setenv("OTEL_GPU_CENSUS_TENANT", "header:x-api-key")
    monkeypatch.setattr(tenant_mod, "_configured", None)
    hashed = _req("t3", _through_with("t3", [("x-api-key", "k-123")])).time_stats.__dict__[CARRY_KEY]["tenant"]
    assert hashed.startswith("sha256:") and "k-123" not in hashed


def test_three_tenants_and_two_adapters_add_up_to_their_requests_and_the_census(loaded, tagged, tmp_path,
                                                                              monkeypatch):
    import random
    from chargeback_sums import check_metrics_equal_spans, check_report      # tests/support
    monkeypatch.setattr(tenant_mod, "_configured", None)
    census = Census(complete=1 << 62)
    rt, spans, reader = in_memory_telemetry("sglang")
    eng = SchedulerTelemetry(telemetry=rt, read=census.read, settle_period_s=3600, reports=True)
    seg = tmp_path / "gpu-census-3-3.seg"
    eng.log_segment = lambda: str(seg)
    rnd = random.Random(59)
    tenants, adapters = ("team-a", "team-b", "team-c"), ("sql-lora", None)
    live, n = [], 0
    si.GUARD.current = eng
    try:
        for k in range(40):
            fresh = []
            if n < 18 and rnd.random() < 0.6:
                who = tenants[n % 3] if n % 5 else None
                rid = f"r{n}"
                req = _req(rid, _through_with(rid, [("baggage", f"gpu_census.tenant={who}")] if who else [],
                                              lora=adapters[n % 2]), prompt=rnd.randint(4, 30))
                si._add_request_to_queue(lambda self, r, is_retracted=False: None, SCHED, req)
                fresh.append(req)
                n += 1
            if k % 7 == 0:                                 # a batch of nobody's (an idle step's work)
                batch = ScheduleBatch(reqs=[], forward_mode=ForwardMode.DECODE)
            elif fresh:
                batch = ScheduleBatch(reqs=fresh, forward_mode=ForwardMode.EXTEND,
                                      extend_lens=[len(r.origin_input_ids) for r in fresh])
            else:
                batch = ScheduleBatch(reqs=list(live), forward_mode=ForwardMode.DECODE)
            si._run_batch(lambda self, b: None, SCHED, batch)
            census.steps[eng.sid] = Step(id=eng.sid, kernel_count=rnd.randint(1, 300), kernel_ns=rnd.randint(1, 10**7),
                                         copies={"htod": Stat(1, rnd.randint(0, 10**6), 5),
                                                 "dtoh": Stat(1, rnd.randint(0, 10**5), 5)})
            live += fresh
            for r in live:
                r.output_ids.append(1)
            ending = [r for r in live if rnd.random() < 0.2]
            for r in ending:
                r.finished_reason = FINISH_LENGTH(length=len(r.output_ids))
            si._stream_output(lambda self, reqs, lp, skip_req=None: None, None, list(live), False)
            live = [r for r in live if r not in ending]
        for r in live:
            r.finished_reason = FINISH_LENGTH(length=len(r.output_ids))
        si._stream_output(lambda self, reqs, lp, skip_req=None: None, None, list(live), False)
    finally:
        si.GUARD.current = None
    assert not si.GUARD.off
    eng.settle()
    eng.shutdown(timeout_s=0.5)
    done = spans.get_finished_spans()
    assert len(done) == 18
    assert {s.attributes.get("gpu_census.tenant", "unknown") for s in done} == set(tenants) | {"unknown"}
    assert {s.attributes["gen_ai.request.model"] for s in done} == {"sql-lora", "qwen"}
    check_metrics_equal_spans(done, reader)
    check_metrics_equal_spans(done, reader, key="gen_ai.request.model")
    rows = [Share(s.kernel_count, s.kernel_ns, dict(s.copies), s.memset).as_row() for s in census.steps.values()]
    log = seg.with_suffix(".requests.jsonl")
    cb, _ = check_report([log], rows, "tenant", spans=done)
    assert cb.unattributed.figures["kernel.count"] > 0
    cbm, _ = check_report([log], rows, "model", spans=done)
    assert {x.name for x in cbm.rows} == {"sql-lora", "qwen"}
