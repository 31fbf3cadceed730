#!/usr/bin/env python3
"""The headline figures, machine-readable: bench/results/headline.json, recomputed from the raw results.

    python bench/headline.py --check     exit 1 when headline.json differs from what the raw files give
    python bench/headline.py --write     rewrite headline.json from the raw files
    python bench/headline.py --set NAME=VALUE --source bench/results/FILE [--date YYYY-MM-DD]
                             [--command CMD] [--device DEV] [--unit UNIT] [--target T|null]
                                         record a new measurement of NAME (or a new name)

headline.json is a list of objects with exactly the keys name, value, target, unit, date, device,
command, source (the raw results file under bench/results/ the value comes from). Each value is the
one measured, whether or not it meets its target.

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

def kernel_phase_ratio(raw: Dict[str, Any]) -> float:
    """Traced / untraced output tok/s of each valid pair of loads on one server, median."""
    row = _row(raw, workload="server/llama.cpp kernel tracing, one server")
    ratios = [p["traced"]["output_tok_s"] / p["untraced"]["output_tok_s"]
              for p in row["per_pair"] if p.get("valid")]
    return round(statistics.median(ratios), 3)


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


def micro_us_added(workload: str) -> Callable[[Dict[str, Any]], float]:
    """µs the default census adds per launch (eager) or per graph node against plain, the median over
    same-round pairs of (census time - plain time) / launches: what bench/micro.py reports as the
    census row's us_added_per_launch."""
    def value(raw: Dict[str, Any]) -> float:
        cfg = raw["config"]
        launches = cfg["eager_n"] if workload == "eager" else cfg["graph_nodes"] * cfg["graph_replays"]
        times: Dict[tuple, float] = {}
        for r in raw["runs"]:
            if r.get("rc") == 0 and r.get(f"{workload}_s"):
                times[(r["round"], r["variant"])] = statistics.median(r[f"{workload}_s"])
        added = [(times[(k, "census")] - times[(k, "plain")]) / launches * 1e6
                 for k in sorted({k for k, _ in times}) if (k, "census") in times and (k, "plain") in times]
        return round(statistics.median(added), 3)
    return value


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


def calls_tax_ratio(mode: str, workload: str) -> Callable[[Dict[str, Any]], float]:
    """plain's time over `mode`'s for one workload of bench/perf/calls_tax.py (a throughput ratio), the median over
    rotations of processes side by side, each rotation's own pair."""
    def value(raw: Dict[str, Any]) -> float:
        r = [rot["plain"][workload] / rot[mode][workload] for rot in raw["rotations"]
             if workload in rot["plain"] and workload in rot[mode]]
        if len(r) < 3:
            raise HeadlineError(f"{len(r)} rotations with {mode} and plain")
        return round(statistics.median(r), 3)
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


def vllm_separate_servers(raw: Dict[str, Any]) -> float:
    """Separate servers give no pairs: each census load over the median plain load of its own
    machine (the machines differ ~35 % in plain throughput), median over every census load."""
    ratios = []
    for m in raw["machines"]:
        plain = statistics.median(m["loads"]["plain"])
        ratios += [c / plain for c in m["loads"]["census"]]
    return round(statistics.median(ratios), 3)


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


# The session-10 runs behind several entries (measurements §19)
S10_LLAMA = ("BENCH_ARGS='--modes off,counted --rounds 16 --beside-plain --budget-s 520' bash bench/device/run.sh "
             "setup llama-phases (after setup llama-bg, llama-wait)")
S10_KIND_COST = "KIND_COST_ARGS='--rounds 31 --budget-s 80' bash bench/device/run.sh setup llama-bg kind-cost"
S11_VLLM = ("VLLM_E2E_ARGS='--only phases --phase-together P,S --phase-modes off,launch,counted --phase-window 1,3 "
            "--phase-kv-bytes 2147483648 --phase-gpu-mem 0.16 --phase-rounds 20 --budget-s 380' "
            "bash bench/device/run.sh setup vllm")
S11_KIND_COST = ("KIND_COST_ARGS='--rounds 21 --pristine 21 --configs cb-launch-driver,cb-paused,graph --budget-s 100' "
                 "bash bench/device/run.sh setup kind-cost")

S12_VLLM = ("VLLM_E2E_ARGS='--only phases --phase-r-env OTEL_GPU_CENSUS_ACTIVITY=off --phase-together P,S "
            "--phase-modes off,calls --phase-window 1,3 --phase-kv-bytes 2147483648 --phase-gpu-mem 0.16 --phase-rounds 20 "
            "--budget-s 330' bash bench/device/run.sh setup vllm")
