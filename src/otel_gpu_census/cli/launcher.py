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
import re
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
    from otel_gpu_census import _native
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
    from otel_gpu_census import settings
    if settings.disabled(env):
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


# a sanitizer's runtime must be the first library of a process (ASan, TSan, ...): LD_PRELOAD keeps it before ours
SANITIZER_RUNTIME = re.compile(r"^lib(?:a|t|m|hwa)san\.so\b")


def census_env(census_dir: Path, precise: bool = False, base: Optional[Mapping[str, str]] = None,
               library: Optional[Path] = None) -> LaunchPlan:
    """The environment of a command under the census, as `run` gives it and `env` prints it: the injector, the census
    folder and the collector. The default collector counts every launch, copy and memset at its CUDA call through the
    library preloaded (LD_PRELOAD, the same file as CUDA_INJECTION64_PATH: one copy in the process) and times kernels
    with CUDA event pairs, CUPTI never loaded; `precise` (or OTEL_GPU_CENSUS_COLLECTOR=precise) takes CUPTI's
    measured records of every kernel and copy instead, at CUPTI's price on every CUDA call."""
    plan = build_env(census_dir, base, library)
    from otel_gpu_census import settings
    have, warning = settings.choice("COLLECTOR", plan.env)
    if warning:
        plan.warnings.append(warning)
    collector = "precise" if precise else have
    plan.env["OTEL_GPU_CENSUS_COLLECTOR"] = collector
    if collector == "default" and plan.census_on and plan.library is not None:
        lib = str(plan.library)
        kept = [p for p in plan.env.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p]
        if lib not in kept:
            first = [p for p in kept if SANITIZER_RUNTIME.match(os.path.basename(p))]
            plan.env["LD_PRELOAD"] = ":".join(first + [lib] + [p for p in kept if p not in first])
    if collector == "precise" and plan.census_on and plan.cupti is None:
        from otel_gpu_census.extras import needs
        plan.warnings.append(f"no {CUPTI_SONAME} found: {needs('cupti')} (or a CUDA toolkit's, or "
                             "OTEL_GPU_CENSUS_CUPTI=PATH)")
    return plan


CENSUS_VARIABLES = ("CUDA_INJECTION64_PATH", "LD_PRELOAD", "OTEL_GPU_CENSUS_DIR", "OTEL_GPU_CENSUS_CUPTI",
                    "OTEL_GPU_CENSUS_COLLECTOR")


def census_variables(plan: LaunchPlan) -> Dict[str, str]:
    """The census variables of `plan`'s environment: what `env` prints."""
    return {k: plan.env[k] for k in CENSUS_VARIABLES if plan.env.get(k)}
