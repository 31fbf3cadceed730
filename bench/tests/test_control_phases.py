"""CPU tests of bench/server/control_phases.py: modes written to every segment's control file, a switch
waited for until the segment shows it, each phase's census figures, rotation, ratios and their summary.
A thread stands in for the injector's flusher: it reads the control file and publishes the mode in the
segment, as native/src/injector.c (control_poll) does; the "load" counts copies into the segment."""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench" / "server"))
sys.path.insert(0, str(REPO / "tests" / "support"))
import control_phases as cp  # noqa: E402
import cupti_records as cr  # noqa: E402
from segments import map_segment  # noqa: E402

T0 = 1_700_000_000_000_000_000


class StandIn:
    """The flusher's half of the control file: census=off -> paused, graphs=... -> graph_mode,
    kernels=all|off|ON/PERIOD -> kernel_mode (and the schedule)."""

    def __init__(self, path: Path):
        self.mm, self.seg = map_segment(path, b"server")
        self.ctl = path.with_suffix(".control")
        self.ffi, self.lib, _ = cr.native()
        self.stop = threading.Event()
        self.seen = []
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        last = None
        while not self.stop.is_set():
            text = self.ctl.read_text() if self.ctl.exists() else None
            if text and text != last:
                last = text
                self.seen.append(text.strip())
                self.lib.gc_segment_begin_update(self.seg)
                self.seg.paused = int("census=off" in text)
                if "graphs=" in text:
                    self.seg.graph_mode = 1 if "graphs=launch" in text else 0
                k = next((w[8:] for w in text.split() if w.startswith("kernels=")), None)
                if k == "all" or k == "off":
                    self.seg.kernel_mode = 0 if k == "all" else 2
                elif k:
                    on, period = map(int, k.split("/"))
                    self.seg.kernel_mode, self.seg.kernel_on_ms, self.seg.kernel_period_ms = 1, on, period
                self.lib.gc_segment_end_update(self.seg)
            time.sleep(0.01)

    def copy(self, nbytes):
        t = self.lib.gc_tally_create(self.seg)
        self.lib.gc_segment_begin_update(self.seg)
        self.lib.gc_tally_record(t, cr.memcpy("dtoh", nbytes, T0, T0 + 10, dst="pinned"))
        self.lib.gc_tally_publish(t, 0)
        self.lib.gc_segment_end_update(self.seg)
        self.lib.gc_tally_destroy(t)


@pytest.fixture
def standin(tmp_path):
    s = StandIn(tmp_path / "gpu-census-7-8.seg")
    yield s
    s.stop.set()
    s.thread.join(2)


def test_rounds_switch_every_segment_and_count_each_phase(standin, tmp_path):
    tok_s = {"off": 100.0, "events": 99.0}
    order = []

    def load(mode, i):
        order.append(mode)
        standin.copy(1000 + i)            # what this phase's load copied
        return {"tok_s": tok_s[mode] + i, "tokens": 10}
    rounds = cp.run_rounds(cp.Phases(tmp_path), 3, load, modes=("off", "events"), settle_s=0)
    assert order == ["off", "events", "events", "off", "off", "events"]
    assert standin.seen[:2] == ["census=off", "census=on"]
    for i, r in enumerate(rounds):
        for m in ("off", "events"):
            assert r[m]["switched"] and r[m]["t0_ns"] <= r[m]["t1_ns"]
            assert r[m]["census"] == {"copy.dtoh.pinned.count": 1, "copy.dtoh.pinned.bytes": 1000 + i, "records": 1}
        assert r["events/off"] == round((99.0 + i) / (100.0 + i), 4)
    s = cp.summarise(rounds, modes=("off", "events"))
    assert s["all_switched"] and s["events/off"]["min"] == 0.99 and s["events/off"]["median"] == round(100 / 101, 4)
    assert s["per_output_token"]["off"] == {"_tokens": 30, "copy.dtoh.pinned.count": 0.1,
                                            "copy.dtoh.pinned.bytes": (1000 + 1001 + 1002) / 30}


def test_no_round_starts_that_would_end_past_the_deadline(monkeypatch):
    """A call cut short keeps whole rounds: the next round is judged by the longest so far."""
    clock = [1000.0]
    monkeypatch.setattr(cp.time, "time", lambda: clock[0])
    monkeypatch.setattr(cp.time, "time_ns", lambda: int(clock[0] * 1e9))

    class NoCensus:
        def set(self, mode):
            return True

        def totals(self):
            return {}

    def load(mode, i):
        clock[0] += 10.0                   # every phase takes 10 s: a round 20 s
        return {"tok_s": 1.0, "tokens": 1}
    rounds = cp.run_rounds(NoCensus(), 8, load, modes=("off", "events"), settle_s=0, deadline=1000.0 + 65)
    assert len(rounds) == 3                # 60 s done; a fourth would end at 80 s
    assert len(cp.run_rounds(NoCensus(), 2, load, modes=("off", "events"), settle_s=0, deadline=0)) == 1


def test_a_switch_the_census_never_shows_is_reported_not_waited_for_ever(tmp_path):
    _mapped = map_segment(tmp_path / "gpu-census-9-9.seg", b"server")   # nobody reads its control file
    t = time.monotonic()
    assert cp.Phases(tmp_path).set("off", timeout=0.3) is False
    assert time.monotonic() - t < 2
    assert (tmp_path / "gpu-census-9-9.control").read_text() == "census=off\n"


def test_no_segment_to_switch_is_not_a_switch(tmp_path):
    assert cp.Phases(tmp_path).set("events", timeout=0.2) is False
    assert not list(tmp_path.iterdir())


def test_every_phase_and_the_plain_load_beside_get_seeds_of_their_own():
    modes = ["off", "events", "launch"]
    seeds = [cp.phase_seed(300, i, m, modes) for i in range(8) for m in modes + ["P"]]
    assert len(set(seeds)) == len(seeds) == 32 and min(seeds) == 300


def test_totals_give_the_censuss_priced_kernel_time_beside_the_raw_kernel_ns(tmp_path, monkeypatch):
    """Under the default collector a device's raw kernel_ns holds the graph spans and the sample only; the eager
    launches' time is the census's price (ProcessCensus.kernel_time): totals carry both, so a phase's kernel time a
    token is the census's, not the graph part alone (a llama-server run read 0.24 of it from kernel_ns)."""
    from types import SimpleNamespace as NS
    from otel_gpu_census.census import KernelTime, reader
    (tmp_path / "gpu-census-1-2.seg").write_bytes(b"")
    dev = NS(kernel_count=10, kernel_ns=400, busy_ns=0, graph_launches=1, graph_kernel_count=2, eager_launches=8,
             eager_traced=1, eager_traced_ns=50, memset=NS(count=0, bytes=0), copies=NS(cells={}))
    fake = NS(devices={0: dev}, graphs=NS(unknown=0, inexact=0), records=0, buffers=0, dropped=0, buffers_refused=0,
              records_unknown=0, kernels=NS(outside=0), launches_lost=0,
              kernel_time=lambda d: KernelTime(d.kernel_ns - d.eager_traced_ns + d.eager_launches * 50, True))
    monkeypatch.setattr(reader, "read_segment", lambda path, detail=True: fake)
    t = cp.Phases(tmp_path).totals()
    assert t["kernel_ns"] == 400 and t["kernel_time_ns"] == 750
