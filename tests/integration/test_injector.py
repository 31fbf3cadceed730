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
             OTEL_GPU_CENSUS_KERNELS="all",      # counts from records; counted launches have tests of their own
             # the CUPTI path, set up once the first context is active, as these cases were written for; the defaults
             # (events where the library is preloaded, CUPTI from cuInit) have tests of their own
             OTEL_GPU_CENSUS_ACTIVITY="on", OTEL_GPU_CENSUS_ATTACH="context")
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


# ---- kernel sampling (OTEL_GPU_CENSUS_KERNELS) ----

WATCH_PHASES = """
    import time
    g.InitializeInjection()
    # the server makes its context (device 0's), which the census learns where it follows contexts
    mock.mock_resource_call(1, 1)   # CUPTI_CBID_RESOURCE_CONTEXT_CREATED (cupti_callbacks.h), context 1
    K, M = rlib.CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, rlib.CUPTI_ACTIVITY_KIND_MEMCPY
    t0 = time.monotonic()
    samples = []
    while time.monotonic() - t0 < {seconds}:
        samples.append((round(time.monotonic() - t0, 4), mock.mock_enabled(K), mock.mock_enabled(M)))
        time.sleep(0.002)
    out['samples'] = samples
    T = 1_700_000_000_000_000_000
    out['copy_queued'] = queue(cr.memcpy('dtoh', 4096, T, T + 10, dst='pageable'), cr.MEMCPY_T)
"""


def test_sampled_kernels_follow_the_schedule_and_copies_stay_on(native, mock_lib, tmp_path, records):
    """40 ms of every 100 ms: the kernel kind goes on and off on time; the copy kinds never go off;
    the segment says which schedule ran and how long kernels were traced."""
    res, err, d = run_case(native, mock_lib, tmp_path, WATCH_PHASES.format(seconds=1.0),
                           env={"OTEL_GPU_CENSUS_KERNELS": "40/100"})
    samples = res["samples"]
    on = [k for _, k, _ in samples]
    assert all(m == 1 for _, _, m in samples)
    changes = sum(1 for a, b in zip(on, on[1:]) if a != b)
    assert 16 <= changes <= 22, changes           # ~10 periods, two switches each
    share = sum(on) / len(on)
    assert 0.3 < share < 0.5, share
    p = read(native, next(d.glob("*.seg")))
    k = p.kernels
    assert (k.mode, k.on_ms, k.period_ms, k.name) == (1, 40, 100, "40/100") and err == ""
    assert p.devices[0].copies.get("dtoh").bytes == 4096       # copies are exact whatever the phase
    alive_ns = p.complete_wall_ns - p.wall_start_ns
    assert 0.3 * alive_ns < k.traced_ns < 0.5 * alive_ns, (k.traced_ns, alive_ns)
    assert k.origin_gpu_ns >= 1_700_000_000_000_000_000


def test_kernels_off_never_enables_the_kernel_kind(native, mock_lib, tmp_path, records):
    res, err, d = run_case(native, mock_lib, tmp_path, WATCH_PHASES.format(seconds=0.2),
                           env={"OTEL_GPU_CENSUS_KERNELS": "off"})
    assert {k for _, k, _ in res["samples"]} == {0} and {m for _, _, m in res["samples"]} == {1}
    p = read(native, next(d.glob("*.seg")))
    assert (p.kernels.mode, p.kernels.name, p.kernels.fraction) == (2, "off", 0.0) and err == ""
    assert p.devices[0].copies.get("dtoh").bytes == 4096 and p.devices[0].kernel_count == 0


@pytest.mark.parametrize("value", ["30/100", "100/100", "0/100", "40", "40/", "a/b", "40/100x", "20/7200000",
                                   "counted:", "counted:30/100", "counted:100", "Counted"])
def test_bad_kernel_settings_take_the_default_with_one_line(native, mock_lib, mock_cuda, tmp_path, records, value):
    """The default: every kernel counted, kernel records for the first 100 ms of every second."""
    body = textwrap.indent(textwrap.dedent(WATCH_PHASES.format(seconds=0.3)), " " * 8)   # CUDA_PRELUDE's indent
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, body,
                                  env={"OTEL_GPU_CENSUS_KERNELS": value, "OTEL_GPU_CENSUS_ATTACH": "cuinit"})
    on = [(t, k) for t, k, _ in res["samples"]]
    assert on[0][1] == 1 and all(k == 0 for t, k in on if t > 0.15), on
    assert err.count("\n") == 1 and f"ignoring OTEL_GPU_CENSUS_KERNELS={value}" in err
    assert read(native, next(d.glob("*.seg"))).kernels.name == "counted:100/1000"


def test_control_file_pauses_and_resumes_a_running_census(native, mock_lib, tmp_path, records):
    """<segment>.control switches a running census: census=off disables every activity kind (the server
    pays CUPTI nothing more), census=on enables them again; the segment says how long it was paused.
    graphs=launch needs the v2 API's callbacks (the mock is v1): refused with one line."""
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
    assert p.graphs.name == "node"          # v1: graphs per node, whatever the file asked
    assert err.count("\n") == 1 and 'ignoring "graphs=launch"' in err, err


