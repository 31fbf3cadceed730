"""Integer GPU activity owned by one party, and the arithmetic that splits it without losing a unit.

Every attribution method (by time window, by step) ends in the same place: integers (kernel count and
time, copy count/bytes/time per direction, memset, eager kernel launches and records) split among
parties so that the parts sum exactly to the whole. :func:`split_weights` does that by the
largest-remainder method in integer arithmetic.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from math import gcd
from typing import Dict, List, Sequence

from otel_gpu_census.census import DIRECTIONS, ZERO, Stat, Step, Window


@dataclass(frozen=True)
class Share:
    """Integer GPU activity owned by one party: the same fields a census Window carries. Under COUNTED
    kernel tracing its kernel time is estimated from the eager_* fields (``census.kernel_time``)."""

    kernel_count: int = 0
    kernel_ns: int = 0
    copies: Dict[str, Stat] = field(default_factory=dict)    # by direction; absent means zero
    memset: Stat = ZERO
    eager_launches: int = 0
    eager_traced: int = 0
    eager_traced_ns: int = 0

    @classmethod
    def of_window(cls, w: Window) -> "Share":
        return cls(w.kernel_count, w.kernel_ns, {d: s for d, s in w.copies.items() if s != ZERO}, w.memset,
                   w.eager_launches, w.eager_traced, w.eager_traced_ns)

    @classmethod
    def of_step(cls, s: Step) -> "Share":
        return cls(s.kernel_count, s.kernel_ns, {d: x for d, x in s.copies.items() if x != ZERO}, s.memset,
                   s.eager_launches, s.eager_traced, s.eager_traced_ns)

    def copy(self, direction: str) -> Stat:
        return self.copies.get(direction, ZERO)

    def __add__(self, o: "Share") -> "Share":
        copies = dict(self.copies)
        for d, s in o.copies.items():
            copies[d] = copies.get(d, ZERO) + s
        return Share(self.kernel_count + o.kernel_count, self.kernel_ns + o.kernel_ns,
                     {d: s for d, s in copies.items() if s != ZERO}, self.memset + o.memset,
                     self.eager_launches + o.eager_launches, self.eager_traced + o.eager_traced,
                     self.eager_traced_ns + o.eager_traced_ns)

    def is_zero(self) -> bool:
        return not any(self.as_row())

    def as_row(self) -> List[int]:
        """Every integer as one row in a fixed order (kernels, copies by direction, memset, eager kernels),
        for splitting."""
        out = [self.kernel_count, self.kernel_ns]
        for d in DIRECTIONS:
            s = self.copy(d)
            out += [s.count, s.bytes, s.ns]
        out += [self.memset.count, self.memset.bytes, self.memset.ns]
        out += [self.eager_launches, self.eager_traced, self.eager_traced_ns]
        return out

    @classmethod
    def from_row(cls, v: Sequence[int]) -> "Share":
        """The inverse of :meth:`as_row`."""
        copies = {}
        for i, d in enumerate(DIRECTIONS):
            s = Stat(*v[2 + 3 * i: 5 + 3 * i])
            if s != ZERO:
                copies[d] = s
        m = 2 + 3 * len(DIRECTIONS)
        return cls(v[0], v[1], copies, Stat(*v[m:m + 3]), *v[m + 3:m + 6])


NOTHING = Share()
ROW_WIDTH = len(NOTHING.as_row())
# the kernel fields of a row (count, time, eager launches and their records): what a cost model weighs
KERNEL_FIELDS = frozenset((0, 1, ROW_WIDTH - 3, ROW_WIDTH - 2, ROW_WIDTH - 1))


def split_weights(total: int, weights: Sequence[int], denom: int) -> List[int]:
    """Split `total` into integers proportional to `weights` (non-negative, summing to `denom`), by
    largest remainder: each entry gets floor(total * w / denom) and the units left over go one each
    to the largest remainders; ties go to the earlier entry. The result sums exactly to `total`.

    Integer arithmetic only: the same result as with exact fractions, at a fraction of their cost."""
    if total == 0:
        return [0] * len(weights)
    floors, rems = [], []
    for w in weights:
        q, r = divmod(total * w, denom)
        floors.append(q)
        rems.append(r)
    left = total - sum(floors)
    if left:
        for i in sorted(range(len(rems)), key=lambda i: (-rems[i], i))[:left]:
            floors[i] += 1
    return floors


def split_integer(total: int, fractions: Sequence[Fraction]) -> List[int]:
    """Split `total` into integers proportional to `fractions` (which sum to 1), by largest remainder.

    Ties in the fractional part go to the earlier entry. The result sums exactly to `total`.
    """
    denom = 1
    for f in fractions:
        denom = denom * f.denominator // gcd(denom, f.denominator)
    return split_weights(total, [f.numerator * (denom // f.denominator) for f in fractions], denom)
