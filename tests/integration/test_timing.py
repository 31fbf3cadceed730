"""Kernel durations in windows of CUPTI attached and detached (OTEL_GPU_CENSUS_ACTIVITY=windows, native/src/timing.c).

The census library is preloaded and counts every launch, copy and graph launch at its call (as ACTIVITY=off);
for the kernel schedule's on-phases the flusher attaches CUPTI (subscriber, buffers, CONCURRENT_KERNEL and
GRAPH_TRACE) and then detaches it: kinds off, a forced flush, and the process's next driver call runs
cuptiFinalize at its exit callsite. Between windows the process has no CUPTI at all. The mock libcupti detaches
as CUPTI does (everything it set up is gone); its callbacks fire when the test makes "driver calls" through it."""
from __future__ import annotations

from test_injector import read, run_with_driver
from test_interpose import DRIVER, preloaded

ENV = {"OTEL_GPU_CENSUS_ATTACH": "cuinit", "OTEL_GPU_CENSUS_ACTIVITY": "windows",
       "OTEL_GPU_CENSUS_KERNELS": "counted:200/1000"}
DETACH = dict(ENV, OTEL_GPU_CENSUS_WINDOWS_PROBE="detach")   # the detach as designed: off by default (§23)

WINDOWS = DRIVER + """
        mffi.cdef('int mock_finalizes(void); int mock_subscribed(void); '
                  'int mock_api_call_params(int, uint32_t, uint32_t, const void *);')
        KERNEL, GRAPH = rlib.CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, rlib.CUPTI_ACTIVITY_KIND_GRAPH_TRACE
        def wait(cond, timeout=3.0):
            t0 = time.time()
            while not cond() and time.time() - t0 < timeout:
                time.sleep(0.002)
            return bool(cond())
        def cupti_now():
            ts = mffi.new('uint64_t *')
            mock.cuptiGetTimestamp(ts)
            return ts[0]
        def cupti_graph_launch(ex, corr):   # CUPTI's enter and exit callbacks of a cuGraphLaunch
            return mock.mock_api_call_params(1, rlib.CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch, corr,
                                             mffi.new('uint64_t *', ex))
"""


def test_windows_time_a_sample_and_price_every_counted_launch(native, mock_lib, mock_cuda, tmp_path):
    """In a window: 10 eager kernels of 1,000 ns and one launch of a 5-kernel graph spanning 50,000 ns. After it,
    30 eager launches and 4 graph launches with no CUPTI. Counts are the calls' (40 eager, 4 graph launches seen
    by the wrappers); eager time is 40 x the sampled mean, each graph launch is priced at its exec's 50,000 ns."""
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, WINDOWS.format(mock_cuda=mock_cuda) + """
        out['init'] = g.InitializeInjection()
        ex = graph(5)
        time.sleep(0.3)                    # a schedule's on-phase, and no context yet: CUPTI is not set up
        out['before_context'] = [mock.mock_subscribed(), mock.mock_registered()]
        cuda.mock_cuda_set_active(1)
        out['opened'] = wait(lambda: mock.mock_enabled(KERNEL) and mock.mock_enabled(GRAPH))
        out['in_window'] = [mock.mock_subscribed(), mock.mock_registered(), mock.mock_finalizes()]
        t0 = cupti_now()
        for i in range(10):
            k()
            queue(cr.kernel(t0 + i * 2000, t0 + i * 2000 + 1000), cr.KERNEL_T)
        out['graph_cb'] = cupti_graph_launch(ex, 77)
        queue(cr.graph_trace(t0 + 30_000, t0 + 80_000, corr=77), cr.GRAPH_T)
        out['closed'] = wait(lambda: not mock.mock_enabled(KERNEL))
        time.sleep(0.05)
        out['before_call'] = [mock.mock_finalizes(), mock.mock_subscribed()]
        mock.mock_api_call(1, 17, 5)       # the process's next driver call: cuptiFinalize at its exit
        out['after_call'] = [mock.mock_finalizes(), mock.mock_subscribed(), mock.mock_registered()]
        for _ in range(30): k()
        for _ in range(4): glaunch(ex, None)
        out['flush'] = g.gc_flush()
        out['path'] = path()
    """, env=dict(DETACH, **preloaded(native)))
    assert res["init"] == 1 and res["opened"] and res["closed"] and res["flush"] == 0, err
    assert res["before_context"] == [0, 0]    # CUPTI set up before a context slows its graphs for good (§15)
    assert res["in_window"] == [1, 1, 0] and res["graph_cb"] == 1
    assert res["before_call"] == [0, 1]          # detached only at a driver call's exit callsite
    assert res["after_call"] == [1, 0, 0]        # then nothing of CUPTI is left
    p = read(native, res["path"])
    dev = p.devices[0]
    assert p.flags & 0x80 and p.flags & 0x40 and p.kernels.windows and not p.kernels.untimed
    assert p.kernels.windows_opened >= 1 and p.kernels.windows_failed == 0 and p.kernels.name == "windows:200/1000"
    assert (dev.eager_launches, dev.eager_traced, dev.eager_traced_ns) == (40, 10, 10_000)
    assert (dev.graph_launches, dev.graph_kernel_count, dev.kernel_count) == (4, 20, 60)
    assert dev.kernel_ns == 10_000 + 4 * 50_000 and p.kernels.graph_untimed == 0
    kt = p.kernel_time(dev)
    assert kt.ns == 4 * 50_000 + 40 * 1_000 and kt.estimated and not kt.unknown
    assert dev.busy_ns == 10 * 1_000 + 50_000    # busy: what the window measured
    assert p.step_unmatched == 0 and "error" not in err.lower() and "not measured" not in err, err
    from otel_gpu_census import cost, report
    est = cost.estimate(p)                       # CUPTI set up: every launch pays its tax, and the windows' records
    assert est.seconds > 0 and (est.launches_counted, est.launches_set_up, est.eager_kernels) == (40, 40, 10)
    text = report.render_text([p], requests=1)
    assert "durations from 1 CUPTI windows" in text or "CUPTI windows (200 ms of every 1000 ms" in text, text


