"""OpenTelemetry metrics over the GPU census: what processes asked of their GPUs, per GPU and process.

Two ways in:

* In-process (engine hooks, any program with its own MeterProvider)::

      from otel_gpu_census.telemetry.census_metrics import register_census_instruments, segment_file_source
      register_census_instruments(meter_provider, segment_file_source(my_segment_path))
      # any source() -> list[ProcessCensus] will do

* The sidecar that ``otel-gpu-census run`` starts in its own (parent) process, reading the census
  segments of the server's process tree (``telemetry.sidecar.start_sidecar``).

Every instrument is observable and reads the latest census snapshot; counters are cumulative totals
exactly as the injector tallied them (counts and bytes as integers, times in seconds). The names,
units and attributes are listed in ``docs/metrics.md`` (a test keeps the two in step).

Process lifetimes. Series are per process (``process.pid``). When a process exits its counters keep
their last totals for as long as this registration lives (at most ``retain_exited`` exited
processes; beyond that the oldest one's series stop). A pid reused by a new process starts new
totals under the same attributes, which a backend reads as a counter reset. The per-device sums
(``gpu_census.host.io``, ``gpu_census.busy.ratio``) fold in processes whose series stopped, so they never
go backwards.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from opentelemetry.metrics import CallbackOptions, Observation

from otel_gpu_census import census
from otel_gpu_census.census import DeviceTotals, ProcessCensus
from otel_gpu_census.version import __version__
from otel_gpu_census.telemetry.specs import COPY_DIRECTION, COPY_MEMORY, GPU, IO_DIRECTION, METER_NAME, PROCESS_EXE, PROCESS_PID, Spec, \
    create_observable, gpu_attributes

log = logging.getLogger("otel_gpu_census.metrics")

_PROC = GPU + (PROCESS_PID, PROCESS_EXE)
_COPY = _PROC + (COPY_DIRECTION, COPY_MEMORY)


CENSUS_INSTRUMENTS: Tuple[Spec, ...] = (
    Spec("gpu_census.kernel.count", "counter", "{kernel}", _PROC,
         "Kernels that ran (each node of a CUDA graph counts once); exact under both collectors."),
    Spec("gpu_census.kernel.time", "counter", "s", _PROC,
         "Summed kernel durations; concurrent kernels add up, so this can exceed wall time. Under the "
         "default collector an estimate: graph spans plus eager launches priced at the mean "
         "duration of the eager kernels sampled (kept from going back as the mean moves)."),
    Spec("gpu_census.busy.time", "counter", "s", _PROC,
         "Time with at least one of the process's kernels running (union of kernel intervals)."),
    Spec("gpu_census.kernel.traced.time", "counter", "s", _PROC,
         "Time the census took CUPTI's kernel records in the process: its whole life under the precise "
         "collector, 0 under the default one (busy time is measured only where this is not 0)."),
    Spec("gpu_census.graph.count", "counter", "{launch}", _PROC,
         "CUDA graph launches, when graphs are recorded per launch rather than per node."),
    Spec("gpu_census.graph.time", "counter", "s", _PROC,
         "Summed durations of those graph launches."),
    Spec("gpu_census.copy.count", "counter", "{copy}", _COPY,
         "Memory copies, by direction and by the kind of host memory involved."),
    Spec("gpu_census.copy.bytes", "counter", "By", _COPY,
         "Bytes copied, by direction and host memory kind."),
    Spec("gpu_census.copy.time", "counter", "s", _COPY,
         "Summed copy durations, by direction and host memory kind."),
    Spec("gpu_census.peer.received.count", "counter", "{copy}", _PROC,
         "Peer copies this GPU received from another GPU (the sender counts them as copy direction ptop)."),
    Spec("gpu_census.peer.received.bytes", "counter", "By", _PROC,
         "Bytes this GPU received in peer copies."),
    Spec("gpu_census.peer.received.time", "counter", "s", _PROC,
         "Summed durations of the peer copies this GPU received."),
    Spec("gpu_census.memset.count", "counter", "{memset}", _PROC, "Memsets."),
    Spec("gpu_census.memset.bytes", "counter", "By", _PROC, "Bytes set by memsets."),
    Spec("gpu_census.memset.time", "counter", "s", _PROC, "Summed memset durations."),
    Spec("gpu_census.records.dropped", "counter", "{record}", (PROCESS_PID, PROCESS_EXE),
         "Activity records CUPTI dropped: the totals above miss that much work."),
    Spec("gpu_census.calls.unsized", "counter", "{call}", (PROCESS_PID, PROCESS_EXE),
         "Driver calls that put work on the GPU which the census saw but could not size or count: the totals "
         "above miss their work."),
    Spec("gpu_census.exact", "gauge", "1", (PROCESS_PID, PROCESS_EXE),
         "1 while the census knows of no work it missed in the process; 0 once it does (unsized calls, functions "
         "it could not wrap, dropped records or lost calls, managed memory whose migrations it does not measure): its "
         "figures are then exact only for what it saw."),
    Spec("gpu_census.managed.unmeasured", "gauge", "1", (PROCESS_PID, PROCESS_EXE),
         "1 once the process allocated managed (unified) memory whose page migrations the census does not measure "
         "between host and device (the default collector; or CUPTI without unified-memory counters): that traffic, "
         "while any of it was live, is in no gpu_census.copy series. The precise collector (run --precise) measures "
         "it, as copy directions managed_htod and managed_dtoh. 0 otherwise."),
    Spec("gpu_census.process.counting", "gauge", "1", (PROCESS_PID, PROCESS_EXE),
         "1 while the census counts in the process; 0 once it exited or the census stepped aside."),
    Spec("gpu_census.busy.ratio", "gauge", "1", GPU,
         "Busy time gained per wall time since the previous collection, 0..1, all censused processes "
         "on the GPU together."),
    Spec("gpu_census.host.io", "counter", "By", GPU + (IO_DIRECTION,),
         "Bytes the censused processes copied host to device (receive) and device to host (transmit), every "
         "memory kind, and managed memory migrated each way where measured (not hw.gpu.io, which is all of the GPU's "
         "traffic: NVML's)."),
)

NS_PER_S = 1e9


def hw_id(d: DeviceTotals) -> str:
    """The GPU's UUID; 'cuda:<ordinal>' when the census could not learn it (ordinals are per process)."""
    return d.uuid or f"cuda:{d.device_id}"


