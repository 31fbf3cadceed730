"""The injector writes its segment only into the census folder it checked: a symbolic link planted at
the folder's path, or swapped in while processes start, never sends a segment elsewhere.

native/src/core/segment.c is compiled here with a small driver that forks N processes, each creating its
segment as the injector does on its first record (gc_segment_open), so hundreds of real creations
race a real swap of the folder for a link (renameat2 RENAME_EXCHANGE) in a few seconds.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)

DRIVER = r"""
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>
#include "internal.h"

int main(int argc, char **argv)
{
    int n = argc > 1 ? atoi(argv[1]) : 1, made = 0;
    for (int i = 0; i < n; i++) {
        pid_t pid = fork();
        if (pid == 0) {
            char path[4096];
            _exit(gc_segment_open(path, sizeof(path)) ? 0 : 1);
        }
        int status;
        if (pid > 0 && waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0)
            made++;
    }
    printf("%d\n", made);
    return 0;
}
"""


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    cc = os.environ.get("CC", "cc")
    if not shutil.which(cc):
        pytest.skip("no C compiler")
    import cupti_records
    d = tmp_path_factory.mktemp("segdriver")
    (d / "driver.c").write_text(DRIVER)
    exe = d / "driver"
    subprocess.run([cc, "-std=c11", "-O1", "-Wall", "-Werror",
                    f"-I{ROOT / 'native' / 'include'}", f"-I{ROOT / 'native' / 'src' / 'core'}",
                    f"-I{cupti_records.cupti_include()}", str(d / "driver.c"),
                    str(ROOT / "native" / "src" / "core" / "segment.c"), str(ROOT / "native" / "src" / "core" / "log.c"),
                    "-o", str(exe)], check=True)
    return exe


def create(driver, folder, n=1, quiet=False):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_GPU_CENSUS")}
    env["OTEL_GPU_CENSUS_DIR"] = str(folder)
    if quiet:
        env["OTEL_GPU_CENSUS_QUIET"] = "1"
    p = subprocess.run([str(driver), str(n)], env=env, capture_output=True, text=True, timeout=100)
    assert p.returncode == 0, p.stderr
    return int(p.stdout), p.stderr


def segs(folder):
    return sorted(Path(folder).glob("gpu-census-*.seg"))


def test_a_private_folder_gets_the_segment(driver, tmp_path):
    made, err = create(driver, tmp_path / "census")
    assert made == 1 and err == ""
    assert len(segs(tmp_path / "census")) == 1
    assert (tmp_path / "census").stat().st_mode & 0o777 == 0o700


def test_a_planted_symlink_is_refused_even_to_a_folder_of_ours(driver, tmp_path):
    # the link points at a private folder of this very user (say ~/.ssh): ownership checks pass
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    link = tmp_path / "census"
    link.symlink_to(elsewhere)
    made, err = create(driver, link)
    assert made == 0 and segs(elsewhere) == []
    assert f"census off: census folder {link} is a symbolic link" in err


def test_a_dangling_symlink_is_not_followed_to_create_a_folder(driver, tmp_path):
    link = tmp_path / "census"
    link.symlink_to(tmp_path / "target")
    made, err = create(driver, link)
    assert made == 0 and not (tmp_path / "target").exists() and "symbolic link" in err


def test_a_foreign_folder_is_refused(driver, tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    if os.getuid() == 0:
        os.chown(foreign, 65534, 65534)
        why = "must belong to uid 0"
    else:
        foreign.chmod(0o777)
        why = "not be group/world-writable"
    made, err = create(driver, foreign)
    assert made == 0 and segs(foreign) == [] and why in err


def test_a_name_too_long_is_one_line(driver, tmp_path):
    made, err = create(driver, tmp_path / ("x" * 5000))
    assert made == 0 and err.count("\n") == 1 and "longer than" in err


def _exchange():
    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "renameat2"):
        pytest.skip("libc has no renameat2")
    AT_FDCWD, RENAME_EXCHANGE = -100, 2

    def swap(a: Path, b: Path) -> None:
        if libc.renameat2(AT_FDCWD, bytes(a), AT_FDCWD, bytes(b), RENAME_EXCHANGE) != 0:
            raise OSError(ctypes.get_errno(), "renameat2")
    return swap


def test_a_symlink_swapped_in_during_start_up_never_gets_a_segment(driver, tmp_path):
    swap = _exchange()
    census = tmp_path / "census"
    census.mkdir(mode=0o700)
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o777)
    foreign.chmod(0o777)          # another user's folder, open to the victim: the old code wrote here
    if os.getuid() == 0:
        os.chown(foreign, 65534, 65534)
    decoy = tmp_path / "decoy"
    decoy.symlink_to(foreign)
    stop = threading.Event()
    swaps = [0]

    def swapper():
        while not stop.is_set():
            swap(census, decoy)     # census <-> the link, atomically, over and over
            swaps[0] += 1

    t = threading.Thread(target=swapper, daemon=True)
    t.start()
    try:
        made, _ = create(driver, census, n=300, quiet=True)
    finally:
        stop.set()
        t.join()
    if census.is_symlink():
        swap(census, decoy)
    assert swaps[0] > 300
    assert segs(foreign) == []
    real = segs(census) + segs(decoy) if not decoy.is_symlink() else segs(census)
    assert made == len(real) and made > 0      # every segment made is in the checked folder
