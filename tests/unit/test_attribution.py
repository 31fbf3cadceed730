"""The attribution rule: shares of each 20 ms bucket by overlap time, integers conserved exactly."""
import random
from fractions import Fraction

import pytest

from otel_gpu_census.attribution import (
    Interval, Share, attribute, bucket_fractions, split_integer,
)
from otel_gpu_census.census import DIRECTIONS, Stat, Window
from otel_gpu_census.attribution.shares import draw

MS = 1_000_000
B = 20 * MS  # bucket width


def win(i, kernels=0, kns=0, dtoh=(0, 0, 0), htod=(0, 0, 0), memset=(0, 0, 0)):
    copies = {}
    if any(dtoh):
        copies["dtoh"] = Stat(*dtoh)
    if any(htod):
        copies["htod"] = Stat(*htod)
    return Window(i * B, (i + 1) * B, kernel_count=kernels, kernel_ns=kns, copies=copies,
                  memset=Stat(*memset), device_mask=1)


def ident(ns):
    return ns


def test_split_integer_sums_exactly_and_breaks_ties_in_order():
    assert split_integer(10, [Fraction(1, 3)] * 3) == [4, 3, 3]
    assert split_integer(2, [Fraction(1, 3)] * 3) == [1, 1, 0]
    assert split_integer(7, [Fraction(1, 2), Fraction(0), Fraction(1, 2)]) == [4, 0, 3]
    assert split_integer(0, [Fraction(1)]) == [0]
    rnd = random.Random(1)
    for _ in range(200):
        n = rnd.randint(1, 6)
        raw = [rnd.randint(0, 9) for _ in range(n)]
        if sum(raw) == 0:
            raw[0] = 1
        fr = [Fraction(r, sum(raw)) for r in raw]
        total = rnd.randint(0, 10**12)
        parts = split_integer(total, fr)
        assert sum(parts) == total
        for p, f in zip(parts, fr):
            assert abs(p - total * f) < 1          # never more than one unit from the exact share
            if f == 0:
                assert p == 0


def test_one_request_covering_everything_owns_everything():
    ws = [win(0, 3, 900, dtoh=(2, 1000, 50)), win(1, 1, 100, htod=(1, 7, 3))]
    a = attribute(ws, ident, [Interval("r", 0, 2 * B)])
    assert a.share("r") == a.total
    assert a.unattributed.is_zero()
    assert a.total.copy("dtoh") == Stat(2, 1000, 50)
    assert a.buckets == 2
    assert a.concurrency_max["r"] == 1


def test_no_request_in_flight_means_all_unattributed():
    ws = [win(5, 4, 400, dtoh=(1, 99, 1))]
    a = attribute(ws, ident, [Interval("early", 0, 5 * B), Interval("late", 6 * B, 7 * B)])
    assert a.shares == {}
    assert a.unattributed == a.total
    assert a.unattributed.copy("dtoh").bytes == 99


def test_two_requests_through_the_whole_bucket_split_evenly_odd_byte_to_one():
    ws = [win(0, 3, 1001, dtoh=(1, 4097, 11))]
    a = attribute(ws, ident, [Interval("a", -B, 2 * B), Interval("b", 0, None)])
    sa, sb = a.share("a"), a.share("b")
    assert sorted([sa.copy("dtoh").bytes, sb.copy("dtoh").bytes]) == [2048, 2049]
    assert sa.kernel_count + sb.kernel_count == 3
    assert sorted([sa.kernel_ns, sb.kernel_ns]) == [500, 501]
    assert a.unattributed.is_zero()
    assert a.concurrency_max == {"a": 2, "b": 2}


def test_ties_do_not_go_to_the_first_request_in_every_bucket():
    """Two requests through 400 buckets of an odd count each: the odd unit goes by a draw per bucket, not to the
    request that came first, so each gets about half of the odd units."""
    ws = [win(i, 1, 1000) for i in range(400)]
    a = attribute(ws, ident, [Interval("a", -B, None), Interval("b", -B, None)])
    assert a.share("a").kernel_count + a.share("b").kernel_count == 400
    assert 150 < a.share("a").kernel_count < 250          # first-in-order took all 400 before


def test_partial_overlap_leaves_the_idle_part_unattributed():
    # in flight for the last 5 ms of the bucket only: a quarter of it
    ws = [win(0, dtoh=(0, 4000, 0))]
    a = attribute(ws, ident, [Interval("r", 15 * MS, 40 * MS)])
    assert a.share("r").copy("dtoh").bytes == 1000
    assert a.unattributed.copy("dtoh").bytes == 3000


