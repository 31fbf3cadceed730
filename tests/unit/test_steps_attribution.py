"""The split of engine steps among requests by scheduled tokens: exact conservation, settling only
once the census is complete, and what happens to requests the census is late for."""
from __future__ import annotations

import random
from fractions import Fraction
from dataclasses import replace

import pytest

from otel_gpu_census.attribution.shares import ROW_WIDTH as WIDTH, Share, split_weights
from otel_gpu_census.census import Stat, Step
from otel_gpu_census.attribution.steps import PRICED, RING_SLOTS, StepLedger, split_step


class FakeCensus:
    """Stands in for reader.read_steps over one segment: steps appear as the 'census' completes."""

    def __init__(self):
        self.steps = {}
        self.complete = 0
        self.alive = True
        self.step_max = None                # the largest step id the census has records of (None: not said)

    def head(self):
        class H:
            pass
        h = H()
        h.complete_wall_ns, h.alive, h.state_name = self.complete, self.alive, "active"
        h.pid, h.gaps = 42, list(getattr(self, "gaps", []))
        if self.step_max is not None:
            h.step_max = self.step_max
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


def test_split_step_is_exact_by_largest_remainder_and_carries_what_rounding_owes():
    parts = dict(split_step([10, 7] + [0] * (WIDTH - 2), {"a": 1, "b": 2, "c": 0, "d": 3}))
    assert set(parts) == {"a", "b", "d"}                      # 0 tokens: no share
    assert [parts[k][0] for k in "abd"] == [2, 3, 5]          # 10 * (1, 2, 3) / 6 = 1.67, 3.33, 5
    assert [parts[k][1] for k in "abd"] == [1, 2, 4]          # 7 * (1,2,3)/6 = 1.17, 2.33, 3.5 -> +1 to d
    # equal weights: a tie goes by the request, not its place: the same parts whatever the order
    eq = dict(split_step([5] + [0] * (WIDTH - 1), {"x": 1, "y": 1, "z": 1}))
    assert dict(split_step([5] + [0] * (WIDTH - 1), {"z": 1, "y": 1, "x": 1})) == eq
    assert sorted(eq[k][0] for k in "xyz") == [1, 2, 2]
    # carried: over three steps of 5 each gets its 5 exactly, the one short a unit first owed it next
    carries: dict = {}
    got = {k: 0 for k in "xyz"}
    for _ in range(3):
        for k, p in split_step([5] + [0] * (WIDTH - 1), {"x": 1, "y": 1, "z": 1}, carries):
            got[k] += p[0]
    assert got == {"x": 5, "y": 5, "z": 5}


def test_each_requests_share_is_the_sum_of_its_split_step_parts():
    """The ledger splits on a step's non-zero fields only (its hot path); every request must still
    get exactly what split_step, the reference, gives it step by step, decode steps and mixed ones."""
    rnd = random.Random(11)
    census = FakeCensus()
    clock = [1_000_000_000]
    led = StepLedger(census.read, clock=lambda: clock[0])
    want = {}
    carries: dict = {}
    keys = [f"r{i}" for i in range(40)]
    for sid in range(1, 200):
        live = rnd.sample(keys, rnd.randint(1, 40))
        decode = rnd.random() < 0.6
        tokens = {k: 1 if decode else rnd.choice([0, 1, 3, 17, 200]) for k in live}
        led.step_opened(sid, tokens, clock[0])
        clock[0] += 10_000_000
        led.step_touched(sid, clock[0])
        st = step(sid, rnd.randint(0, 900), rnd.randint(0, 10**7), rnd.choice([0, 4000, 131073]),
                  rnd.choice([0, 64 << 20]))
        census.steps[sid] = st
        for k, part in split_step(flat(Share(st.kernel_count, st.kernel_ns, dict(st.copies), st.memset)), tokens,
                                  carries):
            want[k] = [a + b for a, b in zip(want.get(k, [0] * WIDTH), part)]
    for k in keys:
        led.request_done(k, {"key": k}, clock[0])
    census.complete = clock[0] + 10**9
    got = {s.key: flat(s.share) for s in led.settle()}
    assert {k: v for k, v in got.items() if any(v)} == {k: v for k, v in want.items() if any(v)}
    assert not any(led.unattributed)


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


