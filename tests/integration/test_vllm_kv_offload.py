"""KV-offload transfers land on the requests whose blocks they move, through vLLM 0.25.1's own
OffloadingConnectorWorker (skipped where vLLM does not import: `make test-vllm`).

The connector worker, its metadata (OffloadingConnectorMetadata, TransferJob, GPULoadStoreSpec,
CPULoadStoreSpec) and the order of its calls inside execute_model are vLLM's; the OffloadingWorker
under it is a stand-in that "launches" each job's copies the way the GPU would be tagged: to the step
open on the launching thread (injector.step_begin/step_end are stood in for by a per-thread stack), so
the census below holds exactly what the injector would have tallied per step id."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (make test-vllm installs it)")

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from otel_gpu_census import injector  # noqa: E402
from otel_gpu_census.attribution.shares import Share  # noqa: E402
from otel_gpu_census.census import Stat, Step  # noqa: E402
from otel_gpu_census.integrations.vllm import instrumentor as vi  # noqa: E402
from otel_gpu_census.integrations.vllm import kv_offload  # noqa: E402
from otel_gpu_census.integrations.vllm.engine import EngineTelemetry  # noqa: E402
from otel_gpu_census.telemetry.request import RequestTelemetry  # noqa: E402

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (  # noqa: E402
    OffloadingConnectorMetadata, TransferJob)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker  # noqa: E402
from vllm.v1.kv_offload.base import GPULoadStoreSpec, OffloadingWorker, TransferResult  # noqa: E402
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402

PAGE = 4096                 # bytes per GPU block (all layers)
KERNEL_NS = 1000


class Gpu:
    """What the census would tally: per step id, from the step open on the launching thread."""

    def __init__(self):
        self.local = threading.local()
        self.steps = {}
        self.outside = Share()

    def stack(self):
        if not hasattr(self.local, "s"):
            self.local.s = []
        return self.local.s

    def launch(self, kernels=0, copy=None):
        top = self.stack()[-1] if self.stack() else None
        if top is None:
            return
        s = self.steps.get(top) or Step(id=top, kernel_count=0, kernel_ns=0, copies={})
        copies = dict(s.copies)
        if copy:
            d, nbytes = copy
            copies[d] = copies.get(d, Stat(0, 0, 0)) + Stat(1, nbytes, nbytes // 10)
        self.steps[top] = Step(id=top, kernel_count=s.kernel_count + kernels,
                               kernel_ns=s.kernel_ns + kernels * KERNEL_NS, copies=copies)

    def read(self, lo, hi):
        head = SimpleNamespace(complete_wall_ns=1 << 62, alive=True, state_name="active")
        return head, {i: s for i, s in self.steps.items() if lo <= i <= hi}


class StandinOffloadingWorker(OffloadingWorker):
    """vLLM's OffloadingWorker interface; each job's copies launched at submit, like the CPU handler's
    swap_blocks on a stream of its own."""

    def __init__(self, gpu):
        self.gpu, self.done, self.submitted = gpu, [], []

    def submit_store(self, job_id, src_spec, dst_spec):       # src_spec: device_ptrs in 0.34
        self.gpu.launch(copy=("dtoh", gpu_blocks(src_spec) * PAGE))
        self.submitted.append(("store", job_id))
        self.done.append(job_id)
        return True

    def submit_load(self, job_id, src_spec, dst_spec, expedited=False):
        self.gpu.launch(copy=("htod", gpu_blocks(dst_spec) * PAGE))
        self.submitted.append(("load", job_id))
        self.done.append(job_id)
        return True

    def get_finished(self):
        out = [TransferResult(job_id=j, success=True) for j in self.done]
        self.done = []
        return out

    def wait(self, job_ids):
        pass


def gpu_spec(blocks):
    return GPULoadStoreSpec(list(range(blocks)), group_sizes=[blocks], block_indices=[0])


def gpu_blocks(spec):
    """The GPU blocks a submit moves: a GPULoadStoreSpec (0.25-0.30) or the DevicePointers vLLM 0.34 resolves
    it to."""
    ids = getattr(spec, "block_ids", None)
    return len(ids) if ids is not None else sum(spec.group_block_counts)


def connector_worker():
    """vLLM's OffloadingConnectorWorker: OffloadingConnectorWorker(spec) in 0.25; 0.27 on take the
    vllm_config and kv_cache_config too (neither read outside register_kv_caches); 0.34 resolves a GPU spec
    to device pointers in its KV caches: one CPU tensor of PAGE-byte blocks here."""
    import inspect
    if "kv_cache_config" not in inspect.signature(OffloadingConnectorWorker.__init__).parameters:
        return OffloadingConnectorWorker(spec=None)      # its spec is only used by register_kv_caches
    import torch
    from vllm.v1.kv_offload import base
    cw = OffloadingConnectorWorker(spec=SimpleNamespace(replicated_layout=False), vllm_config=None,
                                   kv_cache_config=None)
    if hasattr(base, "CanonicalKVCaches"):
        cw._kv_caches = base.CanonicalKVCaches(
            tensors=[base.CanonicalKVCacheTensor(tensor=torch.zeros(16, PAGE, dtype=torch.int8), page_size_bytes=PAGE)],
            group_data_refs=[[base.CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=PAGE)]])
    return cw


@pytest.fixture
def setup(monkeypatch):
    gpu = Gpu()
    monkeypatch.setattr(injector, "step_begin", lambda sid: gpu.stack().append(sid) or True)
    monkeypatch.setattr(injector, "step_end", lambda: gpu.stack().pop() if gpu.stack() else None)
    monkeypatch.setattr(injector, "finish", lambda: True)
    monkeypatch.setattr(injector, "segment_path", lambda: "")
    spans = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(spans))
    eng = EngineTelemetry(telemetry=RequestTelemetry(tp, None, provider_name="vllm"), read=gpu.read,
                          settle_period_s=3600)
    monkeypatch.setattr(vi.GUARD, "current", eng)
    monkeypatch.setattr(vi.GUARD, "off", False)
    inst = vi.VllmInstrumentor()
    inst.instrument()
    cw = connector_worker()
    cw.worker = StandinOffloadingWorker(gpu)
    yield SimpleNamespace(gpu=gpu, eng=eng, spans=spans, cw=cw)
    inst.uninstrument()
    assert not isinstance(vars(StandinOffloadingWorker)["submit_store"], vi.wrapt.FunctionWrapper)


def req(rid):
    return SimpleNamespace(request_id=rid, arrival_time=time.time(), trace_headers=None, num_prompt_tokens=32,
                           num_output_tokens=4, status=SimpleNamespace(name="FINISHED_LENGTH_CAPPED"),
                           get_finished_reason=lambda: "length")


def run_step(s, tokens, meta, kernels=100):
    """One execute_model as vLLM 0.25.1's GPU model runner orders the connector's calls."""
    def body(so):
        s.cw.handle_preemptions(meta)                 # first: deferred stores of the last step go out
        s.cw.start_kv_transfers(meta)                 # loads (and any stores still deferred)
        s.gpu.launch(kernels=kernels)                 # the forward pass
        s.cw.get_finished(set())                      # vLLM's OffloadingConnector.get_finished ...
        s.cw.prepare_store_kv(meta)                   # ... defers this step's stores to the next step
        return "out"
    assert vi._execute_model(body, None, (SimpleNamespace(num_scheduled_tokens=tokens),), {}) == "out"


def test_stores_and_loads_land_on_the_requests_whose_blocks_they_move(setup):
    s = setup
    sched = SimpleNamespace(vllm_config=None)
    a, b, c = req("a-00000001"), req("b-00000002"), req("c-00000003")
    for r in (a, b, c):
        s.eng.request_added(sched, r)
    cpu = CPULoadStoreSpec([7])
    # step 1: a and b prefill; a's 3 and b's 5 prompt blocks will be stored (deferred to step 2)
    run_step(s, {a.request_id: 48, b.request_id: 80},
             OffloadingConnectorMetadata(load_jobs={}, store_jobs={
                 1: TransferJob(a.request_id, gpu_spec(3), cpu), 2: TransferJob(b.request_id, gpu_spec(5), cpu)}))
    # step 2: the stores go out; c's 4 blocks are loaded back; b finishes here
    run_step(s, {a.request_id: 1, b.request_id: 1, c.request_id: 16},
             OffloadingConnectorMetadata(load_jobs={3: TransferJob(c.request_id, CPULoadStoreSpec([1]), gpu_spec(4))},
                                         store_jobs={4: TransferJob(c.request_id, gpu_spec(2), cpu)}))
    s.eng.request_freed(b)
    # c ends before its store (deferred to step 3) is launched: it waits for it
    s.eng.request_freed(c)
    assert s.eng.settle() == 1                         # b only: c awaits its own transfer
    run_step(s, {a.request_id: 1}, OffloadingConnectorMetadata(load_jobs={}, store_jobs={}))
    s.eng.request_freed(a)
    assert s.eng.settle() == 2
    assert [k for k, _ in s.cw.worker.submitted] == ["store", "store", "load", "store"]
    got = {sp.attributes["vllm.request.id"]: sp.attributes for sp in s.spans.get_finished_spans()}
    assert got[a.request_id]["gpu_census.kv_offload.copy.dtoh.bytes"] == 3 * PAGE
    assert got[b.request_id]["gpu_census.kv_offload.copy.dtoh.bytes"] == 5 * PAGE
    assert got[c.request_id]["gpu_census.kv_offload.copy.dtoh.bytes"] == 2 * PAGE
    assert got[c.request_id]["gpu_census.kv_offload.copy.htod.bytes"] == 4 * PAGE
    assert "gpu_census.kv_offload.copy.htod.bytes" not in got[a.request_id]
    assert got[c.request_id]["gpu_census.copy.htod.bytes"] == 4 * PAGE    # no other htod in these steps
    assert (got[a.request_id]["vllm.kv_offload.stored_blocks"], got[c.request_id]["vllm.kv_offload.loaded_blocks"]) == (3, 4)
    assert all(v["gpu_census.attribution.status"] == "complete" for v in got.values())
    assert got[a.request_id]["gpu_census.attribution.steps"] == 3          # sub-steps are not steps
    # exact conservation: the spans + unclaimed == every step and sub-step the census holds
    census = sum((Share(x.kernel_count, x.kernel_ns, dict(x.copies)) for x in s.gpu.steps.values()), Share())
    assert sum(v["gpu_census.kernel.count"] for v in got.values()) + s.eng.ledger.unattributed[0] == census.kernel_count
    for d in ("dtoh", "htod"):
        assert sum(v[f"gpu_census.copy.{d}.bytes"] for v in got.values()) + \
            Share.from_row(s.eng.ledger.unattributed).copy(d).bytes == census.copy(d).bytes
    assert Share.from_row(s.eng.ledger.total) == census
    assert Share.from_row(s.eng.ledger.unattributed).is_zero()
    assert s.eng.ledger.sub_steps == 3                                     # step 2: stores, loads; step 3: store


def test_a_job_the_metadata_never_named_is_counted_unclaimed(setup):
    s = setup
    a = req("a-00000001")
    s.eng.request_added(SimpleNamespace(vllm_config=None), a)
    s.cw._unsubmitted_store_jobs.append((99, gpu_spec(6), CPULoadStoreSpec([1])))   # from before us
    run_step(s, {a.request_id: 8}, OffloadingConnectorMetadata(load_jobs={}, store_jobs={}))
    s.eng.request_freed(a)
    assert s.eng.settle() == 1
    (sp,) = s.spans.get_finished_spans()
    assert sp.attributes["gpu_census.copy.dtoh.bytes"] == 0
    assert Share.from_row(s.eng.ledger.unattributed).copy("dtoh").bytes == 6 * PAGE


def test_a_store_flushed_by_handle_preemptions_lands_on_its_request(setup):
    """From 0.27 on handle_preemptions submits the store jobs in jobs_to_flush itself, taking them out of
    store_jobs before prepare_store_kv sees them: the hook learns their requests from the metadata first."""
    import inspect
    if "store_jobs.pop" not in inspect.getsource(inspect.unwrap(OffloadingConnectorWorker.handle_preemptions)):
        pytest.skip("this vLLM's handle_preemptions submits no store job of the step's metadata (0.25)")
    s = setup
    a = req("a-00000001")
    s.eng.request_added(SimpleNamespace(vllm_config=None), a)
    run_step(s, {a.request_id: 8}, OffloadingConnectorMetadata(
        load_jobs={}, store_jobs={5: TransferJob(a.request_id, gpu_spec(3), CPULoadStoreSpec([7]))},
        jobs_to_flush={5}))
    s.eng.request_freed(a)
    assert s.eng.settle() == 1
    assert s.cw.worker.submitted == [("store", 5)]
    (sp,) = s.spans.get_finished_spans()
    assert sp.attributes["gpu_census.kv_offload.copy.dtoh.bytes"] == 3 * PAGE
    assert Share.from_row(s.eng.ledger.unattributed).is_zero()


def test_the_hook_reads_the_block_count_of_what_this_vllm_submits(setup):
    """What the connector hands submit_* (a GPULoadStoreSpec, or 0.34's DevicePointers) has a block count the
    hook reads; an object it does not know reads as unsized (the shares then say they are approximate)."""
    s = setup
    spec = gpu_spec(5)
    try:
        from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers   # 0.34: the GPU side as device pointers
        spec = resolve_device_pointers(spec, s.cw._kv_caches)
    except ImportError:
        pass
    assert kv_offload._blocks(spec) == 5
    assert kv_offload._blocks(SimpleNamespace()) == 0 and kv_offload._blocks(SimpleNamespace(block_ids=7)) == 0


def test_the_connector_calls_the_hooks_read_exist_in_vllm():
    import inspect
    sig = {n: list(inspect.signature(inspect.unwrap(getattr(OffloadingConnectorWorker, n))).parameters)
           for n in ("prepare_store_kv", "handle_preemptions", "start_kv_transfers")}
    assert sig == {"prepare_store_kv": ["self", "metadata"], "handle_preemptions": ["self", "kv_connector_metadata"],
                   "start_kv_transfers": ["self", "metadata"]}
    # 0.25-0.30: (job_id, src_spec, dst_spec), the GPU side a GPULoadStoreSpec; later releases hand the GPU
    # side over as device_ptrs (DevicePointers) in 0.34, submit_load with an expedited flag after them
    assert list(inspect.signature(OffloadingWorker.submit_store).parameters) in (
        ["self", "job_id", "src_spec", "dst_spec"], ["self", "job_id", "device_ptrs", "dst_spec"])
    assert list(inspect.signature(OffloadingWorker.submit_load).parameters) in (
        ["self", "job_id", "src_spec", "dst_spec"], ["self", "job_id", "src_spec", "device_ptrs", "expedited"])
    assert {f for f in TransferJob.__dataclass_fields__} >= {"req_id", "src_spec", "dst_spec"}
    # vLLM's default for --kv-offloading-size is this connector (not SimpleCPUOffloadConnector)
    from vllm import envs
    assert not envs.VLLM_USE_SIMPLE_KV_OFFLOAD
