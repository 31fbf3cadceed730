#!/usr/bin/env python3
"""llama-server under load: plain vs census variants vs census + proxy, alternating, bounded cycles.

  python bench/server/run_server_bench.py --server BUILD/cmake/bin/llama-server --model M.gguf \\
         --out DIR [--rounds 5] [--flag-sets default,nocache] [--variants plain,census[,...]] \\
         [--budget-s 540] [--vocab ggml-vocab-llama-bpe.gguf]   # --vocab: make M.gguf if missing
  python bench/server/run_server_bench.py ... --proxy-pairs 8 [--flag-sets nocache]   # one server
  any mode: [--load-mode waves [--wave-gap-s 0]]   # requests in waves of --clients (default: free)

Restart mode (default). One cycle = start llama-server (-ngl 99 -np 16 -c 32768 + the flag set),
wait for /health, run the streaming load (bench/server/load.py: 16 clients, 64 requests of ~1,800
prompt tokens and 64 output tokens), stop it (SIGTERM, bounded wait, then SIGKILL) and, for census
variants, read the server's census segment: device-to-host bytes per request, counted over the load
only (a read taken just before the load is subtracted). Variants alternate in every round (ABBA
order), so each round gives one pair per variant and flag set; rows report medians of the pair
ratios. The census is injected at process start, so census vs plain needs a fresh server per cycle.

Variants (the environment each adds is recorded in the results, `variant_env`):
  plain               no census;
  census              the injector in its default mode;
  census+proxy        census, loaded through `otel-gpu-census proxy` in front of the server.

Same-server proxy mode (--proxy-pairs N): ONE llama-server under the census (--proxy-census picks
the variant) with the proxy in front, warmed up, then N pairs of loads alternating direct and
through the proxy (ABBA) on that server, --gap-s apart. Server start-up variance is gone from the
pairs; the row's plain is direct, census is through the proxy, ratio the median proxy/direct pair
ratio (the proxy's cost: target at most 1 % lower). Defaults: 48 requests a load (3 per client),
about 9 s on the random 8B model on an H200: 8 pairs in about 3 minutes.

Every load reports two throughputs (bench/server/load.py): whole-load output tok/s, the headline
that `ratio` uses, and steady-state tok/s (tokens that arrived while every client was busy: ramp-up
and tail left out), with its own `steady_ratio`; rows also give the spread of both, so the quieter
figure can be chosen from the data.

Load shape (--load-mode, all modes): free (default) is load.py's closed loop, each client sending its
next request when its last one ends, which the server batches differently every load (CV ~4 % between
loads on one H200 server). waves sends the requests in waves of --clients that start together, each
wave after every request of the previous one ended (+ --wave-gap-s): every wave is the same batch.
A waves load's tok/s is output tokens / the sum of its wave walls; rows carry the CV across waves of
every load (`wave_tok_s_cvs`, median `wave_tok_s_cv`). --requests must be a multiple of --clients.

Flag sets: default (llama-server's own defaults) and nocache (--cache-ram 0 --ctx-checkpoints 0).
Census modes (--census-mode): env sets CUDA_INJECTION64_PATH / OTEL_GPU_CENSUS_DIR itself; run
starts the server under `python -m otel_gpu_census.cli run`; auto picks run when the package
imports. A plan with estimated minutes is printed first; no cycle (or pair) is started that would
end past --budget-s.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
import benchlib as bl  # noqa: E402
import load  # noqa: E402

FLAG_SETS = {"default": [], "nocache": ["--cache-ram", "0", "--ctx-checkpoints", "0"]}
VARIANTS = ("plain", "census", "census+proxy")
# prompt_ms / predicted_ms: llama-server's own timings of the request (bench/perf/proxy_steps.py tells a
# slower server from a slower path to the client with them)
PER_REQUEST_KEYS = ("i", "client", "wave", "start", "end", "ttft_s", "e2e_s", "tokens_out", "prompt_n",
                    "cache_n", "id_slot", "prompt_ms", "predicted_ms", "error", "ev")


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


def load_record(res: Dict[str, Any]) -> Tuple[Dict[str, Any], List[Dict[str, Any]]]:
    """A load's summary and its compact per-request list (token event times included)."""
    def short(v: Any) -> Any:
        return round(v, 4) if isinstance(v, float) else v
    return ({k: v for k, v in res.items() if k != "per_request"},
            [{k: short(r.get(k)) for k in PER_REQUEST_KEYS if k in r} for r in res.get("per_request", [])])


def complete(ld: Optional[Dict[str, Any]]) -> bool:
    return bool(ld) and ld.get("ok") == ld.get("requests") and bool(ld.get("output_tok_s"))