def traced_ns(p: ProcessCensus) -> int:
    """How long the census took CUPTI's kernel records in the process, up to what its totals cover: its life under the
    precise collector, 0 under the default one (kernels counted at their calls)."""
    if p.kernels.counted:
        return 0
    until = p.complete_wall_ns or p.wall_update_ns
    return max(0, until - p.wall_start_ns)


class _Proc:
    """What the metrics keep of one process: its latest totals, not its windows or steps."""

    __slots__ = ("key", "pid", "exe", "wall_start_ns", "devices", "dropped", "counting", "gone_ns",
                 "kernels", "traced_ns", "kernel_ns", "unsized", "exact", "unmeasured")

    def __init__(self, p: ProcessCensus):
        self.key = (p.pid, p.proc_start_ticks)
        self.pid = p.pid
        self.wall_start_ns = p.wall_start_ns
        self.gone_ns = 0              # wall ns when first seen exited or missing; 0 while it runs
        self.kernel_ns: Dict[str, int] = {}
        self.update(p)

    def update(self, p: ProcessCensus) -> None:
        self.exe = p.comm or "unknown"
        self.devices: Dict[str, DeviceTotals] = {hw_id(d): d for d in p.devices.values()}
        self.dropped = p.dropped
        self.unsized = p.unsized_calls + p.calls_lost
        self.exact = not p.gaps
        self.unmeasured = p.managed_gap is not None
        self.counting = bool(p.alive and p.state == census.STATE_ACTIVE)
        self.kernels = p.kernels
        self.traced_ns = traced_ns(p)
        # counted: an estimate whose mean moves; a counter must not go back. Untimed (ACTIVITY=off): no
        # kernel time at all, so no point, never a 0 that reads as measured
        # events: eager kernels not timed make a device's kernel time unknown: no point, never a part read as whole
        self.kernel_ns = {} if p.kernels.untimed else {
            hid: max(self.kernel_ns.get(hid, 0), p.kernel_time(d).ns) if p.kernels.counted else d.kernel_ns
            for hid, d in self.devices.items() if not (p.kernels.events and p.kernel_time(d).unknown)}

    @property
    def attrs(self) -> Dict[str, object]:
        return {PROCESS_PID: self.pid, PROCESS_EXE: self.exe}


