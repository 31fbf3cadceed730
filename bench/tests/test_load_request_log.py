"""load.py's request log: the load's requests on the wall clock, as `report --request-log` reads them."""
from __future__ import annotations

import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH / "server"))
sys.path.insert(0, str(BENCH.parent / "src"))
import load  # noqa: E402

from otel_gpu_census.report.request_log import parse  # noqa: E402


def test_request_log_places_the_load_on_the_wall_clock():
    now = time.monotonic()
    rs = [{"i": 0, "client": 0, "start": now - 2.0, "end": now - 1.0, "ttft_s": 0.25, "tokens_out": 4, "e2e_s": 1.0},
          {"i": 1, "client": 1, "start": now - 1.5, "end": now - 0.5, "tokens_out": 4, "e2e_s": 1.0,
           "error": "HTTP 500"}]
    before = time.time_ns()
    res = load.summarise(rs)
    recs = parse(load.request_log(res))
    assert len(recs) == 2
    a, b = recs
    assert a.end_ns - a.start_ns == 1_000_000_000 and a.first_token_ns - a.start_ns == 250_000_000
    assert b.start_ns - a.start_ns == 500_000_000 and b.first_token_ns is None
    # the first request started 2 s before summarise ran, on the wall clock (within the rounding and the call)
    assert abs((before - a.start_ns) - 2_000_000_000) < 50_000_000


def test_no_anchor_no_log():
    assert load.request_log({"per_request": [{"start": 0.0, "end": 1.0}]}) == []