def test_weighting_by_overlap_time():
    # a: whole bucket; b: second half. First half a alone, second half shared -> a 3/4, b 1/4.
    ws = [win(0, kns=8000, dtoh=(0, 800, 0))]
    a = attribute(ws, ident, [Interval("a", 0, B), Interval("b", B // 2, B)])
    assert a.share("a").copy("dtoh").bytes == 600
    assert a.share("b").copy("dtoh").bytes == 200
    assert a.share("a").kernel_ns == 6000 and a.share("b").kernel_ns == 2000


def test_wall_mapping_is_applied():
    # the CUPTI clock is 1 s behind wall: bucket 0 is wall [1 s, 1 s + 20 ms)
    ws = [win(0, dtoh=(0, 100, 0))]
    a = attribute(ws, lambda g: g + 1_000_000_000, [Interval("r", 0, B)])
    assert a.shares == {} and a.unattributed.copy("dtoh").bytes == 100
    a = attribute(ws, lambda g: g + 1_000_000_000, [Interval("r", 1_000_000_000, 1_000_000_000 + B)])
    assert a.share("r").copy("dtoh").bytes == 100


def test_phases_of_one_request_do_not_count_as_concurrency():
    ws = [win(0, dtoh=(0, 1000, 0))]
    ivs = [Interval(("a", "prefill"), 0, B // 2, group="a"), Interval(("a", "decode"), B // 2, B, group="a"),
           Interval("b", 0, B)]
    a = attribute(ws, ident, ivs)
    pre, dec = a.share(("a", "prefill")), a.share(("a", "decode"))
    assert pre.copy("dtoh").bytes == 250 and dec.copy("dtoh").bytes == 250
    assert a.share("b").copy("dtoh").bytes == 500
    assert a.group_share([("a", "prefill"), ("a", "decode")]).copy("dtoh").bytes == 500
    assert a.concurrency_max[("a", "prefill")] == 2


def test_open_interval_gives_the_same_split_as_its_later_end():
    ws = [win(i, kernels=i + 1, kns=333 * i, dtoh=(1, 1000 + i, 7)) for i in range(6)]
    before = attribute(ws[:3], ident, [Interval("a", 0, 50 * MS), Interval("b", 10 * MS, None)])
    after = attribute(ws[:3], ident, [Interval("a", 0, 50 * MS), Interval("b", 10 * MS, 110 * MS)])
    assert before.share("a") == after.share("a")
    assert before.share("b") == after.share("b")


def test_duplicate_keys_rejected_and_empty_bucket_rejected():
    with pytest.raises(ValueError):
        attribute([win(0)], ident, [Interval("a", 0, 1), Interval("a", 2, 3)])
    with pytest.raises(ValueError):
        bucket_fractions(5, 5, [])


def test_bucket_fractions_sum_to_one():
    owed, rest, k = bucket_fractions(0, 100, [Interval("a", 10, 60), Interval("b", 40, 90),
                                              Interval("c", 50, 55)])
    assert sum(owed.values()) + rest == 1
    assert rest == Fraction(20, 100)            # [0,10) and [90,100)
    assert k == 3
    # a: [10,40) alone 30, [40,50) half 5, [50,55) third 5/3, [55,60) half 2.5
    assert owed["a"] == Fraction(30 + 5, 100) + Fraction(5, 300) + Fraction(5, 200)


@pytest.mark.parametrize("seed", range(25))
def test_conservation_on_random_workloads(seed):
    rnd = random.Random(seed)
    ws = []
    for i in sorted(rnd.sample(range(60), rnd.randint(1, 40))):
        copies = {d: Stat(rnd.randint(0, 5), rnd.randint(0, 10**9), rnd.randint(0, 10**6))
                  for d in rnd.sample(DIRECTIONS, rnd.randint(0, 3))}
        ws.append(Window(i * B, (i + 1) * B, rnd.randint(0, 500), rnd.randint(0, 10**8), copies,
                         Stat(rnd.randint(0, 3), rnd.randint(0, 10**6), rnd.randint(0, 1000)), 1))
    ivs = []
    for j in range(rnd.randint(0, 12)):
        s = rnd.randint(-B, 60 * B)
        e = None if rnd.random() < 0.15 else s + rnd.randint(1, 30 * B)
        ivs.append(Interval(f"r{j}", s, e))
    offset = rnd.randint(-10**12, 10**12)
    a = attribute(ws, lambda g: g + offset, [Interval(iv.key, iv.start_ns + offset,
                                                      None if iv.end_ns is None else iv.end_ns + offset)
                                              for iv in ivs])
    summed = a.unattributed
    for s in a.shares.values():
        summed = summed + s
    expect = Share()
    for w in ws:
        expect = expect + Share.of_window(w)
    assert summed == a.total == expect
    for s in a.shares.values():   # nothing negative, nobody gets more than exists
        assert all(v >= 0 for v in s.as_row())


def _reference(windows, to_wall, intervals):
    """The rule written the slow, obvious way, with exact fractions: what attribute() must equal."""
    width = len(Share().as_row())
    shares, rest, most = {}, [0] * width, {}
    for w in windows:
        bs, be = to_wall(w.start_ns), to_wall(w.end_ns)
        owed, unowned, k = {}, Fraction(0), 0
        points = sorted({bs, be} | {t for iv in intervals for t in (iv.start_ns, iv.end_ns)
                                    if t is not None and bs < t < be})
        for a, b in zip(points, points[1:]):
            inside = [iv for iv in intervals if iv.covers(a, b)]
            groups = {}
            for iv in inside:
                groups.setdefault(iv.owner, []).append(iv)
            piece = Fraction(b - a, be - bs)
            k = max(k, len(groups))
            if not groups:
                unowned += piece
            for members in groups.values():
                for iv in members:
                    owed[iv.key] = owed.get(iv.key, 0) + piece / len(groups) / len(members)
        start = {}                 # ties: by a draw per bucket from the party's request's start, then its key
        for iv in intervals:
            start[iv.owner] = min(start.get(iv.owner, iv.start_ns), iv.start_ns)
        began = {iv.key: start[iv.owner] for iv in intervals}
        parties = sorted((iv.key for iv in intervals if iv.key in owed),
                         key=lambda k: (draw(began[k], bs), draw(k, bs), [iv.key for iv in intervals].index(k)))
        for key in parties:        # the most groups at once anywhere in a bucket the party was in
            most[key] = max(most.get(key, 0), k)
        fr = [owed[k] for k in parties] + [unowned]
        for i, v in enumerate(Share.of_window(w).as_row()):
            exact = [v * f for f in fr]
            parts = [e.numerator // e.denominator for e in exact]
            for j in sorted(range(len(fr)), key=lambda j: (-(exact[j] - parts[j]), j))[:v - sum(parts)]:
                parts[j] += 1
            for k, p in zip(parties, parts):
                shares.setdefault(k, [0] * width)[i] += p
            rest[i] += parts[-1]
    return {k: Share.from_row(v) for k, v in shares.items()}, Share.from_row(rest), most


@pytest.mark.parametrize("seed", range(20))
def test_integer_split_equals_the_exact_rule_with_and_without_the_cache(seed):
    rnd = random.Random(100 + seed)
    ws = [Window(i * B, (i + 1) * B, rnd.randint(0, 50), rnd.randint(0, 10**7),
                 {d: Stat(rnd.randint(1, 5), rnd.randint(0, 10**9), rnd.randint(0, 10**6))
                  for d in rnd.sample(DIRECTIONS, rnd.randint(0, 3))},
                 Stat(rnd.randint(0, 2), rnd.randint(0, 999), rnd.randint(0, 99)), 1) for i in range(40)]
    ivs = []
    for j in range(rnd.randint(1, 14)):
        s = rnd.randint(-B, 40 * B)
        e = None if rnd.random() < 0.2 else s + rnd.randint(1, 20 * B)
        if e is not None and rnd.random() < 0.6:         # two phases of one request
            ft = rnd.randint(s, e)
            ivs += [Interval((j, "prefill"), s, ft, group=j), Interval((j, "decode"), ft, e, group=j)]
        else:
            ivs.append(Interval(j, s, e))
    shares, rest, most = _reference(ws, ident, ivs)
    a = attribute(ws, ident, ivs)
    assert a.shares == shares and a.unattributed == rest and a.concurrency_max == most
    # a cache shared by calls over different subsets of the buckets changes nothing, and `keys`
    # limits the shares summed to those keys
    cache = {}
    for lo in range(0, 40, 7):
        sub = ws[lo:lo + 13]
        mine = [iv.key for iv in ivs[:2]]
        got = attribute(sub, ident, ivs, cache=cache, keys=mine)
        ref_shares, ref_rest, _ = _reference(sub, ident, ivs)
        assert got.unattributed == ref_rest
        assert got.shares == {k: v for k, v in ref_shares.items() if k in mine}
    assert cache


def test_a_cached_split_survives_a_request_ending_after_the_bucket():
    ws = [win(i, kernels=3, kns=1000 + i, dtoh=(1, 4097 + i, 11)) for i in range(5)]
    cache = {}
    running = [Interval("a", 0, None), Interval("b", B // 3, None)]
    first = attribute(ws, ident, running, cache=cache)
    n = len(cache)
    # b ends inside bucket 4: only that bucket is split again; a ends after every bucket: nothing new
    ended = [Interval("a", 0, 10 * B), Interval("b", B // 3, 4 * B + B // 2)]
    again = attribute(ws[:4], ident, ended, cache=cache)
    assert len(cache) == n
    assert again.share("b") == attribute(ws[:4], ident, running).share("b")
    attribute(ws, ident, ended, cache=cache)
    assert len(cache) == n + 1
    assert first.share("a") != again.share("a")     # (different bucket sets: the cache is per bucket)
