"""Census folders a careless or hostile setup hands the commands: another user's default folder, a
symbolic link at the default path, a name too long for the system, a folder the user cannot enter.
Each gets one clear message (no traceback), and nothing is read from or written to a folder the user
did not choose."""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from otel_gpu_census.census import folder, proctree, reader
from otel_gpu_census.integrations.llamacpp.config import ProxyConfig

pytestmark = pytest.mark.timeout(60)
SRC = Path(__file__).resolve().parents[2] / "src"
NOBODY = 65534
LONG = "/tmp/" + "d" * 5000


def _env(tmp_path, native=None, **extra):
    e = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "CUDA_INJECTION"))}
    e["PYTHONPATH"] = str(SRC)
    e["XDG_RUNTIME_DIR"] = str(tmp_path / "xdg")
    (tmp_path / "xdg").mkdir(mode=0o700, exist_ok=True)
    if native is not None:
        e["OTEL_GPU_CENSUS_LIB"] = native[2]
    e.update(extra)
    return e


def _cli(env, *args, module="otel_gpu_census.cli"):
    p = subprocess.run([sys.executable, "-m", module, *args], env=env, capture_output=True, text=True, timeout=30)
    assert "Traceback" not in p.stderr, p.stderr
    return p


def _foreign_default(tmp_path, segments=None):
    """The default folder ($XDG_RUNTIME_DIR/otel-gpu-census), made another user's, with a segment."""
    d = tmp_path / "xdg" / "otel-gpu-census"
    d.mkdir(parents=True, mode=0o700)
    if segments is not None:
        segments.segment(d, [], comm="planted", pid=4242, start_ticks=1)
    if os.getuid() == 0:
        os.chown(d, NOBODY, NOBODY)
        return d, f"belongs to uid {NOBODY}"
    d.chmod(0o777)        # not root: a folder open to others stands for one another user controls
    return d, "writable by group or others"


# ---- the default folder belongs to someone else -------------------------------------------------

def test_report_refuses_a_default_folder_of_another_user(tmp_path, segments):
    d, why = _foreign_default(tmp_path, segments)
    p = _cli(_env(tmp_path), "report")
    assert p.returncode == 1 and p.stdout == ""
    assert why in p.stderr and "to read it anyway, name it: report" in p.stderr
    assert p.stderr.count("\n") == 1


def test_report_reads_another_users_folder_when_named(tmp_path, segments):
    d, _ = _foreign_default(tmp_path, segments)
    p = _cli(_env(tmp_path), "report", str(d))
    assert p.returncode == 0 and "planted" in p.stdout


def test_proxy_does_not_read_a_default_folder_of_another_user(tmp_path, segments, monkeypatch, caplog):
    from otel_gpu_census.integrations.llamacpp.server import _default_source
    d, why = _foreign_default(tmp_path, segments)
    for k in [k for k in os.environ if k.startswith("OTEL_GPU_CENSUS")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    with caplog.at_level(logging.WARNING, logger="otel_gpu_census.proxy"):
        assert _default_source(ProxyConfig(upstream="http://127.0.0.1:9")) is None
    assert why in caplog.text and "spans carry no GPU cost" in caplog.text
    # named on purpose, it is read
    assert _default_source(ProxyConfig(upstream="http://127.0.0.1:9", census_dir=str(d))) is not None


# ---- a symbolic link at the default path -----------------------------------------------------------

def test_run_refuses_a_symlink_at_the_default_path(tmp_path, native):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (tmp_path / "xdg").mkdir(mode=0o700)
    (tmp_path / "xdg" / "otel-gpu-census").symlink_to(elsewhere)
    marker = tmp_path / "ran"
    p = _cli(_env(tmp_path, native), "run", "--", "touch", str(marker))
    assert p.returncode == 1 and "is a symbolic link" in p.stderr
    assert not marker.exists()


def test_run_resolves_a_folder_the_user_names_through_a_link(tmp_path, native):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    p = _cli(_env(tmp_path, native), "run", "--dir", str(tmp_path / "link"), "--", "sh", "-c",
             'echo "$OTEL_GPU_CENSUS_DIR"')
    # the injector refuses a census folder reached through a link; run hands it the real one
    assert p.returncode == 0 and p.stdout.strip() == str(real)


def test_report_refuses_a_symlink_at_the_default_path(tmp_path, segments):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    segments.segment(elsewhere, [], comm="planted", pid=4242, start_ticks=1)
    (tmp_path / "xdg").mkdir(mode=0o700)
    (tmp_path / "xdg" / "otel-gpu-census").symlink_to(elsewhere)
    p = _cli(_env(tmp_path), "report")
    assert p.returncode == 1 and "is a symbolic link" in p.stderr and "planted" not in p.stdout


# ---- names too long, folders that cannot be entered ----------------------------------------------

@pytest.mark.parametrize("args", [("run", "--dir", LONG, "--", "true"), ("report", LONG),
                                  ("report", LONG + "/gpu-census-1-1.seg")])
def test_a_name_too_long_is_one_message(tmp_path, native, args):
    p = _cli(_env(tmp_path, native), *args)
    assert p.returncode == 1
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and "File name too long" in lines[0] and len(lines[0]) < 400


def test_proxy_with_a_census_dir_too_long_says_so_and_serves(tmp_path, caplog):
    from otel_gpu_census.integrations.llamacpp.server import _default_source
    with caplog.at_level(logging.WARNING, logger="otel_gpu_census.proxy"):
        assert _default_source(ProxyConfig(upstream="http://127.0.0.1:9", census_dir=LONG)) is None
    assert "File name too long" in caplog.text and len(caplog.text) < 600


def _python_for_nobody():
    """A Python the user nobody can run with this checkout's package importable, or None."""
    import cffi
    site = str(Path(cffi.__file__).resolve().parents[1])
    for exe in (sys.executable, shutil.which("python3")):
        if not exe:
            continue
        cmd = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", exe, "-c",
               "import otel_gpu_census.cli.main, otel_gpu_census.report.render, otel_gpu_census.census.reader"]
        env = {"PYTHONPATH": os.pathsep.join([str(SRC), site]), "PATH": os.environ.get("PATH", "")}
        try:
            if subprocess.run(cmd, env=env, capture_output=True, timeout=30).returncode == 0:
                return exe, env
        except OSError:
            return None
    return None


def test_report_of_a_file_in_a_folder_the_user_cannot_enter(tmp_path, segments):
    if os.getuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to run the command as the user nobody")
    found = _python_for_nobody()
    if found is None:
        pytest.skip("no Python here that the user nobody can run with this package importable")
    exe, env = found
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o700)
    seg = segments.segment(locked, [], pid=4242, start_ticks=1)
    os.chmod(tmp_path, 0o755)
    cmd = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", exe, "-m", "otel_gpu_census.cli"]
    for target in (seg, locked):
        p = subprocess.run(cmd + ["report", str(target)], env=env, capture_output=True, text=True, timeout=30,
                           cwd="/")
        assert "Traceback" not in p.stderr, p.stderr
        assert p.returncode == 1 and "Permission denied" in p.stderr and p.stderr.count("\n") == 1, p.stderr


def test_census_dir_never_raises_oserror(tmp_path):
    with pytest.raises(folder.CensusDirError, match="File name too long"):
        folder.census_dir(LONG)
    with pytest.raises(folder.CensusDirError, match="File name too long"):
        folder.readable_dir(LONG)
