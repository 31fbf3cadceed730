"""Shared fixtures: the native library (built once per session) and real census segments.

Segments are written by the C code itself: gc_segment_init, then real CUPTI activity records
(tests/support/cupti_records.py) through gc_tally_record, then the writer's seqlock helpers. The bytes
that land in the file are what the injector would have mapped; the reader under test only sees
the file.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUPPORT = ROOT / "tests" / "support"          # the segment writer, CUPTI records, OTLP receiver, stand-ins
sys.path.insert(0, str(SUPPORT))
try:
    import otel_gpu_census  # noqa: F401
except ImportError:          # a source checkout that was not pip-installed
    sys.path.insert(0, str(ROOT / "src"))
from otel_gpu_census.report import cost as _cost  # noqa: E402
_cost.load_prices(ROOT / "bench" / "results" / "census_cost_prices.json")   # the measured prices, as in a checkout

GC_STATE_ACTIVE, GC_STATE_EXITED = 1, 2


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU (skipped without one)")
    runtime = os.environ.get("CENSUS_TEST_SANITIZER")
    if runtime:
        _sanitize_children(runtime)


def _sanitize_children(runtime: str) -> None:
    """`make test-sanitized`: every process a test starts gets the sanitizer's runtime first in LD_PRELOAD (a test
    that preloads the census library names it alone; `run` keeps a sanitizer's runtime first itself)."""
    init = subprocess.Popen.__init__

    def first(self, *args, **kw):
        env = dict(kw.get("env") if kw.get("env") is not None else os.environ)
        rest = [p for p in env.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p and p != runtime]
        env["LD_PRELOAD"] = ":".join([runtime] + rest)
        kw["env"] = env
        init(self, *args, **kw)
    subprocess.Popen.__init__ = first


def _have_gpu() -> bool:
    return os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi") is not None


def pytest_collection_modifyitems(config, items):
    if _have_gpu():
        return
    skip = pytest.mark.skip(reason="no NVIDIA GPU on this machine: `make gpu-test` on one")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def native():
    """(ffi, lib, path) of the native library, built from native/ once for the session."""
    if not (shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")):
        pytest.skip("no C compiler: the native library cannot be built, so no real segments can be written")
    import cupti_records
    try:
        return cupti_records.native()
    except subprocess.CalledProcessError as e:
        pytest.fail(f"building the native library failed: {e}")


@pytest.fixture(scope="session")
def records(native):
    import cupti_records
    return cupti_records


@pytest.fixture(scope="session")
def segments(native):
    from segments import SegmentWriter
    return SegmentWriter(native)


@pytest.fixture
def census_dir(tmp_path):
    d = tmp_path / "census"
    d.mkdir(mode=0o700)
    return d


@pytest.fixture(scope="session")
def dead_pid():
    """A pid whose process has exited (and was reaped)."""
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


@pytest.fixture
def tagged(monkeypatch):
    """The injector is present and counting, for engine-hook tests: steps are tagged (what
    step_begin/end would do); returns the thread's open step ids."""
    from otel_gpu_census import injector
    opened = []
    monkeypatch.setattr(injector, "step_begin", lambda sid: opened.append(sid) or True)
    monkeypatch.setattr(injector, "step_end", lambda: opened.pop() if opened else None)
    monkeypatch.setattr(injector, "finish", lambda: True)
    monkeypatch.setattr(injector, "segment_path", lambda: "")
    return opened
