"""CPU test of bench/server/sampled_error.py: a sampled request's estimate is its counted kernel time over
the traced share of its life, compared with the median of the round's exact phase."""
from __future__ import annotations

import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench" / "server"))
import sampled_error  # noqa: E402
from otel_gpu_census.census import KERNELS_SAMPLED, KernelTracing  # noqa: E402

S = 1_000_000_000


def req(start, end, kernel_ns):
    return {"start_time_unix_nano": start, "end_time_unix_nano": end, "status": "complete",
            "gpu": {"kernel.time_ns": kernel_ns}}


def test_estimates_scale_by_the_traced_share_and_compare_with_the_exact_phase():
    # 100 ms traced of every 1 s from 0; wall and CUPTI clocks equal
    census = types.SimpleNamespace(kernels=KernelTracing(mode=KERNELS_SAMPLED, on_ms=100, period_ms=1000,
                                                         origin_gpu_ns=0),
                                   wall_to_gpu_ns=lambda w: w)
    rounds = [{"launch": {"t0_ns": 0, "t1_ns": 10 * S}, "sampled": {"t0_ns": 10 * S, "t1_ns": 20 * S}}]
    log = [req(1 * S, 3 * S, 100), req(4 * S, 6 * S, 110), req(7 * S, 9 * S, 90),      # exact: median 100
           req(10 * S, 12 * S, 20),             # 2 windows of 100 ms in 2 s: ratio 0.1 -> 200 (error 1.0)
           req(12 * S, 14 * S, 10),             # -> 100 (error 0)
           req(14 * S + S // 2, 14 * S + 9 * S // 10, 5)]   # no traced window in its life: no estimate
    got = sampled_error.analyse(rounds, log, census, "sampled", "launch")
    assert got["sampled_requests_without_a_traced_window"] == 1
    assert got["relative_error_of_estimates"] == {"n": 2, "p50": 1.0, "p90": 1.0, "max": 1.0}
    assert got["relative_spread_of_exact_requests"]["max"] == 0.1
    assert got["rounds"][0]["exact_median_ns"] == 100 and got["median_estimate_over_exact"] == 1.5
