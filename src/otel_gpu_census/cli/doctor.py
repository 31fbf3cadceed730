"""`otel-gpu-census doctor`: can the census run here, and if not, why — in plain words.

Each line is OK, WARN or FAIL with the reason. FAIL means `run` would not count anything; WARN
means it counts, with something missing (NVML metrics, GPM occupancy). Exit 0 when the census
can run, 1 otherwise. Every probe is guarded: on a machine without a GPU each check says why,
and nothing raises.
"""
from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional

OK, WARN, FAIL = "OK", "WARN", "FAIL"


@dataclass
class Check:
    status: str
    what: str
    detail: str


@dataclass
class Facts:
    """What earlier checks learnt that later ones compare against."""
    driver_cuda: Optional[tuple] = None      # (major, minor) of the CUDA version the driver supports
    library: Optional[Path] = None


def _cuda_version(v: int) -> tuple:
    return v // 1000, (v % 1000) // 10


def check_driver(facts: Facts) -> List[Check]:
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return [Check(FAIL, "NVIDIA driver", f"libcuda.so.1 cannot be loaded ({e}): no NVIDIA driver on this "
                      "machine, or it is not on the library path (inside a container: run with the NVIDIA "
                      "container toolkit, e.g. --gpus all)")]
    v = ctypes.c_int(0)
    rc = cuda.cuDriverGetVersion(ctypes.byref(v))
    if rc != 0 or v.value <= 0:
        return [Check(FAIL, "NVIDIA driver", f"libcuda.so.1 loads but cuDriverGetVersion failed (CUresult {rc})")]
    facts.driver_cuda = _cuda_version(v.value)
    return [Check(OK, "NVIDIA driver", "libcuda.so.1 loads; the driver supports CUDA %d.%d" % facts.driver_cuda)]


def check_nvml(facts: Facts) -> List[Check]:
    try:
        import pynvml
    except ImportError:
        return [Check(WARN, "NVML", "the nvidia-ml-py package is not installed: no GPU utilisation or memory "
                      "metrics (pip install nvidia-ml-py)")]
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return [Check(WARN, "NVML", f"cannot initialise NVML ({e}): no GPU utilisation or memory metrics; "
                      "the kernel and copy census does not need NVML")]
    out = []
    try:
        drv = pynvml.nvmlSystemGetDriverVersion()
        drv = drv.decode() if isinstance(drv, bytes) else drv
        n = pynvml.nvmlDeviceGetCount()
        out.append(Check(OK if n else WARN, "NVML", f"driver {drv}, {n} GPU(s)" + ("" if n else ": no GPU visible")))
        for i in range(n):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else name
            try:
                gpm = bool(pynvml.nvmlGpmQueryDeviceSupport(h).isSupportedDevice)
                why = "" if gpm else ": GPM needs a Hopper-or-newer data-centre GPU"
            except pynvml.NVMLError as e:
                gpm, why = False, f" ({e})"
            out.append(Check(OK if gpm else WARN, f"GPU {i}",
                             f"{name}: GPM {'supported: SM occupancy can be read' if gpm else 'not supported'}"
                             f"{why}"))
    except pynvml.NVMLError as e:
        out.append(Check(WARN, "NVML", f"NVML query failed: {e}"))
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
    return out


def _cupti_version(path: Path) -> Optional[tuple]:
    """(major, minor) from cuptiGetVersion, else from the wheel's metadata, else the soname major."""
    try:
        lib = ctypes.CDLL(str(path))
        v = ctypes.c_uint32(0)
        if lib.cuptiGetVersion(ctypes.byref(v)) == 0 and v.value >= 10000:
            return v.value // 10000, (v.value // 100) % 100
    except OSError:
        pass
    try:
        from importlib import metadata
        for dist in ("nvidia-cuda-cupti", "nvidia-cuda-cupti-cu13"):
            try:
                files = metadata.files(dist) or []
                if any(Path(str(f.locate())).resolve() == path.resolve() for f in files):
                    major, minor = metadata.version(dist).split(".")[:2]
                    return int(major), int(minor)
            except metadata.PackageNotFoundError:
                continue
    except Exception:
        pass
    return None


