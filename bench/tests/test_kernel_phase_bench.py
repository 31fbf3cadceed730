"""CPU tests of run_server_bench.py --kernel-phase-pairs (bench/server/kernel_phase.py): the phase
arithmetic, the pair order, the plan, the census checks, and the mode end to end against the
llama-server stand-in writing a stand-in census segment in sampled mode (tests/support/standin_census.py).
Run: .venv/bin/python -m pytest -q bench/tests
"""
from __future__ import annotations

import argparse
import json

import pytest

from test_server_bench import fake, free_port_pair, run_bench  # noqa: F401  (fake: a fixture)
import kernel_phase as kp  # noqa: E402  (bench/server is on sys.path through test_server_bench)
import load  # noqa: E402

# origin 1000 ns, traced [1000, 1100), untraced [1100, 1250), traced [1250, 1350), ...
S = kp.Schedule(origin_wall_ns=1000, on_ns=100, period_ns=250)


def test_phases_and_sides_follow_the_schedule():
    assert S.phase("traced", 0) == (1000, 1100) and S.phase("untraced", 0) == (1100, 1250)
    assert S.phase("traced", 2) == (1500, 1600) and S.phase("untraced", 2) == (1600, 1750)
    assert [S.side_at(t) for t in (1000, 1099, 1100, 1249, 1250, 1349, 1350)] == \
        ["traced", "traced", "untraced", "untraced", "traced", "traced", "untraced"]


def test_a_load_starts_after_the_lead_or_waits_for_a_phase_it_fits():
    slot = S.slot("traced", 1000, est_ns=50, lead_ns=10)
    assert (slot.k, slot.start, slot.phase_end) == (0, 1010, 1100)
    assert S.slot("traced", 1030, 50, 10).start == 1030            # ready late in the phase, still fits
    assert S.slot("traced", 1060, 50, 10).start == 1260            # would overrun: next traced phase
    assert S.slot("untraced", 1060, 50, 10).start == 1110          # the untraced phase that follows
    assert S.slot("untraced", 1195, 50, 10).start == 1195          # ends at 1245 < 1250
    assert S.slot("untraced", 1201, 50, 10).start == 1360          # ends past 1250: next period
    assert S.slot("traced", 1000, 500, 10).start == 1010           # never fits: the lead, and overrun


def test_pairs_alternate_abba():
    assert [kp.pair_order(k)[0] for k in range(8)] == ["traced", "untraced", "untraced", "traced"] * 2
    assert all(set(kp.pair_order(k)) == {"traced", "untraced"} for k in range(8))


def test_plan_for_the_device_default():
    # 14 s / 28 s phases, 9 s loads, 0.5 s lead, 1.2 s settle, ready at an untraced phase start (14 s):
    # pairs 0-3 end at 164.7 s (worked by hand: T 28.5, U 42.5, U 70.5, T 84.5, U 98.5, T 112.5,
    # T 140.5, U 154.5 + 9 + 1.2), and pairs 4-7 repeat 140 s (5 periods) later: 304.7 - 14 s.
    assert kp.plan_seconds(14000, 28000, 8, 9.0, 0.5) == pytest.approx(290.7)
    assert kp.plan_seconds(14000, 28000, 4, 9.0, 0.5) == pytest.approx(150.7)


def test_phase_ms_option_takes_what_the_injector_takes():
    assert kp.phase_ms_arg(" 14000/28000 ") == "14000/28000"
    for bad in ("10010/20000", "20000/20000", "0/100", "100", "a/b", "3000/4000000"):
        with pytest.raises(argparse.ArgumentTypeError):
            kp.phase_ms_arg(bad)


