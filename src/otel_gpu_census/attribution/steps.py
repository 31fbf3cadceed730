"""Share each engine step's GPU work among the requests it served: by their scheduled tokens, or by the
work they asked of the step.

An engine hook (vLLM, SGLang) runs every batch as a *step*: it tags the GPU work its thread launches
with the step's id (``injector.step_begin``), so the census tallies that work per step (the
segment's step ring), and it tells the :class:`StepLedger` which requests the step served and how
many tokens each had (``step_opened``). The ledger splits each step's integers (kernel count, kernel
ns, copy count/bytes/ns per direction, memset, and the step's kernel time priced once) among those requests in
proportion to their tokens, each request carrying what its rounding owes it from step to step
(``shares.carry_split``; ties by the request, never by its place in the batch), so

    sum of the requests' shares + what no request can claim == the steps' totals, for every field,

and a request's running total is within about a unit of its exact fractional share, wherever the engine lists it.

How a step's kernels are split is the ledger's *method* (the span's ``gpu_census.attribution.method``):
``step_tokens`` by scheduled tokens (the default); ``step_flops`` by each request's estimated FLOPs in
the step (``cost_model.py``: its tokens, the context before them, the model's shape), which follows
attention's growth with context; or ``step_alone`` by what each request's part of the step would cost
alone (its FLOPs plus a step's fixed cost, fitted on the run's own steps: ``cost_model.CostFit``); or
``step_model`` by each request's part of the step's cost as fitted on the run's steps of its kind
(``cost_model.StepModel``: tokens, with a note, while the fit is not ready).
Copies and memsets are split by tokens in every method (inputs and sampled outputs scale with tokens).
Whatever the method, a request's share is an allocation of measured step totals, not a measurement of
the request.

A share that misses work says so (status ``partial``, with notes): steps that served the request but
were gone from the census when their turn came (its step ring was reused under a settling lag, or
their records never came), steps forgotten because the census lagged too far, or anything the
integration notes for the request (``note``: closed by a sweep, a settling process replaced while it
was in flight, ...). A ledger that follows requests (``follows``: every request is announced with
``request_started``) gives a step's part for a request it does not follow, or no longer follows (it
settled), to no one rather than to a share nobody will ever read.

A *sub-step* is GPU work inside a step that belongs to particular requests whatever the batch, such
as the KV-cache blocks a transfer moves for the requests it serves: the hook tags it with an id of its
own (the next id of the same sequence: steps nest per thread), opens it with a ``kind`` other than
:data:`TOKENS` and no weights, and claims it for each request with its weight as it launches that
request's part (``step_claimed``: blocks moved). It is split like a step, by those weights, counted
in the requests' ``sub`` share (and their ``weights`` per kind), not in their step count. A request
may end before the sub-step that carries its last transfer opens (vLLM stores a request's last
blocks at the next step): ``request_done(..., awaiting=True)`` keeps it waiting for its next claim
(bounded by ``max_wait_ns``); a claim for a request that has already settled, or that the ledger
never saw start (``request_started``), is counted but unclaimed.

What no request can claim: steps that served no request, and the parts of requests whose span had to
be closed before the census completed their steps (``late``). GPU work outside any step (start-up,
compilation, CUDA-graph capture, other threads) is the census total minus the steps (``StepLedger``
does not see it; report and the conservation test do).

The census may be several processes (ranks) that run every step with the same id (tensor or
pipeline parallel workers): ``read`` then returns one ``(header, steps)`` pair per process, each
process's step is split by the same weights, a request's share is the sum over processes, and
conservation holds per process (``per_process``) as well as in total.

With sampled kernel tracing (a census recorded with a kernel schedule) a step's kernels are in the
census only if it ran inside a traced phase, so a request's kernel figures are a sample: the ledger
also weighs each step's traced share of its wall time by the request's tokens (``Settled.kernel_*``,
the span's ``gpu_census.kernel.traced_ratio``). The weights only describe the split; they change none.
With counted kernel tracing (``counted``, the default) every step's kernels are counted, and its eager
kernel records only in the traced phases: a request's kernel count is exact and its kernel time an
estimate. Each step's kernel time is priced once (``step_price``: its graph spans, and its eager launches at the
step's own sample's mean, else at the processes' mean over their life as of the split) and that integer is split
like the others, so the requests' kernel times and what no request claimed add up to the steps' exactly
(``Settled.kernel_priced``, ``KernelTimed.share_time``). A step no sample or mean can price yet leaves its eager
launches out of the time, counted (``kernel_unpriced``) and said on the span, never priced at 0.

Steps are split in id order, each once, when the census is complete past the step's end
(``complete_wall_ns``; of every process), so a step shared by a request that ends now and one that
ends in a minute is split one way only; a step the census has seen nothing of, nor of any later step
(``step_max``), waits for one more flush (CUPTI may hand its records over a flush late). A request
settles when every step up to its last one is split. The engine thread only appends to a deque;
splitting and reading the census happen on the caller's thread (``settle``), a few hundred
microseconds per batch of steps.
"""
from __future__ import annotations

