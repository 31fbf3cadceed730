"""Start-up apart from serving: when a server served, and what its GPU did before, while and after.

A server's first seconds load weights, compile, capture graphs and warm up; dividing that by the
requests it later served gives figures no request caused ("269 MB host-to-device per request" that was
the model load). The serving period is

* from the first request's start to the last one's end, when request records are known (a request
  log, the proxy of `run --proxy`, an engine integration's log);
* else from the first GPU work after start-up settles: start-up is the GPU work up to its last pause of
  PAUSE_NS or more (a server that has loaded waits for its first request; a model load may pause between
  reads), a pause being start-up's while the kernels before it are a small share of the run's; found in the
  busiest process and applied to all, up to the last GPU work.

The split is exact, from the 20 ms windows: serving is the windows inside the period, after is the
windows past its end, and start-up is the process's totals less both, so it holds what the windows no
longer reach. It needs the windows to reach back to the period's start (the ring holds ~41 s; `run`
keeps it for longer, census.history); where they do not, the split says why and the figures per
request are over the whole run, start-up included, saying so.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from otel_gpu_census.report import timeline as tl_mod
from otel_gpu_census.census import DIRECTIONS, KernelTime, ProcessCensus, Stat, Window
from otel_gpu_census.report.request_log import RequestRecord

STARTUP_KERNELS = 0.05      # start-up's kernels (warm-up, graph capture) are a small share of a served run's
PAUSE_NS = 250_000_000      # no GPU work this long ends start-up: a server that has loaded waits for its first
                            # request, while a model load streams its weights without pauses this long
                            # (docs/measurements.md, the recorded llama-server runs)


@dataclass(frozen=True)
class Period:
    """The serving period, wall clock (Unix ns), and how it was found."""

    start_ns: int
    end_ns: int
    basis: str                # "requests" | "pause"
    requests: Optional[int] = None    # request records inside it (basis "requests")
    first_work_ns: int = 0    # basis "pause": the first GPU work (start-up began)

    @property
    def span_ns(self) -> int:
        return self.end_ns - self.start_ns


@dataclass(frozen=True)
class Phase:
    """What a process's GPU was asked in one part of its life: exact counts and bytes; durations as
    the census measured them (copies counted at their calls have none), kernel time possibly estimated."""

    copies: Dict[str, Stat]
    memset: Stat
    kernel_count: int
    kernel_time: KernelTime

    def copy(self, direction: str) -> Stat:
        return self.copies.get(direction, Stat())

    @property
    def empty(self) -> bool:
        return not (self.kernel_count or self.memset.count or any(s.count for s in self.copies.values()))

    def __add__(self, o: "Phase") -> "Phase":
        copies = dict(self.copies)
        for d, s in o.copies.items():
            copies[d] = copies.get(d, Stat()) + s
        return Phase(copies, self.memset + o.memset, self.kernel_count + o.kernel_count,
                     self.kernel_time + o.kernel_time)


NO_WORK = Phase({}, Stat(), 0, KernelTime(0))


@dataclass(frozen=True)
class ProcessSplit:
    census: ProcessCensus
    startup: Phase
    serving: Phase
    after: Phase


@dataclass(frozen=True)
class Split:
    """The period and each active process's split; `why` (and no period or no splits) when there is none."""

    period: Optional[Period]
    processes: List[ProcessSplit]
    why: Optional[str] = None
    inexact: Tuple[str, ...] = ()     # what keeps the split from adding up to the totals exactly

    @property
    def ok(self) -> bool:
        return self.period is not None and self.why is None

    def total(self, part: str) -> Phase:
        out = NO_WORK
        for p in self.processes:
            out = out + getattr(p, part)
        return out


def _totals_window(c: ProcessCensus) -> Window:
    t = c.totals()
    return Window(0, 0, kernel_count=t.kernel_count, kernel_ns=t.kernel_ns,
                  copies={d: s for d, s in t.copies.by_direction().items() if s.count or s.bytes or s.ns},
                  memset=t.memset, eager_launches=t.eager_launches, eager_traced=t.eager_traced,
                  eager_traced_ns=t.eager_traced_ns)


def _minus(a: Window, *parts: Window) -> Window:
    copies = dict(a.copies)
    kc, kns, el, et, etn, memset = a.kernel_count, a.kernel_ns, a.eager_launches, a.eager_traced, a.eager_traced_ns, a.memset
    for p in parts:
        kc, kns, el, et, etn = (kc - p.kernel_count, kns - p.kernel_ns, el - p.eager_launches, et - p.eager_traced,
                                etn - p.eager_traced_ns)
        memset = memset - p.memset
        for d, s in p.copies.items():
            copies[d] = copies.get(d, Stat()) - s
    return Window(0, 0, kernel_count=kc, kernel_ns=kns, copies=copies, memset=memset, eager_launches=el,
                  eager_traced=et, eager_traced_ns=etn)


def _phase(c: ProcessCensus, w: Window) -> Phase:
    return Phase({d: s for d, s in w.copies.items() if s.count or s.bytes}, w.memset, w.kernel_count,
                 c.kernel_time(w))