def test_a_census_started_paused_traces_nothing_until_its_control_file_says_on(native, mock_lib, tmp_path, records):
    """OTEL_GPU_CENSUS_START=paused: each kind is checked with CUPTI at start and left off; the flusher
    makes the segment without any record (its control file needs the name); census=on enables the
    kinds and what runs after is counted; the segment says how long it was paused."""
    res, err, d = run_case(native, mock_lib, tmp_path, """
        import time
        T = 1_700_000_000_000_000_000
        kinds = lambda: [mock.mock_enabled(getattr(rlib, 'CUPTI_ACTIVITY_KIND_' + k))
                         for k in ('CONCURRENT_KERNEL', 'MEMCPY', 'MEMCPY2', 'MEMSET')]
        out['init'] = g.InitializeInjection()
        out['at_start'] = kinds()
        for _ in range(300):
            if path():
                break
            time.sleep(0.01)
        out['segment_without_records'] = bool(path())
        time.sleep(0.15)
        out['still_off'] = kinds()
        open(path()[:-4] + '.control', 'w').write('census=on\\n')
        for _ in range(300):
            if kinds() == [1, 1, 1, 1]:
                break
            time.sleep(0.01)
        out['resumed'] = kinds()
        queue(cr.kernel(T, T + 600), cr.KERNEL_T)
        queue(cr.memcpy('dtoh', 4096, T + 1000, T + 2000, dst='pinned'), cr.MEMCPY_T)
        g.gc_flush()
    """, env={"OTEL_GPU_CENSUS_START": "paused", "OTEL_GPU_CENSUS_FLUSH_MS": "20"})
    assert res["init"] == 1 and res["at_start"] == [0, 0, 0, 0] and res["still_off"] == [0, 0, 0, 0]
    assert res["segment_without_records"] and res["resumed"] == [1, 1, 1, 1] and err == "", err
    p = read(native, next(d.glob("*.seg")))
    assert not p.graphs.paused and 0.1e9 < p.graphs.paused_ns < 10e9, p.graphs
    assert p.devices[0].kernel_count == 1 and p.devices[0].copies.get("dtoh", "pinned").bytes == 4096


def test_an_unknown_start_setting_starts_the_census_on_with_one_line(native, mock_lib, tmp_path, records):
    res, err, d = run_case(native, mock_lib, tmp_path, """
        out['init'] = g.InitializeInjection()
        out['kernels'] = mock.mock_enabled(rlib.CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL)
    """, env={"OTEL_GPU_CENSUS_START": "later"})
    assert res == {"init": 1, "kernels": 1}
    assert err.count("\n") == 1 and "ignoring OTEL_GPU_CENSUS_START=later (expected on or paused)" in err


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


def test_control_file_switches_kernel_tracing_of_a_running_census(native, mock_lib, tmp_path, records):
    """kernels=off|ON/PERIOD|all in the control file switch kernel tracing as OTEL_GPU_CENSUS_KERNELS would
    have from the start: off takes only the kernel kind away (copies stay on); a schedule toggles it on
    time; a pause keeps it off whatever the schedule says; all puts it back for good. The segment says
    which mode is in force, and traced time accrues only while the kernel kind was on."""
    res, err, d = run_case(native, mock_lib, tmp_path, """
        import time
        from otel_gpu_census.census.reader import read_segment
        T = 1_700_000_000_000_000_000
        K, M = rlib.CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, rlib.CUPTI_ACTIVITY_KIND_MEMCPY
        g.InitializeInjection()
        queue(cr.kernel(T, T + 600), cr.KERNEL_T)
        g.gc_flush()
        ctl = path()[:-4] + '.control'
        def watch(seconds):
            t0, s = time.monotonic(), []
            while time.monotonic() - t0 < seconds:
                s.append((mock.mock_enabled(K), mock.mock_enabled(M)))
                time.sleep(0.002)
            return s
        def mode():
            c = read_segment(path(), detail=False)
            return c.kernels.name, c.graphs.paused
        def switch(text, want_mode, seconds, paused=False):
            open(ctl, 'w').write(text)
            for _ in range(300):
                if mode() == (want_mode, paused):
                    break
                time.sleep(0.01)
            return [mode()[0], watch(seconds)]
        out['off'] = switch('kernels=off\\n', 'off', 0.3)
        out['sampled'] = switch('kernels=40/100\\n', '40/100', 1.0)
        out['paused'] = switch('census=off kernels=40/100\\n', '40/100', 0.4, paused=True)
        out['bad'] = switch('census=on kernels=30/100\\n', '40/100', 0.3)
        out['all'] = switch('census=on kernels=all\\n', 'all', 0.3)
    """, env={"OTEL_GPU_CENSUS_FLUSH_MS": "20"})
    name, s = res["off"]
    assert name == "off" and {k for k, _ in s} == {0} and {m for _, m in s} == {1}
    name, s = res["sampled"]
    on = [k for k, _ in s]
    assert name == "40/100" and {m for _, m in s} == {1}
    assert 14 <= sum(1 for a, b in zip(on, on[1:]) if a != b) <= 22 and 0.3 < sum(on) / len(on) < 0.5
    name, s = res["paused"]
    assert set(map(tuple, s)) == {(0, 0)}                    # paused: nothing on, the schedule neither
    name, s = res["bad"]                                     # 30 ms is not a multiple of the 20 ms window
    assert name == "40/100" and {m for _, m in s} == {1} and 0 < sum(k for k, _ in s) < len(s)
    name, s = res["all"]
    assert name == "all" and set(map(tuple, s)) == {(1, 1)}
    assert err.count("\n") == 1 and 'ignoring "kernels=30/100"' in err, err
    p = read(native, next(d.glob("*.seg")))
    alive = p.complete_wall_ns - p.wall_start_ns
    # on: before off, ~40 % of the sampled second and of the bad 0.3 s, all of the last 0.3 s
    assert 0.2e9 < p.kernels.traced_ns < alive - 0.5e9, (p.kernels.traced_ns, alive)
    assert p.kernels.tracing and p.kernels.mode == 0


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


