"""The benches set only settings the census still reads: a retired OTEL_GPU_CENSUS_* name is ignored by the
injector (one "unknown setting" line), so a bench that sets one measures another collector than it says."""
from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "bench" / "device"))
import vllm_e2e  # noqa: E402
from otel_gpu_census.cli.launcher import census_env  # noqa: E402
from otel_gpu_census.settings import PREFIX, SETTINGS  # noqa: E402

NAME = re.compile(PREFIX + r"([A-Z][A-Z0-9_]*[A-Z0-9])")
# headline.py records each figure's command as it was run, in the names of its time
AS_MEASURED = {REPO / "bench" / "headline.py", Path(__file__).resolve()}


def names_used(path: Path) -> set:
    return set(NAME.findall(path.read_text()))


def test_every_setting_a_bench_names_is_in_the_table():
    known = set(SETTINGS)
    stale = {}
    for path in sorted((REPO / "bench").rglob("*")):
        if path.suffix not in (".py", ".sh") or path in AS_MEASURED or "results" in path.parts:
            continue
        unknown = names_used(path) - known
        if unknown:
            stale[str(path.relative_to(REPO))] = sorted(unknown)
    assert stale == {}


def test_the_check_sees_a_retired_name(tmp_path):
    f = tmp_path / "probe.py"
    f.write_text('env = {"OTEL_GPU_CENSUS_KERNELS": "all", "OTEL_GPU_CENSUS_COLLECTOR": "precise"}\n')
    assert names_used(f) - set(SETTINGS) == {"KERNELS"}


def test_vllm_server_a_runs_the_precise_collector_under_run(tmp_path):
    """Server A is the reference of the kernel-time checks: under `run` (which names a collector) it must still get
    CUPTI, so its environment names the collector, not a finer setting `run`'s choice decides over."""
    env = vllm_e2e.BESIDE["A"][2]
    plan = census_env(tmp_path, base=env)
    assert plan.env["OTEL_GPU_CENSUS_COLLECTOR"] == "precise"
    assert census_env(tmp_path, base={}).env["OTEL_GPU_CENSUS_COLLECTOR"] == "default"     # the check can fail


def test_vllm_server_u_is_the_precise_collector_paused_without_the_integration(tmp_path):
    """U stands in for the retired "CUPTI set up, every kind off" server: under `run` it must get CUPTI (the precise
    collector), run paused beside R's phases like every non-counting census server, and load no integration."""
    port, census, env, _ = vllm_e2e.BESIDE["U"]
    assert census and "U" not in vllm_e2e.COUNTING
    assert census_env(tmp_path, base=env).env["OTEL_GPU_CENSUS_COLLECTOR"] == "precise"
    assert env["OTEL_PYTHON_DISABLED_INSTRUMENTATIONS"] == "vllm"
    assert port not in {p for n, (p, *_) in vllm_e2e.BESIDE.items() if n != "U"}
