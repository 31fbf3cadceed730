"""CPU tests of bench/server/toggle_pool.py: toggled loads of several runs as one sample of pairs."""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench" / "server"))
sys.path.insert(0, str(REPO / "bench"))
import toggle_pool  # noqa: E402
import headline  # noqa: E402


def _slots(ratios, first="off"):
    """Pairs 0..n-1, each `first` then the other mode; the second mode's rate is the ratio times 1,000."""
    out = []
    for i, r in enumerate(ratios):
        rate = {"off": 1000.0, "events": 1000.0 * r}
        order = ("off", "events") if first == "off" else ("events", "off")
        out += [{"pair": i, "mode": m, "switched": True, "tok_s": rate[m], "tokens": rate[m], "s": 1.0}
                for m in order]
    return out


def _vllm_run(path, ratios, failed=()):
    path.write_text(json.dumps({"date": "2026-12-04", "checks_failed": list(failed),
                                "toggle": {"slots": _slots(ratios), "pairs": len(ratios),
                                           "tick_noise": {"ticks": 9, "cv": 0.1, "lag1": 0.6}}}))
    return path


def _llama_run(path, ratios, ok=True):
    path.write_text(json.dumps({"date": "2026-12-03", "slots": _slots(ratios, first="events"),
                                "checks": [{"what": "every slot switched the census", "ok": ok}]}))
    return path


def test_runs_pool_into_one_sample_of_their_pairs_and_each_keeps_its_own(tmp_path):
    a = _vllm_run(tmp_path / "a.json", [0.9, 1.0, 1.1])
    b = _llama_run(tmp_path / "b.json", [0.95, 0.97])
    got = toggle_pool.pool([a, b])
    assert got["pairs"] == 5 and got["left_out"] == 0                   # no pair made of two runs' slots
    assert sorted(got["events/off"]["all"]) == [0.9, 0.95, 0.97, 1.0, 1.1]
    assert got["events/off"]["median"] == statistics.median([0.9, 1.0, 1.1, 0.95, 0.97])
    assert [r["source"] for r in got["runs"]] == ["a.json", "b.json"]
    assert got["runs"][0]["tick_noise"]["lag1"] == 0.6 and "tick_noise" not in got
    assert all(c["ok"] for c in got["checks"]) and headline.toggle_ratio(min_pairs=5)(got) == 0.97


def test_a_run_whose_check_failed_fails_the_pool_and_the_headline_refuses_it(tmp_path):
    a = _vllm_run(tmp_path / "a.json", [1.0] * 8)
    b = _vllm_run(tmp_path / "b.json", [1.0] * 8, failed=["R: load without errors (3)"])
    got = toggle_pool.pool([a, b])
    assert [c["ok"] for c in got["checks"]] == [True, False] and got["runs"][1]["checks_failed"]
    with pytest.raises(headline.HeadlineError):
        headline.toggle_ratio()(got)


def test_main_writes_the_pool_and_says_why_a_file_is_not_a_toggled_load(tmp_path, capsys):
    a = _vllm_run(tmp_path / "a.json", [0.98, 1.0])
    out = tmp_path / "pooled.json"
    assert toggle_pool.main([str(a), str(a), "--out", str(out), "--command", "two runs"]) == 0
    got = json.loads(out.read_text())
    assert got["pairs"] == 4 and got["date"] == "2026-12-04" and got["command"] == "two runs"
    for bad, why in (("{", "bad.json: Expecting"), ("[1]", "not a JSON object"), ('{"slots": []}', "no toggled slots"),
                     (json.dumps({"slots": _slots([1.0])}), "no checks recorded")):
        (tmp_path / "bad.json").write_text(bad)
        assert toggle_pool.main([str(tmp_path / "bad.json"), "--out", str(tmp_path / "x.json")]) == 2
        assert why in capsys.readouterr().err
    assert toggle_pool.main([str(tmp_path / "missing.json"), "--out", str(out)]) == 2
    assert toggle_pool.main([str(a), "--out", str(out), "--modes", "off"]) == 2
    assert json.loads(out.read_text())["pairs"] == 4                    # a refused run writes nothing


def test_the_headline_reads_a_roles_cpu_a_token_from_the_pool_and_refuses_a_pool_without_it(tmp_path):
    a = _vllm_run(tmp_path / "a.json", [1.0] * 8)
    raw = json.loads(a.read_text())
    for s in raw["toggle"]["slots"]:
        s["cpu_ms_per_ktok"] = {"EngineCore": {"all": 80.0, "main": 70.0 * (1.01 if s["mode"] == "events" else 1.0)}}
    a.write_text(json.dumps(raw))
    got = toggle_pool.pool([a])
    assert headline.toggle_cpu_ratio("EngineCore", "main")(got) == 1.01
    assert headline.toggle_cpu_ratio("EngineCore", "all")(got) == 1.0
    with pytest.raises(headline.HeadlineError, match="no CPU a token of api"):
        headline.toggle_cpu_ratio("api")(got)
