"""KernelTracing: which part of a time range a sampled census traced kernels in, by its schedule."""
from __future__ import annotations

import random

from otel_gpu_census.census import KERNELS_ALL, KERNELS_OFF, KERNELS_SAMPLED, KernelTracing

MS = 1_000_000


def brute(k: KernelTracing, a: int, b: int) -> int:
    """Count traced milliseconds one by one (the schedule is in whole ms)."""
    n = 0
    for t in range(a // MS, b // MS):
        d = t * MS - k.origin_gpu_ns
        n += d >= 0 and d % (k.period_ms * MS) < k.on_ms * MS
    return n * MS


def test_traced_between_matches_counting_each_millisecond():
    rng = random.Random(7)
    for _ in range(300):
        period = rng.choice([40, 100, 1000, 2000])
        on = rng.randrange(20, period, 20)
        k = KernelTracing(KERNELS_SAMPLED, on, period, origin_gpu_ns=rng.randrange(0, 5000) * MS)
        a = rng.randrange(0, 9000) * MS
        b = a + rng.randrange(0, 5000) * MS
        assert k.traced_between(a, b) == brute(k, a, b), (on, period, k.origin_gpu_ns, a, b)


def test_modes():
    assert KernelTracing().traced_between(10, 30) == 20 and KernelTracing().name == "all"
    off = KernelTracing(KERNELS_OFF)
    assert off.traced_between(10, 30) == 0 and off.fraction == 0.0 and off.name == "off"
    s = KernelTracing(KERNELS_SAMPLED, 100, 1000, origin_gpu_ns=0)
    assert s.fraction == 0.1 and s.name == "100/1000"
    assert s.traced_between(0, 10_000 * MS) == 1000 * MS          # ten whole periods
    assert s.traced_between(50 * MS, 150 * MS) == 50 * MS          # the tail of one on-phase
    assert s.traced_between(200 * MS, 900 * MS) == 0               # inside an off-phase
    assert s.traced_between(30, 10) == 0 and KernelTracing(KERNELS_ALL).fraction == 1.0


def test_a_request_span_says_how_much_of_its_time_kernels_were_traced():
    """A request over 2 s of a census sampling 100 ms of every 1000 ms: its span carries the mode and
    the traced share (0.1), while its copy bytes are whole."""
    import dataclasses

    from otel_gpu_census.attribution import Interval
    from otel_gpu_census.census import ProcessCensus, Stat, Window
    from otel_gpu_census.attribution.ledger import cost_of
    from otel_gpu_census.telemetry.attributes import gpu_attributes

    W = 20 * MS
    windows = [Window(i * W, (i + 1) * W, kernel_count=1 if i % 50 < 5 else 0, kernel_ns=W // 2 if i % 50 < 5 else 0,
                      copies={"dtoh": Stat(1, 1000, 10)}) for i in range(100)]
    base = ProcessCensus(
        path="/x", pid=7, ppid=1, comm="llama-server", proc_start_ticks=1, wall_start_ns=0, wall_update_ns=3 * 10**9,
        clock_ref_gpu_ns=0, clock_ref_wall_ns=0, cupti_version=130500, state=1, flags=0, records=0,
        records_unknown=0, dropped=0, buffers=0, buffers_refused=0, step_unmatched=0, window_late=0, step_max=0,
        last_gpu_ns=0, devices={}, windows=windows, complete_wall_ns=3 * 10**9,
        kernels=KernelTracing(KERNELS_SAMPLED, 100, 1000, origin_gpu_ns=0, traced_ns=300 * MS))
    span = (0, 100 * W)
    cost = cost_of("r", span, [base], [Interval(("r", "all"), *span, group="r")])
    attrs = gpu_attributes(cost)
    assert attrs["gpu_census.kernel.tracing"] == "100/1000"
    assert attrs["gpu_census.kernel.traced_ratio"] == 0.1
    assert attrs["gpu_census.kernel.count"] == 10 and attrs["gpu_census.copy.dtoh.bytes"] == 100_000
    full = cost_of("r", span, [dataclasses.replace(base, kernels=KernelTracing())],
                   [Interval(("r", "all"), *span, group="r")])
    attrs = gpu_attributes(full)
    assert attrs["gpu_census.kernel.tracing"] == "all" and "gpu_census.kernel.traced_ratio" not in attrs
