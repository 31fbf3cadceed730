#!/usr/bin/env python3
"""Launch-bound microbenchmarks: what CUPTI and the census add per kernel launch.

Workloads (PyTorch, one CUDA device):
  eager  N tiny in-place adds on a 1-element tensor, one kernel launch each;
  graph  a CUDA graph of NODES tiny adds, replayed R times (one kernel record per node).

Variants, each a fresh child process, alternating within every round (ABBA order):
  plain   no injector;
  floor   bench/floor/libcupti_floor.so: the same CUPTI activity kinds, records discarded;
  census  native/build/libotel_gpu_census.so, segment in a fresh folder per run.

  python bench/micro.py --out DIR_OR_FILE.json [--rounds 5] [--budget-s 420]

Writes rows {workload, variant, plain, census, ratio, ...} (``census`` is the throughput of the
row's variant, ``ratio`` = that / plain, medians over same-round pairs) plus the environment, and
prints a table. Per launch it reports the µs added against plain, and for the census its cost above
the floor: ``above_floor_pct`` (census time / floor time - 1, the target is <= 10%) and
``overhead_vs_floor`` (the census's added µs / the floor's added µs).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402

WORKLOADS = ("eager", "graph")


# ---- child: the workload itself ---------------------------------------------------------------

def _loaded_cupti() -> Dict[str, Any]:
    """Which libcupti this process mapped, and its API version (None when none is loaded)."""
    import ctypes
    try:
        paths = {line.split()[-1] for line in open("/proc/self/maps") if "libcupti" in line}
    except OSError:
        paths = set()
    info: Dict[str, Any] = {"libcupti": sorted(paths) or None}
    for p in sorted(paths):
        try:
            v = ctypes.c_uint32()
            if ctypes.CDLL(p).cuptiGetVersion(ctypes.byref(v)) == 0:
                info["cupti_api_version"] = v.value
        except (OSError, AttributeError):
            pass
    return info


def switch_census(mode: str, timeout_s: float = 15.0) -> bool:
    """Switch this process's census through its control file (bench/server/control_phases.py) and wait
    until its segment shows the mode. A census started paused makes its segment at its flusher's first
    round, so there may be none yet: retried until timeout_s."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "server"))
    from control_phases import Phases
    phases = Phases(os.environ["OTEL_GPU_CENSUS_DIR"])
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        if phases.set(mode, timeout=timeout_s):
            return True
        time.sleep(0.2)
    return False


def wait_census(timeout_s: float = 10.0) -> Optional[float]:
    """Under the precise collector CUPTI is set up once this process's context exists: wait for it before the
    capture, so the census learns the graph it will count.
    Seconds waited; None without a census (plain, the floor)."""
    import ctypes
    path = os.environ.get("CUDA_INJECTION64_PATH")
    if not path:
        return None
    try:
        active = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_NOW).gc_active
    except (OSError, AttributeError):
        return None
    t0 = time.perf_counter()
    while not active() and time.perf_counter() - t0 < timeout_s:
        time.sleep(0.0005)
    return round(time.perf_counter() - t0, 6)


def child(a: argparse.Namespace) -> None:
    """Warm-up and graph capture first, then (MICRO_CENSUS_SWITCH=off|events|...) the census switched,
    then the timed loops: a graph is instantiated in one census state and replayed in another (CUPTI
    decides what it records of a graph when the graph is instantiated)."""
    t_import = time.perf_counter()
    import torch
    x = torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    res: Dict[str, Any] = {"init_s": time.perf_counter() - t_import, "launches": {}}
    res["census_wait_s"] = wait_census()
    adds = 0
    if "eager" in a.workloads:
        for _ in range(a.warmup):
            x.add_(1)
        torch.cuda.synchronize()
        adds += a.warmup
    g = None

    def capture() -> None:
        nonlocal g, adds
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                x.add_(1)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(a.graph_nodes):
                x.add_(1)
        g.replay()
        torch.cuda.synchronize()
        adds += 3 + a.graph_nodes

    if "graph" in a.workloads:
        capture()
    if os.environ.get("MICRO_CENSUS_SWITCH"):
        sw = os.environ["MICRO_CENSUS_SWITCH"]
        res["census_switched"] = {sw: switch_census(sw)}
    torch.cuda.synchronize()
    if "eager" in a.workloads:
        times = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            for _ in range(a.eager_n):
                x.add_(1)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        adds += a.eager_n * a.reps
        res["adds_eager"] = a.warmup + a.eager_n * a.reps
        res["eager_s"] = times
        res["launches"]["eager"] = a.eager_n
    if "graph" in a.workloads:
        times = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            for _ in range(a.graph_replays):
                g.replay()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        adds += a.graph_nodes * a.graph_replays * a.reps
        res["graph_launches_executed"] = 1 + a.graph_replays * a.reps
        res["graph_s"] = times
        res["launches"]["graph"] = a.graph_nodes * a.graph_replays
    res["adds_executed"] = adds
    res.setdefault("adds_eager", 0)
    res.setdefault("graph_launches_executed", 0)
    res["value_ok"] = float(x.item()) == float(adds)
    res["env"] = {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
                  "device": torch.cuda.get_device_name(0), **_loaded_cupti()}
    print("MICRO_RESULT " + json.dumps(res), flush=True)


