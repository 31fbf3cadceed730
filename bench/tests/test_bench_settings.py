"""The benches set only settings the census still reads: a retired OTEL_GPU_CENSUS_* name is ignored by the
injector (one "unknown setting" line), so a bench that sets one measures another collector than it says."""
from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))
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
