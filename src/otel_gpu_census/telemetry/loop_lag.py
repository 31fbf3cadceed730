"""How late an asyncio event loop runs what is ready: a probe that sleeps a fixed interval on the loop
and records how much later than asked it woke up.

A wake-up is late by however long the loop was busy with something else (a callback doing work on
the loop, or the loop's thread waiting for the GIL while another thread of the process runs Python:
a span exporter, a census read handed to a worker thread). Every stream the proxy relays waits the
same: a lag of 20 ms is 20 ms added to whatever chunk was ready at that moment.

Off by default (``otel-gpu-census proxy --loop-lag-probe MS``); it costs one wake-up per interval
(~20-40 µs of CPU each: at 20 ms, ~0.1-0.2 % of a core). The figures since the last reset are what
:meth:`LoopLagProbe.stats` returns and what the proxy serves at ``LOOP_LAG_PATH``.
"""
from __future__ import annotations

import asyncio
import time
from array import array
from typing import Dict, Optional

MAX_SAMPLES = 1_000_000        # kept between resets (8 MB); beyond that only count and max grow
THRESHOLDS_MS = (5, 20, 100)   # how many wake-ups were at least this late


def _quantile(xs, q: float) -> float:
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


class LoopLagProbe:
    """Sleeps `interval_s` at a time on the running loop; each wake-up's lateness is one sample."""

    def __init__(self, interval_s: float = 0.02, clock=time.monotonic):
        if not interval_s > 0:
            raise ValueError(f"loop lag probe interval must be > 0 s, got {interval_s}")
        self.interval_s = interval_s
        self._clock = clock
        self._task: Optional[asyncio.Task] = None
        self.reset()

    def reset(self) -> None:
        self._lags = array("d")
        self._count = 0
        self._max = 0.0
        self._since = self._clock()

    def record(self, lag_s: float) -> None:
        lag_s = max(0.0, lag_s)
        self._count += 1
        if lag_s > self._max:
            self._max = lag_s
        if len(self._lags) < MAX_SAMPLES:
            self._lags.append(lag_s)

    def start(self) -> "LoopLagProbe":
        """Start on the running loop (call from a coroutine)."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="loop-lag-probe")
        return self

    async def _run(self) -> None:
        clock, interval = self._clock, self.interval_s
        while True:
            asked = clock() + interval
            await asyncio.sleep(interval)
            self.record(clock() - asked)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def stats(self, reset: bool = False) -> Dict[str, object]:
        """Since the last reset: wake-ups, how late they were (ms: p50, p90, p99, p99.9, max, mean) and
        how many were at least 5, 20 and 100 ms late; `seconds` the time covered."""
        xs = sorted(self._lags)
        out: Dict[str, object] = {"interval_ms": round(self.interval_s * 1000, 3), "wakeups": self._count,
                                  "seconds": round(self._clock() - self._since, 3)}
        if xs:
            ms = 1000.0
            out.update({"p50_ms": round(_quantile(xs, 0.5) * ms, 3), "p90_ms": round(_quantile(xs, 0.9) * ms, 3),
                        "p99_ms": round(_quantile(xs, 0.99) * ms, 3),
                        "p999_ms": round(_quantile(xs, 0.999) * ms, 3),
                        "max_ms": round(self._max * ms, 3), "mean_ms": round(sum(xs) / len(xs) * ms, 3)})
            for t in THRESHOLDS_MS:
                out[f"over_{t}ms"] = len(xs) - _bisect(xs, t / ms)
            # wall time the probe saw stolen: lateness summed (what every ready stream waited, at most)
            out["late_total_ms"] = round(sum(xs) * ms, 1)
        if reset:
            self.reset()
        return out


def _bisect(xs, v: float) -> int:
    """How many of the sorted `xs` are below `v`."""
    lo, hi = 0, len(xs)
    while lo < hi:
        mid = (lo + hi) // 2
        if xs[mid] < v:
            lo = mid + 1
        else:
            hi = mid
    return lo
