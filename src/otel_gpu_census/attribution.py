"""Share a process's GPU activity among the requests that were in flight when it ran.

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
   exact share, and the units left over go one each to the largest fractional parts (ties: earlier
   party first, unattributed last). Shares are integers and sum exactly to the bucket's value.

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
from typing import Callable, Dict, Hashable, Iterable, List, Optional, Sequence, Tuple

from .census import DIRECTIONS, ZERO, Stat, Window

METHOD = "time_window_shared"
"""Value of the span attribute ``gpu.attribution.method`` for this rule."""

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


@dataclass(frozen=True)
class Share:
    """Integer GPU activity owned by one party: the same fields a census Window carries."""

    kernel_count: int = 0
    kernel_ns: int = 0
    copies: Dict[str, Stat] = field(default_factory=dict)    # by direction; absent means zero
    memset: Stat = ZERO

    @classmethod
    def of_window(cls, w: Window) -> "Share":
        return cls(w.kernel_count, w.kernel_ns, {d: s for d, s in w.copies.items() if s != ZERO}, w.memset)

    def copy(self, direction: str) -> Stat:
        return self.copies.get(direction, ZERO)

    def __add__(self, o: "Share") -> "Share":
        copies = dict(self.copies)
        for d, s in o.copies.items():
            copies[d] = copies.get(d, ZERO) + s
        return Share(self.kernel_count + o.kernel_count, self.kernel_ns + o.kernel_ns,
                     {d: s for d, s in copies.items() if s != ZERO}, self.memset + o.memset)

    def is_zero(self) -> bool:
        return (self.kernel_count == 0 and self.kernel_ns == 0 and self.memset == ZERO
                and all(s == ZERO for s in self.copies.values()))

    # Flattened view for splitting: a fixed order of (name, value) pairs.
    def _flat(self) -> List[int]:
        out = [self.kernel_count, self.kernel_ns]
        for d in DIRECTIONS:
            s = self.copy(d)
            out += [s.count, s.bytes, s.ns]
        out += [self.memset.count, self.memset.bytes, self.memset.ns]
        return out

    @classmethod
    def _unflat(cls, v: Sequence[int]) -> "Share":
        copies = {}
        for i, d in enumerate(DIRECTIONS):
            s = Stat(*v[2 + 3 * i: 5 + 3 * i])
            if s != ZERO:
                copies[d] = s
        m = 2 + 3 * len(DIRECTIONS)
        return cls(v[0], v[1], copies, Stat(*v[m:m + 3]))


NOTHING = Share()


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


def split_integer(total: int, fractions: Sequence[Fraction]) -> List[int]:
    """Split `total` into integers proportional to `fractions` (which sum to 1), by largest remainder.

    Ties in the fractional part go to the earlier entry. The result sums exactly to `total`.
    """
    if total == 0:
        return [0] * len(fractions)
    exact = [total * f for f in fractions]
    floors = [e.numerator // e.denominator for e in exact]
    left = total - sum(floors)
    order = sorted(range(len(exact)), key=lambda i: (-(exact[i] - floors[i]), i))
    for i in order[:left]:
        floors[i] += 1
    return floors


def bucket_fractions(bs: int, be: int, intervals: Sequence[Interval]
                     ) -> Tuple[Dict[Hashable, Fraction], Fraction, int]:
    """Fractions of bucket [bs, be) owed to each interval key, the unattributed fraction, and the
    largest number of groups in flight at once inside the bucket."""
    length = be - bs
    if length <= 0:
        raise ValueError(f"empty bucket [{bs}, {be})")
    live = [iv for iv in intervals if iv.overlaps(bs, be)]
    cuts = {bs, be}
    for iv in live:
        if bs < iv.start_ns < be:
            cuts.add(iv.start_ns)
        if iv.end_ns is not None and bs < iv.end_ns < be:
            cuts.add(iv.end_ns)
    points = sorted(cuts)
    owed: Dict[Hashable, Fraction] = {}
    unattributed = Fraction(0)
    most = 0
    for a, b in zip(points, points[1:]):
        inside = [iv for iv in live if iv.covers(a, b)]
        piece = Fraction(b - a, length)
        groups: Dict[Hashable, List[Interval]] = {}
        for iv in inside:
            groups.setdefault(iv.owner, []).append(iv)
        if not groups:
            unattributed += piece
            continue
        most = max(most, len(groups))
        per_group = piece / len(groups)
        for members in groups.values():
            for iv in members:
                owed[iv.key] = owed.get(iv.key, Fraction(0)) + per_group / len(members)
    return owed, unattributed, most


def attribute(windows: Iterable[Window], to_wall: Callable[[int], int],
              intervals: Iterable[Interval]) -> Attribution:
    """Split every bucket in `windows` among `intervals` by the rule in the module docstring.

    `to_wall` maps a CUPTI timestamp to wall-clock ns (``ProcessCensus.gpu_to_wall_ns``).
    Keys of `intervals` must be unique.
    """
    ivs = list(intervals)
    keys = [iv.key for iv in ivs]
    if len(set(keys)) != len(keys):
        raise ValueError("interval keys must be unique")
    sums: Dict[Hashable, List[int]] = {}
    width = len(NOTHING._flat())
    rest = [0] * width
    total = [0] * width
    most: Dict[Hashable, int] = {}
    n = 0
    for w in windows:
        n += 1
        bs, be = to_wall(w.start_ns), to_wall(w.end_ns)
        owed, unowned, k = bucket_fractions(bs, be, ivs)
        parties = [key for key in keys if key in owed]
        fracs = [owed[key] for key in parties] + [unowned]
        values = Share.of_window(w)._flat()
        for i, v in enumerate(values):
            total[i] += v
            parts = split_integer(v, fracs)
            for key, p in zip(parties, parts):
                sums.setdefault(key, [0] * width)[i] += p
            rest[i] += parts[-1]
        for key in parties:
            most[key] = max(most.get(key, 0), k)
    return Attribution(
        shares={key: Share._unflat(v) for key, v in sums.items()},
        unattributed=Share._unflat(rest),
        total=Share._unflat(total),
        buckets=n,
        concurrency_max=most,
    )