S12_CALLS_TAX = "CALLS_TAX_ARGS='--rotations 6' bash bench/device/run.sh setup calls-tax"
S13_VLLM = ("VLLM_E2E_ARGS='--only phases --phase-r-env OTEL_GPU_CENSUS_ACTIVITY=off --phase-together P,S "
            "--phase-modes off,calls --phase-window 1,3 --phase-kv-bytes 2147483648 --phase-gpu-mem 0.16 --phase-rounds 20 "
            "--budget-s 330' bash bench/device/run.sh setup vllm   (R under `run`, which preloads the library when "
            "ACTIVITY=off)")
S13_VLLM_NOINT = S13_VLLM.replace("ACTIVITY=off --", "ACTIVITY=off,OTEL_PYTHON_DISABLED_INSTRUMENTATIONS=vllm --", 1)
S13_CALLS_TAX = "CALLS_TAX_ARGS='--rotations 4' bash bench/device/run.sh setup calls-tax"
S14_VLLM = ("VLLM_E2E_ARGS='--only phases --phase-r-env OTEL_GPU_CENSUS_ACTIVITY=windows --phase-together P,A "
            "--phase-modes off,windows --phase-window 1,3 --phase-kv-bytes 2147483648 --phase-gpu-mem 0.16 --phase-rounds 20 "
            "--budget-s 300' bash bench/device/run.sh setup vllm   (after vllm-p1, vllm-p2)")
S15_VLLM = ("VLLM_E2E_ARGS='--only phases --phase-r-env OTEL_GPU_CENSUS_ACTIVITY=events,OTEL_GPU_CENSUS_EVENT_EVERY=128 --phase-together P,A "
            "--phase-modes off,events --phase-window 1,3 --phase-kv-bytes 2147483648 --phase-gpu-mem 0.16 --phase-rounds 20 "
            "--budget-s 270' bash bench/device/run.sh setup vllm   (after vllm-p1, vllm-p2)")
S16_VLLM = S15_VLLM
S16_GATE_PROBE = "GATE_PROBE_ARGS='--rounds 1' bash bench/device/run.sh setup gate-probe"
S17_LLAMA = ("BENCH_ARGS='--activity events --modes off,events --beside-plain --beside-traced --rounds 14 "
             "--budget-s 420' bash bench/device/run.sh setup llama-phases (after setup llama-bg, vllm-install llama-wait)")
S18_VLLM = ("VLLM_E2E_ARGS='--only phases --phase-r-env OTEL_GPU_CENSUS_ACTIVITY=events --phase-together P,E "
            "--phase-modes off,events --phase-window 1,3 --phase-kv-bytes 2147483648 --phase-gpu-mem 0.16 --phase-rounds 40 "
            "--budget-s 460 --pin R=0-3,P=4-7,E=8-11,bench=12-15' bash bench/device/run.sh setup vllm "
            "(after vllm-p1, vllm-p2, setup vllm-install)")
S18_PHASES = "LAUNCH_PHASES_ARGS='--rounds 40' bash bench/device/run.sh setup launch-phases"
S20_PHASES = S18_PHASES + "   (native code of 4b8f528: the coarse clock)"
S20_LLAMA_TOGGLE = ("LLAMA_TOGGLE_ARGS='--seconds 400 --slot 3 --tick 0.5 --settle 1 --n-predict 48,80 --budget-s 540' "
                    "bash bench/device/run.sh setup llama-toggle (after setup, LLAMA_BG_CPUS=8-15 llama-bg, llama-wait)")
S17_VLLM = ("VLLM_E2E_ARGS='--only phases --phase-r-env OTEL_GPU_CENSUS_ACTIVITY=events --phase-beside P,A "
            "--phase-modes off,events --phase-window 1,3 --phase-kv-bytes 2147483648 --phase-gpu-mem 0.16 --phase-rounds 20 "
            "--budget-s 250' bash bench/device/run.sh setup vllm   (after vllm-p1, vllm-p2)")
S14_CALLS_TAX = ("CALLS_TAX_WINDOWS=100/1000 CALLS_TAX_ARGS='--modes plain,preload,windows,default --rotations 4 "
                 "--rounds 6' bash bench/device/run.sh setup calls-tax")

