"""Integer GPU activity owned by one party, and the arithmetic that splits it without losing a unit.

Every attribution method (by time window, by step) ends in the same place: integers (kernel count and
time, copy count/bytes/time per direction, memset, eager kernel launches and records) split among
parties so that the parts sum exactly to the whole. :func:`split_weights` does that by the
largest-remainder method in integer arithmetic, for one split on its own; :func:`carry_split` for a split
repeated over many steps among the same parties (engine steps): each party carries what its rounding owes
it, so no party gains by where it sits in the list, and its running total stays within about a unit of
its exact fractional share.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from math import gcd
from typing import Dict, List, Optional, Sequence

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


CARRY_SHIFT = 32
"""A carry is kept in units of 2**-CARRY_SHIFT of a unit: each step's exact part is floored to that grain, so a
party's running total drifts from its exact share by under 2**-32 units a step."""
_MASK = (1 << CARRY_SHIFT) - 1


def carry_split(total: int, weights: Optional[Sequence[int]], denom: int, carries: Sequence[List[int]],
                field_: int) -> List[int]:
    """Split `total` (>= 0) among parties in proportion to `weights` (summing to `denom`; None: equal
    weights), each party's rounding carried across calls in ``carries[j][field_]`` (updated in place).

    A party's target is its exact part plus its carry (in 2**-CARRY_SHIFT units); each gets its target's
    floor (none below 0), the units left over go to the largest remainders, and what each got short of, or
    over, its target is its new carry. Equal remainders go to the earlier party: list the parties in an order
    that does not depend on their place in the engine's batch (``by_tie``). The parts sum to `total` exactly.
    While the same parties share every call, each party's running total stays within one unit of its exact
    share; parties coming and going take their carries with them, and the others' may then reach a little over
    a unit."""
    n = len(carries)
    if weights is None:
        x = (total << CARRY_SHIFT) // n
        t = [x + c[field_] for c in carries]
    else:
        scaled = total << CARRY_SHIFT
        t = [scaled * w // denom + c[field_] for w, c in zip(weights, carries)]
    if min(t) >= 0:
        a = [v >> CARRY_SHIFT for v in t]
        left = total - sum(a)
        rank = [v & _MASK for v in t] if left else t
    else:           # a carry owes more than the part (the party got ahead before): none below 0
        a = [v >> CARRY_SHIFT if v > 0 else 0 for v in t]
        left = total - sum(a)
        rank = [v & _MASK if v > 0 else v for v in t]
    if left > 0:
        q, left = divmod(left, n)
        if q:
            a = [p + q for p in a]
        if left:
            for j in sorted(range(n), key=rank.__getitem__, reverse=True)[:left]:    # stable: ties in order
                a[j] += 1
    elif left < 0:  # carries owed to the parties outnumber the step (others came and went): the smallest
        order = sorted((j for j in range(n) if a[j]), key=rank.__getitem__)        # remainders give back
        while left:
            for j in order:
                if a[j] and left:
                    a[j] -= 1
                    left += 1
    for c, v, p in zip(carries, t, a):
        c[field_] = v - (p << CARRY_SHIFT)
    return a


def tie_of(key) -> int:
    """A party's place among equal remainders (carry_split): fixed for the key within the process, whatever its
    place in the batch."""
    return hash(key)


_M64 = (1 << 64) - 1


def draw(key, salt: int) -> int:
    """A number fixed for (`key`, `salt`) within the process and unrelated from one salt to the next (splitmix64
    of the key's hash and the salt): an order for ties that changes from bucket to bucket."""
    z = (hash(key) + salt * 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def by_tie(keys: Sequence) -> List:
    """`keys` in the order carry_split's ties go by (tie_of), not the batch's."""
    return sorted(keys, key=tie_of)
