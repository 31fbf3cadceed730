#!/usr/bin/env python3
"""llama-server under load, as the metrics arrived over OTLP: a table per second (not a pytest test).

On a GPU, one command (`bash bench/device/run.sh setup llama metrics-table`; ~70 s after the
build: server start-up ~4 s, 3 + 20 + 10 + 20 + 3 s of phases, request drains, stop), which runs:

    timeout 150 python3 tests/gpu/llama_metrics_table.py --server $LLAMA_SERVER --model /root/m8b.gguf \
        --flags default --expect-gpu --max-s 140 --out $OUT/llama_metrics

(`--flags nocache` adds --cache-ram 0 --ctx-checkpoints 0: same time again, far fewer D2H bytes.)
Expected: table.md with ~60 rows, nvidia-smi util and census busy high in the load phases and near
0 in the idle ones, SM occupancy well below utilisation, D2H in the GB/s under load with default
flags, in flight 16 under load and 0 idle; a `check:` line saying the two D2H totals are equal.

On the CPU machine, the plumbing only (~60 s each). Against the stand-in or a CPU llama-server the
census and NVML columns are empty, and the output says why; `standin-census` adds a synthetic
census segment that follows the load (busy 40 %, D2H 3.3 MB/s while requests run), so the census
columns' whole path (segment, sidecar, OTLP, table) shows on a CPU; NVML columns stay empty:

    .venv/bin/python tests/gpu/llama_metrics_table.py --server standin --out /tmp/lmt-standin
    .venv/bin/python tests/gpu/llama_metrics_table.py --server standin-census --out /tmp/lmt-census
    xz -dc .llama/ggml-vocab-llama-bpe.gguf.xz > /tmp/vocab.gguf
    .venv/bin/python bench/server/make_model.py /tmp/tiny.gguf --vocab /tmp/vocab.gguf --preset tiny
    .venv/bin/python tests/gpu/llama_metrics_table.py --server /work/build/llama-cpu/build/bin/llama-server \
        --model /tmp/tiny.gguf --clients 4 --prompt-tokens 128 --n-predict 16 --out /tmp/lmt-cpu

What it does: starts a real OTLP receiver in this process (tests/support/otlp_receiver.py; gRPC, or HTTP
with --protocol http/protobuf), then `python -m otel_gpu_census.cli run --exporter otlp
--metrics-interval 1 --proxy 127.0.0.1:PORT -- llama-server ...` with OTEL_EXPORTER_OTLP_ENDPOINT
pointing at it (`--server standin` runs tests/support/llama_standin.py instead). The proxy is only there
for the in-flight column (`gpu_census.requests.in_flight`, exported by `run`'s proxy over the
same OTLP endpoint); --no-proxy loads the server directly and leaves that column empty. Phases:
3 s idle, --load-s of load (bench/server/load.py's streaming requests from --clients clients, each
starting a new request as soon as its last one ends), --idle-s idle, --load-s load, 3 s idle. Then
`run` is stopped (SIGTERM, which it forwards; its last export carries the final totals).

Every value in the table is what arrived at the receiver. One row per export of the census
sidecar (once a second) and GPU: nvidia-smi's utilisation (`hw.gpu.utilization`), the census busy
ratio (`gpu_census.busy.ratio`), GPM SM occupancy and SM utilisation (`gpu_census.sm.*`), D2H and
H2D MB/s (the change in `gpu_census.copy.bytes`, direction dtoh/htod, summed over processes and
memory kinds, between consecutive exports), and requests in flight (the proxy's newest export at
most 1.5 s older than the row). Without a GPU the rows follow the proxy's exports instead.

Writes to --out: table.md (per-second table, medians per phase, notes), table.json (the same as
data, plus the load summaries and checks), otlp_points.jsonl (every data point received),
server.log (the `run` command's output, the census report at its end), census_report.json.
Exit status: 0 with a table; 1 when the server or the load failed or nothing arrived over OTLP, or
(with --expect-gpu) when a census or NVML column stayed empty; 2 for bad arguments; 3 when the
--max-s watchdog fired, 143 on SIGTERM (everything it started is killed first).
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
for p in (REPO / "tests" / "support", REPO / "bench" / "perf", REPO / "bench" / "server", REPO / "bench"):
    sys.path.insert(0, str(p))

from ports import free_port  # noqa: E402

SIDECAR_SCOPES = ("otel_gpu_census", "otel_gpu_census.nvml")   # the census sidecar's meters
FLAG_SETS = {"default": [], "nocache": ["--cache-ram", "0", "--ctx-checkpoints", "0"]}
GAUGES = {            # metric -> (row key, column title)
    "hw.gpu.utilization": ("nvidia_smi_util", "nvidia-smi util"),
    "gpu_census.busy.ratio": ("census_busy", "census busy"),
    "gpu_census.sm.occupancy": ("sm_occupancy", "SM occupancy"),
    "gpu_census.sm.utilization": ("sm_util", "SM util"),
}
RATES = {"dtoh": "d2h_Bps", "htod": "h2d_Bps"}
IN_FLIGHT = "gpu_census.requests.in_flight"
IN_FLIGHT_LOOKBACK_NS = 1_500_000_000
EDGE_IDLE_S = 3.0


# ---------------------------------------------------------------------------------------------
# the table, from the received points (pure: tests can feed it Points)

def _collections(points, scopes: Sequence[str]) -> Dict[int, list]:
    """{collection time ns: points} of the meters in `scopes` (one SDK collection, one timestamp)."""
    out: Dict[int, list] = {}
    for p in points:
        if p.scope in scopes:
            out.setdefault(p.time_ns, []).append(p)
    return out


def _phase_at(phases: List[Dict[str, Any]], t_ns: int) -> str:
    for ph in phases:
        if ph["start_ns"] <= t_ns < ph["end_ns"]:
            return ph["name"]
    return "start-up" if phases and t_ns < phases[0]["start_ns"] else "stop"


def build_rows(points, phases: List[Dict[str, Any]], t0_ns: int) -> List[Dict[str, Any]]:
    """One row per census-sidecar export and GPU (per proxy export when the sidecar sent nothing)."""
    side = _collections(points, SIDECAR_SCOPES)
    proxy = _collections(points, ("otel_gpu_census.proxy",))
    in_flight = sorted((t, sum(p.value for p in pts if p.name == IN_FLIGHT))
                       for t, pts in proxy.items() if any(p.name == IN_FLIGHT for p in pts))
    times = sorted(side) or sorted(proxy)
    gpus = sorted({p.attributes["hw.id"] for pts in side.values() for p in pts if "hw.id" in p.attributes})
    rows: List[Dict[str, Any]] = []
    prev: Dict[Tuple[str, str], Tuple[int, int]] = {}        # (gpu, direction) -> (t ns, bytes)
    for t in times:
        pts = side.get(t, [])
        flight = None
        for ft, v in in_flight:          # the newest proxy export not after the row (+0.5 s slack)
            if t - IN_FLIGHT_LOOKBACK_NS <= ft <= t + 500_000_000:
                flight = v
        for gpu in gpus or [None]:
            row: Dict[str, Any] = {"t_s": round((t - t0_ns) / 1e9, 2), "phase": _phase_at(phases, t),
                                   "gpu": gpu}
            for name, (key, _) in GAUGES.items():
                vals = [p.value for p in pts if p.name == name and p.attributes.get("hw.id") == gpu]
                row[key] = vals[0] if vals else None
            for direction, key in RATES.items():
                cells = [p for p in pts if p.name == "gpu_census.copy.bytes" and p.attributes.get("hw.id") == gpu
                         and p.attributes.get("gpu_census.copy.direction") == direction]
                row[key] = None
                if gpu is None or not any(q.name == "gpu_census.copy.bytes" or q.name == "gpu_census.busy.ratio"
                                          for q in pts):
                    continue      # no census in this export: no rate, not a zero one
                total = int(sum(p.value for p in cells))
                last = prev.get((gpu, direction))
                if last is not None and t > last[0]:
                    row[key] = (total - last[1]) / ((t - last[0]) / 1e9)
                prev[(gpu, direction)] = (t, total)
            row["in_flight"] = flight
            rows.append(row)
    return rows


def phase_medians(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    out = []
    keys = [k for k, _ in GAUGES.values()] + list(RATES.values()) + ["in_flight"]
    for phase in dict.fromkeys(r["phase"] for r in rows):
        mine = [r for r in rows if r["phase"] == phase]
        rec: Dict[str, Any] = {"phase": phase, "rows": len(mine)}
        for k in keys:
            vals = [r[k] for r in mine if r.get(k) is not None]
            rec[k] = statistics.median(vals) if vals else None
            rec[k + "_n"] = len(vals)
        out.append(rec)
    return out


def _pct(v) -> str:
    return "" if v is None else f"{100 * v:.1f}%"


def _mbs(v) -> str:
    return "" if v is None else f"{v / 1e6:.1f}"


def _num(v) -> str:
    return "" if v is None else f"{v:g}"


def markdown(rows: List[Dict[str, Any]], medians: List[Dict[str, Any]]) -> str:
    cols = ["t (s)", "phase", "GPU"] + [title for _, title in GAUGES.values()] + \
           ["D2H MB/s", "H2D MB/s", "in flight"]
    lines = ["| " + " | ".join(cols) + " |", "|---|---|---|" + "---:|" * (len(cols) - 3)]
    for r in rows:
        cells = [f"{r['t_s']:.1f}", r["phase"], (r["gpu"] or "-")[:12]] + \
                [_pct(r[k]) for k, _ in GAUGES.values()] + [_mbs(r["d2h_Bps"]), _mbs(r["h2d_Bps"]),
                                                            _num(r["in_flight"])]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Medians per phase (n: rows with a value):", "",
              "| phase | rows | " + " | ".join(t for _, t in GAUGES.values()) + " | D2H MB/s | in flight |",
              "|---|---:|" + "---:|" * (len(GAUGES) + 2)]
    for m in medians:
        def cell(key, fmt):
            return f"{fmt(m[key]) or 'n/a'} (n={m[key + '_n']})"
        cells = [m["phase"], str(m["rows"])] + [cell(k, _pct) for k, _ in GAUGES.values()] + \
            [cell("d2h_Bps", _mbs), cell("in_flight", _num)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def empty_column_notes(rows: List[Dict[str, Any]], names: set, proxy_on: bool, report: Optional[dict],
                       log_text: str = "") -> List[str]:
    """Why a column has no value at all, from what arrived (and the run's report and log)."""
    notes = []
    nvml_said = next((ln.strip() for ln in log_text.splitlines() if "NVML instruments off" in ln), "")
    procs = (report or {}).get("processes") or []
    if not any(r["census_busy"] is not None for r in rows):
        why = ("the census recorded no GPU activity: no census segment in this run"
               if not procs else f"{len(procs)} censused process(es) but no busy ratio exported")
        notes.append(f"census columns (census busy, D2H, H2D) empty: {why} — expected on a machine without a "
                     "GPU or with a CPU-only server or the stand-in")
    if "hw.gpu.utilization" not in names:
        notes.append("NVML columns (nvidia-smi util, SM occupancy, SM util) empty: the sidecar exported no NVML "
                     "instrument (" + (f"server.log: {nvml_said!r}" if nvml_said else
                                       "no NVIDIA driver here, or NVML failed: see server.log") + ")")
    elif "gpu_census.sm.occupancy" not in names:
        notes.append("GPM columns (SM occupancy, SM util) empty: NVML is there but GPM is not (a GPU before "
                     "Hopper, or GPM refused; `otel-gpu-census doctor` says why)")
    if not proxy_on:
        notes.append("in-flight column empty: --no-proxy (the count comes from the proxy's export)")
    elif not any(r["in_flight"] is not None for r in rows):
        notes.append(f"in-flight column empty: no {IN_FLIGHT} arrived from the proxy")
    return notes


# ---------------------------------------------------------------------------------------------
# load phases

async def _load_phase(url: str, clients: int, seconds: float, ids: "itertools.count", a, alive: Callable[[], bool]
                      ) -> List[Dict[str, Any]]:
    """Streaming requests from `clients` clients for `seconds`: each starts a new request when its
    last one ends, until the time is up; requests in flight then finish (bounded)."""
    import aiohttp
    import load
    results: List[Dict[str, Any]] = []
    until = time.monotonic() + seconds
    conn = aiohttp.TCPConnector(limit=clients, force_close=True)
    async with aiohttp.ClientSession(connector=conn) as session:
        async def client() -> None:
            while time.monotonic() < until and alive():
                i = next(ids)
                body = {"prompt": load.prompt_ids(a.seed, i, a.prompt_tokens), "n_predict": a.n_predict,
                        "stream": True, "ignore_eos": True, "seed": a.seed + i}
                r = await load.one_request(session, url, body, a.request_timeout)
                r["i"] = i
                results.append(r)
                if "error" in r:
                    await asyncio.sleep(0.2)     # a failing server must not be hammered in a tight loop
        tasks = [asyncio.ensure_future(client()) for _ in range(clients)]
        done, pending = await asyncio.wait(tasks, timeout=seconds + a.request_timeout + 5)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return results


def summarise_phase(results: List[Dict[str, Any]]) -> Dict[str, Any]:
    ok = [r for r in results if "error" not in r]
    return {"requests": len(results), "ok": len(ok), "errors": len(results) - len(ok),
            "first_errors": list(dict.fromkeys(r["error"] for r in results if "error" in r))[:3],
            "output_tokens": sum(r["tokens_out"] for r in ok),
            "ttft_p50_s": round(statistics.median([r["ttft_s"] for r in ok if "ttft_s" in r]), 4)
            if any("ttft_s" in r for r in ok) else None}


# ---------------------------------------------------------------------------------------------
# processes


def _http_ok(url: str, timeout: float = 2.0) -> bool:
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _wait_health(url: str, proc: subprocess.Popen, timeout_s: float) -> Optional[float]:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            return None
        if _http_ok(url + "/health"):
            return time.monotonic() - t0
        time.sleep(0.25)
    return None


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(proc: subprocess.Popen, grace_s: float) -> Dict[str, Any]:
    """SIGTERM to `run` (it forwards to the server and sends its last export), then SIGKILL the group."""
    t0 = time.monotonic()
    if proc.poll() is not None:
        return {"how": "already exited", "rc": proc.returncode}
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
        return {"how": "SIGTERM", "rc": proc.returncode, "stop_s": round(time.monotonic() - t0, 2)}
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        return {"how": f"SIGKILL after {grace_s:g} s", "rc": proc.returncode, "hang": True}


def _status(rc: Optional[int]) -> str:
    """`run` exits with the server's status, 128+N when signal N ended it."""
    if rc is None:
        return "status unknown"
    if rc < 0:
        return f"`run` itself killed by signal {-rc}"
    return f"status {rc}" + (f", signal {rc - 128}" if rc > 128 else "")


def _tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


STANDINS = ("standin", "standin-census")


def server_command(a, port: int) -> List[str]:
    if a.server == "standin":
        return [sys.executable, str(REPO / "tests" / "support" / "llama_standin.py"), "--host", "127.0.0.1", "--port", str(port),
                "--tokens", str(a.n_predict), "--token-delay", str(a.standin_token_delay),
                "--first-token-delay", str(a.standin_first_token_delay), "--forget"]
    if a.server == "standin-census":
        return [sys.executable, str(Path(__file__).resolve()), "--role", "census-standin", "--server", "standin",
                "--out", "-", "--port", str(port), "--n-predict", str(a.n_predict),
                "--standin-token-delay", str(a.standin_token_delay),
                "--standin-first-token-delay", str(a.standin_first_token_delay)]
    return ([a.server, "-m", a.model, "-ngl", str(a.ngl), "-np", str(a.np), "-c", str(a.ctx),
             "--host", "127.0.0.1", "--port", str(port)] + FLAG_SETS[a.flags] + shlex.split(a.server_args))


def census_standin(a) -> int:
    """`--server standin-census`: the stand-in server, plus a census segment for this process that
    gains, in every second with a /completion request in flight, what bench/perf/perf_sidecar_cpu.py's
    writer adds (1000 kernels of 0.4 ms, 50 device-to-host copies of 64 KiB: busy 40 %, D2H 3.3 MB/s),
    through the native tally. It proves the census columns' path (segment, sidecar, OTLP, table) on
    a machine without a GPU; the numbers are the stand-in's, not a GPU's."""
    import cupti_records as cr
    import segments
    import perf_sidecar_cpu as psc
    from llama_standin import Standin
    from otel_gpu_census.census import proctree
    st = Standin(tokens=a.n_predict, token_delay=a.standin_token_delay,
                 first_token_delay=a.standin_first_token_delay).start(port=a.port)
    census_dir = os.environ.get("OTEL_GPU_CENSUS_DIR")
    if not census_dir:
        print("census-standin: OTEL_GPU_CENSUS_DIR is not set (run it under `otel-gpu-census run`)", file=sys.stderr)
        return 1
    _, lib, _ = cr.native()
    pid = os.getpid()
    ticks = proctree.proc_start_ticks(pid) or 0
    mm, seg = segments.map_segment(Path(census_dir) / f"gpu-census-{pid}-{ticks}.seg", b"llama-server",
                             wall_start_ns=time.time_ns())
    seg.pid, seg.ppid, seg.proc_start_ticks, seg.state = pid, os.getppid(), ticks, 1
    tally = lib.gc_tally_create(seg)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    state, pending = {"corr": 1, "gpu_ns": psc.T0}, []
    while not stop.wait(max(0.0, 1.0 - (time.monotonic() % 1.0))):
        new, st.seen = st.seen, []          # the requests of the last second (and none kept for ever)
        new = [r for r in new if r.path == "/completion"]
        pending = [r for r in pending + new if not (r.finished or r.cancelled)]
        if new or pending:
            lib.gc_segment_begin_update(seg)
            psc._tally_update(cr, lib, seg, tally, state)
            seg.wall_update_ns = time.time_ns()
            lib.gc_segment_end_update(seg)
        state["gpu_ns"] += 1_000_000_000
    lib.gc_segment_begin_update(seg)
    seg.state = 2                      # exited, as the injector marks it
    seg.wall_update_ns = time.time_ns()
    lib.gc_segment_end_update(seg)
    st.stop()
    del seg
    mm.close()
    return 0


def _make_model(a) -> Optional[str]:
    """Write the random model to --model when it is missing and --vocab was given; None when fine."""
    if a.server in STANDINS or Path(a.model).is_file():
        return None
    if not a.vocab:
        return f"no model at {a.model} (give --vocab to write a random {a.preset} one)"
    import make_model
    print(f"writing a random {a.preset} model to {a.model} ...", flush=True)
    try:
        info = make_model.write_model(Path(a.model), Path(a.vocab), dict(make_model.PRESETS[a.preset], preset=a.preset))
    except (OSError, make_model.GGUFError) as e:
        return f"cannot write the model: {e}"
    print(f"model: {info['bytes'] / 1e9:.1f} GB in {info['seconds']} s", flush=True)
    return None


class Watchdog:
    """Kills what this script started and exits 3 if the whole run outlives --max-s; the same, with
    status 143, on SIGTERM (an outer `timeout`: the server runs in a session of its own, which that
    signal would not reach)."""

    def __init__(self, seconds: float):
        self.procs: List[subprocess.Popen] = []
        self._timer = threading.Timer(seconds, self._abort, args=(f"still running after --max-s {seconds:g} s", 3))
        self._timer.daemon = True
        self._timer.start()
        signal.signal(signal.SIGTERM, lambda *_: self._abort("terminated (SIGTERM)", 143))

    def _abort(self, why: str, code: int) -> None:
        print(f"llama_metrics_table: {why}: killing the server and exiting (no table)", file=sys.stderr, flush=True)
        for p in self.procs:
            if p.poll() is None:
                _kill_group(p)
        os._exit(code)

    def cancel(self) -> None:
        self._timer.cancel()


# ---------------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="See the top of this file for the GPU and CPU commands.")
    ap.add_argument("--server", required=True,
                    help="llama-server binary; 'standin' (tests/support/llama_standin.py), or 'standin-census' (the stand-in "
                    "with a synthetic census segment that follows its load, to see the census columns on a CPU)")
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--model", help="GGUF model (required with a real server)")
    ap.add_argument("--vocab", help="vocab-only GGUF: write a random --preset model to --model if it is missing")
    ap.add_argument("--preset", default="8b", help="make_model preset for --vocab (default 8b)")
    ap.add_argument("--flags", choices=sorted(FLAG_SETS), default="default",
                    help="llama-server flag set: default, or nocache (--cache-ram 0 --ctx-checkpoints 0)")
    ap.add_argument("--out", required=True, help="folder for table.md, table.json and the logs")
    ap.add_argument("--protocol", choices=("grpc", "http/protobuf"), default="grpc", help="OTLP protocol")
    ap.add_argument("--no-proxy", dest="proxy", action="store_false",
                    help="load the server directly (no in-flight column)")
    ap.add_argument("--load-s", type=float, default=20.0, help="seconds of each load phase (default 20)")
    ap.add_argument("--idle-s", type=float, default=10.0, help="seconds of the idle gap between them (default 10)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=1800)
    ap.add_argument("--n-predict", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--ngl", type=int, default=99)
    ap.add_argument("--np", type=int, default=16, help="server slots")
    ap.add_argument("--ctx", type=int, default=32768, help="server context, all slots together")
    ap.add_argument("--server-args", default="", help="extra llama-server arguments (one string)")
    ap.add_argument("--standin-token-delay", type=float, default=0.02, help=argparse.SUPPRESS)
    ap.add_argument("--standin-first-token-delay", type=float, default=0.05, help=argparse.SUPPRESS)
    ap.add_argument("--startup-timeout", type=float, default=180.0)
    ap.add_argument("--request-timeout", type=float, default=60.0)
    ap.add_argument("--stop-timeout", type=float, default=30.0)
    ap.add_argument("--max-s", type=float, default=400.0, help="watchdog on the whole run (default 400)")
    ap.add_argument("--expect-gpu", action="store_true",
                    help="exit 1 unless the census, NVML and GPM columns all have values (on the GPU machine)")
    a = ap.parse_args(argv)
    if a.server not in STANDINS:
        if not a.model:
            ap.error("--model is required with a llama-server binary")
        if not (Path(a.server).is_file() and os.access(a.server, os.X_OK)):
            ap.error(f"--server {a.server}: not an executable file")
    for name in ("load_s", "idle_s", "startup_timeout", "request_timeout", "stop_timeout", "max_s"):
        if not getattr(a, name) > 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0")
    for name in ("clients", "prompt_tokens", "n_predict"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.role == "census-standin":
        return census_standin(a)
    out = Path(a.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"cannot create --out {out}: {e.strerror}", file=sys.stderr)
        return 1
    try:
        import aiohttp  # noqa: F401  (the load needs it: say so before anything starts)
        from otlp_receiver import OtlpReceiver
    except ImportError as e:
        print(f"llama_metrics_table needs {e.name} here (aiohttp, grpcio, opentelemetry-proto): {e}", file=sys.stderr)
        return 1
    why = _make_model(a)
    if why:
        print(why, file=sys.stderr)
        return 1
    watchdog = Watchdog(a.max_s)
    rx = OtlpReceiver(grpc_enabled=a.protocol == "grpc", http_enabled=a.protocol != "grpc")
    census_dir = Path(tempfile.mkdtemp(prefix="lmt-census-"))
    os.chmod(census_dir, 0o700)
    try:
        return _run(a, out, rx, census_dir, watchdog)
    finally:
        watchdog.cancel()
        rx.close()
        shutil.rmtree(census_dir, ignore_errors=True)


def _run(a, out: Path, rx, census_dir: Path, watchdog: Watchdog) -> int:
    port = free_port()
    proxy_port = free_port() if a.proxy else None
    endpoint = rx.grpc_endpoint if a.protocol == "grpc" else rx.http_endpoint
    env = dict(os.environ)
    for k in list(env):        # the OTel SDK's settings of this shell must not redirect the export
        if k.startswith("OTEL_") and not k.startswith("OTEL_GPU_CENSUS_"):
            del env[k]
    env.update({"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": a.protocol,
                "OTEL_METRIC_EXPORT_INTERVAL": "1000", "OTEL_TRACES_EXPORTER": "none",
                "OTEL_SERVICE_NAME": "llama-metrics-table", "PYTHONUNBUFFERED": "1"})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    env.pop("CUDA_INJECTION64_PATH", None)          # `run` sets it for the server, not for itself
    report_path = out / "census_report.json"
    cmd = [sys.executable, "-m", "otel_gpu_census.cli", "run", "--exporter", "otlp", "--metrics-interval", "1",
           "--dir", str(census_dir), "--json", str(report_path)]
    if a.proxy:
        cmd += ["--proxy", f"127.0.0.1:{proxy_port}"]
    cmd += ["--"] + server_command(a, port)
    server_url = f"http://127.0.0.1:{port}"
    target = f"http://127.0.0.1:{proxy_port}" if a.proxy else server_url
    log_path = out / "server.log"
    result: Dict[str, Any] = {"command": cmd, "otlp_endpoint": endpoint, "protocol": a.protocol,
                              "config": {k: getattr(a, k) for k in ("server", "model", "flags", "load_s", "idle_s",
                                                                    "clients", "prompt_tokens", "n_predict", "ngl",
                                                                    "np", "ctx", "proxy")},
                              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    print("$ " + shlex.join(cmd), flush=True)
    t_start = time.time_ns()
    with open(log_path, "w") as lf:
        lf.write("$ " + shlex.join(cmd) + "\n")
        lf.flush()
        try:
            proc = subprocess.Popen(cmd, env=env, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True,
                                    cwd=str(REPO))
        except OSError as e:
            print(f"cannot start {cmd[0]}: {e.strerror}", file=sys.stderr)
            return 1
    watchdog.procs.append(proc)
    phases: List[Dict[str, Any]] = []
    loads: List[Dict[str, Any]] = []
    failure = None
    try:
        up = _wait_health(server_url, proc, a.startup_timeout)
        if up is None:
            failure = (f"the server exited ({_status(proc.returncode)}) before answering /health"
                       if proc.poll() is not None else
                       f"the server did not answer /health within {a.startup_timeout:g} s")
        elif a.proxy and _wait_health(target, proc, 20) is None:
            failure = "the proxy of `run --proxy` did not answer /health within 20 s"
        if failure is None:
            result["startup_s"] = round(up, 2)
            print(f"server up in {up:.1f} s; phases: idle {EDGE_IDLE_S:g} s, load {a.load_s:g} s, idle {a.idle_s:g} s, "
                  f"load {a.load_s:g} s, idle {EDGE_IDLE_S:g} s ({a.clients} streaming clients via "
                  f"{'the proxy' if a.proxy else 'the server directly'})", flush=True)
            ids = itertools.count()
            alive = lambda: proc.poll() is None  # noqa: E731
            plan = [("idle 0", EDGE_IDLE_S), ("load 1", a.load_s), ("idle 1", a.idle_s), ("load 2", a.load_s),
                    ("idle 2", EDGE_IDLE_S)]
            for name, seconds in plan:
                ph = {"name": name, "start_ns": time.time_ns()}
                if name.startswith("load"):
                    res = asyncio.run(_load_phase(target, a.clients, seconds, ids, a, alive))
                    s = summarise_phase(res)
                    loads.append({"phase": name, **s})
                    print(f"{name}: {s['ok']}/{s['requests']} requests ok, {s['output_tokens']} tokens out, "
                          f"TTFT p50 {s['ttft_p50_s']} s" + (f"; errors: {s['first_errors']}" if s["errors"] else ""),
                          flush=True)
                else:
                    end = time.monotonic() + seconds
                    while time.monotonic() < end and alive():
                        time.sleep(0.1)
                ph["end_ns"] = time.time_ns()
                phases.append(ph)
                if not alive():
                    failure = f"the server exited ({_status(proc.returncode)}) during {name}"
                    break
            if failure is None and not any(ld["ok"] for ld in loads):
                failure = "no request of the load succeeded"
    finally:
        result["stop"] = _stop(proc, a.stop_timeout)
        _kill_group(proc)          # anything of the server's left behind in its session (a wrapper's child)
    time.sleep(0.5)                     # an export the receiver is still decoding
    points = rx.snapshot()
    result.update(t0_ns=t_start, phases=[{**ph, "start_s": round((ph["start_ns"] - t_start) / 1e9, 2),
                                           "end_s": round((ph["end_ns"] - t_start) / 1e9, 2)} for ph in phases],
                  load=loads)
    with open(out / "otlp_points.jsonl", "w") as f:
        for p in points:
            f.write(json.dumps({"name": p.name, "scope": p.scope, "unit": p.unit, "kind": p.kind,
                                "attributes": p.attributes, "value": p.value, "time_ns": p.time_ns,
                                "start_ns": p.start_ns}, default=str) + "\n")
    if failure:
        result["failure"] = failure
        (out / "table.json").write_text(json.dumps(result, indent=1, default=str))
        print(f"\nFAILED: {failure}. Last lines of {log_path}:\n{_tail(log_path)}", file=sys.stderr)
        return 1
    report = None
    try:
        report = json.loads(report_path.read_text())
    except (OSError, ValueError):
        pass
    t_ready = phases[0]["start_ns"] if phases else t_start
    rows = build_rows(points, phases, t_ready)
    medians = phase_medians(rows)
    names = {p.name for p in points}
    notes = empty_column_notes(rows, names, a.proxy, report, _tail(log_path, 10_000))
    checks = consistency(points)
    result.update(rows=rows, medians=medians, notes=notes, checks=checks, otlp={
        "requests": rx.requests, "points": len(points), "metric_names": sorted(names)},
        census_processes=[{k: p.get(k) for k in ("pid", "comm", "state")} for p in (report or {}).get("processes", [])])
    md = markdown(rows, medians)
    per = ("export of the census sidecar" if _collections(points, SIDECAR_SCOPES)
           else "export of the proxy (the census sidecar exported nothing)")
    text = (f"# llama-server under load, as exported over OTLP ({a.protocol})\n\n"
            f"`{shlex.join(cmd)}`\n\nt = seconds since the server answered /health; one row per {per}.\n\n"
            + md + "\n\n" + "".join(f"note: {n}\n" for n in notes) + "".join(f"check: {c}\n" for c in checks))
    (out / "table.md").write_text(text)
    (out / "table.json").write_text(json.dumps(result, indent=1, default=str))
    print("\n" + text)
    print(f"OTLP: {rx.requests} export requests, {len(points)} points received; files in {out}")
    if not points:
        print("FAILED: nothing arrived over OTLP" + ("" if a.proxy else " (without a GPU and with --no-proxy "
              "nothing is exported: try --server standin-census)"), file=sys.stderr)
        return 1
    if a.expect_gpu and notes and any(n.startswith(("census", "NVML", "GPM")) for n in notes):
        print("FAILED (--expect-gpu): a census or NVML column is empty", file=sys.stderr)
        return 1
    return 0


def consistency(points) -> List[str]:
    """The final D2H total two ways: summed gpu_census.copy.bytes (dtoh) and gpu_census.host.io (transmit)."""
    side = _collections(points, SIDECAR_SCOPES)
    if not side:
        return []
    last = side[max(side)]
    out = []
    for gpu in sorted({p.attributes.get("hw.id") for p in last if p.name == "gpu_census.host.io"}):
        io = [p.value for p in last if p.name == "gpu_census.host.io" and p.attributes.get("hw.id") == gpu
              and p.attributes.get("network.io.direction") == "transmit"]
        cb = sum(p.value for p in last if p.name == "gpu_census.copy.bytes" and p.attributes.get("hw.id") == gpu
                 and p.attributes.get("gpu_census.copy.direction") == "dtoh")
        if io:
            same = int(io[0]) == int(cb)
            out.append(f"{gpu}: D2H total at the last export {int(cb):,} B from gpu_census.copy.bytes, "
                       f"{int(io[0]):,} B from gpu_census.host.io transmit: {'equal' if same else 'DIFFERENT'}")
    return out


if __name__ == "__main__":
    sys.exit(main())
