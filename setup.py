"""Builds the native injector into the package (src/otel_gpu_census/_lib/) during `pip install`.

The C library is not a Python extension (CUDA loads it by path), so it is built with the plain
Makefile in native/, against the CUPTI headers of the nvidia-cuda-cupti build dependency.
"""
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

ROOT = Path(__file__).resolve().parent


def cuda_include() -> str:
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec else []:
        inc = Path(base) / "cu13" / "include"
        if (inc / "cupti.h").exists() and (inc / "cuda.h").exists():
            return str(inc)
    sys.exit("otel-gpu-census: CUPTI headers not found; install nvidia-cuda-cupti, nvidia-cuda-runtime "
             "and nvidia-cuda-crt (>= 13.5), or build with pip's default build isolation")


def missing_build_tools(env=os.environ) -> str:
    """One line saying which of the build's tools (make, a C compiler: $CC, else cc) are not on PATH; "" when
    both are."""
    cc = (shlex.split(env.get("CC", "")) or ["cc"])[0]
    path = env.get("PATH", os.defpath)
    missing = [f"`{tool}`" for tool in ("make", cc) if shutil.which(tool, path=path) is None]
    if not missing:
        return ""
    return (f"otel-gpu-census: building the native census library needs make and a C compiler; "
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not on PATH (Debian/Ubuntu: "
            f"apt-get install make gcc; or set CC to your compiler), then run pip again")


class BuildWithNative(build_py):
    def run(self):
        missing = missing_build_tools()
        if missing:
            sys.exit(missing)
        build = ROOT / "build" / "native"
        subprocess.run(["make", "-s", "-C", str(ROOT / "native"), f"BUILD={build}",
                        f"CUPTI_INCLUDE={cuda_include()}", f"PYTHON={sys.executable}"], check=True)
        super().run()
        dest = Path(self.build_lib) / "otel_gpu_census" / "_lib"
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy2(build / "libotel_gpu_census.so", dest)
        shutil.copy2(ROOT / "native" / "include" / "gpu_census.h", dest)
        shutil.copy2(ROOT / "native" / "include" / "gpu_census_settings.def", dest)


class BinaryDistribution(Distribution):
    """The wheel carries a native library: tag it for the platform."""

    def has_ext_modules(self):
        return True


if __name__ == "__main__":       # as setuptools runs it (tests import the checks above)
    setup(cmdclass={"build_py": BuildWithNative}, distclass=BinaryDistribution)
