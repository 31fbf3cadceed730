"""Kernel durations from CUDA event pairs around a sample of the launches (OTEL_GPU_CENSUS_ACTIVITY=events,
native/src/events.c); CUPTI never loaded.

The census library is preloaded and counts every launch, copy and graph launch at its call (as ACTIVITY=off). One of
every EAGER eager launches and GRAPH graph launches of a thread also gets cuEventRecord before and after the call on
its stream; the flusher reads the pairs that completed. The mock driver keeps one GPU timeline on CLOCK_MONOTONIC:
a launch runs its set duration from its call (the GPU idle), so a pair's first event comes before the kernel by the
time the launching thread takes to call it, which the reference event's placement takes out of eager samples."""
from __future__ import annotations

from fractions import Fraction

from test_injector import read, run_with_driver
from test_interpose import DRIVER, preloaded

ENV = {"OTEL_GPU_CENSUS_ATTACH": "cuinit", "OTEL_GPU_CENSUS_ACTIVITY": "events", "OTEL_GPU_CENSUS_KERNELS": "counted"}

EVENTS = DRIVER + """
        cffi_cuda.cdef('void mock_cuda_set_kernel_ns(unsigned long long); void mock_cuda_set_graph_ns(unsigned long long); '
                       'void mock_cuda_set_events_pending(int); int mock_cuda_events_live(void); '
                       'int mock_cuda_events_recorded(void); void *mock_cuda_event_stream(void); '
                       'int mock_cuda_relaxed(void); void mock_cuda_set_capturing(unsigned long);')
        ctx_destroy = proc('cuCtxDestroy', ctypes.CFUNCTYPE(c_int, c_void_p))
        def settle():                      # the flusher reads pairs and folds calls every 20 ms
            time.sleep(0.15)
"""


def test_event_pairs_time_a_sample_and_price_every_counted_launch(native, mock_lib, mock_cuda, tmp_path):
    """A 5-kernel graph of 50 ms launched 4 times, the first while its pair is still running (folded with no span:
    counted, untimed), the rest priced at the exec's measured mean. 40 eager launches of 1,000 ns queued behind the
    first graph, 1 in 4 timed: their first events fire after their calls returned (a busy stream), so each pair is
    the kernel's 1,000 ns and they are the eager sample. 8 more on an idle GPU: 2 pairs whose first event fired before
    the call returned, summed apart (they read long on a real GPU). Counts are the calls'; busy and copy time are not
    measured; CUPTI is never loaded."""
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, EVENTS.format(mock_cuda=mock_cuda) + """
        out['init'] = g.InitializeInjection()
        cuda.mock_cuda_set_kernel_ns(1000)
        cuda.mock_cuda_set_graph_ns(50_000_000)
        ex = graph(5)
        cuda.mock_cuda_set_events_pending(1)
        glaunch(ex, None)                  # 50 ms of GPU work
        for _ in range(36): k()            # queued behind it
        for _ in range(4): k(launch_pt)    # the 4th is sampled: its events go to the thread's own stream
        out['stream'] = int(cffi_cuda.cast('uintptr_t', cuda.mock_cuda_event_stream()))
        settle()                           # the graph launch folded before its pair is read: no span
        cuda.mock_cuda_set_events_pending(0)
        settle()
        for _ in range(3): glaunch(ex, None)
        time.sleep(0.2)                    # the GPU idle again
        for _ in range(8): k()
        htod(DEV, PIN, 1 << 20, None)
        settle()
        out['recorded'] = cuda.mock_cuda_events_recorded()
        out['relaxed'] = cuda.mock_cuda_relaxed()
        out['flush'] = g.gc_flush()
        out['path'] = path()
        out['cupti'] = [mock.mock_registered(), mock.mock_callback_enabled(1, 0)]
    """, env=dict(ENV, **preloaded(native), OTEL_GPU_CENSUS_EVENT_EVERY="4/1"))
    assert res["init"] == 1 and res["flush"] == 0 and res["cupti"] == [0, 0], err
    assert res["stream"] == 2                      # CU_STREAM_PER_THREAD: where the per-thread launch ran
    # two a pair, and the reference's (one every 200 ms of the flusher's, on a stream of its own)
    assert 2 * (12 + 4) < res["recorded"] <= 2 * (12 + 4) + 6 and res["relaxed"] == 1
    p = read(native, res["path"])
    dev = p.devices[0]
    k = p.kernels
    assert k.events and not k.windows and not k.untimed and k.preloaded and p.cupti_version == 0
    assert k.name == "events:4/1" and (k.events_every_eager, k.events_every_graph) == (4, 1)
    assert (k.events_timed, k.events_missed, k.events_failed, k.graph_untimed) == (16, 0, 0, 1)
    assert (dev.eager_launches, dev.eager_traced, dev.eager_traced_ns) == (48, 10, 10_000)
    # idle: from the call's return to the second event, each the kernel's 1,000 ns give or take the reference's
    # placement (its CPU time is read as its record call returns: a few hundred ns after the mock stamps it)
    assert k.events_idle == 2 and 2 * 600 <= k.events_idle_ns <= 2 * 2_000, k.events_idle_ns
    assert (dev.graph_launches, dev.graph_kernel_count, dev.kernel_count) == (4, 20, 68)
    # 3 launches at the exec's mean span: 50 ms, and the first pair's call (it met an idle GPU: a graph's pair is
    # its span as it stands, the launch call's submission with it)
    graphs = dev.kernel_ns - 10_000
    assert 3 * 50_000_000 < graphs <= 3 * 50_000_000 + 3 * 25_000, graphs
    kt = p.kernel_time(dev)
    assert kt.ns == graphs + 48 * 1_000 and kt.estimated and not kt.unknown
    assert dev.busy_ns == 0 and dev.copies.get("htod", "pinned").bytes == 1 << 20
    assert sum(w.eager_traced for w in p.windows) == 10 and sum(w.eager_launches for w in p.windows) == 48
    assert p.sample_gaps() == (0, 0)
    assert "error" not in err.lower(), err
    from otel_gpu_census import cost, report
    from otel_gpu_census.census import spans_estimated
    assert spans_estimated([k.name]) and cost.estimate(p).seconds > 0
    text = report.render_text([p], requests=1)
    assert "16 CUDA event pairs around 1 of every 4 eager and 1 graph launches" in text, text
    assert "busy not measured" in text and "1 graph launches had no measured span" in text
    assert "2 eager pairs met an idle stream and read long: left out of the sample" in text


