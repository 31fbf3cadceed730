"""Kernel durations from CUDA event pairs around a sample of the launches (OTEL_GPU_CENSUS_ACTIVITY=events,
native/src/preload/events.c); CUPTI never loaded.

The census library is preloaded and counts every launch, copy and graph launch at its call (as ACTIVITY=off). One of
every EAGER eager launches and GRAPH graph launches of a thread also gets cuEventRecord before and after the call on
its stream; the flusher reads the pairs that completed. The mock driver keeps one GPU timeline on CLOCK_MONOTONIC:
a launch runs its set duration from the end of its call (the GPU idle), so an ungated pair's first event comes before
the kernel by the time the launching thread takes to call it. Gated (the default), the stream waits for a word the
launching thread writes once launch and second event are submitted, and the pair is the kernel's time."""
from __future__ import annotations

from fractions import Fraction

from test_injector import read, run_with_driver
from test_interpose import DRIVER, preloaded

ENV = {"OTEL_GPU_CENSUS_ACTIVITY": "events"}
UNGATED = {"OTEL_GPU_CENSUS_EVENT_GATE": "off"}

EVENTS = DRIVER + """
        cffi_cuda.cdef('void mock_cuda_set_kernel_ns(unsigned long long); void mock_cuda_set_graph_ns(unsigned long long); '
                       'void mock_cuda_set_events_pending(int); int mock_cuda_events_live(void); '
                       'int mock_cuda_events_recorded(void); void *mock_cuda_event_stream(void); '
                       'int mock_cuda_relaxed(void); void mock_cuda_set_capturing(unsigned long); '
                       'void mock_cuda_set_call_ns(unsigned long long); int mock_cuda_gates(void); '
                       'int mock_cuda_gate_opened_in_call(void); void mock_cuda_set_event_ns(unsigned long long);')
        ctx_destroy = proc('cuCtxDestroy', ctypes.CFUNCTYPE(c_int, c_void_p))
        def settle():                      # the flusher reads pairs and folds calls every 20 ms
            time.sleep(0.15)
"""