class Bench:
    def __init__(self, a: argparse.Namespace, log: bl.Log, work: Path):
        self.a, self.log, self.work = a, log, work
        self.lib = bl.census_lib(a.census_lib)
        self.cycle_no = 0
        self.cycle_s: List[float] = []
        self.server_env = dict(kv.split("=", 1) for kv in a.server_env)

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

    def env_of(self, variant: str) -> Dict[str, str]:
        """The environment a variant's server gets on top of the injector's own variables."""
        return dict(self.server_env)

    def server_cmd(self, port: int, flags: str) -> List[str]:
        a = self.a
        return ([a.server, "-m", a.model, "-ngl", "99", "-np", str(a.np), "-c", str(a.ctx),
                 "--host", "127.0.0.1", "--port", str(port)]
                + FLAG_SETS[flags] + shlex.split(a.server_args))

    def launch(self, variant: str, flags: str, n: int, rec: Dict[str, Any]
               ) -> Optional[Tuple[subprocess.Popen, str, Path]]:
        """Start llama-server for a variant and wait for /health; for census variants, take the
        baseline read. Returns (process, url, census folder), or None with rec["error"] set (the
        process, if any, already stopped)."""
        a = self.a
        port = a.port + (n % 40) * 2
        url = f"http://127.0.0.1:{port}"
        cdir = self.work / f"census-{n:03d}"
        slog = self.work / f"server-{n:03d}-{variant.replace('+', '_')}-{flags}.log"
        rec.update(port=port, server_log=slog.name)
        cmd = self.server_cmd(port, flags)
        if variant == "plain":
            env = bl.plain_env()
        elif rec.setdefault("census_mode", self.census_mode()) == "run":
            cdir.mkdir(parents=True, exist_ok=True, mode=0o700)
            env = self.pkg_env(bl.plain_env())
            cmd = [bl.python(), "-m", "otel_gpu_census.cli", "run", "--dir", str(cdir), "--"] + cmd
        else:
            env = bl.injected_env(self.lib, cdir)
        rec["env"] = self.env_of(variant)
        env.update(rec["env"])
        with open(slog, "w") as lf:
            lf.write("$ " + " ".join(shlex.quote(c) for c in cmd) + "\n")
            lf.flush()
            try:
                proc = subprocess.Popen(cmd, env=env, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True)
            except OSError as e:
                rec["error"] = f"cannot start server: {e}"
                return None
        up = wait_health(url, proc, a.startup_timeout)
        rec["startup_s"] = bl.rnd(up, 2)
        if up is None:
            rec["error"] = (f"server exited rc={proc.returncode} before /health" if proc.poll() is not None
                            else f"no /health within {a.startup_timeout} s")
            rec["stop"] = bl.stop(proc, grace_s=a.stop_timeout)
            return None
        if variant != "plain":
            time.sleep(1.2)  # CUPTI flushes every second: let start-up copies land before the baseline
            rec["census_before"] = server_segments(cdir)
        return proc, url, cdir

    def census_after(self, rec: Dict[str, Any], cdir: Path, requests_ok: int) -> None:
        """Device-to-host bytes per request over the loads (the baseline read subtracted)."""
        after = server_segments(cdir)
        rec["census_after"] = after
        before = rec.get("census_before", {})
        if "error" not in after and not after["processes"]:
            rec["census_note"] = "no census segment: the server never completed a CUDA activity record"
        elif "error" not in after and requests_ok:
            rec["d2h_bytes_per_request"] = (after["dtoh_bytes"] - before.get("dtoh_bytes", 0)) // requests_ok
            rec["d2h_bytes_per_request_incl_startup"] = after["dtoh_bytes"] // requests_ok
            rec["census_state"] = [p["state"] for p in after["processes"]]
        if not self.a.keep_segments:
            bl.rm_tree(cdir)

    def run_load(self, target: str, seed: int, requests: Optional[int] = None) -> Dict[str, Any]:
        a = self.a
        return load.run_load(target, a.clients, requests or a.requests, a.prompt_tokens, a.n_predict,
                             seed=seed, request_timeout_s=a.request_timeout, total_timeout_s=a.load_timeout,
                             waves=a.load_mode == "waves", wave_gap_s=a.wave_gap_s)

    def cycle(self, variant: str, flags: str, rnd: int, requests: Optional[int] = None) -> Dict[str, Any]:
        """Restart mode: a fresh server, one load, stop."""
        a = self.a
        n = self.cycle_no
        self.cycle_no += 1
        rec: Dict[str, Any] = {"cycle": n, "round": rnd, "variant": variant, "flags": flags}
        t0 = time.monotonic()
        srv = self.launch(variant, flags, n, rec)
        if srv is None:
            return rec
        proc, url, cdir = srv
        proxy = None
        try:
            target = url
            if variant == "census+proxy":
                proxy, target, why = self.start_proxy(rec["port"] + 1, url, cdir, proc.pid, n)
                if proxy is None:
                    rec["error"] = why
                    return rec
            rec["load"], rec["per_request"] = load_record(self.run_load(target, 1000 * rnd + 1, requests))
        finally:
            if proxy is not None:
                rec["proxy_stop"] = bl.stop(proxy, grace_s=10)
            rec["stop"] = bl.stop(proc, grace_s=a.stop_timeout)
        rec["cycle_s"] = round(time.monotonic() - t0, 1)
        self.cycle_s.append(rec["cycle_s"])
        rec["log_evidence"] = log_evidence(self.work / rec["server_log"])
        if variant != "plain":
            self.census_after(rec, cdir, rec.get("load", {}).get("ok") or 0)
        return rec

    def proxy_session(self, flags: str, pairs: int, on_pair: Callable[[Dict[str, Any]], None]) -> Dict[str, Any]:
        """Same-server mode: one censused server, the proxy in front, loads alternating direct and
        through the proxy (ABBA), --gap-s apart, until `pairs` pairs or the budget."""
        a, log = self.a, self.log
        n = self.cycle_no
        self.cycle_no += 1
        rec: Dict[str, Any] = {"session": n, "flags": flags, "variant": "census+proxy",
                               "server_variant": a.proxy_census, "loads": []}
        t0 = time.monotonic()
        srv = self.launch(a.proxy_census, flags, n, rec)
        if srv is None:
            return rec
        proc, url, cdir = srv
        proxy = None
        ok_requests = 0
        try:
            proxy, purl, why = self.start_proxy(rec["port"] + 1, url, cdir, proc.pid, n)
            if proxy is None:
                rec["error"] = why
                return rec
            targets = {"direct": url, "proxy": purl}
            if a.warmup_requests:   # server (first batches, graphs) and proxy (imports, connections)
                w = self.run_load(purl, 7, a.warmup_requests)
                ok_requests += w.get("ok") or 0
                rec["warmup"] = {k: w.get(k) for k in ("ok", "requests", "wall_s", "output_tok_s", "first_errors")}
                log(f"warm-up through the proxy: {w.get('ok')}/{w.get('requests')} ok, {w.get('wall_s')} s")
            walls: List[float] = []
            for k in range(pairs):
                if proc.poll() is not None:
                    rec["error"] = f"server exited (rc={proc.returncode}) after {k} pairs"
                    break
                guess = (max(walls[-4:]) if walls else a.load_estimate_s) + a.gap_s
                if log.elapsed() + 2 * guess * 1.1 + a.stop_timeout / 3 > a.budget_s:
                    rec["stopped_early"] = f"budget: {k} pairs done ({log.elapsed():.0f} s used)"
                    log(rec["stopped_early"])
                    break
                for via in (("direct", "proxy") if k % 2 == 0 else ("proxy", "direct")):
                    loop_lag(purl, a)             # the proxy's lag probe: a new period for this load
                    res = self.run_load(targets[via], 1000 * (k + 1) + (via == "proxy"))
                    summary, per_request = load_record(res)
                    ok_requests += summary.get("ok") or 0
                    rec["loads"].append({"pair": k, "via": via, "load": summary, "per_request": per_request})
                    lag = loop_lag(purl, a)
                    if lag is not None:
                        rec["loads"][-1]["loop_lag"] = lag
                        log(f"pair {k} {via}: proxy event-loop lag p50 {lag.get('p50_ms')} ms, p99 "
                            f"{lag.get('p99_ms')} ms, max {lag.get('max_ms')} ms, {lag.get('over_20ms')} of "
                            f"{lag.get('wakeups')} wake-ups >= 20 ms late")
                    walls.append(summary.get("wall_s") or a.load_estimate_s)
                    time.sleep(a.gap_s)   # the proxy's spans settle (~1 s) before the next load starts
                d, p = (next(x["load"] for x in rec["loads"] if x["pair"] == k and x["via"] == v)
                        for v in ("direct", "proxy"))
                ratio = (p["output_tok_s"] / d["output_tok_s"]) if complete(d) and complete(p) else None
                log(f"pair {k} {flags}: direct {d.get('output_tok_s')} tok/s (steady {d.get('steady_tok_s')}), "
                    f"proxy {p.get('output_tok_s')} (steady {p.get('steady_tok_s')}), "
                    f"ratio {'-' if ratio is None else f'{ratio:.4f}'}; TTFT p50 {d.get('ttft_p50_s')} -> "
                    f"{p.get('ttft_p50_s')} s, p90 {d.get('ttft_p90_s')} -> {p.get('ttft_p90_s')} s"
                    + wave_note(d, p))
                on_pair(rec)
        finally:
            if proxy is not None:
                rec["proxy_stop"] = bl.stop(proxy, grace_s=10)
            rec["stop"] = bl.stop(proc, grace_s=a.stop_timeout)
            rec["session_s"] = round(time.monotonic() - t0, 1)
        rec["log_evidence"] = log_evidence(self.work / rec["server_log"])
        self.census_after(rec, cdir, ok_requests)
        return rec

    def start_proxy(self, port: int, upstream: str, cdir: Path, server_pid: int, n: int):
        a = self.a
        listen = f"127.0.0.1:{port}"
        lag = ["--loop-lag-probe", f"{a.proxy_loop_lag:g}"] if a.proxy_loop_lag and a.proxy_pairs else []
        cmd = [bl.python(), "-m", "otel_gpu_census.cli", "proxy", "--upstream", upstream, "--listen", listen,
               "--dir", str(cdir), "--upstream-pid", str(server_pid)] + lag + shlex.split(a.proxy_args)
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