def test_census_check_says_what_a_phase_should_not_have_counted():
    assert kp.census_check("traced", {"kernels": 5, "dtoh_bytes": 1}, 16) == "ok"
    assert kp.census_check("untraced", {"kernels": 16, "dtoh_bytes": 1}, 16) == "ok"
    assert "untraced phase" in kp.census_check("untraced", {"kernels": 17, "dtoh_bytes": 1}, 16)
    assert "no kernels" in kp.census_check("traced", {"kernels": 0, "dtoh_bytes": 1}, 16)
    assert "device-to-host" in kp.census_check("untraced", {"kernels": 0, "dtoh_bytes": 0}, 16)
    loads = [{"side": "traced", "overrun": False, "census": {"kernels": 9, "dtoh_bytes": 1, "check": "ok"}},
             {"side": "untraced", "overrun": True, "census": {"kernels": 99, "dtoh_bytes": 1, "check": "x"}}]
    assert kp.checks(loads, 16)["ok"] is True              # an overrun load is not checked
    assert kp.checks(loads[1:], 16)["ok"] is None          # nothing inside a phase: nothing judged
    loads[1]["overrun"] = False
    c = kp.checks(loads, 16)
    assert c["ok"] is False and c["untraced_loads_without_kernels"] == "0/1" and c["untraced_kernels_max"] == 99


KERNELS, DTOH, REQUESTS = 40, 65536, 8


@pytest.mark.parametrize("mode", ["free", "waves"])
def test_kernel_phase_pairs_on_one_server(fake, tmp_path, mode):  # noqa: F811
    """Three pairs on 1 s / 2 s phases (slack for a loaded 2-core machine); requests that start in a traced phase are made slower
    (so the sides differ), and pair 1's traced load (seeds 2500+) is slow enough to overrun (free: each
    client's two slow requests in a row; waves: two waves of slow requests)."""
    server, model = fake
    out = tmp_path / "kp.json"
    d = run_bench(["--server", str(server), "--model", str(model), "--out", str(out),
                   "--kernel-phase-pairs", "3", "--phase-ms", "1000/2000", "--phase-lead-s", "0.15",
                   "--flag-sets", "nocache", "--requests", str(REQUESTS), "--clients", "4", "--prompt-tokens", "16",
                   "--n-predict", "16", "--load-estimate-s", "0.3", "--census-mode", "env",
                   "--server-env", "FAKE_CENSUS=1", "--server-env", "FAKE_TRACED_EXTRA_S=0.05",
                   "--server-env", "FAKE_SLOW=2500-2599:0.8", "--server-env", "FAKE_TOKEN_DELAY=0.005",
                   "--load-mode", mode, "--port", str(free_port_pair())], tmp_path)
    assert d.returncode == 0, d.stdout[-3000:] + d.stderr[-2000:]
    assert "plan: " in d.stdout.splitlines()[0] and "3 pairs" in d.stdout.splitlines()[0]
    res = json.loads(out.read_text())
    (s,) = res["runs"]
    assert s["env"]["OTEL_GPU_CENSUS_KERNELS"] == "1000/2000" and s["stop"]["how"] == "SIGTERM"
    sch = s["schedule"]
    # the schedule came from the segment, through its CUPTI-to-wall clock pair (the stand-in starts
    # it 137 ms after the segment, on a clock 1000 s ahead of the monotonic one)
    assert (sch["on_ms"], sch["period_ms"]) == (1000, 2000)
    assert sch["origin_wall_ns"] - sch["clock_ref_wall_ns"] == 137_000_000
    assert sch["origin_gpu_ns"] != sch["origin_wall_ns"]
    sched = kp.Schedule(sch["origin_wall_ns"], 1_000_000_000, 2_000_000_000)
    loads = s["loads"]
    assert [(x["pair"], x["side"]) for x in loads] == [(0, "traced"), (0, "untraced"), (1, "untraced"),
                                                        (1, "traced"), (2, "untraced"), (2, "traced")]
    for x in loads:   # every load started in a phase of its side, at least the lead after it began
        assert sched.side_at(x["start_wall_ns"]) == x["side"]
        ps, pe = sched.phase(x["side"], x["phase"])
        assert x["start_wall_ns"] - ps >= 150_000_000 and x["start_wall_ns"] < pe
        assert x["overrun"] == (x["end_wall_ns"] > pe)
    slow = next(x for x in loads if x["pair"] == 1 and x["side"] == "traced")
    assert slow["overrun"] and not slow["valid"] and slow["end_before_phase_end_s"] < 0
    inside = [x for x in loads if x is not slow]
    assert all(x["valid"] and x["census_read"]["settled"] for x in inside)
    for x in inside:   # the census saw exactly this load's work: kernels only when traced
        assert x["census"]["kernels"] == (2 * KERNELS * REQUESTS if x["side"] == "traced" else 0)
        assert x["census"]["dtoh_bytes"] == DTOH * REQUESTS and x["census"]["check"] == "ok"
    assert all(len(load.decode_times(r["ev"])) == 16 for x in loads for r in x["per_request"])
    assert res["load_mode"] == mode and all(x["load"]["load_mode"] == mode for x in loads)
    if mode == "waves":   # the whole load, both waves, was placed and judged in its phase
        for x in loads:
            w = x["load"]["waves"]
            assert len(w) == 2 and w[1]["start"] >= w[0]["end"]
            assert x["end_wall_ns"] - x["start_wall_ns"] >= (w[1]["end"] - w[0]["start"]) * 1e9 - 2e6
        assert slow["load"]["waves"][0]["wall_s"] > 0.8 and slow["load"]["waves"][1]["wall_s"] > 0.8

    (row,) = res["rows"]
    assert row["workload"] == "server/llama.cpp kernel tracing, one server" and row["phase_ms"] == "1000/2000"
    assert row["invalid_pairs"] == [{"pair": 1, "why": "traced: overran its phase"}] and row["overruns"] == 1
    assert row["pairs"] == 2 and [p["pair"] for p in row["per_pair"] if p["valid"]] == [0, 2]
    by = {(x["pair"], x["side"]): x["load"]["output_tok_s"] for x in loads}
    ratios = [by[(k, "traced")] / by[(k, "untraced")] for k in (0, 2)]
    assert row["pair_ratios"] == [round(r, 4) for r in ratios]
    assert row["ratio"] == round(sum(ratios) / 2, 4) and 0.3 < row["ratio"] < 0.9   # traced is the slow side
    assert row["census"] < row["plain"] and row["ttft_p50_s"] > row["plain_ttft_p50_s"]
    assert ("wave_tok_s_cv" in row and len(row["plain_wave_tok_s_cvs"]) == 2) == (mode == "waves")
    assert row["census_checks"]["ok"] and row["census_checks"]["traced_loads_with_kernels"] == "2/2"
    assert row["census_checks"]["untraced_loads_without_kernels"] == "3/3"
    assert row["schedule"]["origin_wall_ns"] == sch["origin_wall_ns"]
    assert res["variant_env"] == {"census-sampled": {"OTEL_GPU_CENSUS_KERNELS": "1000/2000", "FAKE_CENSUS": "1",
                                                     "FAKE_TRACED_EXTRA_S": "0.05", "FAKE_SLOW": "2500-2599:0.8",
                                                     "FAKE_TOKEN_DELAY": "0.005"}}


