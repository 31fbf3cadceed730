"""Fair step shares: identical requests get identical shares whatever their place in the step, and the
requests' kernel time adds up to the steps' exactly (each step priced once, its priced time split)."""
from __future__ import annotations

import json
import random
from dataclasses import replace
from fractions import Fraction

import pytest

from otel_gpu_census.attribution.shares import ROW_WIDTH as WIDTH, Share, by_tie, carry_split
from otel_gpu_census.attribution.steps import StepLedger, step_price
from otel_gpu_census.census import KERNELS_COUNTED, DeviceTotals, KernelTracing, ProcessCensus, Stat, Step

T0 = 1_800_000_000_000_000_000
MS = 1_000_000
EVENTS = KernelTracing(KERNELS_COUNTED, events=True, events_every_eager=128, events_every_graph=1, preloaded=True)


def head(life: DeviceTotals, kernels=EVENTS, complete=T0 + 10**12) -> ProcessCensus:
    return ProcessCensus(
        path="/x.seg", pid=7, ppid=1, comm="vllm", proc_start_ticks=1, wall_start_ns=T0, wall_update_ns=T0,
        clock_ref_gpu_ns=5 * 10**9, clock_ref_wall_ns=T0, cupti_version=0, state=1, flags=0, records=0,
        records_unknown=0, dropped=0, buffers=0, buffers_refused=0, step_unmatched=0, window_late=0, step_max=0,
        last_gpu_ns=0, devices={0: life}, complete_wall_ns=complete, kernels=kernels)


def decode_steps(n_steps, rnd, eager=20, graph=30, every=128, graph_span_ns=40_000):
    """Identical decode steps: `eager` eager launches of which 1 in `every` (counted across steps) carries an
    event-pair sample, and `graph` graph kernels (their spans timed)."""
    steps, launched = {}, 0
    for sid in range(1, n_steps + 1):
        timed = sum(1 for j in range(eager) if (launched + j) % every == 0)
        launched += eager
        tns = sum(rnd.randint(4_000, 8_000) for _ in range(timed))
        steps[sid] = Step(id=sid, kernel_count=eager + graph, kernel_ns=graph * graph_span_ns + tns,
                          copies={"htod": Stat(2, 4096 + 17, 1000), "dtoh": Stat(1, 4 * 48, 700)},
                          eager_launches=eager, eager_traced=timed, eager_traced_ns=tns)
    return steps


def priced_by_hand(s: Step, life_mean: Fraction) -> int:
    """What the issue asks a step's kernel time to be: graph spans + its eager launches at its own sample's mean,
    else at the life mean, rounded to the ns."""
    mean = Fraction(s.eager_traced_ns, s.eager_traced) if s.eager_traced else life_mean
    return s.kernel_ns - s.eager_traced_ns + round(s.eager_launches * mean)


