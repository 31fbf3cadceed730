#!/usr/bin/env python3
"""llama-server under load: plain vs census vs census + proxy, alternating, with bounded cycles.

  python bench/server/run_server_bench.py --server BUILD/cmake/bin/llama-server --model M.gguf \\
         --out DIR [--rounds 5] [--flag-sets default,nocache] [--variants plain,census[,census+proxy]] \\
         [--budget-s 540] [--vocab ggml-vocab-llama-bpe.gguf]   # --vocab: make M.gguf if missing

One cycle = start llama-server (-ngl 99 -np 16 -c 32768 + the flag set), wait for /health, run the
streaming load (bench/server/load.py: 16 clients, 64 requests of ~1,800 prompt tokens and 64 output
tokens), stop it (SIGTERM, bounded wait, then SIGKILL) and, for census variants, read the server's
census segment: device-to-host bytes per request, counted over the load only (a read taken just
before the load is subtracted). Variants alternate in every round (ABBA order), so each round gives
one pair per variant and flag set; rows report medians of the pair ratios.

Flag sets: default (llama-server's own defaults) and nocache (--cache-ram 0 --ctx-checkpoints 0).
Census modes (--census-mode): env sets CUDA_INJECTION64_PATH / OTEL_GPU_CENSUS_DIR itself; run
starts the server under `python -m otel_gpu_census.cli run`; auto picks run when the package
imports. The census+proxy variant puts `otel-gpu-census proxy` in front and loads through it.
A plan with estimated minutes is printed first; no cycle is started that would end past --budget-s.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Dict, List, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
import benchlib as bl  # noqa: E402

FLAG_SETS = {"default": [], "nocache": ["--cache-ram", "0", "--ctx-checkpoints", "0"]}
VARIANTS = ("plain", "census", "census+proxy")


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_health(url: str, proc: subprocess.Popen, timeout_s: float) -> Optional[float]:
    """Seconds until GET url/health answers 200; None if the process died or time ran out."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            return None
        if http_ok(url + "/health"):
            return time.monotonic() - t0
        time.sleep(0.25)
    return None


def server_segments(census_dir: Path) -> Dict[str, Any]:
    """Sum of the census over the folder's segments (the server is the only CUDA process)."""
    seg = bl.read_segments(census_dir)
    if "error" in seg:
        return {"error": seg["error"]}
    procs = [bl.census_summary(p) for p in seg["processes"]]
    dtoh = sum(p["copies"].get("dtoh", {}).get("bytes", 0) for p in procs)
    htod = sum(p["copies"].get("htod", {}).get("bytes", 0) for p in procs)
    return {"processes": procs, "errors": seg["errors"], "dtoh_bytes": dtoh, "htod_bytes": htod,
            "kernels": sum(p["kernels"] for p in procs)}