def _active(c: ProcessCensus) -> bool:
    return any(d.kernel_count or d.copies.total().count or d.memset.count for d in c.devices.values())


def _pause_start(t: tl_mod.Timeline) -> Optional[Tuple[int, int]]:
    """(first GPU work, first work after start-up's last pause of PAUSE_NS or more), wall ns; None without a pause.
    Start-up may pause several times (a model read from disk between uploads, compilation) and serving hardly runs
    kernels before it begins: the first pause is start-up's, and a later one too while the kernels before it are at
    most STARTUP_KERNELS of the run's; pauses later are serving's own (a state save holding the server's thread)."""
    need = max(1, -(-PAUSE_NS // t.slots[0].length)) if t.slots else 1
    total = sum(s.kernel_count for s in t.slots)
    first = found = None
    quiet = before = 0
    for s in t.slots:
        if not s.active:
            quiet += 1
            continue
        if first is None:
            first = s.start_ns
        elif quiet >= need and (found is None or before <= STARTUP_KERNELS * total):
            found = s.start_ns
        quiet = 0
        before += s.kernel_count
    return (first, found) if found is not None else None


def find_period(censuses: Sequence[ProcessCensus], records: Optional[Sequence[RequestRecord]] = None
                ) -> Tuple[Optional[Period], Optional[str]]:
    """The serving period, or (None, why not)."""
    active = [c for c in censuses if _active(c)]
    if not active:
        return None, "no GPU work"
    if records:
        return Period(min(r.start_ns for r in records), max(r.end_ns for r in records), "requests",
                      requests=len(records)), None
    main = max(active, key=lambda c: (lambda t: t.kernel_count + t.copies.total().count + t.memset.count)(c.totals()))
    t = tl_mod.build(main)
    if t is None or not t.slots:
        return None, f"pid {main.pid} kept no 20 ms windows"
    if not t.complete:
        return None, (f"the 20 ms windows of pid {main.pid} reach back {(t.span_ns) / 1e9:.1f} s from its last GPU "
                      "work, not to its start-up (`run` keeps them for the whole run)")
    found = _pause_start(t)
    if found is None:
        return None, (f"pid {main.pid}'s GPU work has no pause of {PAUSE_NS / 1e9:g} s or more, so its start-up "
                      "cannot be told apart from serving")
    first, start = found
    end = max(s.end_ns for tt in (tl_mod.build(c) for c in active) if tt for s in tt.slots if s.active)
    return Period(start, end, "pause", first_work_ns=first), None


def split_process(c: ProcessCensus, period: Period) -> Tuple[Optional[ProcessSplit], Optional[str]]:
    rng = tl_mod.window_range(c)
    total = _totals_window(c)
    if rng is None:      # activity but no windows: all of it before or after? Unknown.
        return None, f"pid {c.pid} kept no 20 ms windows"
    width, lo, hi, complete = rng
    start = c.wall_to_gpu_ns(period.start_ns) // width
    end = c.wall_to_gpu_ns(period.end_ns - 1) // width
    if lo > start and not complete:
        return None, (f"the 20 ms windows of pid {c.pid} reach back only to "
                      f"{(c.gpu_to_wall_ns(lo * width) - period.start_ns) / 1e9:.1f} s after serving began "
                      "(`run` keeps them for the whole run)")
    by = {w.start_ns // width: w for w in c.windows}
    inside = tl_mod.window_sum([w for i, w in by.items() if start <= i <= end])
    after = tl_mod.window_sum([w for i, w in by.items() if i > end])
    before = _minus(total, inside, after)
    return ProcessSplit(c, _phase(c, before), _phase(c, inside), _phase(c, after)), None


def split(censuses: Sequence[ProcessCensus], records: Optional[Sequence[RequestRecord]] = None) -> Split:
    """The serving period of `censuses` and what each active process did before, while and after it."""
    period, why = find_period(censuses, records)
    if period is None:
        return Split(None, [], why)
    out, whys, inexact = [], [], []
    for c in censuses:
        if not _active(c):
            continue
        ps, why = split_process(c, period)
        if ps is None:
            whys.append(why)
            continue
        out.append(ps)
        if c.window_late:
            inexact.append(f"pid {c.pid}: {c.window_late:,} records arrived after their 20 ms window had left the "
                           "ring: in its totals and counted as start-up here")
    if out and not whys and all(ps.serving.empty for ps in out):
        return Split(period, [], "no GPU work in the serving period" + (
            " (request records of another run?)" if period.basis == "requests" else ""))
    return Split(period, out, "; ".join(whys) or None, tuple(inexact))


def phase_dict(p: Phase) -> dict:
    out = {"kernel_count": p.kernel_count, "kernel_ns": p.kernel_time.ns,
           "copies": {d: {"count": s.count, "bytes": s.bytes, "ns": s.ns} for d in DIRECTIONS
                      for s in [p.copy(d)] if s.count}}
    if p.kernel_time.estimated:
        out["kernel_time_estimated"] = True
    if p.kernel_time.unknown:
        out["kernel_time_unknown"] = True
    if p.memset.count:
        out["memset"] = {"count": p.memset.count, "bytes": p.memset.bytes, "ns": p.memset.ns}
    return out
