"""Shared fixtures: the native library (built once per session) and real census segments.

Segments are written by the C code itself: gc_segment_init, then real CUPTI activity records
(tests/cupti_records.py) through gc_tally_record, then the writer's seqlock helpers. The bytes
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
try:
    import otel_gpu_census  # noqa: F401
except ImportError:          # a source checkout that was not pip-installed
    sys.path.insert(0, str(ROOT / "src"))

GC_STATE_ACTIVE, GC_STATE_EXITED = 1, 2


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU (skipped without one)")


def _have_gpu() -> bool:
    return os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi") is not None


def pytest_collection_modifyitems(config, items):
    if _have_gpu():
        return
    skip = pytest.mark.skip(reason="no NVIDIA GPU on this machine")
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


class SegmentWriter:
    """Writes census segments through the native tally, as the injector would."""

    def __init__(self, native):
        self.ffi, self.lib, self.path = native

    def new(self, comm="worker", gpu_ref_ns=0):
        seg = self.ffi.new("gc_segment *")
        self.lib.gc_segment_init(seg, comm.encode() if comm is not None else self.ffi.NULL, 0, gpu_ref_ns)
        return seg

    def tally(self, seg, recs, final=True, state=None):
        """Count `recs` into `seg` inside one seqlock update, as one buffer completion does."""
        t = self.lib.gc_tally_create(seg)
        try:
            self.lib.gc_segment_begin_update(seg)
            for r in recs:
                self.lib.gc_tally_record(t, r)
            self.lib.gc_tally_publish(t, 1 if final else 0)
            seg.state = state if state is not None else (GC_STATE_EXITED if final else GC_STATE_ACTIVE)
            self.lib.gc_segment_end_update(seg)
        finally:
            self.lib.gc_tally_destroy(t)
        return seg

    def write(self, directory, seg, name=None) -> Path:
        directory = Path(directory)
        name = name or f"gpu-census-{seg.pid}-{seg.proc_start_ticks}.seg"
        p = directory / name
        p.write_bytes(bytes(self.ffi.buffer(seg)))
        return p

    def segment(self, directory, recs=(), comm="worker", final=True, state=None, pid=None, ppid=None,
                start_ticks=None, gpu_ref_ns=0, edit=None) -> Path:
        """One segment file holding `recs`; pid/ppid/start_ticks override the identity (to stand for
        other processes); `edit(seg)` may change anything before it is written."""
        seg = self.new(comm, gpu_ref_ns)
        self.tally(seg, recs, final=final, state=state)
        if pid is not None:
            seg.pid = pid
        if ppid is not None:
            seg.ppid = ppid
        if start_ticks is not None:
            seg.proc_start_ticks = start_ticks
        if edit is not None:
            edit(seg)
        return self.write(directory, seg)


@pytest.fixture(scope="session")
def segments(native):
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
