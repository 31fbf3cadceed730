"""Give each finished request its share of the server's GPU work, once the census has caught up.

An integration (the llama.cpp proxy today) tells a :class:`GpuLedger` when a request starts, when its
first token streams and when it ends. CUPTI hands records to the census up to about a second late, so a finished request waits
(without blocking anything) until every relevant segment says it is complete past the request's end
(the injector's ``complete_wall_ns``, at a flush before the latest one read: CUPTI may hand records
over a flush late; for segments without it, a publish at least ``margin`` after the end), the server
exited, or ``max_wait`` passed; then its share is computed with
:func:`windows.attribute` from the buckets its window touched and every request in flight in
them, and handed back as a :class:`GpuCost`.

Which processes count (:class:`CensusSource`): the server process (the proxy's ``--upstream-pid``)
and its descendants — Ollama runs its model in a child — or, without a pid, every segment in the
census folder that was alive during the request.

:class:`GpuCost` is engine-neutral: ``method`` says how the share was found (``time_window_shared``
here; ``step_tokens`` for per-step shares), ``steps`` how many steps it covers (0 for windows), and
``note`` an integration's explanation of what its spans show (the span attribute
``gpu_census.attribution.note`` leads with it). Under counted kernel tracing (the default) its kernel
counts are exact and its kernel times estimated (:meth:`GpuCost.kernel_time`).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable, Dict, Hashable, List, Optional, Sequence, Tuple

from otel_gpu_census.census import (FLAG_DROPPED, FLAG_RING_OVERRUN, STATE_ACTIVE, DeviceTotals, KernelTimed,
                                    ProcessCensus, eager_mean_ns, folder, proctree, reader)
from otel_gpu_census.attribution.shares import NOTHING, Share
from otel_gpu_census.attribution.windows import METHOD as WINDOW_METHOD
from otel_gpu_census.attribution.windows import Interval, attribute

log = logging.getLogger("otel_gpu_census.attribution")

BUCKET_SLACK_NS = 1_000_000_000     # keep finished requests this long before the oldest open one
# With the injector's "complete up to" time: GPU work that finished before it is counted. A request's
# last bucket ends at most 20 ms after the request; work started in it may run a little longer.
COMPLETE_SLACK_NS = 100_000_000
INTERVAL_SLACK_NS = 100_000_000     # requests this close to a request's window may share its buckets
MAX_CACHED_SPLITS = 4096            # bucket splits remembered (~80 s of buckets of one process)
DESCENDANTS_TTL_S = 1.0             # the server's child processes, read from /proc at most this often

_LATER = object()           # _settle_one: wait for the census (and so must every later request)

# GpuCost.status values
COMPLETE = "complete"       # census published >= margin after the request ended (or the server exited)
SETTLED = "settled"         # waited max_wait; the census was published after the request ended
STALE = "stale"             # waited max_wait; no publish since before the request ended: may miss work
NO_CENSUS = "no_census"     # no census folder / reading switched off
NO_SEGMENT = "no_segment"   # the folder holds no segment of the server
READ_ERROR = "read_error"
SHUTDOWN = "shutdown"       # the proxy stopped before the census caught up
# the figures are exact for what the census saw, but it knows it missed work the share should hold (driver
# calls it could not see or size, steps it lost, work on threads it does not follow): `notes` say what
PARTIAL = "partial"


@dataclass
class GpuCost(KernelTimed):
    """One request's GPU work: its share, what its window (or steps) held, and how sure that is."""

    status: str
    method: str = WINDOW_METHOD     # how the share was found: time_window_shared | step_tokens
    steps: int = 0                  # steps the share was taken from (step attribution; 0 for windows)
    note: str = ""                  # the integration's note on what the figures mean (first in the span's)
    share: Share = NOTHING          # this request's share of its window
    prefill: Share = NOTHING        # the part of the share before its first token
    window: Share = NOTHING         # everything in the buckets its window touched
    unattributed: Share = NOTHING   # of `window`, what no request was in flight for
    buckets: int = 0
    concurrency_max: int = 0        # most requests in flight at once in those buckets
    pids: List[int] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    waited_s: float = 0.0
    # each process's mode: all, off, ON/PERIOD, counted:ON/PERIOD
    kernel_tracing: List[str] = field(default_factory=list)
    kernel_traced_ns: int = 0       # of the request's span (summed over processes), kernels traced ...
    kernel_span_ns: int = 0         # ... out of this long (step attribution: over its steps, x tokens)
    # counted kernel tracing (a server's processes share one mode): kernel times are estimated, eager
    # launches priced at a share's own sample's mean, else at this one (the processes' over their life)
    kernel_counted: bool = False
    eager_mean_ns: Optional[Fraction] = None
    # step attribution: the share's (and prefill's) kernel time as the steps were split, (ns, eager launches
    # left unpriced) (KernelTimed.share_time); None: priced from the share itself (windows)
    kernel_priced: Optional[Tuple[int, int]] = None
    prefill_priced: Optional[Tuple[int, int]] = None

    @property
    def has_figures(self) -> bool:
        """Whether the census gave this request any figures (its status, or buckets or processes seen)."""
        return self.status in (COMPLETE, SETTLED, PARTIAL) or bool(self.buckets or self.pids)

    @property
    def has_window(self) -> bool:
        """Whether the figures come with a time window (bucket totals, unattributed part)."""
        return self.method == WINDOW_METHOD or self.buckets > 0


