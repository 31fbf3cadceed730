"""The injector's life in a process, on a CPU: a mock libcupti (native/tests/mock_cupti.c) stands in
for CUPTI, hands the injector real record structs through its own buffer callbacks, and each case
runs in a fresh process (InitializeInjection runs once per process, and exit matters).

What must hold: exact totals; no file for a process without GPU work; every failure (disabled,
no CUPTI, CUPTI taken, enable refused, unusable folder, bad settings) leaves the process running
with the census off and one clear log line; dropped and refused buffers are counted; a forked child
never writes its parent's segment; exit flushes what is still queued and marks the totals complete.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


PRELUDE = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, {tests!r})
    import cffi, cupti_records as cr
    mffi = cffi.FFI()
    mffi.cdef('''int mock_queue_record(const void *, uint32_t); void mock_set_dropped(size_t);
                int mock_enabled(int); int mock_enabled_globally(int); int mock_context_calls(void); int mock_context_calls_of(int); int mock_enabled_in(int, int); int mock_resource_call(uint32_t, int); int mock_registered(void); uint64_t mock_ext_top(void);
                int mock_hold_buffers(int); int mock_callback_enabled(int, uint32_t);
                int mock_api_call(int, uint32_t, uint32_t); int mock_api_call_nested(int, uint32_t, uint32_t, uint32_t);
                void mock_set_api_device(int); void mock_set_api_result(int); int cuptiGetTimestamp(uint64_t *);
                void mock_set_api_stream(uintptr_t);''')
    mock = mffi.dlopen({mock!r})
    gffi = cffi.FFI()
    gffi.cdef('''int InitializeInjection(void); int gc_active(void); int gc_step_begin(uint64_t);
                int gc_step_end(uint64_t *); int gc_flush(void); int gc_finish(void);
                const char *gc_segment_path(void);''')
    g = gffi.dlopen({lib!r})
    rffi, rlib = cr.records()
    def queue(rec, type_name):
        return mock.mock_queue_record(rffi.cast("void *", rec), rffi.sizeof(type_name))
    def path():
        return gffi.string(g.gc_segment_path()).decode()
    out = {{}}
""")


def run_case(native, mock_lib, tmp_path, body: str, env=None, expect_rc=0):
    census_dir = tmp_path / "census"
    e = dict(os.environ)
    e.update(OTEL_GPU_CENSUS_CUPTI=mock_lib, OTEL_GPU_CENSUS_DIR=str(census_dir),
             OTEL_GPU_CENSUS_FLUSH_MS="60000",  # the flusher sleeps: the test decides when to flush
             # the CUPTI path these cases were written for; the default (events where the library is preloaded) has
             # tests of its own
             OTEL_GPU_CENSUS_ACTIVITY="on")
    e.pop("OTEL_GPU_CENSUS_DISABLED", None)
    e.update(env or {})
    script = PRELUDE.format(tests=str(ROOT / "tests" / "support"), mock=mock_lib, lib=native[2]) + textwrap.dedent(body) + \
        "\nprint('RESULT ' + json.dumps(out))\n"
    p = subprocess.run([sys.executable, "-c", script], env=e, capture_output=True, text=True, timeout=60)
    assert p.returncode == expect_rc, p.stderr[-3000:]
    result = json.loads(next(l for l in p.stdout.splitlines() if l.startswith("RESULT "))[7:])
    return result, p.stderr, census_dir


def read(native, path):
    from otel_gpu_census.census.reader import read_segment
    return read_segment(str(path))


