"""What the vLLM hooks rely on, checked against the real vLLM 0.25.1 classes on the CPU.

Each hook wraps a method by name (wrapt) and reads fields of the objects it is handed; a rename upstream
would make a hook fail silently or not attach at all. These tests import the classes themselves (no
stand-ins), check the wrapped methods' parameter names, and build a real Request and SchedulerOutput.
They run in the environment that `tests/vllm_env.sh .venv-vllm` makes (`make test-vllm`).
"""
from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap

import pytest

vllm = pytest.importorskip(
    "vllm", reason="vLLM is not installed here: `make test-vllm` builds the CPU environment these tests need")

import support_vllm  # noqa: E402  (imports vLLM)
from vllm.entrypoints.generate.base.serving import GenerateBaseServing  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.engine.core import DPEngineCoreProc, EngineCore, EngineCoreProc  # noqa: E402
from vllm.v1.metrics.stats import PrefillStats  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.worker.gpu_worker import Worker  # noqa: E402
from vllm.v1.worker.worker_base import WorkerWrapperBase  # noqa: E402
import vllm.plugins  # noqa: E402


def params(func) -> list[tuple[str, object]]:
    """(name, default) of each parameter, inspect.Parameter.empty where there is none."""
    return [(p.name, p.default) for p in inspect.signature(func).parameters.values()]


E = inspect.Parameter.empty


def test_version_is_the_one_the_hooks_were_written_for():
    from packaging.requirements import Requirement
    from otel_gpu_census.integrations.vllm.package import _instruments
    assert Requirement(_instruments[0]).specifier.contains(vllm.__version__), vllm.__version__


# -- the methods the hooks wrap ---------------------------------------------------------------------

@pytest.mark.parametrize("cls, name, expected", [
    (WorkerWrapperBase, "execute_model", [("self", E), ("scheduler_output", E)]),
    (Scheduler, "update_from_output", [("self", E), ("scheduler_output", E), ("model_runner_output", E)]),
    (Scheduler, "_free_request", [("self", E), ("request", E), ("delay_free_blocks", False)]),
    (Scheduler, "finish_requests", [("self", E), ("request_ids", E), ("finished_status", E)]),
    (Scheduler, "schedule", [("self", E), ("throttle_prefills", False)]),
    (EngineCore, "shutdown", [("self", E)]),
])
def test_wrapped_method_is_defined_on_the_class_with_these_parameters(cls, name, expected):
    # Defined on the class itself (not inherited, not forwarded), so wrapping "Class.method" patches the
    # code that runs.
    assert name in vars(cls), f"{cls.__qualname__}.{name} is not defined on {cls.__qualname__}"
    assert params(getattr(cls, name)) == expected


def test_sample_tokens_is_forwarded_by_the_wrapper_to_the_worker():
    # WorkerWrapperBase has no sample_tokens of its own: its __getattr__ hands the call to the worker
    # it wraps (gpu_worker.Worker on CUDA). A hook must wrap Worker.sample_tokens; wrapping
    # "WorkerWrapperBase.sample_tokens" raises AttributeError when the hook is installed.
    assert "sample_tokens" not in vars(WorkerWrapperBase)
    assert not hasattr(WorkerWrapperBase, "sample_tokens")
    assert "sample_tokens" in vars(Worker)
    assert params(Worker.sample_tokens) == [("self", E), ("grammar_output", E)]
    assert params(Worker.execute_model) == [("self", E), ("scheduler_output", E)]

    class Inner:
        def sample_tokens(self, grammar_output):
            return ("sampled", grammar_output)

    wrapper = WorkerWrapperBase(rpc_rank=0)
    wrapper.worker = Inner()
    assert wrapper.sample_tokens("g") == ("sampled", "g")