import collections
import itertools
import threading
import time
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Callable, Deque, Dict, Hashable, List, Mapping, MutableMapping, Optional, Sequence, Set, Tuple

from otel_gpu_census._native import consts as _consts
from otel_gpu_census.census import (DeviceTotals, KernelTimed, ProcessCensus, Step,
                                    eager_mean_ns)
from otel_gpu_census.attribution.cost_model import CostFit, ModelShape, StepModel, attention_work, step_weights
from otel_gpu_census.attribution.engine_state import StateBuckets
from otel_gpu_census.attribution.shares import (KERNEL_FIELDS, NOTHING, ROW_WIDTH as WIDTH, Share, by_tie,
                                                carry_split)

METHOD = "step_tokens"
"""Value of the span attribute ``gpu_census.attribution.method``: kernels split by scheduled tokens."""
FLOPS_METHOD = "step_flops"
"""The same for kernels split by each request's estimated FLOPs in the step (cost_model.py)."""
ALONE_METHOD = "step_alone"
"""The same for kernels split by what each request's part would cost alone (cost_model.CostFit)."""
MODEL_METHOD = "step_model"
"""The same for kernels split by each request's part of the step's fitted cost (cost_model.StepModel)."""
METHODS = {"tokens": METHOD, "flops": FLOPS_METHOD, "alone": ALONE_METHOD,   # OTEL_GPU_CENSUS_ATTRIBUTION's
           "model": MODEL_METHOD}                                            # values -> method

TOKENS = "tokens"                   # the kind of a step: weights are scheduled tokens
COMPLETE_SLACK_NS = 200_000_000     # a step's GPU work ends this soon after its last launch returned
MAX_WAIT_NS = 5_000_000_000         # a request waits at most this long after its end for the census
MAX_BOOK = 65536                    # steps remembered while the census lags (then the oldest go)
TOUCH_SEARCH = 16                   # step_touched / step_claimed look this far back for their step
RING_SLOTS = _consts.GC_STEP_SLOTS  # the census's step ring (shared by steps and sub-steps)
# A ledger row is a census row (Share.as_row) and two more columns: the step's kernel time priced once
# (step_price) and its eager launches no mean could price; both split with the kernel weights.
PRICED, UNPRICED = WIDTH, WIDTH + 1
ROW = WIDTH + 2
SPLIT_KERNEL_FIELDS = KERNEL_FIELDS | {PRICED, UNPRICED}
_LAUNCHES, _TRACED, _TRACED_NS = WIDTH - 3, WIDTH - 2, WIDTH - 1

Census = Tuple[Optional[ProcessCensus], Dict[int, Step]]


@dataclass
class _Entry:
    sid: int
    tokens: MutableMapping[Hashable, int]   # weights: scheduled tokens, or what a sub-step moves
    opened_ns: int
    closed_ns: int = 0
    kind: str = TOKENS
    before: Optional[Mapping[Hashable, int]] = None   # tokens computed before this step, per request
    guessed: str = ""                       # why a claim's weight is a guess (step_claimed)
    fallback: str = ""                      # MODEL_METHOD: why this step was split by tokens instead
    state: Optional[tuple] = None           # the engine's state as it opened (engine_state.FIELDS)
    redo: Optional[Mapping[Hashable, int]] = None   # of its tokens, those a preempted request recomputes


@dataclass
class _Acc:
    values: List[int] = field(default_factory=lambda: [0] * ROW)
    prefill: List[int] = field(default_factory=lambda: [0] * ROW)
    sub: List[int] = field(default_factory=lambda: [0] * ROW)
    carry: List[int] = field(default_factory=lambda: [0] * ROW)   # what its rounding owes it (carry_split)
    weights: Dict[str, int] = field(default_factory=dict)
    steps: int = 0
    first_step_ns: int = 0
    fallback: Dict[str, int] = field(default_factory=dict)         # MODEL_METHOD: steps split by tokens, by why
    redo_tokens: int = 0            # tokens recomputed after a preemption
    redo_ns: int = 0                # ... and their part of its priced kernel time