def test_no_event_inside_a_capture_nor_after_a_failed_launch_and_a_context_going_takes_its_events(
        native, mock_lib, mock_cuda, tmp_path):
    """Every launch sampled (1/1). Launches into a capture record no event (it would become a node of the graph) and
    launches elsewhere while a capture is open record none either; a failed launch gives its pair back unread. A
    context about to be destroyed has its events destroyed first (none left alive); the next launch makes new ones."""
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, EVENTS.format(mock_cuda=mock_cuda) + """
        g.InitializeInjection()
        cuda.mock_cuda_set_kernel_ns(2000)
        begin(0x55, 0)
        k(stream=0x55); k()
        end(0x55, byref(c_void_p()))
        out['in_capture'] = cuda.mock_cuda_events_recorded()
        cuda.mock_cuda_set_result(1)
        out['failed'] = k()
        cuda.mock_cuda_set_result(0)
        k(); k()
        settle()
        out['live_before'] = cuda.mock_cuda_events_live()
        out['destroy'] = ctx_destroy(0xc000)
        out['live_after'] = cuda.mock_cuda_events_live()
        k()
        settle()
        out['live_again'] = cuda.mock_cuda_events_live()
        out['flush'] = g.gc_flush()
        out['path'] = path()
    """, env=dict(ENV, **preloaded(native), OTEL_GPU_CENSUS_EVENT_EVERY="1"))
    assert res["in_capture"] == 0 and res["failed"] == 1 and res["destroy"] == 0, err
    assert res["live_before"] >= 2 + 2 and res["live_after"] == 0     # pairs and the reference's two
    assert res["live_again"] == 2 + 2
    p = read(native, res["path"])
    dev = p.devices[0]
    assert dev.eager_launches == 1 + 2 + 1           # the captured one and the failed one run nothing
    k = p.kernels
    # an idle GPU throughout: every pair met an idle stream, so their mean is the last resort that prices the launches
    assert dev.eager_traced == 0 and k.events_idle == 3 and 3 * 1_600 <= k.events_idle_ns <= 3 * 3_000
    assert p.eager_mean_ns() == Fraction(k.events_idle_ns, 3)
    assert p.kernel_time(dev).ns == round(4 * Fraction(k.events_idle_ns, 3)) and p.kernel_time(dev).estimated
    assert k.events_failed == 0 and k.name == "events:1/1"


def test_a_bad_sample_setting_says_so_and_events_need_the_library_preloaded(native, mock_lib, mock_cuda, tmp_path):
    """OTEL_GPU_CENSUS_EVENT_EVERY=0 is refused with one line (the defaults: 128/1); without the preload, events fall
    back to the activity census, with one line."""
    body = EVENTS.format(mock_cuda=mock_cuda) + """
        out['init'] = g.InitializeInjection()
        k()
        out['flush'] = g.gc_flush()
        out['path'] = path()
        out['registered'] = mock.mock_registered()
    """
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, body,
                                  env=dict(ENV, **preloaded(native), OTEL_GPU_CENSUS_EVENT_EVERY="0/1"))
    assert "ignoring OTEL_GPU_CENSUS_EVENT_EVERY=0/1" in err and err.count("\n") == 1, err
    assert read(native, res["path"]).kernels.name == "events:128/1" and res["registered"] == 0
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, body, env=ENV)
    assert "OTEL_GPU_CENSUS_ACTIVITY=events needs the census library preloaded" in err, err
    assert res["init"] == 1 and res["registered"] == 1     # CUPTI's activity API: the default census
