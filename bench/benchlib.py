"""Shared pieces of the bench scripts: bounded subprocesses, logging, statistics, environment,
census segments. Standard library only, so every script starts fast on a bare GPU machine.

Every helper here is bounded in time and reports failure as a value rather than raising, so one
failing step of a benchmark is logged and the rest still runs.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
CENSUS_LIB_DEFAULT = REPO / "native" / "build" / "libotel_gpu_census.so"
FLOOR_LIB_DEFAULT = BENCH_DIR / "floor" / "build" / "libcupti_floor.so"


# ---- logging -------------------------------------------------------------------------------

class Log:
    """Timestamped lines to stdout and to a file in the output folder."""

    def __init__(self, path: Optional[Path] = None):
        self.t0 = time.monotonic()
        self.f = open(path, "a", buffering=1) if path else None

    def __call__(self, *parts: Any) -> None:
        line = f"[{time.monotonic() - self.t0:7.1f}s] " + " ".join(str(p) for p in parts)
        print(line, flush=True)
        if self.f:
            self.f.write(line + "\n")

    def elapsed(self) -> float:
        return time.monotonic() - self.t0


# ---- processes -----------------------------------------------------------------------------

class Done:
    """What a bounded command did."""

    def __init__(self, rc: Optional[int], wall_s: float, timed_out: bool, out: str, err: str):
        self.rc, self.wall_s, self.timed_out, self.out, self.err = rc, wall_s, timed_out, out, err

    @property
    def ok(self) -> bool:
        return self.rc == 0 and not self.timed_out

    def tail(self, n: int = 1500) -> str:
        return (self.err or self.out or "")[-n:]


def run(cmd: Sequence[str], timeout: float, env: Optional[Dict[str, str]] = None,
        cwd: Optional[Path] = None, log_path: Optional[Path] = None) -> Done:
    """Run cmd to completion within timeout; on timeout kill its whole process group."""
    t0 = time.monotonic()
    try:
        p = subprocess.Popen(list(cmd), env=env, cwd=cwd, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, errors="replace",
                             start_new_session=True)
    except OSError as e:
        return Done(None, 0.0, False, "", f"cannot start {cmd[0]}: {e}")
    timed_out = False
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_group(p)
        try:
            out, err = p.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            out, err = "", "(output lost: process did not die after SIGKILL)"
    wall = time.monotonic() - t0
    if log_path:
        with open(log_path, "a") as f:
            f.write(f"$ {' '.join(map(str, cmd))}\n# rc={p.returncode} wall={wall:.2f}s"
                    f"{' TIMEOUT' if timed_out else ''}\n{out}\n{err}\n")
    return Done(p.returncode, wall, timed_out, out or "", err or "")


def kill_group(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            p.kill()
        except ProcessLookupError:
            pass


def stop(p: subprocess.Popen, sig: int = signal.SIGTERM, grace_s: float = 15.0) -> Dict[str, Any]:
    """Send sig, wait up to grace_s, then SIGKILL the group. Says what it took."""
    t0 = time.monotonic()
    if p.poll() is not None:
        return {"how": "already-exited", "rc": p.returncode, "stop_s": 0.0}
    try:
        p.send_signal(sig)
    except ProcessLookupError:
        pass
    try:
        p.wait(timeout=grace_s)
        return {"how": signal.Signals(sig).name, "rc": p.returncode,
                "stop_s": round(time.monotonic() - t0, 3)}
    except subprocess.TimeoutExpired:
        kill_group(p)
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        return {"how": "SIGKILL-after-timeout", "rc": p.returncode,
                "stop_s": round(time.monotonic() - t0, 3), "hang": True}


# ---- statistics ----------------------------------------------------------------------------

def median(xs: Iterable[float]) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def quantile(xs: Iterable[float], q: float) -> Optional[float]:
    """Linear-interpolated quantile, q in [0, 1]."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def cv(xs: Iterable[Optional[float]], nd: int = 4) -> Optional[float]:
    """Coefficient of variation (stdev / mean) of the non-empty values; None for fewer than two."""
    xs = [x for x in xs if x]
    return round(statistics.stdev(xs) / statistics.mean(xs), nd) if len(xs) > 1 else None


def rnd(x: Optional[float], nd: int = 4) -> Optional[float]:
    return None if x is None else round(x, nd)


def alternating(variants: Sequence[str], rounds: int) -> List[List[str]]:
    """Variant order per round, reversed every other round (ABBA) so drift cancels out."""
    return [list(variants) if r % 2 == 0 else list(reversed(variants)) for r in range(rounds)]


# ---- environment ---------------------------------------------------------------------------

def nvidia_smi() -> Dict[str, Any]:
    d = run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,uuid",
             "--format=csv,noheader"], timeout=20)
    if not d.ok:
        return {"error": d.tail(300) or "nvidia-smi not available"}
    first = d.out.strip().splitlines()[0].split(", ")
    info = dict(zip(["gpu", "driver", "memory_total", "uuid"], first))
    info["gpu_count"] = len(d.out.strip().splitlines())
    h = run(["nvidia-smi"], timeout=20)
    m = re.search(r"CUDA Version:\s*([\d.]+)", h.out)
    if m:
        info["driver_cuda"] = m.group(1)
    return info