# ---- when CUPTI is set up (OTEL_GPU_CENSUS_ATTACH) ----------------------------------------------
# By default the injector sets CUPTI up only once a primary context is active (set up before, CUPTI
# makes that context's graph replays slower: docs/measurements.md §15). A mock libcuda.so.1 stands in
# for the driver the watch polls; the mock libcupti keeps no record of a kind not enabled when it is
# queued, as CUPTI records no work it was not attached for.

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
    """run_case in a process whose libcuda.so.1 is the mock driver (its one context off until the body
    switches it on)."""
    return run_case(native, mock_lib, tmp_path, CUDA_PRELUDE.format(mock_cuda=mock_cuda) + body, env=env)


def test_attach_waits_for_the_first_context_and_counts_from_there(native, mock_lib, mock_cuda, tmp_path):
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, """
        out['init'] = g.InitializeInjection()
        time.sleep(0.05)
        out['waiting'] = [g.gc_active(), mock.mock_registered(), g.gc_step_begin(3)]
        # work before the attach: CUPTI is not set up, so nothing records it
        out['before'] = queue(cr.memcpy('htod', 1000, T, T + 10), cr.MEMCPY_T)
        out['polls_before'] = cuda.mock_cuda_polls()
        t_on = time.time_ns()
        cuda.mock_cuda_set_active(1)
        out['active'] = wait_active()
        out['attach_s'] = (time.time_ns() - t_on) / 1e9
        out['registered'] = mock.mock_registered()
        queue(cr.memcpy('dtoh', 643 * 10**6, T + 100, T + 200, dst='pageable'), cr.MEMCPY_T)
        out['flush'] = g.gc_flush()
        out['t_on'] = t_on
    """, env={"OTEL_GPU_CENSUS_GRAPHS": "node"})
    assert res["init"] == 1
    assert res["waiting"] == [0, 0, -1]      # loaded, not attached: no CUPTI, no steps
    assert res["polls_before"] > 0
    assert res["active"] == 1 and res["registered"] == 1 and res["flush"] == 0
    assert res["attach_s"] < 1.0             # polled every 100 us at first
    p = read(native, next(d.glob("*.seg")))
    dev = p.devices[0]
    assert dev.copies.get("dtoh", "pageable").bytes == 643 * 10**6
    assert dev.copies.get("htod", "pageable").bytes == 0 and dev.copies.get("htod", "pinned").bytes == 0
    assert p.attach.name == "context"
    assert p.wall_start_ns < res["t_on"] <= p.attach.wall_ns
    assert 100_000 <= p.attach.after_ns < 1_000_000_000   # the poll interval at least
    assert p.state_name == "exited"
    assert err == ""


def test_set_up_on_a_live_context_has_the_stack_cupti_needs(native, mock_lib, mock_cuda, tmp_path):
    """The flusher thread sets CUPTI up once a context is active; CUPTI and the driver then use deep
    stacks (llama-server segfaulted in libcuda on the H200 with the flusher's old 256 KiB stack). The
    mock's set-up uses 4 MiB of stack here: the process attaches, counts and exits."""
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, """
        out['init'] = g.InitializeInjection()
        cuda.mock_cuda_set_active(1)
        out['active'] = wait_active()
        queue(cr.memcpy('dtoh', 67108864, T, T + 10, dst='pinned'), cr.MEMCPY_T)
        out['flush'] = g.gc_flush()
    """, env={"MOCK_CUPTI_STACK_KB": "4096"})
    assert res == {"init": 1, "active": 1, "flush": 0}
    p = read(native, next(d.glob("*.seg")))
    assert p.devices[0].copies.get("dtoh", "pinned").bytes == 67108864
    assert p.attach.name == "context" and p.state_name == "exited"


def test_a_process_that_never_makes_a_context_exits_untouched(native, mock_lib, mock_cuda, tmp_path):
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, """
        out['init'] = g.InitializeInjection()
        time.sleep(0.2)
        out['state'] = [g.gc_active(), mock.mock_registered(), g.gc_flush()]
        out['polls'] = cuda.mock_cuda_polls()
    """)
    assert res["init"] == 1 and res["state"] == [0, 0, -1]
    assert res["polls"] >= 20                # the watch runs (100 us ticks) ...
    assert not d.exists() or list(d.iterdir()) == []   # ... and exit stops it: no file, no line
    assert err == ""


def test_finish_before_any_context_stops_the_watch(native, mock_lib, mock_cuda, tmp_path):
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, """
        out['init'] = g.InitializeInjection()
        out['finish'] = g.gc_finish()
        cuda.mock_cuda_set_active(1)
        time.sleep(0.1)
        out['after'] = [g.gc_active(), mock.mock_registered()]
    """)
    assert res == {"init": 1, "finish": 0, "after": [0, 0]}
    assert err == ""


