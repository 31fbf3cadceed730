"""The causes only the engine's own state tells apart (issue 62), on synthetic serving segments with an engine's
request log beside them: its requests and its state per second (``engine_state`` lines, as
attribution/engine_state.py writes them). Each cause is named, and only that one; without state lines (an engine
whose scheduler fields differ) or with lines that are not ours, the census's own diagnoses stand."""
from __future__ import annotations

import json

import pytest

from otel_gpu_census.attribution.engine_state import StateBuckets
from otel_gpu_census.census import reader
from otel_gpu_census.report import explain
from otel_gpu_census.report.diagnose import Facts, diagnose
from otel_gpu_census.report.request_log import parse
from serving_census import MS, S, clocks, serve

# many requests in flight, the GPU about half busy: what the census alone calls server-bound
LOADED = dict(clients=16, requests=32, step_ns=40 * MS, kernel_ns=20 * MS, stagger_ns=20 * MS)


def run(records, census_dir, segments, engine="vllm", states=None, bad=(), **shape):
    """The census of an engine's serving run, its request log beside the segment holding the requests and
    the state lines `states(lo, hi)` makes over the serving period, and the report's facts."""
    sv = serve(records, **(shape or LOADED))
    path = segments.segment(census_dir, sv.records, comm="VLLM::EngineCore", edit=clocks())
    lines = [{"id": f"r{i}", "start_time_unix_nano": s, "end_time_unix_nano": e, "first_token_time_unix_nano": f,
              "status": "complete", "steps": 10, "gpu": {"kernel.count": 10, "kernel.time_ns": 1000}}
             for i, (s, e, f) in enumerate(sv.log)]
    lo, hi = min(s for s, _, _ in sv.log), max(e for _, e, _ in sv.log)
    for b in (states(lo, hi) if states else []):
        lines.append({"engine_state": b, "engine": engine})
    lines.extend(bad)
    with open(str(path)[:-4] + ".requests.jsonl", "w") as f:
        f.write("\n".join(json.dumps(x) for x in lines) + "\n")
    return [reader.read_segment(path)], Facts(records=parse(sv.log_lines()))


def steady(running, waiting, cap, kv_used=100, kv_free=900, preempt_every=0, recompute=0.0, kernel_share=0.5):
    """State lines of an engine that held this state all through serving: one 10 ms step after another, every
    `preempt_every`-th one preempting a sequence, `recompute` of its kernel time recomputing one."""
    def make(lo, hi):
        sb = StateBuckets()
        t, i = lo, 0
        while t < hi:
            i += 1
            pre = 1 if preempt_every and i % preempt_every == 0 else 0
            k = int(10 * MS * kernel_share)
            sb.add(t, t + 10 * MS, (running, waiting, cap, kv_used, kv_free, pre, 40 * pre), k, int(k * recompute))
            t += 10 * MS
        return sb.drain(final=True)
    return make


def kinds(found):
    return [d.kind for d in found]


def one(found, kind):
    hits = [d for d in found if d.kind == kind]
    assert len(hits) == 1, [d.text for d in found]
    return hits[0]


CONCURRENCY = {"client_bound", "server_bound", "cap_bound", "front_end_bound"}


def only(found, kind):
    """`kind` is the one concurrency cause named."""
    assert [k for k in kinds(found) if k in CONCURRENCY] == [kind], [d.text for d in found]
    return one(found, kind)


@pytest.mark.parametrize("engine,flag", [("vllm", "`--max-num-seqs`"), ("sglang", "`--max-running-requests`")])
def test_running_at_the_cap_while_requests_wait_is_the_cap(census_dir, segments, records, engine, flag):
    # 8 running of a cap of 8 with 8 waiting; 100 of 1000 KV blocks in use: room for ~80 at this length
    cs, facts = run(records, census_dir, segments, engine, steady(8, 8, 8, kv_used=100, kv_free=900))
    d = only(diagnose(cs, facts), "cap_bound")
    assert f"running sat at {flag} 8 for 100.0% of serving while 8.0 requests waited on average" in d.text
    assert "the KV cache had room for ~80 at this context length: raise" in d.text
    assert d.figures["kv_room_requests"] == 80 and d.figures["at_cap_share"] == pytest.approx(1.0, abs=0.01)
    assert "preemption" not in kinds(diagnose(cs, facts))


def test_at_the_cap_with_the_kv_cache_full_says_raising_it_needs_memory(census_dir, segments, records):
    cs, facts = run(records, census_dir, segments, "vllm", steady(8, 8, 8, kv_used=990, kv_free=10))
    d = only(diagnose(cs, facts), "cap_bound")
    assert "nearly full at the cap" in d.text and "`--gpu-memory-utilization`" in d.text