def test_subclasses_the_engine_uses_inherit_the_wrapped_methods():
    # AsyncScheduler (async scheduling) and EngineCoreProc run the base methods, so one wrap covers them.
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    for name in ("update_from_output", "_free_request", "finish_requests", "schedule"):
        assert getattr(AsyncScheduler, name) is getattr(Scheduler, name), name
    assert EngineCoreProc.shutdown is EngineCore.shutdown
    # The data-parallel engine overrides shutdown but calls the base one first.
    assert "shutdown" in vars(DPEngineCoreProc)
    assert "super().shutdown()" in inspect.getsource(DPEngineCoreProc.shutdown)


def test_run_engine_core_is_a_static_entry_point():
    assert isinstance(inspect.getattr_static(EngineCoreProc, "run_engine_core"), staticmethod)
    assert params(EngineCoreProc.run_engine_core) == [
        ("args", E), ("dp_rank", 0), ("local_dp_rank", 0), ("kwargs", E)]


def test_get_trace_headers_is_an_async_method_of_the_generate_serving_base():
    # 0.25-0.30 define it on GenerateBaseServing, 0.34 on its base BaseServing (the hook wraps it on
    # GenerateBaseServing all the same, and uninstrument takes the wrapper off again)
    from vllm.entrypoints.serve.engine.serving import BaseServing
    assert "_get_trace_headers" in vars(GenerateBaseServing) or "_get_trace_headers" in vars(BaseServing)
    assert issubclass(GenerateBaseServing, BaseServing)
    method = GenerateBaseServing._get_trace_headers
    assert inspect.iscoroutinefunction(method)
    assert params(method) == [("self", E), ("headers", E)]


# -- the objects the hooks read ---------------------------------------------------------------------

def test_the_scheduler_holds_the_config_that_names_vllms_traces_endpoint():
    """The hook on Scheduler.add_request reads scheduler.vllm_config.observability_config.otlp_traces_endpoint
    (--otlp-traces-endpoint) to send our spans where vLLM sends its own."""
    from vllm.config import ObservabilityConfig, VllmConfig
    assert "self.vllm_config = vllm_config" in inspect.getsource(Scheduler.__init__)
    assert "observability_config" in VllmConfig.__dataclass_fields__
    assert ObservabilityConfig(otlp_traces_endpoint="http://collector:4317").otlp_traces_endpoint == \
        "http://collector:4317"
    assert ObservabilityConfig().otlp_traces_endpoint is None        # not set: the OTEL_* variables decide


def test_scheduler_output_fields():
    fields = SchedulerOutput.__dataclass_fields__
    for name in ("num_scheduled_tokens", "total_num_scheduled_tokens", "finished_req_ids",
                 "scheduled_new_reqs", "scheduled_cached_reqs"):
        assert name in fields, name
    assert fields["num_scheduled_tokens"].type == dict[str, int]
    assert fields["total_num_scheduled_tokens"].type is int
    assert fields["finished_req_ids"].type == set[str]
    assert "req_id" in NewRequestData.__dataclass_fields__
    assert "req_ids" in CachedRequestData.__dataclass_fields__


def test_a_real_scheduler_output_for_one_step():
    new = support_vllm.make_request("r-new", prompt_len=5)
    so = support_vllm.make_scheduler_output({"r-new": 5, "r-run": 1}, finished={"r-done"}, new_requests=[new])
    assert isinstance(so, SchedulerOutput)
    assert so.num_scheduled_tokens == {"r-new": 5, "r-run": 1}
    assert so.total_num_scheduled_tokens == 6
    assert so.finished_req_ids == {"r-done"}
    assert [r.req_id for r in so.scheduled_new_reqs] == ["r-new"]
    assert so.scheduled_new_reqs[0].prompt_token_ids == list(range(5))
    assert so.scheduled_cached_reqs.req_ids == ["r-run"]
    assert so.scheduled_cached_reqs.num_reqs == 1


