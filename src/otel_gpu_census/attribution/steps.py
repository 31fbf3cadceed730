"""Share each engine step's GPU work among the requests it served, by their scheduled tokens.

An engine hook (vLLM, SGLang) runs every batch as a *step*: it tags the GPU work its thread launches
with the step's id (``injector.step_begin``), so the census tallies that work per step (the
segment's step ring), and it tells the :class:`StepLedger` which requests the step served and how
many tokens each had (``step_opened``). The ledger splits each step's integers (kernel count, kernel
ns, copy count/bytes/ns per direction, memset) among those requests in proportion to their tokens by
largest remainder (``attribution.split_weights``: ties to the request scheduled first), so

    sum of the requests' shares + what no request can claim == the steps' totals, for every field.

What no request can claim: steps that served no request, and the parts of requests whose span had to
be closed before the census completed their steps (``late``). GPU work outside any step (start-up,
compilation, CUDA-graph capture, other threads) is the census total minus the steps (``StepLedger``
does not see it; report and the conservation test do).

Steps are split in id order, each once, when the census is complete past the step's end
(``complete_wall_ns``), so a step shared by a request that ends now and one that ends in a minute is
split one way only. A request settles when every step up to its last one is split. The engine
thread only appends to a deque; splitting and reading the census happen on the caller's thread
(``settle``), a few hundred microseconds per batch of steps.
"""
from __future__ import annotations

import collections
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Mapping, Optional, Tuple

from ..census import ProcessCensus, Step
from .shares import NOTHING, ROW_WIDTH as WIDTH, Share, split_weights

METHOD = "step_tokens"
"""Value of the span attribute ``gpu_census.attribution.method`` for this rule."""

COMPLETE_SLACK_NS = 200_000_000     # a step's GPU work ends this soon after its last launch returned
MAX_WAIT_NS = 5_000_000_000         # a request waits at most this long after its end for the census
MAX_BOOK = 65536                    # steps remembered while the census lags (then the oldest go)


@dataclass
class _Entry:
    sid: int
    tokens: Mapping[str, int]
    opened_ns: int
    closed_ns: int = 0


@dataclass
class _Acc:
    values: List[int] = field(default_factory=lambda: [0] * WIDTH)
    prefill: List[int] = field(default_factory=lambda: [0] * WIDTH)
    steps: int = 0
    first_step_ns: int = 0


@dataclass
class Settled:
    """A request whose GPU cost is known: the facts its integration gave, and the split."""
    key: str
    facts: Any
    end_ns: int
    status: str                     # complete | stale (closed before the census completed its steps)
    share: Share = NOTHING
    prefill: Share = NOTHING        # the part from steps that began before its first token
    steps: int = 0                  # steps that served it
    first_step_ns: int = 0          # wall time its first step began (queue time ends there)
    notes: List[str] = field(default_factory=list)


def _flat(step: Step) -> List[int]:
    return Share(step.kernel_count, step.kernel_ns, dict(step.copies), step.memset).as_row()


def split_step(values: List[int], tokens: Mapping[str, int]) -> List[Tuple[str, List[int]]]:
    """One step's flat values split among `tokens`' requests (in their order) by token count; the
    parts sum to `values` exactly. Requests with 0 tokens get nothing."""
    keys = [k for k, n in tokens.items() if n > 0]
    weights = [tokens[k] for k in keys]
    total = sum(weights)
    parts = [[0] * WIDTH for _ in keys]
    if not keys:
        return []
    for i, v in enumerate(values):
        if not v:
            continue
        if weights.count(weights[0]) == len(weights):       # decode steps: one token each
            q, r = divmod(v, len(keys))
            for j, p in enumerate(parts):
                p[i] = q + (1 if j < r else 0)
        else:
            for p, x in zip(parts, split_weights(v, weights, total)):
                p[i] = x
    return list(zip(keys, parts))


