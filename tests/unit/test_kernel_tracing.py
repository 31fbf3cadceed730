"""KernelTracing: how a census's collector saw kernels (precise: every record; default: counted at the calls, a sample
timed by event pairs, or none timed), and what a request's span says of it."""
from __future__ import annotations

import dataclasses

from otel_gpu_census.census import KERNELS_ALL, KERNELS_COUNTED, KernelTracing

MS = 1_000_000
EVENTS = KernelTracing(KERNELS_COUNTED, preloaded=True, events=True, events_every_eager=128, events_every_graph=16)
UNTIMED = KernelTracing(KERNELS_COUNTED, preloaded=True, untimed=True)


def test_the_two_collectors_name_what_they_measured():
    precise = KernelTracing()
    assert (precise.mode, precise.name, precise.counted, precise.copies_timed) == (KERNELS_ALL, "all", False, True)
    assert precise.traced_between(10, 30) == 20 and precise.traced_between(30, 10) == 0
    assert (EVENTS.name, EVENTS.counted, EVENTS.copies_timed) == ("events:128/16", True, False)
    assert EVENTS.traced_between(10, 30) == 20
    assert (UNTIMED.name, UNTIMED.copies_timed, UNTIMED.traced_between(10, 30)) == ("calls", False, 0)


def test_a_request_span_says_no_kernel_duration_was_measured_under_an_untimed_census():
    """A request over 2 s: under the precise collector its span carries no traced ratio (every kernel timed); with no
    duration measured, a ratio of 0; its copy bytes are whole either way."""
    from otel_gpu_census.attribution import Interval
    from otel_gpu_census.attribution.ledger import cost_of
    from otel_gpu_census.census import ProcessCensus, Stat, Window
    from otel_gpu_census.telemetry.attributes import gpu_attributes

    W = 20 * MS
    windows = [Window(i * W, (i + 1) * W, kernel_count=1, kernel_ns=W // 2, copies={"dtoh": Stat(1, 1000, 10)})
               for i in range(100)]
    base = ProcessCensus(
        path="/x", pid=7, ppid=1, comm="llama-server", proc_start_ticks=1, wall_start_ns=0, wall_update_ns=3 * 10**9,
        clock_ref_gpu_ns=0, clock_ref_wall_ns=0, cupti_version=130500, state=1, flags=0, records=0,
        records_unknown=0, dropped=0, buffers=0, buffers_refused=0, step_unmatched=0, window_late=0, step_max=0,
        last_gpu_ns=0, devices={}, windows=windows, complete_wall_ns=3 * 10**9)
    span = (0, 100 * W)
    attrs = gpu_attributes(cost_of("r", span, [base], [Interval(("r", "all"), *span, group="r")]))
    assert attrs["gpu_census.kernel.tracing"] == "all" and "gpu_census.kernel.traced_ratio" not in attrs
    assert attrs["gpu_census.kernel.count"] == 100 and attrs["gpu_census.copy.dtoh.bytes"] == 100_000
    untimed = dataclasses.replace(base, kernels=UNTIMED)
    attrs = gpu_attributes(cost_of("r", span, [untimed], [Interval(("r", "all"), *span, group="r")]))
    assert attrs["gpu_census.kernel.tracing"] == "calls" and attrs["gpu_census.kernel.traced_ratio"] == 0.0
    assert attrs["gpu_census.copy.dtoh.bytes"] == 100_000
