"""The vLLM and SGLang instrumentors as an OpenTelemetry user drives them: the providers given to
instrument(), the application's own (opentelemetry-instrument sets them globally), OTEL_PYTHON_DISABLED_INSTRUMENTATIONS
as opentelemetry-instrument reads it, and vLLM's --otlp-traces-endpoint."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from otel_gpu_census.integrations.engine import settle_process
from otel_gpu_census.integrations.sglang import instrumentor as si
from otel_gpu_census.integrations.vllm import instrumentor as vi
from otel_gpu_census.telemetry import setup
from engine_standins import in_memory_providers  # tests/support

ENGINES = [pytest.param(vi, "vllm", id="vllm"), pytest.param(si, "sglang", id="sglang")]


@pytest.fixture
def in_memory():
    return in_memory_providers()


@pytest.fixture
def fresh(monkeypatch):
    """Each instrumentor as if never used in this process: no hooks land (no engine here), no engine made."""
    monkeypatch.setattr(vi.wrapt, "when_imported", lambda name: (lambda f: f))
    monkeypatch.setattr(si, "_registry", lambda: (SimpleNamespace(register=lambda *a: None, apply_hooks=lambda: None),
                                                  SimpleNamespace(AROUND=1, AFTER=2)))
    monkeypatch.setattr(si, "_registered", False)
    for mod in (vi, si):
        monkeypatch.setattr(mod.GUARD, "current", None)
        monkeypatch.setattr(mod.GUARD, "off", False)
        monkeypatch.setattr(mod, "_providers", (None, None))
    monkeypatch.setattr(setup, "application_providers", lambda: (None, None))
    yield
    for inst in (vi.VllmInstrumentor(), si.SglangInstrumentor()):
        if inst.is_instrumented_by_opentelemetry:
            inst.uninstrument()


def _one_request(eng):
    """A request through the engine's request lifecycle, as its settler ends it."""
    req = eng.telemetry().start(start_ns=1_000_000_000, operation="chat", model="m", span_name="chat m")
    req.first_token(1_200_000_000)
    req.finish(2_000_000_000, output_tokens=5)


@pytest.mark.parametrize("mod,name", ENGINES)
def test_instrument_takes_the_users_providers(mod, name, fresh, in_memory):
    tp, mp, spans, reader = in_memory
    cls = vi.VllmInstrumentor if mod is vi else si.SglangInstrumentor
    cls().instrument(tracer_provider=tp, meter_provider=mp, skip_dep_check=True)
    eng = mod.engine()
    # the providers are objects of this process: settling stays here (a settling child could not reach them)
    assert eng.remote is None and eng.providers == (tp, mp)
    _one_request(eng)
    [span] = spans.get_finished_spans()
    assert span.name == "chat m" and span.instrumentation_scope.name == f"otel_gpu_census.{name}"
    names = {m.name for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics
             for m in sm.metrics}
    assert {"gen_ai.server.request.duration", "gen_ai.server.time_to_first_token"} <= names


@pytest.mark.parametrize("mod,name", ENGINES)
def test_without_providers_the_applications_global_ones_are_used(mod, name, fresh, in_memory, monkeypatch):
    """opentelemetry-instrument (or the application) set SDK providers globally: they are the user's."""
    tp, mp, spans, _ = in_memory
    monkeypatch.setattr(setup, "application_providers", lambda: (tp, mp))
    (vi.VllmInstrumentor if mod is vi else si.SglangInstrumentor)().instrument(skip_dep_check=True)
    eng = mod.engine()
    assert eng.remote is None
    _one_request(eng)
    assert len(spans.get_finished_spans()) == 1


@pytest.mark.parametrize("mod,name", ENGINES)
def test_without_any_providers_a_child_settles_with_providers_from_the_environment(mod, name, fresh, monkeypatch):
    monkeypatch.delenv(settle_process.SETTLE_ENV, raising=False)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    (vi.VllmInstrumentor if mod is vi else si.SglangInstrumentor)().instrument(skip_dep_check=True)
    eng = mod.engine()
    assert isinstance(eng.remote, settle_process.Remote) and eng.providers == (None, None)
    tel = setup.engine_telemetry(*eng.providers)        # what the settling child builds
    assert tel.descriptions[0] == "traces → console (stdout)"