def test_a_step_the_ring_no_longer_holds_is_counted_missing_and_its_requests_say_partial():
    census = FakeCensus()
    led = StepLedger(census.read, clock=lambda: 5 * 10**9, follows=True)
    for k in "ab":
        led.request_started(k)
    led.step_opened(1, {"a": 1}, 10**9); led.step_touched(1, 10**9)
    led.step_opened(2, {"a": 1, "b": 1}, 10**9); led.step_touched(2, 10**9)
    census.steps[2] = Step(id=2, kernel_count=4, kernel_ns=400)
    led.request_done("a", None, 10**9)
    led.request_done("b", None, 10**9)
    census.complete = 4 * 10**9
    a, b = sorted(led.settle(), key=lambda s: s.key)
    assert led.steps_missing == 1 and a.share.kernel_count == 2 and b.share.kernel_count == 2
    assert a.status == "partial" and b.status == "complete" and not b.notes
    assert a.notes == ["1 steps that served it are missing from its share (no records of them came); 1 were split"]


def test_a_census_that_knows_it_missed_work_makes_every_share_partial_and_says_what():
    """The default census counted calls of a driver function it cannot size: the shares are exact for what it saw,
    and say so (status partial, the gap in the notes) rather than complete."""
    census = FakeCensus()
    led = StepLedger(census.read, clock=lambda: 5 * 10**9, follows=True)
    led.request_started("a")
    led.step_opened(1, {"a": 1}, 10**9); led.step_touched(1, 10**9)
    census.steps[1] = Step(id=1, kernel_count=4, kernel_ns=400)
    led.request_done("a", None, 10**9)
    census.complete = 4 * 10**9
    census.gaps = ["3 calls of cuMemcpyFutureAsync the census could not size"]
    (a,) = led.settle()
    assert a.status == "partial" and a.share.kernel_count == 4
    assert a.notes == ["the census missed work in this server (pid 42: 3 calls of cuMemcpyFutureAsync the census "
                       "could not size)"]


def test_a_step_lapped_by_the_ring_says_so():
    census = FakeCensus()
    led = StepLedger(census.read, clock=lambda: 5 * 10**9, follows=True)
    led.request_started("a")
    led.step_opened(1, {"a": 1}, 10**9); led.step_touched(1, 10**9)
    led.request_done("a", None, 10**9)
    census.complete = 4 * 10**9
    census.step_max = 1 + RING_SLOTS                          # a step a whole ring later has records
    (a,) = led.settle()
    assert a.status == "partial" and "step ring (1024 slots, shared with sub-steps) was reused" in a.notes[0]


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


