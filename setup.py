"""Builds the native injector into the package (src/otel_gpu_census/_lib/) during `pip install`.

The C library is not a Python extension (CUDA loads it by path), so it is built with the plain
Makefile in native/, against the CUPTI headers of the nvidia-cuda-cupti build dependency.
"""
import importlib.util
import os
import shlex
import shutil
import struct
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


# What a manylinux wheel may link against besides glibc's own symbol versions (PEP 600 and the manylinux policies:
# the libraries every glibc system has)
MANYLINUX_LIBS = {"libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1",
                  "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1"}


def elf_needs(path) -> tuple:
    """(the libraries a 64-bit little-endian ELF shared library names as NEEDED, the GLIBC_x.y versions of its
    symbols as (x, y)), read from its dynamic and version-needs sections; ((), ()) for anything else."""
    data = Path(path).read_bytes()
    if data[:6] != b"\x7fELF\x02\x01":
        return (), ()
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]

    def string(strtab, at):
        start = sections[strtab][4] + at
        return data[start:data.index(b"\0", start)].decode()

    needed, versions = [], set()
    for _name, kind, _flags, _addr, off, size, link, _info, _align, _entsize in sections:
        if kind == 6:                                   # SHT_DYNAMIC: (tag, value) pairs; DT_NEEDED is 1
            for at in range(off, off + size, 16):
                tag, val = struct.unpack_from("<qQ", data, at)
                if tag == 1:
                    needed.append(string(link, val))
        elif kind == 0x6FFFFFFE:                        # SHT_GNU_verneed: one entry per library, its versions
            at = off
            while True:
                _v, count, _file, aux, nxt = struct.unpack_from("<HHIII", data, at)
                a = at + aux
                for _ in range(count):
                    _hash, _f, _o, name, anext = struct.unpack_from("<IHHII", data, a)
                    version = string(link, name)
                    if version.startswith("GLIBC_") and version[6:].replace(".", "").isdigit():
                        versions.add(tuple(int(n) for n in version[6:].split(".")[:2]))
                    a += anext
                if not nxt:
                    break
                at += nxt
    return tuple(needed), tuple(sorted(versions))


def wheel_platform(library, default: str) -> str:
    """The wheel's platform tag: manylinux_X_Y_<arch> for the newest glibc symbol version the library needs (the
    library is plain C loaded by path, so any CPython on a glibc at least that new can use it); the default tag
    when the library links something no manylinux system is sure to have, or is not built against glibc."""
    needed, glibc = elf_needs(library)
    arch = default[len("linux_"):]
    if not default.startswith("linux_") or arch not in ("x86_64", "aarch64") or not glibc or \
            not set(needed) <= MANYLINUX_LIBS:
        return default
    major, minor = max(glibc)
    return f"manylinux_{major}_{minor}_{arch}"


def platform_wheel():
    """bdist_wheel tagging the wheel py3-none-<platform>: it holds no Python extension, only a C library that cffi
    loads by path, so any Python 3 can use it on the platform the library was built for (the glibc it needs, said in
    the tag). Imported here: setuptools has bdist_wheel from 70.1 (the build asks for 77), the tests import this
    file under older ones."""
    from setuptools.command.bdist_wheel import bdist_wheel

    class PlatformWheel(bdist_wheel):
        def get_tag(self):
            _python, _abi, plat = super().get_tag()
            if self.plat_name_supplied:                 # --plat-name: the builder's word
                return "py3", "none", plat
            library = Path(self.bdist_dir) / "otel_gpu_census" / "_lib" / "libotel_gpu_census.so"
            return "py3", "none", wheel_platform(library, plat)
    return PlatformWheel


class BinaryDistribution(Distribution):
    """The wheel carries a native library: tag it for the platform."""

    def has_ext_modules(self):
        return True


if __name__ == "__main__":       # as setuptools runs it (tests import the checks above)
    setup(cmdclass={"build_py": BuildWithNative, "bdist_wheel": platform_wheel()}, distclass=BinaryDistribution)