def test_scheduler_output_helper_refuses_what_the_scheduler_never_produces():
    with pytest.raises(ValueError, match="non-negative int"):
        support_vllm.make_scheduler_output({"r": -1})
    with pytest.raises(ValueError, match="no scheduled tokens"):
        support_vllm.make_scheduler_output({}, new_requests=[support_vllm.make_request("r", 3)])


def test_a_real_request_and_the_fields_the_hooks_read():
    tp = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    req = support_vllm.make_request("r1", prompt_len=7, max_tokens=4, trace_headers=tp, arrival_time=100.5)
    assert isinstance(req, Request)
    assert req.request_id == "r1"
    assert req.arrival_time == 100.5
    assert req.trace_headers == tp
    assert req.num_prompt_tokens == 7
    assert req.num_output_tokens == 0
    assert req.status == RequestStatus.WAITING
    assert req.get_finished_reason() is None

    req.append_output_token_ids([11, 12])
    assert req.num_output_tokens == 2
    req.status = RequestStatus.FINISHED_STOPPED
    assert req.is_finished()
    assert str(req.get_finished_reason()) == "stop"
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert str(req.get_finished_reason()) == "length"


def test_arrival_time_defaults_to_wall_clock_seconds():
    import time
    before = time.time()
    req = support_vllm.make_request("r", prompt_len=1)
    assert before <= req.arrival_time <= time.time()


def test_cached_prompt_tokens_live_in_prefill_stats_until_the_first_output():
    # 0.25.1's Request has no num_cached_tokens. The scheduler records prefix-cache hits in
    # request.prefill_stats when it first schedules the prefill (schedule()), and update_from_output
    # hands them to the output with take_prefill_stats(), which leaves None behind: a hook reads them
    # before update_from_output runs (or from the EngineCoreOutput), never in _free_request.
    req = support_vllm.make_request("r", prompt_len=10)
    assert not hasattr(req, "num_cached_tokens")
    assert isinstance(req.prefill_stats, PrefillStats)
    req.prefill_stats.set(num_prompt_tokens=10, num_local_cached_tokens=4, num_external_cached_tokens=2)
    assert req.prefill_stats.num_cached_tokens == 6
    assert req.prefill_stats.num_computed_tokens == 4
    taken = req.take_prefill_stats()
    assert taken.num_cached_tokens == 6
    assert req.prefill_stats is None


# -- the plugin entry point -------------------------------------------------------------------------

def test_plugins_module_names_the_group():
    assert vllm.plugins.DEFAULT_PLUGINS_GROUP == "vllm.general_plugins"
    assert callable(vllm.plugins.load_general_plugins)


def _write_plugin_distribution(root, marker):
    """A distribution on sys.path with one vllm.general_plugins entry point: what `pip install` of a
    package declaring it leaves in site-packages (a dist-info with entry_points.txt beside the module)."""
    (root / "census_probe_plugin.py").write_text(textwrap.dedent(f"""
        def register():
            with open({str(marker)!r}, "a") as f:
                f.write("loaded\\n")
    """))
    dist = root / "census_probe_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: census-probe-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[vllm.general_plugins]\ncensus_probe = census_probe_plugin:register\n")


@pytest.mark.parametrize("allowed, expect_loaded", [(None, True), ("census_probe", True), ("other", False)])
def test_load_general_plugins_runs_an_installed_entry_point_on_cpu(tmp_path, allowed, expect_loaded):
    # In a fresh interpreter: load_general_plugins runs once per process.
    marker = tmp_path / "marker"
    _write_plugin_distribution(tmp_path, marker)
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    env.pop("VLLM_PLUGINS", None)
    if allowed is not None:
        env["VLLM_PLUGINS"] = allowed
    code = "import vllm.plugins as p; p.load_general_plugins(); p.load_general_plugins()"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Failed to load plugin" not in proc.stderr
    if expect_loaded:
        assert marker.read_text() == "loaded\n"   # once, though called twice
    else:
        assert not marker.exists()
