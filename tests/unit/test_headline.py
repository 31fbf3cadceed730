"""bench/results/headline.json: its schema, and bench/headline.py (--check, --write, --set) against the
raw results files it is derived from."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "headline.py"
HEADLINE = REPO / "bench" / "results" / "headline.json"
sys.path.insert(0, str(REPO / "bench"))
import headline  # noqa: E402


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


@pytest.fixture
def copy(tmp_path):
    dst = tmp_path / "headline.json"
    shutil.copy(HEADLINE, dst)
    return dst


def entries(path: Path):
    return json.loads(path.read_text())


def test_committed_file_has_every_required_name_with_exactly_the_eight_keys():
    data = entries(HEADLINE)
    assert isinstance(data, list)
    names = [e["name"] for e in data]
    assert set(headline.REQUIRED) <= set(names) and len(names) == len(set(names))
    for e in data:
        assert list(e) == list(headline.KEYS), e["name"]
        assert isinstance(e["value"], (int, float)) and not isinstance(e["value"], bool)
        assert e["target"] is None or isinstance(e["target"], (int, float))
        assert all(isinstance(e[k], str) and e[k] for k in ("name", "unit", "date", "device", "command"))
        assert e["source"].startswith("bench/results/") and (REPO / e["source"]).is_file()
    assert headline.problems(data) == []


def test_targets_are_the_issues():
    by = {e["name"]: e for e in entries(HEADLINE)}
    for n in ("llamacpp_default_throughput_ratio", "vllm_default_throughput_ratio",
              "llamacpp_proxy_throughput_ratio"):
        assert by[n]["target"] == 0.99
    assert by["sidecar_cpu_pct_of_one_core"]["target"] == 1.0
    assert by["micro_eager_us_per_launch_default"]["target"] is None


def test_check_passes_on_the_committed_file():
    r = run("--check")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "matches the raw results" in r.stdout


def test_check_fails_when_a_value_differs_from_the_raw_files(copy):
    data = entries(copy)
    data[0]["value"] = round(data[0]["value"] + 0.05, 3)
    copy.write_text(json.dumps(data))
    r = run("--check", "--file", str(copy))
    assert r.returncode == 1
    assert data[0]["name"] in r.stdout and "value" in r.stdout


def test_check_fails_on_a_missing_name_and_on_an_extra_key(copy):
    data = entries(copy)
    copy.write_text(json.dumps(data[1:]))
    r = run("--check", "--file", str(copy))
    assert r.returncode == 1 and data[0]["name"] in r.stdout
    data[1]["reason"] = "x"
    copy.write_text(json.dumps(data))
    r = run("--check", "--file", str(copy))
    assert r.returncode == 1 and "keys must be exactly" in r.stdout


def test_write_restores_what_check_wants(copy):
    data = entries(copy)
    data[3]["value"] = 0.5
    copy.write_text(json.dumps(list(reversed(data))))
    assert run("--check", "--file", str(copy)).returncode == 1
    assert run("--write", "--file", str(copy)).returncode == 0
    assert entries(copy) == entries(HEADLINE)


def test_schema_problems_are_named():
    good = entries(HEADLINE)
    assert headline.problems({"name": "x"}) == ["not a JSON list"]
    bad = json.loads(json.dumps(good))
    bad[0]["value"] = True
    bad[1]["date"] = "1 Dec 2026"
    bad[2]["source"] = "bench/results/no-such-file.json"
    bad[3]["target"] = "1 %"
    bad.append(dict(good[0]))
    found = " | ".join(headline.problems(bad))
    for part in ("value must be a finite number", "date must be YYYY-MM-DD", "no-such-file.json",
                 "target must be a finite number or null", "name appears twice"):
        assert part in found


def test_rules_agree_with_the_benchmarks_own_summaries():
    res = headline.RESULTS
    px = json.loads((res / "llamacpp_proxy_throughput_ratio/proxy-pairs.json").read_text())
    assert abs(headline.proxy_pair_ratio(px) - px["rows"][0]["ratio"]) < 5e-4
    sc = json.loads((res / "sidecar_cpu_pct_of_one_core/sidecar-cpu.json").read_text())
    assert abs(headline.sidecar_pct(sc) - sc["cpu_pct_of_one_core"]) < 1e-3
    fl = json.loads((res / "llamacpp_prompt_cache_d2h_bytes_per_request/server-flags.json").read_text())
    assert headline.d2h_bytes_per_request("default")(fl) == 215_989_920
    assert headline.d2h_bytes_per_request("nocache")(fl) == 32_849_568
    bg = json.loads((res / "busy_gap_matmul_sm_occupancy/busy-gap.json").read_text())
    assert headline.busy_gap("matmul", "hw.gpu.utilization")(bg) == 0.99
    assert headline.busy_gap("tiny", "gpu_census.sm.occupancy")(bg) == 0.0


def test_phase_and_kind_cost_rules_agree_with_the_raw_files():
    """The phase ratios are the benchmarks' own medians; kind_cost's is its paired delta, in µs; a run
    in which a phase did not switch gives no value."""
    res = headline.RESULTS
    lp = json.loads((res / "llamacpp_default_phases_throughput_ratio/llama-phases.json").read_text())
    r = sorted(x["events/off"] for x in lp["rounds"])
    assert len(r) == 11 and headline.phases_ratio("events")(lp) == round(r[5], 3) == 0.985
    vp = json.loads((res / "vllm_default_phases_throughput_ratio/vllm-phases.json").read_text())
    assert headline.phases_ratio("events", "phases")(vp) == round(vp["phases"]["events/off"]["median"], 3)
    kc = json.loads((res / "micro_eager_us_per_launch_precise/kind-cost.json").read_text())
    row = next(x for x in kc["results"] if (x["config"], x["workload"], x["metric"]) == ("graph+kernel", "eager", "issue"))
    assert headline.kind_cost_us("graph+kernel")(kc) == round(row["delta_vs_none"]["median"] / 1000, 3)
    assert headline.kind_cost_us("kernel")(kc) > headline.kind_cost_us("copies")(kc) + 0.5   # records are per kernel
    with pytest.raises(headline.HeadlineError):
        headline.phases_ratio("events")({**lp, "all_switched": False})


def test_set_records_a_new_measurement_that_check_and_write_keep(copy):
    src = "bench/results/llamacpp_prompt_cache_d2h_bytes_per_request/server-flags.json"
    r = run("--set", "vllm_default_throughput_ratio=0.991", "--source", str(REPO / src),
            "--date", "2026-12-02", "--command", "bench/device/run.sh vllm", "--file", str(copy))
    assert r.returncode == 0, r.stderr
    e = next(x for x in entries(copy) if x["name"] == "vllm_default_throughput_ratio")
    assert (e["value"], e["source"], e["date"], e["target"]) == (0.991, src, "2026-12-02", 0.99)
    assert e["device"].startswith("1 × NVIDIA H200")       # from the source's environment
    assert run("--check", "--file", str(copy)).returncode == 0
    assert run("--write", "--file", str(copy)).returncode == 0
    assert next(x for x in entries(copy) if x["name"] == "vllm_default_throughput_ratio")["value"] == 0.991
    # the rest is still derived from the raw files
    assert [x for x in entries(copy) if x["name"] != "vllm_default_throughput_ratio"] == \
        [x for x in entries(HEADLINE) if x["name"] != "vllm_default_throughput_ratio"]


def test_set_of_a_new_name_needs_a_unit_and_is_appended(copy):
    src = str(REPO / "bench/results/sidecar_cpu_pct_of_one_core/sidecar-cpu.json")   # no date, command, device
    r = run("--set", "sidecar_cpu_pct_e2=1.207", "--source", src, "--file", str(copy))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--date" in r.stderr
    r = run("--set", "sidecar_cpu_pct_e2=1.207", "--source", src, "--date", "2026-11-29", "--command", "c",
            "--device", "H200", "--file", str(copy))
    assert r.returncode == 2 and "--unit" in r.stderr
    r = run("--set", "sidecar_cpu_pct_e2=1.207", "--source", src, "--date", "2026-11-29", "--command", "c",
            "--device", "H200", "--unit", "% of one core", "--target", "1", "--file", str(copy))
    assert r.returncode == 0, r.stderr
    assert entries(copy)[-1]["name"] == "sidecar_cpu_pct_e2" and entries(copy)[-1]["target"] == 1.0
    assert run("--check", "--file", str(copy)).returncode == 0


@pytest.mark.parametrize("args, says", [
    (["--set", "vllm_default_throughput_ratio=fast"], "finite number"),
    (["--set", "vllm_default_throughput_ratio=nan"], "finite number"),
    (["--set", "no value"], "NAME=VALUE"),
    (["--set", "x=1", "--source", "/etc/hostname"], "under bench/results/"),
    (["--set", "llamacpp_default_throughput_ratio=0.99", "--source",   # the rule's own raw file
      str(REPO / "bench/results" / next(r.source for r in headline.RULES
                                         if r.name == "llamacpp_default_throughput_ratio"))], "run --write"),
    (["--set", "x=1", "--source", str(REPO / "bench/results/micro_graph_replay_ratio_cupti_set_up/micro.json"), "--date", "Dec 2"],
     "YYYY-MM-DD"),
])
def test_bad_set_input_gets_one_error_line_and_leaves_the_file(copy, args, says):
    before = copy.read_text()
    r = run(*args, "--file", str(copy))
    assert r.returncode == 2 and says in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert "Traceback" not in r.stderr and copy.read_text() == before


def test_unreadable_file_gets_one_error_line(tmp_path):
    f = tmp_path / "headline.json"
    f.write_text("{not json")
    r = run("--check", "--file", str(f))
    assert r.returncode == 2 and "not readable JSON" in r.stderr and "Traceback" not in r.stderr


def test_every_figure_has_one_section_in_measurements_and_every_section_is_a_figure():
    """docs/measurements.md is read by figure: one "### `name`: value" section for each entry, none for others."""
    import re
    text = (REPO / "docs" / "measurements.md").read_text()
    sections = re.findall(r"^### `([a-z0-9_]+)`", text, flags=re.M)
    names = [e["name"] for e in entries(HEADLINE)]
    assert sorted(sections) == sorted(names) and len(sections) == len(set(sections))