def test_no_window_while_a_detach_waits_and_cupti_held_elsewhere_skips_windows(native, mock_lib, mock_cuda, tmp_path):
    """A detach that no driver call has finished yet holds the next window back (CUPTI is never set up twice);
    once finished, the next on-phase attaches again. A graph launched before any window has no span to price
    it: counted, and said (graph_untimed)."""
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, WINDOWS.format(mock_cuda=mock_cuda) + """
        g.InitializeInjection()
        cuda.mock_cuda_set_active(1)
        ex = graph(3)
        wait(lambda: mock.mock_enabled(KERNEL))
        glaunch(ex, None)                  # no record of it comes: untimed
        wait(lambda: not mock.mock_enabled(KERNEL))
        time.sleep(1.2)                    # past the next on-phase: skipped, the detach still waits
        out['held_back'] = [mock.mock_finalizes(), mock.mock_enabled(KERNEL)]
        mock.mock_api_call(1, 17, 5)
        out['second'] = wait(lambda: mock.mock_enabled(KERNEL), 2.0)
        out['flush'] = g.gc_flush()
        out['path'] = path()
    """, env=dict(DETACH, **preloaded(native), OTEL_GPU_CENSUS_KERNELS="counted:100/1000"))
    assert res["held_back"] == [0, 0] and res["second"] and res["flush"] == 0, err
    p = read(native, res["path"])
    assert p.kernels.windows_opened == 2 and p.kernels.graph_untimed == 1
    assert p.devices[0].graph_kernel_count == 3 and p.kernels.detach_ns > 0


def test_by_default_cupti_stays_set_up_between_windows_and_only_its_kinds_switch(native, mock_lib, mock_cuda, tmp_path):
    """cuptiFinalize crashed CUDA-graph workloads on the H200 (§23): by default a window's end switches the two
    kinds off and leaves CUPTI set up (never finalized, one subscription for the process's life); the next window
    switches them on again. Counts stay the calls'; the windows' records time them."""
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, WINDOWS.format(mock_cuda=mock_cuda) + """
        g.InitializeInjection()
        cuda.mock_cuda_set_active(1)
        ex = graph(2)
        seen = []
        for w in range(2):
            wait(lambda: mock.mock_enabled(KERNEL))
            t0 = cupti_now()
            k()
            queue(cr.kernel(t0, t0 + 3000), cr.KERNEL_T)
            cupti_graph_launch(ex, 90 + w)
            queue(cr.graph_trace(t0 + 5000, t0 + 25000, corr=90 + w), cr.GRAPH_T)
            wait(lambda: not mock.mock_enabled(KERNEL))
            mock.mock_api_call(1, 17, 5)
            seen.append([mock.mock_finalizes(), mock.mock_subscribed(), mock.mock_enabled(GRAPH)])
        glaunch(ex, None)
        out['seen'] = seen
        out['flush'] = g.gc_flush()
        out['path'] = path()
    """, env=dict(ENV, **preloaded(native), OTEL_GPU_CENSUS_KERNELS="counted:100/500"))
    assert res["seen"] == [[0, 1, 0], [0, 1, 0]] and res["flush"] == 0, err
    p = read(native, res["path"])
    dev = p.devices[0]
    assert p.kernels.windows_opened == 2 and p.kernels.detach_ns == 0
    assert (dev.eager_launches, dev.eager_traced, dev.eager_traced_ns) == (2, 2, 6000)
    assert dev.graph_launches == 1 and dev.kernel_ns == 6000 + 20000


def test_cupti_held_by_another_tool_leaves_counts_exact_and_kernel_time_unknown(native, mock_lib, mock_cuda, tmp_path):
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, WINDOWS.format(mock_cuda=mock_cuda) + """
        g.InitializeInjection()
        cuda.mock_cuda_set_active(1)
        time.sleep(0.1)
        for _ in range(7): k()
        out['flush'] = g.gc_flush()
        out['path'] = path()
    """, env=dict(ENV, **preloaded(native), MOCK_CUPTI_CONFLICT="1"))
    p = read(native, res["path"])
    dev = p.devices[0]
    assert dev.eager_launches == 7 and p.kernels.windows_opened == 0 and p.kernels.windows_failed >= 1
    kt = p.kernel_time(dev)
    assert kt.unknown and kt.ns == 0
    assert err.count("CUPTI is held by another tool") == 1, err


def test_windows_without_the_library_preloaded_is_the_activity_census(native, mock_lib, mock_cuda, tmp_path):
    """Durations need the activity API when the calls cannot be the library's: one line, and the default census."""
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, """
        out['init'] = g.InitializeInjection()
        out['registered'] = mock.mock_registered()
    """, env=ENV)
    assert res == {"init": 1, "registered": 1}
    assert "ACTIVITY=windows needs the census library preloaded" in err