def test_attach_cuinit_sets_cupti_up_inside_cuinit(native, mock_lib, mock_cuda, tmp_path):
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, """
        out['init'] = g.InitializeInjection()
        out['now'] = [g.gc_active(), mock.mock_registered()]
        queue(cr.memcpy('htod', 4096, T, T + 10, src='pinned'), cr.MEMCPY_T)
        out['flush'] = g.gc_flush()
        out['polls'] = cuda.mock_cuda_polls()
    """, env={"OTEL_GPU_CENSUS_ATTACH": "cuinit", "OTEL_GPU_CENSUS_GRAPHS": "node"})
    assert res["now"] == [1, 1] and res["polls"] == 0
    p = read(native, next(d.glob("*.seg")))
    assert p.devices[0].copies.get("htod", "pinned").bytes == 4096
    assert p.attach.name == "cuinit" and p.attach.after_ns == 0 and p.attach.wall_ns >= p.wall_start_ns
    assert err == ""


def test_a_bad_attach_setting_gets_a_line_and_the_default(native, mock_lib, mock_cuda, tmp_path):
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, """
        out['init'] = g.InitializeInjection()
        out['now'] = g.gc_active()
        cuda.mock_cuda_set_active(1)
        out['active'] = wait_active()
    """, env={"OTEL_GPU_CENSUS_ATTACH": "later", "OTEL_GPU_CENSUS_GRAPHS": "node"})
    assert res == {"init": 1, "now": 1, "active": 1}        # the default: CUPTI set up in cuInit
    assert "ignoring OTEL_GPU_CENSUS_ATTACH=later (expected cuinit or context); using cuinit" in err


def test_the_precise_census_counts_from_cuinit_by_default(native, mock_lib, mock_cuda, tmp_path):
    """CUPTI asked for without an attach setting is set up inside cuInit: work before the first context's
    activation is counted (nothing between the first CUDA call and the census goes unseen)."""
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, """
        out['init'] = g.InitializeInjection()
        out['now'] = [g.gc_active(), mock.mock_registered()]
        queue(cr.memcpy('htod', 12_000_000, T, T + 10, src='pageable'), cr.MEMCPY_T)
        out['flush'] = g.gc_flush()
    """, env={"OTEL_GPU_CENSUS_ATTACH": "", "OTEL_GPU_CENSUS_GRAPHS": "node"})
    assert res == {"init": 1, "now": [1, 1], "flush": 0}, err
    p = read(native, next(d.glob("*.seg")))
    assert p.attach.name == "cuinit" and p.devices[0].copies.get("htod", "pageable").bytes == 12_000_000


def test_the_default_census_without_the_library_preloaded_says_it_takes_cupti(native, mock_lib, tmp_path):
    """The default (events) needs the library preloaded; started by CUDA_INJECTION64_PATH alone the injector says
    so in one line and counts through CUPTI, exact, rather than silently not at all."""
    res, err, d = run_case(native, mock_lib, tmp_path, """
        out['init'] = g.InitializeInjection()
        out['active'] = g.gc_active()
    """, env={"OTEL_GPU_CENSUS_ACTIVITY": "", "OTEL_GPU_CENSUS_ATTACH": ""})
    assert res == {"init": 1, "active": 1}
    assert err.count("needs the census library preloaded") == 1, err


# ---- counted kernels (OTEL_GPU_CENSUS_KERNELS=counted, the default) ----
# Counting needs graphs counted per launch (graphs.c), which needs a driver's graph queries: these run
# with the mock driver, set up in cuInit.

COUNTED_CALLS = """
        import threading, time
        RT, DRV = 0, 1
        RT_LAUNCH = rlib.CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_v7000
        DRV_LAUNCH, DRV_LAUNCH_EX = rlib.CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel, rlib.CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx
        HOST_FUNC = (rlib.CUPTI_RUNTIME_TRACE_CBID_cudaLaunchHostFunc_v10000, rlib.CUPTI_DRIVER_TRACE_CBID_cuLaunchHostFunc)
        def now():
            t = mffi.new('uint64_t *')
            mock.cuptiGetTimestamp(t)
            return t[0]
        def torch_launch(n=1):       # cudaLaunchKernel, with the driver's cuLaunchKernel inside it
            for _ in range(n):
                mock.mock_api_call_nested(RT, RT_LAUNCH, 1, DRV_LAUNCH)
        mock.mock_set_api_device(1)  # device 0's context
"""


