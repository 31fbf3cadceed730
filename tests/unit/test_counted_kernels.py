"""Counted kernel tracing (the default collector): every kernel counted exactly,
eager kernels' records (durations) only on the ON/PERIOD schedule. The reader reads the eager_* fields,
the estimator prices eager launches at a sampled mean, and requests, steps, reports and metrics carry
exact counts with estimated kernel time, saying so; ALL mode is unchanged."""
from __future__ import annotations

import json
from dataclasses import replace
from fractions import Fraction

import pytest

from otel_gpu_census import census
from otel_gpu_census._native import consts as native_consts
from otel_gpu_census.attribution import Interval
from otel_gpu_census.attribution.ledger import cost_of
from otel_gpu_census.attribution.shares import Share
from otel_gpu_census.census import (KERNELS_COUNTED, CopyTable, DeviceTotals, KernelTime, KernelTracing, ProcessCensus,
                                    Stat, Step, Window, kernel_time, reader)
from otel_gpu_census.telemetry.attributes import gpu_attributes

MS = 1_000_000
T = 1000 * 10**9                    # the CUPTI clock when the schedule starts (window index far from 0)
W = 20 * MS
COUNTED = KernelTracing(KERNELS_COUNTED, preloaded=True, events=True, events_every_eager=128, events_every_graph=16)


# -- a real segment, written by the native tally -------------------------------------------------------

def counted_segment(segments, records, directory):
    """A default-collector segment: one eager kernel timed (under step 42), a graph launch of 4 kernels, and the
    launches counted at the calls."""
    ffi, lib = segments.ffi, segments.lib
    seg = segments.new()
    seg.collector = native_consts.GC_COLLECTOR_DEFAULT
    seg.timing.on, seg.timing.every_eager, seg.timing.every_graph, seg.timing.timed = 1, 128, 16, 2
    contents = ffi.new("gc_graph_contents *")
    contents.kernels = 4
    t = lib.gc_tally_create(seg)
    try:
        lib.gc_segment_begin_update(seg)
        for r in (records.external(5, 42), records.kernel(T + 10 * MS, T + 10 * MS + 1000, corr=5)):
            lib.gc_tally_record(t, r)
        lib.gc_tally_graph_launch(t, records.graph_trace(T + 600 * MS, T + 600 * MS + 3000, corr=7), contents)
        lib.gc_tally_launches_device(t, 0, 7)
        lib.gc_tally_launches_window(t, T + 10 * MS, 3)
        lib.gc_tally_launches_window(t, T + 500 * MS, 4)
        lib.gc_tally_launches_step(t, 42, 0, 7)
        lib.gc_tally_launches_device(t, 99, 2)          # no such device: lost
        lib.gc_tally_launches_step(t, 0, 0, 1)          # no step: lost
        lib.gc_tally_publish(t, 1)
        seg.state = census.STATE_EXITED
        lib.gc_segment_end_update(seg)
    finally:
        lib.gc_tally_destroy(t)
    return segments.write(directory, seg)