@pytest.mark.parametrize("value,off", [("*", True), (" flask , * ", True), ("vllm,sglang", True),
                                       ("flask", False), ("", False), ("vllm*", False)])
@pytest.mark.parametrize("mod,name", ENGINES)
def test_disabled_instrumentations_read_as_opentelemetry_instrument_reads_them(mod, name, value, off, monkeypatch):
    calls = []
    cls = vi.VllmInstrumentor if mod is vi else si.SglangInstrumentor
    monkeypatch.setattr(cls, "instrument", lambda self, **kw: calls.append(1))
    monkeypatch.setenv("CUDA_INJECTION64_PATH", "/opt/x/libotel_gpu_census.so")
    monkeypatch.setenv("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", value)
    mod.register()
    assert calls == ([] if off else [1])


@pytest.fixture
def endpoint_env(monkeypatch):
    """The variables the endpoint tests read, unset, and restored afterwards (the hook sets one itself)."""
    for k in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_TRACES_EXPORTER",
              "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)
    monkeypatch.setattr(vi, "_endpoint_read", False)


def _scheduler(endpoint):
    return SimpleNamespace(vllm_config=SimpleNamespace(observability_config=SimpleNamespace(
        otlp_traces_endpoint=endpoint)))


def test_vllms_otlp_traces_endpoint_is_where_the_spans_go(endpoint_env):
    vi._follow_traces_endpoint(_scheduler("http://jaeger.example:4317"))
    assert setup.build_telemetry(metrics=False).descriptions == ["traces → OTLP grpc jaeger.example:4317"]
    vi._follow_traces_endpoint(_scheduler("http://other:4317"))          # read once, at the first request
    assert setup.build_telemetry(metrics=False).descriptions == ["traces → OTLP grpc jaeger.example:4317"]


@pytest.mark.parametrize("scheduler", [_scheduler(None), _scheduler(""), SimpleNamespace()])
def test_without_vllms_endpoint_the_otel_variables_decide(scheduler, endpoint_env):
    vi._follow_traces_endpoint(scheduler)
    assert "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT" not in os.environ


def test_the_users_traces_endpoint_wins_over_vllms(endpoint_env, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://mine:4317")
    vi._follow_traces_endpoint(_scheduler("http://vllms:4317"))
    assert os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] == "http://mine:4317"


def test_the_endpoint_is_read_before_the_request_reaches_the_engine(monkeypatch):
    """The hook on Scheduler.add_request reads it before anything of ours makes a span or a settling child."""
    seen = []
    monkeypatch.setattr(vi, "_endpoint_read", False)
    monkeypatch.setattr(vi.GUARD, "off", False)
    monkeypatch.setattr(vi, "_follow_traces_endpoint", lambda s: seen.append(("endpoint", s)))
    monkeypatch.setattr(vi.GUARD, "current", SimpleNamespace(request_added=lambda s, r: seen.append(("added", r))))
    sched = _scheduler("http://c:4317")
    assert vi._add_request(lambda r: "queued", sched, ("req",), {}) == "queued"
    assert seen == [("endpoint", sched), ("added", "req")]


def test_opentelemetry_instrument_skips_both_where_neither_engine_is_installed():
    """opentelemetry-instrument reads the distribution's `instruments-any` extra before it loads an instrumentor
    (get_dist_dependency_conflicts): with neither vLLM nor SGLang here it loads none; with either, both load, and
    the other's instrumentor finds no engine and does nothing. The extra is the two packages' ranges."""
    import importlib.metadata as md
    tomllib = pytest.importorskip("tomllib")
    from opentelemetry.instrumentation.dependencies import get_dist_dependency_conflicts
    from otel_gpu_census.integrations import sglang, vllm
    root = __import__("pathlib").Path(__file__).resolve().parents[2]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["instruments-any"] == [*vllm._instruments, *sglang._instruments]
    dist = SimpleNamespace(requires=[f'{r}; extra == "instruments-any"' for r in extras["instruments-any"]] +
                           ['wrapt>=1.14'])
    for name in ("vllm", "sglang"):
        try:
            md.version(name)
            pytest.skip(f"{name} is installed here: the case is neither installed")
        except md.PackageNotFoundError:
            pass
    conflict = get_dist_dependency_conflicts(dist)
    assert conflict is not None and "vllm" in str(conflict) and "sglang" in str(conflict), conflict