def test_counts_are_exact_and_exit_completes_them(native, mock_lib, tmp_path, records):
    res, err, d = run_case(native, mock_lib, tmp_path, """
        out['init'] = g.InitializeInjection()
        out['active'] = g.gc_active()
        out['kinds'] = [mock.mock_enabled(getattr(rlib, 'CUPTI_ACTIVITY_KIND_' + k)) for k in
                        ('CONCURRENT_KERNEL', 'MEMCPY', 'MEMCPY2', 'MEMSET', 'EXTERNAL_CORRELATION', 'KERNEL')]
        T = 1_700_000_000_000_000_000
        for i in range(1000):
            queue(cr.kernel(T + i * 1000, T + i * 1000 + 600), cr.KERNEL_T)
        queue(cr.memcpy('dtoh', 643 * 10**6, T + 2_000_000, T + 3_000_000, dst='pageable'), cr.MEMCPY_T)
        out['flush'] = g.gc_flush()
        out['path'] = path()
        # queued but never flushed by us: exit must deliver it
        queue(cr.memcpy('htod', 64 << 20, T + 4_000_000, T + 5_000_000, src='pinned'), cr.MEMCPY_T)
    """)
    assert res["init"] == 1 and res["active"] == 1 and res["flush"] == 0
    # never KERNEL (it serialises kernels); no EXTERNAL_CORRELATION (steps come from API callbacks)
    assert res["kinds"] == [1, 1, 1, 1, 0, 0]
    files = list(d.glob("*.seg"))
    assert [str(f) for f in files] == [res["path"]]
    p = read(native, files[0])
    dev = p.devices[0]
    assert p.state_name == "exited" and not p.torn
    assert dev.kernel_count == 1000 and dev.kernel_ns == 600_000
    assert dev.copies.get("dtoh", "pageable").bytes == 643 * 10**6
    assert dev.copies.get("htod", "pinned").bytes == 64 * MiB
    assert p.complete_wall_ns == 0 or p.complete_wall_ns >= p.wall_start_ns
    assert err == ""  # a healthy census says nothing


def test_no_gpu_work_leaves_no_file(native, mock_lib, tmp_path):
    res, err, d = run_case(native, mock_lib, tmp_path, """
        out['init'] = g.InitializeInjection()
        out['flush'] = g.gc_flush()
    """)
    assert res == {"init": 1, "flush": 0}
    assert not d.exists() or list(d.iterdir()) == []


@pytest.mark.parametrize("env,needle", [
    ({"OTEL_GPU_CENSUS_DISABLED": "1"}, None),
    ({"OTEL_GPU_CENSUS_CUPTI": "/nonexistent/libcupti.so.13"}, "census off: cannot load OTEL_GPU_CENSUS_CUPTI=/nonexistent"),
    ({"MOCK_CUPTI_CONFLICT": "1"}, "census off: another CUPTI client"),
    ({"MOCK_CUPTI_ENABLE_FAIL": "1"}, "census off: cannot enable activity kind"),
])
def test_census_steps_aside_and_the_process_carries_on(native, mock_lib, tmp_path, env, needle):
    res, err, d = run_case(native, mock_lib, tmp_path, """
        out['init'] = g.InitializeInjection()
        out['active'] = g.gc_active()
        out['step'] = g.gc_step_begin(5)
        out['flush'] = g.gc_flush()
        out['work_after'] = sum(range(1000))
    """, env=env)
    assert res["init"] == 1 and res["active"] == 0 and res["step"] == -1 and res["flush"] == -1
    assert res["work_after"] == 499500
    lines = [l for l in err.splitlines() if l.strip()]
    if needle is None:
        assert lines == []
    else:
        assert len(lines) == 1 and needle in lines[0] and lines[0].startswith("otel-gpu-census[")
    assert not d.exists() or list(d.glob("*.seg")) == []