def test_the_reader_reads_the_eager_fields_of_devices_windows_and_steps(segments, records, census_dir):
    c = reader.read_segment(counted_segment(segments, records, census_dir))
    assert c.kernels.counted and c.kernels.name == "events:128/16" and c.launches_lost == 3
    d = c.devices[0]
    assert (d.kernel_count, d.graph_kernel_count, d.eager_launches, d.eager_traced, d.eager_traced_ns) == \
        (7 + 4, 4, 7, 1, 1000)
    assert d.kernel_ns == 3000 + 1000
    win = {(w.start_ns - T) // W: w for w in c.windows}
    assert sorted(win) == [0, 25, 30]
    assert (win[0].kernel_count, win[0].kernel_ns, win[0].eager_launches, win[0].eager_traced,
            win[0].eager_traced_ns) == (3, 1000, 3, 1, 1000)
    assert (win[25].kernel_count, win[25].kernel_ns, win[25].eager_launches, win[25].eager_traced) == (4, 0, 4, 0)
    assert (win[30].kernel_count, win[30].kernel_ns, win[30].eager_launches) == (4, 3000, 0)
    st = c.steps[42]
    assert (st.kernel_count, st.kernel_ns, st.eager_launches, st.eager_traced, st.eager_traced_ns) == \
        (7, 1000, 7, 1, 1000)
    assert reader.read_steps(c.path, 42, 43) == [st]
    # the device's kernel time: graph span + 7 launches x the one sampled kernel's 1000 ns
    assert c.kernel_time(d) == KernelTime(3000 + 7 * 1000, estimated=True)
    assert c.kernel_time(win[25]) == KernelTime(4 * 1000, estimated=True)     # no sample: the process's mean


def test_the_report_prints_exact_counts_and_estimated_kernel_time(segments, records, census_dir):
    from otel_gpu_census.report import render as report
    c = reader.read_segment(counted_segment(segments, records, census_dir))
    text = report.render_text([c], requests=2)
    assert "kernel time 0.000010 s (estimated)" in text and "kernels counted at their calls" in text
    assert "NOT EXACT" in text and "3 kernel launches counted but placed nowhere" in text
    # the first window's 3 launches are start-up (490 ms of nothing follow them): per request is the other 8 kernels,
    # 4 eager launches priced at the one sample (1000 ns) and the graph launch's span (3000 ns)
    assert "start-up, before it (weights, compilation, graph capture, warm-up): 3 kernels" in text
    assert "4 kernels per request, 0.000003 s kernel time per request (estimated)" in text
    out = report.to_dict([c], requests=2)
    (dev,) = out["processes"][0]["devices"]
    assert (dev["kernel_count"], dev["kernel_ns"], dev["kernel_ns_estimated"], dev["eager_launches"]) == \
        (11, 4000, 10000, 7)
    assert out["per_request"]["scope"] == "serving"
    assert out["per_request"]["kernel_ns"] == 3500 and out["per_request"]["kernel_time_estimated"] is True
    from otel_gpu_census.report import diff
    run = diff.Run("a", [c])
    row = next(r for r in diff.rows(run.totals(), run.totals(), run.kernel_time(), run.kernel_time())
               if r.figure == "kernels.ns")
    assert (row.label, row.a) == ("kernel time s (estimated)", 10000)


# -- the estimator -----------------------------------------------------------------------------------

def test_the_estimate_prices_eager_launches_at_the_scopes_own_sample_mean():
    # 2000 ns of graph spans, 3 eager kernels sampled in 1000 ns (mean 333.3), 10 eager launches
    w = Window(0, W, kernel_count=14, kernel_ns=3000, eager_launches=10, eager_traced=3, eager_traced_ns=1000)
    assert kernel_time(w, counted=True) == KernelTime(2000 + 3333, estimated=True)
    assert kernel_time(w, counted=True, fallback_mean_ns=Fraction(10**6)) == KernelTime(5333, estimated=True)
    half = Step(id=1, kernel_ns=3, eager_launches=1, eager_traced=2, eager_traced_ns=3)     # 1 x 1.5: rounds up
    assert kernel_time(half, counted=True).ns == 2
    every = Share(kernel_count=5, kernel_ns=700, eager_launches=5, eager_traced=5, eager_traced_ns=500)
    assert kernel_time(every, counted=True).ns == 700          # every launch sampled: the measured time


def test_without_a_sample_of_its_own_the_fallback_mean_prices_it_and_without_any_it_is_unknown():
    s = Share(kernel_count=8, kernel_ns=2000, eager_launches=4)
    assert kernel_time(s, counted=True, fallback_mean_ns=Fraction(501, 2)) == KernelTime(2000 + 1002, True)
    assert kernel_time(s, counted=True) == KernelTime(2000, estimated=True, unknown=True)
    graphs = Share(kernel_count=4, kernel_ns=2000)
    assert kernel_time(graphs, counted=True) == KernelTime(2000)          # graph spans only: exact
    assert census.eager_mean_ns(s) is None and census.eager_mean_ns(Share(eager_traced=3, eager_traced_ns=10)) == \
        Fraction(10, 3)


def test_all_mode_keeps_the_measured_kernel_time():
    w = Window(0, W, kernel_count=3, kernel_ns=3000, eager_traced=3, eager_traced_ns=3000)
    assert kernel_time(w, counted=False) == KernelTime(3000)
    assert kernel_time(w, counted=False, fallback_mean_ns=Fraction(7)) == KernelTime(3000)


def head(kernels=COUNTED, devices=None, windows=()):
    return ProcessCensus(
        path="/x.seg", pid=7, ppid=1, comm="llama-server", proc_start_ticks=1, wall_start_ns=0,
        wall_update_ns=3 * 10**9, clock_ref_gpu_ns=T, clock_ref_wall_ns=0, cupti_version=130500, state=1, flags=0,
        records=0, records_unknown=0, dropped=0, buffers=0, buffers_refused=0, step_unmatched=0, window_late=0,
        step_max=0, last_gpu_ns=0, devices=devices or {}, windows=list(windows), complete_wall_ns=3 * 10**9,
        kernels=kernels)


def test_the_process_mean_over_its_life_is_the_fallback_of_its_scopes():
    devs = {0: DeviceTotals(0, eager_traced=3, eager_traced_ns=900),
            1: DeviceTotals(1, eager_traced=1, eager_traced_ns=100)}
    p = head(devices=devs)
    assert p.eager_mean_ns() == 250
    assert p.kernel_time(Step(id=1, kernel_ns=50, eager_launches=4)) == KernelTime(50 + 1000, True)
    assert p.kernel_time(Step(id=1, kernel_ns=50, eager_launches=4, eager_traced=1, eager_traced_ns=20)) == \
        KernelTime(30 + 80, True)
    assert replace(p, kernels=KernelTracing()).kernel_time(Step(id=1, kernel_ns=50, eager_launches=4)) == KernelTime(50)


# -- a request by time windows (the proxy) -----------------------------------------------------------

def windows():
    """100 windows of 2 s: a graph of 2 kernels (500 ns) each, 3 eager launches each, and in the traced
    phases (5 of every 50 windows) the 3 eager kernels' records, 200 ns each."""
    out = []
    for i in range(100):
        traced = i % 50 < 5
        out.append(Window(T + i * W, T + (i + 1) * W, kernel_count=2 + 3, kernel_ns=500 + (600 if traced else 0),
                          copies={"dtoh": Stat(1, 1000, 10)}, eager_launches=3, eager_traced=3 if traced else 0,
                          eager_traced_ns=600 if traced else 0))
    return out


def request(p, span=(0, 100 * W)):
    return cost_of("r", span, [p], [Interval(("r", "all"), *span, group="r")])


def test_a_counted_request_has_exact_counts_and_an_estimated_time_that_says_so():
    p = head(devices={0: DeviceTotals(0, eager_traced=30, eager_traced_ns=6000)}, windows=windows())
    a = gpu_attributes(request(p))
    assert a["gpu_census.kernel.count"] == 500 and a["gpu_census.copy.dtoh.bytes"] == 100_000    # never scaled
    # 100 graph spans of 500 ns + 300 eager launches x 200 ns (its own sample: 30 records, 6000 ns)
    assert a["gpu_census.kernel.time"] == (50_000 + 60_000) / 1e9 == a["gpu_census.window.kernel.time"]
    assert a["gpu_census.kernel.time_estimated"] is True
    assert a["gpu_census.kernel.tracing"] == "events:128/16" and a["gpu_census.kernel.traced_ratio"] == 1.0
    assert a["gpu_census.prefill.kernel.time"] == 0
    # a request inside an untraced phase: priced at the process's mean over its life (200 ns)
    a = gpu_attributes(request(p, (20 * W, 30 * W)))
    assert a["gpu_census.kernel.count"] == 50 and a["gpu_census.kernel.time"] == (5000 + 30 * 200) / 1e9
    assert a["gpu_census.kernel.time_estimated"] is True


def test_a_counted_request_with_no_sample_anywhere_says_its_eager_time_is_unknown():
    ws = [replace(w, kernel_ns=500, eager_traced=0, eager_traced_ns=0) for w in windows()]
    a = gpu_attributes(request(head(windows=ws), (20 * W, 30 * W)))
    assert a["gpu_census.kernel.count"] == 50 and a["gpu_census.kernel.time"] == 5000 / 1e9
    assert "kernel time leaves out 30 eager kernel launches" in a["gpu_census.attribution.note"]


def test_an_all_mode_request_is_unchanged():
    ws = [replace(w, eager_launches=0) for w in windows()]
    a = gpu_attributes(request(head(kernels=KernelTracing(), windows=ws)))
    assert a["gpu_census.kernel.count"] == 500 and a["gpu_census.kernel.time"] == sum(w.kernel_ns for w in ws) / 1e9
    assert a["gpu_census.kernel.tracing"] == "all"
    assert "gpu_census.kernel.time_estimated" not in a and "gpu_census.kernel.traced_ratio" not in a


# -- requests by engine steps ------------------------------------------------------------------------

@pytest.mark.parametrize("counted", [True, False])
def test_an_engines_counted_requests_get_exact_counts_and_estimated_time(tagged, monkeypatch, tmp_path, counted):
    from engine_standins import Census, Clock, in_memory_telemetry    # tests/support
    from otel_gpu_census import injector
    from otel_gpu_census.report import engine_requests
    from otel_gpu_census.integrations.engine.steps import StepEngine

    seg = tmp_path / "gpu-census-7-1.seg"
    monkeypatch.setattr(injector, "segment_path", lambda: str(seg))
    clock = Clock()
    life = {0: DeviceTotals(0, eager_traced=10, eager_traced_ns=5000)}          # mean 500 ns over its life
    h = replace(head(COUNTED if counted else KernelTracing(), devices=life), clock_ref_gpu_ns=7 * 10**9,
                clock_ref_wall_ns=clock.t, wall_start_ns=clock.t)

    class RealHead(Census):
        def read(self, lo, hi):
            _, steps = super().read(lo, hi)
            return replace(h, complete_wall_ns=self.complete, step_max=max(self.steps, default=0)), steps
    c = RealHead()
    rt, spans, metric_reader = in_memory_telemetry("engine")
    eng = StepEngine(telemetry=rt, read=c.read, clock=clock, settle_period_s=3600)
    t0 = clock.t
    for k in "abc":
        eng.start_request(k, start_ns=t0, operation="chat", model="m", headers={}, attributes={})
    # step 1: 4 graph kernels (2000 ns span) and 10 eager launches, all sampled (3000 ns); step 2: 20
    # eager launches, none sampled
    plan = ((0, {"a": 1, "b": 1}, Step(id=0, kernel_count=14, kernel_ns=5000, eager_launches=10, eager_traced=10,
                                      eager_traced_ns=3000), "b"),
            (500, {"a": 1, "c": 1}, Step(id=0, kernel_count=20, eager_launches=20), "ac"))
    for start, tokens, st, done in plan:
        clock.t = t0 + start * MS
        sid = eng.open_step(tokens)
        c.steps[sid] = replace(st, id=sid)
        clock.t += 40 * MS
        eng.end_step(sid)
        for k in done:
            eng.request_done(k, {"gen_ai.usage.output_tokens": 2})
    c.complete = clock.t + 10**9
    assert eng.settle() == 3
    by_count = {s.attributes["gpu_census.kernel.count"]: s.attributes for s in spans.get_finished_spans()}
    assert sorted(by_count) == [7, 10, 17]                      # b, c, a: exact, never scaled
    lines = {x["gpu"]["kernel.count"]: x for x in map(json.loads, (tmp_path / "gpu-census-7-1.requests.jsonl")
                                                      .read_text().splitlines()) if "gpu" in x}
    b, cc, a = by_count[7], by_count[10], by_count[17]
    if counted:
        # each step priced once, then halved: step 1 by its own sample (2000 ns of graph spans + 10 launches x
        # 300), step 2, with none, at the process's mean (20 x 500); a has half of both, b of step 1, c of step 2
        want = {17: (2000 + 10 * 300) // 2 + 20 * 500 // 2, 7: (2000 + 10 * 300) // 2, 10: 20 * 500 // 2}
        assert {k: round(x["gpu_census.kernel.time"] * 1e9) for k, x in by_count.items()} == want
        assert all(x["gpu_census.kernel.time_estimated"] is True for x in (a, b, cc))
        assert all(x["gpu_census.kernel.tracing"] == "events:128/16" for x in (a, b, cc))
        assert {k: (x["gpu"]["kernel.time_ns"], x["kernel_time_estimated"]) for k, x in lines.items()} == \
            {k: (v, True) for k, v in want.items()}
        log = engine_requests.read(str(tmp_path / "gpu-census-7-1.requests.jsonl"))
        assert engine_requests.kernel_sample(log) is None          # an estimate is never scaled again
        assert engine_requests.kernel_estimated(log) == {"modes": ["events:128/16"], "requests": 3,
                                                          "estimated": 3, "unknown": 0}
        from otel_gpu_census.report import render as report
        text = "\n".join(report._engine_request_lines([replace(h, path=str(seg))]))
        assert "kernel counts exact, kernel time estimated for 3 of 3 requests" in text
        assert "kernel figures are a sample" not in text
        times = [dp for rm in metric_reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics
                 for m in sm.metrics if m.name == "gpu_census.request.kernel.time" for dp in m.data.data_points]
        assert sum(dp.sum for dp in times) == pytest.approx(sum(want.values()) / 1e9)
    else:
        assert {k: round(x["gpu_census.kernel.time"] * 1e9) for k, x in by_count.items()} == {17: 2500, 7: 2500, 10: 0}
        assert all("gpu_census.kernel.time_estimated" not in x and x["gpu_census.kernel.tracing"] == "all"
                   for x in (a, b, cc))
        assert all("kernel_time_estimated" not in x for x in lines.values())


# -- metrics -----------------------------------------------------------------------------------------

def test_the_kernel_time_counter_is_estimated_and_never_goes_back():
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from otel_gpu_census.telemetry import census_metrics as metrics

    def proc(traced_ns):
        d = DeviceTotals(0, "GPU-1", kernel_count=14, kernel_ns=2000 + traced_ns, eager_launches=10,
                         eager_traced=2, eager_traced_ns=traced_ns)
        return head(devices={0: d})
    procs = [proc(1000)]
    rd = InMemoryMetricReader()
    metrics.register_census_instruments(MeterProvider(metric_readers=[rd]), lambda: procs, min_refresh_s=0)

    def kernel_time():
        return [dp.value for rm in rd.get_metrics_data().resource_metrics for sm in rm.scope_metrics
                for m in sm.metrics if m.name == "gpu_census.kernel.time" for dp in m.data.data_points]
    assert kernel_time() == [pytest.approx((2000 + 10 * 500) / 1e9)]
    procs[0] = proc(600)                      # the sample's mean fell: 2000 + 10 x 300 < 7000
    assert kernel_time() == [pytest.approx(7000 / 1e9)]
    procs[0] = proc(2000)
    assert kernel_time() == [pytest.approx((2000 + 10 * 1000) / 1e9)]


def test_the_cost_estimate_of_every_kernel_traced_prices_each_record_and_its_launch():
    """The precise collector: each record at CUPTI's record cost (0.902 us) and its launch at CUPTI's set-up cost
    (0.654 us); graph nodes at the per-node price."""
    from otel_gpu_census.report import cost
    d = DeviceTotals(0, kernel_count=10_000 + 200, graph_kernel_count=200, eager_traced=10_000,
                     eager_traced_ns=10_000 * 600)
    e_all = cost.estimate(head(kernels=KernelTracing(), devices={0: d}))
    assert (e_all.eager_kernels, e_all.launches_counted) == (10_000, 0)
    node_s = cost.graph_node_s(head(kernels=KernelTracing()))
    assert e_all.launches_set_up == 10_000 and abs(e_all.seconds - (10_000 * (0.902e-6 + 0.654e-6) + 200 * node_s)) < 1e-12


def test_the_cost_estimate_of_a_census_at_the_calls_prices_its_callbacks_not_records():
    """ACTIVITY=off: no record and no activity API; launches, copies and graph nodes at the callbacks' prices
    measured beside an untraced process (docs/measurements.md)."""
    from otel_gpu_census.report import cost
    d = DeviceTotals(0, kernel_count=10_000 + 200, graph_kernel_count=200, eager_launches=10_000,
                     memset=Stat(3, 300, 0))
    e = cost.estimate(head(kernels=KernelTracing(mode=KERNELS_COUNTED, untimed=True), devices={0: d}))
    assert (e.eager_kernels, e.launches_counted, e.launches_set_up, e.graph_nodes, e.copies) == (0, 10_000, 0, 200, 3)
    assert abs(e.seconds - (10_000 * 1.31e-6 + 3 * 0.65e-6 + 200 * 0.129e-6)) < 1e-12


def test_a_census_at_the_calls_exports_kernel_counts_and_no_kernel_time():
    """ACTIVITY=off measures no duration: the kernel count goes out, the kernel time series has no point for
    the process (a 0 would read as an idle GPU)."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from otel_gpu_census.telemetry import census_metrics as metrics
    d = DeviceTotals(0, "GPU-1", kernel_count=14, graph_kernel_count=4, eager_launches=10, graph_launches=1,
                     memset=Stat(3, 300, 0), copies=CopyTable({("htod", "pinned"): Stat(2, 8192, 0)}))
    procs = [head(kernels=KernelTracing(mode=KERNELS_COUNTED, untimed=True), devices={0: d})]
    rd = InMemoryMetricReader()
    metrics.register_census_instruments(MeterProvider(metric_readers=[rd]), lambda: procs, min_refresh_s=0)
    got = {m.name: [dp.value for dp in m.data.data_points] for rm in rd.get_metrics_data().resource_metrics
           for sm in rm.scope_metrics for m in sm.metrics}
    assert got.get("gpu_census.kernel.count") == [14] and got.get("gpu_census.copy.bytes") == [8192]
    assert got.get("gpu_census.memset.count") == [3] and got.get("gpu_census.graph.count") == [1]
    for name in ("gpu_census.kernel.time", "gpu_census.copy.time", "gpu_census.memset.time", "gpu_census.graph.time"):
        assert not got.get(name), name


@pytest.mark.parametrize("how", [dict(untimed=True), dict(events=True, preloaded=True)])
def test_censuses_counted_at_the_calls_export_copy_bytes_and_no_copy_or_memset_time(how):
    """Counted at the calls (untimed, events) copies and memsets have bytes and no duration: their time series
    get no point for the process (a 0 would read as measured); the activity census's do."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from otel_gpu_census.telemetry import census_metrics as metrics

    def got(kernels):
        d = DeviceTotals(0, "GPU-1", kernel_count=4, eager_launches=4, memset=Stat(3, 300, 0),
                         copies=CopyTable({("htod", "pinned"): Stat(2, 8192, 0)}))
        rd = InMemoryMetricReader()
        metrics.register_census_instruments(MeterProvider(metric_readers=[rd]),
                                            lambda: [head(kernels=kernels, devices={0: d})], min_refresh_s=0)
        return {m.name: [dp.value for dp in m.data.data_points] for rm in rd.get_metrics_data().resource_metrics
                for sm in rm.scope_metrics for m in sm.metrics}
    bare, timed = got(KernelTracing(mode=KERNELS_COUNTED, **how)), got(KernelTracing(mode=KERNELS_COUNTED))
    assert bare.get("gpu_census.copy.bytes") == [8192] and bare.get("gpu_census.memset.bytes") == [300]
    assert not bare.get("gpu_census.copy.time") and not bare.get("gpu_census.memset.time")
    assert timed.get("gpu_census.copy.time") == [0.0] and timed.get("gpu_census.memset.time") == [0.0]


def test_a_per_request_kernel_time_without_its_eager_part_says_so(monkeypatch):
    """Events with eager launches and no pair to price them (a short program: a function's first sampled launch gets
    no pair): the per-request figure is the graph part only, and the line says so; with no graph part either it
    is not a measured 0 but "not measured"."""
    from otel_gpu_census.report import render as report
    base = {"requests": 10, "scope": "serving", "kernel_count": 0.1, "kernel_ns": 0, "copies": {},
            "kernel_time_estimated": True}
    assert report._per_request_lines({**base, "kernel_time_unknown": True}, 1)[-1] == \
        "  0.1 kernels per request, kernel time not measured (too few eager launches for one to be timed)"
    assert report._per_request_lines({**base, "kernel_time_unknown": True, "kernel_ns": 2_000_000}, 1)[-1] == \
        "  0.1 kernels per request, 0.002000 s kernel time per request (estimated, graph launches only: no eager " \
        "launch was timed)"
    assert report._per_request_lines(base, 1)[-1].endswith("s kernel time per request (estimated)")
    assert report._kernel_time_words(KernelTime(0, estimated=True, unknown=True)) == report.NONE_TIMED


def test_span_attributes_give_no_copy_time_where_nothing_timed_copies():
    """Counted at the calls (events, `run`'s default; untimed) a copy has bytes and no duration: its span carries
    the bytes and counts and no time_ns, which would read as a measured 0; under CUPTI's records it carries all three."""
    from otel_gpu_census.attribution.shares import Share
    from otel_gpu_census.census import Stat, copy_times_measured
    from otel_gpu_census.telemetry.attributes import share_attributes
    s = Share(kernel_count=3, kernel_ns=10, copies={"dtoh": Stat(count=1, bytes=4096, ns=0)},
              memset=Stat(count=1, bytes=64, ns=0))
    timed = share_attributes("g.", s, copy_time=True)
    bare = share_attributes("g.", s, copy_time=copy_times_measured(["events:128/1"]))
    assert "g.copy.dtoh.time_ns" in timed and "g.memset.time_ns" in timed
    assert bare["g.copy.dtoh.bytes"] == 4096 and bare["g.memset.count"] == 1
    assert not [k for k in bare if k.endswith("time_ns") and k != "g.kernel.time_ns"]
    assert [copy_times_measured(m) for m in (["all"], ["counted"], [], ["calls"], ["events:128/16"])] == \
        [True, True, True, False, False]
