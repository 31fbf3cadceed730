"""bench/ratio_interval.py: the ratios of phase and pair runs, their geometric mean and a seeded
bootstrap interval that holds it; the recorded runs give the figures docs/measurements.md quotes."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
import ratio_interval as ri  # noqa: E402


def test_ratios_of_phase_runs_nested_or_not_and_of_pair_runs():
    assert ri.ratios({"rounds": [{"launch/off": 0.9}, {"launch/off": 1.1}, {}]}) == [0.9, 1.1]
    assert ri.ratios({"phases": {"rounds": [{"off/P": 0.8}]}}, "off/P", "phases") == [0.8]
    assert ri.ratios({"rows": [{"pair_ratios": [1.0, 0.98]}]}) == [1.0, 0.98]


def test_the_interval_holds_the_geometric_mean_and_is_the_same_every_time():
    xs = [0.95, 1.02, 0.99, 1.08, 0.9]
    lo, hi = ri.interval(xs)
    assert lo < ri.gmean(xs) < hi and (lo, hi) == ri.interval(xs)
    assert ri.interval([1.0, 1.0, 1.0]) == (1.0, 1.0)


def test_the_recorded_llama_phases_give_the_quoted_figures():
    out = subprocess.run([sys.executable, str(REPO / "bench/ratio_interval.py"),
                          str(REPO / "bench/results/llamacpp_default_phases_throughput_ratio/llama-phases.json"),
                          "--key", "events/off"],
                         capture_output=True, text=True, check=True).stdout
    got = json.loads(out)
    assert got["n"] == 11 and got["median"] == 0.9847 and got["gmean"] == 0.9908 and got["gmean_95"] == [0.979, 1.005]


def test_a_file_without_ratios_gets_one_line_and_exit_2(tmp_path):
    f = tmp_path / "x.json"
    f.write_text("{}")
    r = subprocess.run([sys.executable, str(REPO / "bench/ratio_interval.py"), str(f)], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