def check_cupti(facts: Facts) -> List[Check]:
    from otel_gpu_census.cli.launcher import CUPTI_SONAME, find_cupti
    path = find_cupti()
    if path is None:
        where = os.environ.get("OTEL_GPU_CENSUS_CUPTI")
        detail = (f"OTEL_GPU_CENSUS_CUPTI={where} does not exist" if where else
                  f"{CUPTI_SONAME} not found in the nvidia-cuda-cupti wheel, ldconfig's cache or /usr/local/cuda")
        from otel_gpu_census.extras import install_line
        return [Check(WARN, "CUPTI", f"{detail}: the default census does not need it, the precise one "
                      f"(run --precise) does: {install_line('cupti')}")]
    try:
        ctypes.CDLL(str(path))
    except OSError as e:
        return [Check(FAIL, "CUPTI", f"{path} cannot be loaded: {e}")]
    ver = _cupti_version(path)
    out = [Check(OK, "CUPTI", f"{path}" + (" (version %d.%d)" % ver if ver else ""))]
    major = ver[0] if ver else 13           # libcupti.so.13 is CUPTI 13.x
    if facts.driver_cuda is None:
        out.append(Check(WARN, "CUPTI and driver", f"CUPTI {major}.x needs a driver for CUDA {major} or newer; "
                         "no driver found to compare with"))
    elif facts.driver_cuda[0] < major:
        out.append(Check(FAIL, "CUPTI and driver", f"CUPTI {major}.x needs a driver for CUDA {major} or newer, "
                         "and this driver supports CUDA %d.%d: update the driver" % facts.driver_cuda))
    else:
        out.append(Check(OK, "CUPTI and driver", f"CUPTI {major}.x works with this driver (CUDA "
                         "%d.%d)" % facts.driver_cuda))
    return out


def check_injector(facts: Facts) -> List[Check]:
    from otel_gpu_census import _native
    path = _native.find_library()
    if path is None:
        where = ", ".join(str(p) for p in _native.library_candidates())
        return [Check(FAIL, "injector", f"{_native.LIB_NAME} not found (looked in: {where}); reinstall the "
                      "package, or `make -C native` in a source checkout")]
    try:
        version = _native.load_library().gc_layout_version()
    except _native.NativeError as e:
        return [Check(FAIL, "injector", str(e))]
    except AttributeError:
        return [Check(FAIL, "injector", f"{path} has no gc_layout_version: not the census library")]
    if version != _native.LAYOUT_VERSION:
        return [Check(FAIL, "injector", f"{path} writes segment layout {version} but this reader reads "
                      f"{_native.LAYOUT_VERSION}: library and Python package are from different builds")]
    facts.library = path
    return [Check(OK, "injector", f"{path} loads (segment layout {version})")]


# Run in a child with the library preloaded: who answers the driver's cuGetProcAddress_v2 lookup.
_PRELOAD_PROBE = r"""
import ctypes, sys
try:
    cu = ctypes.CDLL("libcuda.so.1")
except OSError:
    print("no-driver"); sys.exit(0)
try:
    addr = ctypes.cast(cu.cuGetProcAddress_v2, ctypes.c_void_p).value
except AttributeError:
    print("no-gpa"); sys.exit(0)
class Info(ctypes.Structure):
    _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p), ("sname", ctypes.c_char_p), ("saddr", ctypes.c_void_p)]
info = Info()
ok = ctypes.CDLL(None).dladdr(ctypes.c_void_p(addr), ctypes.byref(info))
print("answered-by", (info.fname or b"?").decode() if ok else "?")
"""


