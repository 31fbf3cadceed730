"""Where GPU time goes, 20 ms at a time: kernels, copies only, nothing, next to requests in flight.

Built from one process's window ring (``census.Window``, ~41 s of 20 ms buckets, or longer where
``census.history`` kept the ring over several reads) and, optionally, request records
(``request_log``). Every bucket of the covered range is a ``Slot``; buckets the ring has no entry for
had no activity at all (the ring keeps every bucket of its range that had any).

What a bucket can tell, and therefore the rule for splitting its length L:

* kernels: the kernels' durations inside the bucket, summed (concurrent kernels add up), capped at
  L. Exact for one stream of kernels with every kernel traced; an estimate where eager kernels are
  priced at a sampled mean (counted kernels, the default census's event pairs: ``kernel_time_estimated``).
* copies only: copy and memset durations inside the bucket, capped at what kernels left. Copies
  that overlapped kernels are counted here too, so this is an upper bound. Counted at the calls
  (the default census) a copy has no duration: this part is then 0 and ``copies_timed`` is false.
* nothing: the rest, so a lower bound of the time with nothing running on the GPU.

Counts and bytes of a bucket are exact in every census: a copy counted at its call lands in the
bucket of its call, a CUPTI record in the bucket of its start on the GPU.

Requests in flight per bucket are request-nanoseconds inside it (a request in flight for half a
bucket counts half), kept as integers; their mean over a span is the time-weighted mean.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from otel_gpu_census.census import FLAG_RING_OVERRUN, KERNELS_ALL, KERNELS_COUNTED, ProcessCensus, Stat, Window
from otel_gpu_census.report.request_log import RequestRecord

RING_SLOTS = 2048          # GC_WINDOW_SLOTS: buckets older than the newest minus this are gone


@dataclass(frozen=True)
class Slot:
    start_ns: int            # wall clock
    end_ns: int
    kernel_ns: int = 0       # capped at the slot's length (an estimate where Timeline.kernel_time_estimated)
    copy_only_ns: int = 0    # copies + memsets, capped at what kernels left
    in_flight_ns: int = 0    # request-ns inside the slot
    kernel_work_ns: int = 0  # the kernel time before the cap: an estimate puts a launch's whole time in the
                             # window of its launch, so only a sum over many windows means busy time
    kernel_count: int = 0    # kernels launched (counted) or started (traced) here
    memset_count: int = 0
    dtoh_bytes: int = 0
    dtoh_count: int = 0
    dtoh_ns: int = 0
    htod_bytes: int = 0
    htod_count: int = 0
    htod_ns: int = 0         # capped at the slot's length
    copy_counts: Tuple[Tuple[str, int], ...] = ()   # (direction, copies started here)

    @property
    def length(self) -> int:
        return self.end_ns - self.start_ns

    @property
    def idle_ns(self) -> int:
        return self.length - self.kernel_ns - self.copy_only_ns

    @property
    def active(self) -> bool:
        """Any kernel, copy or memset started here (whether or not its duration was measured)."""
        return bool(self.kernel_count or self.copy_counts or self.memset_count)

    def copies_started(self, direction: str) -> int:
        return dict(self.copy_counts).get(direction, 0)


@dataclass(frozen=True)
class Timeline:
    census: ProcessCensus
    slots: List[Slot]                  # every bucket of the covered range, in time order
    kernel_time_known: bool            # each slot's kernel_ns is the time of all its kernels (measured or estimated)
    requests: Optional[List[RequestRecord]] = None
    kernel_time_estimated: bool = False   # ... estimated: eager kernels priced at a sampled mean
    copies_timed: bool = True          # copy durations measured (CUPTI); counted at the calls they are not
    complete: bool = False             # the slots reach back to the process's first GPU work
    sums_exact: bool = True            # every record is in a bucket (no late record, no ring overrun)

    @property
    def start_ns(self) -> int:
        return self.slots[0].start_ns if self.slots else 0

    @property
    def end_ns(self) -> int:
        return self.slots[-1].end_ns if self.slots else 0

    @property
    def span_ns(self) -> int:
        return self.end_ns - self.start_ns

    def between(self, lo_ns: int, hi_ns: int) -> List[Slot]:
        """The slots that overlap wall time [lo_ns, hi_ns)."""
        return [s for s in self.slots if s.end_ns > lo_ns and s.start_ns < hi_ns]

    def serving(self) -> List[Slot]:
        """The slots from the first request's start to the last one's end (all, without records)."""
        if not self.requests:
            return list(self.slots)
        lo = min(r.start_ns for r in self.requests)
        hi = max(r.end_ns for r in self.requests)
        return self.between(lo, hi)


def span_words(t: "Timeline", slots: Sequence["Slot"]) -> str:
    """How a report names the span of `slots` (t.serving()): the requests' span, or the part of it the
    window ring still holds when the records reach further back."""
    total = len(t.requests or ())
    if not slots:
        return "no time"
    inside = sum(1 for r in t.requests or () if r.end_ns > slots[0].start_ns and r.start_ns < slots[-1].end_ns)
    span = f"{(slots[-1].end_ns - slots[0].start_ns) / 1e9:.6f} s"
    if t.requests and min(r.start_ns for r in t.requests) < slots[0].start_ns:
        return (f"the last {span} of the requests (all the 20 ms windows kept reach; {inside} of the {total} "
                "requests)")
    if t.requests:
        return f"the {span} from the first request to the last ({plural_requests(total)})"
    return f"the {span} of the windows kept"


def plural_requests(n: int) -> str:
    return f"{n:,} request" + ("" if n == 1 else "s")


def _in_flight(slots: List[Slot], records: Sequence[RequestRecord], t0: int, width: int) -> List[int]:
    """Request-ns per slot (slots are consecutive buckets of `width` ns starting at t0)."""
    out = [0] * len(slots)
    n = len(slots)
    for r in records:
        a, b = r.start_ns, r.end_ns
        if b <= t0 or n == 0 or a >= t0 + n * width:
            continue
        i0, i1 = max(0, (a - t0) // width), min(n - 1, (b - 1 - t0) // width)
        for i in range(i0, i1 + 1):
            s = t0 + i * width
            out[i] += min(b, s + width) - max(a, s)
    return out


def kernel_time_kind(c: ProcessCensus) -> Tuple[bool, bool]:
    """(known, estimated): whether a window's kernel time covers all its kernels, and whether it is an
    estimate. Every kernel traced: measured. Counted kernels (the default census's event pairs, CUPTI's
    counted mode, its windows): eager launches priced at a sampled mean, graph spans measured or priced.
    Sampled tracing, no kernels, or counted with no duration at all: not known."""
    k = c.kernels
    if k.untimed:
        return False, False
    if k.mode == KERNELS_ALL:
        return True, False
    if k.mode == KERNELS_COUNTED:
        return True, True
    return False, False


def window_range(c: ProcessCensus) -> Optional[Tuple[int, int, int, bool]]:
    """(width, first bucket index, last bucket index, complete) of what the windows cover, or None
    without windows. complete: the range reaches back to the process's first GPU work."""
    if not c.windows:
        return None
    width = c.windows[0].end_ns - c.windows[0].start_ns
    idx = [w.start_ns // width for w in c.windows]
    hi = max(idx)
    reach = c.windows_since_ns // width if c.windows_since_ns else hi - RING_SLOTS + 1
    firsts = [d.first_ns // width for d in c.devices.values() if d.first_ns]
    first = min(firsts + [min(idx)])
    return width, max(reach, first), hi, reach <= first


def build(c: ProcessCensus, records: Optional[Sequence[RequestRecord]] = None) -> Optional[Timeline]:
    """The timeline of one process's windows; None when it holds none."""
    rng = window_range(c)
    if rng is None:
        return None
    width, lo, hi, complete = rng
    by_idx = {w.start_ns // width: w for w in c.windows}
    offset = c.clock_ref_wall_ns - c.clock_ref_gpu_ns        # gpu -> wall, as gpu_to_wall_ns
    known, estimated = kernel_time_kind(c)
    slots = []
    for idx in range(lo, hi + 1):
        start = idx * width + offset
        w = by_idx.get(idx)
        if w is None:
            slots.append(Slot(start, start + width))
            continue
        work = c.kernel_time(w).ns if known else w.kernel_ns
        k = min(work, width)
        moved = sum(s.ns for s in w.copies.values()) + w.memset.ns
        dtoh, htod = w.copies.get("dtoh", Stat()), w.copies.get("htod", Stat())
        slots.append(Slot(
            start, start + width, kernel_ns=k, copy_only_ns=min(moved, width - k), kernel_work_ns=work,
            kernel_count=w.kernel_count,
            memset_count=w.memset.count, dtoh_bytes=dtoh.bytes, dtoh_count=dtoh.count, dtoh_ns=dtoh.ns,
            htod_bytes=htod.bytes, htod_count=htod.count, htod_ns=min(htod.ns, width),
            copy_counts=tuple((d, s.count) for d, s in sorted(w.copies.items()) if s.count)))
    recs = sorted(records, key=lambda r: r.start_ns) if records else None
    if recs:
        flights = _in_flight(slots, recs, lo * width + offset, width)
        slots = [dataclasses.replace(s, in_flight_ns=f) for s, f in zip(slots, flights)]
    return Timeline(c, slots, known, recs, kernel_time_estimated=estimated, copies_timed=c.kernels.copies_timed,
                    complete=complete, sums_exact=not c.window_late and not c.flags & FLAG_RING_OVERRUN)


def window_sum(windows: Sequence[Window]) -> Window:
    """The windows added together (one scope: counts, bytes, durations, eager launches), for kernel_time."""
    copies: Dict[str, Stat] = {}
    memset = Stat()
    kc = kns = el = et = etn = mask = 0
    for w in windows:
        kc += w.kernel_count
        kns += w.kernel_ns
        el += w.eager_launches
        et += w.eager_traced
        etn += w.eager_traced_ns
        mask |= w.device_mask
        memset = memset + w.memset
        for d, st in w.copies.items():
            copies[d] = copies.get(d, Stat()) + st
    lo = min((w.start_ns for w in windows), default=0)
    hi = max((w.end_ns for w in windows), default=0)
    return Window(lo, hi, kernel_count=kc, kernel_ns=kns, copies=copies, memset=memset, device_mask=mask,
                  eager_launches=el, eager_traced=et, eager_traced_ns=etn)


# ---------------------------------------------------------------------------------------------
# the split of a span of slots

@dataclass(frozen=True)
class Split:
    span_ns: int
    kernel_ns: int
    copy_only_ns: int
    idle_ns: int
    in_flight_ns: int

    @property
    def mean_in_flight(self) -> float:
        return self.in_flight_ns / self.span_ns if self.span_ns else 0.0

    def share(self, part: int) -> float:
        return part / self.span_ns if self.span_ns else 0.0


def split(slots: Sequence[Slot]) -> Split:
    return Split(sum(s.length for s in slots), sum(s.kernel_ns for s in slots),
                 sum(s.copy_only_ns for s in slots), sum(s.idle_ns for s in slots),
                 sum(s.in_flight_ns for s in slots))


INTERVALS_S = (1, 2, 5, 10, 20, 60)
MAX_ROWS = 12


def intervals(slots: Sequence[Slot], max_rows: int = MAX_ROWS) -> Tuple[int, List[Tuple[int, Split]]]:
    """(interval length in ns, [(interval start, split)]): the shortest of INTERVALS_S that gives at
    most max_rows rows."""
    if not slots:
        return 0, []
    span = slots[-1].end_ns - slots[0].start_ns
    step = next((s * 10**9 for s in INTERVALS_S if span <= s * 10**9 * max_rows), INTERVALS_S[-1] * 10**9)
    rows: Dict[int, List[Slot]] = {}
    t0 = slots[0].start_ns
    for s in slots:
        rows.setdefault((s.start_ns - t0) // step, []).append(s)
    return step, [(t0 + k * step, split(v)) for k, v in sorted(rows.items())]


IN_FLIGHT_GROUPS = ((0, 0, "0"), (1, 1, "1"), (2, 3, "2-3"), (4, 7, "4-7"), (8, 15, "8-15"), (16, None, "16+"))


def by_in_flight(slots: Sequence[Slot]) -> List[Tuple[str, Split]]:
    """The split of the slots grouped by the requests in flight in each (mean over the slot, half up)."""
    groups: Dict[str, List[Slot]] = {}
    for s in slots:
        k = (2 * s.in_flight_ns + s.length) // (2 * s.length) if s.length else 0
        label = next(lab for lo, hi, lab in IN_FLIGHT_GROUPS if k >= lo and (hi is None or k <= hi))
        groups.setdefault(label, []).append(s)
    return [(lab, split(groups[lab])) for _, _, lab in IN_FLIGHT_GROUPS if lab in groups]