def mark_gaps(cost: GpuCost, censuses: Sequence[ProcessCensus]) -> GpuCost:
    """`cost` labelled partial, with what the census missed, when any of the processes it was taken from knows of
    work it could not count (a driver function it cannot size, lost calls, dropped records): such a share is exact
    only for what was seen. The counters are per process, so every share after the first gap says so."""
    gaps = [f"pid {c.pid}: " + "; ".join(c.gaps) for c in censuses if c.gaps]
    if gaps and cost.status in (COMPLETE, SETTLED):
        cost.status = PARTIAL
    if gaps:
        cost.notes = cost.notes + ["the census missed work in this server (" + "; ".join(gaps) + ")"]
    return cost


class CensusSource:
    """Reads the segments of the server (and its children) from the census folder."""

    def __init__(self, directory: str, pid: Optional[int] = None):
        self.directory = directory
        self.pid = pid
        self._root_ticks: Optional[int] = None
        self._warned: set = set()
        self._parents: Tuple[float, Dict[int, int]] = (float("-inf"), {})

    def read_headers(self) -> Tuple[List[ProcessCensus], List[str]]:
        """Same processes, without windows and steps (~12 KiB a segment): enough to decide whether
        the census has caught up."""
        return self.read(detail=False)

    def read(self, detail: bool = True) -> Tuple[List[ProcessCensus], List[str]]:
        censuses, errors = reader.scan(self.directory, detail)
        notes = self._notes(errors)
        if self.pid is not None:
            if self._root_ticks is None:
                self._root_ticks = proctree.proc_start_ticks(self.pid)
            parents = self._descendants()
            censuses = proctree.process_tree(self.pid, censuses, parents=parents, root_start_ticks=self._root_ticks)
        return censuses, notes

    def _descendants(self) -> Dict[int, int]:
        # /proc/PID/task/*/children for every thread of the server: dozens of reads for llama-server
        t, parents = self._parents
        now = time.monotonic()
        if now - t >= DESCENDANTS_TTL_S:
            parents = proctree.live_descendants(self.pid)
            self._parents = (now, parents)
        return parents

    def read_range(self, lo_ns: int, hi_ns: int, headers=None) -> Tuple[List[ProcessCensus], List[str]]:
        """The processes that lived during wall [lo, hi), each with only the windows of that range:
        headers first (~12 KiB a segment; `headers`: a read_headers() result just taken), then one
        copy of each relevant segment, parsed only as far as attribution needs (reader.read_windows)."""
        heads, notes = headers if headers is not None else self.read_headers()
        out, errors = [], []
        for h in heads:
            if not (h.wall_start_ns < hi_ns and (h.alive or h.wall_update_ns >= lo_ns)):
                continue
            try:
                out.append(reader.read_windows(h.path, lo_ns, hi_ns))
            except reader.SegmentError as e:      # gone or damaged since its header was read
                errors.append(e)
        return out, notes + self._notes(errors)

    def _notes(self, errors) -> List[str]:
        notes = []
        for e in errors:
            if e.path not in self._warned:
                self._warned.add(e.path)
                log.warning("census: cannot read %s: %s", folder.show_path(e.path), e.reason)
            notes.append(f"unreadable segment {e.path}: {e.reason}")
        return notes


