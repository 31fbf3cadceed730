"""census/control.py against the real injector (mock libcupti, as tests/integration/test_injector.py):
a manager asks the census of a running process for its final flush through the control file, and its
flusher thread does it while the process's own thread is busy elsewhere; descendants by the segments'
parent pid; links, dead segments and hangs are not followed or waited on for ever. And the vLLM hook
that does it before vLLM stops its engines."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

from otel_gpu_census.census import control
from otel_gpu_census.census.reader import read_segment
from otel_gpu_census.integrations.engine.final_flush import FINISH_WAIT_S

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    import cffi, cupti_records as cr
    mffi = cffi.FFI()
    mffi.cdef('int mock_queue_record(const void *, uint32_t);')
    mock = mffi.dlopen({mock!r})
    gffi = cffi.FFI()
    gffi.cdef('int InitializeInjection(void); int gc_flush(void);')
    g = gffi.dlopen({lib!r})
    rffi, rlib = cr.records()
    g.InitializeInjection()
    T = 1_700_000_000_000_000_000
    rec = cr.memcpy('dtoh', 4096, T, T + 10, dst='pinned')
    mock.mock_queue_record(rffi.cast('void *', rec), rffi.sizeof(cr.MEMCPY_T))
    g.gc_flush()
    print('ready', flush=True)
    t = time.monotonic()
    while time.monotonic() - t < 20:     # busy in Python, never at its shutdown code
        pass
""")


def _busy_child(native, mock_lib, d) -> subprocess.Popen:
    """A process under the real injector (mock libcupti, 50 ms flush period) busy in Python after one
    4 KiB copy was counted; it prints "ready" first."""
    env = dict(os.environ, OTEL_GPU_CENSUS_CUPTI=mock_lib, OTEL_GPU_CENSUS_DIR=str(d),
               OTEL_GPU_CENSUS_FLUSH_MS="50")
    env.pop("OTEL_GPU_CENSUS_DISABLED", None)
    script = CHILD.format(tests=str(ROOT / "tests" / "support"), mock=mock_lib, lib=native[2])
    return subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)


def test_a_running_process_finishes_its_census_when_asked(native, mock_lib, tmp_path):
    d = tmp_path / "census"
    p = _busy_child(native, mock_lib, d)
    try:
        assert p.stdout.readline().strip() == "ready"
        t = time.monotonic()
        assert control.finish(d, [p.pid], timeout_s=5) == (1, 1)
        assert time.monotonic() - t < 2
        seg = read_segment(next(d.glob("*.seg")))
        assert seg.state_name == "exited" and seg.devices[0].copies.get("dtoh").bytes == 4096
        assert p.poll() is None                      # the process runs on
        assert control.finish(d, [p.pid], timeout_s=0.2) == (0, 0)     # exited: nothing to ask
    finally:
        p.kill()
        p.wait()


def test_finish_waits_for_the_engines_request_log_summary(native, mock_lib, tmp_path):
    """An engine's request log beside its segment: the manager waits (within its timeout) until the
    log ends with the ledger's summary, which the engine's settler writes once its census ended."""
    import threading
    d = tmp_path / "census"
    p = _busy_child(native, mock_lib, d)
    try:
        assert p.stdout.readline().strip() == "ready"
        log = next(d.glob("*.seg")).with_suffix(".requests.jsonl")
        log.write_text('{"id":"r1"}\n')
        t = time.monotonic()
        assert control.finish(d, [p.pid], timeout_s=0.6) == (1, 0)     # exited, but no summary yet
        assert 0.5 < time.monotonic() - t < 2
        assert read_segment(next(d.glob("*.seg"))).state_name == "exited"
    finally:
        p.kill()
        p.wait()
    # a live one whose settler writes the summary 0.4 s after the ask: finish returns then
    p = _busy_child(native, mock_lib, d)
    try:
        assert p.stdout.readline().strip() == "ready"
        seg = next(s for s in d.glob("*.seg") if s.name.startswith(f"gpu-census-{p.pid}-"))
        seg.with_suffix(".requests.jsonl").write_text('{"id":"r1"}\n')
        writer = threading.Timer(0.4, lambda: seg.with_suffix(".requests.jsonl").open("a").write(
            '{"summary":{"method":"step_tokens"}}\n'))
        writer.start()
        t = time.monotonic()
        assert control.finish(d, [p.pid], timeout_s=5) == (1, 1)
        assert 0.35 < time.monotonic() - t < 2.5
    finally:
        writer.cancel()
        p.kill()
        p.wait()


def test_descendants_by_parent_pid_and_no_wait_beyond_the_timeout(census_dir, segments, records):
    rec = [records.kernel(10, 20)]
    live = dict(final=False)                   # segments still active, as their writers left them
    engine = segments.segment(census_dir, rec, pid=101, ppid=1, start_ticks=5, **live)
    worker = segments.segment(census_dir, rec, pid=202, ppid=101, start_ticks=6, **live)
    grandchild = segments.segment(census_dir, rec, pid=303, ppid=202, start_ticks=7, **live)
    other = segments.segment(census_dir, rec, pid=404, ppid=1, start_ticks=8, **live)
    assert control.segments_of(census_dir, [101]) == sorted([engine, worker, grandchild])
    t = time.monotonic()
    # nobody answers these (no injector behind them): asked, none finished, back within the timeout
    asked, done = control.finish(census_dir, [101], timeout_s=0.3)
    assert time.monotonic() - t < 1.5
    assert all(s.with_suffix(".control").read_text() == "census=finish\n" for s in (engine, worker, grandchild))
    assert not other.with_suffix(".control").exists()
    assert (asked, done) == (3, 0)