def loop_lag(proxy_url: str, a: argparse.Namespace) -> Optional[Dict[str, Any]]:
    """The proxy's event-loop lag since the last call (its probe's figures, then reset); None when the
    probe is off or did not answer (a proxy from before the probe existed)."""
    if not a.proxy_loop_lag:
        return None
    try:
        with urllib.request.urlopen(proxy_url + "/.otel-gpu-census/loop-lag?reset=1", timeout=10) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


# ---- rows ------------------------------------------------------------------------------------

def spread(xs: List[float]) -> Optional[float]:
    """Coefficient of variation (stdev / mean), None for fewer than two values."""
    return bl.cv(xs)


def wave_note(*loads: Dict[str, Any]) -> str:
    """For a log line: the CV across waves of each load (waves mode), else nothing."""
    cvs = [ld.get("wave_tok_s_cv") for ld in loads]
    return f"; wave CV {' / '.join('-' if c is None else f'{c:.4f}' for c in cvs)}" if any(
        ld.get("load_mode") == "waves" for ld in loads) else ""


def compare(pairs: List[Tuple[Dict[str, Any], Dict[str, Any]]]) -> Dict[str, Any]:
    """Pair ratios (variant / reference) of whole-load and steady-state throughput.

    `ratio` (the headline) is the median of the whole-load pair ratios; `steady_ratio` the median of
    the steady-state ones; *_spread is max - min of the pair ratios."""
    whole = [v["output_tok_s"] / p["output_tok_s"] for p, v in pairs]
    steady = [v["steady_tok_s"] / p["steady_tok_s"] for p, v in pairs if p.get("steady_tok_s") and v.get("steady_tok_s")]
    out: Dict[str, Any] = {"pairs": len(whole), "pair_ratios": [bl.rnd(x) for x in whole],
                           "ratio": bl.rnd(bl.median(whole)),
                           "ratio_spread": bl.rnd(max(whole) - min(whole)) if whole else None,
                           "steady_pair_ratios": [bl.rnd(x) for x in steady],
                           "steady_ratio": bl.rnd(bl.median(steady)),
                           "steady_ratio_spread": bl.rnd(max(steady) - min(steady)) if steady else None}
    if whole:
        out["target_ratio_ge_0_99"] = bl.median(whole) >= 0.99
    return out