def test_identical_requests_in_identical_steps_get_equal_shares_and_the_steps_kernel_time_exactly(tagged, monkeypatch,
                                                                                                 tmp_path):
    """The issue's case: 48 identical requests share 400 identical decode steps (20 eager launches, about 1 in 128
    timed, and 30 graph kernels), listed in the same order every step, through the engine: its spans and its
    request log. Counts within one unit of the exact share; kernel time within 1 % between equal requests; the
    spans' kernel time adds up to the steps' exactly."""
    from engine_standins import Clock, in_memory_telemetry    # tests/support
    from otel_gpu_census import injector
    from otel_gpu_census.integrations.engine.steps import StepEngine

    seg = tmp_path / "gpu-census-7-1.seg"
    monkeypatch.setattr(injector, "segment_path", lambda: str(seg))
    rnd = random.Random(54)
    keys = [f"req-{i}" for i in range(48)]
    steps = decode_steps(400, rnd)
    life = DeviceTotals(device_id=0, eager_launches=10**5, eager_traced=800, eager_traced_ns=800 * 6_000 + 37)
    clock = Clock()
    census = {"complete": 0}

    def read(lo, hi):
        return (replace(head(life), complete_wall_ns=census["complete"], step_max=max(steps)),
                {i: s for i, s in steps.items() if lo <= i <= hi})
    rt, spans, _ = in_memory_telemetry("engine", metrics=False)
    eng = StepEngine(telemetry=rt, read=read, clock=clock, settle_period_s=3600)
    for k in keys:
        eng.start_request(k, start_ns=clock.t, operation="chat", model="m", headers={}, attributes={})
    for sid in steps:
        assert eng.open_step({k: 1 for k in keys}) == sid                  # the same order every step
        clock.t += 10 * MS
        eng.end_step(sid)
    for k in keys:
        eng.request_done(k, {"gen_ai.usage.output_tokens": 400})
    census["complete"] = clock.t + 10**9
    assert eng.settle() == 48
    got = [s.attributes for s in spans.get_finished_spans()]
    lines = [json.loads(x) for x in (tmp_path / "gpu-census-7-1.requests.jsonl").read_text().splitlines()]
    assert len(got) == 48 and len(lines) == 48

    exact = Fraction(400 * 50, 48)                                        # 416.67 kernels each
    counts = [a["gpu_census.kernel.count"] for a in got]
    assert all(abs(c - exact) < 1 for c in counts), (min(counts), max(counts))
    for f, per_step in (("htod.bytes", 4113), ("dtoh.bytes", 192), ("htod.count", 2)):
        assert all(abs(a[f"gpu_census.copy.{f}"] - Fraction(400 * per_step, 48)) < 1 for a in got)
    span_ns = [round(a["gpu_census.kernel.time"] * 1e9) for a in got]
    assert max(span_ns) <= 1.01 * min(span_ns), (min(span_ns), max(span_ns))
    assert all(a["gpu_census.kernel.time_estimated"] for a in got)      # an estimate says it is one
    life_mean = Fraction(life.eager_traced_ns, life.eager_traced)
    steps_ns = sum(priced_by_hand(s, life_mean) for s in steps.values())
    assert sum(span_ns) == sum(line["gpu"]["kernel.time_ns"] for line in lines) == steps_ns
    assert eng.ledger.kernel_times == {"total": (steps_ns, 0), "unattributed": (0, 0)}


def test_shares_do_not_depend_on_the_requests_place_in_the_step():
    """The same requests with unequal, fixed weights, listed to the ledger in one order or shuffled every step:
    each gets the same share either way, within one unit of its exact share, every field."""
    rnd = random.Random(3)
    keys = [f"r{i}" for i in range(24)]
    weights = {k: rnd.choice([1, 1, 2, 3, 7]) for k in keys}
    steps = {sid: Step(id=sid, kernel_count=rnd.choice([1, 5, 31]), kernel_ns=10**6 + rnd.randint(0, 999),
                       copies={"htod": Stat(rnd.choice([0, 1, 2]), rnd.choice([0, 7, 4096]), 9)})
             for sid in range(1, 301)}

    def run(shuffle):
        def read(lo, hi):
            return replace(head(DeviceTotals(device_id=0)), step_max=300), \
                {i: s for i, s in steps.items() if lo <= i <= hi}
        led = StepLedger(read, clock=lambda: T0 + 10**12)
        for sid in steps:
            order = rnd.sample(keys, len(keys)) if shuffle else keys
            led.step_opened(sid, {k: weights[k] for k in order}, T0 + sid * MS)
            led.step_touched(sid, T0 + sid * MS + 1)
        for k in keys:
            led.request_done(k, {}, T0)
        return {s.key: s.share.as_row() for s in led.settle(final=True)}
    fixed, shuffled = run(False), run(True)
    assert fixed == shuffled
    denom = sum(weights.values())
    totals = [sum(col) for col in zip(*(Share.of_step(s).as_row() for s in steps.values()))]
    for k in keys:
        for i, total in enumerate(totals):
            assert abs(fixed[k][i] - Fraction(total * weights[k], denom)) < 1, (k, i)


def test_carry_split_keeps_each_party_within_a_unit_of_its_exact_share():
    rnd = random.Random(5)
    weights = [rnd.choice([1, 1, 2, 3, 7, 1000]) for _ in range(30)]
    carries = [[0] for _ in weights]
    got, total = [0] * len(weights), 0
    for _ in range(3000):
        v = rnd.choice([1, 2, 3, 29, 10**7 + rnd.randint(0, 99)])
        parts = carry_split(v, weights, sum(weights), carries, 0)
        assert sum(parts) == v and min(parts) >= 0
        got = [g + p for g, p in zip(got, parts)]
        total += v
    assert all(abs(g - Fraction(total * w, sum(weights))) < 1 for g, w in zip(got, weights))


