"""What the census itself cost a process, estimated from what it counted and a price for each unit of work.

The prices are measured, on one machine, so they are not part of the package: they live in
bench/results/census_cost_prices.json (each with the measurement it comes from), and this module reads them only
where that file is there, a source checkout. Without them :func:`estimate` returns None and the report prints no
estimate: another machine's prices are a scale, not a measurement of this one.

What is priced, by how the census counted:
- CUPTI's activity records: each eager kernel record (EAGER_KERNEL_S), each copy or memset (COPY_S), each graph
  kernel node, GPU time (GRAPH_NODE_PER_LAUNCH_S where a context was made with CUPTI set up,
  GRAPH_NODE_AFTER_CONTEXT_S where not, GRAPH_NODE_PER_NODE_S traced node by node), and CUPTI being set up at all
  on every eager launch (SET_UP_EAGER_S); CUPTI's tax on calls that launch nothing is not priced.
- CUPTI's callbacks counting at the calls: CALLS_LAUNCH_S, CALLS_COPY_S, CALLS_GRAPH_NODE_S.
- The preloaded library's wrappers: an eager launch (WRAPPED_LAUNCH_S), a graph launch (WRAPPED_GRAPH_LAUNCH_S), an
  event pair around an eager or a graph launch (PAIR_EAGER_S, PAIR_GRAPH_S, PAIR_GRAPH_UNGATED_S); copies and
  memsets are not priced there (no price for a copy call could be read).

The estimate is seconds over the census's life: of the launching threads' time for launches and copies, and of GPU
time for graph nodes. Where those threads, or the GPU running small graph kernels, are the bottleneck, it is about
the throughput the census costs."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from otel_gpu_census.census import ATTACH_CUINIT, GRAPHS_LAUNCH, MANAGED_DIRECTIONS, ProcessCensus

PRICES_FILE = Path(__file__).resolve().parents[3] / "bench" / "results" / "census_cost_prices.json"
PRICE_NAMES = ("EAGER_KERNEL_S", "SET_UP_EAGER_S", "GRAPH_NODE_PER_LAUNCH_S", "GRAPH_NODE_AFTER_CONTEXT_S",
               "GRAPH_NODE_PER_NODE_S", "COPY_S", "CALLS_LAUNCH_S", "CALLS_COPY_S", "CALLS_GRAPH_NODE_S",
               "WRAPPED_LAUNCH_S", "WRAPPED_GRAPH_LAUNCH_S", "PAIR_EAGER_S", "PAIR_GRAPH_S", "PAIR_GRAPH_UNGATED_S")
EAGER_KERNEL_S = SET_UP_EAGER_S = GRAPH_NODE_PER_LAUNCH_S = GRAPH_NODE_AFTER_CONTEXT_S = GRAPH_NODE_PER_NODE_S = None
COPY_S = CALLS_LAUNCH_S = CALLS_COPY_S = CALLS_GRAPH_NODE_S = WRAPPED_LAUNCH_S = WRAPPED_GRAPH_LAUNCH_S = None
PAIR_EAGER_S = PAIR_GRAPH_S = PAIR_GRAPH_UNGATED_S = None


def load_prices(path: Path = PRICES_FILE) -> bool:
    """Take the prices from `path` (bench/results/census_cost_prices.json) into this module's *_S names; all of them
    or none (None each: no estimate). True when they were read whole."""
    try:
        got = json.loads(Path(path).read_text())["prices_s"]
        prices = {n: float(got[n]) for n in PRICE_NAMES}
    except (OSError, ValueError, KeyError, TypeError):
        prices = dict.fromkeys(PRICE_NAMES)
    globals().update(prices)
    return prices_known()


def prices_known() -> bool:
    return all(globals()[n] is not None for n in PRICE_NAMES)


load_prices()


@dataclass(frozen=True)
class CensusCost:
    eager_kernels: int            # kernel records of eager launches (and, traced per node, graph nodes)
    graph_nodes: int              # kernels counted from graph launches' learned contents
    copies: int                   # copies and memsets, graph ones included
    seconds: float
    per_node: bool                # graphs traced node by node: their nodes are among eager_kernels
    node_s: float = 0.0           # what one graph kernel node was priced at
    launches_counted: int = 0     # eager launches the launch callbacks counted (counted mode)
    launches_set_up: int = 0      # eager launches priced at CUPTI's set-up cost (counted, else records)
    wrapped: bool = False         # counted by the library preloaded: launches at the wrappers' prices, copies unpriced
    graph_launches: int = 0       # ... graph launches counted
    pairs_eager: int = 0          # ... ACTIVITY=events: event pairs around eager launches (the sample, idle ones too)
    pairs_graph: int = 0          # ... and around graph launches
    pair_graph_s: float = 0.0     # what one graph pair was priced at (gated or not)

    def share_of(self, ns: int) -> float:
        return self.seconds * 1e9 / ns if ns > 0 else 0.0


def estimate(c: ProcessCensus) -> Optional[CensusCost]:
    """The census's own cost to this process; None where the prices are not there (:func:`load_prices`)."""
    if not prices_known():
        return None
    eager = graph = copies = launches = 0
    for d in c.devices.values():
        graph += d.graph_kernel_count
        # counted: kernel_count holds launches, and only the duty cycle's eager kernels were records
        eager += d.eager_traced if c.kernels.counted else d.kernel_count - d.graph_kernel_count
        launches += d.eager_launches if c.kernels.counted else 0
        # managed_* rows are the driver's migrations, no call of the process's: not a copy the census paid for
        copies += sum(s.count for (dr, _), s in d.copies.cells.items() if dr not in MANAGED_DIRECTIONS) + d.memset.count
    if c.kernels.preloaded:       # the library's own wrappers, no CUPTI: their prices
        return wrapped_cost(c, eager, graph, copies, launches)
    if c.kernels.untimed:         # counted at the calls (no record: eager is 0): the callbacks' prices
        s = launches * CALLS_LAUNCH_S + copies * CALLS_COPY_S + graph * CALLS_GRAPH_NODE_S
        return CensusCost(eager, graph, copies, s, False, CALLS_GRAPH_NODE_S, launches, 0)
    per_node = c.graphs.mode != GRAPHS_LAUNCH
    # Traced node by node, graph nodes are kernel records like eager ones: priced as eager launches,
    # an upper bound (a node costs CUPTI less than an eager launch: GRAPH_NODE_PER_NODE_S, EAGER_KERNEL_S).
    node_s = graph_node_s(c)
    set_up = launches if c.kernels.counted else eager
    s = eager * EAGER_KERNEL_S + graph * node_s + copies * COPY_S + set_up * SET_UP_EAGER_S
    return CensusCost(eager, graph, copies, s, per_node, node_s, launches, set_up)


def wrapped_cost(c: ProcessCensus, eager: int, graph: int, copies: int, launches: int) -> CensusCost:
    """The census library preloaded: each launch at its wrapper's price and, under ACTIVITY=events, each event pair
    at its own; copies unpriced."""
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
    """A context of this process was created while CUPTI was set up (CUPTI set up in cuInit, or a context made
    after the attach): its graph replays pay CUPTI's per-node cost, paused or not. Never where CUPTI was never
    loaded (:func:`cupti_never_loaded`)."""
    return not cupti_never_loaded(c) and (c.attach.mode == ATTACH_CUINIT or c.attach.contexts_late > 0)


def cupti_never_loaded(c: ProcessCensus) -> bool:
    """The default collector: the census library preloaded counted at the calls, CUPTI never loaded."""
    return c.kernels.preloaded


def graph_node_s(c: ProcessCensus) -> float:
    """GPU time one graph kernel node counted per launch costs, by when the census set CUPTI up."""
    return GRAPH_NODE_PER_LAUNCH_S if context_made_under_cupti(c) else GRAPH_NODE_AFTER_CONTEXT_S