def test_counted_kernels_count_every_launch_once_and_sample_their_records(native, mock_lib, mock_cuda, tmp_path, records):
    """Every successful kernel launch counts once, whichever API it came through and whether the driver
    reports the runtime's inner call; failed launches and host functions do not count; records give
    time only. Windows hold the launches at the time they were made."""
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, COUNTED_CALLS + """
        g.InitializeInjection()
        t0 = now()
        out['enabled'] = [mock.mock_callback_enabled(RT, RT_LAUNCH), mock.mock_callback_enabled(DRV, DRV_LAUNCH),
                          mock.mock_callback_enabled(DRV, DRV_LAUNCH_EX), mock.mock_callback_enabled(RT, HOST_FUNC[0]),
                          mock.mock_callback_enabled(DRV, HOST_FUNC[1])]
        torch_launch(300)
        for _ in range(200):             # a runtime launch whose driver call is not reported
            mock.mock_api_call(RT, RT_LAUNCH, 1)
        for _ in range(100):             # Triton: the driver API alone
            mock.mock_api_call(DRV, DRV_LAUNCH_EX, 1)
        mock.mock_api_call(RT, HOST_FUNC[0], 1); mock.mock_api_call(DRV, HOST_FUNC[1], 1)
        mock.mock_set_api_result(1)      # failed launches put nothing on the GPU
        torch_launch(5)
        for _ in range(50):
            mock.mock_api_call(DRV, DRV_LAUNCH, 1)
        mock.mock_set_api_result(0)
        mock.mock_set_api_device(3)      # device 2
        for _ in range(7):
            mock.mock_api_call(DRV, DRV_LAUNCH, 1)
        mock.mock_set_api_device(0)      # no context: counted as lost, in no total
        mock.mock_api_call(DRV, DRV_LAUNCH, 1)
        for i in range(40):              # the records of the traced phase: durations
            queue(cr.kernel(t0 + i * 1000, t0 + i * 1000 + 500), cr.KERNEL_T)
        out['t'] = [t0, now()]
        g.gc_flush()
        out['path'] = path()
    """, env={"OTEL_GPU_CENSUS_ATTACH": "cuinit", "OTEL_GPU_CENSUS_KERNELS": "counted:1000/2000"})
    assert res["enabled"] == [1, 1, 1, 0, 0] and err == ""
    p = read(native, res["path"])
    d0, d2 = p.devices[0], p.devices[2]
    assert p.kernels.mode == 3 and (p.kernels.on_ms, p.kernels.period_ms) == (1000, 2000)
    assert (d0.kernel_count, d0.eager_launches, d0.eager_traced) == (600, 600, 40)
    assert d0.kernel_ns == d0.eager_traced_ns == 40 * 500
    assert (d2.kernel_count, d2.eager_launches, d2.eager_traced) == (7, 7, 0) and p.launches_lost == 1
    assert sum(w.eager_launches for w in p.windows) == sum(w.kernel_count for w in p.windows) == 607
    t0, t1 = res["t"]
    placed = [w for w in p.windows if w.eager_launches]
    assert placed and all(t0 - 20_000_000 <= w.start_ns <= t1 for w in placed), (t0, t1, [w.start_ns for w in placed])


def test_counted_kernels_give_each_step_its_own_launches(native, mock_lib, mock_cuda, tmp_path, records):
    """A step's launches are those of its thread between begin and end, nested steps' not included;
    another thread's step has its own."""
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, COUNTED_CALLS + """
        g.InitializeInjection()
        torch_launch(2)                  # before any step
        g.gc_step_begin(42)
        torch_launch(3)
        g.gc_step_begin(43)
        torch_launch(5)
        g.gc_step_end(gffi.NULL)
        torch_launch(1)                  # 42's again
        def other():
            mock.mock_set_api_device(2)  # this thread launches on device 1
            g.gc_step_begin(7)
            torch_launch(4)
            g.gc_step_end(gffi.NULL)
        th = threading.Thread(target=other); th.start(); th.join()
        g.gc_step_end(gffi.NULL)
        torch_launch(1)                  # after
        g.gc_flush()
        out['path'] = path()
    """, env={"OTEL_GPU_CENSUS_ATTACH": "cuinit", "OTEL_GPU_CENSUS_KERNELS": "counted"})
    p = read(native, res["path"])
    got = {i: (s.eager_launches, s.kernel_count, s.device_mask) for i, s in p.steps.items()}
    assert got == {42: (4, 4, 1), 43: (5, 5, 1), 7: (4, 4, 2)}, got
    assert (p.devices[0].kernel_count, p.devices[1].kernel_count) == (12, 4) and err == ""


def test_counted_kernels_keep_every_launch_of_a_step_begun_again(native, mock_lib, mock_cuda, tmp_path, records):
    """vLLM's sample_tokens and SGLang's delayed sampling tag their launches with the step they belong
    to, begun again after it ended: the step has the launches of both parts, none lost (on the H200 the
    second part's deposit replaced the first's: 61 % of vLLM's eager launches were lost to their steps).
    Launch counts do not move step_max (on the H200 the settler then split steps before their records
    came: requests with steps and no kernel)."""
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, COUNTED_CALLS + """
        g.InitializeInjection()
        for sid in (42, 43):
            g.gc_step_begin(sid)
            torch_launch(30)             # execute_model
            g.gc_step_end(gffi.NULL)
            g.gc_step_begin(sid)         # sample_tokens: the same step again
            torch_launch(2)
            g.gc_step_end(gffi.NULL)
        g.gc_flush()
        out['path'] = path()
    """, env={"OTEL_GPU_CENSUS_ATTACH": "cuinit", "OTEL_GPU_CENSUS_KERNELS": "counted"})
    p = read(native, res["path"])
    got = {i: (s.eager_launches, s.kernel_count) for i, s in p.steps.items()}
    assert got == {42: (32, 32), 43: (32, 32)}, got
    assert p.launches_lost == 0 and p.devices[0].eager_launches == 64 and err == ""
    # launch counts come at a step's end, its records a flush or more later: step_max (the settler's
    # "records of this step or a later one are in") moves with records only, none here
    assert p.step_max == 0


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