def test_a_guessed_claim_makes_every_share_of_its_sub_step_partial_and_says_why():
    """A claim whose size the integration could not read weighs a guess: the sub-step's bytes stay whole,
    but each request's part of them is approximate, and every request it was split among says so."""
    census = FakeCensus()
    clock = [10**9]
    led = StepLedger(census.read, clock=lambda: clock[0])
    for k in "abc":
        led.request_started(k)
    led.step_opened(1, {}, clock[0], kind="kv_store")
    led.step_claimed(1, "a", 3)
    led.step_claimed(1, "b", 1, guessed="b's block count could not be read")
    led.step_touched(1, clock[0])
    led.step_opened(2, {}, clock[0], kind="kv_store")
    led.step_claimed(2, "a", 2)                                 # a second sub-step: one note, not two
    led.step_claimed(2, "c", 2)
    led.step_touched(2, clock[0])
    census.steps[1] = step(1, 0, 0, dtoh_bytes=4000)
    census.steps[2] = step(2, 0, 0, dtoh_bytes=400)
    for k in "abc":
        led.request_done(k, k, clock[0])
    census.complete = clock[0] + 10**9
    got = {x.key: x for x in led.settle()}
    assert got["a"].status == got["b"].status == "partial"
    assert got["a"].notes == ["its share of kv_store sub-steps is approximate (b's block count could not be read)"]
    assert got["a"].notes == got["b"].notes
    assert got["c"].status == "complete" and got["c"].notes == []
    assert [got[k].sub.copy("dtoh").bytes for k in "abc"] == [3000 + 200, 1000, 200]     # conserved
    assert led.partial == 2


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
        assert per["total"][:WIDTH] == want
        assert per["total"][PRICED] == want[1]          # kernel time priced per step: as measured (traced whole)
    assert [a + b + u for a, b, u in zip(flat(got["a"].share), flat(got["b"].share), led.unattributed)] == led.total
    # 2 steps a rank of 8 and 7 kernels split 3:1, one carry a request across ranks and steps: a is within a
    # unit of its exact 22.5
    assert got["a"].share.kernel_count + got["b"].share.kernel_count == 30
    assert got["a"].share.kernel_count in (22, 23)


# -- sampled kernel tracing: how much of each request's steps' time kernels were traced ---------------

MS = 1_000_000
T0 = 1_800_000_000_000_000_000          # wall ns; the census's CUPTI clock reads GPU0 then


def census_head(kernels=None, pid=7, gpu0=5 * 10**9):
    """A real ProcessCensus header, its clock pair (GPU0 <-> T0) and kernel tracing as given (every kernel traced
    unless given)."""
    from otel_gpu_census.census import KernelTracing, ProcessCensus
    return ProcessCensus(
        path="/x.seg", pid=pid, ppid=1, comm="vllm", proc_start_ticks=1, wall_start_ns=T0, wall_update_ns=T0,
        clock_ref_gpu_ns=gpu0, clock_ref_wall_ns=T0, cupti_version=130500, state=1, flags=0, records=0,
        records_unknown=0, dropped=0, buffers=0, buffers_refused=0, step_unmatched=0, window_late=0, step_max=0,
        last_gpu_ns=0, devices={},
        kernels=kernels or KernelTracing())


class HeadCensus(FakeCensus):
    """FakeCensus whose header is a real ProcessCensus (its kernel tracing and clock pair)."""

    def __init__(self, head):
        super().__init__()
        self.base = head

    def head(self):   # step_max: the largest step id it counted, as a segment says
        return replace(self.base, complete_wall_ns=self.complete, alive=self.alive,
                       step_max=max(self.steps, default=0))


def test_steps_the_census_has_seen_nothing_of_wait_for_one_more_flush_all_together():
    """CUPTI's periodic flush keeps back a buffer holding a record still in flight, and the census is
    complete past its steps all the same: a step the census has counted nothing of, nor of any later
    step (step_max), waits for the next flush; then every such step goes, present or missing."""
    census = HeadCensus(census_head())
    led = StepLedger(census.read, clock=lambda: census.complete)
    for sid in range(1, 41):
        led.step_opened(sid, {"a": 1}, sid * 10**7); led.step_touched(sid, sid * 10**7 + 10**6)
    led.request_done("a", None, 41 * 10**7)
    census.steps[1] = step(1, 4, 400)
    census.complete = 2 * 10**9                                 # past every step; 2..40 not in it
    assert led.settle() == [] and led.settle() == [] and led.settled_sid == 1
    census.steps.update({sid: step(sid, 4, 400) for sid in range(2, 21)})   # the held buffer
    census.complete = 3 * 10**9                                 # 21..40 never came: lost, and said so
    (a,) = led.settle()
    assert (a.steps, a.share.kernel_count, a.status) == (20, 80, "partial") and led.steps_missing == 20