# ---- parent: variants, rounds, statistics ----------------------------------------------------

def parse_variants(a: argparse.Namespace, log: bl.Log) -> Dict[str, Dict[str, Any]]:
    """name -> {base, env}. Extra variants: --variant NAME BASE K=V ..."""
    graph_kinds = a.floor_kinds + ",graph"
    known = {"plain": {"base": "plain", "env": {}}, "floor": {"base": "floor", "env": {}},
             "census": {"base": "census", "env": {}},
             # the lighter mode: one record per graph launch (GRAPH_TRACE) instead of one per node
             "floor-graph": {"base": "floor", "env": {"CUPTI_FLOOR_KINDS": graph_kinds}},
             "census-graph": {"base": "census", "env": {"OTEL_GPU_CENSUS_GRAPHS": "launch"}}}
    floors = {"census-graph": "floor-graph"}   # the floor each census variant is set against
    out = {}
    for name in a.variants.split(","):
        if name in known:
            out[name] = dict(known[name], floor=floors.get(name, "floor"))
        elif name:
            log(f"unknown variant {name!r} ignored (define it with --variant)")
    for spec in a.variant or []:
        name, base, *kvs = spec
        if base not in known:
            log(f"--variant {name}: base must be plain, floor or census, not {base!r}; ignored")
            continue
        env = dict(kv.split("=", 1) for kv in kvs if "=" in kv)
        out[name] = {"base": base, "env": env, "floor": "floor"}
    if "plain" not in out:
        out = {"plain": dict(known["plain"], floor="floor"), **out}
    return out


def run_child(a: argparse.Namespace, variant: Dict[str, Any], census_dir: Path, log_path: Path) -> Dict[str, Any]:
    cmd = [bl.python(), str(Path(__file__).resolve()), "--child", "--workloads", ",".join(a.workloads),
           "--eager-n", str(a.eager_n), "--reps", str(a.reps), "--warmup", str(a.warmup),
           "--graph-nodes", str(a.graph_nodes), "--graph-replays", str(a.graph_replays)]
    base = variant["base"]
    if base == "plain":
        env = bl.plain_env()
    elif base == "floor":
        env = bl.injected_env(Path(a.floor_lib), None, CUPTI_FLOOR_KINDS=a.floor_kinds)
        env.pop("OTEL_GPU_CENSUS_DIR", None)
    else:
        env = bl.injected_env(bl.census_lib(a.census_lib), census_dir)
    env.update(variant["env"])
    d = bl.run(cmd, timeout=a.child_timeout, env=env, log_path=log_path)
    row: Dict[str, Any] = {"rc": d.rc, "process_s": round(d.wall_s, 3), "timed_out": d.timed_out}
    line = next((ln for ln in reversed(d.out.splitlines()) if ln.startswith("MICRO_RESULT ")), None)
    if line is None:
        row["error"] = d.tail(600) or "no result line"
        return row
    res = json.loads(line[len("MICRO_RESULT "):])
    row.update(res)
    row["injector_log"] = [ln for ln in d.err.splitlines() if "cupti_floor" in ln or "census" in ln.lower()][-4:]
    if base == "census":
        seg = bl.read_segments(census_dir)
        if "error" in seg:
            row["census"] = {"error": seg["error"]}
        else:
            mine = [bl.census_summary(p) for p in seg["processes"]]
            row["census"] = {"segments": mine, "errors": seg["errors"]}
            kernels = sum(m["kernels"] for m in mine)
            launches = sum(m["graph_launches"] for m in mine)
            # Every add_ is a kernel (torch's init adds a few more): fewer means records were lost.
            # Per-launch graph mode counts graph launches instead of the kernels inside them.
            row["census_kernels"] = kernels
            if variant["env"].get("OTEL_GPU_CENSUS_GRAPHS") == "launch":
                row["census_kernels_ok"] = (kernels >= res["adds_eager"]
                                            and launches >= res["graph_launches_executed"])
            else:
                row["census_kernels_ok"] = kernels >= res["adds_executed"]
        bl.rm_tree(census_dir)
    return row