class CensusMetrics:
    """The snapshot behind the instruments; one source read serves every callback of a collection.

    `source` is called at most once per `min_refresh_s` (callbacks of one collection come within
    milliseconds of each other); a source that raises keeps the last snapshot, with one warning.
    """

    def __init__(self, source: Callable[[], Iterable[ProcessCensus]], min_refresh_s: float = 0.25,
                 retain_exited: int = 256, clock: Callable[[], int] = time.time_ns,
                 known_gpus: Optional[Mapping[str, Mapping[str, str]]] = None):
        self._source = source
        self._known_gpus = known_gpus or {}      # hw.id -> what NVML says of it (hw.model, hw.name, …)
        self._min_refresh_ns = int(min_refresh_s * 1e9)
        self._retain_exited = retain_exited
        self._clock = clock
        self._lock = threading.RLock()
        self._procs: Dict[Tuple[int, int], _Proc] = {}
        self._evicted: set = set()                     # keys whose series stopped; never re-added
        self._evicted_totals: Dict[str, DeviceTotals] = {}   # per hw.id, folded in at eviction
        self._last_refresh_ns: Optional[int] = None
        self._warned: set = set()
        # busy ratio: busy_ns per (process key, hw.id) at the previous ratio observation
        self._ratio_t_ns = clock()
        self._ratio_base: Dict[Tuple[Tuple[int, int], str], Tuple[int, int]] = {}   # (busy, traced)
        self._ratio_pending: Dict[str, int] = {}       # busy of evicted processes not yet reported
        self.reads = 0

    # -- reading ------------------------------------------------------------------------
    def _warn_once(self, key: str, msg: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    def refresh(self, force: bool = True) -> None:
        with self._lock:
            now = self._clock()
            if not force and self._last_refresh_ns is not None and now - self._last_refresh_ns < self._min_refresh_ns:
                return
            self._last_refresh_ns = now
            try:
                procs = list(self._source())
            except Exception as e:      # never into the SDK's collection thread
                self._warn_once(f"source:{type(e).__name__}", "metrics: reading the census failed (%s: %s); "
                                "keeping the last values", type(e).__name__, e)
                return
            self.reads += 1
            self._apply(procs, now)

    def _apply(self, procs: List[ProcessCensus], now: int) -> None:
        newest: Dict[int, ProcessCensus] = {}     # per pid: a reused pid's newest process wins
        for p in procs:
            cur = newest.get(p.pid)
            if cur is None or (p.proc_start_ticks, p.wall_start_ns) > (cur.proc_start_ticks, cur.wall_start_ns):
                newest[p.pid] = p
        for p in procs:
            key = (p.pid, p.proc_start_ticks)
            if key in self._evicted:
                continue
            if newest[p.pid] is not p:
                # An older process whose pid was reused: its series yield to the new one.
                rec = self._procs.get(key) or _Proc(p)
                rec.update(p)
                self._evict(rec)
                continue
            rec = self._procs.get(key)
            if rec is None:
                rec = self._procs[key] = _Proc(p)
            else:
                rec.update(p)
            running = p.alive and p.state != census.STATE_EXITED
            rec.gone_ns = 0 if running else (rec.gone_ns or now)
        present = {(p.pid, p.proc_start_ticks) for p in procs}
        for key, rec in list(self._procs.items()):
            if key not in present:           # segment removed: keep its last totals
                rec.counting = False
                rec.gone_ns = rec.gone_ns or now
            other = newest.get(rec.pid)
            if other is not None and (other.pid, other.proc_start_ticks) != key:
                self._evict(rec)
        exited = sorted((r for r in self._procs.values() if r.gone_ns), key=lambda r: r.gone_ns)
        for rec in exited[:max(0, len(exited) - self._retain_exited)]:
            self._evict(rec)

    def _evict(self, rec: _Proc) -> None:
        """Stop a process's series, folding its totals into the per-device sums."""
        self._procs.pop(rec.key, None)
        if rec.key in self._evicted:
            return
        self._evicted.add(rec.key)
        for hid, d in rec.devices.items():
            base = self._evicted_totals.get(hid)
            self._evicted_totals[hid] = d if base is None else base + d
            b = self._ratio_base.pop((rec.key, hid), None)
            if b is not None and rec.kernels.mode == census.KERNELS_ALL:
                self._ratio_pending[hid] = self._ratio_pending.get(hid, 0) + d.busy_ns - b[0]

    def processes(self) -> List[_Proc]:
        with self._lock:
            return list(self._procs.values())

    def device_totals(self) -> Dict[str, DeviceTotals]:
        """Per GPU: every process seen, running, exited or evicted, added together."""
        with self._lock:
            out = dict(self._evicted_totals)
            for rec in self._procs.values():
                for hid, d in rec.devices.items():
                    out[hid] = out[hid] + d if hid in out else d
            return out

    # -- busy ratio ---------------------------------------------------------------------
    def busy_ratios(self) -> Dict[str, float]:
        """Per GPU, busy time gained since the previous call over the wall time passed, 0..1.

        A process first seen now counts from zero if it started after the previous call, else
        from its current total (its earlier work belongs to intervals we did not observe).
        """
        with self._lock:
            now = self._clock()
            dt = now - self._ratio_t_ns
            gained: Dict[str, int] = dict(self._ratio_pending)
            base: Dict[Tuple[Tuple[int, int], str], Tuple[int, int]] = {}
            for rec in self._procs.values():
                if rec.kernels.untimed or rec.kernels.events:
                    continue                     # no kernel records: nothing to say about busy
                for hid, d in rec.devices.items():
                    k = (rec.key, hid)
                    if k in self._ratio_base:
                        prev, _ = self._ratio_base[k]
                    elif rec.wall_start_ns >= self._ratio_t_ns:
                        prev = 0
                    else:
                        prev = d.busy_ns
                    g = max(0, d.busy_ns - prev)
                    gained[hid] = gained.get(hid, 0) + g
                    base[k] = (d.busy_ns, rec.traced_ns)
            for hid in self._evicted_totals:
                gained.setdefault(hid, 0)
            self._ratio_base = base
            self._ratio_pending = {}
            self._ratio_t_ns = now
            if dt <= 0:          # the first call (or a clock step back): a starting point only
                return {}
            # Several processes on one GPU can overlap, and CUPTI delivers records late: clamp.
            return {hid: min(1.0, g / dt) for hid, g in gained.items()}

    # -- callbacks ----------------------------------------------------------------------
    def gpu(self, hid: str) -> Dict[str, object]:
        """A GPU's attributes on its series (specs.gpu_attributes)."""
        return gpu_attributes(hid, self._known_gpus)

    def _observe(self, fn: Callable[[], Iterable[Observation]]) -> Callable[[CallbackOptions], List[Observation]]:
        def callback(options: CallbackOptions) -> List[Observation]:
            try:
                self.refresh(force=False)
                return list(fn())
            except Exception as e:     # a bug here must not become a traceback per collection
                self._warn_once(f"cb:{type(e).__name__}", "metrics: census callback failed: %s: %s",
                                type(e).__name__, e)
                return []
        return callback

    def _per_device(self, value: Callable[[DeviceTotals], object],
                    counted: Optional[Callable[[DeviceTotals], int]] = None, timed: bool = False,
                    busy: bool = False, copy_time: bool = False) -> Iterable[Observation]:
        """One point per (process, GPU); with `counted`, only where it is non-zero (a series that
        most processes never start, such as graph launches or memsets, costs nothing until then); a
        `timed` series (a duration) none for a process that measures none (ACTIVITY=off); `busy` none where busy
        is not measured (ACTIVITY=off, events); `copy_time` none where copies are counted at the calls (off,
        windows, events: KernelTracing.copies_timed)."""
        for rec in self.processes():
            if timed and rec.kernels.untimed or busy and (rec.kernels.untimed or rec.kernels.events) \
                    or copy_time and not rec.kernels.copies_timed:
                continue
            attrs = rec.attrs
            for hid, d in rec.devices.items():
                if counted is None or counted(d):
                    yield Observation(value(d), {**self.gpu(hid), **attrs})

    def _per_copy(self, field: str) -> Iterable[Observation]:
        for rec in self.processes():
            if field == "ns" and not rec.kernels.copies_timed:
                continue                         # no copy time measured (ACTIVITY=off, windows, events)
            attrs = rec.attrs
            for hid, d in rec.devices.items():
                for (direction, mem), s in sorted(d.copies.cells.items()):
                    v = s.ns / NS_PER_S if field == "ns" else getattr(s, field)
                    yield Observation(v, {**self.gpu(hid), **attrs, COPY_DIRECTION: direction, COPY_MEMORY: mem})


    def _kernel_time(self) -> Iterable[Observation]:
        for rec in self.processes():
            attrs = rec.attrs
            for hid, ns in rec.kernel_ns.items():
                yield Observation(ns / NS_PER_S, {**self.gpu(hid), **attrs})

    def _traced(self) -> Iterable[Observation]:
        for rec in self.processes():
            attrs = rec.attrs
            for hid in rec.devices:
                yield Observation(rec.traced_ns / NS_PER_S, {**self.gpu(hid), **attrs})

    def _io(self) -> Iterable[Observation]:
        for hid, d in sorted(self.device_totals().items()):
            receive = d.copies.get("htod").bytes + d.copies.get("managed_htod").bytes   # migrations cross the bus too
            transmit = d.copies.get("dtoh").bytes + d.copies.get("managed_dtoh").bytes
            yield Observation(receive, {**self.gpu(hid), IO_DIRECTION: "receive"})
            yield Observation(transmit, {**self.gpu(hid), IO_DIRECTION: "transmit"})

    def callbacks(self) -> Dict[str, Callable[[CallbackOptions], List[Observation]]]:
        s = NS_PER_S
        # Series most processes never start appear at their first count (peer copies: only on
        # machines with several GPUs; graph launches: only when graphs are recorded per launch).
        graphs = lambda d: d.graph_launches          # noqa: E731
        peers = lambda d: d.peer_recv.count          # noqa: E731
        memsets = lambda d: d.memset.count           # noqa: E731
        fns: Dict[str, Callable[[], Iterable[Observation]]] = {
            "gpu_census.kernel.count": lambda: self._per_device(lambda d: d.kernel_count),
            "gpu_census.kernel.time": self._kernel_time,
            "gpu_census.busy.time": lambda: self._per_device(lambda d: d.busy_ns / s, busy=True),
            "gpu_census.kernel.traced.time": self._traced,
            "gpu_census.graph.count": lambda: self._per_device(lambda d: d.graph_launches, graphs),
            "gpu_census.graph.time": lambda: self._per_device(lambda d: d.graph_ns / s, graphs, timed=True),
            "gpu_census.copy.count": lambda: self._per_copy("count"),
            "gpu_census.copy.bytes": lambda: self._per_copy("bytes"),
            "gpu_census.copy.time": lambda: self._per_copy("ns"),
            "gpu_census.peer.received.count": lambda: self._per_device(lambda d: d.peer_recv.count, peers),
            "gpu_census.peer.received.bytes": lambda: self._per_device(lambda d: d.peer_recv.bytes, peers),
            "gpu_census.peer.received.time": lambda: self._per_device(lambda d: d.peer_recv.ns / s, peers,
                                                                      copy_time=True),
            "gpu_census.memset.count": lambda: self._per_device(lambda d: d.memset.count, memsets),
            "gpu_census.memset.bytes": lambda: self._per_device(lambda d: d.memset.bytes, memsets),
            "gpu_census.memset.time": lambda: self._per_device(lambda d: d.memset.ns / s, memsets, copy_time=True),
            "gpu_census.records.dropped": lambda: (Observation(r.dropped, r.attrs) for r in self.processes()),
            "gpu_census.calls.unsized": lambda: (Observation(r.unsized, r.attrs) for r in self.processes()),
            "gpu_census.exact": lambda: (Observation(int(r.exact), r.attrs) for r in self.processes()),
            "gpu_census.managed.unmeasured": lambda: (Observation(int(r.unmeasured), r.attrs) for r in self.processes()),
            "gpu_census.process.counting": lambda: (Observation(int(r.counting), r.attrs) for r in self.processes()),
            "gpu_census.busy.ratio": lambda: (Observation(v, self.gpu(h)) for h, v in sorted(self.busy_ratios().items())),
            "gpu_census.host.io": self._io,
        }
        return {name: self._observe(fn) for name, fn in fns.items()}


def register_census_instruments(meter_provider, source: Callable[[], Iterable[ProcessCensus]], *,
                                min_refresh_s: float = 0.25, retain_exited: int = 256,
                                clock: Callable[[], int] = time.time_ns,
                                known_gpus: Optional[Mapping[str, Mapping[str, str]]] = None) -> CensusMetrics:
    """Register the census instruments (``CENSUS_INSTRUMENTS``) on `meter_provider`.

    `source` returns the processes to report (``census.ProcessCensus``), e.g. ``lambda:
    [reader.read_segment(path)]`` inside a server. It is read once now (the busy ratio's starting
    point) and then when a collection needs it. `known_gpus` ({hw.id: attributes}, NVML's
    ``NvmlSampler.known_gpus()``) adds the recommended hw.* attributes of the GPUs it knows. Returns the
    :class:`CensusMetrics` behind the instruments (useful for its ``device_totals()`` and for tests).
    """
    state = CensusMetrics(source, min_refresh_s=min_refresh_s, retain_exited=retain_exited, clock=clock,
                          known_gpus=known_gpus)
    state.refresh()
    state.busy_ratios()          # start the ratio's first interval now
    meter = meter_provider.get_meter(METER_NAME, __version__)
    callbacks = state.callbacks()
    for spec in CENSUS_INSTRUMENTS:
        create_observable(meter, spec, callbacks[spec.name])
    return state


# -------------------------------------------------------------------------------------------
# sources: which processes to report

class ProcessTreeFilter:
    """Keeps the censuses of `root_pid` and its descendants (the census folder may be shared).

    Parent links come from the segments' ppid, from `parents` ({pid: ppid}, e.g. the launcher's
    live record of the tree), and from /proc for processes that wrote no segment (a shell between
    the launcher and the server). A decided membership is kept; a chain broken by a process that
    is gone and was never seen stays undecided (left out) and is tried again at the next read.
    """

    def __init__(self, root_pid: int, parents: Optional[Mapping[int, int]] = None):
        from otel_gpu_census.census import proctree
        self._proctree = proctree
        self.root_pid = root_pid
        self.root_ticks = proctree.proc_start_ticks(root_pid) or 0
        self._parents = parents
        self._learned: Dict[int, int] = {}
        self._decided: Dict[Tuple[int, int], bool] = {}

    def __call__(self, procs: Sequence[ProcessCensus]) -> List[ProcessCensus]:
        links = {p.pid: p.ppid for p in procs}
        out, walked = [], False
        for p in procs:
            key = (p.pid, p.proc_start_ticks)
            ok = self._decided.get(key)
            if ok is None:
                ok = self._descends(p, links)
                if ok is None and not walked:     # learn the live tree once per read, then retry
                    walked = True
                    try:
                        self._learned.update(self._proctree.live_descendants(self.root_pid))
                    except Exception:
                        pass
                    ok = self._descends(p, links)
                if ok is not None:
                    self._decided[key] = ok
            if ok:
                out.append(p)
        return out

    def _parent(self, pid: int, links: Dict[int, int]) -> Optional[int]:
        for source in (links, self._learned, self._parents or {}):
            pp = source.get(pid)
            if pp:
                return pp
        pp = self._proctree.proc_ppid(pid)
        if pp is not None:
            self._learned[pid] = pp
        return pp

    def _descends(self, p: ProcessCensus, links: Dict[int, int]) -> Optional[bool]:
        if p.pid == self.root_pid:
            return True
        if self.root_ticks and p.proc_start_ticks and p.proc_start_ticks < self.root_ticks:
            return False          # older than the root: an earlier process that had this pid
        pid, seen = p.ppid, set()
        while pid not in seen and len(seen) < 256:
            if pid == self.root_pid:
                return True
            if pid <= 1:
                return False
            seen.add(pid)
            nxt = self._parent(pid, links)
            if nxt is None:
                return None       # a link we cannot see (that process is gone)
            pid = nxt
        return False


def segment_file_source(path) -> Callable[[], List[ProcessCensus]]:
    """A census source over one segment file (a process's own, for in-process hooks): its
    totals, or nothing while the file does not exist yet (CUDA not initialised)."""
    from otel_gpu_census.census import reader

    def source() -> List[ProcessCensus]:
        if not os.path.exists(path):
            return []
        return [reader.read_segment(path, detail=False)]
    return source


def segment_source(census_dir, root_pid: Optional[int] = None,
                   parents: Optional[Mapping[int, int]] = None) -> Callable[[], List[ProcessCensus]]:
    """A census source over the segments in `census_dir` (only `root_pid`'s tree when given)."""
    from otel_gpu_census.census import reader
    tree = ProcessTreeFilter(root_pid, parents) if root_pid else None
    reported: set = set()

    def source() -> List[ProcessCensus]:
        # Totals only: metrics never read the window and step rings (~12 KiB per segment, not ~630).
        procs, errors = reader.scan(census_dir, detail=False)
        for e in errors:
            path = getattr(e, "path", str(e))
            if path not in reported:      # one line per unreadable file, not one per export
                reported.add(path)
                log.warning("metrics: skipping %s", e)
        return tree(procs) if tree else list(procs)
    return source
