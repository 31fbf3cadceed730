"""The wheel's tag (setup.py): py3-none-manylinux_X_Y_<arch>, X.Y the newest glibc symbol version the census library
needs, read from the library itself; tests/install_paths.sh installs a wheel built on one Python into another."""
import re
import runpy
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SETUP = runpy.run_path(str(ROOT / "setup.py"), run_name="not_main")


def readelf(*args):
    if shutil.which("readelf") is None:
        pytest.skip("readelf (binutils) is not on PATH: nothing independent to check the ELF reading against")
    return subprocess.run(["readelf", "-W", *args], capture_output=True, text=True, check=True).stdout


def test_the_library_needs_read_as_readelf_reads_them(native):
    path = native[2]
    needed, glibc = SETUP["elf_needs"](path)
    assert list(needed) == re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", readelf("-d", path))
    versions = {tuple(int(n) for n in v.split(".")[:2])
                for v in re.findall(r"Name: GLIBC_(\d+\.\d+(?:\.\d+)?)\s", readelf("-V", path))}
    assert glibc and set(glibc) == versions


def test_the_tag_names_the_newest_glibc_the_library_needs(native):
    path = native[2]
    needed, glibc = SETUP["elf_needs"](path)
    if any(re.fullmatch(r"lib[a-z]*san\.so(\.\d+)*", n) for n in needed):   # make test-sanitized's library
        # it links a sanitizer's runtime beside glibc: manylinux would promise what it cannot keep
        assert SETUP["wheel_platform"](path, "linux_x86_64") == "linux_x86_64"
        return
    major, minor = max(glibc)
    assert SETUP["wheel_platform"](path, "linux_x86_64") == f"manylinux_{major}_{minor}_x86_64"
    assert SETUP["wheel_platform"](path, "macosx_14_0_arm64") == "macosx_14_0_arm64"


def test_a_library_that_links_beyond_glibc_keeps_the_plain_linux_tag(native, tmp_path):
    """manylinux promises only glibc's libraries: anything else linked and the tag says only linux_<arch>."""
    lib = Path(native[2])
    src = tmp_path / "uses.c"
    src.write_text("int gc_layout_version(void);\nint f(void) { return gc_layout_version(); }\n")
    out = tmp_path / "libuses.so"
    subprocess.run([shutil.which("cc") or "gcc", "-shared", "-fPIC", str(src), "-o", str(out), f"-L{lib.parent}",
                    "-lotel_gpu_census"], check=True)
    needed, _glibc = SETUP["elf_needs"](out)
    assert "libotel_gpu_census.so" in needed
    assert SETUP["wheel_platform"](out, "linux_x86_64") == "linux_x86_64"
    not_elf = tmp_path / "not.so"
    not_elf.write_bytes(b"#!/bin/sh\n")
    assert SETUP["elf_needs"](not_elf) == ((), ())
    assert SETUP["wheel_platform"](not_elf, "linux_x86_64") == "linux_x86_64"