# -- the FLOPs split: attention grows with context, linear layers with tokens ------------------------------

from types import SimpleNamespace  # noqa: E402

from otel_gpu_census.attribution.cost_model import FIT_MIN_STEPS, CostFit, ModelShape, step_weights  # noqa: E402
from otel_gpu_census.attribution.steps import ALONE_METHOD, FLOPS_METHOD, METHOD, step_kernel_ns  # noqa: E402

LLAMA = SimpleNamespace(num_hidden_layers=8, hidden_size=1024, num_attention_heads=16, num_key_value_heads=8,
                        intermediate_size=4096, vocab_size=32000, hidden_act="silu")


def test_a_models_flops_follow_its_shape():
    s = ModelShape.of(LLAMA)
    assert (s.layers, s.hidden, s.q_dim, s.kv_dim, s.intermediate, s.vocab, s.gated) == (8, 1024, 1024, 512, 4096, 32000, True)
    assert s.linear_flops == 2 * 8 * (2 * 1024 * 1024 + 2 * 1024 * 512 + 3 * 1024 * 4096)
    assert s.pair_flops == 4 * 8 * 1024 and s.head_flops == 2 * 1024 * 32000
    # a decode token at 32k context: 32k + 1 keys; at 2k: 2k + 1 (the 16x of attention the token split ignores)
    att = lambda before: s.flops(1, before, 1) - s.linear_flops - s.head_flops
    assert att(32768) == (32768 + 1) * s.pair_flops and att(2048) == (2048 + 1) * s.pair_flops
    # a prefill chunk late in a prompt does more attention than the same chunk at its start
    assert s.flops(512, 4096, 0) - s.flops(512, 0, 0) == 512 * 4096 * s.pair_flops
    # only a token sampled pays the output layer: not a prompt chunk that ends short of the prompt
    assert step_weights(s, ["a", "b"], {"a": 512, "b": 512}, {"a": 0, "b": 512}, {"a": 1024, "b": 1024}) == [
        s.flops(512, 0, 0), s.flops(512, 512, 1)]
    assert ModelShape.of(SimpleNamespace(hidden_size=8)) is None and ModelShape.of(None) is None
    moe = ModelShape.of(SimpleNamespace(**vars(LLAMA), num_experts_per_tok=2, moe_intermediate_size=512))
    assert moe.intermediate == 1024


def flops_ledger(census, shape=True):
    led = StepLedger(census.read, clock=lambda: 5 * 10**9, follows=True, method=FLOPS_METHOD)
    if shape:
        led.set_shape(ModelShape.of(LLAMA))
    for k, prompt in (("short", 64), ("long", 8192), ("new", 2048)):
        led.request_started(k, prompt)
    return led


def test_the_flops_split_gives_long_contexts_more_kernel_time_and_conserves_every_field():
    census = FakeCensus()
    led = flops_ledger(census)
    tokens, before = {"short": 1, "long": 1, "new": 512}, {"short": 100, "long": 30000, "new": 0}
    led.step_opened(1, dict(tokens), 10**9, before=before); led.step_touched(1, 10**9)
    census.steps[1] = step(1, 1001, 9_876_543, dtoh_bytes=3001, htod_bytes=514 * 8 + 1)
    for k in tokens:
        led.request_done(k, None, 10**9)
    census.complete = 4 * 10**9
    got = {s.key: s for s in led.settle()}
    shape = ModelShape.of(LLAMA)
    w = step_weights(shape, list(tokens), tokens, before, {"short": 64, "long": 8192, "new": 2048})
    assert [got[k].share.kernel_ns for k in tokens] == split_weights(9_876_543, w, sum(w))
    assert got["long"].share.kernel_ns > got["short"].share.kernel_ns      # one token each, 300x the context
    assert [got[k].share.copy("htod").bytes for k in tokens] == split_weights(514 * 8 + 1, [1, 1, 512], 514)
    row = flat(Share.of_step(census.steps[1]))
    assert [sum(c) for c in zip(*(flat(s.share) for s in got.values()))] == row
    assert led.method == FLOPS_METHOD and all(s.status == "complete" for s in got.values())