@dataclass
class _Req:
    key: Hashable
    start_ns: int
    first_token_ns: Optional[int] = None
    end_ns: Optional[int] = None
    future: Optional["asyncio.Future[GpuCost]"] = None
    done: bool = False
    _ivs: Tuple = ((), None)        # (intervals, the (first_token_ns, end_ns) they were made for)

    def intervals(self) -> Sequence[Interval]:
        made, made_for = self._ivs
        if made and made_for == (self.first_token_ns, self.end_ns):
            return made
        k = self.key
        if self.first_token_ns is None:
            made = (Interval((k, "all"), self.start_ns, self.end_ns, group=k),)
        else:
            ft = max(self.first_token_ns, self.start_ns)
            if self.end_ns is not None:
                ft = min(ft, self.end_ns)
            made = (Interval((k, "prefill"), self.start_ns, ft, group=k),
                    Interval((k, "decode"), ft, self.end_ns, group=k))
        self._ivs = (made, (self.first_token_ns, self.end_ns))
        return made


def _wall_span(c: ProcessCensus, lo: int, hi: int):
    """Buckets of `c` overlapping wall [lo, hi), and the wall span those buckets cover."""
    ws = c.windows_between(c.wall_to_gpu_ns(lo), c.wall_to_gpu_ns(hi))
    if not ws:
        return ws, lo, hi
    return ws, c.gpu_to_wall_ns(ws[0].start_ns), c.gpu_to_wall_ns(ws[-1].end_ns)


def cost_of(key: Hashable, req_span: Tuple[int, int], censuses: Sequence[ProcessCensus],
            intervals: Sequence[Interval], cache: Optional[Dict] = None) -> GpuCost:
    """The GPU cost of request `key` (wall span `req_span`) in `censuses`, sharing its buckets with
    every interval in `intervals` (which must include the request's own, keyed (key, phase)).
    `cache`: bucket splits kept between calls (attribution.attribute)."""
    lo, hi = req_span
    cost = GpuCost(status=COMPLETE)
    most = 0
    life = DeviceTotals(device_id=-1)      # the counted processes over their life: the fallback mean
    for c in censuses:
        ws, wlo, whi = _wall_span(c, lo, hi)
        cost.pids.append(c.pid)
        flags = []
        if c.flags & FLAG_RING_OVERRUN:
            flags.append("window ring overrun")
        if c.flags & FLAG_DROPPED:
            flags.append("CUPTI dropped records")
        if c.torn:
            flags.append("torn read")
        if c.window_late:
            flags.append(f"{c.window_late} records arrived too late for the window ring")
        for f in flags:
            cost.notes.append(f"pid {c.pid}: {f}")
        if c.kernels.name not in cost.kernel_tracing:
            cost.kernel_tracing.append(c.kernels.name)
        cost.kernel_traced_ns += c.kernels.traced_between(c.wall_to_gpu_ns(lo), c.wall_to_gpu_ns(hi))
        cost.kernel_span_ns += max(0, hi - lo)
        if c.kernels.counted:
            cost.kernel_counted = True
            life = life + c.totals()
        if not ws:
            continue
        touching = [iv for iv in intervals if iv.overlaps(wlo, whi)]
        mine = [iv.key for iv in touching if iv.owner == key]
        a = attribute(ws, c.gpu_to_wall_ns, touching, cache=cache, keys=mine)
        cost.share = cost.share + a.group_share(mine)
        cost.prefill = cost.prefill + a.share((key, "prefill"))
        cost.window = cost.window + a.total
        cost.unattributed = cost.unattributed + a.unattributed
        cost.buckets += a.buckets
        most = max([most] + [a.concurrency_max.get(k, 0) for k in mine])
    cost.concurrency_max = most
    cost.eager_mean_ns = eager_mean_ns(life)
    return cost


