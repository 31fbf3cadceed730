#!/usr/bin/env python3
"""The headline figures, machine-readable: bench/results/headline.json, recomputed from the raw results.

    python bench/headline.py --check     exit 1 when headline.json differs from what the raw files give
    python bench/headline.py --write     rewrite headline.json from the raw files
    python bench/headline.py --set NAME=VALUE --source bench/results/FILE [--date YYYY-MM-DD]
                             [--command CMD] [--device DEV] [--unit UNIT] [--target T|null]
                                         record a new measurement of NAME (or a new name)

headline.json is a list of objects with exactly the keys name, value, target, unit, date, device,
command, source (the raw results file the value comes from, under bench/results/<headline name>/; a file
that serves several figures lives in the folder of the first). Each value is the one measured, whether or
not it meets its target. docs/measurements.md has a section for each.

Most entries have a rule here that derives the value from its raw file. An entry whose source is
not its rule's source (a measurement recorded with --set) is kept as it is by --write and --check;
--check still checks its schema and that its source exists. So a rule moved to a newer raw file does
not replace its entry by itself: take the entry out of headline.json, then --write. --set takes --date, --command and
--device from the source's own `date`, `command` and `environment.nvidia_smi` when they are there.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
HEADLINE = RESULTS / "headline.json"
KEYS = ("name", "value", "target", "unit", "date", "device", "command", "source")
REQUIRED = ("llamacpp_default_throughput_ratio", "vllm_default_throughput_ratio",
            "llamacpp_proxy_throughput_ratio", "sidecar_cpu_pct_of_one_core",
            "micro_eager_us_per_launch_default", "micro_graph_us_per_node_default")
DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
# The machine of docs/measurements.md, for raw files that do not record their own.
H200 = "1 × NVIDIA H200 (driver 580.159.04, CUDA 13.0)"


class HeadlineError(Exception):
    """Bad input: reported as one line, exit status 2."""


def load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise HeadlineError(f"{rel(path)}: no such file")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HeadlineError(f"{rel(path)}: not readable JSON ({e})")


def rel(path: Path) -> str:
    try:
        return path.resolve().relative_to(REPO).as_posix()
    except ValueError:
        return str(path)


def _row(raw: Dict[str, Any], **match: str) -> Dict[str, Any]:
    rows = [r for r in raw.get("rows", []) if all(r.get(k) == v for k, v in match.items())]
    if len(rows) != 1:
        raise HeadlineError(f"expected one row with {match}, found {len(rows)}")
    return rows[0]


# ---- the rules: one raw file -> one value ------------------------------------------------------

def proxy_pair_ratio(raw: Dict[str, Any]) -> float:
    """Through-the-proxy / direct output tok/s of each pair of loads on one server, median."""
    by_pair: Dict[int, Dict[str, float]] = {}
    for run in raw["runs"]:
        for load in run["loads"]:
            if load.get("load", {}).get("errors") == 0:
                by_pair.setdefault(load["pair"], {})[load["via"]] = load["load"]["output_tok_s"]
    ratios = [p["proxy"] / p["direct"] for p in by_pair.values() if "proxy" in p and "direct" in p]
    return round(statistics.median(ratios), 3)


def sidecar_pct(raw: Dict[str, Any]) -> float:
    return round(100.0 * raw["cpu_s"] / raw["wall_s"], 3)


def phases_ratio(mode: str, key: Optional[str] = None) -> Callable[[Dict[str, Any]], float]:
    """The median over rounds of mode/off output tok/s, on one server whose census modes alternate in
    phases through the control file (bench/server/control_phases.py)."""
    def value(raw: Dict[str, Any]) -> float:
        res = raw[key] if key else raw
        if not res.get("all_switched"):
            raise HeadlineError("a phase did not switch the census")
        return round(res[f"{mode}/off"]["median"], 3)
    return value


def micro_ratio(workload: str, variant: str) -> Callable[[Dict[str, Any]], float]:
    """The variant's throughput / plain's in bench/micro.py, the median over same-round pairs (its row's ratio)."""
    def value(raw: Dict[str, Any]) -> float:
        return round(_row(raw, workload=f"micro/{workload}", variant=variant)["ratio"], 3)
    return value


def beside_ratio(key: str, under: Optional[str] = "phases") -> Callable[[Dict[str, Any]], float]:
    """The median over rounds of a ratio between a phase of R and a server loaded beside it, from the
    phases' summary (under `under`, or the file's top level): e.g. launch/P (bench/device/vllm_e2e.py
    --phase-beside: R's default census against plain vLLM) or launch/plain (bench/server/llama_phases.py
    --beside-plain)."""
    def value(raw: Dict[str, Any]) -> float:
        res = raw[under] if under else raw
        if not res.get("all_switched"):
            raise HeadlineError("a phase did not switch the census")
        return round(res[key]["median"], 3)
    return value


def kind_cost_us(config: str, workload: str = "eager") -> Callable[[Dict[str, Any]], float]:
    """µs CUPTI adds per launch with `config`'s activity kinds: the median over rounds of the paired
    difference against nothing enabled, in one process (bench/floor/kind_cost.cu)."""
    def value(raw: Dict[str, Any]) -> float:
        rows = [r for r in raw["results"] if r["config"] == config and r["workload"] == workload
                and r["metric"] == "issue"]
        if len(rows) != 1:
            raise HeadlineError(f"expected one {config}/{workload} row, found {len(rows)}")
        return round(rows[0]["delta_vs_none"]["median"] / 1000.0, 3)
    return value


def kind_cost_set_up_us(workload: str):
    """µs per unit that CUPTI's set-up adds with nothing enabled: kind_cost's `none` median less the
    median of its --pristine rounds (before CUPTI was set up; not paired: nothing to alternate with)."""
    def value(raw: Dict[str, Any]) -> float:
        rows = [r for r in raw.get("pristine", {}).get("results", []) if r["workload"] == workload
                and r["metric"] == "issue"]
        if len(rows) != 1:
            raise HeadlineError(f"expected one pristine {workload}/issue row, found {len(rows)}")
        return round(rows[0]["none_median_minus_this"] / 1000.0, 3)
    return value


def toggle_refused(raw: Dict[str, Any], min_pairs: int = 8) -> None:
    """A toggled load (bench/server/toggle_slots.py, or several pooled) is refused unless every check passed (every
    slot switched among them) and it holds min_pairs pairs."""
    if not all(c.get("ok") for c in raw.get("checks", [{"ok": False}])):
        raise HeadlineError("a check of the toggled load failed")
    if raw.get("pairs", 0) < min_pairs:
        raise HeadlineError(f"{raw.get('pairs', 0)} pairs")


def toggle_ratio(key: str = "events/off", min_pairs: int = 8) -> Callable[[Dict[str, Any]], float]:
    """The median over pairs of slots of key (events/off tok/s) in one load of one server whose census was switched
    slot by slot (bench/server/toggle_slots.py); refused unless every check passed and every slot switched."""
    def value(raw: Dict[str, Any]) -> float:
        toggle_refused(raw, min_pairs)
        return round(raw[key]["median"], 3)
    return value


def toggle_cpu_ratio(role: str, part: str = "main") -> Callable[[Dict[str, Any]], float]:
    """The median over the pairs of a toggled load of one role's CPU a token (its `part`: "all" its processes,
    "main" its main thread), events over off (toggle_slots.cpu_pairs); refused as toggle_ratio refuses."""
    def value(raw: Dict[str, Any]) -> float:
        toggle_refused(raw)
        try:
            return round(raw["cpu_per_token"][role][part]["median"], 3)
        except (KeyError, TypeError):
            raise HeadlineError(f"no CPU a token of {role} ({part}) in the toggled load") from None
    return value


def launch_phases_us(key: str, per: int = 1) -> Callable[[Dict[str, Any]], float]:
    """µs the census's events default adds to one call of `key` (eager_ns, graph_issue_ns, ...) in one process,
    switched off / events between rounds, ABBA (bench/perf/launch_phases.py): the median over round pairs of the
    difference, divided by `per` (a graph's nodes); refused unless the census counted exactly what ran."""
    def value(raw: Dict[str, Any]) -> float:
        if not raw.get("exact"):
            raise HeadlineError("the census did not count exactly what launch_price did")
        got = raw["summary"][f"events-off {key}"]
        if raw["summary"]["rounds"] < 8:
            raise HeadlineError(f"{raw['summary']['rounds']} round pairs")
        return round(got["median"] / per / 1000.0, 3)
    return value


def pooled_beside_ratio(keys: tuple, under: str = "phases") -> Callable[[Dict[str, Any]], float]:
    """The median of one ratio over every round of several windows of a phase run (e.g. E/P at once in R's off and
    its events windows: two servers whose own modes never change, loaded at once twice a round)."""
    def value(raw: Dict[str, Any]) -> float:
        res = raw[under]
        if not res.get("all_switched"):
            raise HeadlineError("a phase did not switch the census")
        return round(statistics.median([x for k in keys for x in res[k]["all"]]), 3)
    return value


def reference_ratio(mode: str, min_phases: int = 8) -> Callable[[Dict[str, Any]], float]:
    """R's estimated kernel time an output token over A's measured (every kernel traced), loaded in the same
    windows: the median over phases (bench/device/vllm_e2e.py reference_check)."""
    def value(raw: Dict[str, Any]) -> float:
        ref = raw["phases"].get("reference", {}).get(mode)
        if not ref or ref.get("phases", 0) < min_phases:
            raise HeadlineError(f"fewer than {min_phases} phases of {mode} with a reference")
        return round(ref["kernel_ns_per_token_ratio_median"], 3)
    return value


def phase_kernel_time_ratio(mode: str) -> Callable[[Dict[str, Any]], float]:
    """Each phase's kernel time a token, priced as the census prices it, over the every-kernel server's loaded after
    the same round (bench/server/phase_kernel_time.py on a llama_phases.py --beside-traced file): the median."""
    def value(raw: Dict[str, Any]) -> float:
        sys.path.insert(0, str(REPO / "bench" / "server"))
        sys.path.insert(0, str(REPO / "src"))
        import phase_kernel_time
        xs = phase_kernel_time.ratios(raw, mode)
        if not xs:
            raise HeadlineError(f"no {mode} phase with a traced load beside it")
        return round(statistics.median(xs), 3)
    return value


def gate_excess_ns(spin_ns: int) -> Callable[[Dict[str, Any]], float]:
    """ns a gated eager event pair (the lead event's pass taken off) reads above CUPTI's duration of the same
    kernel, steady.cu's kernels spinning `spin_ns` (bench/perf/event_gate_probe.py's summary)."""
    def value(raw: Dict[str, Any]) -> float:
        row = raw["summary"][str(spin_ns)]
        if not (row["gated"]["exact"] and row["all"]["exact"]):
            raise HeadlineError("a run's counts were not exact")
        return round(row["gated"]["eager_mean_ns"] - row["all"]["eager_mean_ns"])
    return value


def d2h_bytes_per_request(flags: str) -> Callable[[Dict[str, Any]], float]:
    """Device-to-host bytes a request the census counted on llama-server with one flag set
    (bench/server/run_server_bench.py's census row)."""
    def value(raw: Dict[str, Any]) -> float:
        return _row(raw, workload="server/llama.cpp", flags=flags, variant="census")["d2h_bytes_per_request"]
    return value


def busy_gap(loop: str, gauge: str) -> Callable[[Dict[str, Any]], float]:
    """One gauge's median while a busy loop ran (bench/perf/gpu_busy_gap.py's `steady`), 3 decimals."""
    def value(raw: Any) -> float:
        (row,) = [r for r in raw if r["loop"] == loop]
        return round(row["steady"][gauge][0], 3)
    return value


def share_error(method: str) -> Callable[[Dict[str, Any]], float]:
    """The larger over the mixed loads of `method`'s mean absolute relative error of request shares against each
    request's cost alone (bench/device/attribution_error.py); refused if a check failed or a request was left out."""
    def value(raw: Dict[str, Any]) -> float:
        if raw.get("checks_failed"):
            raise HeadlineError(f"checks failed: {raw['checks_failed']}")
        got = [load[method] for load in raw.get("errors", {}).values() if method in load]
        if not got or any(g.get("left_out") for g in got):
            raise HeadlineError(f"no complete mixed load split by {method}")
        return round(max(g["all"]["mae"] for g in got), 3)
    return value


@dataclass(frozen=True)
class Rule:
    name: str
    source: str                     # under bench/results/
    value: Callable[[Dict[str, Any]], float]
    target: Optional[float]
    unit: str
    command: Optional[str] = None   # None: the raw file's own `command`
    date: Optional[str] = None      # None: the raw file's own `date`
    why_no_target: str = ""


# The runs behind several entries (each entry's section in docs/measurements.md). Settings are named as they
# were when measured: OTEL_GPU_CENSUS_ACTIVITY=events is today's default collector, `--activity on` the precise one.
LLAMA_PHASES = ("BENCH_ARGS='--activity events --modes off,events --beside-plain --beside-traced --rounds 14 "
                "--budget-s 420' bash bench/device/run.sh setup llama-phases (after setup llama-bg, vllm-install "
                "llama-wait)")
LLAMA_TOGGLE = ("LLAMA_TOGGLE_ARGS='--seconds 240 --slot 3 --tick 0.5 --settle 1 --n-predict 48,80 --budget-s 300' "
                "bash bench/device/run.sh setup llama-wait launch-phases llama-toggle (after setup, "
                "LLAMA_BG_CPUS=8-15 llama-bg)")
VLLM_TOGGLE = ('VLLM_E2E_ARGS="--only toggle --phase-r-env OTEL_GPU_CENSUS_ACTIVITY=events,OTEL_GPU_CENSUS_FLUSH_MS=200 '
               '--phase-modes off,events --phase-window 10,3 --phase-kv-bytes 2147483648 --phase-gpu-mem 0.16 '
               '--toggle-s 600 --toggle-slot 4|2 --toggle-tick 0.5|0.25 --toggle-settle 1|0.5 --toggle-order random '
               '--toggle-seed 700|701|702 --budget-s 569|570|520 --pin R=0-3,bench=4-7" bash bench/device/run.sh setup '
               'vllm (a: slot 4, tick 0.5, settle 1, seed 700; b: slot 2, tick 0.25, settle 0.5, seed 701; c: as b, '
               'seed 702; after setup, vllm-q1, vllm-q2, vllm-q3, setup vllm-install); then python3 '
               'bench/server/toggle_pool.py bench/results/vllm_default_throughput_ratio/vllm-toggle-{a,b,c}.json '
               '--date 2026-12-04 --out bench/results/vllm_default_throughput_ratio/vllm-toggle.json')
VLLM_PINNED = ("VLLM_E2E_ARGS='--only phases --phase-r-env OTEL_GPU_CENSUS_ACTIVITY=events --phase-together P,E "
               "--phase-modes off,events --phase-window 1,3 --phase-kv-bytes 2147483648 --phase-gpu-mem 0.16 "
               "--phase-rounds 40 --budget-s 460 --pin R=0-3,P=4-7,E=8-11,bench=12-15' bash bench/device/run.sh setup "
               "vllm (after vllm-q1, vllm-q2, vllm-q3, setup vllm-install)")
VLLM_ALONE = ("VLLM_E2E_ARGS='--only phases --phase-r-env OTEL_GPU_CENSUS_ACTIVITY=events --phase-beside P,A "
              "--phase-modes off,events --phase-window 1,3 --phase-kv-bytes 2147483648 --phase-gpu-mem 0.16 "
              "--phase-rounds 20 --budget-s 250' bash bench/device/run.sh setup vllm")
VLLM_SHARED = ("VLLM_E2E_ARGS='--only phases --phase-r-env OTEL_GPU_CENSUS_ACTIVITY=events,OTEL_GPU_CENSUS_EVENT_EVERY=128 "
               "--phase-together P,A --phase-modes off,events --phase-window 1,3 --phase-kv-bytes 2147483648 "
               "--phase-gpu-mem 0.16 --phase-rounds 20 --budget-s 270' bash bench/device/run.sh setup vllm")
VLLM_CUPTI = ("VLLM_E2E_ARGS='--only phases --phase-together P,S --phase-modes off,launch,counted --phase-window 1,3 "
              "--phase-kv-bytes 2147483648 --phase-gpu-mem 0.16 --phase-rounds 20 --budget-s 380' "
              "bash bench/device/run.sh setup vllm")
LAUNCH_PHASES = "LAUNCH_PHASES_ARGS='--rounds 16' bash bench/device/run.sh setup launch-phases"
NO_LAUNCH_TARGET = "the overhead target is >= 0.99 of server throughput, none per launch"

RULES = (
    Rule("llamacpp_default_throughput_ratio", "llamacpp_default_throughput_ratio/llama-toggle.json",
         toggle_ratio(), 0.99,
         "ratio of output tok/s, the default census (preloaded, event pairs 128/1, gated, no CUPTI; native code of "
         "7b9260b) / the same census switched off (its wrappers passing every call through), inside ONE load of one "
         "llama-server (8B, 16 slots, 16 closed-loop streaming clients, prompts of 1,800 distinct ids, 48-80 tokens a "
         "request), switched every 3 s, each pair's order drawn at random, median of 38 pairs (0.810-1.264; geometric "
         "mean 1.002 [0.972, 1.033]; no slot position differs from another by more than its error)",
         command=LLAMA_TOGGLE, date="2026-12-05"),
    Rule("llamacpp_default_phases_throughput_ratio", "llamacpp_default_phases_throughput_ratio/llama-phases.json",
         phases_ratio("events"), 0.99,
         "ratio of output tok/s, the default census / the same census paused (its wrappers passing every call "
         "through), one llama-server (8B, 16 slots) in alternating control-file phases with prompts of their own, "
         "median of 11 rounds (spread 0.962-1.045, geometric mean 0.991 [0.979, 1.005])",
         command=LLAMA_PHASES, date="2026-12-04"),
    Rule("llamacpp_default_vs_plain_throughput_ratio", "llamacpp_default_phases_throughput_ratio/llama-phases.json",
         beside_ratio("events/plain", under=None), 0.99,
         "ratio of output tok/s, the default census (R's events phases) / a plain llama-server (no census) loaded after "
         "every round of R's phases, 8B, 16 slots, prompts of their own, median of 11 rounds (geometric mean 0.980 "
         "[0.960, 1.002]; R paused / plain 0.986, geometric mean 0.989 [0.969, 1.010])",
         command=LLAMA_PHASES, date="2026-12-04"),
    Rule("llamacpp_default_kernel_time_vs_measured_ratio", "llamacpp_default_phases_throughput_ratio/llama-phases.json",
         phase_kernel_time_ratio("events"), 1.0,
         "ratio of kernel ns an output token, the default census's events phases (eager launches x the pairs' mean, "
         "graph launches x their exec's mean span) / a llama-server under CUPTI tracing every kernel, loaded alone after "
         "each round, 8B, 16 slots, median of 11 rounds (1.024-1.121; eager pairs' mean 16.5 us against CUPTI's 15.4: "
         "the dispatch each pair holds); stated bound +-10 %",
         command=LLAMA_PHASES, date="2026-12-04"),
    Rule("vllm_default_throughput_ratio", "vllm_default_throughput_ratio/vllm-toggle.json",
         toggle_ratio(), 0.99,
         "ratio of output tok/s, the default census (preloaded, gated event pairs, 128/1, no CUPTI) with the vLLM "
         "integration / the same census switched off (the integration on in both), inside ONE load of one vLLM (random "
         "160M Llama, CUDA graphs, 64 closed-loop clients, 64-192 tokens a request, on 4 CPUs of its own), switched "
         "every 2 s (two runs) or 4 s (one), each pair's order drawn at random, median of 244 pairs of three runs "
         "(0.804-1.230; geometric mean 0.989 [0.980, 0.999]; per run 1.003, 0.981, 0.999)",
         command=VLLM_TOGGLE, date="2026-12-04"),
    Rule("vllm_default_engine_cpu_per_token_ratio", "vllm_default_throughput_ratio/vllm-toggle.json",
         toggle_cpu_ratio("python3", "main"), None,
         "ratio of the vLLM engine core's main thread's CPU ms a token (/proc), the default census / the same census "
         "switched off, the 244 pairs of vllm_default_throughput_ratio (geometric mean 1.010 [1.000, 1.020]; 65.5 -> "
         "66.1 ms a 1,000 tokens): the thread that limits this load",
         command=VLLM_TOGGLE, date="2026-12-04",
         why_no_target="the overhead target is throughput (>= 0.99); this says where its cost goes"),
    Rule("vllm_default_phases_throughput_ratio", "vllm_default_phases_throughput_ratio/vllm-phases.json",
         phases_ratio("events", "phases"), 0.99,
         "ratio of output tok/s, the default census with the vLLM integration / the same server paused (the "
         "integration on in both), random 160M Llama, CUDA graphs, 64 closed-loop clients, 3 s windows, alternating "
         "phases, P and E loaded at the same time, each server on 4 CPUs of its own, median of 24 rounds (0.832-1.165; "
         "geometric mean 0.982 [0.954, 1.012])",
         command=VLLM_PINNED, date="2026-12-04"),
    Rule("vllm_default_vs_plain_throughput_ratio", "vllm_default_phases_throughput_ratio/vllm-phases.json",
         beside_ratio("events/P@once"), 0.99,
         "ratio of output tok/s, the default census with the vLLM integration (R) / a plain vLLM (P) loaded at the same "
         "time, 64 closed-loop clients each, 3 s windows, each server on 4 CPUs of its own, median of 24 rounds "
         "(0.844-1.073; geometric mean 0.937 [0.915, 0.960]; R paused / P 0.942 in the same rounds: a gap between two "
         "servers that R's own phases do not show)",
         command=VLLM_PINNED, date="2026-12-04"),
    Rule("vllm_default_census_only_vs_plain_throughput_ratio", "vllm_default_phases_throughput_ratio/vllm-phases.json",
         pooled_beside_ratio(("E/P@once:off", "E/P@once:events")), 0.99,
         "ratio of output tok/s, the default census counting with the vLLM integration disabled (E) / a plain vLLM (P), "
         "loaded at the same time, both windows of each of 24 rounds (48), each server on 4 CPUs of its own; two "
         "servers, so each one's own speed is in it",
         command=VLLM_PINNED, date="2026-12-04"),
    Rule("vllm_default_integration_vs_census_only_throughput_ratio",
         "vllm_default_phases_throughput_ratio/vllm-phases.json",
         beside_ratio("events/E@once"), 0.99,
         "ratio of output tok/s, the default census with the vLLM integration (R, counting) / the same census with the "
         "integration disabled (E), loaded at the same time, median of 24 rounds (0.853-1.143; geometric mean 0.953 "
         "[0.930, 0.978]); R paused / E 0.985 in the same rounds; two servers",
         command=VLLM_PINNED, date="2026-12-04"),
    Rule("vllm_default_kernel_time_vs_measured_ratio", "vllm_default_kernel_time_vs_measured_ratio/vllm-phases.json",
         reference_ratio("events", min_phases=5), 1.0,
         "ratio of kernel ns an output token, the default census's requests (eager launches x the pairs' mean, graph "
         "launches x their exec's mean span) / A's requests (CUPTI tracing every kernel), A loaded alone after each "
         "round of R's phases, random 160M Llama, CUDA graphs, 64 closed-loop clients, 3 s windows, median of 5 phases "
         "(1.059-1.096; per request p50 14.8 % / p90 39.5 % from A's median request, A's own 13.5 % / 39.8 %; eager "
         "pairs' mean 8,056 ns against CUPTI's 7,098, graph spans 1.013 of A's); stated bound +-10 %",
         command=VLLM_ALONE, date="2026-12-04"),
    Rule("vllm_default_kernel_time_shared_gpu_vs_measured_ratio",
         "vllm_default_kernel_time_shared_gpu_vs_measured_ratio/vllm-phases.json",
         reference_ratio("events", min_phases=7), 1.0,
         "ratio of kernel ns an output token, R's requests under gated event pairs (eager launches x the pairs' mean, "
         "graph launches x their exec's mean span) / A's requests (CUPTI tracing every kernel) loaded in the same 3 s "
         "windows, three vLLM servers on one GPU, median of 7 phases (1.595-1.735): graph spans +1.9 %, eager pairs "
         "2.9 times CUPTI's mean, the other servers' work inside them",
         command=VLLM_SHARED, date="2026-12-03"),
    Rule("micro_gated_eager_pair_excess_ns", "micro_gated_eager_pair_excess_ns/gate-probe.json",
         gate_excess_ns(3000), None,
         "ns a gated eager event pair reads above CUPTI's duration of the same kernel (steady.cu, 20 kernels a ms "
         "spinning 3 us, 1 in 4 eager launches paired, the lead event's pass taken off; 986 ns for empty kernels, "
         "1,076 ns for 20 us ones): the GPU's dispatch of a kernel, which CUPTI's records do not count",
         command="GATE_PROBE_ARGS='--rounds 1' bash bench/device/run.sh setup gate-probe", date="2026-12-03",
         why_no_target="the stated bound is on per-request kernel time (+-10 %), none per pair"),
    Rule("micro_eager_us_per_launch_default", "micro_eager_us_per_launch_default/launch-phases.json",
         launch_phases_us("eager_ns"), None,
         "µs the default census (native code of 7b9260b) adds to the launching thread per eager launch of an empty "
         "kernel (launch_price.cu through the CUDA runtime, 3,055 ns a launch paused): counting it and pairing 1 in "
         "128; one process pinned to a core, the census switched off/events between rounds, ABBA, median of 16 round "
         "pairs (mean 0.089 [-0.071, 0.235]; earlier leases, other hosts: 0.423 and 0.027); every launch and copy "
         "counted exactly",
         command=LAUNCH_PHASES, date="2026-12-05", why_no_target=NO_LAUNCH_TARGET),
    Rule("micro_graph_us_per_launch_default", "micro_eager_us_per_launch_default/launch-phases.json",
         launch_phases_us("graph_issue_ns"), None,
         "µs the default census adds to the launching thread per CUDA-graph launch (64 empty kernels; 1,642 ns a launch "
         "paused): counting it and its gated event pair (every graph launch paired); one process, ABBA, median of 16 "
         "round pairs (mean 3.548 [3.154, 3.979]; earlier leases, other hosts: 6.124 and 5.024)",
         command=LAUNCH_PHASES, date="2026-12-05", why_no_target=NO_LAUNCH_TARGET),
    Rule("micro_graph_us_per_node_default", "micro_eager_us_per_launch_default/launch-phases.json",
         launch_phases_us("graph_issue_ns", per=64), None,
         "µs the default census adds to the launching thread per CUDA-graph kernel node, for a graph of 64 (its price "
         "is per launch, micro_graph_us_per_launch_default, whatever the graph's size: vLLM's hold ~31 kernels); one "
         "process, ABBA, median of 16 round pairs",
         command=LAUNCH_PHASES, date="2026-12-05", why_no_target=NO_LAUNCH_TARGET),
    Rule("micro_eager_pair_us_events", "micro_eager_pair_us_events/launch-phases.json",
         launch_phases_us("eager_ns"), None,
         "µs one gated eager event pair (three events, a stream wait, the gate's write) adds to the launching thread: "
         "the default census with every launch paired (EVENT_EVERY=1/1), one process, ABBA, median of 30 round pairs "
         "(the default pairs 1 in 128)",
         command="LAUNCH_PHASES_ARGS='--rounds 30 --event-every 1/1 --adds 200 --replays 48' bash bench/device/run.sh "
                 "setup launch-phases", date="2026-12-04",
         why_no_target="a price, not a goal: the default pays it on 1 in 128 eager launches"),
    Rule("micro_eager_us_per_launch_precise", "micro_eager_us_per_launch_precise/kind-cost.json",
         kind_cost_us("graph+kernel"), None,
         "µs CUPTI adds per eager kernel launch with the precise census's activity kinds (kernels, copies, memsets, "
         "graph launches) on, paired against CUPTI set up with nothing on, in one process, median of 21 rounds (on top "
         "of micro_eager_us_per_launch_cupti_set_up)",
         command="bash bench/device/run.sh setup kind-cost", date="2026-12-02", why_no_target=NO_LAUNCH_TARGET),
    Rule("micro_eager_us_per_launch_cupti_set_up", "micro_eager_us_per_launch_cupti_set_up/kind-cost.json",
         kind_cost_set_up_us("eager"), None,
         "µs CUPTI adds per eager launch once set up as the census sets it up (activity API and a subscriber), with "
         "nothing enabled: kind_cost's none median (3,957 ns) less its 21 rounds before CUPTI was set up (3,303 ns), "
         "one process, not paired; the precise census pays it, on or off",
         command="KIND_COST_ARGS='--rounds 21 --pristine 21 --configs cb-launch-driver,cb-paused,graph --budget-s 100' "
                 "bash bench/device/run.sh setup kind-cost", date="2026-12-03", why_no_target=NO_LAUNCH_TARGET),
    Rule("micro_graph_replay_ratio_cupti_set_up", "micro_graph_replay_ratio_cupti_set_up/micro.json",
         micro_ratio("graph", "census-paused"), 0.99,
         "ratio of CUDA-graph replay throughput (1,000 tiny kernels a graph), a process with CUPTI set up inside cuInit "
         "and no activity kind on (the census started paused) / plain, median of 7 same-round pairs: a context created "
         "while CUPTI is set up pays ~0.12 µs of GPU time a kernel node for its whole life",
         command="BENCH_ARGS='--rounds 7 --workloads graph --variants plain --variant census-disabled census "
                 "OTEL_GPU_CENSUS_DISABLED=1 --variant census-paused-node census OTEL_GPU_CENSUS_START=paused "
                 "OTEL_GPU_CENSUS_GRAPHS=node --variant census-paused census OTEL_GPU_CENSUS_START=paused --variant "
                 "floor-memcpy floor CUPTI_FLOOR_KINDS=memcpy --variant floor-kernel floor CUPTI_FLOOR_KINDS=kernel "
                 "--budget-s 300' bash bench/device/run.sh setup micro"),
    Rule("vllm_cupti_set_up_vs_plain_throughput_ratio", "vllm_cupti_set_up_vs_plain_throughput_ratio/vllm-phases.json",
         beside_ratio("S/P@once:off"), 0.99,
         "ratio of output tok/s, vLLM with CUPTI set up by the census and every kind off (S, no integration) / a plain "
         "vLLM (P), loaded at the same time, random 160M Llama, CUDA graphs, 64 closed-loop clients each, 3 s windows, "
         "median of 10 rounds (geometric mean 0.861 [0.789, 0.946]; over all 30 windows of the run 0.894, geometric "
         "mean 0.906 [0.859, 0.951]): the floor of the precise census on vLLM",
         command=VLLM_CUPTI, date="2026-12-03"),
    Rule("llamacpp_proxy_throughput_ratio", "llamacpp_proxy_throughput_ratio/proxy-pairs.json",
         proxy_pair_ratio, 0.99, "ratio of output tok/s, through the proxy / direct (one server), median of 5 pairs",
         command="BENCH_ARGS='--proxy-pairs 5 --budget-s 190' bash bench/device/run.sh setup proxy-pairs"),
    Rule("sidecar_cpu_pct_of_one_core", "sidecar_cpu_pct_of_one_core/sidecar-cpu.json",
         sidecar_pct, 1.0, "% of one core (8 processes, 1 s interval, NVML and GPM on)",
         command="bash bench/device/run.sh setup sidecar (bench/perf/perf_sidecar_cpu.py --workload cuda "
                 "--seconds 25)", date="2026-12-02"),
    Rule("llamacpp_prompt_cache_d2h_bytes_per_request",
         "llamacpp_prompt_cache_d2h_bytes_per_request/server-flags.json",
         d2h_bytes_per_request("default"), None,
         "bytes device-to-host per request, llama-server b11434 with its default flags (prompt cache and context "
         "checkpoints on), random 8B llama, 16 streaming clients, 64 requests of 1,800 prompt and 64 output tokens; "
         "with --cache-ram 0 --ctx-checkpoints 0 the same load copies 32,849,568 B a request (the logits)",
         why_no_target="a finding, not a goal"),
    Rule("vllm_share_vs_alone_error_tokens", "attribution_error/attribution_error.json",
         share_error("tokens"), None,
         "mean absolute relative error of the default step split's (scheduled tokens) request kernel shares against "
         "each request's kernel time served alone, after scaling the shares to the alone total; the larger of two "
         "mixed loads (16 and 48 concurrent; 48 requests of four classes, 48 or 1,536 prompt tokens by 16 or 192 "
         "output tokens; vLLM, random 160M Llama, prefix caching off). Splits by FLOPs and by alone cost, the same "
         "run: docs/measurements.md",
         command="ATTRIBUTION_ARGS='--per-class 12 --mixed 16,48 --methods tokens,flops,alone --budget-s 400' "
                 "bash bench/device/run.sh setup attribution (after setup, vllm-q1, vllm-q2, vllm-q3)",
         why_no_target="an allocation's distance from one reference, stated so that no share reads as a measurement"),
    Rule("busy_gap_matmul_sm_occupancy", "busy_gap_matmul_sm_occupancy/busy-gap.json",
         busy_gap("matmul", "gpu_census.sm.occupancy"), None,
         "NVML GPM SM occupancy (ratio of the SMs' warp slots) of a loop of bf16 8192x8192 matmuls that nvidia-smi "
         "reports 0.99 utilised (census busy 0.98), median of the seconds the loop ran (bench/perf/gpu_busy_gap.py)",
         command="python3 bench/perf/gpu_busy_gap.py --seconds 10 (after bash bench/device/run.sh setup)",
         date="2026-11-29", why_no_target="a finding, not a goal"),
)


def source_device(raw: Any) -> Optional[str]:
    smi = raw.get("environment", {}).get("nvidia_smi") if isinstance(raw, dict) else None
    if not isinstance(smi, dict) or not smi.get("gpu"):
        return None
    extra = ", ".join(x for x in (f"driver {smi['driver']}" if smi.get("driver") else "",
                                  f"CUDA {smi['driver_cuda']}" if smi.get("driver_cuda") else "") if x)
    return f"{smi.get('gpu_count', 1)} × {smi['gpu']}" + (f" ({extra})" if extra else "")


def compute(rule: Rule) -> Dict[str, Any]:
    path = RESULTS / rule.source
    raw = load_json(path)
    try:
        value = rule.value(raw)
    except HeadlineError as e:
        raise HeadlineError(f"{rel(path)}: {e}")
    except (KeyError, TypeError, ValueError, ZeroDivisionError, statistics.StatisticsError) as e:
        raise HeadlineError(f"{rel(path)}: cannot derive {rule.name} ({type(e).__name__}: {e})")
    date = rule.date or str(raw.get("date", ""))[:10]
    command = rule.command or raw.get("command")
    if not DATE.match(date) or not command:
        raise HeadlineError(f"{rel(path)}: no date or command for {rule.name}")
    return {"name": rule.name, "value": value, "target": rule.target, "unit": rule.unit, "date": date,
            "device": source_device(raw) or H200, "command": command, "source": rel(path)}


# ---- the file ----------------------------------------------------------------------------------

def problems(entries: Any) -> List[str]:
    """Everything wrong with the schema of a headline list (empty: fine)."""
    if not isinstance(entries, list):
        return ["not a JSON list"]
    out, seen = [], set()
    for i, e in enumerate(entries):
        where = f"entry {i}" + (f" ({e.get('name')})" if isinstance(e, dict) and e.get("name") else "")
        if not isinstance(e, dict) or tuple(sorted(e)) != tuple(sorted(KEYS)):
            out.append(f"{where}: keys must be exactly {', '.join(KEYS)}")
            continue
        for k in ("name", "unit", "device", "command", "source"):
            if not isinstance(e[k], str) or not e[k].strip():
                out.append(f"{where}: {k} must be a non-empty string")
        for k in ("value", "target"):
            v = e[k]
            if v is None and k == "target":
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                out.append(f"{where}: {k} must be a finite number" + (" or null" if k == "target" else ""))
        if not isinstance(e["date"], str) or not DATE.match(e["date"]):
            out.append(f"{where}: date must be YYYY-MM-DD")
        if isinstance(e["source"], str) and e["source"].strip():
            src = (REPO / e["source"]).resolve()
            if RESULTS.resolve() not in src.parents or src == HEADLINE.resolve() or not src.is_file():
                out.append(f"{where}: source {e['source']} is not a results file under bench/results/")
        if e["name"] in seen:
            out.append(f"{where}: name appears twice")
        seen.add(e["name"])
    missing = [n for n in REQUIRED if n not in seen]
    if missing:
        out.append("missing: " + ", ".join(missing))
    return out


def expected(current: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """What the file should hold: every rule's entry computed from its raw file, except where the
    file records a newer measurement of that name from another source (--set); those are kept."""
    by_name = {e.get("name"): e for e in current if isinstance(e, dict)}
    rules = {r.name: r for r in RULES}
    out = []
    for r in RULES:
        e = by_name.get(r.name)
        out.append(e if e is not None and e.get("source") != f"bench/results/{r.source}" else compute(r))
    out += [e for e in current if isinstance(e, dict) and e.get("name") not in rules]
    return out


def read_headline(path: Path) -> List[Dict[str, Any]]:
    if not path.exists():
        return []
    entries = load_json(path)
    if not isinstance(entries, list):
        raise HeadlineError(f"{rel(path)}: not a JSON list")
    return entries


def write_headline(path: Path, entries: List[Dict[str, Any]]) -> None:
    bad = problems(entries)
    if bad:
        raise HeadlineError(f"refusing to write {rel(path)}: {bad[0]}")
    text = "[\n" + ",\n".join("  " + json.dumps(e, ensure_ascii=False) for e in entries) + "\n]\n"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def check(path: Path) -> int:
    if not path.exists():
        print(f"headline: {rel(path)} does not exist (run --write)")
        return 1
    current = read_headline(path)
    diffs = problems(current)
    want = expected(current)
    have = {e.get("name"): e for e in current if isinstance(e, dict)}
    for w in want:
        h = have.get(w["name"])
        if h is None:
            continue                               # reported by problems() or below
        for k in KEYS:
            if h.get(k) != w[k]:
                diffs.append(f"{w['name']}: {k} is {h.get(k)!r} in the file, the raw files give {w[k]!r}")
    if [e.get("name") for e in current if isinstance(e, dict)] != [w["name"] for w in want]:
        diffs.append("entries missing or out of order (run --write)")
    for d in diffs:
        print(f"headline: {d}")
    if not diffs:
        print(f"headline: {rel(path)} matches the raw results ({len(current)} entries)")
    return 1 if diffs else 0


def number(text: str, what: str, allow_null: bool = False) -> Optional[float]:
    if allow_null and text.strip().lower() in ("null", "none"):
        return None
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not math.isfinite(v):
        raise HeadlineError(f"{what} must be a finite number{' or null' if allow_null else ''}, got {text!r}")
    return v


def set_entry(path: Path, a: argparse.Namespace) -> Dict[str, Any]:
    name, sep, value_text = a.set.partition("=")
    name = name.strip()
    if not sep or not re.fullmatch(r"[a-z0-9_]+", name):
        raise HeadlineError(f"--set wants NAME=VALUE with NAME in [a-z0-9_], got {a.set!r}")
    value = number(value_text, f"the value of {name}")
    if a.date is not None and not DATE.match(a.date):
        raise HeadlineError(f"--date must be YYYY-MM-DD, got {a.date!r}")
    if not a.source:
        raise HeadlineError("--set needs --source (the raw results file under bench/results/)")
    src = Path(a.source)
    src = (src if src.is_absolute() else Path.cwd() / src).resolve()
    if RESULTS.resolve() not in src.parents or src == HEADLINE.resolve() or not src.is_file():
        raise HeadlineError(f"--source {a.source}: not a results file under bench/results/")
    rule = next((r for r in RULES if r.name == name), None)
    if rule and src == (RESULTS / rule.source).resolve():
        raise HeadlineError(f"{name} is derived from {rel(src)} by this script: run --write instead")
    try:
        raw = json.loads(src.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        raw = None                                   # a log or table: take everything from the flags
    entries = read_headline(path)
    old = next((e for e in entries if isinstance(e, dict) and e.get("name") == name), {})
    date = a.date or (str(raw.get("date", ""))[:10] if isinstance(raw, dict) else "")
    command = a.command or (raw.get("command") if isinstance(raw, dict) else None)
    device = a.device or source_device(raw) or old.get("device")
    unit = a.unit or old.get("unit") or (rule.unit if rule else None)
    target = (number(a.target, "--target", allow_null=True) if a.target is not None
              else old.get("target", rule.target if rule else None))
    for flag, v in (("--date", date), ("--command", command), ("--device", device), ("--unit", unit)):
        if not v:
            raise HeadlineError(f"--set {name}: give {flag} (the source does not say)")
    if not DATE.match(date):
        raise HeadlineError(f"--set {name}: the source's date {date!r} is not YYYY-MM-DD: give --date")
    entry = {"name": name, "value": value, "target": target, "unit": unit, "date": date,
             "device": device, "command": command, "source": rel(src)}
    entries = [e for e in entries if not (isinstance(e, dict) and e.get("name") == name)] + [entry]
    write_headline(path, expected(entries))
    return entry


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="exit 1 if headline.json differs from the raw files")
    mode.add_argument("--write", action="store_true", help="rewrite headline.json from the raw files")
    mode.add_argument("--set", metavar="NAME=VALUE", help="record a new measurement of NAME")
    ap.add_argument("--source", help="with --set: the raw results file under bench/results/")
    ap.add_argument("--date", help="with --set: YYYY-MM-DD (default: the source's date)")
    ap.add_argument("--command", help="with --set: the command that measured it (default: the source's)")
    ap.add_argument("--device", help="with --set: the machine (default: the source's environment)")
    ap.add_argument("--unit", help="with --set: the unit (default: the entry's present unit)")
    ap.add_argument("--target", help="with --set: the target, a number or null (default: the present one)")
    ap.add_argument("--file", type=Path, default=HEADLINE, help=argparse.SUPPRESS)   # for the tests
    a = ap.parse_args(argv)
    try:
        if a.check:
            return check(a.file)
        if a.write:
            write_headline(a.file, expected(read_headline(a.file)))
            print(f"headline: wrote {rel(a.file)}")
            return 0
        e = set_entry(a.file, a)
        print(f"headline: {e['name']} = {e['value']} ({e['source']}), wrote {rel(a.file)}")
        return 0
    except HeadlineError as e:
        print(f"headline: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
