"""CPU test of bench/device/attribution_error.py against two stand-in engines (tests/support/
vllm_steps_standin.py), one per method, whose steps cost exactly their requests' FLOPs: then the FLOPs
split gives each mixed request its alone cost (error ~0, up to integer rounding) and the token split
does not; the result says so per class, and a request whose log line is missing is a failed check."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench" / "device"))
sys.path.insert(0, str(REPO / "tests" / "support"))
import attribution_error  # noqa: E402
import vllm_e2e  # noqa: E402
from vllm_steps_standin import StepsStandin  # noqa: E402


@pytest.fixture
def standins(tmp_path, monkeypatch):
    monkeypatch.setattr(attribution_error, "CLASSES", {"short-short": (8, 3), "short-long": (8, 24),
                                                        "long-short": (1200, 3), "long-long": (1200, 24)})
    monkeypatch.setattr(vllm_e2e, "FAILS", [])
    with StepsStandin(tmp_path / "tokens", "tokens") as t, StepsStandin(tmp_path / "flops", "flops") as f:
        yield {"tokens": t, "flops": f}


def test_the_flops_split_of_flops_priced_steps_matches_the_alone_costs_and_the_token_split_does_not(standins, tmp_path):
    servers = ";".join(f"{m}={s.url},{s.census_dir}" for m, s in standins.items())
    out = tmp_path / "res.json"
    rc = attribution_error.main(["--out", str(out), "--methods", "tokens,flops", "--per-class", "3", "--mixed", "4,12", "--servers", servers])
    res = json.loads(out.read_text())
    assert rc == 0 and res["checks_failed"] == []
    for level in ("mixed@4", "mixed@12"):
        got = res["errors"][level]
        assert got["tokens"]["requests"] == got["flops"]["requests"] == 12
        assert got["flops"]["all"]["mae"] < 0.005
        assert got["tokens"]["all"]["mae"] > 0.05 and res["closer"][level] == "flops"
        # the token split charges short contexts for long contexts' attention
        assert got["tokens"]["by_class"]["short-long"]["bias"] > 0 > got["tokens"]["by_class"]["long-long"]["bias"]
    # one request's alone cost on either server: the same truth, so no noise here
    assert set(res["alone_agreement"]) == {"flops"}
    floor = res["alone_agreement"]["flops"]
    assert set(floor) == set(attribution_error.CLASSES) and max(floor.values()) < 1e-6
    assert {r["method"] for r in res["servers"]["flops"]["mixed@4"]["rows"]} == {"step_flops"}
    assert {r["method"] for r in res["servers"]["tokens"]["mixed@4"]["rows"]} == {"step_tokens"}


def test_the_error_of_a_mixed_share_is_against_the_alone_costs_scaled_to_the_same_total():
    alone = [{"cls": "a", "kernel_ns": 100, "status": "complete"}, {"cls": "b", "kernel_ns": 300, "status": "complete"},
             {"cls": "b", "kernel_ns": 300, "status": "complete"}]
    mixed = [{"cls": "a", "kernel_ns": 60, "status": "complete"}, {"cls": "b", "kernel_ns": 90, "status": "complete"},
             {"cls": "b", "kernel_ns": 50, "status": "partial"}]
    got = attribution_error.errors(alone, mixed)
    # scale = 150 / 400; a: 60 / 0.375 / 100 - 1 = 0.6; b: 90 / 0.375 / 300 - 1 = -0.2
    assert got["requests"] == 2 and got["left_out"] == 1 and got["scale"] == 0.375
    assert got["by_class"]["a"] == {"n": 1, "mae": 0.6, "bias": 0.6, "ratio_median": 0.6}
    assert got["all"]["mae"] == 0.4 and got["all"]["bias"] == 0.2


def test_a_request_the_engine_never_logged_fails_its_check(standins, tmp_path, monkeypatch):
    monkeypatch.setattr(attribution_error, "wait_logged", lambda d, ids, timeout_s=0: {})
    servers = ";".join(f"{m}={s.url},{s.census_dir}" for m, s in standins.items())
    out = tmp_path / "res.json"
    assert attribution_error.main(["--out", str(out), "--methods", "tokens,flops", "--per-class", "1", "--mixed", "4", "--servers", servers]) == 1
    assert "tokens alone: every request answered and logged" in json.loads(out.read_text())["checks_failed"]


def test_where_a_step_costs_something_whatever_it_serves_the_alone_split_is_closest(tmp_path, monkeypatch):
    """Stand-ins whose steps cost a fixed part (a launch-bound model) plus their requests' FLOPs: a request
    run alone pays the fixed part every step, so the split by each part's cost alone (FLOPs plus the fixed
    part the ledger fits on the run's steps) comes closest to the alone costs, and by tokens or FLOPs not."""
    monkeypatch.setattr(attribution_error, "CLASSES", {"short-short": (8, 3), "short-long": (8, 24),
                                                        "long-short": (1200, 3), "long-long": (1200, 24)})
    monkeypatch.setattr(vllm_e2e, "FAILS", [])
    fixed = 200_000                         # about 600 tokens' worth of the stand-in's linear layers
    with StepsStandin(tmp_path / "t", "tokens", step_fixed_ns=fixed) as t, \
            StepsStandin(tmp_path / "f", "flops", step_fixed_ns=fixed) as f, \
            StepsStandin(tmp_path / "a", "alone", step_fixed_ns=fixed) as al:
        servers = ";".join(f"{m}={s.url},{s.census_dir}" for m, s in (("tokens", t), ("flops", f), ("alone", al)))
        out = tmp_path / "res.json"
        rc = attribution_error.main(["--out", str(out), "--methods", "tokens,flops,alone", "--per-class", "3",
                                     "--mixed", "12", "--servers", servers])
        fit = al.engine.ledger.fit
    res = json.loads(out.read_text())
    assert rc == 0 and res["checks_failed"] == []
    got = res["errors"]["mixed@12"]
    assert res["closer"]["mixed@12"] == "alone"
    assert got["alone"]["all"]["mae"] < 0.75 * min(got["tokens"]["all"]["mae"], got["flops"]["all"]["mae"])
    assert {r["method"] for r in res["servers"]["alone"]["mixed@12"]["rows"]} == {"step_alone"}
    # the fit found the fixed part: intercept / slope in FLOPs' worth, the stand-in's ns being FLOPs / 1000
    assert abs(fit.fixed_flops() - fixed * 1000) < 0.01 * fixed * 1000


def test_long_prompt_sets_the_long_classes_prompts(standins, tmp_path):
    """--long-prompt: the long classes ask for that many prompt tokens; the short ones keep theirs."""
    servers = ";".join(f"{m}={s.url},{s.census_dir}" for m, s in standins.items())
    out = tmp_path / "res.json"
    rc = attribution_error.main(["--out", str(out), "--methods", "tokens,flops", "--per-class", "1", "--mixed", "2",
                                 "--long-prompt", "640", "--servers", servers])
    res = json.loads(out.read_text())
    assert rc == 0 and res["checks_failed"] == []
    assert res["classes"] == {"short-short": [8, 3], "short-long": [8, 24], "long-short": [640, 3],
                              "long-long": [640, 24]}