def load_figures(loads: List[Dict[str, Any]], prefix: str = "") -> Dict[str, Any]:
    """Medians (and spreads) of a set of load summaries, keys prefixed for the reference side."""
    def med(key):
        return bl.median(ld.get(key) for ld in loads)
    out = {f"{prefix}tok_s": bl.rnd(med("output_tok_s"), 2), f"{prefix}steady_tok_s": bl.rnd(med("steady_tok_s"), 2),
           f"{prefix}ttft_p50_s": bl.rnd(med("ttft_p50_s")), f"{prefix}ttft_p90_s": bl.rnd(med("ttft_p90_s")),
           f"{prefix}e2e_p50_s": bl.rnd(med("e2e_p50_s")),
           f"{prefix}tok_s_cv": spread([ld["output_tok_s"] for ld in loads]),
           f"{prefix}steady_tok_s_cv": spread([ld.get("steady_tok_s") for ld in loads])}
    if any(ld.get("load_mode") == "waves" for ld in loads):   # spread inside each load, across its waves
        out[f"{prefix}wave_tok_s_cvs"] = [ld.get("wave_tok_s_cv") for ld in loads]
        out[f"{prefix}wave_tok_s_cv"] = bl.rnd(med("wave_tok_s_cv"))
    return out


def pair_rows(a: argparse.Namespace, runs: List[Dict[str, Any]], variants: List[str]) -> List[Dict[str, Any]]:
    """Restart mode: one row per flag set and variant; plain's figures and pair ratios beside."""
    rows = []
    ok = {(r["round"], r["flags"], r["variant"]): r for r in runs if complete(r.get("load")) and "error" not in r}
    for flags in a.flag_sets:
        plain_runs = [r for k, r in ok.items() if k[1] == flags and k[2] == "plain"]
        for v in variants:
            mine = [r for k, r in ok.items() if k[1] == flags and k[2] == v]
            row: Dict[str, Any] = {"workload": "server/llama.cpp", "flags": flags, "variant": v,
                                   "env": dict(kv.split("=", 1) for kv in a.server_env),
                                   "unit": "output tok/s", "runs": len(mine),
                                   "failed_runs": sum(1 for r in runs if r["flags"] == flags and r["variant"] == v)
                                   - len(mine)}
            if not mine:
                row["error"] = "no successful run"
                rows.append(row)
                continue
            fig = load_figures([r["load"] for r in mine])
            row["census"] = fig.pop("tok_s")
            row.update(fig)
            d2h = [r["d2h_bytes_per_request"] for r in mine if "d2h_bytes_per_request" in r]
            if d2h:
                row["d2h_bytes_per_request"] = int(bl.median(d2h))
                row["d2h_mb_per_request"] = round(bl.median(d2h) / 1e6, 1)
            if plain_runs:
                pf = load_figures([r["load"] for r in plain_runs], "plain_")
                row["plain"] = pf.pop("plain_tok_s")
                row.update(pf)
            if v != "plain":
                row.update(compare([(ok[(rr, flags, "plain")]["load"], ok[(rr, flags, v)]["load"])
                                    for (rr, f, vv) in ok if f == flags and vv == v and (rr, flags, "plain") in ok]))
            rows.append(row)
    return rows