def test_counted_kernels_count_nothing_while_paused(native, mock_lib, mock_cuda, tmp_path, records):
    """Started paused, nothing counts; census=on counts from then on; census=off stops it again. While
    paused the launch calls' callbacks are off (a paused census costs a launch nothing), the captures'
    stay on (a capture begun while paused is still known when counting resumes)."""
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, COUNTED_CALLS + CONTROL_SWITCH + """
        g.InitializeInjection()
        torch_launch(10)
        BEGIN = rlib.CUPTI_RUNTIME_TRACE_CBID_cudaStreamBeginCapture_v10000
        def callbacks():
            return [mock.mock_callback_enabled(RT, RT_LAUNCH), mock.mock_callback_enabled(DRV, DRV_LAUNCH),
                    mock.mock_callback_enabled(RT, BEGIN)]
        def settled(want):               # the flusher switches them after it has read the control file
            for _ in range(300):
                if callbacks() == want:
                    break
                time.sleep(0.01)
            return callbacks()
        out['paused_cb'] = settled([0, 0, 1])
        out['on'] = switch('census=on\\n', False)
        out['on_cb'] = settled([1, 1, 1])
        torch_launch(3)
        out['off'] = switch('census=off\\n', True)
        out['off_cb'] = settled([0, 0, 1])
        torch_launch(20)
        g.gc_finish()
    """, env={"OTEL_GPU_CENSUS_ATTACH": "cuinit", "OTEL_GPU_CENSUS_START": "paused", "OTEL_GPU_CENSUS_FLUSH_MS": "20", "OTEL_GPU_CENSUS_KERNELS": "counted"})
    assert res["on"] and res["off"] and err == ""
    assert (res["paused_cb"], res["on_cb"], res["off_cb"]) == ([0, 0, 1], [1, 1, 1], [0, 0, 1])
    p = read(native, next(d.glob("*.seg")))
    assert p.devices[0].kernel_count == p.devices[0].eager_launches == 3


def test_counted_kernels_count_at_the_driver_once_the_runtime_is_proven_to_report_it(native, mock_lib, mock_cuda, tmp_path, records):
    """CUPTI reports a runtime launch's driver launch too (H200, §19): after 256 such launches in a row the
    runtime launch's callback goes off and the driver's counts them alone, exactly. A runtime launch seen
    without its driver launch keeps the runtime's on; so do steps, which want it themselves; a finished
    census switches the launch callbacks off."""
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, COUNTED_CALLS + """
        g.InitializeInjection()
        def settle(want, rounds=300):
            for _ in range(rounds):
                if mock.mock_callback_enabled(RT, RT_LAUNCH) == want:
                    break
                time.sleep(0.01)
            return mock.mock_callback_enabled(RT, RT_LAUNCH)
        for _ in range(6):               # half the runtime's launches unreported by the driver: keep it
            torch_launch(100)
            for _ in range(100):
                mock.mock_api_call(RT, RT_LAUNCH, 1)
            time.sleep(0.05)
        out['mixed'] = settle(0, rounds=20)
        torch_launch(300)                # then 300 reported in a row
        out['proven'] = settle(0)
        out['driver'] = mock.mock_callback_enabled(DRV, DRV_LAUNCH)
        torch_launch(500)                # counted by the driver's callback alone
        g.gc_flush()
        out['path'] = path()
        g.gc_finish()
        out['finished'] = [mock.mock_callback_enabled(RT, RT_LAUNCH), mock.mock_callback_enabled(DRV, DRV_LAUNCH)]
    """, env={"OTEL_GPU_CENSUS_ATTACH": "cuinit", "OTEL_GPU_CENSUS_FLUSH_MS": "20", "OTEL_GPU_CENSUS_KERNELS": "counted"})
    assert (res["mixed"], res["proven"], res["driver"]) == (1, 0, 1) and err == ""
    assert res["finished"] == [0, 0]
    p = read(native, res["path"])
    assert p.devices[0].eager_launches == p.devices[0].kernel_count == 6 * 200 + 300 + 500


def test_counted_kernels_leave_the_steps_their_callbacks(native, mock_lib, mock_cuda, tmp_path, records):
    """Steps map launches to their step through the same launch callbacks: once steps are on, neither a
    pause nor a proven runtime launch switches those off, and each launch still counts once."""
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, COUNTED_CALLS + """
        g.InitializeInjection()
        out['step'] = g.gc_step_begin(5)
        torch_launch(400)
        g.gc_step_end(gffi.NULL)
        time.sleep(0.3)                  # many wakes: the runtime launch is proven meanwhile
        out['kept'] = [mock.mock_callback_enabled(RT, RT_LAUNCH), mock.mock_callback_enabled(DRV, DRV_LAUNCH)]
        torch_launch(10)
        g.gc_flush()
        out['path'] = path()
    """, env={"OTEL_GPU_CENSUS_ATTACH": "cuinit", "OTEL_GPU_CENSUS_FLUSH_MS": "20", "OTEL_GPU_CENSUS_KERNELS": "counted"})
    assert res["step"] == 0 and res["kept"] == [1, 1] and err == ""
    p = read(native, res["path"])
    assert p.devices[0].eager_launches == 410 and p.steps[5].eager_launches == 400


def test_counted_kernels_without_callbacks_trace_every_kernel(native, mock_lib, mock_cuda, tmp_path, records):
    """Under the v1 API another tool may hold CUPTI's one callback slot: then every kernel is traced (exact,
    at the old cost) with one line."""
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, COUNTED_CALLS + """
        g.InitializeInjection()
        t0 = now()
        torch_launch(3)
        for i in range(3):
            queue(cr.kernel(t0 + i, t0 + i + 1), cr.KERNEL_T)
        g.gc_flush()
        out['kernels_on'] = mock.mock_enabled(rlib.CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL)
    """, env={"OTEL_GPU_CENSUS_ATTACH": "cuinit", "MOCK_CUPTI_SLOT_TAKEN": "1", "OTEL_GPU_CENSUS_KERNELS": "counted"})
    p = read(native, next(d.glob("*.seg")))
    assert p.kernels.name == "all" and p.devices[0].kernel_count == 3 and res["kernels_on"] == 1
    # graphs.c asks for callbacks first, so it is the one refused, and graphs go node by node
    assert err.count("\n") == 2 and "cannot subscribe to CUPTI callbacks" in err
    assert "OTEL_GPU_CENSUS_KERNELS=counted: graphs are traced node by node; tracing all kernels" in err