class StepLedger:
    """Steps and requests of one engine process, and the split of the census's steps among them.

    `read(lo, hi)` returns (the process's census header, {step id: Step}) for step ids [lo, hi], or
    (None, {}) while the census has no segment yet (``census.reader`` on the injector's path)."""

    def __init__(self, read: Callable[[int, int], Tuple[Optional[ProcessCensus], Dict[int, Step]]],
                 clock: Callable[[], int] = time.time_ns, max_wait_ns: int = MAX_WAIT_NS):
        self.read = read
        self.clock = clock
        self.max_wait_ns = max_wait_ns
        self._book: Deque[_Entry] = collections.deque()
        self._acc: Dict[str, _Acc] = {}
        self._first_token: Dict[str, int] = {}
        self._done: Dict[str, Tuple[Any, int, int]] = {}       # key -> (facts, end_ns, last sid)
        self._closed_early: Dict[str, int] = {}                 # settled before their steps: key -> last sid
        self._lock = threading.Lock()                           # settle() against itself
        self.last_sid = 0           # newest step opened
        self.settled_sid = 0        # every step up to this one is split
        self.unattributed = [0] * WIDTH   # steps that served no request, and late parts
        self.total = [0] * WIDTH          # all steps split
        self.steps_missing = 0      # steps the census ring no longer held when their turn came
        self.steps_dropped = 0      # steps forgotten because the census lagged MAX_BOOK steps behind

    # -- from the engine thread: cheap appends --------------------------------------------------
    def step_opened(self, sid: int, tokens: Mapping[str, int], wall_ns: int) -> None:
        self._book.append(_Entry(sid, tokens, wall_ns))
        self.last_sid = sid
        if len(self._book) > MAX_BOOK:
            self._book.popleft()
            self.steps_dropped += 1

    def step_touched(self, sid: int, wall_ns: int) -> None:
        """The step's last launch returned at wall_ns (execute_model, then sample_tokens)."""
        book = self._book
        if book and book[-1].sid == sid:
            book[-1].closed_ns = wall_ns

    def first_token(self, key: str, wall_ns: int) -> None:
        self._first_token.setdefault(key, wall_ns)

    def request_done(self, key: str, facts: Any, end_ns: int) -> None:
        """The request ended at end_ns (finished, aborted, failed); no later step serves it."""
        self._done[key] = (facts, end_ns, self.last_sid)

    # -- from the settling thread ---------------------------------------------------------------
    def settle(self, final: bool = False) -> List[Settled]:
        """Split every step the census has completed; the requests that can settle now. final: the
        engine is gone (its census complete): split what there is and settle everyone."""
        with self._lock:
            return self._settle(final)

    def _settle(self, final: bool) -> List[Settled]:
        now = self.clock()
        book = self._book
        closed = list(itertools.takewhile(lambda e: e.closed_ns or final, list(book)))
        if closed:
            head, steps = self.read(closed[0].sid, closed[-1].sid)
            complete = self._complete_up_to(head, final)
            for e in closed:
                if not final and e.closed_ns + COMPLETE_SLACK_NS > complete:
                    break
                if not book or book[0] is not e:
                    break
                book.popleft()
                step = steps.get(e.sid)
                if step is None:
                    if head is not None:
                        self.steps_missing += 1
                else:
                    self._split(e, _flat(step))
                self.settled_sid = e.sid
        out = []
        for key in [k for k, (_, end, last) in self._done.items()
                    if last <= self.settled_sid or final or now >= end + self.max_wait_ns]:
            facts, end, last = self._done.pop(key)
            acc = self._acc.pop(key, _Acc())
            self._first_token.pop(key, None)
            s = Settled(key, facts, end, "complete" if last <= self.settled_sid else "stale",
                        Share.from_row(acc.values), Share.from_row(acc.prefill), acc.steps, acc.first_step_ns)
            if s.status == "stale":
                self._closed_early[key] = last
                s.notes.append(f"closed {max(0, now - end) / 1e9:.1f} s after its end with steps "
                               f"{self.settled_sid + 1}..{last} not yet counted by the census")
            out.append(s)
        for key in [k for k, last in self._closed_early.items() if last <= self.settled_sid]:
            del self._closed_early[key]
        return out

    def _complete_up_to(self, head: Optional[ProcessCensus], final: bool) -> int:
        if head is None:
            return 0
        if final or not head.alive or head.state_name == "exited":
            return 1 << 62
        return head.complete_wall_ns

    def _split(self, e: _Entry, values: List[int]) -> None:
        for i, v in enumerate(values):
            self.total[i] += v
        parts = split_step(values, e.tokens)
        if not parts:
            for i, v in enumerate(values):
                self.unattributed[i] += v
            return
        for key, part in parts:
            if key in self._closed_early:           # its span is gone: count the part, unclaimed
                for i, v in enumerate(part):
                    self.unattributed[i] += v
                continue
            acc = self._acc.get(key)
            if acc is None:
                acc = self._acc[key] = _Acc(first_step_ns=e.opened_ns)
            acc.steps += 1
            vals = acc.values
            for i, v in enumerate(part):
                vals[i] += v
            ft = self._first_token.get(key)
            if ft is None or e.opened_ns < ft:
                pre = acc.prefill
                for i, v in enumerate(part):
                    pre[i] += v

    def pending(self) -> int:
        return len(self._done)