def test_a_control_file_that_is_a_link_or_a_fifo_is_not_written_through(census_dir, segments, records, tmp_path):
    seg = segments.segment(census_dir, [records.kernel(10, 20)], pid=os.getpid(), ppid=1, start_ticks=9,
                           final=False)
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    os.symlink(target, seg.with_suffix(".control"))
    control.finish(census_dir, [os.getpid()], timeout_s=0.1)
    assert target.read_text() == "keep"
    os.unlink(seg.with_suffix(".control"))
    os.mkfifo(seg.with_suffix(".control"))
    t = time.monotonic()
    control.finish(census_dir, [os.getpid()], timeout_s=0.1)      # no reader: must not block
    assert time.monotonic() - t < 2


def test_vllm_asks_the_engines_census_to_finish_before_stopping_them(monkeypatch):
    from otel_gpu_census.integrations.vllm import instrumentor as vi
    monkeypatch.setattr(vi.GUARD, "off", False)
    monkeypatch.setenv("OTEL_GPU_CENSUS_DIR", "/some/census")
    monkeypatch.setenv("CUDA_INJECTION64_PATH", "/lib/injector.so")
    calls = []
    monkeypatch.setattr(control, "finish", lambda d, pids, t, exclude=(): calls.append(("finish", d, list(pids), t)) or (1, 1))
    procs = [SimpleNamespace(pid=7, is_alive=lambda: True), SimpleNamespace(pid=8, is_alive=lambda: False)]
    vi._process_shutdown(lambda procs, timeout=None: calls.append(("stop", timeout)), None, (procs,), {"timeout": 0})
    assert calls == [("finish", "/some/census", [7], FINISH_WAIT_S), ("stop", vi.SHUTDOWN_GRACE_S)]
    calls.clear()
    monkeypatch.delenv("CUDA_INJECTION64_PATH")                   # not under the census: nothing to ask
    vi._process_shutdown(lambda procs, timeout=None: calls.append(("stop", timeout)), None, (procs,), {})
    assert calls == [("stop", None)]


def test_sglang_asks_the_censuses_of_a_tree_to_finish_before_killing_it(monkeypatch):
    from otel_gpu_census.integrations.sglang import instrumentor as si
    monkeypatch.setattr(si.GUARD, "off", False)
    monkeypatch.setenv("OTEL_GPU_CENSUS_DIR", "/some/census")
    monkeypatch.setenv("CUDA_INJECTION64_PATH", "/lib/injector.so")
    calls = []
    monkeypatch.setattr(control, "finish", lambda d, pids, t, exclude=(): calls.append(
        ("finish", d, list(pids), t, sorted(exclude))) or (1, 1))
    kill = lambda *a, **kw: calls.append(("kill", a, kw)) or "killed"
    # the launcher at its stop: its children, not itself
    assert si._kill_process_tree(kill, 4242, include_parent=False) == "killed"
    assert calls == [("finish", "/some/census", [4242], FINISH_WAIT_S, [4242]),
                     ("kill", (4242,), {"include_parent": False})]
    calls.clear()
    si._kill_process_tree(kill, 4242, True, 77)                   # the whole tree but skip_pid
    assert calls[0] == ("finish", "/some/census", [4242], FINISH_WAIT_S, [77])
    calls.clear()
    si._kill_process_tree(kill, None)                             # None: this process's children
    assert calls[0] == ("finish", "/some/census", [os.getpid()], FINISH_WAIT_S, [os.getpid()])
    calls.clear()
    si._kill_process_tree(kill, 4242, wait_timeout=None)          # SGLang must not block there: no wait
    assert calls == [("kill", (4242,), {"wait_timeout": None})]
    calls.clear()
    monkeypatch.delenv("CUDA_INJECTION64_PATH")                   # not under the census: nothing to ask
    si._kill_process_tree(kill, 4242)
    assert calls == [("kill", (4242,), {})]
    monkeypatch.setenv("CUDA_INJECTION64_PATH", "/lib/injector.so")
    monkeypatch.setattr(control, "finish", lambda *a, **kw: 1 / 0)   # our failure never stops the kill
    calls.clear()
    assert si._kill_process_tree(kill, 4242) == "killed" and calls == [("kill", (4242,), {})]


def test_exclude_leaves_the_managers_own_census_alone(census_dir, segments, records):
    rec = [records.kernel(10, 20)]
    launcher = segments.segment(census_dir, rec, pid=101, ppid=1, start_ticks=5, final=False)
    sched = segments.segment(census_dir, rec, pid=202, ppid=101, start_ticks=6, final=False)
    assert control.finish(census_dir, [101], timeout_s=0.1, exclude=[101]) == (1, 0)
    assert sched.with_suffix(".control").read_text() == "census=finish\n"
    assert not launcher.with_suffix(".control").exists()
