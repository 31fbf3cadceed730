"""The split of engine steps among requests by scheduled tokens: exact conservation, settling only
once the census is complete, and what happens to requests the census is late for."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from otel_gpu_census.attribution.shares import ROW_WIDTH as WIDTH, Share
from otel_gpu_census.census import Stat, Step
from otel_gpu_census.attribution.steps import StepLedger, split_step


class FakeCensus:
    """Stands in for reader.read_steps over one segment: steps appear as the 'census' completes."""

    def __init__(self):
        self.steps = {}
        self.complete = 0
        self.alive = True

    def head(self):
        class H:
            pass
        h = H()
        h.complete_wall_ns, h.alive, h.state_name = self.complete, self.alive, "active"
        return h

    def read(self, lo, hi):
        return self.head(), {i: s for i, s in self.steps.items() if lo <= i <= hi}


def step(sid, kernels, kns, dtoh_bytes=0, htod_bytes=0):
    copies = {}
    if dtoh_bytes:
        copies["dtoh"] = Stat(1, dtoh_bytes, 1000)
    if htod_bytes:
        copies["htod"] = Stat(2, htod_bytes, 3000)
    return Step(id=sid, kernel_count=kernels, kernel_ns=kns, copies=copies)


def flat(sh: Share):
    return sh.as_row()


def test_split_step_is_exact_by_largest_remainder():
    parts = dict(split_step([10, 7] + [0] * (WIDTH - 2), {"a": 1, "b": 2, "c": 0, "d": 3}))
    assert set(parts) == {"a", "b", "d"}                      # 0 tokens: no share
    assert [parts[k][0] for k in "abd"] == [2, 3, 5]          # 10 * (1, 2, 3) / 6 = 1.67, 3.33, 5
    assert [parts[k][1] for k in "abd"] == [1, 2, 4]          # 7 * (1,2,3)/6 = 1.17, 2.33, 3.5 -> +1 to d
    eq = dict(split_step([5] + [0] * (WIDTH - 1), {"x": 1, "y": 1, "z": 1}))
    assert [eq[k][0] for k in "xyz"] == [2, 2, 1]             # equal weights: ties to the earlier


def test_every_field_is_conserved_across_requests_and_unclaimed_steps():
    rnd = random.Random(7)
    census = FakeCensus()
    clock = [1_000_000_000]
    led = StepLedger(census.read, clock=lambda: clock[0])
    live = {}
    ended = []
    settled = []
    for sid in range(1, 400):
        if rnd.random() < 0.3 or not live:
            live[f"r{sid}"] = 0
        tokens = {k: rnd.choice([1, 1, 1, 17, 200]) for k in live} if rnd.random() > 0.05 else {}
        led.step_opened(sid, tokens, clock[0])
        clock[0] += 10_000_000
        led.step_touched(sid, clock[0])
        census.steps[sid] = step(sid, rnd.randint(1, 900), rnd.randint(1, 10**7),
                                 rnd.choice([0, 4000, 131072]), rnd.choice([0, 0, 64 << 20]))
        for k in list(live):
            if rnd.random() < 0.05:
                del live[k]
                led.request_done(k, {"key": k}, clock[0])
                ended.append(k)
        if sid % 25 == 0:
            census.complete = clock[0] - 300_000_000             # the census lags ~0.3 s
            settled += led.settle()
    for k in live:
        led.request_done(k, {"key": k}, clock[0])
    census.complete = clock[0] + 10**9
    settled += led.settle()
    assert led.pending() == 0 and len(settled) == len(ended) + len(live)
    assert all(s.status == "complete" for s in settled)
    total_steps = [0] * WIDTH
    for s in census.steps.values():
        for i, v in enumerate(flat(Share(s.kernel_count, s.kernel_ns, dict(s.copies), s.memset))):
            total_steps[i] += v
    shares = [0] * WIDTH
    for s in settled:
        for i, v in enumerate(flat(s.share)):
            shares[i] += v
        assert all(p <= v for p, v in zip(flat(s.prefill), flat(s.share)))
    assert led.total == total_steps
    assert [a + b for a, b in zip(shares, led.unattributed)] == total_steps
    assert any(led.unattributed)                               # the steps that served nobody


def test_a_request_waits_for_the_census_and_a_late_census_leaves_it_stale_but_conserved():
    census = FakeCensus()
    clock = [10**9]
    led = StepLedger(census.read, clock=lambda: clock[0], max_wait_ns=2 * 10**9)
    led.step_opened(1, {"a": 5, "b": 5}, clock[0]); led.step_touched(1, clock[0] + 10**7)
    census.steps[1] = step(1, 10, 1000)
    led.first_token("a", clock[0] + 2 * 10**7)
    led.request_done("a", "facts-a", clock[0] + 2 * 10**7)
    assert led.settle() == []                                   # census not complete yet
    census.complete = clock[0] + 10**9
    (a,) = led.settle()
    assert a.key == "a" and a.status == "complete" and a.share.kernel_count == 5 and a.steps == 1
    assert a.prefill.kernel_count == 5                          # its one step began before its first token
    # b goes on into step 2, ends, and the census stops completing: b closes stale after max_wait
    led.step_opened(2, {"b": 1}, clock[0] + 10**9); led.step_touched(2, clock[0] + 10**9 + 10**7)
    led.request_done("b", "facts-b", clock[0] + 10**9 + 10**7)
    clock[0] += 4 * 10**9
    (b,) = led.settle()
    assert b.status == "stale" and b.share.kernel_count == 5 and b.notes
    census.steps[2] = step(2, 3, 30)
    census.complete = clock[0] + 10**9
    assert led.settle() == []
    assert led.unattributed[0] == 3                             # b's late part: counted, unclaimed
    assert led.total[0] == 13


def test_a_step_the_ring_no_longer_holds_is_counted_missing():
    census = FakeCensus()
    led = StepLedger(census.read, clock=lambda: 5 * 10**9)
    led.step_opened(1, {"a": 1}, 10**9); led.step_touched(1, 10**9)
    led.request_done("a", None, 10**9)
    census.complete = 4 * 10**9
    (a,) = led.settle()
    assert led.steps_missing == 1 and a.share == Share() and a.status == "complete"