def test_counted_kernels_with_graphs_node_by_node_trace_every_kernel(native, mock_lib, mock_cuda, tmp_path, records):
    """Graphs traced node by node put their kernels in records, which a duty cycle would leave out: then
    every kernel is traced, with one line, and the control file cannot turn counting on."""
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, COUNTED_CALLS + """
        g.InitializeInjection()
        t0 = now()
        torch_launch(2)
        queue(cr.kernel(t0, t0 + 1), cr.KERNEL_T)
        g.gc_flush()
    """, env={"OTEL_GPU_CENSUS_ATTACH": "cuinit", "OTEL_GPU_CENSUS_KERNELS": "counted", "OTEL_GPU_CENSUS_GRAPHS": "node"})
    p = read(native, next(d.glob("*.seg")))
    assert p.kernels.name == "all" and p.devices[0].kernel_count == 1 and p.devices[0].eager_launches == 0
    assert err.count("\n") == 1 and "graphs are traced node by node; tracing all kernels" in err


# A counted census on device 0's context (known to it from a launch), and switch(): write its control
# file and wait until the segment shows the state.
SWITCHING = """
        from otel_gpu_census.census.reader import read_segment
        K = rlib.CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL
        g.InitializeInjection()
        torch_launch(1)
        g.gc_flush()
        ctl = path()[:-4] + '.control'
        def switch(text, name, paused):
            open(ctl, 'w').write(text)
            for _ in range(300):
                c = read_segment(path(), detail=False)
                if c.kernels.name == name and c.graphs.paused == paused:
                    return True
                time.sleep(0.01)
"""


def test_kinds_are_switched_only_when_their_state_changes(native, mock_lib, mock_cuda, tmp_path, records):
    """A pause inside the duty cycle's off part, a resume, a switch to every kernel: the kernel kind is on
    again even for a CUPTI that counts enables and disables (on the H200 every-kernel phases after such a
    pause had no kernel records at all, measurements §17)."""
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, COUNTED_CALLS + SWITCHING + """
        time.sleep(0.1)                                        # into the schedule's off part (20/1000)
        out['off_part'] = mock.mock_enabled(K)
        seq = []
        for _ in range(2):
            seq.append(switch('census=off\\n', 'counted:20/1000', True))
            seq.append(switch('census=on kernels=all\\n', 'all', False))
            time.sleep(0.05)
            seq.append(mock.mock_enabled(K))
            seq.append(switch('census=on kernels=counted:20/1000\\n', 'counted:20/1000', False))
            time.sleep(0.1)
        out['seq'] = seq
        out['last'] = switch('census=on kernels=all\\n', 'all', False)
        out['on'] = mock.mock_enabled(K)
        t0 = now()
        queue(cr.kernel(t0, t0 + 700), cr.KERNEL_T)
        g.gc_finish()
    """, env={"OTEL_GPU_CENSUS_ATTACH": "cuinit", "OTEL_GPU_CENSUS_FLUSH_MS": "20",
              "OTEL_GPU_CENSUS_KERNELS": "counted:20/1000", "MOCK_CUPTI_COUNTED_ENABLE": "1"})
    assert res["off_part"] == 0 and res["seq"] == [True, True, 1, True] * 2 and res["last"] and res["on"] == 1, res
    p = read(native, next(d.glob("*.seg")))
    assert p.devices[0].eager_traced == 1 and p.devices[0].eager_traced_ns == 700 and err == ""



SWITCH_CYCLES = SWITCHING + """
        seq = []
        for _ in range(3):                                     # pauses, mode switches, duty cycles
            seq.append(switch('census=off\\n', 'counted:20/100', True))
            seq.append(switch('census=on kernels=all\\n', 'all', False))
            seq.append(switch('census=on kernels=counted:20/100\\n', 'counted:20/100', False))
            time.sleep(0.25)
        seq.append(switch('census=on kernels=all\\n', 'all', False))
        time.sleep(0.1)
        out['seq'] = seq
        out['traced'] = mock.mock_enabled(K)
        out['global'] = mock.mock_enabled_globally(K)
        out['context_calls'] = mock.mock_context_calls()
        t0 = now()
        queue(cr.kernel(t0, t0 + 700), cr.KERNEL_T)
        g.gc_finish()
        out['after_finish'] = [mock.mock_enabled(K), mock.mock_enabled_globally(K)]
"""


def test_kernel_records_survive_switches_where_a_global_reenable_loses_them(native, mock_lib, mock_cuda, tmp_path,
                                                                            records):
    """CUPTI 13.5 on the H200 keeps no eager kernel record once CONCURRENT_KERNEL was disabled and enabled
    again globally (measurements §18; the mock does the same). The census switches the kind per context
    once it knows the context: after pauses, mode switches and duty cycles, every-kernel tracing still
    records kernels. A finished census leaves the kind off everywhere."""
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, COUNTED_CALLS + SWITCH_CYCLES,
                                  env={"OTEL_GPU_CENSUS_ATTACH": "cuinit", "OTEL_GPU_CENSUS_FLUSH_MS": "20",
                                       "OTEL_GPU_CENSUS_KERNELS": "counted:20/100", "MOCK_CUPTI_REENABLE_LOSES": "1"})
    assert all(res["seq"]) and res["traced"] == 1 and res["context_calls"] >= 10, res
    assert res["after_finish"] == [0, 0], res
    p = read(native, next(d.glob("*.seg")))
    assert p.devices[0].eager_traced == 1 and p.devices[0].eager_traced_ns == 700 and err == "", err