def test_event_pairs_time_a_sample_and_price_every_counted_launch(native, mock_lib, mock_cuda, tmp_path):
    """A 5-kernel graph of 50 ms launched 4 times, the first while its pair is still running (folded with no span:
    counted, untimed), the rest priced at the exec's measured mean. 40 eager launches of 1,000 ns queued behind the
    first graph, about 1 in 4 timed (random gaps of 1 to 7): their first events had not fired when their calls
    returned (a busy stream), so each pair is the kernel's 1,000 ns and they are the eager sample. 8 more on an idle
    GPU: their pairs also hold the 2 us launch call, so they are summed apart. Counts are the calls'; busy and copy
    time are not measured; CUPTI is never loaded."""
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, EVENTS.format(mock_cuda=mock_cuda) + """
        out['init'] = g.InitializeInjection()
        cuda.mock_cuda_set_kernel_ns(1000)
        cuda.mock_cuda_set_graph_ns(50_000_000)
        ex = graph(5)
        cuda.mock_cuda_set_events_pending(1)
        glaunch(ex, None)                  # 50 ms of GPU work
        cuda.mock_cuda_set_events_pending(0)
        for _ in range(36): k()            # queued behind it
        for _ in range(4): k(launch_pt)
        out['early'] = cuda.mock_cuda_events_recorded()
        time.sleep(0.2)                    # the graph's pair done, the GPU idle again; the first launch folded
        for _ in range(3): glaunch(ex, None)
        time.sleep(0.2)
        for _ in range(8): k()
        htod(DEV, PIN, 1 << 20, None)
        settle()
        out['recorded'] = cuda.mock_cuda_events_recorded()
        out['relaxed'] = cuda.mock_cuda_relaxed()
        out['flush'] = g.gc_flush()
        out['path'] = path()
        out['cupti'] = [mock.mock_registered(), mock.mock_callback_enabled(1, 0)]
    """, env=dict(ENV, **UNGATED, **preloaded(native), OTEL_GPU_CENSUS_EVENT_EVERY="4/1"))
    assert res["init"] == 1 and res["flush"] == 0 and res["cupti"] == [0, 0], err
    p = read(native, res["path"])
    dev = p.devices[0]
    k = p.kernels
    assert k.events and not k.untimed and k.preloaded and p.cupti_version == 0
    assert k.name == "events:4/1" and (k.events_every_eager, k.events_every_graph) == (4, 1)
    eager_pairs = dev.eager_traced + k.events_idle
    assert res["recorded"] == 2 * (eager_pairs + 4)             # two events a pair, nothing else
    assert res["relaxed"] >= 1 + eager_pairs                     # the flusher's thread, and each eager pair's query
    assert 6 <= eager_pairs <= 30 and (k.events_timed, k.events_missed, k.events_failed) == (eager_pairs + 4, 0, 0)
    assert res["early"] >= 2 * 6
    # behind the graph: each pair is the kernel's 1,000 ns; at least one of every 7 launches, both runs of them
    assert dev.eager_launches == 48 and 40 // 7 <= dev.eager_traced and dev.eager_traced_ns == 1_000 * dev.eager_traced
    # on the idle GPU: the 2 us call and the kernel
    assert 8 // 7 <= k.events_idle and k.events_idle_ns >= 3_000 * k.events_idle
    assert (dev.graph_launches, dev.graph_kernel_count, dev.kernel_count, k.graph_untimed) == (4, 20, 68, 1)
    graphs = dev.kernel_ns - dev.eager_traced_ns     # 3 launches at the exec's mean span: 50 ms, and the first's call
    assert 3 * 50_000_000 < graphs <= 3 * 50_000_000 + 3 * 25_000, graphs
    kt = p.kernel_time(dev)
    assert kt.ns == graphs + 48 * 1_000 and kt.estimated and not kt.unknown
    assert dev.busy_ns == 0 and dev.copies.get("htod", "pinned").bytes == 1 << 20
    assert sum(w.eager_traced for w in p.windows) == dev.eager_traced and sum(w.eager_launches for w in p.windows) == 48
    assert "error" not in err.lower(), err
    from otel_gpu_census.report import cost
    from otel_gpu_census.report import render as report
    from otel_gpu_census.census import spans_estimated
    # priced as measured in one process (docs/measurements.md): each launch at its wrapper's price, each pair at its own (ungated
    # here: a graph pair 3.039 us); copies not priced
    e = cost.estimate(p)
    assert (e.launches_counted, e.graph_launches, e.pairs_eager, e.pairs_graph) == (48, 4, eager_pairs, 4)
    want = 48 * 0.137e-6 + 4 * 0.790e-6 + eager_pairs * 6.045e-6 + 4 * 3.039e-6
    assert spans_estimated([k.name]) and abs(e.seconds - want) < 1e-12, (e.seconds, want)
    text = report.render_text([p], requests=1)
    assert (f"census cost, estimated: {want:.6f} s of the launching threads" in text and "(48 eager launches counted "
            f"x 0.137 us, 4 graph launches x 0.79 us, {eager_pairs} eager event pairs x 6.045 us, 4 graph event pairs "
            "x 3.039 us; 1 copies and memsets not priced" in text), text
    assert f"{k.events_timed} CUDA event pairs (not gated) around about 1 of every 4 eager launches and every graph launch of each thread" in text, text
    assert "busy not measured" in text and "1 graph launches had no measured span" in text
    assert f"{k.events_idle} eager pairs met an idle stream and read long: left out of the sample" in text