def summarise(a: argparse.Namespace, runs: List[Dict[str, Any]], variants: Dict[str, Any]) -> List[Dict[str, Any]]:
    rows = []
    by = {(r["round"], r["variant"]): r for r in runs if r.get("launches")}

    def t(r: Optional[Dict[str, Any]], w: str) -> Optional[float]:
        return bl.median(r[f"{w}_s"]) if r and f"{w}_s" in r else None

    for w in a.workloads:
        launches = a.eager_n if w == "eager" else a.graph_nodes * a.graph_replays
        rounds = sorted({r["round"] for r in runs})
        plain_t = [t(by.get((k, "plain")), w) for k in rounds]
        for name in variants:
            if name == "plain":
                continue
            ref = variants[name].get("floor", "floor")   # census-graph is compared with floor-graph
            pairs = [(p, t(by.get((k, name)), w), t(by.get((k, ref)), w))
                     for k, p in zip(rounds, plain_t)]
            pairs = [x for x in pairs if x[0] is not None and x[1] is not None]
            if not pairs:
                rows.append({"workload": f"micro/{w}", "variant": name, "error": "no complete pairs"})
                continue
            p_med = bl.median(p for p, _, _ in pairs)
            v_med = bl.median(v for _, v, _ in pairs)
            row = {
                "workload": f"micro/{w}", "variant": name, "unit": "launches/s",
                "plain": round(launches / p_med), "census": round(launches / v_med),
                "ratio": bl.rnd(bl.median(p / v for p, v, _ in pairs)),
                "us_added_per_launch": bl.rnd(bl.median((v - p) / launches * 1e6 for p, v, _ in pairs), 3),
                "plain_s": bl.rnd(p_med), "variant_s": bl.rnd(v_med), "pairs": len(pairs),
                "launches": launches,
                "pair_ratios": [bl.rnd(p / v) for p, v, _ in pairs],
            }
            triples = [(p, v, f) for p, v, f in pairs if f is not None]
            if variants[name]["base"] == "census" and triples:
                above = bl.median((v / f - 1) * 100 for _, v, f in triples)
                f_added = bl.median((f - p) for p, _, f in triples)
                v_added = bl.median((v - p) for p, v, _ in triples)
                row["floor_variant"] = ref
                row["above_floor_pct"] = bl.rnd(above, 2)
                row["floor_us_added_per_launch"] = bl.rnd(f_added / launches * 1e6, 3)
                row["overhead_vs_floor"] = bl.rnd(v_added / f_added, 3) if f_added > 0 else None
                row["target_above_floor_le_10pct"] = above <= 10.0
            rows.append(row)
    return rows


def print_table(rows: List[Dict[str, Any]]) -> None:
    print(f"\n{'workload':<14}{'variant':<20}{'plain/s':>12}{'variant/s':>12}{'ratio':>8}"
          f"{'us/launch':>11}{'>floor %':>10}{'pairs':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['workload']:<14}{r['variant']:<20}  {r['error']}")
            continue
        af = r.get("above_floor_pct")
        print(f"{r['workload']:<14}{r['variant']:<20}{r['plain']:>12,}{r['census']:>12,}{r['ratio']:>8.4f}"
              f"{r['us_added_per_launch']:>11.3f}{'' if af is None else f'{af:.2f}':>10}{r['pairs']:>7}")