@dataclass
class Settled(KernelTimed):
    """A request whose GPU cost is known: the facts its integration gave, and the split."""
    key: str
    facts: Any
    end_ns: int
    status: str                     # complete | partial (notes say what it misses) | stale (closed
                                    # before the census completed its steps)
    share: Share = NOTHING
    prefill: Share = NOTHING        # the part from steps that began before its first token
    steps: int = 0                  # steps that served it
    first_step_ns: int = 0          # wall time its first step began (queue time ends there)
    notes: List[str] = field(default_factory=list)
    sub: Share = NOTHING            # the part of `share` from sub-steps (e.g. KV transfers)
    weights: Dict[str, int] = field(default_factory=dict)   # its sub-step weights, by kind
    # kernel tracing over its token steps: the modes seen, and sum(tokens x traced ns) out of
    # sum(tokens x step ns) (token-weighted, so the ratio says how much of its kernel share was traced)
    kernel_tracing: List[str] = field(default_factory=list)
    kernel_traced_ns: int = 0
    kernel_span_ns: int = 0
    # counted kernel tracing: its kernel time is estimated (kernel_time), by this mean where its share
    # has no eager kernel record of its own (the processes' mean over their life, as of its settling)
    kernel_counted: bool = False
    eager_mean_ns: Optional[Fraction] = None
    # its kernel time as split: the sum of its parts of each step's kernel time priced once (step_price),
    # and the eager launches of its parts no mean could price (left out of the time, never priced at 0)
    kernel_priced: Optional[Tuple[int, int]] = None
    prefill_priced: Optional[Tuple[int, int]] = None
    split_note: str = ""            # MODEL_METHOD: its steps split by tokens instead, and why
    # preempted and recomputed: the tokens its later steps computed again, and of its priced kernel time the part
    # for them (in each such step, its part of the step's kernel time times recomputed / scheduled tokens)
    recomputed_tokens: int = 0
    recompute_ns: int = 0


def _fallback_note(fallback: Mapping[str, int], steps: int) -> str:
    if not fallback:
        return ""
    return (f"{sum(fallback.values())} of its {steps} steps split by tokens, not the step model: "
            + "; ".join(f"{why} ({n})" for why, n in fallback.items()))


@dataclass
class _Traced:
    modes: List[str] = field(default_factory=list)
    traced: int = 0
    span: int = 0
    counted: bool = False


def step_price(values: Sequence[int], kernels: Any, life_mean_ns: Optional[Fraction]) -> Tuple[int, int]:
    """A step's (flat values') kernel time, priced once for the whole step, and its eager launches left
    unpriced: census.kernel_time in integers. Counted kernels: graph spans and the step's eager launches at its
    own sample's mean, else at the processes' over their life (`life_mean_ns`), else unpriced (unknown, left
    out). Untimed (ACTIVITY=off): 0, nothing was timed (the modes say so). Otherwise as measured."""
    if kernels is None or not getattr(kernels, "counted", False):
        return values[1], 0
    if getattr(kernels, "untimed", False):
        return 0, 0
    launches, traced, traced_ns = values[_LAUNCHES], values[_TRACED], values[_TRACED_NS]
    base = max(0, values[1] - traced_ns)
    if not launches:
        return base, 0
    if traced:
        num, den = launches * traced_ns, traced
    elif life_mean_ns is not None:
        num, den = launches * life_mean_ns.numerator, life_mean_ns.denominator
    else:
        return base, launches
    return base + (2 * num + den) // (2 * den), 0         # rounded half up, as census.kernel_time


class _Counted:
    counted = True


def step_kernel_ns(values: Sequence[int], fallback_mean_ns: Optional[Fraction]) -> int:
    """A counted step's kernel time (step_price), its untimed eager launches priced at its own sample's mean,
    else at `fallback_mean_ns`."""
    return step_price(values, _Counted, fallback_mean_ns)[0]


def _flat(step: Step) -> List[int]:
    return Share.of_step(step).as_row()


def _lost_notes(lost: List[int], steps: int) -> List[str]:
    """What a request's lost steps say on its span (see StepLedger._missing, step_opened)."""
    missing, lapped, forgotten = lost
    out = []
    if missing:
        why = ("the census's step ring (%d slots, shared with sub-steps) was reused before settling read "
               "them" % RING_SLOTS) if lapped == missing else \
              "no records of them came" if not lapped else \
              "%d lapped by the census's step ring (%d slots) before settling read them, %d with no records" % (
                  lapped, RING_SLOTS, missing - lapped)
        out.append(f"{missing} steps that served it are missing from its share ({why}); {steps} were split")
    if forgotten:
        out.append(f"{forgotten} steps that served it were forgotten unsplit (the census lagged more than "
                   f"{MAX_BOOK} steps behind)")
    return out


def split_step(values: List[int], tokens: Mapping[Hashable, int],
               carries: Optional[Dict[Hashable, List[int]]] = None) -> List[Tuple[Hashable, List[int]]]:
    """One step's flat values split among `tokens`' requests by token count (carry_split: what each
    request's rounding owes it carried in `carries`, {request: row}, kept across calls by the caller); the parts
    sum to `values` exactly, whatever the requests' order. Requests with 0 tokens get nothing."""
    keys = by_tie([k for k, n in tokens.items() if n > 0])
    if not keys:
        return []
    carries = {} if carries is None else carries
    rows = [carries.setdefault(k, [0] * len(values)) for k in keys]
    weights = [tokens[k] for k in keys]
    equal = None if weights.count(weights[0]) == len(weights) else weights
    parts = [[0] * len(values) for _ in keys]
    for i, v in enumerate(values):
        if v:
            for p, x in zip(parts, carry_split(v, equal, sum(weights), rows, i)):
                p[i] = x
    got = dict(zip(keys, parts))
    return [(k, got[k]) for k in tokens if tokens[k] > 0]