class GpuLedger:
    """Requests in flight and recently finished, and the wait for the census to catch up."""

    def __init__(self, source: Optional[CensusSource], margin_s: float = 1.2, max_wait_s: float = 3.0,
                 poll_s: float = 0.25, clock: Callable[[], int] = time.time_ns, note: str = ""):
        """`note`: the integration's explanation of its figures, put on every cost (GpuCost.note)."""
        self.source = source
        self.note = note
        self.margin_ns = int(margin_s * 1e9)
        self.max_wait_ns = int(max(max_wait_s, margin_s) * 1e9)
        self.poll_s = poll_s
        self.clock = clock
        self.reqs: Dict[Hashable, _Req] = {}
        self._waiting: Dict[Hashable, _Req] = {}     # closed, waiting for their cost
        self._splits: Dict = {}         # bucket splits shared by the requests that touch a bucket
        self._flushes: Dict[str, Tuple[int, int]] = {}   # per segment: its last two complete times read
        self._wake: Optional[asyncio.Event] = None
        self._task: Optional[asyncio.Task] = None
        self._stopping = False

    # -- bookkeeping from the proxy ---------------------------------------------------------
    def open(self, key: Hashable, start_ns: int) -> None:
        self.reqs[key] = _Req(key, start_ns)

    def first_token(self, key: Hashable, t_ns: int) -> None:
        r = self.reqs.get(key)
        if r is not None and r.first_token_ns is None:
            r.first_token_ns = t_ns

    def forget(self, key: Hashable) -> None:
        """A request that never reached the server."""
        self.reqs.pop(key, None)

    def close(self, key: Hashable, end_ns: int) -> "asyncio.Future[GpuCost]":
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        r = self.reqs.get(key)
        if r is None:
            fut.set_result(GpuCost(status=NO_CENSUS))
            return fut
        r.end_ns = max(end_ns, r.start_ns)
        r.future = fut
        if self.source is None:
            r.done = True
            fut.set_result(GpuCost(status=NO_CENSUS))
            self._prune()
            return fut
        self._waiting[key] = r
        self._ensure_task()
        self._wake.set()
        return fut

    # -- the waiting loop ----------------------------------------------------------------------
    def _ensure_task(self) -> None:
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="gpu-ledger")

    def _pending(self) -> List[_Req]:
        return list(self._waiting.values())

    async def _run(self) -> None:
        while not self._stopping:
            pending = self._pending()
            if not pending:
                self._wake.clear()
                await self._wake.wait()
                continue
            now = self.clock()
            earliest = min(r.end_ns for r in pending) + min(self.margin_ns, COMPLETE_SLACK_NS)
            if now < earliest:       # the census cannot have caught up with anyone yet
                await self._sleep(min((earliest - now) / 1e9, self.poll_s))
                continue
            # One hand-over to a worker thread reads the census and works out every cost it can
            # settle (bucket splits take milliseconds a request): the loop relays streams meanwhile,
            # and only hands the results out.
            others = list(self.reqs.values())          # the intervals that share buckets, as of now
            settled = await asyncio.to_thread(self._read_and_settle, pending, now, others)
            if settled is None:
                await self._sleep(self.poll_s)
                continue
            for r, cost, at in settled:
                if not r.done:
                    self._finish(r, cost, at)
            self._prune()
            await self._sleep(self.poll_s)

    def _read_and_settle(self, pending: Sequence[_Req], now: int, others: Sequence[_Req]):
        """In a worker thread: None when the census cannot settle anyone yet, else [(request, cost,
        now)] for those it settles, in end order (see _settle)."""
        try:
            got = self._read_when_ready(pending, now)
            if got is None:
                return None
            censuses, notes = got
            error = None
        except Exception as e:   # a broken folder must not stop the proxy
            censuses, notes, error = [], [], f"{type(e).__name__}: {e}"
        return self._settle(pending, censuses, notes, error, self.clock(), others)

    def _read(self, pending: Sequence[_Req], headers=None) -> Tuple[List[ProcessCensus], List[str]]:
        """The census for the buckets `pending` may touch (in a worker thread: file reads). A source
        that cannot read a range (a test's stand-in) reads everything."""
        read_range = getattr(self.source, "read_range", None)
        if read_range is None:
            return self._note_flushes(self.source.read(), everything=True)
        lo = min(r.start_ns for r in pending) - BUCKET_SLACK_NS
        hi = max(r.end_ns for r in pending) + BUCKET_SLACK_NS
        return self._note_flushes(read_range(lo, hi) if headers is None else read_range(lo, hi, headers))

    def _read_when_ready(self, pending: Sequence[_Req], now: int):
        """In a worker thread (one hand-over per poll): the census for `pending` when it can settle
        anyone, else None. A header read (~12 KiB a segment) decides before the windows are read
        (~650 KiB). Only the request that ended first needs checking: a census that covers a later
        end covers an earlier one, a segment that counts for the earlier request only has ended (so
        covers it), and running out of time also comes first to the first to end."""
        read_headers = getattr(self.source, "read_headers", None)
        if read_headers is None:
            return self._read(pending)
        first = min(pending, key=lambda r: r.end_ns)
        if now >= first.end_ns + self.max_wait_ns:
            return self._read(pending)
        headers = self._note_flushes(read_headers(), everything=True)
        censuses = headers[0]
        if censuses and not self._caught_up(self._relevant(censuses, first.start_ns, first.end_ns), first):
            return None
        return self._read(pending, headers)

    async def _sleep(self, s: float) -> None:
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), timeout=max(s, 0.001))
        except asyncio.TimeoutError:
            pass

    def _relevant(self, censuses: Sequence[ProcessCensus], lo: int, hi: int) -> List[ProcessCensus]:
        # A segment counts when its process lived during the request: started before it ended and
        # published after it started (or is still there to publish).
        return [c for c in censuses if c.wall_start_ns < hi and (c.alive or c.wall_update_ns >= lo)]

    def _settle(self, pending: Sequence[_Req], censuses: List[ProcessCensus], notes: List[str],
                error: Optional[str], now: int, others: Sequence[_Req]) -> List[Tuple[_Req, GpuCost, int]]:
        """The costs `censuses` settles (pure: nothing is finished here, so it can run off the loop).
        `others`: every request whose intervals may share a bucket (a snapshot of self.reqs)."""
        out = []
        for r in sorted(pending, key=lambda r: r.end_ns):
            if r.done:
                continue
            cost = self._settle_one(r, censuses, notes, error, now, others)
            if cost is _LATER:
                break               # requests that ended later cannot settle either (_read_when_ready)
            if cost is not None:
                out.append((r, cost, now))
        return out

    def _settle_one(self, r: _Req, censuses: List[ProcessCensus], notes: List[str], error: Optional[str],
                    now: int, others: Sequence[_Req]):
        """The request's cost, None when it cannot settle yet, or _LATER when neither it nor any
        request that ended after it can settle yet."""
        rel = self._relevant(censuses, r.start_ns, r.end_ns)
        out_of_time = now >= r.end_ns + self.max_wait_ns
        if error is not None:
            if out_of_time:
                return GpuCost(status=READ_ERROR, notes=[error])
            return _LATER
        if not rel:
            if out_of_time or not censuses:
                return GpuCost(status=NO_SEGMENT, notes=list(notes))
            return None
        caught_up = self._caught_up(rel, r)
        if not caught_up and not out_of_time:
            return _LATER
        cost = cost_of(r.key, (r.start_ns, r.end_ns), rel, self._intervals(r.start_ns, r.end_ns, others),
                       self._splits)
        if not caught_up:
            cost.status = SETTLED if all(c.wall_update_ns >= r.end_ns for c in rel) else STALE
        cost.notes = notes + cost.notes
        return mark_gaps(cost, rel)

    def _caught_up(self, rel: Sequence[ProcessCensus], r: _Req) -> bool:
        return all(self._covers(c, r.end_ns) for c in rel)

    def _note_flushes(self, read, everything: bool = False):
        """Remember each segment's last two complete times in `read` (a read's result, handed back);
        a read of `everything` forgets the segments it no longer holds (bounded memory)."""
        old = self._flushes
        new = {} if everything else dict(old)
        for c in read[0]:
            prev, cur = old.get(c.path, (0, 0))
            new[c.path] = (cur, c.complete_wall_ns) if c.complete_wall_ns > cur else (prev, cur)
        self._flushes = new           # one assignment: stop() may read while a poll's thread still runs
        return read

    def _covers(self, c: ProcessCensus, end_ns: int) -> bool:
        """Whether `c` holds all the GPU work of the buckets up to wall time `end_ns`."""
        if not c.alive or c.state != STATE_ACTIVE:
            return True
        if c.complete_wall_ns:
            # The injector's flusher says up to when it is complete, but its periodic flush (not forced)
            # keeps back a buffer holding a record still in flight, with the finished records before it:
            # those come with the next flush. So a complete time counts once a later flush was read.
            return self._flushes.get(c.path, (0, 0))[0] >= end_ns + COMPLETE_SLACK_NS
        return c.wall_update_ns >= end_ns + self.margin_ns     # else: CUPTI's ~1 s delivery, plus margin

    def _intervals(self, lo: int, hi: int, reqs: Optional[Sequence[_Req]] = None) -> List[Interval]:
        # A request's buckets reach at most one bucket (20 ms) beyond it on either side.
        out: List[Interval] = []
        lo, hi = lo - INTERVAL_SLACK_NS, hi + INTERVAL_SLACK_NS
        for r in (self.reqs.values() if reqs is None else reqs):
            if r.start_ns < hi and (r.end_ns is None or r.end_ns > lo):
                out.extend(r.intervals())
        return out

    def _finish(self, r: _Req, cost: GpuCost, now: int) -> None:
        r.done = True
        self._waiting.pop(r.key, None)
        cost.waited_s = max(0, now - r.end_ns) / 1e9
        cost.note = cost.note or self.note
        if r.future is not None and not r.future.done():
            r.future.set_result(cost)

    def _prune(self) -> None:
        # A finished request is still needed while an unfinished one may share a bucket with it.
        open_starts = [r.start_ns for r in self.reqs.values() if not r.done]
        horizon = min(open_starts + [self.clock()]) - BUCKET_SLACK_NS
        for k in [k for k, r in self.reqs.items() if r.done and r.end_ns is not None and r.end_ns < horizon]:
            del self.reqs[k]
        if len(self._splits) > MAX_CACHED_SPLITS:
            # oldest first (insertion order); a bucket split again later costs time, never accuracy
            for k in list(self._splits)[:len(self._splits) // 2]:
                del self._splits[k]

    async def stop(self) -> None:
        """Hand every waiting request what the census has now: complete when it had caught up (or the
        server exited), else status shutdown."""
        self._stopping = True
        if self._task is not None:
            self._wake.set()
            try:
                await asyncio.wait_for(self._task, 2)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                self._task.cancel()
        pending = self._pending()
        if not pending:
            return
        try:
            censuses, notes = await asyncio.to_thread(self._read, pending) if self.source else ([], [])
        except Exception:
            censuses, notes = [], []
        now = self.clock()
        for r in pending:
            rel = self._relevant(censuses, r.start_ns, r.end_ns)
            if rel:
                cost = cost_of(r.key, (r.start_ns, r.end_ns), rel, self._intervals(r.start_ns, r.end_ns),
                               self._splits)
                cost.notes = notes + cost.notes
                if not self._caught_up(rel, r):
                    cost.status = SHUTDOWN
            else:
                cost = GpuCost(status=NO_SEGMENT if self.source is not None else NO_CENSUS)
            self._finish(r, cost, now)