def check_preload(facts: Facts) -> List[Check]:
    """`run`'s default collector counts through the library preloaded (no CUPTI): does it answer the driver's
    lookups here? A child process with LD_PRELOAD looks cuGetProcAddress_v2 up as the CUDA runtime does."""
    import subprocess
    if facts.library is None:
        return []
    env = dict(os.environ, LD_PRELOAD=str(facts.library))
    env.pop("CUDA_INJECTION64_PATH", None)
    try:
        p = subprocess.run([sys.executable, "-c", _PRELOAD_PROBE], env=env, capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return [Check(WARN, "preload", f"could not try `run`'s preload: {e}")]
    out = p.stdout.split()
    if p.returncode != 0 or not out:
        return [Check(WARN, "preload", "a process with the library preloaded failed ("
                      + (p.stderr.strip().splitlines() or ["no output"])[-1] + "): the default collector needs it; "
                      "`run --precise` (CUPTI) needs no preload")]
    if out[0] in ("no-driver", "no-gpa"):
        return [Check(WARN, "preload", "no CUDA driver with cuGetProcAddress_v2 to look up: whether `run` "
                      "can count without CUPTI (its default collector) is not known here")]
    who = out[-1]
    if Path(who).resolve() == Path(facts.library).resolve():
        return [Check(OK, "preload", "`run` (the default collector): the library preloaded answers the driver's "
                      "lookups, so it counts every launch, copy and memset with no CUPTI loaded")]
    return [Check(WARN, "preload", f"the driver's cuGetProcAddress_v2 came from {who}, not the census library: "
                  "the default collector will count through CUPTI instead (another preload or interposer first?)")]


def check_census_dir(facts: Facts) -> List[Check]:
    import tempfile
    from otel_gpu_census.census import folder
    try:
        d = folder.census_dir()
        with tempfile.NamedTemporaryFile(dir=d, prefix=".doctor-"):
            pass
    except folder.CensusDirError as e:
        return [Check(FAIL, "census folder", str(e))]
    except OSError as e:
        return [Check(FAIL, "census folder", f"cannot write in it: {e}")]
    return [Check(OK, "census folder", f"{d} (private, writable)")]


def check_environment(facts: Facts) -> List[Check]:
    env = os.environ
    out = []
    current = env.get("CUDA_INJECTION64_PATH")
    if current and (facts.library is None or Path(current).resolve() != facts.library.resolve()):
        out.append(Check(FAIL, "CUDA_INJECTION64_PATH", f"already set to {current} (another tool, e.g. Nsight): "
                         "CUDA loads one injector, so `run` leaves it and the census stays off; unset it"))
    from otel_gpu_census import settings
    if settings.disabled(env):
        out.append(Check(FAIL, "OTEL_GPU_CENSUS_DISABLED", "is set: the injector switches itself off"))
    profiler_hints = sorted(k for k in env if k.startswith(("NSYS_", "NSIGHT_", "NV_NSIGHT", "NCU_")))
    preload = env.get("LD_PRELOAD", "")
    if "ToolsInjection" in preload or "nsys" in preload:
        profiler_hints.append("LD_PRELOAD")
    if profiler_hints:
        out.append(Check(WARN, "profiler", "this shell looks like it runs under Nsight ("
                         + ", ".join(profiler_hints) + "): up to CUDA 13.4 CUPTI takes one client per process, "
                         "so the census and the profiler would get in each other's way"))
    if not out:
        out.append(Check(OK, "environment", "no other CUDA injector or profiler set"))
    return out


def check_exporters(facts: Facts) -> List[Check]:
    """Exporters are optional: one that cannot be imported is a warning saying why (a missing extra: which)."""
    from otel_gpu_census.extras import missing
    from otel_gpu_census.telemetry.setup import exporter_class
    ok, out = [], []
    for label, entry in (("OTLP grpc", "otlp_proto_grpc"), ("OTLP http/protobuf", "otlp_proto_http")):
        try:
            exporter_class(entry, "metrics")
            ok.append(label)
        except Exception as e:
            out.append(Check(WARN, f"{label} exporter", f"{type(e).__name__}: {e}; spans and metrics cannot go "
                             "out this way"))
    try:
        lacking = missing("prometheus")
    except ImportError as e:
        lacking = f"{type(e).__name__}: {e}"
    if lacking:
        out.append(Check(WARN, "Prometheus exporter", lacking))
    else:
        ok.append("Prometheus")
    if ok:
        out.insert(0, Check(OK, "metrics exporters", ", ".join(ok) + " can be imported"))
    return out


CHECKS: List[Callable[[Facts], List[Check]]] = [
    check_driver, check_nvml, check_cupti, check_injector, check_preload, check_census_dir, check_environment,
    check_exporters]


def run_checks() -> List[Check]:
    facts = Facts()
    out: List[Check] = []
    for check in CHECKS:
        name = check.__name__.replace("check_", "").replace("_", " ")
        try:
            out.extend(check(facts))
        except ImportError as e:   # a broken install: the package's own modules cannot load
            out.append(Check(FAIL, name, str(e) if "reinstall" in str(e) else f"{e} (reinstall otel-gpu-census)"))
        except Exception as e:     # a probe must never end the diagnosis
            out.append(Check(FAIL, name, f"unexpected error: {type(e).__name__}: {e}"))
    return out


def main(stream=None) -> int:
    stream = stream or sys.stdout
    checks = run_checks()
    width = max(len(c.what) for c in checks)
    for c in checks:
        print(f"{c.status:<5} {c.what:<{width}}  {c.detail}", file=stream)
    fails = [c for c in checks if c.status == FAIL]
    if fails:
        print(f"\nthe census cannot run here: {len(fails)} problem(s) marked FAIL above", file=stream)
        return 1
    print("\nthe census can run here", file=stream)
    return 0