def test_without_a_model_shape_the_flops_ledger_splits_by_tokens_and_says_so():
    census = FakeCensus()
    led = flops_ledger(census, shape=False)
    led.step_opened(1, {"short": 1, "long": 3}, 10**9, before={"short": 5, "long": 9000}); led.step_touched(1, 10**9)
    census.steps[1] = step(1, 4, 400)
    led.request_done("short", None, 10**9); led.request_done("long", None, 10**9)
    census.complete = 4 * 10**9
    got = {s.key: s.share.kernel_ns for s in led.settle()}
    assert got == {"short": 100, "long": 300} and led.method == METHOD


def test_the_split_is_one_setting_and_a_bad_value_says_so(caplog):
    from otel_gpu_census.integrations.engine.steps import ATTRIBUTION_ENV, attribution_method
    assert attribution_method({}) == METHOD and attribution_method({ATTRIBUTION_ENV: " Flops "}) == FLOPS_METHOD
    assert attribution_method({ATTRIBUTION_ENV: "alone"}) == ALONE_METHOD
    assert attribution_method({ATTRIBUTION_ENV: "model"}) == "step_model"
    assert attribution_method({ATTRIBUTION_ENV: "time"}) == METHOD and "not one of tokens | flops | alone | model" in \
        caplog.text


def test_a_step_for_a_request_the_ledger_no_longer_follows_is_nobodys_not_a_lost_share():
    """A request settled (or never announced) that a later step still names: that part is unattributed,
    not kept for a share nobody will read."""
    census = FakeCensus()
    led = StepLedger(census.read, clock=lambda: 5 * 10**9, follows=True)
    led.request_started("a")
    led.step_opened(1, {"a": 1}, 10**9); led.step_touched(1, 10**9)
    census.steps[1] = step(1, 2, 200)
    led.request_done("a", None, 10**9)
    census.complete = 4 * 10**9
    (a,) = led.settle()
    led.step_opened(2, {"a": 1, "ghost": 1}, 2 * 10**9); led.step_touched(2, 2 * 10**9)
    census.steps[2] = step(2, 6, 600)
    assert led.settle() == [] and led._acc == {}
    assert led.unattributed[0] == 6 and led.total[0] == 8 and a.share.kernel_count == 2


def test_steps_forgotten_because_the_census_lagged_make_their_requests_partial(monkeypatch):
    from otel_gpu_census.attribution import steps as st
    monkeypatch.setattr(st, "MAX_BOOK", 3)
    census = FakeCensus()
    led = StepLedger(census.read, clock=lambda: 5 * 10**9, follows=True)
    led.request_started("a")
    for sid in range(1, 6):
        led.step_opened(sid, {"a": 1}, 10**9); led.step_touched(sid, 10**9)
        census.steps[sid] = step(sid, 1, 100)
    led.request_done("a", None, 10**9)
    census.complete = 4 * 10**9
    (a,) = led.settle()
    assert led.steps_dropped == 2 and a.steps == 3 and a.share.kernel_count == 3 and a.status == "partial"
    assert a.notes == ["2 steps that served it were forgotten unsplit (the census lagged more than 3 steps behind)"]