def test_requests_in_flight_but_not_in_the_engine_is_the_front_end(census_dir, segments, records):
    # 16 clients keep ~16 requests in flight; the engine holds 2 of them, far under its cap
    cs, facts = run(records, census_dir, segments, "vllm", steady(2, 0, 256))
    d = only(diagnose(cs, facts), "front_end_bound")
    assert d.text.startswith("the front end (tokenising, the API server) is the bottleneck, not the GPU")
    assert "`--api-server-count`" in d.text
    # Little's law: (in flight - in the engine) x serving time / requests
    f = d.figures
    assert f["front_end_ns_per_request"] == pytest.approx(
        (f["mean_in_flight"] - 2) * f["serving_ns"] / f["requests"], rel=0.01)
    assert f["mean_in_engine"] == pytest.approx(2, abs=0.1)


def test_requests_in_the_engine_under_its_cap_is_neither_the_cap_nor_the_front_end(census_dir, segments, records):
    """All in the engine, running under the cap, none waiting: the engine's CPU side or the model, not these."""
    cs, facts = run(records, census_dir, segments, "vllm", steady(14, 0, 256))
    found = diagnose(cs, facts)
    assert "cap_bound" not in kinds(found) and "front_end_bound" not in kinds(found)
    only(found, "server_bound")


def test_one_client_at_a_time_stays_client_bound_with_the_state(census_dir, segments, records):
    cs, facts = run(records, census_dir, segments, "vllm", steady(1, 0, 256),
                    clients=1, requests=8, kernel_ns=5 * MS, gap_ns=60 * MS)
    only(diagnose(cs, facts), "client_bound")


@pytest.mark.parametrize("lines", ["none", "not ours"])
def test_without_state_lines_the_census_rules_stand(census_dir, segments, records, lines):
    bad = [{"engine_state": {"t": "x"}}, {"engine_state": {"t": 1, "steps": -1}}] if lines == "not ours" else []
    cs, facts = run(records, census_dir, segments, "vllm", None, bad=bad)
    found = diagnose(cs, facts)
    only(found, "server_bound")
    assert "preemption" not in kinds(found)


def test_preemptions_priced_on_a_busy_gpu_are_the_one_diagnosis(census_dir, segments, records):
    # a busy GPU (no concurrency cause), a preemption every 20 steps, 30 % of those steps' kernels recomputing
    cs, facts = run(records, census_dir, segments, "vllm",
                    steady(16, 4, 256, kv_used=999, kv_free=1, preempt_every=1, recompute=0.1, kernel_share=0.9),
                    clients=16, requests=32, step_ns=40 * MS, kernel_ns=38 * MS, stagger_ns=20 * MS)
    found = diagnose(cs, facts)
    d = one(found, "preemption")
    assert [k for k in kinds(found) if k in CONCURRENCY] == []
    f = d.figures
    assert f["recompute_share"] == pytest.approx(0.1, abs=0.001)
    assert f["recomputed_tokens"] == 40 * f["preempted"]
    assert f"{f['preempted']:,} sequences preempted, their recomputation" in d.text
    assert "(10.0% of the GPU's work while serving)" in d.text
    assert "999 of 1000 blocks" in d.text and "lower `--max-num-seqs` (256)" in d.text
    js = explain.to_dict(cs, facts, __import__("otel_gpu_census.report.serving", fromlist=["split"]).split(
        cs, facts.records))
    assert any(x["kind"] == "preemption" and x["figures"]["preempted"] == f["preempted"] for x in js["diagnoses"])


def test_a_rare_cheap_preemption_is_not_worth_naming(census_dir, segments, records):
    cs, facts = run(records, census_dir, segments, "vllm", steady(16, 0, 256, preempt_every=500, recompute=0.001))
    assert "preemption" not in kinds(diagnose(cs, facts))


def test_report_and_report_json_name_the_cap_from_the_engines_log_alone(census_dir, segments, records):
    """`report DIR` as a user runs it after a vLLM run: the engine's request log beside the segment is all it has."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    run(records, census_dir, segments, "vllm", steady(8, 8, 8))
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")]))
    out = {}
    for fmt in ((), ("--json",)):
        p = subprocess.run([sys.executable, "-m", "otel_gpu_census.cli", "report", str(census_dir), *fmt], env=env,
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
        out[fmt] = p.stdout
    diag = out[()].split("\ndiagnoses:\n")[1]
    assert "  * vLLM's cap on running requests is the bottleneck, not the GPU: running sat at `--max-num-seqs` 8" in diag
    assert "server is the bottleneck" not in diag
    js = json.loads(out[("--json",)])
    found = [d for d in js["diagnoses"] if d["kind"] == "cap_bound"]
    assert len(found) == 1 and found[0]["figures"]["cap"] == 8 and found[0]["figures"]["kv_room_requests"] == 80
