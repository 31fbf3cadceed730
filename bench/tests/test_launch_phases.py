"""bench/perf/launch_phases.py without a GPU: the ABBA order, the per-pair differences and their interval, what
the census must have counted given its counting rounds, and its refusal to run without the injector."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("launch_phases", REPO / "bench/perf/launch_phases.py")
launch_phases = importlib.util.module_from_spec(spec)
spec.loader.exec_module(launch_phases)


def row(off, events):
    fig = lambda e: {"eager_ns": e, "graph_issue_ns": 2000.0, "graph_ns": 30000.0, "copy_pair_ns": 9000.0,
                     "control_ms": 3.0}
    return {"off": fig(off), "events": fig(events)}


def test_modes_alternate_abba_so_each_goes_first_as_often():
    order = launch_phases.abba(4)
    assert order == [("off", "events"), ("events", "off"), ("off", "events"), ("events", "off")]


def test_the_price_is_events_minus_off_per_pair_with_an_interval_of_its_mean():
    rows = [row(4000.0, 4030.0), row(4400.0, 4420.0), row(3900.0, 3950.0), {"off": row(1, 1)["off"]}]
    assert launch_phases.paired(rows, "eager_ns") == [30.0, 20.0, 50.0]     # a round without events: left out
    s = launch_phases.summarise(rows)
    e = s["events-off eager_ns"]
    assert e["median"] == 30.0 and e["mean"] == round(100 / 3, 2) and 20.0 <= e["mean_95"][0] <= e["mean_95"][1] <= 50.0
    assert e["off_median"] == 4000.0 and e["ratio"] == round(4030 / 4000, 4)   # the pairs' own off rounds
    assert s["events-off graph_issue_ns"]["median"] == 0.0 and s["rounds"] == 4


def test_what_the_census_must_have_counted_is_the_warmup_and_the_counting_rounds_share():
    did = {"eager_launches": 12 * 100, "graph_launches": 12 * 10, "htod_pinned": [12 * 5, 12 * 5 * 4096]}
    # 10 rounds after 2 warm-up rounds, 5 of them counting: 7 of the 12 runs counted
    assert launch_phases.expected(did, 5, 10) == {"eager_launches": 700, "graph_launches": 70,
                                                  "htod_pinned": [35, 35 * 4096]}


def test_without_the_injector_it_says_so():
    p = subprocess.run([sys.executable, str(REPO / "bench/perf/launch_phases.py"), "--out", "/dev/null"],
                       capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert p.returncode == 1 and "OTEL_GPU_CENSUS_LIB" in p.stderr


def test_exact_means_every_launch_graph_kernel_and_pinned_copy_each_way():
    did = {"eager_launches": 700, "graph_launches": 70, "graph_kernels": 70 * 64, "htod_pinned": [35, 35 * 4096],
           "dtoh_pinned": [35, 35 * 4096]}
    census = {"eager_launches": 700, "graph_launches": 70, "graph_kernel_count": 70 * 64,
              "kernel_count": 700 + 70 * 64, "htod_pinned": [35, 35 * 4096], "dtoh_pinned": [35, 35 * 4096]}
    assert launch_phases.census_did(did, census)
    for key, wrong in (("eager_launches", 699), ("kernel_count", 700), ("dtoh_pinned", [35, 35 * 4095])):
        assert not launch_phases.census_did(did, {**census, key: wrong}), key
