"""What the census itself cost a process, estimated from what it counted and CUPTI's per-record costs.

CUPTI charges the thread that launches GPU work for each activity record it will produce; the census's
own processing above that was measured at ~1 % of it (docs/measurements.md §4). The per-record costs
below were measured on an H200 (driver r580, CUPTI 13.5; §10 and §12: one process, 21 paired rounds
on a quiet machine, quartiles within ±0.1 µs), so on other machines the estimate is a scale, not a
measurement:

- an eager kernel launch traced with the default's kinds: 0.902 µs (§11's 1.25 µs had a build beside it);
- a kernel node of a CUDA graph counted per launch: 0.119 µs of GPU time with CUPTI set up inside cuInit
  (OTEL_GPU_CENSUS_ATTACH=cuinit, and every census before it), 0.010 µs set up after the context
  (the default since §15); traced node by node: 0.332;
- a copy or memset: 0.81 µs (a 4 KiB copy with the default's kinds);
- every eager launch, traced or counted: 0.654 µs for CUPTI being set up at all (§20: against the same
  process before CUPTI was set up; the per-record figures above were measured against CUPTI set up with
  nothing enabled, so they come on top). Counted launches (OTEL_GPU_CENSUS_KERNELS=counted, the default)
  cost that alone: the driver's launch callback was not told apart from zero (§19); their kernel
  records, taken on the duty cycle, are priced as eager kernels as well. CUPTI's tax on the CUDA calls
  that launch nothing (~0.1 µs a call, §20) is not counted, so not in the estimate.

Counted at the calls (OTEL_GPU_CENSUS_ACTIVITY=off: no activity API, so none of the above applies) the
prices are torch's, measured on the H200 as processes side by side against a process without the census
(§21, bench/perf/calls_tax.py, 6 rotations): an eager launch 1.31 µs (a torch add on its launching thread:
CUPTI's launch callbacks), a copy 0.65 µs (its callback and pointer queries), a graph kernel node 0.129 µs
of GPU time (and 0.269 µs of the thread that launches the graph).

Counted at the calls by the census library preloaded (LD_PRELOAD, CUPTI never loaded: `run`'s default
ACTIVITY=events, and `run --activity off`) the prices are the library's wrappers', measured on the H200 inside one
process whose census was switched off and back between rounds, ABBA (§27, bench/perf/launch_phases.py, 30-40
pairs of rounds of a C program's launches, medians):
- an eager launch counted: 0.137 µs (the default's 0.185, less 1/128 of a gated eager pair);
- a graph launch counted: 0.790 µs (its exec's contents looked up; from the two graph rows, every launch paired
  5.441 and 1 in 4 paired 1.953: count + pair and count + pair / 4);
- an event pair (ACTIVITY=events): around an eager launch 6.045 µs gated (6.182 for the launch and its pair, less
  the count; the ungated eager pair was not measured alone, so it is priced the same: an upper bound), around a
  graph launch 4.651 µs gated, 3.039 ungated.
Copies and memsets are not priced there: in the same runs a copy pair ran faster while counted (§27), so no price
for a copy call could be read. Processes side by side had not told these prices from zero (§22: ±0.5 µs a launch
from one process to the next).

The estimate is seconds over the census's life: of the launching threads' time for eager launches and
copies, and of GPU time for graph nodes (a graph's replay is the GPU's work; §14-§15: with CUPTI set
up before the context existed each graph kernel node costs ~0.12 µs more for the context's life, even
with the census paused, and a paused census counts no node, so what a pause still costs is not in the
estimate). Where those
threads, or the GPU running small graph kernels, are the bottleneck, it is about the throughput the
census costs."""
from __future__ import annotations

from dataclasses import dataclass

from .census import ATTACH_CUINIT, GRAPHS_LAUNCH, ProcessCensus

EAGER_KERNEL_S = 0.902e-6                   # a kernel record, above CUPTI set up
SET_UP_EAGER_S = 0.654e-6                   # CUPTI set up, against no CUPTI: every eager launch
GRAPH_NODE_PER_LAUNCH_S = 0.119e-6          # CUPTI set up in cuInit, before the context
GRAPH_NODE_AFTER_CONTEXT_S = 0.010e-6       # set up once the context was active (ATTACH=context)
GRAPH_NODE_PER_NODE_S = 0.332e-6
COPY_S = 0.81e-6
CALLS_LAUNCH_S = 1.31e-6                    # ACTIVITY=off (§21): an eager launch, its callbacks
CALLS_COPY_S = 0.65e-6                      # ... a copy or memset call
CALLS_GRAPH_NODE_S = 0.129e-6               # ... a graph kernel node, GPU time
WRAPPED_LAUNCH_S = 0.137e-6                 # preloaded (§27): an eager launch counted by the library's wrapper
WRAPPED_GRAPH_LAUNCH_S = 0.790e-6           # ... a graph launch counted
PAIR_EAGER_S = 6.045e-6                     # ... ACTIVITY=events: an event pair around an eager launch (gated)
PAIR_GRAPH_S = 4.651e-6                     # ... around a graph launch, gated
PAIR_GRAPH_UNGATED_S = 3.039e-6             # ... ungated (OTEL_GPU_CENSUS_EVENT_GATE=off)


