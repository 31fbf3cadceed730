"""`run` exits with its command's code whatever happens to its own stderr after the command ended (a
pipe whose reader has gone, stderr closed, a full disk), and its command does not outlive a `run`
that was SIGKILLed. Real processes, real file descriptors."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from run_env import run_env

pytestmark = pytest.mark.timeout(60)


_env = run_env


def _run_cmd(census_dir, script):
    return [sys.executable, "-m", "otel_gpu_census.cli", "run", "--dir", str(census_dir), "--", "sh", "-c", script]


def test_exit_code_survives_a_stderr_pipe_whose_reader_has_gone(tmp_path, native, census_dir):
    """The reader goes while the command runs; `run`'s report then meets EPIPE."""
    ready = tmp_path / "ready"
    p = subprocess.Popen(_run_cmd(census_dir, f'touch {ready}; sleep 0.5; exit 4'),
                         env=_env(tmp_path, native), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while not ready.exists():
        assert p.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    p.stderr.close()                          # the reader is gone before the report is written
    assert p.wait(30) == 4


def test_exit_code_survives_a_closed_stderr(tmp_path, native, census_dir):
    p = subprocess.run(_run_cmd(census_dir, "exit 4"), env=_env(tmp_path, native), stdout=subprocess.PIPE,
                       stderr=subprocess.DEVNULL, timeout=30, preexec_fn=lambda: os.close(2))
    assert p.returncode == 4
    assert p.stdout == b""                    # nothing of run's went to stdout instead


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_exit_code_survives_a_full_disk(tmp_path, native, census_dir):
    with open("/dev/full", "w") as full:
        p = subprocess.run(_run_cmd(census_dir, "exit 4"), env=_env(tmp_path, native), stderr=full,
                           stdout=subprocess.PIPE, timeout=30)
    assert p.returncode == 4 and p.stdout == b""


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_a_failing_stderr_loses_nothing_else_and_success_stays_0(tmp_path, native, census_dir):
    out = tmp_path / "report.json"
    with open("/dev/full", "w") as full:
        p = subprocess.run([sys.executable, "-m", "otel_gpu_census.cli", "run", "--dir", str(census_dir), "--json",
                            str(out), "--", "sh", "-c", "echo hello"],
                           env=_env(tmp_path, native), stderr=full, stdout=subprocess.PIPE, timeout=30)
    assert p.returncode == 0 and p.stdout == b"hello\n"
    assert '"processes"' in out.read_text()   # the JSON report is still written


def test_run_killed_takes_its_command_with_it(tmp_path, native, census_dir):
    """SIGKILL cannot be forwarded; the command must not run on, orphaned."""
    pidfile, ready = tmp_path / "pid", tmp_path / "ready"
    p = subprocess.Popen(_run_cmd(census_dir, f'echo $$ > {pidfile}; touch {ready}; while :; do sleep 0.05; done'),
                         env=_env(tmp_path, native), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    deadline = time.monotonic() + 20
    while not ready.exists():
        assert p.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    child = int(pidfile.read_text())
    try:
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        deadline = time.monotonic() + 5
        alive = True
        while alive and time.monotonic() < deadline:
            try:
                with open(f"/proc/{child}/stat") as f:
                    alive = f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
            except FileNotFoundError:
                alive = False
            time.sleep(0.05)
        assert not alive, "the command outlived run"
    finally:
        for kill, who in ((os.killpg, p.pid), (os.kill, child)):
            try:
                kill(who, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
