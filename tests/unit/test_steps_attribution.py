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


# -- sub-steps: GPU work inside a step owned by the requests it names (KV-offload transfers) ----------

def test_sub_steps_go_to_the_requests_they_claim_by_weight_and_every_field_conserves():
    """Random steps, each with up to two sub-steps (stores, loads) claiming live, finished-and-awaiting,
    already settled and unknown requests; the census lags. Every unit of every field ends up in one
    request or unclaimed; a sub-step's work goes only to requests it claimed, by their weights."""
    rnd = random.Random(11)
    census = FakeCensus()
    clock = [1_000_000_000]
    led = StepLedger(census.read, clock=lambda: clock[0], max_wait_ns=10**12)
    live, gone, settled = {}, [], []
    claims = {}                      # sub-step id -> {key: weight}
    sid = 0
    for _ in range(300):
        if rnd.random() < 0.3 or not live:
            k = f"r{sid}"
            live[k] = 0
            led.request_started(k)
        sid += 1
        step_id = sid
        led.step_opened(step_id, {k: rnd.choice([1, 1, 16, 100]) for k in live}, clock[0])
        census.steps[step_id] = step(step_id, rnd.randint(1, 500), rnd.randint(1, 10**6), rnd.choice([0, 4000]))
        for kind in ("kv_store", "kv_load"):
            if rnd.random() < 0.5:
                continue
            sid += 1
            led.step_opened(sid, {}, clock[0], kind=kind)
            pool = list(live) + gone[-3:] + ["never-started"]
            claims[sid] = {}
            for k in rnd.sample(pool, min(len(pool), rnd.randint(1, 3))):
                w = rnd.randint(1, 9)
                led.step_claimed(sid, k, w)
                claims[sid][k] = claims[sid].get(k, 0) + w
            led.step_touched(sid, clock[0])
            census.steps[sid] = step(sid, 0, 0, dtoh_bytes=rnd.randint(1, 10**6) if kind == "kv_store" else 0,
                                     htod_bytes=rnd.randint(1, 10**6) if kind == "kv_load" else 0)
        clock[0] += 10_000_000
        led.step_touched(step_id, clock[0])
        for k in list(live):
            if rnd.random() < 0.06:
                del live[k]
                gone.append(k)
                led.request_done(k, None, clock[0], awaiting=rnd.random() < 0.5)
        if step_id % 20 == 0:
            census.complete = clock[0] - 300_000_000
            settled += led.settle()
    for k in list(live):
        led.request_done(k, None, clock[0])
    census.complete = clock[0] + 10**9
    settled += led.settle(final=True)
    by_key = {s.key: s for s in settled}
    assert set(by_key) == set(gone) | {k for k in live}
    total = [sum(col) for col in zip(*[flat(Share(s.kernel_count, s.kernel_ns, dict(s.copies))) for s in census.steps.values()])]
    shares = [sum(col) for col in zip(*[flat(s.share) for s in settled])]
    assert led.total == total
    assert [a + b for a, b in zip(shares, led.unattributed)] == total
    sub_total = [sum(col) for col in zip(*[flat(Share(s.kernel_count, s.kernel_ns, dict(s.copies)))
                                           for i, s in census.steps.items() if i in claims])]
    assert led.sub_total == sub_total and led.sub_steps == len(claims)
    claimed = {k for c in claims.values() for k in c}
    for s in settled:
        assert all(p <= v for p, v in zip(flat(s.sub), flat(s.share)))
        if s.key not in claimed:
            assert s.sub == Share() and s.weights == {}
        assert s.steps <= 300                                   # sub-steps are not counted as steps
    assert any(s.sub.copy("dtoh").bytes for s in settled) and any(led.unattributed)   # "never-started"


def test_a_request_awaiting_its_transfer_settles_after_it_and_gets_it():
    census = FakeCensus()
    clock = [10**9]
    led = StepLedger(census.read, clock=lambda: clock[0], max_wait_ns=3 * 10**9)
    for k in "ab":
        led.request_started(k)
    led.step_opened(1, {"a": 1, "b": 1}, clock[0]); led.step_touched(1, clock[0])
    census.steps[1] = step(1, 10, 100)
    led.request_done("a", "fa", clock[0], awaiting=True)      # its store goes out next step
    led.request_done("b", "fb", clock[0], awaiting=True)      # ... and never does
    census.complete = clock[0] + 10**9
    assert led.settle() == []
    led.step_opened(2, {}, clock[0] + 10**7, kind="kv_store")
    led.step_claimed(2, "a", 4)
    led.step_touched(2, clock[0] + 10**7)
    led.step_claimed(2, "a", 99)                                # closed: no more claims
    census.steps[2] = step(2, 0, 0, dtoh_bytes=4096)
    (a,) = led.settle()
    assert a.key == "a" and a.status == "complete" and a.sub.copy("dtoh").bytes == 4096
    assert a.weights == {"kv_store": 4} and a.steps == 1 and a.share.kernel_count == 5
    clock[0] += 4 * 10**9                                       # b waited past max_wait: stale, conserved
    (b,) = led.settle()
    assert b.status == "stale" and "waiting for a transfer" in b.notes[0] and b.share.kernel_count == 5
    led.step_opened(3, {}, clock[0], kind="kv_store")
    led.step_claimed(3, "b", 2)                                 # too late for b: unclaimed
    led.step_touched(3, clock[0])
    census.steps[3] = step(3, 0, 0, dtoh_bytes=777)
    census.complete = clock[0] + 10**9
    assert led.settle() == []
    assert Share.from_row(led.unattributed).copy("dtoh").bytes == 777


def test_several_processes_run_the_same_steps_each_split_alike_and_conserved_per_process():
    """Tensor parallel: every rank runs step n under id n; a request's share is the sum over ranks."""
    ranks = {101: FakeCensus(), 102: FakeCensus()}

    def read(lo, hi):
        out = []
        for pid, c in ranks.items():
            h, steps = c.read(lo, hi)
            h.pid = pid
            out.append((h, steps))
        return out
    led = StepLedger(read, clock=lambda: 10**9)
    for sid in (1, 2, 3):
        led.step_opened(sid, {"a": 3, "b": 1} if sid < 3 else {}, 10**9); led.step_touched(sid, 10**9)
        for pid, c in ranks.items():
            c.steps[sid] = step(sid, 7 + pid % 2, 1000 * sid, dtoh_bytes=pid)
    led.request_done("a", None, 10**9); led.request_done("b", None, 10**9)
    ranks[101].complete = 10**10
    assert led.settle() == []                                   # rank 102 not complete yet
    ranks[102].complete = 10**10
    got = {s.key: s for s in led.settle()}
    assert got["a"].steps == 2 and got["b"].steps == 2          # steps counted once, not per rank
    for pid in ranks:
        per = led.per_process[pid]
        want = [sum(col) for col in zip(*[flat(Share(s.kernel_count, s.kernel_ns, dict(s.copies)))
                                          for s in ranks[pid].steps.values()])]
        assert per["total"] == want
    assert [a + b + u for a, b, u in zip(flat(got["a"].share), flat(got["b"].share), led.unattributed)] == led.total
    # 2 steps a rank; rank 101's 8 kernels split 6/2, rank 102's 7 split 5/2 (largest remainder)
    assert got["a"].share.kernel_count == 2 * 6 + 2 * 5 and got["b"].share.kernel_count == 2 * 2 + 2 * 2