def test_unusable_census_folder_turns_the_census_off_once(native, mock_lib, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    res, err, _ = run_case(native, mock_lib, tmp_path, """
        import time
        out['init'] = g.InitializeInjection()
        T = 1_700_000_000_000_000_000
        for i in range(3):
            queue(cr.kernel(T + i, T + i + 1), cr.KERNEL_T)
            out.setdefault('flush', []).append(g.gc_flush())
        out['active'] = g.gc_active()
        time.sleep(0.3)  # the flusher (20 ms) sees the failure and switches CUPTI's tracing off
        out['kernels_traced'] = mock.mock_enabled(rlib.CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL)
    """, env={"OTEL_GPU_CENSUS_DIR": str(blocker / "sub"), "OTEL_GPU_CENSUS_FLUSH_MS": "20"})
    assert res["init"] == 1 and res["active"] == 0 and res["kernels_traced"] == 0
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1 and "census off: cannot create census folder" in lines[0]


def test_group_writable_folder_is_refused(native, mock_lib, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    res, err, _ = run_case(native, mock_lib, tmp_path, """
        out['init'] = g.InitializeInjection()
        queue(cr.kernel(10**18, 10**18 + 5), cr.KERNEL_T)
        g.gc_flush()
        out['active'] = g.gc_active()
    """, env={"OTEL_GPU_CENSUS_DIR": str(shared)})
    assert res["active"] == 0 and "must belong to uid" in err and list(shared.iterdir()) == []


def test_dropped_records_and_refused_buffers_are_counted(native, mock_lib, tmp_path):
    res, err, d = run_case(native, mock_lib, tmp_path, """
        out['init'] = g.InitializeInjection()
        T = 1_700_000_000_000_000_000
        queue(cr.kernel(T, T + 10), cr.KERNEL_T)
        mock.mock_set_dropped(7)
        g.gc_flush()
        out['held'] = mock.mock_hold_buffers(10)   # CUPTI keeps buffers: the bound (2) refuses the rest
        queue(cr.kernel(T + 100, T + 110), cr.KERNEL_T)
        g.gc_flush()                                # no buffer left: CUPTI drops the record
    """, env={"OTEL_GPU_CENSUS_MAX_BUFFERS": "2", "OTEL_GPU_CENSUS_BUFFER_KB": "64"})
    assert res["held"] == 2
    p = read(native, next(d.glob("*.seg")))
    assert p.dropped >= 7 and p.buffers_refused >= 8 and p.flags & 0x2
    assert p.devices[0].kernel_count == 1


def test_bad_settings_are_ignored_with_a_line(native, mock_lib, tmp_path):
    res, err, _ = run_case(native, mock_lib, tmp_path, """
        out['init'] = g.InitializeInjection()
        out['active'] = g.gc_active()
    """, env={"OTEL_GPU_CENSUS_BUFFER_KB": "lots", "OTEL_GPU_CENSUS_MAX_BUFFERS": "-3"})
    assert res["active"] == 1
    assert "ignoring OTEL_GPU_CENSUS_BUFFER_KB=lots" in err and "ignoring OTEL_GPU_CENSUS_MAX_BUFFERS=-3" in err


def test_unknown_values_and_names_get_one_line_each_and_the_defaults(native, mock_lib, tmp_path, records):
    res, err, d = run_case(native, mock_lib, tmp_path, """
        out['init'] = g.InitializeInjection()
        out['active'] = g.gc_active()
        out['graph_trace'] = mock.mock_enabled(rlib.CUPTI_ACTIVITY_KIND_GRAPH_TRACE)
    """, env={"OTEL_GPU_CENSUS_GRAPHS": "xyz", "OTEL_GPU_CENSUS_CUPTI_API": "v9",
               "OTEL_GPU_CENSUS_KERNEL": "off", "OTEL_GPU_CENSUS_LIB": "/x.so"})
    # GRAPHS: the default, launch, needs the v2 API's callbacks; the mock is v1, so graphs go per node
    assert res["active"] == 1 and res["graph_trace"] == 0
    lines = err.strip().splitlines()
    assert len(lines) == 3, err
    assert "ignoring OTEL_GPU_CENSUS_GRAPHS=xyz (expected launch or node); using launch" in err
    assert "ignoring OTEL_GPU_CENSUS_CUPTI_API=v9 (expected v2 or v1); using v2" in err
    assert "ignoring unknown setting OTEL_GPU_CENSUS_KERNEL" in err   # a typo of KERNELS; LIB is the reader's


STEP_CALLS = """
        import threading
        RT, DRV = 0, 1
        LAUNCH, COPY, GRAPH = (getattr(rlib, 'CUPTI_RUNTIME_TRACE_CBID_' + n) for n in
                               ('cudaLaunchKernel_v7000', 'cudaMemcpyAsync_v3020', 'cudaGraphLaunch_v10000'))
        T = 1_700_000_000_000_000_000
        def launch_kernel(corr, cbid=LAUNCH, dom=RT, n=1):
            called = mock.mock_api_call(dom, cbid, corr)
            for i in range(n):   # a graph launch: every node's record shares the launch's correlation id
                queue(cr.kernel(T + corr * 10_000 + i * 100, T + corr * 10_000 + i * 100 + 50, corr=corr), cr.KERNEL_T)
            return called
"""


def test_steps_tag_the_work_each_thread_launches_through_api_callbacks(native, mock_lib, tmp_path, records):
    res, err, d = run_case(native, mock_lib, tmp_path, STEP_CALLS + """
        g.InitializeInjection()
        out['before'] = mock.mock_callback_enabled(RT, LAUNCH)   # nothing to pay until a step begins
        launch_kernel(1)                                          # before any step: not a step's
        out['begin'] = g.gc_step_begin(42)
        out['enabled'] = [mock.mock_callback_enabled(RT, c) for c in (LAUNCH, COPY, GRAPH)] + [
            mock.mock_callback_enabled(DRV, rlib.CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel)]
        out['not_enabled'] = [mock.mock_callback_enabled(RT, rlib.CUPTI_RUNTIME_TRACE_CBID_cudaGetDevice_v3020),
                              mock.mock_callback_enabled(RT, rlib.CUPTI_RUNTIME_TRACE_CBID_cudaGraphAddMemcpyNode_v10000),
                              mock.mock_callback_enabled(DRV, rlib.CUPTI_DRIVER_TRACE_CBID_cuCtxGetCurrent)]
        launch_kernel(2)
        launch_kernel(3, cbid=GRAPH, n=5)                         # a graph of 5 kernels
        launch_kernel(4, cbid=rlib.CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel, dom=DRV)   # Triton: driver API
        mock.mock_api_call(RT, COPY, 5)
        queue(cr.memcpy('dtoh', 4000, T + 60_000, T + 61_000, dst='pinned', corr=5), cr.MEMCPY_T)
        def other():   # another thread's step, while 42 is open on this one
            g.gc_step_begin(7)
            launch_kernel(6)
            g.gc_step_end(gffi.NULL)
        th = threading.Thread(target=other); th.start(); th.join()
        out['nested'] = g.gc_step_begin(43)
        launch_kernel(8)
        got = gffi.new('uint64_t *')
        out['end_inner'] = (g.gc_step_end(got), got[0])
        launch_kernel(9)                                          # back in 42
        out['end_outer'] = (g.gc_step_end(got), got[0])
        out['end_again'] = g.gc_step_end(got)                     # nothing open
        launch_kernel(10)                                         # after: not a step's
        out['bad'] = [g.gc_step_begin(0), g.gc_step_begin(1 << 32)]
        g.gc_flush()
        out['path'] = path()
    """)
    assert res["before"] == 0 and res["begin"] == 0
    assert res["enabled"] == [1, 1, 1, 1] and res["not_enabled"] == [0, 0, 0]
    assert res["nested"] == 0 and res["end_inner"] == [0, 43] and res["end_outer"] == [0, 42]
    assert res["end_again"] == -1 and res["bad"] == [-1, -1]
    p = read(native, res["path"])
    assert set(p.steps) == {42, 7, 43}
    s42, s7, s43 = p.steps[42], p.steps[7], p.steps[43]
    assert s42.kernel_count == 1 + 5 + 1 + 1 and s42.kernel_ns == 8 * 50      # corr 2, graph 3, 4, 9
    assert s42.copies["dtoh"].bytes == 4000 and s42.copies["dtoh"].count == 1
    assert s7.kernel_count == 1 and s43.kernel_count == 1
    assert p.step_unmatched == 2 and p.step_max == 43                         # corr 1 and 10
    assert p.devices[0].kernel_count == 11 + 1                                  # totals count everything
    assert err == ""


def test_steps_off_when_cuptis_one_slot_is_taken_and_the_census_counts_on(native, mock_lib, tmp_path, records):
    res, err, d = run_case(native, mock_lib, tmp_path, STEP_CALLS + """
        g.InitializeInjection()
        out['begin'] = [g.gc_step_begin(5), g.gc_step_begin(6)]
        out['end'] = g.gc_step_end(gffi.NULL)
        launch_kernel(1)
        g.gc_flush()
        out['active'] = g.gc_active()
    """, env={"MOCK_CUPTI_SLOT_TAKEN": "1"})
    assert res == {"begin": [-1, -1], "end": -1, "active": 1}
    assert err.count("steps off: cannot subscribe to CUPTI callbacks") == 1 and err.count("\n") == 1
    p = read(native, next(d.glob("*.seg")))
    assert p.devices[0].kernel_count == 1 and p.steps == {}


def test_finish_completes_the_census_before_exit_and_stops_paying_cupti(native, mock_lib, tmp_path, records):
    res, err, d = run_case(native, mock_lib, tmp_path, STEP_CALLS + """
        g.InitializeInjection()
        launch_kernel(1)
        out['finish'] = g.gc_finish()
        out['again'] = g.gc_finish()
        out['active'] = g.gc_active()
        out['kernels_enabled'] = mock.mock_enabled(rlib.CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL)
        out['path'] = path()
        p = __import__('otel_gpu_census.census.reader', fromlist=['x']).read_segment(out['path'])
        out['state'] = p.state_name
        out['kernels'] = p.devices[0].kernel_count
    """)
    assert res["finish"] == 0 and res["again"] == -1 and res["active"] == 0
    assert res["kernels_enabled"] == 0 and res["state"] == "exited" and res["kernels"] == 1
    assert err == ""


def test_exit_while_the_flusher_runs_completes_the_totals(native, mock_lib, tmp_path, records):
    """A 10 ms flusher racing the exit: the exit waits for it, then flushes once more; nothing lost."""
    res, err, d = run_case(native, mock_lib, tmp_path, """
        import time
        g.InitializeInjection()
        T = 1_700_000_000_000_000_000
        for i in range(2000):
            queue(cr.kernel(T + i * 100, T + i * 100 + 50), cr.KERNEL_T)
            if i % 100 == 0:
                time.sleep(0.002)
        time.sleep(0.05)
        out['complete'] = 1
    """, env={"OTEL_GPU_CENSUS_FLUSH_MS": "10"})
    p = read(native, next(d.glob("*.seg")))
    assert p.state_name == "exited" and p.devices[0].kernel_count == 2000 and err == ""
    assert p.complete_wall_ns >= p.wall_start_ns > 0


def test_forked_child_never_writes_the_parents_segment(native, mock_lib, tmp_path):
    res, err, d = run_case(native, mock_lib, tmp_path, """
        g.InitializeInjection()
        T = 1_700_000_000_000_000_000
        queue(cr.kernel(T, T + 10), cr.KERNEL_T)
        g.gc_flush()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            queue(cr.kernel(T + 50, T + 60), cr.KERNEL_T)
            msg = json.dumps({'active': g.gc_active(), 'flush': g.gc_flush(), 'path': path()})
            os.write(w, msg.encode())
            sys.exit(0)                       # runs atexit handlers in the child
        os.close(w)
        child = json.loads(os.read(r, 4096))
        os.waitpid(pid, 0)
        out['child'] = child
        queue(cr.kernel(T + 100, T + 110), cr.KERNEL_T)
        g.gc_flush()
    """)
    assert res["child"] == {"active": 0, "flush": -1, "path": ""}
    segs = list(d.glob("*.seg"))
    assert len(segs) == 1
    p = read(native, segs[0])
    assert p.devices[0].kernel_count == 2 and p.state_name == "exited"  # the parent's two, not the child's


def test_control_file_pauses_and_resumes_a_running_census(native, mock_lib, tmp_path, records):
    """<segment>.control switches a running census: census=off disables every activity kind (the server
    pays CUPTI nothing more), census=on enables them again; the segment says how long it was paused.
    Words other than census=on|off|finish are refused with one line."""
    res, err, d = run_case(native, mock_lib, tmp_path, """
        import time
        T = 1_700_000_000_000_000_000
        kinds = lambda: [mock.mock_enabled(getattr(rlib, 'CUPTI_ACTIVITY_KIND_' + k))
                         for k in ('CONCURRENT_KERNEL', 'MEMCPY', 'MEMCPY2', 'MEMSET')]
        g.InitializeInjection()
        queue(cr.kernel(T, T + 600), cr.KERNEL_T)
        g.gc_flush()
        ctl = path()[:-4] + '.control'
        def wait_for(want):
            for _ in range(200):
                if kinds() == want:
                    return True
                time.sleep(0.01)
            return False
        open(ctl, 'w').write('census=off graphs=launch\\n')
        out['paused'] = wait_for([0, 0, 0, 0])
        time.sleep(0.2)
        open(ctl, 'w').write('census=on\\n')
        out['resumed'] = wait_for([1, 1, 1, 1])
    """, env={"OTEL_GPU_CENSUS_FLUSH_MS": "20"})
    assert res["paused"] and res["resumed"], res
    p = read(native, next(d.glob("*.seg")))
    assert not p.graphs.paused and 0.15e9 < p.graphs.paused_ns < 5e9, p.graphs
    assert err.count("\n") == 1 and 'ignoring "graphs=launch" (census=on|off|finish)' in err, err


def test_the_integrations_settle_setting_is_known_to_the_injector(native, mock_lib, tmp_path, records):
    """OTEL_GPU_CENSUS_SETTLE is the engine integrations' (Python); every CUDA process of an engine sees
    it, and the injector must not call it unknown in each of them."""
    res, err, d = run_case(native, mock_lib, tmp_path, """
        out['init'] = g.InitializeInjection()
    """, env={"OTEL_GPU_CENSUS_SETTLE": "thread", "OTEL_GPU_CENSUS_NOSUCH": "1"})
    assert res == {"init": 1} and "SETTLE" not in err and "ignoring unknown setting OTEL_GPU_CENSUS_NOSUCH" in err


def test_a_control_file_that_is_a_link_or_a_fifo_is_not_read(native, mock_lib, tmp_path, records):
    res, err, d = run_case(native, mock_lib, tmp_path, """
        import time
        T = 1_700_000_000_000_000_000
        g.InitializeInjection()
        queue(cr.kernel(T, T + 600), cr.KERNEL_T)
        g.gc_flush()
        ctl = path()[:-4] + '.control'
        target = os.path.join(os.path.dirname(ctl), 'elsewhere')
        open(target, 'w').write('census=off')
        os.symlink(target, ctl)
        time.sleep(0.2)
        out['after_link'] = mock.mock_enabled(rlib.CUPTI_ACTIVITY_KIND_MEMCPY)
        os.unlink(ctl)
        os.mkfifo(ctl)
        time.sleep(0.2)
        out['after_fifo'] = mock.mock_enabled(rlib.CUPTI_ACTIVITY_KIND_MEMCPY)
        out['active'] = g.gc_active()
    """, env={"OTEL_GPU_CENSUS_FLUSH_MS": "20"})
    assert res == {"after_link": 1, "after_fifo": 1, "active": 1} and err == ""


def test_census_finish_in_the_control_file_runs_the_final_flush_on_the_flusher(native, mock_lib, tmp_path, records):
    """census=finish: the final flush now, by the flusher thread (it answers when the process's own
    threads do not: a vLLM engine about to be killed), then the census is over: every kind off, records
    after it not counted, the segment exited with the totals of before; the process runs on."""
    res, err, d = run_case(native, mock_lib, tmp_path, """
        import time
        from otel_gpu_census.census.reader import read_segment
        T = 1_700_000_000_000_000_000
        g.InitializeInjection()
        queue(cr.memcpy('dtoh', 4096, T, T + 10, dst='pinned'), cr.MEMCPY_T)
        g.gc_flush()
        queue(cr.memcpy('dtoh', 1000, T + 20, T + 30, dst='pinned'), cr.MEMCPY_T)   # queued, not yet handed back
        open(path()[:-4] + '.control', 'w').write('census=finish\\n')
        for _ in range(300):
            if read_segment(path(), detail=False).state_name == 'exited':
                break
            time.sleep(0.01)
        out['state'] = read_segment(path(), detail=False).state_name
        out['active'] = g.gc_active()
        out['kinds'] = [mock.mock_enabled(getattr(rlib, 'CUPTI_ACTIVITY_KIND_' + k))
                        for k in ('CONCURRENT_KERNEL', 'MEMCPY', 'MEMCPY2', 'MEMSET')]
        queue(cr.memcpy('dtoh', 7, T + 40, T + 50, dst='pinned'), cr.MEMCPY_T)
        out['finish_again'] = g.gc_finish()
    """, env={"OTEL_GPU_CENSUS_FLUSH_MS": "20"})
    assert res == {"state": "exited", "active": 0, "kinds": [0, 0, 0, 0], "finish_again": -1}, res
    p = read(native, next(d.glob("*.seg")))
    assert p.state_name == "exited" and p.devices[0].copies.get("dtoh").bytes == 4096 + 1000
    assert err == ""


# The mock libcuda.so.1 (native/tests/mock_cuda.c) stands in for the driver the injector asks about contexts and
# devices; the mock libcupti keeps no record of a kind not enabled when it is queued, as CUPTI records no work it was
# not attached for.
CUDA_PRELUDE = """
        cffi_cuda = cffi.FFI()
        cffi_cuda.cdef('void mock_cuda_set_active(int); int mock_cuda_polls(void);')
        cuda = cffi_cuda.dlopen({mock_cuda!r}, cffi_cuda.RTLD_GLOBAL | cffi_cuda.RTLD_NOW)
        import time
        def wait_active(timeout=5.0):
            t0 = time.time()
            while not g.gc_active() and time.time() - t0 < timeout:
                time.sleep(0.001)
            return g.gc_active()
        T = 1_700_000_000_000_000_000
"""


def run_with_driver(native, mock_lib, mock_cuda, tmp_path, body: str, env=None):
    """run_case in a process whose libcuda.so.1 is the mock driver."""
    return run_case(native, mock_lib, tmp_path, CUDA_PRELUDE.format(mock_cuda=mock_cuda) + body, env=env)


# ---- when CUPTI is set up: inside cuInit --------------------------------------------------------
def test_the_precise_census_counts_from_cuinit_by_default(native, mock_lib, mock_cuda, tmp_path):
    """CUPTI asked for without an attach setting is set up inside cuInit: work before the first context's
    activation is counted (nothing between the first CUDA call and the census goes unseen)."""
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, """
        out['init'] = g.InitializeInjection()
        out['now'] = [g.gc_active(), mock.mock_registered()]
        queue(cr.memcpy('htod', 12_000_000, T, T + 10, src='pageable'), cr.MEMCPY_T)
        out['flush'] = g.gc_flush()
    """, env={"OTEL_GPU_CENSUS_GRAPHS": "node"})
    assert res == {"init": 1, "now": [1, 1], "flush": 0}, err
    p = read(native, next(d.glob("*.seg")))
    assert p.attach.name == "cuinit" and p.devices[0].copies.get("htod", "pageable").bytes == 12_000_000


def test_the_default_census_without_the_library_preloaded_says_it_takes_cupti(native, mock_lib, tmp_path):
    """The default (events) needs the library preloaded; started by CUDA_INJECTION64_PATH alone the injector says
    so in one line and counts through CUPTI, exact, rather than silently not at all."""
    res, err, d = run_case(native, mock_lib, tmp_path, """
        out['init'] = g.InitializeInjection()
        out['active'] = g.gc_active()
    """, env={"OTEL_GPU_CENSUS_ACTIVITY": ""})
    assert res == {"init": 1, "active": 1}
    assert err.count("needs the census library preloaded") == 1, err


# For a body that switches its census through the control file: switch(text, paused) writes it and waits
# until the segment shows the pause state; it first waits for the flusher to make the segment (and so
# the control file's name).
CONTROL_SWITCH = """
        from otel_gpu_census.census.reader import read_segment
        def readable():
            try:
                return read_segment(path(), detail=False)
            except Exception:            # not made yet, or made and not yet initialised
                return None
        def switch(text, paused):
            for _ in range(300):
                if path() and readable():
                    break
                time.sleep(0.01)
            open(path()[:-4] + '.control', 'w').write(text)
            for _ in range(300):
                if read_segment(path(), detail=False).graphs.paused == paused:
                    return True
                time.sleep(0.01)
"""
