"""The environment that puts a command under the census.

CUDA loads the injector named by CUDA_INJECTION64_PATH into every process that initialises the
driver, and every child inherits the variable, so setting it once covers a whole process tree
(vLLM workers, Ollama's runner). The injector then reads OTEL_GPU_CENSUS_DIR and
OTEL_GPU_CENSUS_CUPTI from the same environment.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Mapping, Optional

CUPTI_SONAME = "libcupti.so.13"
_SYSTEM_CUPTI_DIRS = (
    "/usr/local/cuda/extras/CUPTI/lib64",
    "/usr/local/cuda/lib64",
    "/usr/local/cuda-13*/extras/CUPTI/lib64",
    "/usr/local/cuda-13*/lib64",
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib64",
)


def _wheel_cupti() -> Optional[Path]:
    """libcupti.so.13 from the nvidia-cuda-cupti wheel (nvidia/cu13/lib/ in CUDA 13 wheels)."""
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return None
    for base in (spec.submodule_search_locations or []) if spec else []:
        for sub in ("cu13/lib", "cuda_cupti/lib"):
            p = Path(base) / sub / CUPTI_SONAME
            if p.is_file():
                return p
    return None


def _ldconfig_cupti() -> Optional[Path]:
    for ldconfig in ("ldconfig", "/sbin/ldconfig", "/usr/sbin/ldconfig"):
        try:
            out = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, timeout=5).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        for line in out.splitlines():
            name, _, where = line.strip().partition(" => ")
            if name.split(" ")[0] == CUPTI_SONAME and Path(where).is_file():
                return Path(where)
        return None
    return None


def find_cupti(env: Optional[Mapping[str, str]] = None) -> Optional[Path]:
    """Where libcupti.so.13 is: $OTEL_GPU_CENSUS_CUPTI, the wheel, ldconfig's cache, usual CUDA
    folders. None when nowhere (the injector then says so in the child's log)."""
    env = os.environ if env is None else env
    explicit = env.get("OTEL_GPU_CENSUS_CUPTI")
    if explicit:
        return Path(explicit) if Path(explicit).is_file() else None
    found = _wheel_cupti() or _ldconfig_cupti()
    if found:
        return found
    for pattern in _SYSTEM_CUPTI_DIRS:
        for d in sorted(glob.glob(pattern), reverse=True):
            p = Path(d) / CUPTI_SONAME
            if p.is_file():
                return p
    return None


@dataclass
class LaunchPlan:
    env: Dict[str, str]
    census_on: bool               # the injector will be loaded (if the command touches CUDA)
    library: Optional[Path] = None
    cupti: Optional[Path] = None
    warnings: List[str] = field(default_factory=list)


def build_env(census_dir: Path, base: Optional[Mapping[str, str]] = None,
              library: Optional[Path] = None) -> LaunchPlan:
    """The child's environment: `base` (default os.environ) plus the census variables.

    An injection path the user already set (Nsight Systems, another tool) is left alone: the
    command runs as the user asked and the census is off for this run, with a warning.
    """
    from . import _native
    env = dict(os.environ if base is None else base)
    env["OTEL_GPU_CENSUS_DIR"] = str(census_dir)
    plan = LaunchPlan(env=env, census_on=False)
    library = library if library is not None else _native.find_library()
    plan.library = library
    if library is None:
        where = ", ".join(str(p) for p in _native.library_candidates())
        plan.warnings.append(f"census off: {_native.LIB_NAME} not found (looked in: {where}); "
                             "reinstall the package or build it with `make -C native`")
        return plan
    current = env.get("CUDA_INJECTION64_PATH")
    if current and Path(current).resolve() != library.resolve():
        plan.warnings.append(f"census off for this run: CUDA_INJECTION64_PATH is already set to {current} "
                             "(another tool, e.g. Nsight); CUDA loads one injector, and that one is kept")
        return plan
    if env.get("OTEL_GPU_CENSUS_DISABLED", "") not in ("", "0"):
        plan.warnings.append("census off for this run: OTEL_GPU_CENSUS_DISABLED is set")
        return plan
    env["CUDA_INJECTION64_PATH"] = str(library)
    plan.cupti = find_cupti(env)
    if plan.cupti is not None:
        env["OTEL_GPU_CENSUS_CUPTI"] = str(plan.cupti)
    elif env.get("OTEL_GPU_CENSUS_CUPTI"):
        plan.warnings.append(f"OTEL_GPU_CENSUS_CUPTI={env['OTEL_GPU_CENSUS_CUPTI']} does not exist; "
                             "the injector will say whether it finds another libcupti")
    plan.census_on = True
    return plan


# `run`'s census when neither --activity nor OTEL_GPU_CENSUS_ACTIVITY names one: counted at the calls by the library
# preloaded, kernel durations from gated CUDA event pairs, CUPTI never loaded. CUPTI set up at all, even paused, slowed
# vLLM to 0.84-0.89 of a plain one (measurements §20, §25); counting at the calls cost it nothing measurable (§22), and
# the pairs' kernel time a token was 1.06 (llama-server) and 1.09 (vLLM) of every kernel traced (§26). The injector's
# own default, for a process CUDA loads it into without `run` (no preload), stays the activity census.
RUN_DEFAULT_ACTIVITY = "events"


def choose_activity(plan: LaunchPlan, asked: Optional[str], kernels_asked: bool = False) -> str:
    """The census `run` gives its command: --activity, else OTEL_GPU_CENSUS_ACTIVITY as set, else the activity census
    when --kernels asked for CUPTI's kernel records, else RUN_DEFAULT_ACTIVITY. Written into the child's environment."""
    have = plan.env.get("OTEL_GPU_CENSUS_ACTIVITY", "").strip()
    chosen = asked or have or ("on" if kernels_asked else RUN_DEFAULT_ACTIVITY)
    if chosen != have:
        plan.env["OTEL_GPU_CENSUS_ACTIVITY"] = chosen
    if plan.census_on and plan.cupti is None and chosen.lower() in ("on", "windows"):
        from .extras import needs
        plan.warnings.append(f"no {CUPTI_SONAME} found: {needs('cupti')} (or a CUDA toolkit's, or "
                             "OTEL_GPU_CENSUS_CUPTI=PATH)")
    return chosen


def preload_for_calls(plan: LaunchPlan) -> None:
    """OTEL_GPU_CENSUS_ACTIVITY=off, =windows and =events count every launch, copy and memset at its CUDA call. Preloaded
    (LD_PRELOAD, the same file as CUDA_INJECTION64_PATH: one copy in the process), the library sees those
    calls itself and CUPTI is never loaded (windows: only for its windows); without it, CUPTI's callbacks see
    them, at ~1.3 µs a launch (docs/measurements.md §21, §22), and windows and events fall back to the activity
    census.
    OTEL_GPU_CENSUS_PRELOAD=off keeps CUPTI's callbacks."""
    env = plan.env
    if not plan.census_on or plan.library is None or \
            env.get("OTEL_GPU_CENSUS_ACTIVITY", "").lower() not in ("off", "windows", "events"):
        return
    want = env.get("OTEL_GPU_CENSUS_PRELOAD", "").strip().lower()
    if want in ("off", "0", "false", "no"):
        return
    if want not in ("", "on", "1", "true", "yes"):
        plan.warnings.append(f"OTEL_GPU_CENSUS_PRELOAD={env['OTEL_GPU_CENSUS_PRELOAD']!r} is neither on nor off: "
                             "preloading the census library (on)")
    lib = str(plan.library)
    have = [p for p in env.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p]
    if lib not in have:
        env["LD_PRELOAD"] = ":".join([lib] + have)
