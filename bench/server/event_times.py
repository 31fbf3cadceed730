"""Per-request event times, compactly: what bench/server/load.py records for every streamed request
and the readers of its results (bench/perf/proxy_steps.py, which must run without aiohttp) decode."""
from __future__ import annotations

from typing import List, Optional


def encode_times(ts: List[float], t0: float) -> str:
    """Times (monotonic s) as ms after t0 for the first, then ms steps, comma-separated ints.

    About 3 characters an event; rounding does not accumulate (each step is taken between rounded
    absolute times), so decode_times is within 0.5 ms of every original time."""
    out, prev = [], 0
    for t in ts:
        ms = round((t - t0) * 1000)
        out.append(ms - prev)
        prev = ms
    return ",".join(map(str, out))


def decode_times(s: Optional[str]) -> List[float]:
    """Inverse of encode_times: seconds after t0."""
    if not s:
        return []
    out, acc = [], 0
    for d in s.split(","):
        acc += int(d)
        out.append(acc / 1000)
    return out