def estimate_child_s(a: argparse.Namespace) -> float:
    s = 6.0  # torch import, CUDA init, exit
    if "eager" in a.workloads:
        s += (a.eager_n * a.reps + a.warmup) * 9e-6
    if "graph" in a.workloads:
        s += a.graph_nodes * a.graph_replays * a.reps * 1.3e-6 + 0.5
    return s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="results file (.json) or folder (default bench/results)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants", default="plain,floor,census,floor-graph,census-graph",
                    help="of plain, floor, census, floor-graph, census-graph (GRAPH_TRACE: one record "
                         "per graph launch) and names given with --variant")
    ap.add_argument("--variant", nargs="+", action="append", metavar="NAME BASE K=V",
                    help="extra variant: name, base (plain|floor|census), env settings; repeatable")
    ap.add_argument("--workloads", default="eager,graph")
    ap.add_argument("--eager-n", type=int, default=200_000)
    ap.add_argument("--warmup", type=int, default=2_000)
    ap.add_argument("--reps", type=int, default=1, help="timed repetitions inside each child (median)")
    ap.add_argument("--graph-nodes", type=int, default=1000)
    ap.add_argument("--graph-replays", type=int, default=200)
    ap.add_argument("--census-lib", help="default $OTEL_GPU_CENSUS_LIB or native/build/libotel_gpu_census.so")
    ap.add_argument("--floor-lib", default=str(bl.FLOOR_LIB_DEFAULT))
    ap.add_argument("--floor-kinds", default="kernel,memcpy,memcpy2,memset,extcorr")
    ap.add_argument("--child-timeout", type=float, default=120)
    ap.add_argument("--budget-s", type=float, default=480, help="start no round that would end past this")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.workloads = [w for w in a.workloads.split(",") if w in WORKLOADS]
    if a.child:
        child(a)
        return 0

    out_path = bl.results_path(a.out, None, "micro")  # renamed below once the GPU is known
    work = out_path.parent / "micro-work"
    work.mkdir(parents=True, exist_ok=True)
    log = bl.Log(work / "micro.log")
    variants = parse_variants(a, log)
    env = {"nvidia_smi": bl.nvidia_smi(), "nvcc": bl.nvcc_version(), "python": sys.version.split()[0]}
    gpu = env["nvidia_smi"].get("gpu")
    if not (a.out and a.out.endswith(".json")):
        out_path = bl.results_path(a.out, gpu, "micro")

    for name, v in variants.items():
        if v["base"] == "floor":
            why = bl.ensure_built(Path(a.floor_lib), bl.BENCH_DIR / "floor", log)
            if why:
                log(f"variant {name} dropped: {why}")
                variants[name] = None
        if v["base"] == "census":
            lib = bl.census_lib(a.census_lib)
            why = bl.ensure_built(lib, bl.REPO / "native", log) if lib == bl.CENSUS_LIB_DEFAULT.resolve() \
                else (None if lib.is_file() else f"{lib} does not exist")
            if why:
                log(f"variant {name} dropped: {why}")
                variants[name] = None
    variants = {k: v for k, v in variants.items() if v}

    per_child = estimate_child_s(a)
    per_round = per_child * len(variants)
    log(f"plan: {a.rounds} rounds x {list(variants)} x workloads {a.workloads}; "
        f"~{per_child:.0f} s per child, ~{per_round * a.rounds / 60:.1f} min total; budget {a.budget_s:.0f} s")
    log(f"GPU: {gpu}; output: {out_path}")

    runs: List[Dict[str, Any]] = []
    result: Dict[str, Any] = {
        "benchmark": "micro", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(shlex.quote(x) for x in sys.argv), "environment": env,
        "config": {k: getattr(a, k) for k in ("rounds", "workloads", "eager_n", "warmup", "reps",
                                              "graph_nodes", "graph_replays", "floor_kinds")},
        "variants": variants, "rows": [], "runs": runs,
    }
    rounds_done = 0
    for k, order in enumerate(bl.alternating(list(variants), a.rounds)):
        if k:   # measured rounds replace the estimate
            per_round = log.elapsed() / k
        if log.elapsed() + per_round * (1.3 if k == 0 else 1.1) > a.budget_s:
            log(f"budget: stopping before round {k} ({log.elapsed():.0f} s used)")
            break
        for name in order:
            row = run_child(a, variants[name], work / f"census-{k}-{name}", work / "children.log")
            row.update(round=k, variant=name)
            runs.append(row)
            msg = " ".join(f"{w}={bl.median(row[f'{w}_s']):.4f}s" for w in a.workloads if f"{w}_s" in row)
            log(f"round {k} {name:<10} {msg or 'FAILED: ' + str(row.get('error', ''))[-300:]}"
                f" process={row['process_s']:.1f}s"
                + (f" census_kernels_ok={row.get('census_kernels_ok')}" if "census" in row else ""))
        rounds_done = k + 1
        if not env.get("child") and runs and runs[0].get("env"):
            env["child"] = runs[0]["env"]
        result["rows"] = summarise(a, runs, variants)
        result["rounds_done"] = rounds_done
        bl.write_json(out_path, result)   # after every round: a later failure keeps what ran
    result["rows"] = summarise(a, runs, variants)
    result["rounds_done"] = rounds_done
    result["process_s_median"] = {n: bl.median(r["process_s"] for r in runs if r["variant"] == n and r.get("rc") == 0)
                                  for n in variants}
    bl.write_json(out_path, result)
    print_table(result["rows"])
    print("\nprocess wall time (start to exit), median: "
          + ", ".join(f"{n} {s:.2f}s" for n, s in result["process_s_median"].items() if s))
    print(f"rounds done: {rounds_done}/{a.rounds}; results: {out_path}")
    ok = rounds_done > 0 and all("error" not in r for r in result["rows"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