def nvcc_version() -> Optional[str]:
    d = run(["nvcc", "--version"], timeout=20)
    m = re.search(r"release ([\d.]+)", d.out)
    return m.group(1) if m else None


def device_slug(gpu_name: Optional[str]) -> str:
    if not gpu_name:
        return "nogpu"
    s = gpu_name.lower().replace("nvidia", "").strip()
    return re.sub(r"[^a-z0-9]+", "-", s).strip("-") or "gpu"


def results_path(out: Optional[str], gpu_name: Optional[str], bench: str) -> Path:
    """--out FILE.json is used as given; --out DIR (or nothing: bench/results) gets
    <date>-<device>-<bench>.json."""
    name = f"{_dt.date.today().isoformat()}-{device_slug(gpu_name)}-{bench}.json"
    if out and out.endswith(".json"):
        p = Path(out)
    else:
        p = Path(out or BENCH_DIR / "results") / name
    p.parent.mkdir(parents=True, exist_ok=True)
    return p


def write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str) + "\n")
    tmp.replace(path)


# ---- native builds ---------------------------------------------------------------------------

def ensure_built(target: Path, make_dir: Path, log: Log, timeout: float = 180) -> Optional[str]:
    """Build target with make if missing. Returns None when it exists afterwards, else why not."""
    if target.is_file():
        return None
    log(f"building {target} (make -C {make_dir})")
    d = run(["make", "-C", str(make_dir), "-j4"], timeout=timeout)
    if target.is_file():
        return None
    return f"make -C {make_dir} failed (rc={d.rc}): {d.tail(800)}"


def census_lib(path: Optional[str] = None) -> Path:
    """The injector: `path`, else $OTEL_GPU_CENSUS_LIB, else the checkout's build, else the installed
    package's copy (`pip install .` builds it there, not in native/build)."""
    explicit = path or os.environ.get("OTEL_GPU_CENSUS_LIB")
    if explicit or CENSUS_LIB_DEFAULT.is_file():
        return Path(explicit or CENSUS_LIB_DEFAULT).resolve()
    pkg, _ = import_package()
    if pkg is not None:
        try:
            from otel_gpu_census import _native
            found = _native.find_library()
            if found is not None:
                return found
        except Exception:      # a broken install: report the checkout's path, as before
            pass
    return CENSUS_LIB_DEFAULT.resolve()


def injected_env(lib: Path, census_dir: Optional[Path] = None,
                 base: Optional[Dict[str, str]] = None, **extra: str) -> Dict[str, str]:
    """The environment of a process that loads `lib` as its CUDA injector."""
    env = dict(os.environ if base is None else base)
    env["CUDA_INJECTION64_PATH"] = str(lib)
    if census_dir is not None:
        census_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(census_dir, 0o700)
        env["OTEL_GPU_CENSUS_DIR"] = str(census_dir)
    env.update(extra)
    return env


def plain_env(base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ if base is None else base)
    for k in ("CUDA_INJECTION64_PATH", "OTEL_GPU_CENSUS_DIR"):
        env.pop(k, None)
    return env


# ---- census segments ---------------------------------------------------------------------------

def import_package():
    """Import otel_gpu_census (installed, else the checkout's src/). Returns (module, why-not)."""
    try:
        import otel_gpu_census  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(REPO / "src"))
    try:
        import otel_gpu_census
        from otel_gpu_census.census import reader  # noqa: F401
        return otel_gpu_census, None
    except Exception as e:  # ImportError, a missing header, cffi absent...
        return None, f"otel_gpu_census reader not importable: {type(e).__name__}: {e}"


def segment_files(census_dir: Path) -> List[Path]:
    try:
        return sorted(census_dir.glob("gpu-census-*.seg"))
    except OSError:
        return []


def read_segments(census_dir: Path) -> Dict[str, Any]:
    """Read every segment of a census folder with the package's reader.

    Returns {"processes": [ProcessCensus...], "errors": [...]} or {"error": why} when the reader
    cannot be used. Never raises.
    """
    pkg, why = import_package()
    if pkg is None:
        return {"error": why}
    from otel_gpu_census.census import reader
    try:
        procs, bad = reader.scan(census_dir)
    except Exception as e:  # a bug in the reader must not end a benchmark
        return {"error": f"reader.scan failed: {type(e).__name__}: {e}"}
    return {"processes": procs, "errors": [str(e) for e in bad]}


def census_summary(pc: Any) -> Dict[str, Any]:
    """The numbers a benchmark row needs from one ProcessCensus."""
    t = pc.totals()
    by_dir = t.copies.by_direction()
    return {
        "pid": pc.pid, "comm": pc.comm, "state": pc.state_name, "torn": pc.torn, "alive": pc.alive,
        "flags": pc.flags, "records": pc.records, "dropped": pc.dropped,
        "buffers_refused": pc.buffers_refused, "kernels": t.kernel_count, "kernel_ns": t.kernel_ns,
        "busy_ns": t.busy_ns, "graph_launches": t.graph_launches,
        "copies": {d: {"count": s.count, "bytes": s.bytes} for d, s in by_dir.items() if s.count},
        "memset": {"count": t.memset.count, "bytes": t.memset.bytes},
    }


def rm_tree(p: Path) -> None:
    shutil.rmtree(p, ignore_errors=True)


def python() -> str:
    return sys.executable or "python3"