def proxy_rows(a: argparse.Namespace, sessions: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Same-server mode: one row per session; plain = direct, census = through the proxy."""
    rows = []
    for s in sessions:
        row: Dict[str, Any] = {"workload": "server/llama.cpp proxy, one server", "flags": s["flags"],
                               "variant": "census+proxy", "server_variant": s["server_variant"],
                               "env": s.get("env", {}), "unit": "output tok/s", "reference": "direct"}
        by = {(x["pair"], x["via"]): x["load"] for x in s.get("loads", [])}
        pairs = [(by[(k, "direct")], by[(k, "proxy")]) for k in sorted({k for k, _ in by})
                 if complete(by.get((k, "direct"))) and complete(by.get((k, "proxy")))]
        row["failed_pairs"] = len({k for k, _ in by}) - len(pairs)
        if not pairs:
            row["error"] = s.get("error") or "no complete pair"
            rows.append(row)
            continue
        pair_figures(row, pairs)
        row["target_ratio_ge_0_99"] = row["ratio"] >= 0.99   # the proxy: at most 1 % lower than direct
        keys = ("output_tok_s", "steady_tok_s", "ttft_p50_s", "ttft_p90_s", "wall_s", "wave_tok_s_cv")
        row["per_pair"] = [{"direct": {k: d.get(k) for k in keys}, "proxy": {k: v.get(k) for k in keys},
                            "ratio": bl.rnd(v["output_tok_s"] / d["output_tok_s"])} for d, v in pairs]
        if "d2h_bytes_per_request" in s:
            row["d2h_bytes_per_request"] = s["d2h_bytes_per_request"]
        for via in ("proxy", "direct"):   # the proxy's loop during its own loads, and idle (direct loads)
            lags = [x["loop_lag"] for x in s.get("loads", []) if x["via"] == via and x.get("loop_lag", {}).get("wakeups")]
            if lags:
                row[f"loop_lag_{via}_loads"] = {
                    "p50_ms_median": statistics.median(x.get("p50_ms", 0) for x in lags),
                    "p99_ms_median": statistics.median(x.get("p99_ms", 0) for x in lags),
                    "max_ms": max(x.get("max_ms", 0) for x in lags),
                    "over_20ms": sum(x.get("over_20ms", 0) for x in lags),
                    "wakeups": sum(x.get("wakeups", 0) for x in lags), "loads": len(lags)}
        rows.append(row)
    return rows


def print_table(rows: List[Dict[str, Any]]) -> None:
    print(f"\n{'flags':<9}{'variant':<20}{'tok/s':>9}{'ref':>9}{'ratio':>8}{'steady':>8}{'pairs':>6}"
          f"{'TTFT p50':>10}{'p90':>8}{'D2H MB/req':>12}")
    for r in rows:
        if "error" in r:
            print(f"{r['flags']:<9}{r['variant']:<20}  {r['error']}")
            continue
        ratio, steady = r.get("ratio"), r.get("steady_ratio")
        print(f"{r['flags']:<9}{r['variant']:<20}{r['census']:>9.1f}{r.get('plain') or 0:>9.1f}"
              f"{'' if ratio is None else f'{ratio:.4f}':>8}{'' if steady is None else f'{steady:.4f}':>8}"
              f"{r.get('pairs', ''):>6}{r['ttft_p50_s'] or 0:>10.3f}{r['ttft_p90_s'] or 0:>8.3f}"
              f"{r.get('d2h_mb_per_request', ''):>12}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", required=True, help="llama-server binary")
    ap.add_argument("--model", required=True, help="GGUF model (made with --vocab when missing)")
    ap.add_argument("--vocab", help="vocab-only GGUF: write a random 8B model to --model if it is missing")
    ap.add_argument("--out", help="results file (.json) or folder (default bench/results)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--flag-sets", default="default,nocache", help="of: " + ",".join(FLAG_SETS))
    ap.add_argument("--variants", default="plain,census", help="of: " + ",".join(VARIANTS))
    ap.add_argument("--proxy-pairs", type=int, metavar="N",
                    help="same-server mode: N direct/proxy pairs of loads on one censused server per flag set")
    ap.add_argument("--proxy-census", default="census", choices=[v for v in VARIANTS if v not in ("plain", "census+proxy")],
                    help="census variant of the server in --proxy-pairs mode (default census)")
    ap.add_argument("--gap-s", type=float, default=1.0, help="--proxy-pairs: pause after each load (spans settle)")
    ap.add_argument("--census-mode", choices=("auto", "env", "run"), default="auto")
    ap.add_argument("--census-lib", help="default $OTEL_GPU_CENSUS_LIB or native/build/libotel_gpu_census.so")
    ap.add_argument("--load-mode", choices=("free", "waves"), default="free",
                    help="free: closed loop, a client's next request when its last ends (default); waves: "
                         "waves of --clients requests that start together, each after the previous ended")
    ap.add_argument("--wave-gap-s", type=float, default=0.0,
                    help="--load-mode waves: pause between waves (not counted in tok/s)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, help="requests a load (default 64; 48 with --proxy-pairs)")
    ap.add_argument("--prompt-tokens", type=int, default=1800)
    ap.add_argument("--n-predict", type=int, default=64)
    ap.add_argument("--np", type=int, default=16, help="server slots")
    ap.add_argument("--ctx", type=int, default=32768, help="server context (all slots together)")
    ap.add_argument("--port", type=int, default=18080)
    ap.add_argument("--server-args", default="", help="extra llama-server arguments (one string)")
    ap.add_argument("--server-env", action="append", default=[], metavar="K=V", help="extra server environment")
    ap.add_argument("--proxy-args", default="", help="extra proxy arguments (one string)")
    ap.add_argument("--proxy-loop-lag", type=float, default=20.0, metavar="MS",
                    help="--proxy-pairs: the proxy's event-loop lag probe interval; its figures are read per "
                    "load (loads[].loop_lag, rows' loop_lag_proxy_loads/_direct_loads); 0: off (default 20)")
    ap.add_argument("--proxy-traces-exporter", default="none",
                    help="OTEL_TRACES_EXPORTER for the proxy unless set (default none: no collector here)")
    ap.add_argument("--warmup-requests", type=int,
                    help="a first, unrecorded cycle (with --proxy-pairs: load through the proxy); 0: none "
                         "(default 16)")
    ap.add_argument("--startup-timeout", type=float, default=180)
    ap.add_argument("--load-timeout", type=float, default=180)
    ap.add_argument("--request-timeout", type=float, default=120)
    ap.add_argument("--stop-timeout", type=float, default=30)
    ap.add_argument("--cycle-estimate-s", type=float, default=40, help="first guess of one cycle, for the plan")
    ap.add_argument("--load-estimate-s", type=float, default=9,
                    help="--proxy-pairs: first guess of one load, for the plan and "
                         "the budget (default 9)")
    ap.add_argument("--budget-s", type=float, default=540)
    ap.add_argument("--keep-segments", action="store_true")
    a = ap.parse_args()
    a.flag_sets = [f for f in a.flag_sets.split(",") if f]
    variants = [v for v in a.variants.split(",") if v]
    bad = [f for f in a.flag_sets if f not in FLAG_SETS] + [v for v in variants if v not in VARIANTS]
    if bad:
        ap.error(f"unknown flag set or variant: {', '.join(bad)}")
    for name in ("rounds", "clients", "prompt_tokens", "n_predict", "np", "ctx"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if any("=" not in kv for kv in a.server_env):
        ap.error("--server-env wants K=V")
    if a.proxy_pairs is not None and a.proxy_pairs < 1:
        ap.error("--proxy-pairs must be at least 1")
    if a.requests is None:
        a.requests = 48 if a.proxy_pairs else 64
    if a.requests < 1:
        ap.error("--requests must be at least 1")
    if a.load_mode == "waves" and a.requests % a.clients:
        ap.error(f"--load-mode waves: --requests ({a.requests}) must be a multiple of --clients ({a.clients}): "
                 "every wave the same size")
    if a.wave_gap_s < 0:
        ap.error("--wave-gap-s must be at least 0")
    if a.warmup_requests is None:
        a.warmup_requests = 16
    if a.warmup_requests < 0:
        ap.error("--warmup-requests must be at least 0")
    if "plain" not in variants:
        variants.insert(0, "plain")
    if a.proxy_pairs:
        variants = [a.proxy_census, "census+proxy"]

    env_info = {"nvidia_smi": bl.nvidia_smi(), "nvcc": bl.nvcc_version(), "python": sys.version.split()[0]}
    out_path = bl.results_path(a.out, env_info["nvidia_smi"].get("gpu"),
                               "server-llamacpp-proxy-pairs" if a.proxy_pairs else "server-llamacpp")
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
            if a.proxy_pairs:
                return 1
            variants = ["plain"]
    if "census+proxy" in variants:
        d = bl.run([bl.python(), "-m", "otel_gpu_census.cli", "proxy", "--help"], timeout=30,
                   env=b.pkg_env(bl.plain_env()))
        if not d.ok or "--upstream" not in d.out:
            log(f"census+proxy dropped: the proxy is not usable here ({d.tail(300).strip()})")
            if a.proxy_pairs:
                return 1
            variants.remove("census+proxy")
    env_info["census_mode"] = b.census_mode()

    runs: List[Dict[str, Any]] = []
    result: Dict[str, Any] = {
        "benchmark": "server/llama.cpp" + (" proxy pairs" if a.proxy_pairs else ""),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(shlex.quote(x) for x in sys.argv), "environment": env_info,
        "config": {k: getattr(a, k) for k in ("rounds", "proxy_pairs", "proxy_census", "gap_s",
                                              "flag_sets", "clients", "requests", "prompt_tokens", "n_predict",
                                              "np", "ctx", "server_args", "census_mode",
                                              "warmup_requests", "load_mode", "wave_gap_s")},
        "load_mode": a.load_mode,
        "variants": variants, "variant_env": {v: b.env_of(v) for v in variants},
        "headline": "ratio = median of whole-load pair ratios; steady_ratio = the same from steady-state tok/s",
        "rows": [], "runs": runs,
    }
    if a.proxy_pairs:
        return proxy_main(a, b, log, result, out_path)

    cycles = a.rounds * len(a.flag_sets) * len(variants)
    est = a.cycle_estimate_s
    log(f"plan: {a.rounds} rounds x flag sets {a.flag_sets} x variants {variants} = {cycles} cycles "
        f"(+{'1 warm-up' if a.warmup_requests else 'no warm-up'}), ~{est:.0f} s each: "
        f"~{(cycles + (1 if a.warmup_requests else 0)) * est / 60:.1f} min; budget {a.budget_s:.0f} s; "
        f"census mode {env_info['census_mode']}; {load_shape(a)}")
    log(f"server: {shlex.join(b.server_cmd(a.port, a.flag_sets[0]))}")
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
                log(f"r{rnd} {flags:<8} {v:<19} " + (f"ERROR {r['error']}" if "error" in r else
                    f"{ld.get('output_tok_s')} tok/s (steady {ld.get('steady_tok_s')}) ok={ld.get('ok')}/"
                    f"{ld.get('requests')} ttft p50={ld.get('ttft_p50_s')} p90={ld.get('ttft_p90_s')} "
                    f"startup={r.get('startup_s')}s stop={r.get('stop', {}).get('how')} "
                    f"{r.get('stop', {}).get('stop_s')}s cycle={r.get('cycle_s')}s"
                    + (f" D2H/req={r['d2h_bytes_per_request'] / 1e6:.1f}MB" if "d2h_bytes_per_request" in r else "")
                    + wave_note(ld)))
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


def load_shape(a: argparse.Namespace) -> str:
    """The load's shape for plan lines."""
    if a.load_mode == "waves":
        return (f"loads in waves: {a.requests // a.clients} waves of {a.clients} requests a load"
                + (f", {a.wave_gap_s:g} s apart" if a.wave_gap_s else ""))
    return f"free-running loads ({a.clients} clients in a closed loop)"


def pair_figures(row: Dict[str, Any], pairs: List[Tuple[Dict[str, Any], Dict[str, Any]]]) -> None:
    """A same-server row's figures from (reference load, variant load) pairs: the variant's as `census`,
    the reference's as `plain`, the pair ratios, and TTFT p50 pair ratios."""
    fig = load_figures([v for _, v in pairs])
    row["census"] = fig.pop("tok_s")
    row.update(fig)
    pf = load_figures([r for r, _ in pairs], "plain_")
    row["plain"] = pf.pop("plain_tok_s")
    row.update(pf)
    row.update(compare(pairs))
    row["ttft_p50_pair_ratios"] = [bl.rnd(v["ttft_p50_s"] / r["ttft_p50_s"]) for r, v in pairs
                                   if r.get("ttft_p50_s") and v.get("ttft_p50_s")]


def run_sessions(a: argparse.Namespace, log: bl.Log, result: Dict[str, Any], out_path: Path,
                 make_rows: Callable[[List[Dict[str, Any]]], List[Dict[str, Any]]],
                 session: Callable[[str, Callable[[Dict[str, Any]], None]], Dict[str, Any]]) -> None:
    """One same-server session per flag set (the --proxy-pairs mode): rows and
    the JSON rewritten after every pair (`save`), none started past the budget; fills result's runs,
    rows and hangs."""
    sessions: List[Dict[str, Any]] = result["runs"]

    def save(current: Dict[str, Any]) -> None:
        result["rows"] = make_rows(sessions + ([] if any(current is x for x in sessions) else [current]))
        bl.write_json(out_path, result)

    for flags in a.flag_sets:
        if log.elapsed() + 60 > a.budget_s:
            result["stopped_early"] = f"budget: no time for flag set {flags}"
            log(result["stopped_early"])
            break
        s = session(flags, save)
        sessions.append(s)
        if "error" in s:
            log(f"{flags}: ERROR {s['error']}")
        save(s)
    result["rows"] = make_rows(sessions)
    result["hangs"] = sum(1 for s in sessions if s.get("stop", {}).get("hang"))
    bl.write_json(out_path, result)


def proxy_main(a: argparse.Namespace, b: Bench, log: bl.Log, result: Dict[str, Any], out_path: Path) -> int:
    """--proxy-pairs: one session (server + proxy, N pairs) per flag set."""
    sessions: List[Dict[str, Any]] = result["runs"]
    load_s = a.load_estimate_s + a.gap_s
    per = 15 + (load_s if a.warmup_requests else 0) + 2 * a.proxy_pairs * load_s
    log(f"plan: same server, flag sets {a.flag_sets}: start + warm-up + {a.proxy_pairs} pairs (direct/proxy, ABBA) "
        f"x ~{load_s:.0f} s a load = ~{per / 60:.1f} min each, ~{per * len(a.flag_sets) / 60:.1f} min in all; "
        f"server {a.proxy_census} {b.env_of(a.proxy_census)}; {a.requests} requests x {a.prompt_tokens} prompt "
        f"tokens x {a.n_predict} out, {a.clients} clients, {load_shape(a)}; budget {a.budget_s:.0f} s")
    log(f"server: {shlex.join(b.server_cmd(a.port, a.flag_sets[0]))}")

    run_sessions(a, log, result, out_path, lambda ss: proxy_rows(a, ss),
                 lambda flags, save: b.proxy_session(flags, a.proxy_pairs, save))
    print_table(result["rows"])
    for r in result["rows"]:
        if "error" not in r:
            print(f"{r['flags']}: proxy/direct pair ratios {r['pair_ratios']} (steady {r['steady_pair_ratios']}); "
                  f"direct tok/s CV {r['plain_tok_s_cv']} (steady {r['plain_steady_tok_s_cv']})"
                  + (f"; CV across waves (median of loads) direct {r['plain_wave_tok_s_cv']}, proxy "
                     f"{r['wave_tok_s_cv']}" if "wave_tok_s_cv" in r else ""))
    print(f"\nsessions: {len(sessions)}, hangs: {result['hangs']}; results: {out_path}; logs: {b.work}")
    return 0 if sessions and not any("error" in r for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