def log_evidence(path: Path, limit: int = 6) -> List[str]:
    """The server's own lines about its prompt cache and checkpoints (sizes in MiB)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    keys = ("cache state", "prompt cache", "checkpoint", "census")
    return [ln.strip()[:240] for ln in lines if any(k in ln.lower() for k in keys)][-limit:]


class Bench:
    def __init__(self, a: argparse.Namespace, log: bl.Log, work: Path):
        self.a, self.log, self.work = a, log, work
        self.lib = bl.census_lib(a.census_lib)
        self.cycle_no = 0
        self.cycle_s: List[float] = []

    def census_mode(self) -> str:
        if self.a.census_mode != "auto":
            return self.a.census_mode
        pkg, why = bl.import_package()
        return "run" if pkg is not None else "env"

    def pkg_env(self, env: Dict[str, str]) -> Dict[str, str]:
        """Make the package importable for child Pythons (checkout's src/ when not installed)."""
        env = dict(env)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(bl.REPO / "src"), env.get("PYTHONPATH")]))
        env["OTEL_GPU_CENSUS_LIB"] = str(self.lib)
        return env

    def server_cmd(self, port: int, flags: str) -> List[str]:
        a = self.a
        return ([a.server, "-m", a.model, "-ngl", "99", "-np", str(a.np), "-c", str(a.ctx),
                 "--host", "127.0.0.1", "--port", str(port)]
                + FLAG_SETS[flags] + shlex.split(a.server_args))

    def cycle(self, variant: str, flags: str, rnd: int, requests: Optional[int] = None) -> Dict[str, Any]:
        a = self.a
        n = self.cycle_no
        self.cycle_no += 1
        port = a.port + (n % 40) * 2
        url = f"http://127.0.0.1:{port}"
        cdir = self.work / f"census-{n:03d}"
        slog = self.work / f"server-{n:03d}-{variant.replace('+', '_')}-{flags}.log"
        rec: Dict[str, Any] = {"cycle": n, "round": rnd, "variant": variant, "flags": flags, "port": port}
        cmd = self.server_cmd(port, flags)
        censused = variant != "plain"
        if not censused:
            env = bl.plain_env()
        elif rec.setdefault("census_mode", self.census_mode()) == "run":
            cdir.mkdir(parents=True, exist_ok=True, mode=0o700)
            env = self.pkg_env(bl.plain_env())
            cmd = [bl.python(), "-m", "otel_gpu_census.cli", "run", "--dir", str(cdir), "--"] + cmd
        else:
            env = bl.injected_env(self.lib, cdir)
        env.update(dict(kv.split("=", 1) for kv in a.server_env))
        t0 = time.monotonic()
        proxy = None
        with open(slog, "w") as lf:
            lf.write("$ " + " ".join(shlex.quote(c) for c in cmd) + "\n")
            lf.flush()
            try:
                proc = subprocess.Popen(cmd, env=env, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True)
            except OSError as e:
                rec["error"] = f"cannot start server: {e}"
                return rec
            try:
                up = wait_health(url, proc, a.startup_timeout)
                rec["startup_s"] = bl.rnd(up, 2)
                if up is None:
                    rec["error"] = (f"server exited rc={proc.returncode} before /health" if proc.poll() is not None
                                    else f"no /health within {a.startup_timeout} s")
                    return rec
                target = url
                if censused:
                    time.sleep(1.2)  # CUPTI flushes every second: let start-up copies land before the baseline
                    rec["census_before"] = server_segments(cdir)
                if variant == "census+proxy":
                    proxy, target, why = self.start_proxy(port + 1, url, cdir, proc.pid, n)
                    if proxy is None:
                        rec["error"] = why
                        return rec
                import load
                res = load.run_load(target, a.clients, requests or a.requests, a.prompt_tokens, a.n_predict,
                                    seed=1000 * rnd + 1, request_timeout_s=a.request_timeout,
                                    total_timeout_s=a.load_timeout)
                rec["load"] = {k: v for k, v in res.items() if k != "per_request"}
                rec["per_request"] = [{k: r.get(k) for k in ("i", "ttft_s", "e2e_s", "tokens_out", "prompt_n",
                                                              "cache_n", "id_slot", "error")}
                                      for r in res.get("per_request", [])]
            finally:
                if proxy is not None:
                    rec["proxy_stop"] = bl.stop(proxy, grace_s=10)
                rec["stop"] = bl.stop(proc, grace_s=a.stop_timeout)
        rec["cycle_s"] = round(time.monotonic() - t0, 1)
        self.cycle_s.append(rec["cycle_s"])
        rec["server_log"] = slog.name
        rec["log_evidence"] = log_evidence(slog)
        if censused:
            after = server_segments(cdir)
            rec["census_after"] = after
            before = rec.get("census_before", {})
            ok = rec.get("load", {}).get("ok") or 0
            if "error" not in after and not after["processes"]:
                rec["census_note"] = "no census segment: the server never completed a CUDA activity record"
            elif "error" not in after and ok:
                load_dtoh = after["dtoh_bytes"] - before.get("dtoh_bytes", 0)
                rec["d2h_bytes_per_request"] = load_dtoh // ok
                rec["d2h_bytes_per_request_incl_startup"] = after["dtoh_bytes"] // ok
                rec["census_state"] = [p["state"] for p in after["processes"]]
            if not a.keep_segments:
                bl.rm_tree(cdir)
        return rec

    def start_proxy(self, port: int, upstream: str, cdir: Path, server_pid: int, n: int):
        a = self.a
        listen = f"127.0.0.1:{port}"
        cmd = [bl.python(), "-m", "otel_gpu_census.cli", "proxy", "--upstream", upstream, "--listen", listen,
               "--census-dir", str(cdir), "--upstream-pid", str(server_pid)] + shlex.split(a.proxy_args)
        env = self.pkg_env(bl.plain_env())
        env.setdefault("OTEL_TRACES_EXPORTER", a.proxy_traces_exporter)
        env.setdefault("OTEL_METRICS_EXPORTER", "none")
        plog = open(self.work / f"proxy-{n:03d}.log", "w")
        try:
            p = subprocess.Popen(cmd, env=env, stdout=plog, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as e:
            return None, "", f"cannot start proxy: {e}"
        finally:
            plog.close()
        target = f"http://{listen}"
        if wait_health(target, p, 20) is None:
            bl.stop(p, grace_s=5)
            return None, "", f"proxy did not answer /health (see proxy-{n:03d}.log)"
        return p, target, None


def pair_rows(a: argparse.Namespace, runs: List[Dict[str, Any]], variants: List[str]) -> List[Dict[str, Any]]:
    rows = []
    ok = {(r["round"], r["flags"], r["variant"]): r for r in runs
          if r.get("load", {}).get("ok") == r.get("load", {}).get("requests", -1) and "error" not in r}

    def med(rs, key):
        return bl.median(r["load"][key] for r in rs if r["load"].get(key) is not None)

    for flags in a.flag_sets:
        plain_runs = [r for k, r in ok.items() if k[1] == flags and k[2] == "plain"]
        for v in variants:
            mine = [r for k, r in ok.items() if k[1] == flags and k[2] == v]
            row: Dict[str, Any] = {"workload": "server/llama.cpp", "flags": flags, "variant": v,
                                   "unit": "output tok/s", "runs": len(mine),
                                   "failed_runs": sum(1 for r in runs if r["flags"] == flags and r["variant"] == v)
                                   - len(mine)}
            if not mine:
                row["error"] = "no successful run"
                rows.append(row)
                continue
            row.update({
                "census": bl.rnd(med(mine, "output_tok_s"), 2),
                "ttft_p50_s": bl.rnd(med(mine, "ttft_p50_s")), "ttft_p90_s": bl.rnd(med(mine, "ttft_p90_s")),
                "e2e_p50_s": bl.rnd(med(mine, "e2e_p50_s")),
            })
            d2h = [r["d2h_bytes_per_request"] for r in mine if "d2h_bytes_per_request" in r]
            if d2h:
                row["d2h_bytes_per_request"] = int(bl.median(d2h))
                row["d2h_mb_per_request"] = round(bl.median(d2h) / 1e6, 1)
            if plain_runs:
                row["plain"] = bl.rnd(med(plain_runs, "output_tok_s"), 2)
                row["plain_ttft_p50_s"] = bl.rnd(med(plain_runs, "ttft_p50_s"))
                row["plain_ttft_p90_s"] = bl.rnd(med(plain_runs, "ttft_p90_s"))
            if v != "plain":
                ratios = [ok[(rr, flags, v)]["load"]["output_tok_s"] / ok[(rr, flags, "plain")]["load"]["output_tok_s"]
                          for (rr, f, vv) in ok if f == flags and vv == v and (rr, flags, "plain") in ok]
                row["pairs"] = len(ratios)
                row["pair_ratios"] = [bl.rnd(x) for x in ratios]
                row["ratio"] = bl.rnd(bl.median(ratios))
                if ratios:
                    row["target_ratio_ge_0_99"] = bl.median(ratios) >= 0.99
            rows.append(row)
    return rows


def print_table(rows: List[Dict[str, Any]]) -> None:
    print(f"\n{'flags':<9}{'variant':<14}{'tok/s':>9}{'plain':>9}{'ratio':>8}{'pairs':>6}"
          f"{'TTFT p50':>10}{'p90':>8}{'D2H MB/req':>12}")
    for r in rows:
        if "error" in r:
            print(f"{r['flags']:<9}{r['variant']:<14}  {r['error']}")
            continue
        ratio = r.get("ratio")
        print(f"{r['flags']:<9}{r['variant']:<14}{r['census']:>9.1f}{r.get('plain') or 0:>9.1f}"
              f"{'' if ratio is None else f'{ratio:.4f}':>8}{r.get('pairs', ''):>6}"
              f"{r['ttft_p50_s']:>10.3f}{r['ttft_p90_s']:>8.3f}{r.get('d2h_mb_per_request', ''):>12}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", required=True, help="llama-server binary")
    ap.add_argument("--model", required=True, help="GGUF model (made with --vocab when missing)")
    ap.add_argument("--vocab", help="vocab-only GGUF: write a random 8B model to --model if it is missing")
    ap.add_argument("--out", help="results file (.json) or folder (default bench/results)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--flag-sets", default="default,nocache", help="of: " + ",".join(FLAG_SETS))
    ap.add_argument("--variants", default="plain,census", help="of: " + ",".join(VARIANTS))
    ap.add_argument("--census-mode", choices=("auto", "env", "run"), default="auto")
    ap.add_argument("--census-lib", help="default $OTEL_GPU_CENSUS_LIB or native/build/libotel_gpu_census.so")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=1800)
    ap.add_argument("--n-predict", type=int, default=64)
    ap.add_argument("--np", type=int, default=16, help="server slots")
    ap.add_argument("--ctx", type=int, default=32768, help="server context (all slots together)")
    ap.add_argument("--port", type=int, default=18080)
    ap.add_argument("--server-args", default="", help="extra llama-server arguments (one string)")
    ap.add_argument("--server-env", action="append", default=[], metavar="K=V", help="extra server environment")
    ap.add_argument("--proxy-args", default="", help="extra proxy arguments (one string)")
    ap.add_argument("--proxy-traces-exporter", default="none",
                    help="OTEL_TRACES_EXPORTER for the proxy unless set (default none: no collector here)")
    ap.add_argument("--warmup-requests", type=int, default=16, help="a first, unrecorded cycle (0: none)")
    ap.add_argument("--startup-timeout", type=float, default=180)
    ap.add_argument("--load-timeout", type=float, default=180)
    ap.add_argument("--request-timeout", type=float, default=120)
    ap.add_argument("--stop-timeout", type=float, default=30)
    ap.add_argument("--cycle-estimate-s", type=float, default=40, help="first guess of one cycle, for the plan")
    ap.add_argument("--budget-s", type=float, default=540)
    ap.add_argument("--keep-segments", action="store_true")
    a = ap.parse_args()
    a.flag_sets = [f for f in a.flag_sets.split(",") if f]
    variants = [v for v in a.variants.split(",") if v]
    bad = [f for f in a.flag_sets if f not in FLAG_SETS] + [v for v in variants if v not in VARIANTS]
    if bad:
        ap.error(f"unknown flag set or variant: {', '.join(bad)}")
    if "plain" not in variants:
        variants.insert(0, "plain")

    env_info = {"nvidia_smi": bl.nvidia_smi(), "nvcc": bl.nvcc_version(), "python": sys.version.split()[0]}
    out_path = bl.results_path(a.out, env_info["nvidia_smi"].get("gpu"), "server-llamacpp")
    work = out_path.parent / "server-work"
    work.mkdir(parents=True, exist_ok=True)
    log = bl.Log(work / "server-bench.log")
    if not Path(a.server).is_file():
        log(f"no llama-server at {a.server}")
        return 1
    if not Path(a.model).is_file():
        if not a.vocab:
            log(f"no model at {a.model} (give --vocab to make one)")
            return 1
        import make_model
        log(f"writing a random 8B model to {a.model}")
        try:
            info = make_model.write_model(Path(a.model), Path(a.vocab), dict(make_model.PRESETS["8b"], preset="8b"))
        except (OSError, make_model.GGUFError) as e:
            log(f"cannot make the model: {e}")
            return 1
        log(f"model: {info['bytes'] / 1e9:.1f} GB in {info['seconds']} s")
        env_info["model_made"] = info
    b = Bench(a, log, work)
    if any(v != "plain" for v in variants):
        why = bl.ensure_built(b.lib, bl.REPO / "native", log) if b.lib == bl.CENSUS_LIB_DEFAULT.resolve() \
            else (None if b.lib.is_file() else f"{b.lib} does not exist")
        if why:
            log(f"census variants dropped: {why}")
            variants = ["plain"]
    if "census+proxy" in variants:
        d = bl.run([bl.python(), "-m", "otel_gpu_census.cli", "proxy", "--help"], timeout=30,
                   env=b.pkg_env(bl.plain_env()))
        if not d.ok or "--upstream" not in d.out:
            log(f"census+proxy dropped: the proxy is not usable here ({d.tail(300).strip()})")
            variants.remove("census+proxy")
    env_info["census_mode"] = b.census_mode()

    cycles = a.rounds * len(a.flag_sets) * len(variants)
    est = a.cycle_estimate_s
    log(f"plan: {a.rounds} rounds x flag sets {a.flag_sets} x variants {variants} = {cycles} cycles "
        f"(+{'1 warm-up' if a.warmup_requests else 'no warm-up'}), ~{est:.0f} s each: "
        f"~{(cycles + (1 if a.warmup_requests else 0)) * est / 60:.1f} min; budget {a.budget_s:.0f} s; "
        f"census mode {env_info['census_mode']}")
    log(f"server: {shlex.join(b.server_cmd(a.port, a.flag_sets[0]))}")

    runs: List[Dict[str, Any]] = []
    result: Dict[str, Any] = {
        "benchmark": "server/llama.cpp", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(shlex.quote(x) for x in sys.argv), "environment": env_info,
        "config": {k: getattr(a, k) for k in ("rounds", "flag_sets", "clients", "requests", "prompt_tokens",
                                              "n_predict", "np", "ctx", "server_args", "census_mode")},
        "variants": variants, "rows": [], "runs": runs,
    }
    if a.warmup_requests:
        w = b.cycle("plain", a.flag_sets[0], -1, requests=a.warmup_requests)
        result["warmup"] = {k: w.get(k) for k in ("startup_s", "cycle_s", "error", "stop")}
        log(f"warm-up: startup {w.get('startup_s')} s, cycle {w.get('cycle_s')} s {w.get('error', '')}")
    stopped_early = None
    for rnd, order in enumerate(bl.alternating(variants, a.rounds)):
        for flags in a.flag_sets:
            for v in order:
                guess = max(b.cycle_s[-4:] or [est])
                if log.elapsed() + guess * 1.15 > a.budget_s:
                    stopped_early = f"budget: stopped at round {rnd} ({log.elapsed():.0f} s used)"
                    break
                r = b.cycle(v, flags, rnd)
                runs.append(r)
                ld = r.get("load", {})
                log(f"r{rnd} {flags:<8} {v:<13} " + (f"ERROR {r['error']}" if "error" in r else
                    f"{ld.get('output_tok_s')} tok/s ok={ld.get('ok')}/{ld.get('requests')} "
                    f"ttft p50={ld.get('ttft_p50_s')} p90={ld.get('ttft_p90_s')} startup={r.get('startup_s')}s "
                    f"stop={r.get('stop', {}).get('how')} {r.get('stop', {}).get('stop_s')}s cycle={r.get('cycle_s')}s"
                    + (f" D2H/req={r['d2h_bytes_per_request'] / 1e6:.1f}MB" if "d2h_bytes_per_request" in r else "")))
                result["rows"] = pair_rows(a, runs, variants)
                bl.write_json(out_path, result)
            if stopped_early:
                break
        if stopped_early:
            log(stopped_early)
            break
    result["stopped_early"] = stopped_early
    result["rows"] = pair_rows(a, runs, variants)
    result["hangs"] = sum(1 for r in runs if r.get("stop", {}).get("hang"))
    bl.write_json(out_path, result)
    print_table(result["rows"])
    print(f"\ncycles: {len(runs)}, failed: {sum(1 for r in runs if 'error' in r)}, hangs: {result['hangs']}; "
          f"results: {out_path}; logs: {work}")
    return 0 if runs and not any("error" in r for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