def test_no_census_segment_is_a_clear_error(fake, tmp_path):  # noqa: F811
    """As on a machine without a GPU: the injector never starts, so the mode stops and says why."""
    server, model = fake
    d = run_bench(["--server", str(server), "--model", str(model), "--out", str(tmp_path / "n.json"),
                   "--kernel-phase-pairs", "1", "--phase-ms", "1000/2000", "--phase-lead-s", "0.15",
                   "--flag-sets", "nocache", "--requests", "4", "--clients", "2", "--segment-timeout", "1",
                   "--census-mode", "env", "--port", str(free_port_pair())], tmp_path)
    assert d.returncode == 1 and "Traceback" not in d.stderr
    assert "no census segment" in d.stdout and "no GPU here?" in d.stdout
    (row,) = json.loads((tmp_path / "n.json").read_text())["rows"]
    assert "no census segment" in row["error"]


def test_kernel_phase_options_are_checked(tmp_path):
    d = run_bench(["--server", "x", "--model", "y", "--kernel-phase-pairs", "2", "--phase-ms", "300/1000"], tmp_path)
    assert d.returncode == 2 and "longer than --phase-lead-s" in d.stderr and "Traceback" not in d.stderr
    d = run_bench(["--server", "x", "--model", "y", "--kernel-phase-pairs", "2", "--proxy-pairs", "2"], tmp_path)
    assert d.returncode == 2 and "give one" in d.stderr
    d = run_bench(["--server", "x", "--model", "y", "--kernel-phase-pairs", "2", "--phase-ms", "30/1000"], tmp_path)
    assert d.returncode == 2 and "multiples of 20 ms" in d.stderr