@dataclass(frozen=True)
class CensusCost:
    eager_kernels: int            # kernel records of eager launches (and, traced per node, graph nodes)
    graph_nodes: int              # kernels counted from graph launches' learned contents
    copies: int                   # copies and memsets, graph ones included
    seconds: float
    per_node: bool                # graphs traced node by node: their nodes are among eager_kernels
    node_s: float = GRAPH_NODE_PER_LAUNCH_S    # what one graph kernel node was priced at
    launches_counted: int = 0     # eager launches the launch callbacks counted (counted mode)
    launches_set_up: int = 0      # eager launches priced at CUPTI's set-up cost (counted, else records)
    wrapped: bool = False         # counted by the library preloaded: launches at the wrappers' prices, copies unpriced
    graph_launches: int = 0       # ... graph launches counted
    pairs_eager: int = 0          # ... ACTIVITY=events: event pairs around eager launches (the sample, idle ones too)
    pairs_graph: int = 0          # ... and around graph launches
    pair_graph_s: float = PAIR_GRAPH_S   # what one graph pair was priced at (gated or not)

    def share_of(self, ns: int) -> float:
        return self.seconds * 1e9 / ns if ns > 0 else 0.0


def estimate(c: ProcessCensus) -> CensusCost:
    eager = graph = copies = launches = 0
    for d in c.devices.values():
        graph += d.graph_kernel_count
        # counted: kernel_count holds launches, and only the duty cycle's eager kernels were records
        eager += d.eager_traced if c.kernels.counted else d.kernel_count - d.graph_kernel_count
        launches += d.eager_launches if c.kernels.counted else 0
        copies += sum(s.count for s in d.copies.cells.values()) + d.memset.count
    if c.kernels.windows:         # the wrappers count; CUPTI set up at the first window taxes every launch
        node_s = graph_node_s(c)  # after it (§23), and the windows' kernel records cost as the default's
        s = eager * EAGER_KERNEL_S + graph * node_s + launches * SET_UP_EAGER_S
        return CensusCost(eager, graph, copies, s, False, node_s, launches, launches)
    if c.kernels.preloaded:       # the library's own wrappers, no CUPTI: their prices in one process (§27)
        return wrapped_cost(c, eager, graph, copies, launches)
    if c.kernels.untimed:         # counted at the calls (no record: eager is 0): the callbacks' prices
        s = launches * CALLS_LAUNCH_S + copies * CALLS_COPY_S + graph * CALLS_GRAPH_NODE_S
        return CensusCost(eager, graph, copies, s, False, CALLS_GRAPH_NODE_S, launches, 0)
    per_node = c.graphs.mode != GRAPHS_LAUNCH
    # Traced node by node, graph nodes are kernel records like eager ones: priced as eager launches,
    # an upper bound (a node costs CUPTI 0.332 µs against 0.902 for an eager launch).
    node_s = graph_node_s(c)
    set_up = launches if c.kernels.counted else eager
    s = eager * EAGER_KERNEL_S + graph * node_s + copies * COPY_S + set_up * SET_UP_EAGER_S
    return CensusCost(eager, graph, copies, s, per_node, node_s, launches, set_up)


def wrapped_cost(c: ProcessCensus, eager: int, graph: int, copies: int, launches: int) -> CensusCost:
    """The census library preloaded: each launch at its wrapper's price and, under ACTIVITY=events, each event pair
    at its own; copies unpriced (§27)."""
    k = c.kernels
    glaunches = sum(d.graph_launches for d in c.devices.values())
    pe = pg = 0
    if k.events:                  # events_timed: every pair read; the eager ones are the sample and the idle ones
        pe = min(k.events_timed, eager + k.events_idle)
        pg = k.events_timed - pe
    pg_s = PAIR_GRAPH_S if k.events_gate else PAIR_GRAPH_UNGATED_S
    s = launches * WRAPPED_LAUNCH_S + glaunches * WRAPPED_GRAPH_LAUNCH_S + pe * PAIR_EAGER_S + pg * pg_s
    return CensusCost(eager, graph, copies, s, False, 0.0, launches, 0, True, glaunches, pe, pg, pg_s)


def context_made_under_cupti(c: ProcessCensus) -> bool:
    """A context of this process was created while CUPTI was set up (ATTACH=cuinit, or a context made
    after the attach): its graph replays pay CUPTI's per-node cost, paused or not. Never where CUPTI was never
    loaded (:func:`cupti_never_loaded`)."""
    return not cupti_never_loaded(c) and (c.attach.mode == ATTACH_CUINIT or c.attach.contexts_late > 0)


def cupti_never_loaded(c: ProcessCensus) -> bool:
    """The census library preloaded counted at the calls, with no CUPTI window (ACTIVITY=off or events)."""
    return c.kernels.preloaded and not c.kernels.windows


def graph_node_s(c: ProcessCensus) -> float:
    """GPU time one graph kernel node counted per launch costs, by when the census set CUPTI up."""
    return GRAPH_NODE_PER_LAUNCH_S if context_made_under_cupti(c) else GRAPH_NODE_AFTER_CONTEXT_S