class StepLedger:
    """Steps and requests of one engine, and the split of the census's steps among them.

    `read(lo, hi)` returns (the process's census header, {step id: Step}) for step ids [lo, hi], or
    (None, {}) while the census has no segment yet (``census.reader`` on the injector's path); or a
    list of such pairs, one per process that runs the steps (ranks)."""

    def __init__(self, read: Callable[[int, int], Any],
                 clock: Callable[[], int] = time.time_ns, max_wait_ns: int = MAX_WAIT_NS,
                 follows: bool = False, method: str = METHOD):
        """follows: every request is announced (request_started), and a step's part for one that is not
        (or no longer) followed is nobody's; method: METHOD, FLOPS_METHOD or ALONE_METHOD (the last two need
        the model's shape, set_shape; until then steps are split by tokens)."""
        self.read = read
        self.clock = clock
        self.max_wait_ns = max_wait_ns
        self.follows = follows
        self._method = method
        self.shape: Optional[ModelShape] = None
        self._prompt: Dict[Hashable, Optional[int]] = {}        # prompt lengths (FLOPS_METHOD, ALONE_METHOD)
        self.fit = CostFit()                                    # ALONE_METHOD's steps' fixed cost
        self.model = StepModel()                                # MODEL_METHOD's fitted step cost
        self._notes: Dict[Hashable, List[str]] = {}             # what a request's share misses, as said
        self._lost: Dict[Hashable, List[int]] = {}              # key -> [steps not in the ring, of which
                                                                #  lapped by it; steps forgotten]
        self._book: Deque[_Entry] = collections.deque()
        self._acc: Dict[Hashable, _Acc] = {}
        self._first_token: Dict[Hashable, int] = {}
        self._done: Dict[Hashable, Tuple[Any, int, int]] = {}   # key -> (facts, end_ns, last sid)
        self._awaiting: Set[Hashable] = set()                   # done, waiting for a sub-step's claim
        self._live: Set[Hashable] = set()                       # started (request_started), not settled
        self._closed_early: Dict[Hashable, int] = {}            # settled before their steps: key -> last sid
        self._traced: Dict[Hashable, _Traced] = {}              # kernel tracing over a request's steps
        self._lock = threading.Lock()                           # settle() against itself
        self.last_sid = 0           # newest step opened
        self.settled_sid = 0        # every step up to this one is split
        self._flushes = (0, 0)      # the census's last two complete times read (_seen)
        self._unattributed = [0] * ROW    # steps that served no request, and late parts
        self._total = [0] * ROW           # all steps split
        self._sub_total = [0] * ROW       # of `total`, the sub-steps
        self.sub_steps = 0          # sub-steps split
        self.steps_missing = 0      # steps the census ring no longer held when their turn came
        self.steps_dropped = 0      # steps forgotten because the census lagged MAX_BOOK steps behind
        self.partial = 0            # requests settled partial
        self._gaps: List[str] = []  # what the census knows it missed, as of the last read
        self.per_process: Dict[Any, Dict[str, Any]] = {}   # with several processes: pid -> totals
        self.eager_mean_ns: Optional[Fraction] = None      # of the counted processes over their life
        self._batch: Tuple[List[Hashable], List[Hashable]] = ([], [])   # the last step's requests, by_tie
        self.states = StateBuckets()        # the engine's state per step, summed per second
        self.recomputed = [0, 0]            # tokens recomputed after preemptions, their priced kernel time

    @property
    def total(self) -> List[int]:
        """Every step split, as a census row (Share.as_row)."""
        return self._total[:WIDTH]

    @property
    def unattributed(self) -> List[int]:
        """Of `total`, what no request could claim."""
        return self._unattributed[:WIDTH]

    @property
    def sub_total(self) -> List[int]:
        """Of `total`, the sub-steps."""
        return self._sub_total[:WIDTH]

    @property
    def kernel_times(self) -> Dict[str, Tuple[int, int]]:
        """The steps' kernel time priced once per step (step_price), as (ns, eager launches left unpriced):
        ``total``, ``unattributed``; the requests' shares are the rest, exactly."""
        return {"total": (self._total[PRICED], self._total[UNPRICED]),
                "unattributed": (self._unattributed[PRICED], self._unattributed[UNPRICED])}

    @property
    def method(self) -> str:
        """How this ledger's steps are split (the span's gpu_census.attribution.method)."""
        return self._method if self._method in (METHOD, MODEL_METHOD) or self.shape is not None else METHOD

    def set_shape(self, shape: Optional[ModelShape]) -> None:
        """The model's shape, for FLOPS_METHOD and ALONE_METHOD (from the engine's configuration, before its
        first step)."""
        self.shape = shape

    # -- from the engine thread: cheap appends --------------------------------------------------
    def step_opened(self, sid: int, tokens: MutableMapping[Hashable, int], wall_ns: int,
                    kind: str = TOKENS, before: Optional[Mapping[Hashable, int]] = None,
                    state: Optional[tuple] = None, redo: Optional[Mapping[Hashable, int]] = None) -> None:
        """Step `sid` began at wall_ns serving `tokens` ({request: weight}); `kind` other than
        TOKENS: a sub-step, whose weights come from step_claimed. `before`: {request: tokens computed
        before this step} (FLOPS_METHOD). `state`: the engine's (engine_state.FIELDS); `redo`: {request:
        of its tokens, those it computes again after a preemption}."""
        self._book.append(_Entry(sid, tokens, wall_ns, kind=kind, before=before, state=state, redo=redo))
        self.last_sid = sid
        if len(self._book) > MAX_BOOK:
            gone = self._book.popleft()
            self.steps_dropped += 1
            for key, n in gone.tokens.items():
                if n > 0:
                    self._lose(key, 2)

    def _entry(self, sid: int) -> Optional[_Entry]:
        for e in itertools.islice(reversed(self._book), TOUCH_SEARCH):
            if e.sid == sid:
                return e
        return None

    def step_touched(self, sid: int, wall_ns: int) -> None:
        """The step's last launch returned at wall_ns (execute_model, then sample_tokens)."""
        e = self._entry(sid)
        if e is not None:
            e.closed_ns = wall_ns

    def step_claimed(self, sid: int, key: Hashable, weight: int, guessed: str = "") -> None:
        """Sub-step `sid` (open) moves `weight` for request `key`; a request done and waiting for it
        now waits for this sub-step. `guessed`: why `weight` is a guess (the integration could not read
        what the claim moves); every share of the sub-step is approximate then, and its requests say so."""
        e = self._entry(sid)
        if e is None or e.closed_ns or weight <= 0:
            return
        e.tokens[key] = e.tokens.get(key, 0) + weight
        if guessed:
            e.guessed = guessed
        d = self._done.get(key)
        if d is not None and d[2] < sid:
            self._done[key] = (d[0], d[1], sid)
            self._awaiting.discard(key)

    def request_started(self, key: Hashable, prompt_tokens: Optional[int] = None) -> None:
        """A request the ledger follows from now (steps and sub-steps may serve it); `prompt_tokens`:
        its prompt's length (FLOPS_METHOD: whether a step samples a token of it)."""
        self._live.add(key)
        if self._method != METHOD:
            self._prompt[key] = prompt_tokens

    def note(self, key: Hashable, text: str) -> None:
        """Something the request's share misses (its status becomes partial, `text` among its notes)."""
        self._notes.setdefault(key, []).append(text)

    def _note_once(self, key: Hashable, text: str) -> None:
        notes = self._notes.setdefault(key, [])
        if text not in notes:
            notes.append(text)

    def _lose(self, key: Hashable, what: int) -> None:
        lost = self._lost.get(key)
        if lost is None:
            if key in self._closed_early or (key not in self._live and key not in self._done
                                             and (self.follows or key not in self._acc)):
                return                       # nobody's share: not a request's loss
            lost = self._lost[key] = [0, 0, 0]
        lost[what] += 1

    def first_token(self, key: Hashable, wall_ns: int) -> None:
        self._first_token.setdefault(key, wall_ns)

    def request_done(self, key: Hashable, facts: Any, end_ns: int, awaiting: bool = False) -> None:
        """The request ended at end_ns (finished, aborted, failed); no later step serves it.
        awaiting: a sub-step still to open will claim it (wait for that claim, up to max_wait_ns)."""
        self._done[key] = (facts, end_ns, self.last_sid)
        if awaiting:
            self._awaiting.add(key)

    # -- from the settling thread ---------------------------------------------------------------
    def settle(self, final: bool = False) -> List[Settled]:
        """Split every step the census has completed; the requests that can settle now. final: the
        engine is gone (its census complete): split what there is and settle everyone."""
        with self._lock:
            return self._settle(final)

    def _read(self, lo: int, hi: int) -> List[Census]:
        got = self.read(lo, hi)
        return got if isinstance(got, list) else [got]

    def _settle(self, final: bool) -> List[Settled]:
        now = self.clock()
        book = self._book
        closed = list(itertools.takewhile(lambda e: e.closed_ns or final, list(book)))
        if closed:
            sources = self._read(closed[0].sid, closed[-1].sid)
            self._note_eager_mean(sources)
            # work the census knows it missed in these processes (a driver function it cannot size, lost calls,
            # dropped records): counted per process, so every share settled from now on says so
            # (step_gaps: the census's gaps and what steps cannot hold, managed-memory migrations)
            self._gaps = [f"pid {h.pid}: " + "; ".join(g) for h, _ in sources if h is not None
                          for g in [getattr(h, "step_gaps", None) or getattr(h, "gaps", None)] if g]
            complete = min((self._complete_up_to(h, final) for h, _ in sources), default=0)
            if complete != self._flushes[1]:
                self._flushes = (self._flushes[1], complete)
            seen = self._seen_up_to(sources)
            for e in closed:
                if not final and e.closed_ns + COMPLETE_SLACK_NS > complete:
                    break
                if not final and e.sid > seen and e.closed_ns + COMPLETE_SLACK_NS > self._flushes[0]:
                    break
                if not book or book[0] is not e:
                    break
                book.popleft()
                rows = []
                for n, (head, steps) in enumerate(sources):
                    step = steps.get(e.sid)
                    if step is None:
                        if head is not None:
                            self._missing(e, head)
                    else:
                        rows.append((self._process_key(head, n) if len(sources) > 1 else None, _flat(step),
                                     getattr(head, "kernels", None)))
                self._split(e, rows)
                self._weigh_tracing(e, sources)
                self.settled_sid = e.sid
        out = []
        for key in [k for k, (_, end, last) in self._done.items()
                    if (last <= self.settled_sid and k not in self._awaiting) or final
                    or now >= end + self.max_wait_ns]:
            facts, end, last = self._done.pop(key)
            waited = key in self._awaiting
            self._awaiting.discard(key)
            self._live.discard(key)
            acc = self._acc.pop(key, _Acc())
            tr = self._traced.pop(key, _Traced())
            self._first_token.pop(key, None)
            ok = last <= self.settled_sid and not waited
            notes = self._notes.pop(key, [])
            if self._gaps:
                notes.append("the census missed work in this server (" + "; ".join(self._gaps) + ")")
            lost = self._lost.pop(key, None)
            self._prompt.pop(key, None)
            if lost is not None:
                notes = _lost_notes(lost, acc.steps) + notes
            status = "stale" if not ok else "partial" if notes else "complete"
            s = Settled(key, facts, end, status,
                        Share.from_row(acc.values), Share.from_row(acc.prefill), acc.steps, acc.first_step_ns,
                        notes=notes, sub=Share.from_row(acc.sub), weights=dict(acc.weights),
                        kernel_tracing=tr.modes, kernel_traced_ns=tr.traced, kernel_span_ns=tr.span,
                        kernel_counted=tr.counted, eager_mean_ns=self.eager_mean_ns if tr.counted else None,
                        kernel_priced=(acc.values[PRICED], acc.values[UNPRICED]),
                        prefill_priced=(acc.prefill[PRICED], acc.prefill[UNPRICED]),
                        split_note=_fallback_note(acc.fallback, acc.steps),
                        recomputed_tokens=acc.redo_tokens, recompute_ns=acc.redo_ns)
            if status == "partial":
                self.partial += 1
            if not ok:
                self._closed_early[key] = max(last, self.last_sid) if waited else last
                if waited:
                    s.notes.append(f"closed {max(0, now - end) / 1e9:.1f} s after its end still waiting "
                                   f"for a transfer of its own to be launched")
                else:
                    s.notes.append(f"closed {max(0, now - end) / 1e9:.1f} s after its end with steps "
                                   f"{self.settled_sid + 1}..{last} not yet counted by the census")
            out.append(s)
        for key in [k for k, last in self._closed_early.items() if last <= self.settled_sid]:
            del self._closed_early[key]
        return out

    def _missing(self, e: _Entry, head) -> None:
        """Step `e` is not in this process's census: its part of every request it served is lost to them.
        Lapped: the census has since counted a step a whole ring later (its slot was reused)."""
        self.steps_missing += 1
        step_max = getattr(head, "step_max", None)
        lapped = isinstance(step_max, int) and step_max >= e.sid + RING_SLOTS
        for key, n in e.tokens.items():
            if n > 0:
                self._lose(key, 0)
                if lapped and key in self._lost:
                    self._lost[key][1] += 1

    def _note_eager_mean(self, sources: Sequence[Census]) -> None:
        """The counted processes' mean eager kernel duration over their life, from headers just read
        (kept when none has a sample yet)."""
        life = DeviceTotals(device_id=-1)
        for head, _ in sources:
            kernels = getattr(head, "kernels", None)
            if kernels is not None and kernels.counted:
                life = life + head.totals()
        mean = eager_mean_ns(life)
        if mean is not None:
            self.eager_mean_ns = mean

    @staticmethod
    def _process_key(head, n: int):
        pid = getattr(head, "pid", None)
        return pid if pid is not None else n

    def _complete_up_to(self, head: Optional[ProcessCensus], final: bool) -> int:
        if head is None:
            return 0
        if final or not head.alive or head.state_name == "exited":
            return 1 << 62
        return head.complete_wall_ns

    def _seen_up_to(self, sources: Sequence[Census]) -> int:
        """The last step the census holds all it will of: every process has counted work of it or of a
        later step (``step_max``), or has ended. A later step waits until a later flush than the one it
        was due at has completed (``_flushes[0]``): CUPTI's periodic flush (not forced) keeps back a
        buffer that holds a record still in flight, with the finished records before it, while
        complete_wall_ns moves on, and the steps in it come with a later flush (on vLLM, without this wait,
        stretches of steps read as missing and their requests came up short of them)."""
        return min((h.step_max for h, _ in sources
                    if h is not None and getattr(h, "step_max", None) is not None
                    and self._complete_up_to(h, False) < 1 << 62), default=1 << 62)

    def _split(self, e: _Entry, rows: Sequence[Tuple[Any, List[int], Any]]) -> None:
        sub = e.kind != TOKENS
        if sub:
            self.sub_steps += 1
        served = set()
        kernel_ns = redo_ns = 0
        for proc, values, kernels in rows:
            values = values + list(step_price(values, kernels, self.eager_mean_ns))
            redo_ns += self._split_one(e, values, proc, served)
            kernel_ns += values[PRICED]
        if e.redo:
            n = sum(x for k, x in e.redo.items() if e.tokens.get(k, 0) > 0)
            self.recomputed[0] += n
            self.recomputed[1] += redo_ns
            for key in served:
                if e.redo.get(key):
                    self._acc[key].redo_tokens += e.redo[key]
        if e.state is not None and not sub:
            self.states.add(e.opened_ns, e.closed_ns, e.state, kernel_ns, redo_ns)
        for key in served:
            acc = self._acc[key]
            if e.guessed:
                self._note_once(key, f"its share of {e.kind} sub-steps is approximate ({e.guessed})")
            if sub:
                acc.weights[e.kind] = acc.weights.get(e.kind, 0) + e.tokens[key]
            else:
                acc.steps += 1
                if e.fallback:
                    acc.fallback[e.fallback] = acc.fallback.get(e.fallback, 0) + 1

    def _weigh_tracing(self, e: _Entry, sources: Sequence[Census]) -> None:
        """Add token step `e`'s kernel-traced share of its wall time to each request it served.

        Every process with a census counts, whether or not its ring holds the step: a step that ran
        outside a traced phase may have left no record at all (no kernels counted, no copies), and
        leaving it out would make the sample look whole. With several processes (ranks) each is
        weighed by its own schedule (each injector fixes its origin in its own CUPTI clock, so ranks'
        phases line up only roughly) and the step counts once per process, like the proxy's figures
        summed over processes: the ratio is the mean over the ranks. A head without a schedule (no
        census yet, or a stand-in without one) adds nothing."""
        if e.kind != TOKENS:
            return
        served = [(k, n) for k, n in e.tokens.items() if n > 0 and k not in self._closed_early]
        if not served:
            return
        end = max(e.closed_ns, e.opened_ns + 1)      # final settling: a step never touched counts 1 ns
        traced = span = 0
        modes = []
        counted = False
        for head, _ in sources:
            kernels = getattr(head, "kernels", None)
            if kernels is None:
                continue
            traced += kernels.traced_between(head.wall_to_gpu_ns(e.opened_ns), head.wall_to_gpu_ns(end))
            span += end - e.opened_ns
            counted = counted or kernels.counted
            if kernels.name not in modes:
                modes.append(kernels.name)
        if not span:
            return
        for key, n in served:
            tr = self._traced.get(key)
            if tr is None:
                tr = self._traced[key] = _Traced()
            tr.traced += n * traced
            tr.span += n * span
            tr.counted = tr.counted or counted
            tr.modes.extend(m for m in modes if m not in tr.modes)

    def _split_one(self, e: _Entry, values: List[int], proc, served: set) -> int:
        """Add one process's values of step `e` (a ledger row: census fields, then the step's priced kernel
        time) to its requests' shares by carry_split, on the step's non-zero fields only (a decode step has ~10
        of the 28; this runs for every request of every step on a thread beside the engine's loop). Returns
        the priced kernel time of the step's recomputed tokens (`e.redo`), claimed or not."""
        sub = e.kind != TOKENS
        rank = None
        if proc is not None:
            rank = self.per_process.setdefault(proc, {"total": [0] * ROW, "unattributed": [0] * ROW})
        nz = [(i, v) for i, v in enumerate(values) if v]
        total, sub_total = self._total, self._sub_total
        for i, v in nz:
            total[i] += v
            if sub:
                sub_total[i] += v
            if rank is not None:
                rank["total"][i] += v
        keys = self._keys(e)
        redo_ns = 0
        if not keys:
            self._unclaimed(values, rank)
            return redo_ns
        closed, live, done, accs, first = self._closed_early, self._live, self._done, self._acc, self._first_token
        follows = self.follows or sub
        # who claims each part: a request's accumulator, or None where its span is gone or the ledger does not
        # follow it (never announced, or settled): unclaimed, split with no carry of its own
        claim: List[Optional[_Acc]] = []
        for key in keys:
            if key in closed or (follows and key not in live and key not in done):
                claim.append(None)
                continue
            acc = accs.get(key)
            if acc is None:
                acc = accs[key] = _Acc(first_step_ns=e.opened_ns)
            served.add(key)
            claim.append(acc)
        if not nz:
            return redo_ns
        weights = [e.tokens[k] for k in keys]
        cost = self._cost(e, keys, values) if not sub else None
        by_tokens = (None, 0) if weights.count(weights[0]) == len(weights) else (weights, sum(weights))
        by_cost = by_tokens if cost is None else (
            (None, 0) if cost.count(cost[0]) == len(cost) else (cost, sum(cost)))
        if None in claim:
            carries = [a.carry if a is not None else [0] * ROW for a in claim]
            unclaimed = [j for j, a in enumerate(claim) if a is None]
            mine = [(j, a) for j, a in enumerate(claim) if a is not None]
            claimed = [a for _, a in mine]
        else:
            carries = [a.carry for a in claim]
            unclaimed, mine, claimed = [], None, claim
        rows = [a.values for a in claimed]
        subs = [a.sub for a in claimed] if sub else []
        pres = [a.prefill for k, a in zip(keys, claim)
                if a is not None and (first.get(k) is None or e.opened_ns < first[k])]
        pre_j = [j for j, (k, a) in enumerate(zip(keys, claim))
                 if a is not None and (first.get(k) is None or e.opened_ns < first[k])] if pres else []
        unatt = self._unattributed
        for i, v in nz:
            w, denom = by_cost if i in SPLIT_KERNEL_FIELDS else by_tokens
            parts = carry_split(v, w, denom, carries, i)
            if unclaimed:
                lost = sum(parts[j] for j in unclaimed)
                unatt[i] += lost
                if rank is not None:
                    rank["unattributed"][i] += lost
                mp = [parts[j] for j, _ in mine]
            else:
                mp = parts
            for r, x in zip(rows, mp):
                r[i] += x
            for r, x in zip(subs, mp):
                r[i] += x
            for r, j in zip(pres, pre_j):
                r[i] += parts[j]
            if i == PRICED and e.redo:
                for j, key in enumerate(keys):
                    n = e.redo.get(key)
                    if n:
                        x = parts[j] * min(n, e.tokens[key]) // e.tokens[key]
                        redo_ns += x
                        if claim[j] is not None:
                            claim[j].redo_ns += x
        return redo_ns

    def _keys(self, e: _Entry) -> List[Hashable]:
        """Step `e`'s requests in carry_split's order (by_tie), kept while the batch stays the same."""
        keys = [k for k, n in e.tokens.items() if n > 0]
        if keys != self._batch[0]:
            self._batch = (keys, by_tie(keys))
        return self._batch[1]

    def _cost(self, e: _Entry, keys: List[Hashable], values: Sequence[int]) -> Optional[List[int]]:
        """The kernel weights of step `e`'s requests: FLOPs (FLOPS_METHOD), or each one's cost alone
        (ALONE_METHOD: FLOPs plus the fitted fixed cost of a step, CostFit), given a shape; else None
        (tokens); MODEL_METHOD: each one's part of the step's fitted cost (StepModel), None while the fit of the
        step's kind is not ready (`e.fallback` says why). ALONE_METHOD and MODEL_METHOD fit this step (its priced
        kernel time) after weighing it."""
        if self._method == MODEL_METHOD:
            return self._model_weights(e, keys, values)
        if self._method == METHOD or self.shape is None:
            return None
        flops = step_weights(self.shape, keys, e.tokens, e.before or {}, self._prompt)
        if self._method != ALONE_METHOD:
            return flops
        fixed = self.fit.fixed_flops()
        if values[1] and not values[UNPRICED]:
            self.fit.add(sum(flops), values[PRICED])
        if fixed is None:
            return flops
        return [1] * len(flops) if fixed < 0 else [f + fixed for f in flops]

    def _model_weights(self, e: _Entry, keys: List[Hashable], values: Sequence[int]) -> Optional[List[int]]:
        news = [e.tokens[k] for k in keys]
        before = e.before or {}
        attns = [attention_work(n, before.get(k) or 0) for k, n in zip(keys, news)]
        fit = self.model.fit_of(news)
        w = fit.weights(news, attns)
        if w is None:
            e.fallback = fit.why
        if values[1] and not values[UNPRICED]:
            fit.add(self.model.features(news, attns), float(values[PRICED]))
        return w

    def _unclaimed(self, values: List[int], rank) -> None:
        for i, v in enumerate(values):
            self._unattributed[i] += v
            if rank is not None:
                rank["unattributed"][i] += v

    def pending(self) -> int:
        return len(self._done)