RULES = (
    Rule("llamacpp_default_throughput_ratio", "2026-12-04-h200-s20-llama-toggle.json",
         toggle_ratio(), 0.99,
         "ratio of output tok/s, the default census (`run`: preloaded, events 128/1, gated, no CUPTI; native code of "
         "4b8f528) / the same census switched off (its wrappers passing every call through), inside ONE load of one "
         "llama-server (8B, 16 slots, 16 closed-loop streaming clients, prompts of 1,800 distinct ids, 48-80 tokens a "
         "request), switched every 3 s, each pair's order drawn at random, median of 63 pairs (0.851-1.238; geometric "
         "mean 1.007 [0.987, 1.029]; no slot position differs from another by more than its error); the phases of "
         "§26 gave 0.985 (llamacpp_default_phases_throughput_ratio); measurements §28",
         command=S20_LLAMA_TOGGLE, date="2026-12-04"),
    Rule("llamacpp_default_phases_throughput_ratio", "2026-12-04-h200-s17-llama-events.json",
         phases_ratio("events"), 0.99,
         "ratio of output tok/s, the default census (`run`: counted at the calls by the library preloaded, CUPTI never "
         "loaded, kernel durations from gated CUDA event pairs around every graph launch and ~1 in 128 eager launches) / "
         "the same census paused (its wrappers passing every call through), one llama-server (8B, 16 slots) in "
         "alternating control-file phases with prompts of their own, median of 11 rounds (spread 0.962-1.045, "
         "geometric mean 0.991 [0.979, 1.005]); measurements §26",
         command=S17_LLAMA, date="2026-12-04"),
    Rule("llamacpp_default_vs_plain_throughput_ratio", "2026-12-04-h200-s17-llama-events.json",
         beside_ratio("events/plain", under=None), 0.99,
         "ratio of output tok/s, the default census (R's events phases) / a plain llama-server (no census) loaded after "
         "every round of R's phases, 8B, 16 slots, prompts of their own, median of 11 rounds (geometric mean 0.980 "
         "[0.960, 1.002]; R paused / plain 0.986, geometric mean 0.989 [0.969, 1.010]); measurements §26",
         command=S17_LLAMA, date="2026-12-04"),
    Rule("llamacpp_default_kernel_time_vs_measured_ratio", "2026-12-04-h200-s17-llama-events.json",
         phase_kernel_time_ratio("events"), 1.0,
         "ratio of kernel ns an output token, the default census's events phases (eager launches x the pairs' mean, "
         "graph launches x their exec's mean span) / a llama-server under the activity census tracing every kernel, "
         "loaded alone after each round, 8B, 16 slots, median of 11 rounds (1.024-1.121; eager pairs' mean 16.5 us "
         "against CUPTI's 15.4: the dispatch each pair holds); stated bound +-10 %; measurements §26",
         command=S17_LLAMA, date="2026-12-04"),
    Rule("vllm_default_throughput_ratio", "2026-12-04-h200-s21-vllm-toggle.json",
         toggle_ratio(), 0.99,
         "ratio of output tok/s, the default census (`run`: preloaded, gated event pairs, 128/1, no CUPTI) with the vLLM "
         "integration / the same census switched off (the integration on in both), inside ONE load of one vLLM (random "
         "160M Llama, CUDA graphs, 64 closed-loop clients, 64-192 tokens a request, on 4 CPUs of its own), switched "
         "every 2 s (two runs) or 4 s (one), each pair's order drawn at random, median of 244 pairs of three runs "
         "(0.804-1.230; geometric mean 0.989 [0.980, 0.999]; per run 1.003, 0.981, 0.999); the engine's main thread "
         "spent 1.1 % more CPU a token (vllm_default_engine_cpu_per_token_ratio); alternating phases gave 0.986 "
         "(vllm_default_phases_throughput_ratio); measurements §29",
         command=None, date="2026-12-04"),
    Rule("vllm_default_engine_cpu_per_token_ratio", "2026-12-04-h200-s21-vllm-toggle.json",
         toggle_cpu_ratio("python3", "main"), None,
         "ratio of the vLLM engine core's main thread's CPU ms a token (/proc), the default census / the same census "
         "switched off, the 244 pairs of vllm_default_throughput_ratio (geometric mean 1.010 [1.000, 1.020]; 65.5 -> "
         "66.1 ms a 1,000 tokens): the thread that limits this load; measurements §29",
         command=None, date="2026-12-04",
         why_no_target="the overhead issue's target is throughput (>= 0.99); this says where its cost goes"),
    Rule("vllm_default_phases_throughput_ratio", "2026-12-04-h200-s18-vllm-pinned.json",
         phases_ratio("events", "phases"), 0.99,
         "ratio of output tok/s, the default census (`run`: preloaded, gated event pairs, 128/1, no CUPTI) with the vLLM "
         "integration / the same server paused (the integration on in both), random 160M Llama, CUDA graphs, 64 "
         "closed-loop clients, 3 s windows, alternating phases, P and E loaded at the same time, each server on 4 CPUs "
         "of its own, median of 24 rounds (0.832-1.165; geometric mean 0.982 [0.954, 1.012]); the price of its launches "
         "in one process puts it at ~0.995 (measurements §27)",
         command=S18_VLLM, date="2026-12-04"),
    Rule("vllm_default_vs_plain_throughput_ratio", "2026-12-04-h200-s18-vllm-pinned.json",
         beside_ratio("events/P@once"), 0.99,
         "ratio of output tok/s, the default census (`run`: preloaded, gated event pairs, 128/1, no CUPTI) with the vLLM "
         "integration (R) / a plain vLLM (P) loaded at the same time, 64 closed-loop clients each, 3 s windows, each "
         "server on 4 CPUs of its own, median of 24 rounds (0.844-1.073; geometric mean 0.937 [0.915, 0.960]; R paused / "
         "P 0.942 in the same rounds: a gap between two servers that R's own phases do not show); measurements §27",
         command=S18_VLLM, date="2026-12-04"),
    Rule("vllm_default_census_only_vs_plain_throughput_ratio", "2026-12-04-h200-s18-vllm-pinned.json",
         pooled_beside_ratio(("E/P@once:off", "E/P@once:events")), 0.99,
         "ratio of output tok/s, the default census counting with the vLLM integration disabled (E) / a plain vLLM (P), "
         "loaded at the same time, both windows of each of 24 rounds (48), each server on 4 CPUs of its own; two "
         "servers, so each one's own speed is in it (§13, §27)",
         command=S18_VLLM, date="2026-12-04"),
    Rule("vllm_default_integration_vs_census_only_throughput_ratio", "2026-12-04-h200-s18-vllm-pinned.json",
         beside_ratio("events/E@once"), 0.99,
         "ratio of output tok/s, the default census with the vLLM integration (R, counting) / the same census with the "
         "integration disabled (E), loaded at the same time, median of 24 rounds (0.853-1.143; geometric mean 0.953 "
         "[0.930, 0.978]); R paused / E 0.985 in the same rounds; two servers (§27)",
         command=S18_VLLM, date="2026-12-04"),
    Rule("vllm_default_kernel_time_vs_measured_ratio", "2026-12-04-h200-s17-vllm-events-alone.json",
         reference_ratio("events", min_phases=5), 1.0,
         "ratio of kernel ns an output token, the default census's requests (eager launches x the pairs' mean, graph "
         "launches x their exec's mean span) / A's requests (the activity census tracing every kernel), A loaded alone "
         "after each round of R's phases, random 160M Llama, CUDA graphs, 64 closed-loop clients, 3 s windows, median "
         "of 5 phases (1.059-1.096; per request p50 14.8 % / p90 39.5 % from A's median request, A's own 13.5 % / "
         "39.8 %; eager pairs' mean 8,056 ns against CUPTI's 7,098, graph spans 1.013 of A's); stated bound +-10 %; "
         "measurements §26",
         command=S17_VLLM, date="2026-12-04"),
    Rule("llamacpp_activity_counted_throughput_ratio", "2026-12-03-h200-s10-llama-phases.json",
         phases_ratio("counted"), 0.99,
         "ratio of output tok/s, the activity census (`run --activity on`; the default until 2026-12-04: every kernel launch counted by the driver's launch callback, kernel "
         "records 100 ms of every 1000 ms switched per CUDA context, graphs per launch) / census paused (every activity "
         "kind and every launch callback off), one llama-server (8B, 16 slots) in alternating control-file phases with "
         "prompts of their own, median of 16 rounds (spread 0.899-1.082, geometric mean 0.980 [0.954, 1.005]); "
         "measurements §19",
         command=S10_LLAMA),
    Rule("llamacpp_activity_counted_vs_plain_throughput_ratio", "2026-12-03-h200-s10-llama-phases.json",
         beside_ratio("counted/plain", under=None), 0.99,
         "ratio of output tok/s, the activity census (`run --activity on`, R's counted phases) / a plain llama-server (no census) loaded "
         "after every round of R's phases, 8B, 16 slots, prompts of their own, median of 16 rounds (geometric mean "
         "0.995 [0.963, 1.031]; the paused census / plain 0.991, geometric mean 1.015 [0.976, 1.061])",
         command=S10_LLAMA),
    Rule("vllm_activity_counted_throughput_ratio", "2026-12-03-h200-s11-vllm-phases.json",
         phases_ratio("counted", "phases"), 0.99,
         "ratio of output tok/s, the activity census (`run --activity on`: counted kernels, graphs per launch) / census paused, one vLLM server "
         "(random 160M Llama, CUDA graphs, 64 closed-loop non-streaming clients, vLLM's generated-token counter over "
         "3 s windows) in alternating control-file phases, median of 10 rounds (spread 0.73-1.23, geometric mean 1.013 "
         "[0.916, 1.111]); every-kernel phases 0.891; a paused census is not an untraced vLLM (CUPTI's set-up tax, "
         "vllm_paused_vs_plain_throughput_ratio); measurements §20",
         command=S11_VLLM),
    Rule("vllm_activity_counted_vs_plain_throughput_ratio", "2026-12-03-h200-s11-vllm-phases.json",
         beside_ratio("counted/P@once"), 0.99,
         "ratio of output tok/s, the activity census (`run --activity on`) with the vLLM integration (R's counted phases) / a plain vLLM (P) "
         "loaded at the same time by clients of its own, random 160M Llama, CUDA graphs, 64 closed-loop non-streaming "
         "clients each, each load's rate vLLM's own generated-token counter over a 3 s window, median of 10 rounds "
         "(geometric mean 0.912 [0.834, 0.994]); measurements §20",
         command=S11_VLLM),
    Rule("vllm_paused_vs_plain_throughput_ratio", "2026-12-03-h200-s11-vllm-phases.json",
         beside_ratio("S/P@once:off"), 0.99,
         "ratio of output tok/s, vLLM under a paused census without the integration (S) / a plain vLLM (P), loaded "
         "at the same time as R's paused phases, median of 10 rounds (geometric mean 0.861 [0.789, 0.946]; over all "
         "30 windows of the run 0.894, geometric mean 0.906 [0.859, 0.951]): CUPTI set up and every kind off still "
         "taxes each CUDA call (micro_eager_us_per_launch_cupti_set_up); measurements §20",
         command=S11_VLLM),
    Rule("vllm_calls_vs_plain_throughput_ratio", "2026-12-03-h200-s12-vllm-calls.json",
         beside_ratio("calls/P@once"), 0.99,
         "ratio of output tok/s, a census counting at the calls (OTEL_GPU_CENSUS_ACTIVITY=off, no activity API) with the "
         "vLLM integration (R) / a plain vLLM (P) loaded at the same time, random 160M Llama, CUDA graphs, 64 closed-loop "
         "clients each, 3 s windows, median of 16 rounds (geometric mean 0.863 [0.822, 0.905]; against the paused "
         "activity census S loaded at once 0.987 [0.939, 1.035]): counting through CUPTI's callbacks costs vLLM as "
         "much as its activity API; measurements §21",
         command=S12_VLLM, date="2026-12-03"),
    Rule("vllm_preload_vs_plain_throughput_ratio", "2026-12-03-h200-s13-vllm-preload.json",
         beside_ratio("calls/P@once"), 0.99,
         "ratio of output tok/s, a census counting at the calls by the library preloaded (`run --activity off`: "
         "LD_PRELOAD, CUPTI never loaded) with the vLLM integration (R) / a plain vLLM (P) loaded at the same time, "
         "random 160M Llama, CUDA graphs, 64 closed-loop clients each, 3 s windows, median of 14 rounds (geometric "
         "mean 0.972 [0.934, 1.017]; through CUPTI's callbacks 0.864, §21); counting / R paused 1.02: counting is not what "
         "is left; measurements §22",
         command=S13_VLLM, date="2026-12-03"),
    Rule("vllm_preload_census_only_vs_plain_throughput_ratio", "2026-12-03-h200-s13-vllm-preload-noint.json",
         beside_ratio("calls/P@once"), 0.99,
         "ratio of output tok/s, the census counting at the calls by the library preloaded, the vLLM integration "
         "disabled (R) / a plain vLLM (P) loaded at the same time, same load as vllm_preload_vs_plain_throughput_ratio, "
         "median of 12 rounds (geometric mean 1.024 [0.974, 1.081]): the native census costs vLLM nothing "
         "measurable; measurements §22",
         command=S13_VLLM_NOINT, date="2026-12-03"),
    Rule("vllm_windows_vs_plain_throughput_ratio", "2026-12-03-h200-s14-vllm-windows.json",
         beside_ratio("windows/P@once"), 0.99,
         "ratio of output tok/s, the census counting at the calls by the library preloaded with kernel durations from "
         "CUPTI windows (OTEL_GPU_CENSUS_ACTIVITY=windows, 200 ms of every 5 s, CUPTI never detached) and the vLLM "
         "integration (R) / a plain vLLM (P) loaded at the same time, 64 closed-loop clients each, 3 s windows, median "
         "of 12 rounds (geometric mean 0.861 [0.800, 0.928]; R paused / P 0.844): CUPTI set up at the first window "
         "taxes every launch after it, as a paused census; measurements §23",
         command=S14_VLLM, date="2026-12-03"),
    Rule("vllm_windows_kernel_time_vs_measured_ratio", "2026-12-03-h200-s14-vllm-windows.json",
         reference_ratio("windows"), 1.0,
         "ratio of kernel ns an output token, R's requests under OTEL_GPU_CENSUS_ACTIVITY=windows (estimated: eager "
         "launches x the windows' mean, graph launches x their exec's mean span) / A's requests (the activity census "
         "tracing every kernel, measured) loaded in the same 3 s windows, median of 12 phases (0.984-1.057; per request "
         "p50 11.9 % / p90 35.9 % from A's median request, A's own requests 12.8 % / 35.5 %); stated bound +-10 %; "
         "measurements §23",
         command=S14_VLLM, date="2026-12-03"),
    Rule("vllm_events_vs_plain_throughput_ratio", "2026-12-03-h200-s15-vllm-events.json",
         beside_ratio("events/P@once"), 0.99,
         "ratio of output tok/s, the census counting at the calls by the library preloaded with kernel durations from "
         "CUDA event pairs around 1 of every 128 eager and every graph launch (OTEL_GPU_CENSUS_ACTIVITY=events, no "
         "CUPTI) and the vLLM integration (R) / a plain vLLM (P) loaded at the same time, 64 closed-loop clients each, "
         "3 s windows, median of 8 rounds (0.843-1.093; R paused / P 0.892 in the same rounds, R's events / its own "
         "paused phases 1.021): the event pairs cost nothing measurable, the rest is R's integration; measurements §24",
         command=S15_VLLM, date="2026-12-03"),
    Rule("vllm_events_kernel_time_vs_measured_ratio", "2026-12-03-h200-s15-vllm-events.json",
         reference_ratio("events"), 1.0,
         "ratio of kernel ns an output token, R's requests under OTEL_GPU_CENSUS_ACTIVITY=events (estimated: eager "
         "launches x the event pairs' mean, graph launches x their exec's mean span) / A's requests (the activity census "
         "tracing every kernel, measured) loaded in the same 3 s windows, median of 8 phases (1.170-1.638): graph spans "
         "+5.7 %, eager samples 2.65 times CUPTI's durations; outside the stated +-10 %; measurements §24",
         command=S15_VLLM, date="2026-12-03"),
    Rule("vllm_events_gated_kernel_time_vs_measured_ratio", "2026-12-03-h200-s16-vllm-events-gated.json",
         reference_ratio("events", min_phases=7), 1.0,
         "ratio of kernel ns an output token, R's requests under gated event pairs (eager launches x the pairs' mean, "
         "graph launches x their exec's mean span) / A's requests (the activity census tracing every kernel) loaded "
         "in the same 3 s windows, three vLLM servers on one H200, median of 7 phases (1.595-1.735): graph spans "
         "+1.9 %, eager pairs 2.9 times CUPTI's mean, the other servers' work inside them (R alone on the GPU: "
         "eager pairs 1.26 times A's CUPTI mean, ~1.08 a token against A's); measurements §25",
         command=S16_VLLM, date="2026-12-03"),
    Rule("micro_gated_eager_pair_excess_ns", "2026-12-03-h200-s16-gate-probe.json",
         gate_excess_ns(3000), None,
         "ns a gated eager event pair reads above CUPTI's duration of the same kernel (steady.cu, 20 kernels a ms "
         "spinning 3 us, 1 in 4 eager launches paired, the lead event's pass taken off; 986 ns for empty kernels, "
         "1,076 ns for 20 us ones): the GPU's dispatch of a kernel, which CUPTI's records do not count; measurements "
         "§25",
         command=S16_GATE_PROBE, date="2026-12-03",
         why_no_target="the overhead issue states a bound on per-request kernel time (±10 %), none per pair"),
    Rule("micro_graph_issue_ratio_windows", "2026-12-03-h200-s14-calls-tax.json",
         calls_tax_ratio("windows", "graph_issue_ns"), 0.99,
         "ratio of CUDA-graph replays (64 adds a graph) issued a second by torch's thread, a process under "
         "OTEL_GPU_CENSUS_ACTIVITY=windows (100 ms of every 1 s) / a process without the census, median of 4 rotations "
         "(0.979-0.981; the default 0.904, preloaded without windows 0.999, same rotations); measurements §23",
         command=S14_CALLS_TAX, date="2026-12-03"),
    Rule("micro_graph_issue_ratio_preload", "2026-12-03-h200-s13-preload-tax.json",
         calls_tax_ratio("preload", "graph_issue_ns"), 0.99,
         "ratio of CUDA-graph replays (64 adds a graph) issued a second by torch's thread, a process under the census "
         "preloaded (ACTIVITY=off, no CUPTI) / a process without it, median of 4 rotations of processes side by side "
         "on one core (0.995-1.006; through CUPTI's callbacks 0.648, the default 0.917); measurements §22",
         command=S13_CALLS_TAX, date="2026-12-03"),
    Rule("micro_torch_op_ratio_preload", "2026-12-03-h200-s13-preload-tax.json",
         calls_tax_ratio("preload", "eager_ns"), 0.99,
         "ratio of torch in-place adds a second on the launching thread, a process under the census preloaded "
         "(ACTIVITY=off, no CUPTI) / a process without it, median of 4 rotations (0.76-1.24: the host's noise, its "
         "pure-Python control 0.80-1.48; the default 0.749 in the same rotations); measurements §22",
         command=S13_CALLS_TAX, date="2026-12-03"),
    Rule("micro_torch_op_ratio_calls", "2026-12-03-h200-s12-calls-tax.json",
         calls_tax_ratio("calls", "eager_ns"), 0.99,
         "ratio of torch in-place adds a second on the launching thread (one eager launch each), a process under the "
         "census counting at the calls (OTEL_GPU_CENSUS_ACTIVITY=off) / a process without it, median of 6 rotations "
         "of processes side by side on one core (calls_tax.py); the default census 0.784; measurements §21",
         command=S12_CALLS_TAX, date="2026-12-03"),
    Rule("micro_torch_op_ratio_default", "2026-12-03-h200-s12-calls-tax.json",
         calls_tax_ratio("default", "eager_ns"), 0.99,
         "ratio of torch in-place adds a second on the launching thread, a process under the activity census (the default until 2026-12-04) / a "
         "process without it, median of 6 rotations of processes side by side on one core (calls_tax.py); "
         "measurements §21",
         command=S12_CALLS_TAX, date="2026-12-03"),
    Rule("micro_graph_replay_ratio_default", "2026-12-02-h200-s6-micro-census-attach.json",
         micro_ratio("graph", "census"), 0.99,
         "ratio of CUDA-graph replay throughput (1,000 tiny kernels a graph), the activity census (the default until 2026-12-04; CUPTI set up once "
         "the context is active, graphs per launch, every kernel counted) / plain, median of 5 same-round pairs "
         "(0.9863-0.9907; set up inside cuInit as before: 0.875)"),
    Rule("micro_graph_replay_ratio_census_paused", "2026-12-02-h200-s5-micro-presence.json",
         micro_ratio("graph", "census-paused"), 0.99,
         "ratio of CUDA-graph replay throughput (1,000 tiny kernels a graph), census started paused (CUPTI attached, "
         "no activity kind on) / plain, median of 7 same-round pairs; CUPTI set up inside cuInit, as every census "
         "until 2026-12-02 session 6 (now OTEL_GPU_CENSUS_ATTACH=cuinit)",
         command="BENCH_ARGS='--rounds 7 --workloads graph --variants plain --variant census-disabled census "
                 "OTEL_GPU_CENSUS_DISABLED=1 --variant census-paused-node census OTEL_GPU_CENSUS_START=paused "
                 "OTEL_GPU_CENSUS_GRAPHS=node --variant census-paused census OTEL_GPU_CENSUS_START=paused --variant "
                 "floor-memcpy floor CUPTI_FLOOR_KINDS=memcpy --variant floor-kernel floor CUPTI_FLOOR_KINDS=kernel "
                 "--budget-s 300' bash bench/device/run.sh setup micro"),
    Rule("llamacpp_proxy_throughput_ratio", "2026-12-02-h200-s3-proxy-pairs.json",
         proxy_pair_ratio, 0.99, "ratio of output tok/s, through the proxy / direct (one server), median of 5 pairs",
         command="BENCH_ARGS='--proxy-pairs 5 --budget-s 190' bash bench/device/run.sh setup proxy-pairs"),
    Rule("sidecar_cpu_pct_of_one_core", "2026-12-02-h200-s3-sidecar-cpu.json",
         sidecar_pct, 1.0, "% of one core (8 processes, 1 s interval, NVML and GPM on)",
         command="bash bench/device/run.sh setup sidecar (bench/perf/perf_sidecar_cpu.py --workload cuda "
                 "--seconds 25)", date="2026-12-02"),
    Rule("micro_eager_us_per_launch_default", "2026-12-04-h200-s20-launch-phases.json",
         launch_phases_us("eager_ns"), None,
         "µs the default census (`run`: preloaded, events 128/1, gated, no CUPTI; a launch reads the coarse clock, "
         "4b8f528) adds to the launching thread per eager launch of an empty kernel (launch_price.cu through the CUDA "
         "runtime, 4,269 ns a launch paused): counting it and pairing 1 in 128; one process pinned to a core, the "
         "census switched off/events between rounds, ABBA, median of 40 round pairs (mean 0.121 [-0.051, 0.299]: the "
         "precise clock's 0.185 of §27 is inside it; on the mock driver the coarse clock saves 15-35 ns a launch); "
         "every launch and copy counted exactly; measurements §28",
         command=S20_PHASES, date="2026-12-04",
         why_no_target="the overhead issue sets none per launch; its target is ≥ 0.99 of server throughput"),
    Rule("micro_eager_us_per_launch_default_precise_clock", "2026-12-04-h200-s18-launch-phases.json",
         launch_phases_us("eager_ns"), None,
         "µs the default census as of 1fa6ffc (every launch read CLOCK_MONOTONIC) adds to the launching thread per eager "
         "launch of an empty kernel (launch_price.cu through the CUDA runtime, 4,231 ns a launch paused): counting it and "
         "pairing 1 in 128; one process pinned to a core, the census switched off/events between rounds, ABBA, median of "
         "40 round pairs (mean 0.225 [0.087, 0.366]); every launch and copy counted exactly; measurements §27",
         command=S18_PHASES, date="2026-12-04",
         why_no_target="the overhead issue sets none per launch; its target is ≥ 0.99 of server throughput"),
    Rule("micro_eager_us_per_launch_activity_census", "2026-12-02-h200-s3-kind-cost.json",
         kind_cost_us("graph+kernel"), None,
         "µs CUPTI adds per eager kernel launch with the activity census's kinds (`run --activity on`, the default until "
         "2026-12-04) (kernels, copies, memsets, graph launches), paired against none in one process, median of 21 rounds",
         command="bash bench/device/run.sh setup kind-cost", date="2026-12-02",
         why_no_target="the overhead issue sets none per launch; its target is ≥ 0.99 of server throughput"),
    Rule("micro_graph_us_per_launch_default", "2026-12-04-h200-s20-launch-phases.json",
         launch_phases_us("graph_issue_ns"), None,
         "µs the default census adds to the launching thread per CUDA-graph launch (64 empty kernels; 2,419 ns a launch "
         "paused): counting it and its gated event pair (every graph launch paired); one process, ABBA, median of 40 "
         "round pairs (mean 4.978 [4.555, 5.410]; 5.441 in §27's run); OTEL_GPU_CENSUS_EVENT_EVERY=128/4: 1.953, "
         "ungated: 3.829 (§27); measurements §28",
         command=S20_PHASES, date="2026-12-04",
         why_no_target="the overhead issue sets none per launch; its target is ≥ 0.99 of server throughput"),
    Rule("micro_eager_pair_us_events", "2026-12-04-h200-s18-launch-phases-every.json",
         launch_phases_us("eager_ns"), None,
         "µs one gated eager event pair (three events, a stream wait, the gate's write) adds to the launching thread: "
         "the events census with every launch paired (EVENT_EVERY=1/1), one process, ABBA, median of 30 round pairs "
         "(the default pairs 1 in 128); measurements §27",
         command="LAUNCH_PHASES_ARGS='--rounds 30 --event-every 1/1 --adds 200 --replays 48' bash bench/device/run.sh "
                 "setup launch-phases", date="2026-12-04",
         why_no_target="a price, not a goal: the default pays it on 1 in 128 eager launches"),
    Rule("micro_eager_us_per_launch_launch_callbacks", "2026-12-03-h200-s10-kind-cost.json",
         kind_cost_us("cb-launch"), None,
         "µs CUPTI's callbacks on the kernel launch calls, runtime and driver, add per eager launch (what counting "
         "cost until 2026-12-03: 2 enter and 2 exit callbacks a runtime launch), paired against none in one process, "
         "median of 31 rounds (quartiles -0.087, 0.304: a llama.cpp build ran on the other cores)",
         command=S10_KIND_COST,
         date="2026-12-03",
         why_no_target="the overhead issue sets none per launch; its target is ≥ 0.99 of server throughput"),
    Rule("micro_eager_us_per_launch_driver_callback", "2026-12-03-h200-s10-kind-cost.json",
         kind_cost_us("cb-launch-driver"), None,
         "µs CUPTI's callback on the driver's kernel launch calls alone adds per eager launch (what counting costs "
         "once the runtime's are proven redundant: 1 enter and 1 exit callback a launch), paired against none in one "
         "process, median of 31 rounds (quartiles -0.229, 0.116: not told from zero beside a build)",
         command=S10_KIND_COST,
         date="2026-12-03",
         why_no_target="the overhead issue sets none per launch; its target is ≥ 0.99 of server throughput"),
    Rule("micro_eager_us_per_launch_cupti_set_up", "2026-12-03-h200-s11-kind-cost-pristine.json",
         kind_cost_set_up_us("eager"), None,
         "µs CUPTI adds per eager launch once set up as the census sets it up (activity API and a subscriber), with "
         "nothing enabled: kind_cost's none median (3,957 ns) less its 21 rounds before CUPTI was set up (3,303 ns), "
         "one process, not paired; a paused census and the counted default pay it (measurements §20)",
         command=S11_KIND_COST,
         date="2026-12-03",
         why_no_target="the overhead issue sets none per launch; its target is ≥ 0.99 of server throughput"),
    Rule("micro_graph_us_per_node_default", "2026-12-04-h200-s20-launch-phases.json",
         launch_phases_us("graph_issue_ns", per=64), None,
         "µs the default census adds to the launching thread per CUDA-graph kernel node, for a graph of 64 (its price is "
         "per launch, micro_graph_us_per_launch_default, whatever the graph's size: vLLM's hold ~31 kernels); one "
         "process, ABBA, median of 40 round pairs (0.085 in §27's run); measurements §28",
         command=S20_PHASES, date="2026-12-04",
         why_no_target="the overhead issue sets none per node; its target is ≥ 0.99 of server throughput"),
    Rule("micro_graph_us_per_node_activity_census", "2026-12-02-h200-s6-micro-census-attach.json",
         micro_us_added("graph"), None,
         "µs of GPU time the activity census (`run --activity on`, the default until 2026-12-04) adds per CUDA-graph "
         "kernel node vs plain (CUPTI set up once the context is active; 0.120 set up inside cuInit), median of 5 "
         "same-round pairs",
         why_no_target="the overhead issue sets none per node; its target is ≥ 0.99 of server throughput"),
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
