"""Share a process's GPU activity among the requests that were in flight when it ran, by time window.

The census counts GPU work in 20 ms buckets of the CUPTI clock (``census.Window``); a proxy in
front of a server that cannot be hooked (llama-server, Ollama) knows only when each request was in
flight, in wall-clock time. This module joins the two, exactly and without guessing more than it must.

The rule, for one bucket whose wall-clock span is [bs, be) (mapped with
``ProcessCensus.gpu_to_wall_ns``), length L = be - bs:

1. Activity inside a bucket is taken as spread evenly over the bucket: the census does not know
   where inside those 20 ms a record started.
2. Cut the bucket at every request start and end. In a piece of length l during which k > 0
   requests are in flight, each of them is owed l / (k·L) of the bucket; with k = 0 the piece's
   l / L is *unattributed*. A request's fraction of a bucket is the sum over its pieces, so two
   requests in flight through the whole bucket get half each, and a request in flight for 5 ms of
   a bucket it had to itself gets a quarter (the rest is unattributed).
3. Every integer in the bucket (kernel count, kernel ns, copy count/bytes/ns per direction, memset)
   is split by those fractions with the largest-remainder method: each party gets the floor of its
   exact share, and the units left over go one each to the largest fractional parts (ties: in an order
   drawn afresh for every bucket from the start of the request each party belongs to and the bucket, never
   their arrival order, so no request takes the ties of every bucket it shares, and anyone who knows the
   requests' times splits a bucket alike; unattributed last; ``shares.split_weights``). Shares are
   integers and sum exactly to the bucket's value.

Conservation, therefore, per bucket and over any set of buckets:
``sum(shares) + unattributed == sum of the buckets``, for every field.

A request may be given as several intervals that share a ``group`` (e.g. its prefill and its decode
phase). Concurrency k counts distinct groups, so phases do not dilute each other or other requests;
the group's part of a piece goes to its interval(s) covering that piece.

An interval with ``end_ns=None`` is still in flight: it covers everything after its start. That is
what makes the split stable: a request finalised while another is still running computes the same
shares for the buckets they share as the other will compute when it finishes, provided both see the
same set of intervals for those buckets (callers keep recent intervals until nobody needs them).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from math import gcd
from typing import Callable, Dict, Hashable, Iterable, List, Optional, Sequence, Tuple

from otel_gpu_census.census import Window
from otel_gpu_census.attribution.shares import NOTHING, ROW_WIDTH, Share, draw, split_weights

METHOD = "time_window_shared"
"""Value of ``GpuCost.method`` (span attribute ``gpu_census.attribution.method``) for this rule."""

UNATTRIBUTED = object()
"""Party key of the activity no request can claim (never a valid request key)."""


@dataclass(frozen=True)
class Interval:
    """A request (or one phase of it) in flight over [start_ns, end_ns) of the wall clock."""

    key: Hashable
    start_ns: int
    end_ns: Optional[int] = None       # None: still in flight
    group: Optional[Hashable] = None   # the request it belongs to; defaults to key

    @property
    def owner(self) -> Hashable:
        return self.key if self.group is None else self.group

    def covers(self, a: int, b: int) -> bool:
        """True when the interval covers all of [a, b)."""
        return self.start_ns <= a and (self.end_ns is None or self.end_ns >= b)

    def overlaps(self, a: int, b: int) -> bool:
        return self.start_ns < b and (self.end_ns is None or self.end_ns > a)


@dataclass
class Attribution:
    """The split of a set of buckets: per key, the remainder, and what the buckets held."""

    shares: Dict[Hashable, Share]
    unattributed: Share
    total: Share
    buckets: int = 0
    concurrency_max: Dict[Hashable, int] = field(default_factory=dict)  # most groups seen at once

    def share(self, key: Hashable) -> Share:
        return self.shares.get(key, NOTHING)

    def group_share(self, keys: Iterable[Hashable]) -> Share:
        out = NOTHING
        for k in keys:
            out = out + self.share(k)
        return out


def bucket_weights(bs: int, be: int, intervals: Sequence[Interval]
                   ) -> Tuple[Dict[Hashable, int], int, int, int]:
    """Integer form of :func:`bucket_fractions`: (weight per key, unattributed weight, denominator,
    most groups in flight at once); the weights and the unattributed weight sum to the denominator."""
    length = be - bs
    if length <= 0:
        raise ValueError(f"empty bucket [{bs}, {be})")
    live = [iv for iv in intervals if iv.start_ns < be and (iv.end_ns is None or iv.end_ns > bs)]
    cuts = {bs, be}
    for iv in live:
        if bs < iv.start_ns < be:
            cuts.add(iv.start_ns)
        if iv.end_ns is not None and bs < iv.end_ns < be:
            cuts.add(iv.end_ns)
    points = sorted(cuts)
    # A piece of length l shared by k groups owes each member of a group of m intervals l / (k·m)
    # of the bucket; one common multiple of the divisors k·m makes every share a whole number.
    pieces = []
    lcm = 1
    most = 0
    for a, b in zip(points, points[1:]):
        groups: Dict[Hashable, List[Hashable]] = {}
        for iv in live:
            if iv.start_ns <= a and (iv.end_ns is None or iv.end_ns >= b):
                groups.setdefault(iv.owner, []).append(iv.key)
        k = len(groups)
        most = max(most, k)
        members = []
        for keys in groups.values():
            d = k * len(keys)
            lcm = lcm * d // gcd(lcm, d)
            members.extend((key, d) for key in keys)
        pieces.append((b - a, members))
    weights: Dict[Hashable, int] = {}
    unattributed = 0
    for piece, members in pieces:
        if not members:
            unattributed += piece * lcm
        for key, d in members:
            weights[key] = weights.get(key, 0) + piece * (lcm // d)
    return weights, unattributed, length * lcm, most


def bucket_fractions(bs: int, be: int, intervals: Sequence[Interval]
                     ) -> Tuple[Dict[Hashable, Fraction], Fraction, int]:
    """Fractions of bucket [bs, be) owed to each interval key, the unattributed fraction, and the
    largest number of groups in flight at once inside the bucket."""
    weights, rest, denom, most = bucket_weights(bs, be, intervals)
    return {k: Fraction(w, denom) for k, w in weights.items()}, Fraction(rest, denom), most


def _split_bucket(values: Sequence[int], bs: int, be: int, ivs: Sequence[Interval],
                  order: Dict[Hashable, Tuple[int, int]]):
    """One bucket: (parties, indices of the non-zero fields, each party's parts of those fields, the
    unattributed parts, most groups at once). Parties are listed, and so break ties, by a draw from their
    request's start and the bucket (`order`: key -> (that start, interval order)), then from its key (requests that
    started together), then by interval order (never reached: keys are unique)."""
    weights, rest, denom, k = bucket_weights(bs, be, ivs)
    parties = sorted(weights, key=lambda p: (draw(order[p][0], bs), draw(p, bs), order[p][1]))
    ws = [weights[p] for p in parties] + [rest]
    nz = [i for i, v in enumerate(values) if v]
    columns = [split_weights(values[i], ws, denom) for i in nz]
    parts = [[col[j] for col in columns] for j in range(len(parties))]
    return parties, nz, parts, [col[-1] for col in columns], k


def attribute(windows: Iterable[Window], to_wall: Callable[[int], int],
              intervals: Iterable[Interval], cache: Optional[Dict] = None,
              keys: Optional[Iterable[Hashable]] = None) -> Attribution:
    """Split every bucket in `windows` among `intervals` by the rule in the module docstring.

    `to_wall` maps a CUPTI timestamp to wall-clock ns (``ProcessCensus.gpu_to_wall_ns``).
    Keys of `intervals` must be unique. `cache`, a dict kept by the caller, remembers each
    bucket's split by its wall span, values and the intervals that touch it: a caller that
    attributes many requests sharing buckets splits each bucket once. With `keys`, only those
    keys' shares (and concurrency) are summed; totals and the unattributed part are always whole.
    """
    ivs = list(intervals)
    starts: Dict[Hashable, int] = {}
    for iv in ivs:
        starts[iv.owner] = min(starts.get(iv.owner, iv.start_ns), iv.start_ns)
    order = {iv.key: (starts[iv.owner], i) for i, iv in enumerate(ivs)}
    if len(order) != len(ivs):
        raise ValueError("interval keys must be unique")
    wanted = None if keys is None else set(keys)
    sums: Dict[Hashable, List[int]] = {}
    rest = [0] * ROW_WIDTH
    total = [0] * ROW_WIDTH
    most: Dict[Hashable, int] = {}
    n = 0
    for w in windows:
        n += 1
        bs, be = to_wall(w.start_ns), to_wall(w.end_ns)
        values = Share.of_window(w).as_row()
        live = [iv for iv in ivs if iv.start_ns < be and (iv.end_ns is None or iv.end_ns > bs)]
        if cache is not None:
            # The same values and the same ordered intervals, as seen inside the bucket, give the same
            # split, ties included: a start before the bucket or an end after it (or none yet) counts
            # only as "covers that edge", so a request ending later does not undo splits made earlier.
            key = (bs, be, tuple(values), tuple((iv.key, iv.group, iv.start_ns if iv.start_ns > bs else None,
                                                 iv.end_ns if iv.end_ns is not None and iv.end_ns < be else None)
                                                for iv in live))
            hit = cache.get(key)
            if hit is None:
                hit = cache[key] = _split_bucket(values, bs, be, live, order)
            parties, nz, parts, unowned, k = hit
        else:
            parties, nz, parts, unowned, k = _split_bucket(values, bs, be, live, order)
        for i, x in zip(nz, unowned):
            total[i] += values[i]
            rest[i] += x
        for key, row in zip(parties, parts):
            if wanted is not None and key not in wanted:
                continue
            acc = sums.get(key)
            if acc is None:
                acc = sums[key] = [0] * ROW_WIDTH
            for i, x in zip(nz, row):
                acc[i] += x
            most[key] = max(most.get(key, 0), k)
    return Attribution(
        shares={key: Share.from_row(v) for key, v in sums.items()},
        unattributed=Share.from_row(rest),
        total=Share.from_row(total),
        buckets=n,
        concurrency_max=most,
    )