def test_sampled_launches_are_one_in_n_on_average_with_no_fixed_stride(native, mock_lib, mock_cuda, tmp_path):
    """1 in 16 eager launches over 16,000 launches: about 1,000 pairs, and not a fixed stride (a server's regular
    launch sequence would alias with one): the sampled launches' positions modulo 16 spread over every residue."""
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, EVENTS.format(mock_cuda=mock_cuda) + """
        g.InitializeInjection()
        seen = []
        for i in range(16_000):
            if i % 256 == 0: time.sleep(0.03)   # the flusher gives pairs back: the pool never runs out
            before = cuda.mock_cuda_events_recorded()
            k()
            if cuda.mock_cuda_events_recorded() != before: seen.append(i)
        out['n'] = len(seen)
        out['residues'] = len(set(i % 16 for i in seen))
        out['gaps'] = [min(b - a for a, b in zip(seen, seen[1:])), max(b - a for a, b in zip(seen, seen[1:]))]
        out['flush'] = g.gc_flush()
        out['path'] = path()
    """, env=dict(ENV, **UNGATED, **preloaded(native), OTEL_GPU_CENSUS_EVENT_EVERY="16"))
    assert read(native, res["path"]).kernels.events_missed == 0
    assert 850 <= res["n"] <= 1150 and res["residues"] == 16 and res["gaps"][0] >= 1 and res["gaps"][1] <= 31, res


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
        k(launch_pt)                       # the per-thread twin: its events go to the thread's own stream
        out['stream'] = int(cffi_cuda.cast('uintptr_t', cuda.mock_cuda_event_stream()))
        settle()
        out['live_again'] = cuda.mock_cuda_events_live()
        out['flush'] = g.gc_flush()
        out['path'] = path()
    """, env=dict(ENV, **UNGATED, **preloaded(native), OTEL_GPU_CENSUS_EVENT_EVERY="1/1"))
    assert res["in_capture"] == 0 and res["failed"] == 1 and res["destroy"] == 0, err
    assert res["live_before"] >= 2 and res["live_after"] == 0 and res["live_again"] == 2
    assert res["stream"] == 2                        # CU_STREAM_PER_THREAD
    p = read(native, res["path"])
    dev = p.devices[0]
    assert dev.eager_launches == 1 + 2 + 1           # the captured one and the failed one run nothing
    k = p.kernels
    # an idle GPU throughout: every pair met an idle stream, so their mean is the last resort that prices the launches
    assert dev.eager_traced == 0 and k.events_idle == 3 and k.events_idle_ns >= 3 * (2_000 + 2_000)
    assert p.eager_mean_ns() == Fraction(k.events_idle_ns, 3)
    assert p.kernel_time(dev).ns == round(4 * Fraction(k.events_idle_ns, 3)) and p.kernel_time(dev).estimated
    assert k.events_failed == 0 and k.name == "events:1/1"


def test_with_no_eager_pair_only_graph_launches_are_timed_and_eager_time_is_unknown(
        native, mock_lib, mock_cuda, tmp_path):
    """OTEL_GPU_CENSUS_EVENT_EVERY=0/1: every graph launch gets a gated pair but an exec's first (its first launch may
    wait for the context), no eager launch does. Eager kernel time is then unknown, and said: in the report, and in
    the metrics, which give no kernel-time point (a part never read as the whole) and no busy or copy-time point,
    while graph time, counts and bytes are there."""
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, EVENTS.format(mock_cuda=mock_cuda) + """
        g.InitializeInjection()
        cuda.mock_cuda_set_kernel_ns(1000)
        cuda.mock_cuda_set_graph_ns(30_000)
        ex = graph(4)
        for _ in range(20): k()
        for _ in range(3): glaunch(ex, None)
        htod(DEV, PIN, 4096, None)
        settle()
        out['recorded'] = cuda.mock_cuda_events_recorded()
        out['gates'] = cuda.mock_cuda_gates()
        out['flush'] = g.gc_flush()
        out['path'] = path()
    """, env=dict(ENV, **preloaded(native), OTEL_GPU_CENSUS_EVENT_EVERY="0/1"))
    assert res["flush"] == 0 and res["recorded"] == 2 * 2 and res["gates"] == 2 and err == "", err
    p = read(native, res["path"])
    dev, k = p.devices[0], p.kernels
    assert k.name == "events:0/1" and k.events_timed == 2 and k.events_idle == 0 and dev.eager_traced == 0
    assert k.events_gate and (k.events_gated, k.events_forced) == (2, 0)
    assert dev.kernel_ns == 3 * 30_000      # every launch at the exec's span, the gated pairs' exactly
    assert (dev.eager_launches, dev.graph_kernel_count) == (20, 12)
    kt = p.kernel_time(dev)
    assert kt.unknown and kt.estimated and kt.ns == dev.kernel_ns > 0      # the graph spans only, and said so
    from otel_gpu_census.report import render as report
    from otel_gpu_census.telemetry.census_metrics import CensusMetrics
    text = report.render_text([p], requests=1)
    assert "eager kernels are not timed" in text and "graph launches only: no eager launch was timed" in text, text
    m = CensusMetrics(lambda: [p], min_refresh_s=0)
    cbs = m.callbacks()
    points = {name: cbs[name](None) for name in ("gpu_census.kernel.time", "gpu_census.kernel.count",
                                                  "gpu_census.busy.time", "gpu_census.graph.time")}
    assert points["gpu_census.kernel.time"] == [] and points["gpu_census.busy.time"] == []
    assert [o.value for o in points["gpu_census.kernel.count"]] == [32]
    assert [o.value for o in points["gpu_census.graph.time"]] == [dev.graph_ns / 1e9] and dev.graph_ns > 0


def test_a_bad_sample_setting_says_so_and_events_need_the_library_preloaded(native, mock_lib, mock_cuda, tmp_path):
    """OTEL_GPU_CENSUS_EVENT_EVERY=4/0 is refused with one line (the defaults: 128/16); without the preload, events fall
    back to the activity census, with one line."""
    body = EVENTS.format(mock_cuda=mock_cuda) + """
        out['init'] = g.InitializeInjection()
        k()
        out['flush'] = g.gc_flush()
        out['path'] = path()
        out['registered'] = mock.mock_registered()
    """
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, body,
                                  env=dict(ENV, **preloaded(native), OTEL_GPU_CENSUS_EVENT_EVERY="4/0"))
    assert "ignoring OTEL_GPU_CENSUS_EVENT_EVERY=4/0" in err and err.count("\n") == 1, err
    assert read(native, res["path"]).kernels.name == "events:128/16" and res["registered"] == 0
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, body, env=ENV)
    assert "the default collector needs the census library preloaded" in err, err
    assert res["init"] == 1 and res["registered"] == 1     # CUPTI's activity API: the default census


def test_gated_pairs_time_the_kernel_on_an_idle_stream_and_skip_a_functions_first_launch(
        native, mock_lib, mock_cuda, tmp_path):
    """Every launch sampled, gated (the default): the stream waits for the launching thread's word, written once the
    launch and the second event are submitted, so on an idle GPU a pair reads the kernel's 1,000 ns and the graph's
    30,000 ns and the GPU's 300 ns pass over the second event, not the 2 us call before them (ungated: the call and
    the kernel, summed apart as idle). An eager pair also has an event just before its first, whose pass is taken
    off: the eager sample is the kernels' 1,000 ns exactly. The first sampled launch of each function and of each
    graph exec gets no pair (a first launch may load code and wait for the whole context, the gate with it).
    A graph launch is priced at its exec's mean pair when the flusher folds it: one folded before a pair of its exec
    was read (any of the first three, on a loaded machine) is counted unpriced; the three launched after the first
    pairs were read are priced, always."""
    body = EVENTS.format(mock_cuda=mock_cuda) + """
        g.InitializeInjection()
        cuda.mock_cuda_set_kernel_ns(1000)
        cuda.mock_cuda_set_graph_ns(30_000)
        cuda.mock_cuda_set_event_ns(300)
        ex = graph(5)
        for i in range(20):
            k(fn=0xf00 + 0x10 * (i % 2))       # two functions
            time.sleep(0.001)                  # the GPU idle before each
        for _ in range(3): glaunch(ex, None); time.sleep(0.001)
        settle()
        for _ in range(3): glaunch(ex, None); time.sleep(0.001)
        settle()
        out['recorded'] = cuda.mock_cuda_events_recorded()
        out['gates'] = cuda.mock_cuda_gates()
        out['flush'] = g.gc_flush()
        out['path'] = path()
    """
    env = dict(ENV, **preloaded(native), OTEL_GPU_CENSUS_EVENT_EVERY="1")
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, body, env=env)
    assert res["flush"] == 0 and err == "", err
    p = read(native, res["path"])
    dev, k = p.devices[0], p.kernels
    assert k.events_gate and k.events_gated == 18 + 5 == res["gates"] and k.events_forced == 0
    assert res["recorded"] == 3 * 18 + 2 * 5 and k.events_timed == 23 and k.events_idle == 0 and k.events_missed == 0
    assert (k.events_lead, k.events_lead_ns) == (18, 18 * 300)
    assert dev.eager_launches == 20 and dev.eager_traced == 18 and dev.eager_traced_ns == 18 * 1_000
    priced = 6 - k.graph_untimed
    assert dev.graph_launches == 6 and 3 <= priced <= 6
    assert dev.kernel_ns == 18 * 1_000 + priced * 30_300 and p.kernel_time(dev).ns == 20 * 1_000 + priced * 30_300
    from otel_gpu_census.report import render as report
    assert "23 CUDA event pairs (23 gated: the stream waited for the launch to be submitted" in report.render_text([p])
    # the same launches ungated: every eager pair met an idle stream and holds the 2 us call
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, body, env=dict(env, **UNGATED))
    p = read(native, res["path"])
    dev, k = p.devices[0], p.kernels
    assert not k.events_gate and k.events_gated == 0 and res["gates"] == 0 and res["recorded"] == 2 * 26
    assert k.events_idle == 20 and k.events_idle_ns >= 20 * 3_000 and dev.eager_traced == 0 and k.events_lead == 0
    assert dev.kernel_ns - dev.eager_traced_ns >= (6 - k.graph_untimed) * 32_000 and k.graph_untimed <= 3


def test_a_gate_its_thread_leaves_shut_is_opened_by_the_watchdog_and_its_pair_dropped(
        native, mock_lib, mock_cuda, tmp_path):
    """A launch call that takes 40 ms (held up inside the driver) while its stream waits at the gate: the census's
    watchdog opens the gate during the call (the stream stalls 10-20 ms, never for good), and the pair, which holds
    the stall, is dropped and counted as forced. The next sampled launch is timed as ever. The watchdog, like the
    flusher, blocks every signal: the server's signals never run on a thread of ours."""
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, EVENTS.format(mock_cuda=mock_cuda) + """
        g.InitializeInjection()
        cuda.mock_cuda_set_kernel_ns(1000)
        k(fn=0xf00)                            # the function's first launch: no pair
        cuda.mock_cuda_set_call_ns(40_000_000)
        k(fn=0xf00)
        out['opened_in_call'] = cuda.mock_cuda_gate_opened_in_call()
        cuda.mock_cuda_set_call_ns(2000)
        time.sleep(0.001)
        k(fn=0xf00)
        settle()
        import os
        out['blocked'] = []                    # the census's threads (flusher, watchdog) take none of the server's signals
        for tid in os.listdir('/proc/self/task'):
            if int(tid) != os.getpid():
                blk = next(l for l in open(f'/proc/self/task/{tid}/status') if l.startswith('SigBlk:'))
                out['blocked'].append(int(blk.split()[1], 16))
        out['flush'] = g.gc_flush()
        out['path'] = path()
    """, env=dict(ENV, **preloaded(native), OTEL_GPU_CENSUS_EVENT_EVERY="1"))
    assert res["flush"] == 0 and res["opened_in_call"] == 1 and err == "", err
    term_int = (1 << (15 - 1)) | (1 << (2 - 1))  # SIGTERM, SIGINT
    assert len(res["blocked"]) >= 2 and all(b & term_int == term_int for b in res["blocked"]), res["blocked"]
    p = read(native, res["path"])
    dev, k = p.devices[0], p.kernels
    assert (k.events_gated, k.events_forced, k.events_timed, k.events_failed) == (2, 1, 1, 0)
    assert dev.eager_launches == 3 and dev.eager_traced == 1 and dev.eager_traced_ns == 1_000
    from otel_gpu_census.report import render as report
    assert "1 gated pairs were dropped, their gate opened by the census's watchdog" in report.render_text([p])