def test_where_cupti_refuses_per_context_switching_the_census_switches_globally_and_says_so(
        native, mock_lib, mock_cuda, tmp_path, records):
    """The same switches with a CUPTI that refuses per-context settings: the kind is switched globally as
    before, one line says that kernel records may stop, and with this CUPTI they do."""
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, COUNTED_CALLS + SWITCH_CYCLES,
                                  env={"OTEL_GPU_CENSUS_ATTACH": "cuinit", "OTEL_GPU_CENSUS_FLUSH_MS": "20",
                                       "OTEL_GPU_CENSUS_KERNELS": "counted:20/100", "MOCK_CUPTI_REENABLE_LOSES": "1",
                                       "MOCK_CUPTI_NO_CONTEXT_SWITCH": "1"})
    assert all(res["seq"]) and res["global"] == 1 and res["traced"] == 0 and res["context_calls"] == 0, res
    p = read(native, next(d.glob("*.seg")))
    assert p.devices[0].eager_traced == 0
    assert err.count("\n") == 1 and "CUPTI refused to switch them per context" in err, err


def test_contexts_made_later_follow_the_kernel_kinds_state_until_they_go(native, mock_lib, mock_cuda, tmp_path,
                                                                         records):
    """A context made while the census is paused (CUPTI's CONTEXT_CREATED) gets the kernel kind off at the
    flusher's next wake, and on again with the others at census=on; once it is being destroyed
    (CONTEXT_DESTROY_STARTING) the census never switches it again."""
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, COUNTED_CALLS + SWITCHING + """
        CREATED, DESTROY = 1, 2    # CUPTI_CBID_RESOURCE_CONTEXT_CREATED, _DESTROY_STARTING (cupti_callbacks.h)
        out['paused'] = switch('census=off\\n', 'counted:20/100', True)
        out['created'] = mock.mock_resource_call(CREATED, 2)      # device 1's context
        time.sleep(0.1)
        out['new_while_paused'] = [mock.mock_enabled_in(K, 1), mock.mock_enabled_in(K, 2)]
        out['on'] = switch('census=on kernels=all\\n', 'all', False)
        time.sleep(0.05)
        out['resumed'] = [mock.mock_enabled_in(K, 1), mock.mock_enabled_in(K, 2)]
        out['destroyed'] = mock.mock_resource_call(DESTROY, 2)
        calls = mock.mock_context_calls_of(2)
        out['off_again'] = switch('census=off\\n', 'all', True)
        time.sleep(0.05)
        out['after'] = [mock.mock_enabled_in(K, 1), mock.mock_context_calls_of(2) - calls]
    """, env={"OTEL_GPU_CENSUS_ATTACH": "cuinit", "OTEL_GPU_CENSUS_FLUSH_MS": "20",
              "OTEL_GPU_CENSUS_KERNELS": "counted:20/100"})
    assert res["paused"] and res["created"] == 1 and res["on"] and res["destroyed"] == 1 and res["off_again"], res
    assert res["new_while_paused"] == [0, 0] and res["resumed"] == [1, 1] and res["after"] == [0, 0], res
    assert err == "", err
    p = read(native, next(d.glob("*.seg")))
    assert p.attach.contexts_late == 1


def test_launches_into_a_capturing_stream_make_graph_nodes_and_are_not_counted(native, mock_lib, mock_cuda, tmp_path,
                                                                                 records):
    """While a capture is open, a launch into the capturing stream records a graph node (counted when the
    graph is launched); a launch into another stream runs and counts; after the capture ends, both count."""
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, COUNTED_CALLS + """
        cffi_cuda.cdef('void mock_cuda_set_capturing(unsigned long);')
        BEGIN, END = rlib.CUPTI_RUNTIME_TRACE_CBID_cudaStreamBeginCapture_v10000, rlib.CUPTI_RUNTIME_TRACE_CBID_cudaStreamEndCapture_v10000
        g.InitializeInjection()
        mock.mock_set_api_stream(5)
        out['begin'] = mock.mock_api_call(RT, BEGIN, 1)
        cuda.mock_cuda_set_capturing(5)
        torch_launch(4)                                   # captured: graph nodes
        mock.mock_api_call(DRV, DRV_LAUNCH, 1)            # captured through the driver API too
        mock.mock_set_api_stream(6)
        torch_launch(3)                                   # another stream: runs
        mock.mock_set_api_stream(5)
        mock.mock_api_call(RT, END, 1)
        cuda.mock_cuda_set_capturing(0)
        torch_launch(2)                                   # after the capture: runs
        g.gc_flush()
    """, env={"OTEL_GPU_CENSUS_ATTACH": "cuinit", "OTEL_GPU_CENSUS_KERNELS": "counted"})
    assert res["begin"] == 1 and err == ""
    p = read(native, next(d.glob("*.seg")))
    assert p.devices[0].eager_launches == p.devices[0].kernel_count == 5