def test_requests_coming_and_going_keep_every_step_exact_and_shares_close():
    """Requests join and leave: each step's parts still sum to its value, none negative, and a request's total
    stays within a couple of units of its exact share (its carry went with it when it left)."""
    rnd = random.Random(9)
    live, carries, got, exact = [], {}, {}, {}
    for n in range(2000):
        if rnd.random() < 0.2 or not live:
            live.append(f"r{n}")
        if len(live) > 1 and rnd.random() < 0.15:
            live.remove(rnd.choice(live))
        w = [rnd.choice([1, 1, 1, 4]) for _ in live]
        v = rnd.choice([0, 1, 2, 3, 50])
        if not v:
            continue
        order = by_tie(live)
        w = [w[live.index(k)] for k in order]
        parts = carry_split(v, w, sum(w), [carries.setdefault(k, [0]) for k in order], 0)
        assert sum(parts) == v and min(parts) >= 0
        for k, p, x in zip(order, parts, w):
            got[k] = got.get(k, 0) + p
            exact[k] = exact.get(k, 0) + Fraction(v * x, sum(w))
    assert max(abs(got[k] - exact[k]) for k in got) < 2


def test_a_step_no_sample_or_mean_can_price_is_unknown_and_said_never_zero():
    """Counted kernels with no eager sample anywhere yet: the step's eager launches are left out of its kernel
    time (graph spans kept), counted as unpriced, and the span says its kernel time leaves them out."""
    from otel_gpu_census.attribution.ledger import GpuCost
    from otel_gpu_census.telemetry.attributes import gpu_attributes

    counted = KernelTracing(KERNELS_COUNTED, preloaded=True, events=True)
    row = [0] * WIDTH
    row[0], row[1], row[-3:] = 50, 1_200_000, [20, 0, 0]
    assert step_price(row, counted, None) == (1_200_000, 20)                 # unknown: left out, said
    assert step_price(row, counted, Fraction(6000)) == (1_200_000 + 20 * 6000, 0)
    steps = {1: Step(id=1, kernel_count=50, kernel_ns=1_200_000, eager_launches=20),
             2: Step(id=2, kernel_count=50, kernel_ns=1_200_000 + 9_000, eager_launches=20, eager_traced=1,
                     eager_traced_ns=9_000)}
    nothing = DeviceTotals(device_id=0)

    def read(lo, hi):
        return replace(head(nothing, counted), step_max=2), {i: s for i, s in steps.items() if lo <= i <= hi}
    led = StepLedger(read, clock=lambda: T0 + 10**12)
    for k in "ab":
        led.request_started(k)
    for sid in steps:
        led.step_opened(sid, {"a": 1, "b": 1}, T0 + sid * 10 * MS)
        led.step_touched(sid, T0 + sid * 10 * MS + 5 * MS)
    for k in "ab":
        led.request_done(k, {}, T0 + 40 * MS)
    got = {s.key: s for s in led.settle()}
    assert led.kernel_times["total"] == (2 * 1_200_000 + 20 * 9_000, 20)
    for s in got.values():
        kt = s.share_time()
        assert kt.unknown and kt.estimated and s.kernel_unpriced == 10
        assert kt.ns == 1_200_000 + 10 * 9_000                  # step 2 priced by its sample; step 1's eager left out
        cost = GpuCost(status="complete", method="step_tokens", share=s.share, prefill=s.prefill,
                       kernel_tracing=["counted:100/1000"], kernel_counted=True, kernel_priced=s.kernel_priced,
                       prefill_priced=s.prefill_priced)
        attrs = gpu_attributes(cost)
        assert "kernel time leaves out 10 eager kernel launches" in attrs["gpu_census.attribution.note"]
        assert attrs["gpu_census.kernel.time"] == pytest.approx(kt.ns / 1e9)


def test_carry_split_takes_back_from_the_smallest_remainders_when_carries_owe_more_than_the_step():
    """Two requests each owed nearly a unit (others took it and left) share a step of one unit: one gets it, the
    other stays owed; the parts sum to the step and none is negative."""
    one = 1 << 32
    carries = [[one - 5], [one - 9]]
    parts = carry_split(1, None, 0, carries, 0)
    assert parts == [1, 0] and sum(parts) == 1
    assert carries[0][0] == one // 2 - 5 and carries[1][0] == one + one // 2 - 9


