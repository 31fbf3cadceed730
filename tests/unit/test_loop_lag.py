"""The event-loop lag probe: a callback that holds the loop shows up as one late wake-up of about
its length; an idle loop's wake-ups are on time; reset starts a new period."""
from __future__ import annotations

import asyncio
import time

import pytest

from otel_gpu_census.telemetry.loop_lag import LoopLagProbe


def test_a_blocking_callback_is_one_late_wakeup_of_its_length():
    async def main():
        probe = LoopLagProbe(0.005).start()
        await asyncio.sleep(0.1)
        idle = probe.stats(reset=True)
        time.sleep(0.08)                     # holds the loop, as blocking work on it would
        await asyncio.sleep(0.05)
        busy = probe.stats()
        probe.stop()
        return idle, busy
    idle, busy = asyncio.run(main())
    assert idle["wakeups"] >= 5 and idle["max_ms"] < 40, idle
    assert busy["max_ms"] >= 70, busy                # the wake-up due during the 80 ms block
    assert busy["over_20ms"] >= 1 and busy["over_100ms"] == 0, busy
    assert busy["p50_ms"] < 40, busy                 # the other wake-ups were on time
    assert busy["seconds"] < idle["seconds"] + 1


def test_record_and_quantiles():
    t = [0.0]
    probe = LoopLagProbe(0.01, clock=lambda: t[0])
    for ms in list(range(100)) + [250]:
        probe.record(ms / 1000)
    probe.record(-0.001)                             # early (clock granularity): counts as on time
    t[0] = 2.0
    s = probe.stats(reset=True)
    assert s["wakeups"] == 102 and s["max_ms"] == 250.0 and s["seconds"] == 2.0
    assert s["over_5ms"] == 96 and s["over_20ms"] == 81 and s["over_100ms"] == 1
    assert s["p50_ms"] == pytest.approx(49.5, abs=1) and s["p99_ms"] == pytest.approx(99, abs=1)
    after = probe.stats()
    assert after["wakeups"] == 0 and "max_ms" not in after


def test_interval_must_be_positive():
    with pytest.raises(ValueError):
        LoopLagProbe(0)