def test_the_watchdog_leaves_gates_their_threads_open_in_time(native, mock_lib, mock_cuda, tmp_path):
    """20,000 gated launches of 2 us calls while the watchdog scans every 10 ms: not one gate is forced. (The race the
    GPU showed, 1 or 2 of 15,000 pairs forced, a gate shut just after the watchdog read its clock looking 2^64 ns
    old, is too narrow for this mock to meet reliably: the watchdog's signed age is checked by reading.)"""
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, EVENTS.format(mock_cuda=mock_cuda) + """
        g.InitializeInjection()
        cuda.mock_cuda_set_kernel_ns(500)
        for i in range(20_000):
            if i % 128 == 0: time.sleep(0.002)   # the flusher gives pairs back
            k(fn=0xf00)
        settle()
        out['flush'] = g.gc_flush()
        out['path'] = path()
    """, env=dict(ENV, **preloaded(native), OTEL_GPU_CENSUS_EVENT_EVERY="1"))
    k = read(native, res["path"]).kernels
    assert res["flush"] == 0 and err == "", err
    assert k.events_gated > 4_000 and k.events_forced == 0, (k.events_gated, k.events_forced)


def test_by_default_one_eager_launch_in_128_and_one_graph_launch_in_16_get_a_gated_pair(
        native, mock_lib, mock_cuda, tmp_path):
    """The mode's default (OTEL_GPU_CENSUS_EVENT_EVERY unset: 128/16, gated): about 1 of every 128 eager launches is
    paired, every pair gated; eager kernel time is then known (the pairs' mean prices every eager launch), not left
    unknown. A graph exec's launches are paired (but its first) until 8 pairs have joined its version's mean, then
    about 1 in 16: once its mean holds them, 400 launches get about 25 pairs, not 400; an exec launched 5 times gets a
    pair on each launch after its first; every launch is priced at a measured mean."""
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, EVENTS.format(mock_cuda=mock_cuda) + """
        g.InitializeInjection()
        cuda.mock_cuda_set_kernel_ns(1000)
        cuda.mock_cuda_set_graph_ns(30_000)
        ex, rare = graph(4), graph(2)
        for i in range(6_400):
            if i % 512 == 0: time.sleep(0.002)
            k(fn=0xf00)
        for _ in range(400): glaunch(ex, None); time.sleep(0.0005)
        settle()                           # its pairs read: its mean holds 8 and more
        out['warm'] = cuda.mock_cuda_gates()
        for i in range(400):
            if i % 100 == 0: time.sleep(0.002)
            glaunch(ex, None)
        settle()
        out['often'] = cuda.mock_cuda_gates()
        for _ in range(5): glaunch(rare, None); time.sleep(0.0005)
        settle()
        out['gates'] = cuda.mock_cuda_gates()
        out['flush'] = g.gc_flush()
        out['path'] = path()
    """, env=dict(ENV, **preloaded(native)))
    assert res["flush"] == 0 and err == "", err
    p = read(native, res["path"])
    dev, k = p.devices[0], p.kernels
    assert k.name == "events:128/16" and k.events_gate and k.events_forced == 0 and k.events_missed == 0
    assert 20 <= dev.eager_traced <= 80 and dev.eager_traced_ns == 1_000 * dev.eager_traced
    assert res["warm"] - dev.eager_traced >= 8                # its minimum, however slow the flusher was
    assert 10 <= res["often"] - res["warm"] <= 50, res       # then a sample, ~400 / 16: not 400
    assert res["gates"] - res["often"] == 4                  # the rare exec: every launch but its first
    assert k.events_gated == res["gates"] and k.events_lead == dev.eager_traced
    # a launch is priced when folded (every 20 ms): at its exec's mean (30 us), or, folded before its exec had a pair
    # read, at every timed graph's time per kernel (7.5 us x 2 for the rare one); before any pair was read, not at all
    kt = p.kernel_time(dev)
    graphs = kt.ns - 6_400 * 1_000
    assert not kt.unknown and graphs % 15_000 == 0 and k.graph_untimed < 400, (kt, k.graph_untimed)
    assert 800 * 30_000 + 5 * 15_000 <= graphs + k.graph_untimed * 30_000 <= 805 * 30_000, (kt, k.graph_untimed)