# -- the step model (OTEL_GPU_CENSUS_ATTRIBUTION=model) -----------------------------------------------------------

def test_a_kind_fit_finds_the_step_cost_non_negative_and_robust_to_a_few_slow_steps():
    from otel_gpu_census.attribution.cost_model import MODEL_MIN_STEPS, KindFit, StepModel, attention_work
    rnd = random.Random(2)
    fit = KindFit()
    assert fit.weights([1, 1], [5, 5]) is None and "fewer than" in fit.why
    for k in range(600):
        news = [rnd.choice([1, 16, 512]) for _ in range(rnd.randint(1, 8))]
        attns = [attention_work(q, rnd.randint(0, 4000)) for q in news]
        x = StepModel.features(news, attns)
        y = 200_000 + 3_000 * x[1] + 40 * x[2] + 0.5 * x[3]
        fit.add(x, y * (10 if k % 50 == 7 else 1))                 # a slow step now and then (a stall)
        if k == MODEL_MIN_STEPS - 2:
            assert fit.coef is None
    a, b, g, d = fit.coef
    assert min(fit.coef) >= 0
    assert a == pytest.approx(200_000, rel=0.1) and b == pytest.approx(3_000, rel=0.15)
    assert g == pytest.approx(40, rel=0.1) and d == pytest.approx(0.5, rel=0.05)
    # decode: requests and tokens are the same column (collinear), and a cost that falls with context is no
    # reason for a negative coefficient: the fit keeps what it can, never below 0
    dec = KindFit()
    for k in range(200):
        ctx = [rnd.randint(0, 8000) for _ in range(8)]
        attns = [attention_work(1, c) for c in ctx]
        dec.add(StepModel.features([1] * 8, attns), 900_000 - 2 * sum(attns) / 8)
    assert dec.coef is not None and min(dec.coef) >= 0
    assert dec.weights([1] * 8, [1] * 8) is not None


def _model_ledger(steps, batches, befores, method="step_model"):

    def read(lo, hi):
        return replace(head(DeviceTotals(device_id=0), KernelTracing()), step_max=max(steps)), \
            {i: s for i, s in steps.items() if lo <= i <= hi}
    led = StepLedger(read, clock=lambda: T0 + 10**12, method=method)
    keys = sorted({k for b in batches.values() for k in b})
    for k in keys:
        led.request_started(k, 10)
    for sid in steps:
        led.step_opened(sid, dict(batches[sid]), T0 + sid * MS, before=befores[sid])
        led.step_touched(sid, T0 + sid * MS + 1)
    for k in keys:
        led.request_done(k, {}, T0)
    return led, {s.key: s for s in led.settle(final=True)}


def test_the_model_split_follows_attention_once_fitted_falls_back_to_tokens_before_and_says_so():
    """Decode steps of 8 requests, one at a long context: the step's measured time grows with attention pairs.
    Until its kind's fit is ready the steps are split by tokens (each request's span says how many); then the long
    request gets more of each step's kernel time; every field still adds up to the steps' exactly."""
    from otel_gpu_census.attribution.cost_model import MODEL_MIN_STEPS, attention_work
    from otel_gpu_census.attribution.ledger import GpuCost
    from otel_gpu_census.telemetry.attributes import gpu_attributes
    rnd = random.Random(4)
    keys = [f"q{i}" for i in range(8)]
    steps, batches, befores = {}, {}, {}
    for sid in range(1, 301):
        ctx = {k: (30_000 if k == "q0" else rnd.randint(100, 300)) + sid for k in keys}
        pairs = sum(attention_work(1, c) for c in ctx.values())
        steps[sid] = Step(id=sid, kernel_count=40, kernel_ns=500_000 + pairs * 5 + rnd.randint(0, 999),
                          copies={"htod": Stat(1, 64, 10)})
        batches[sid], befores[sid] = {k: 1 for k in keys}, ctx
    led, got = _model_ledger(steps, batches, befores)
    assert led.method == "step_model"
    total = [sum(c) for c in zip(*(s.share.as_row() for s in got.values()))]
    assert [a + u for a, u in zip(total, led.unattributed)] == led.total
    assert sum(s.share_time().ns for s in got.values()) == sum(s.kernel_ns for s in steps.values())
    # the long request's part: tokens (1/8) in the steps before the fit, then the truth's weights
    # (500 us / 8 + 5 ns a pair), which the fit must have found (up to the steps' noise)
    want = Fraction(0)
    for sid, s in steps.items():
        w = {k: Fraction(500_000, 8) + 5 * attention_work(1, c) for k, c in befores[sid].items()}
        want += Fraction(s.kernel_ns, 8) if sid <= MODEL_MIN_STEPS else s.kernel_ns * w["q0"] / sum(w.values())
    assert got["q0"].share.kernel_ns == pytest.approx(float(want), rel=0.02)
    assert got["q0"].share.kernel_ns > 2.5 * got["q1"].share.kernel_ns
    assert abs(got["q0"].share.copy("htod").bytes - 300 * 64 / 8) < 1  # copies: still by tokens
    for s in got.values():
        assert s.split_note.startswith(f"{MODEL_MIN_STEPS} of its 300 steps split by tokens, not the step model")
        cost = GpuCost(status="complete", method=led.method, note=s.split_note, share=s.share)
        assert "split by tokens" in gpu_attributes(cost)["gpu_census.attribution.note"]