def test_the_alone_split_weighs_each_part_by_its_flops_plus_the_fixed_cost_fitted_on_the_steps():
    """Steps that cost 2,000,000 ns plus 1 ns a 1,000 FLOPs: until FIT_MIN_STEPS steps are fitted the split is
    by FLOPs; after, each request weighs its FLOPs plus the fitted fixed part (2e9 FLOPs' worth), so a one-token
    decode beside a long prefill chunk gets far more than its FLOPs' share, and every field still conserves."""
    census = FakeCensus()
    led = StepLedger(census.read, clock=lambda: 5 * 10**9, follows=True, method=ALONE_METHOD)
    shape = ModelShape.of(LLAMA)
    led.set_shape(shape)
    fixed_ns = 2_000_000
    keys = [f"r{i}" for i in range(FIT_MIN_STEPS + 1)]
    for i, k in enumerate(keys):                 # one request a step, of growing size: the fit's points
        led.request_started(k, 4096)
        n = 64 * (i + 1)
        f = shape.flops(n, 0, 0)
        led.step_opened(i + 1, {k: n}, 10**9, before={k: 0}); led.step_touched(i + 1, 10**9)
        census.steps[i + 1] = step(i + 1, 10, fixed_ns + f // 1000)
    sid = len(keys) + 1
    tokens, before = {"decode": 1, "prefill": 512}, {"decode": 100, "prefill": 0}
    for k, prompt in (("decode", 64), ("prefill", 2048)):
        led.request_started(k, prompt)
    led.step_opened(sid, dict(tokens), 10**9, before=before); led.step_touched(sid, 10**9)
    both = step_weights(shape, list(tokens), tokens, before, {"decode": 64, "prefill": 2048})
    kns = fixed_ns + sum(both) // 1000 + 7                  # on the fitted line (the fit takes this step in too)
    census.steps[sid] = step(sid, 1001, kns, htod_bytes=513)
    for k in keys + list(tokens):
        led.request_done(k, None, 10**9)
    census.complete = 4 * 10**9
    got = {s.key: s for s in led.settle()}
    fixed = led.fit.fixed_flops()
    assert abs(fixed - fixed_ns * 1000) < 1e-3 * fixed_ns * 1000          # intercept / slope, in FLOPs
    w = [x + fixed for x in both]
    assert [got[k].share.kernel_ns for k in tokens] == split_weights(kns, w, sum(w))
    assert got["decode"].share.kernel_ns > 5 * both[0] / sum(both) * kns    # far above its FLOPs' part
    assert [got[k].share.copy("htod").bytes for k in tokens] == split_weights(513, [1, 512], 513)   # copies: tokens
    assert led.method == ALONE_METHOD and all(s.status == "complete" for s in got.values())


def test_the_fit_says_nothing_until_it_can_and_equal_shares_where_no_cost_grows_with_flops():
    fit = CostFit()
    for i in range(FIT_MIN_STEPS - 1):
        fit.add(1000 * (i + 1), 500 + i)
    assert fit.fixed_flops() is None                                   # too few steps
    fit.add(10**6, 10)
    fit.add(10**6, 10)
    assert fit.fixed_flops() is not None
    flat_fit = CostFit()
    for i in range(FIT_MIN_STEPS):
        flat_fit.add(1000 * (i + 1), 700 - i)       # cost falls as FLOPs grow: nothing to weigh
    assert flat_fit.fixed_flops() == -1
    tiny = CostFit()                    # a slope next to nothing: equal shares, not an OverflowError
    for i in range(FIT_MIN_STEPS):
        tiny.add(1000 * (i + 1), 5000)
    tiny.cxx, tiny.cxy = 1.0, 1e-320    # fixed / per_flop = 5000 / 1e-320: inf in floats
    assert tiny.fixed_flops() == -1
    # untimed eager launches are priced at the timed ones' mean: 10 launches, 2 timed for 300 ns -> 150 each
    assert step_kernel_ns([1, 1000, *([0] * (WIDTH - 5)), 10, 2, 300], None) == 1000 + 8 * 150
    # none timed in the step: the processes' mean over their life, as a request's share gets
    assert step_kernel_ns([1, 1000, *([0] * (WIDTH - 5)), 10, 0, 0], Fraction(200)) == 1000 + 10 * 200
