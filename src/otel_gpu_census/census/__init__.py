"""The census model: what one process asked of its GPUs, as plain Python values.

The reader (``reader.py``) turns a census segment (``native/include/gpu_census.h``) into these
objects; metrics, spans and reports read only these. Every field is an exact integer count, byte
total or nanosecond total as the injector tallied it; ratios are derived here, never stored. The one
estimate, the kernel time of eager kernels under COUNTED tracing, is made here too (:func:`kernel_time`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Dict, Iterable, List, Optional, Tuple

from otel_gpu_census._native import consts as _c

# Copy directions and host memory kinds, in the order of the C enums gc_dir / gc_mem. The managed_* rows are no
# copy call's: managed memory the driver migrated, measured by CUPTI's unified-memory counters (precise collector).
DIRECTIONS: Tuple[str, ...] = ("htod", "dtoh", "dtod", "ptop", "htoh", "other", "managed_htod", "managed_dtoh")
MANAGED_DIRECTIONS: Tuple[str, ...] = ("managed_htod", "managed_dtoh")
MEMORY_KINDS: Tuple[str, ...] = ("pageable", "pinned", "device", "other")

# Segment states, collectors and flags: the values of gpu_census.h, read from the header itself (cffi), never copied
# by hand.
STATE_ACTIVE, STATE_EXITED = _c.GC_STATE_ACTIVE, _c.GC_STATE_EXITED
STATE_NAMES = {STATE_ACTIVE: "active", STATE_EXITED: "exited"}
COLLECTOR_DEFAULT, COLLECTOR_PRECISE = _c.GC_COLLECTOR_DEFAULT, _c.GC_COLLECTOR_PRECISE
# How kernels were counted, in the model: ALL (every kernel a CUPTI record: the precise collector) or COUNTED (at the
# calls: the default one).
KERNELS_ALL, KERNELS_COUNTED = 0, 3
FLAG_DROPPED, FLAG_RING_OVERRUN, FLAG_GRAPH_LAUNCHES = _c.GC_FLAG_DROPPED, _c.GC_FLAG_RING_OVERRUN, _c.GC_FLAG_GRAPH_LAUNCHES
FLAG_GRAPH_INEXACT = _c.GC_FLAG_GRAPH_INEXACT
FLAG_MANAGED, FLAG_UM_COUNTERS, FLAG_UM_REFUSED = _c.GC_FLAG_MANAGED, _c.GC_FLAG_UM_COUNTERS, _c.GC_FLAG_UM_REFUSED
FLAG_ENV_UNIFIED = _c.GC_FLAG_ENV_UNIFIED      # GGML_CUDA_ENABLE_UNIFIED_MEMORY was set (llama.cpp: managed buffers)
# what a census that cannot measure migrations tells its reader to use
PRECISE_HINT = "the precise collector (otel-gpu-census run --precise) measures them"
GRAPHS_NODE, GRAPHS_LAUNCH = _c.GC_GRAPHS_NODE, _c.GC_GRAPHS_LAUNCH
ATTACH_CUINIT, ATTACH_CONTEXT = 0, 1     # when CUPTI was set up: in cuInit (every precise census since layout 5)


@dataclass(frozen=True)
class Stat:
    """count / bytes / summed duration of one kind of activity."""

    count: int = 0
    bytes: int = 0
    ns: int = 0

    def __add__(self, o: "Stat") -> "Stat":
        return Stat(self.count + o.count, self.bytes + o.bytes, self.ns + o.ns)

    def __sub__(self, o: "Stat") -> "Stat":
        return Stat(self.count - o.count, self.bytes - o.bytes, self.ns - o.ns)


ZERO = Stat()


def _sum(stats: Iterable[Stat]) -> Stat:
    total = ZERO
    for s in stats:
        total = total + s
    return total


@dataclass(frozen=True)
class CopyTable:
    """Copies keyed by (direction, host memory kind); absent keys are zero."""

    cells: Dict[Tuple[str, str], Stat] = field(default_factory=dict)

    def get(self, direction: str, memory: Optional[str] = None) -> Stat:
        if memory is not None:
            return self.cells.get((direction, memory), ZERO)
        return _sum(s for (d, _), s in self.cells.items() if d == direction)

    def by_direction(self) -> Dict[str, Stat]:
        return {d: self.get(d) for d in DIRECTIONS}

    def total(self) -> Stat:
        return _sum(self.cells.values())

    def _combine(self, o: "CopyTable", sign: int) -> "CopyTable":
        keys = set(self.cells) | set(o.cells)
        out = {}
        for k in keys:
            a, b = self.cells.get(k, ZERO), o.cells.get(k, ZERO)
            v = a + b if sign > 0 else a - b
            if v != ZERO:
                out[k] = v
        return CopyTable(out)

    def __add__(self, o: "CopyTable") -> "CopyTable":
        return self._combine(o, +1)

    def __sub__(self, o: "CopyTable") -> "CopyTable":
        return self._combine(o, -1)


@dataclass(frozen=True)
class Managed:
    """Managed (unified) memory of one device (gc_managed): the calls both collectors count, and CUPTI's
    unified-memory counters beyond the migrations each way (those are copies' managed_* rows)."""

    allocs: int = 0
    alloc_bytes: int = 0
    live_bytes: int = 0            # allocated and not freed (frees the census could not follow never come off)
    advises: int = 0
    prefetch_in: Stat = ZERO       # prefetches to the device: calls and bytes asked (pages already there do not move)
    prefetch_out: Stat = ZERO      # ... to the host
    migrated_dtod: Stat = ZERO     # precise: migrated to this device from another
    gpu_faults: int = 0            # precise: GPU page fault groups
    thrashing: int = 0
    throttling: int = 0
    remote_maps: int = 0

    def _combine(self, o: "Managed", sign: int) -> "Managed":
        out = {}
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(o, f.name)
            out[f.name] = a + b if sign > 0 else a - b
        if sign < 0:
            out["live_bytes"] = self.live_bytes     # a state, not a running total
        return Managed(**out)

    def __add__(self, o: "Managed") -> "Managed":
        return self._combine(o, +1)

    def __sub__(self, o: "Managed") -> "Managed":
        return self._combine(o, -1)


NO_MANAGED = Managed()


@dataclass(frozen=True)
class DeviceTotals:
    """Running totals for one CUDA device inside one process."""

    device_id: int
    uuid: str = ""                 # "GPU-xxxxxxxx-..." as nvidia-smi prints it; "" if unknown
    kernel_count: int = 0
    kernel_ns: int = 0             # summed kernel durations
    busy_ns: int = 0               # union of kernel intervals
    first_ns: int = 0              # CUPTI timestamps
    last_ns: int = 0
    graph_launches: int = 0        # graph launches traced per launch (GRAPH_TRACE)
    graph_ns: int = 0              # their spans on the GPU
    graph_kernel_count: int = 0    # of kernel_count: kernels counted from those launches' graphs
    copies: CopyTable = field(default_factory=CopyTable)   # ("ptop", "device"): sent to another device
    memset: Stat = ZERO
    peer_recv: Stat = ZERO         # peer copies this device received from other devices
    # Eager (non-graph) kernels: launches the launch callbacks counted (COUNTED only), and the kernel
    # records tallied with their summed durations (part of kernel_ns): the sample COUNTED prices them by.
    eager_launches: int = 0
    eager_traced: int = 0
    eager_traced_ns: int = 0
    managed: Managed = NO_MANAGED  # managed memory: allocations, prefetches; migrations are copies' managed_* rows

    def __sub__(self, o: "DeviceTotals") -> "DeviceTotals":
        return dataclasses.replace(
            self,
            kernel_count=self.kernel_count - o.kernel_count,
            kernel_ns=self.kernel_ns - o.kernel_ns,
            busy_ns=self.busy_ns - o.busy_ns,
            first_ns=o.last_ns if o.last_ns else self.first_ns,
            graph_launches=self.graph_launches - o.graph_launches,
            graph_ns=self.graph_ns - o.graph_ns,
            graph_kernel_count=self.graph_kernel_count - o.graph_kernel_count,
            copies=self.copies - o.copies,
            memset=self.memset - o.memset,
            peer_recv=self.peer_recv - o.peer_recv,
            eager_launches=self.eager_launches - o.eager_launches,
            eager_traced=self.eager_traced - o.eager_traced,
            eager_traced_ns=self.eager_traced_ns - o.eager_traced_ns,
            managed=self.managed - o.managed,
        )

    def __add__(self, o: "DeviceTotals") -> "DeviceTotals":
        firsts = [x for x in (self.first_ns, o.first_ns) if x]
        return dataclasses.replace(
            self,
            uuid=self.uuid or o.uuid,
            kernel_count=self.kernel_count + o.kernel_count,
            kernel_ns=self.kernel_ns + o.kernel_ns,
            # Busy time of two processes on one device can overlap; the sum is an upper bound.
            busy_ns=self.busy_ns + o.busy_ns,
            first_ns=min(firsts) if firsts else 0,
            last_ns=max(self.last_ns, o.last_ns),
            graph_launches=self.graph_launches + o.graph_launches,
            graph_ns=self.graph_ns + o.graph_ns,
            graph_kernel_count=self.graph_kernel_count + o.graph_kernel_count,
            copies=self.copies + o.copies,
            memset=self.memset + o.memset,
            peer_recv=self.peer_recv + o.peer_recv,
            eager_launches=self.eager_launches + o.eager_launches,
            eager_traced=self.eager_traced + o.eager_traced,
            eager_traced_ns=self.eager_traced_ns + o.eager_traced_ns,
            managed=self.managed + o.managed,
        )


@dataclass(frozen=True)
class Window:
    """Activity that started inside one time bucket [start_ns, end_ns) of the CUPTI clock."""

    start_ns: int
    end_ns: int
    kernel_count: int = 0
    kernel_ns: int = 0
    copies: Dict[str, Stat] = field(default_factory=dict)   # by direction
    memset: Stat = ZERO
    device_mask: int = 0
    eager_launches: int = 0        # as in DeviceTotals; launches placed by launch time, records by start
    eager_traced: int = 0
    eager_traced_ns: int = 0


@dataclass(frozen=True)
class Step:
    """GPU work launched under one external correlation id (gc_step_begin)."""

    id: int
    kernel_count: int = 0
    kernel_ns: int = 0
    first_ns: int = 0
    last_ns: int = 0
    copies: Dict[str, Stat] = field(default_factory=dict)   # by direction
    memset: Stat = ZERO
    device_mask: int = 0
    eager_launches: int = 0        # as in DeviceTotals
    eager_traced: int = 0
    eager_traced_ns: int = 0


@dataclass(frozen=True)
class KernelTracing:
    """How the census's collector saw kernels (the segment's gc_collector and gc_timing). Copies, memsets and kernel
    counts are always exact.

    - ALL (the precise collector): CUPTI's record of every kernel and copy; every figure measured, busy too.
    - COUNTED (the default collector, ``preloaded``): every launch, copy and memset counted at its call by the census
      library preloaded (interpose.c), CUPTI never loaded. ``events``: kernel durations from CUDA event pairs around
      about 1 of every `events_every_eager` eager and `events_every_graph` graph launches of each thread (events.c):
      eager kernel time is launches x the mean of the pairs (ungated, only those that met a busy stream, or with none
      in the process, of those that met an idle one, `events_idle`, which read long), a graph launch's span its exec's
      mean span (`graph_untimed` launches had none). ``events_gate``: each pair's stream waited for its launch to be
      submitted before the first event (`events_forced` gates the watchdog opened were dropped). Copy time and busy:
      not measured (0). ``untimed`` (no pair ever set up): no duration measured at all, kernel time unknown
      (:func:`kernel_time`)."""

    mode: int = KERNELS_ALL
    untimed: bool = False          # COUNTED with no event pair: counted at the calls, no durations
    preloaded: bool = False        # COUNTED: the calls seen by the census library preloaded (LD_PRELOAD)
    graph_untimed: int = 0         # graph launches with no span to price them (in counts, not in kernel time)
    events: bool = False           # COUNTED with event pairs timing a sample of the launches
    events_every_eager: int = 0    # 1 of every N eager launches of a thread timed ...
    events_every_graph: int = 0    # ... and of its graph launches
    events_timed: int = 0          # event pairs read
    events_missed: int = 0         # launches of the sample left untimed (no free pair)
    events_failed: int = 0         # pairs an event call failed for
    events_idle: int = 0           # eager pairs that met an idle stream (they read long): not the eager sample ...
    events_idle_ns: int = 0        # ... their durations from the launch call's return, summed
    events_gate: bool = False      # pairs gated: the stream waited for the launch's submission before its first event
    events_gated: int = 0          # pairs gated
    events_forced: int = 0         # ... whose gate the census's watchdog opened (their thread held up): dropped
    events_lead: int = 0           # gated eager pairs less the GPU's pass over one event, timed just before them ...
    events_lead_ns: int = 0        # ... those passes, summed (already taken off the eager sample)

    @property
    def name(self) -> str:
        if self.untimed:
            return UNTIMED_MODE
        if self.events:
            return f"{EVENTS_MODE}{self.events_every_eager}/{self.events_every_graph}"
        return {KERNELS_ALL: "all", KERNELS_COUNTED: "counted"}.get(self.mode, f"unknown({self.mode})")

    @property
    def copies_timed(self) -> bool:
        """Copy and memset durations measured: only CUPTI's copy records time them; counted at the calls a copy has
        bytes and no duration."""
        return not (self.untimed or self.events)

    @property
    def counted(self) -> bool:
        """Kernel counts from the calls, eager kernels' time estimated from a sample (COUNTED)."""
        return self.mode == KERNELS_COUNTED

    def traced_between(self, gpu_start_ns: int, gpu_end_ns: int) -> int:
        """How many ns of [gpu_start_ns, gpu_end_ns) kernel durations were measured in: all of it, or none when no
        duration was (untimed)."""
        return 0 if self.untimed else max(0, gpu_end_ns - gpu_start_ns)


@dataclass(frozen=True)
class KernelTime:
    """Kernel time of one scope (a device, window, step or request's share): measured, or under COUNTED
    the graph spans and the traced eager kernels' durations with the sample's ones replaced by every
    eager launch priced at a mean duration."""

    ns: int
    estimated: bool = False        # COUNTED, with eager kernels in the scope: ns is an estimate
    unknown: bool = False          # COUNTED: eager launches and no mean to price them: left out of ns;
                                   # not estimated too: no duration measured at all (untimed)

    def __add__(self, o: "KernelTime") -> "KernelTime":
        return KernelTime(self.ns + o.ns, self.estimated or o.estimated, self.unknown or o.unknown)


# The kernel tracing name of a census that measured no duration (KernelTracing.name): readers of a share that
# lists the modes it saw know from it that no duration was measured.
UNTIMED_MODE = "calls"
# ... and the prefix of the event pairs' names (EAGER/GRAPH: 1 of every N launches timed by an event pair).
EVENTS_MODE = "events:"


def timed_modes(modes) -> bool:
    """Whether kernel durations were measured in every mode of `modes` (KernelTracing names)."""
    return UNTIMED_MODE not in modes


def copy_times_measured(modes) -> bool:
    """KernelTracing.copies_timed in every mode of `modes` (KernelTracing names): no mode counted at the calls."""
    return timed_modes(modes) and not spans_estimated(modes)


def spans_estimated(modes) -> bool:
    """Whether graph spans were priced from a sample (event pairs; not measured per launch) in any mode
    of `modes`."""
    return any(str(m).startswith(EVENTS_MODE) for m in modes)


def eager_mean_ns(scope) -> Optional[Fraction]:
    """Mean duration of the eager kernel records of `scope` (anything with eager_traced and
    eager_traced_ns), exact; None when it has none."""
    return Fraction(scope.eager_traced_ns, scope.eager_traced) if scope.eager_traced > 0 else None


def kernel_time(scope, counted: bool, fallback_mean_ns: Optional[Fraction] = None,
                timed: bool = True, spans_estimated: bool = False) -> KernelTime:
    """The kernel time of `scope` (kernel_ns and the eager_* fields: DeviceTotals, Window, Step, a Share).

    Not COUNTED: kernel_ns as measured. COUNTED: kernel_ns - eager_traced_ns + eager_launches x mean,
    rounded to the ns, the mean being the scope's own sample (eager_traced_ns / eager_traced) or, without
    one, `fallback_mean_ns` (the process's over its life, :meth:`ProcessCensus.eager_mean_ns`). With
    neither the eager launches' time is unknown and left out. Not `timed` (untimed):
    no duration was measured, so a scope with kernels has an unknown kernel time (0 ns, unknown).
    `spans_estimated` (event pairs): the graph spans in kernel_ns are priced too, so any kernel is."""
    if not timed:
        return KernelTime(0, unknown=bool(scope.kernel_count))
    if not counted:
        return KernelTime(scope.kernel_ns)
    # a split share rounds each field apart: its eager part may exceed its kernel_ns by a unit
    base = max(0, scope.kernel_ns - scope.eager_traced_ns)
    estimated = bool(scope.eager_launches or scope.eager_traced or (spans_estimated and scope.kernel_count))
    if not scope.eager_launches:
        return KernelTime(base, estimated)
    mean = eager_mean_ns(scope)
    if mean is None:
        mean = fallback_mean_ns
    if mean is None:
        return KernelTime(base, True, unknown=True)
    eager = scope.eager_launches * mean
    return KernelTime(base + (2 * eager.numerator + eager.denominator) // (2 * eager.denominator), True)


class KernelTimed:
    """The kernel time of a request's cost (ledger.GpuCost, steps.Settled): both carry kernel_tracing (the
    modes seen), kernel_traced_ns out of kernel_span_ns, kernel_counted and eager_mean_ns (the fallback), share
    and prefill, and kernel_priced and prefill_priced ((ns, eager launches unpriced) as a step split priced
    them; None: priced from the share itself)."""

    kernel_priced = None
    prefill_priced = None

    @property
    def kernel_traced_ratio(self) -> float:
        return self.kernel_traced_ns / self.kernel_span_ns if self.kernel_span_ns else 1.0

    def kernel_time(self, share) -> KernelTime:
        """Kernel time of one of its shares (share, prefill, window, unattributed): measured, or estimated
        under counted tracing (:func:`kernel_time`)."""
        return kernel_time(share, self.kernel_counted, self.eager_mean_ns, timed=timed_modes(self.kernel_tracing),
                           spans_estimated=spans_estimated(self.kernel_tracing))

    def share_time(self) -> KernelTime:
        """The kernel time of its share: as split (``kernel_priced``: each step priced once, so the shares and
        what no request claimed add up to the steps exactly) where the split priced it, else :meth:`kernel_time`."""
        return self._priced(self.share, self.kernel_priced)

    def prefill_time(self) -> KernelTime:
        """The same for the part of its share before its first token."""
        return self._priced(self.prefill, self.prefill_priced)

    @property
    def kernel_unpriced(self) -> int:
        """Eager kernel launches of its share whose time is left out: no sample, nor a mean, could price them."""
        if self.kernel_priced is not None:
            return self.kernel_priced[1]
        return self.share.eager_launches if self.kernel_time(self.share).unknown else 0

    def _priced(self, share, priced) -> KernelTime:
        kt = self.kernel_time(share)
        if priced is None:
            return kt
        ns, unpriced = priced
        untimed = not timed_modes(self.kernel_tracing) and bool(share.kernel_count)
        return KernelTime(ns, kt.estimated or bool(unpriced), unknown=bool(unpriced) or untimed)


@dataclass(frozen=True)
class GraphTracing:
    """How CUDA graph launches were counted (OTEL_GPU_CENSUS_GRAPHS). LAUNCH: one record per launch,
    its kernels, copies and memsets learned from the graph when it was instantiated or updated (exact
    counts and bytes; a graph's kernel time is its span). NODE: one record per node of every launch.
    `paused_ns`: time a control file had the census paused (nothing counted then)."""

    mode: int = GRAPHS_NODE
    unknown: int = 0               # launches whose graph was not known: only their span counted
    inexact: int = 0               # launches of graphs with conditional or changed nodes
    paused: bool = False
    paused_ns: int = 0

    @property
    def name(self) -> str:
        return {GRAPHS_NODE: "node", GRAPHS_LAUNCH: "launch"}.get(self.mode, f"unknown({self.mode})")


@dataclass(frozen=True)
class Attach:
    """When the census set CUPTI up: in cuInit (CUINIT, today's precise collector), or, in segments recorded before
    that, CONTEXT: once the first
    primary CUDA context was active, because CUPTI set up before a context exists makes its graph
    replays slower; GPU work before `wall_ns` is not counted, and the first context existed at most
    `after_ns` before it. CUINIT: inside cuInit, before any work. `contexts_late`: contexts created
    after the attach (counted from their first launch; their graph replays pay CUPTI's per-node cost).
    `wall_ns` 0: a segment written before this was recorded."""

    mode: int = ATTACH_CUINIT
    wall_ns: int = 0
    after_ns: int = 0
    contexts_late: int = 0

    @property
    def name(self) -> str:
        return {ATTACH_CUINIT: "cuinit", ATTACH_CONTEXT: "context"}.get(self.mode, f"unknown({self.mode})")


@dataclass(frozen=True)
class ProcessCensus:
    """One segment, read consistently at one moment."""

    path: str
    pid: int
    ppid: int
    comm: str
    proc_start_ticks: int
    wall_start_ns: int            # CLOCK_REALTIME
    wall_update_ns: int
    clock_ref_gpu_ns: int         # a CUPTI timestamp and the wall clock read with it
    clock_ref_wall_ns: int
    cupti_version: int
    state: int
    flags: int
    records: int
    records_unknown: int
    dropped: int
    buffers: int
    buffers_refused: int
    step_unmatched: int
    window_late: int
    step_max: int
    last_gpu_ns: int
    devices: Dict[int, DeviceTotals]
    windows: List[Window] = field(default_factory=list)     # sorted by start_ns
    steps: Dict[int, Step] = field(default_factory=dict)
    windows_since_ns: int = 0     # CUPTI time from which `windows` holds every bucket that had activity; 0: the
                                  # ring's own reach, its newest bucket less GC_WINDOW_SLOTS (census.history keeps
                                  # a ring's windows over several reads, reaching further back)
    torn: bool = False            # writer died mid-update: values may be mid-change
    alive: bool = True            # the process still runs (same pid and start time)
    complete_wall_ns: int = 0     # GPU work that finished before this wall time is in the totals
    launches_lost: int = 0        # COUNTED: eager launches counted but placed nowhere (in no total)
    calls_lost: int = 0           # COUNTED: copies, memsets, graph launches seen and in no total
    unsized_calls: int = 0        # calls of driver work functions the census has no wrapper for (not sized)
    unwrapped: int = 0            # such functions handed out with no way to count their calls
    unsized_name: str = ""        # the first such function
    kernels: KernelTracing = KernelTracing()
    graphs: GraphTracing = GraphTracing()
    attach: Attach = Attach()
    um_cpu_faults: int = 0        # precise: CPU page faults on managed memory (CUPTI's unified-memory counters)
    um_since_wall_ns: int = 0     # FLAG_UM_COUNTERS: when they went on
    um_refused_code: int = 0      # FLAG_UM_REFUSED: CUPTI's result code

    # -- managed memory ----------------------------------------------------------------
    @property
    def managed_in_use(self) -> bool:
        """Managed (unified) memory was allocated or migrated in this process: pages may have moved between host
        and device with no copy call naming them."""
        return bool(self.flags & FLAG_MANAGED)

    @property
    def migrations_measured(self) -> bool:
        """CUPTI's unified-memory counters were on (precise collector): the managed_* copy rows hold what moved."""
        return bool(self.flags & FLAG_UM_COUNTERS)

    def managed_totals(self) -> Managed:
        out = NO_MANAGED
        for d in self.devices.values():
            out = out + d.managed
        return out

    @property
    def managed_gap(self) -> Optional[str]:
        """The phrase that says managed memory was in use and its migrations were not measured; None when none was
        in use or they were."""
        if not self.managed_in_use or self.migrations_measured:
            return None
        m = self.managed_totals()
        what = (f"managed memory in use ({m.allocs:,} allocations, {m.alloc_bytes:,} bytes, {m.live_bytes:,} live)"
                if m.allocs else "managed memory in use")
        if self.flags & FLAG_UM_REFUSED:
            return (f"{what}: page migrations between host and device not measured (CUPTI gave no unified-memory "
                    f"counters here, code {self.um_refused_code}); copies, kernels and memsets stay exact")
        return (f"{what}: page migrations between host and device are not measured by this collector (no copy call "
                f"names them); {PRECISE_HINT}")

    # -- derived ---------------------------------------------------------------------
    @property
    def gaps(self) -> List[str]:
        """What this process's census knows it did not count, one phrase each (none: exact for what ran)."""
        out = []
        if self.managed_gap:
            out.append(self.managed_gap)
        if self.unsized_calls:
            out.append(f"{self.unsized_calls:,} calls of {self.unsized_name or 'driver functions'} the census "
                       "could not size (a driver function it has no wrapper for)")
        if self.unwrapped:
            out.append(f"{self.unwrapped:,} driver work functions handed out uncounted"
                       + (f" ({self.unsized_name})" if self.unsized_name and not self.unsized_calls else ""))
        if self.calls_lost:
            out.append(f"{self.calls_lost:,} copies, memsets or graph launches seen but not counted")
        if self.launches_lost:
            out.append(f"{self.launches_lost:,} kernel launches counted but placed nowhere")
        if self.dropped:
            out.append(f"{self.dropped:,} activity records dropped")
        return out

    @property
    def step_gaps(self) -> List[str]:
        """:attr:`gaps`, and what a share taken from steps misses besides: managed memory the driver migrated carries
        no correlation id, so it is in the device totals and the windows, never in a step."""
        out = list(self.gaps)
        if self.migrations_measured and any(d.copies.get(m).count for d in self.devices.values()
                                            for m in MANAGED_DIRECTIONS):
            out.append("managed memory migrated between host and device is measured per process and 20 ms window, "
                       "not per step: step shares hold none of it")
        return out

    @property
    def state_name(self) -> str:
        return STATE_NAMES.get(self.state, f"unknown({self.state})")

    def gpu_to_wall_ns(self, gpu_ns: int) -> int:
        return gpu_ns - self.clock_ref_gpu_ns + self.clock_ref_wall_ns

    def wall_to_gpu_ns(self, wall_ns: int) -> int:
        return wall_ns - self.clock_ref_wall_ns + self.clock_ref_gpu_ns

    def totals(self) -> DeviceTotals:
        """All devices of this process added together (device_id -1)."""
        out = DeviceTotals(device_id=-1)
        for d in self.devices.values():
            out = out + d
        return out

    def eager_mean_ns(self) -> Optional[Fraction]:
        """Mean eager kernel duration over the process's life, all devices: the fallback mean of
        :func:`kernel_time` for its windows, steps and requests."""
        m = eager_mean_ns(self.totals())
        k = self.kernels
        if m is None and k.events and k.events_idle:   # only idle-stream pairs: the last resort (they read long)
            m = Fraction(k.events_idle_ns, k.events_idle)
        return m

    def kernel_time(self, scope) -> KernelTime:
        """:func:`kernel_time` of one of this process's scopes, priced by its own mode and mean."""
        own = not self.kernels.counted or eager_mean_ns(scope) is not None
        return kernel_time(scope, self.kernels.counted, None if own else self.eager_mean_ns(),
                           timed=not self.kernels.untimed, spans_estimated=self.kernels.events)

    def windows_between(self, gpu_start_ns: int, gpu_end_ns: int) -> List[Window]:
        """Buckets that overlap [gpu_start_ns, gpu_end_ns) of the CUPTI clock."""
        return [w for w in self.windows if w.end_ns > gpu_start_ns and w.start_ns < gpu_end_ns]


def delta(newer: ProcessCensus, older: Optional[ProcessCensus]) -> Dict[int, DeviceTotals]:
    """Per-device change between two reads of the same process (all of `newer` if no older)."""
    if older is None:
        return dict(newer.devices)
    out = {}
    for dev, d in newer.devices.items():
        o = older.devices.get(dev)
        out[dev] = d - o if o is not None else d
    return out


def merge_devices(processes: Iterable[ProcessCensus]) -> Dict[str, DeviceTotals]:
    """Totals per physical GPU across processes, keyed by UUID (or 'cuda:<ordinal>' if unknown).

    Counts, bytes and kernel time add exactly: each record lives in exactly one process's segment.
    Busy time is a per-process union, so its sum over processes sharing a GPU is an upper bound.
    """
    out: Dict[str, DeviceTotals] = {}
    for p in processes:
        for d in p.devices.values():
            key = d.uuid or f"cuda:{d.device_id}"
            out[key] = out[key] + d if key in out else d
    return out