def test_the_model_split_is_tokens_where_its_fit_never_gets_ready():
    """Too few steps of a kind: every step split by tokens (exactly as the tokens method would), and said."""
    keys = ["a", "b"]
    steps = {sid: Step(id=sid, kernel_count=7, kernel_ns=10_001) for sid in range(1, 11)}
    batches = {sid: {"a": 3, "b": 1} for sid in steps}
    led, got = _model_ledger(steps, batches, {sid: {"a": 0, "b": 50} for sid in steps})
    _, by_tokens = _model_ledger(steps, batches, {sid: {"a": 0, "b": 50} for sid in steps}, method="step_tokens")
    assert {k: s.share for k, s in got.items()} == {k: s.share for k, s in by_tokens.items()}
    assert abs(got["a"].share.kernel_count - Fraction(7 * 10 * 3, 4)) < 1
    for k in keys:
        assert got[k].split_note == ("10 of its 10 steps split by tokens, not the step model: fewer than 32 steps "
                                     "of its kind fitted (10)")


def test_an_engine_with_the_model_split_says_on_each_span_and_log_line_which_split_its_steps_had(tagged, monkeypatch,
                                                                                               tmp_path):
    from engine_standins import Census, Clock, in_memory_telemetry    # tests/support
    from otel_gpu_census import injector
    from otel_gpu_census.integrations.engine.steps import StepEngine

    monkeypatch.setenv("OTEL_GPU_CENSUS_ATTRIBUTION", "model")
    monkeypatch.setattr(injector, "segment_path", lambda: str(tmp_path / "gpu-census-7-1.seg"))
    clock, census = Clock(), Census()
    rt, spans, _ = in_memory_telemetry("engine", metrics=False)
    eng = StepEngine(telemetry=rt, read=census.read, clock=clock, settle_period_s=3600)
    assert eng.wants_context                                           # the hooks read each step's context
    for k in "ab":
        eng.start_request(k, start_ns=clock.t, operation="chat", model="m", headers={}, attributes={})
    for _ in range(3):
        sid = eng.open_step({"a": 1, "b": 1}, {"a": 10, "b": 5000})
        census.steps[sid] = Step(id=sid, kernel_count=9, kernel_ns=1001)
        clock.t += 10 * MS
        eng.end_step(sid)
    for k in "ab":
        eng.request_done(k, {"gen_ai.usage.output_tokens": 3})
    census.complete = clock.t + 10**9
    assert eng.settle() == 2
    lines = [json.loads(x) for x in (tmp_path / "gpu-census-7-1.requests.jsonl").read_text().splitlines()]
    for a in (s.attributes for s in spans.get_finished_spans()):
        assert a["gpu_census.attribution.method"] == "step_model"
        assert "3 of its 3 steps split by tokens, not the step model" in a["gpu_census.attribution.note"]
        assert a["gpu_census.attribution.status"] == "complete"           # a fallback misses no work
    assert all(line["split_note"].startswith("3 of its 3 steps split by tokens") for line in lines)
