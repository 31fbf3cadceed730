"""Client hang-ups and failed requests through vLLM 0.25.1's own Scheduler.finish_requests (what the
engine runs when the API server aborts a request whose client went away): the request's span ends in
error, and its share of the steps that served it still counts, so the shares still conserve.
Skipped where vLLM does not import (`make test-vllm`)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (make test-vllm installs it)")

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from otel_gpu_census import injector  # noqa: E402
from otel_gpu_census.census import Stat, Step  # noqa: E402
from otel_gpu_census.integrations.vllm import instrumentor as vi  # noqa: E402
from otel_gpu_census.integrations.vllm.engine import EngineTelemetry  # noqa: E402
from otel_gpu_census.telemetry.request import RequestTelemetry  # noqa: E402

import support_vllm  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402


class Queue(list):
    def remove_requests(self, reqs):
        for r in reqs:
            if r in self:
                self.remove(r)


def scheduler(reqs, running):
    """vLLM's Scheduler with only the state finish_requests and _free_request touch (no KV cache,
    no connector): its methods are vLLM's, hooked as in a server."""
    s = object.__new__(Scheduler)
    s.requests = {r.request_id: r for r in reqs}
    s.running = [r for r in reqs if r.request_id in running]
    s.waiting, s.skipped_waiting = Queue(r for r in reqs if r.request_id not in running), Queue()
    s.num_waiting_for_streaming_input = 0
    s.finished_recving_kv_req_ids, s.failed_recving_kv_req_ids = set(), set()
    s._inflight_prefills, s.finished_req_ids, s.finished_req_ids_dict = set(), set(), None
    s.connector, s.defer_block_free = None, False
    s.ec_connector = None                       # read by _free_request from vLLM 0.27 on
    # and what 0.34's finish_requests / _free_request read besides
    s.kv_holding_waiting, s.async_kv_waiting, s.deferred_waiting = Queue(), Queue(), set()
    s.deferred_loads, s._aborted_kv_loads, s._pending_encoder_input_ids = {}, set(), {}
    s.aux_output_connector, s._kv_fetch_stages = None, None
    s._parked_reserved_blocks, s._parked_reservations = 0, {}
    s.encoder_cache_manager = SimpleNamespace(free=lambda r: None)
    s.kv_cache_manager = SimpleNamespace(free=lambda r: None)
    s.vllm_config = None
    for r in reqs:
        r.status = RequestStatus.RUNNING if r.request_id in running else RequestStatus.WAITING
    return s


def test_aborted_and_failed_requests_end_in_error_and_their_shares_conserve(monkeypatch):
    monkeypatch.setattr(injector, "step_begin", lambda sid: True)
    monkeypatch.setattr(injector, "step_end", lambda: None)
    spans = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(spans))
    steps = {}
    eng = EngineTelemetry(telemetry=RequestTelemetry(tp, None, provider_name="vllm"), settle_period_s=3600,
                          read=lambda lo, hi: (SimpleNamespace(complete_wall_ns=1 << 62, alive=True,
                                                               state_name="active"), steps))
    monkeypatch.setattr(vi.GUARD, "current", eng)
    monkeypatch.setattr(vi.GUARD, "off", False)
    inst = vi.VllmInstrumentor()
    inst.instrument()
    try:
        reqs = [support_vllm.make_request(f"cmpl-{i}-0-abcd000{i}", 6) for i in range(4)]
        s = scheduler(reqs, running={r.request_id for r in reqs[:3]})
        for r in reqs:
            eng.request_added(s, r)          # what the Scheduler.add_request hook does (it needs a full scheduler)
        for n in range(3):                                           # 3 steps serve the three running ones
            so = support_vllm.make_scheduler_output({r.request_id: 6 if n == 0 else 1 for r in reqs[:3]})
            vi._execute_model(lambda so: None, None, (so,), {})
            steps[eng.sid] = Step(id=eng.sid, kernel_count=31, kernel_ns=3100 + n, copies={"dtoh": Stat(1, 1001, 9)})
        # the client of 0 hung up mid-decode; 3 never got scheduled and its client left too
        got = s.finish_requests([reqs[0].request_id, reqs[3].request_id], RequestStatus.FINISHED_ABORTED)
        # (req_id, client_index) pairs in 0.25, the Requests themselves from 0.27 on
        assert {g.request_id if hasattr(g, "request_id") else g[0] for g in got} == {reqs[0].request_id, reqs[3].request_id}
        s.finish_requests(reqs[1].request_id, RequestStatus.FINISHED_ERROR)
        s.finish_requests(reqs[2].request_id, RequestStatus.FINISHED_LENGTH_CAPPED)
        assert eng.settle() == 4
    finally:
        inst.uninstrument()
    by = {sp.attributes["vllm.request.id"]: sp for sp in spans.get_finished_spans()}
    r0, r1, r2, r3 = (by[r.request_id] for r in reqs)
    assert r0.status.status_code.name == "ERROR" and r0.attributes["error.type"] == "aborted"
    assert r0.attributes["gen_ai.response.finish_reasons"] == ("abort",)
    assert r1.attributes["error.type"] == "engine_error" and r1.status.status_code.name == "ERROR"
    assert "error.type" not in r2.attributes and r2.status.status_code.name == "UNSET"
    assert r3.attributes["error.type"] == "aborted" and r3.attributes["gpu_census.kernel.count"] == 0
    assert "gpu_census.attribution.steps" not in r3.attributes         # never served by a step
    assert all(sp.attributes["gpu_census.attribution.status"] == "complete" for sp in by.values())
    for attr, total in (("gpu_census.kernel.count", 3 * 31), ("gpu_census.kernel.time", 3 * 3100 + 3),
                        ("gpu_census.copy.dtoh.bytes", 3 * 1001)):
        # times are seconds on a span: each back to the census's integer ns, exactly
        scale = 1e9 if attr.endswith(".time") else 1
        assert sum(round(sp.attributes[attr] * scale) for sp in by.values()) == total, attr   # nothing unclaimed here
    # 31 kernels a step among three: each step's leftover unit to a different one (each carries its rounding), so
    # the three get their exact 31 each, whatever their place in the batch
    assert [by[r.request_id].attributes["gpu_census.kernel.count"] for r in reqs[:3]] == [31, 31, 31]
