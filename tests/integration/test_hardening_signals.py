"""`run` passes every catchable signal to its command and keeps the command's exit code; from a
supervisor (no terminal) the command has its own process group and signals reach all of it, so a
shell's children stop with the shell. Real `sh -c` commands, real signals."""
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


def _start(tmp_path, native, census_dir, script):
    """`run -- sh -c script` in its own session (signals come from kill(), as from systemd or docker);
    returns once the script touched $READY."""
    ready = tmp_path / "ready"
    env = _env(tmp_path, native, READY=str(ready), PIDFILE=str(tmp_path / "pid"))
    p = subprocess.Popen([sys.executable, "-m", "otel_gpu_census.cli", "run", "--dir", str(census_dir), "--",
                          "sh", "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    deadline = time.monotonic() + 20
    while not ready.exists():
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.02)
    return p


def _gone(pid: int, timeout: float = 5.0) -> bool:
    """The process ended (or is a zombie waiting for its new parent to reap it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("name", ["USR1", "USR2", "WINCH", "ALRM", "PWR", "CONT"])
def test_every_catchable_signal_reaches_the_command(tmp_path, native, census_dir, name):
    p = _start(tmp_path, native, census_dir,
               f'trap "echo got-{name}; exit 42" {name}; touch "$READY"; while :; do sleep 0.05; done')
    try:
        p.send_signal(getattr(signal, f"SIG{name}"))
        out, err = p.communicate(timeout=20)
    finally:
        _kill_session(p)
    assert p.returncode == 42, err          # run lived on, and exits with the command's code
    assert out == f"got-{name}\n" and "Traceback" not in err


def _kill_session(p):
    """A launcher that failed may leave its command behind in the session it was started in."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if p.poll() is None:
        p.wait(10)


def test_sigterm_reaches_the_children_of_a_shell(tmp_path, native, census_dir):
    p = _start(tmp_path, native, census_dir, 'sleep 300 & echo $! > "$PIDFILE"; touch "$READY"; wait')
    sleeper = int((tmp_path / "pid").read_text())
    try:
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=20)
        assert p.returncode == 128 + signal.SIGTERM, err
        assert _gone(sleeper), "the shell's child survived the SIGTERM"
    finally:
        try:
            os.kill(sleeper, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_the_command_runs_in_its_own_process_group_under_a_supervisor(tmp_path, native, census_dir):
    p = _start(tmp_path, native, census_dir, 'ps -o pgid= -p $$ > "$PIDFILE"; touch "$READY"; echo $$; '
               'while :; do sleep 0.05; done')
    try:
        child_pgid = int((tmp_path / "pid").read_text())
        assert child_pgid != os.getpgid(p.pid)
    finally:
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=20)


def test_a_harmless_signal_after_the_command_ended_does_not_cut_the_report(tmp_path, native, census_dir):
    # SIGWINCH (a terminal resized) while the report is written must not end run with 128+28
    p = _start(tmp_path, native, census_dir, 'touch "$READY"; sleep 0.3; exit 7')
    deadline = time.monotonic() + 10
    while p.poll() is None and time.monotonic() < deadline:
        try:
            p.send_signal(signal.SIGWINCH)
        except ProcessLookupError:
            break
        time.sleep(0.01)
    _, err = p.communicate(timeout=20)
    assert p.returncode == 7 and "otel-gpu-census report" in err


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _until(pid: int, states: str, timeout: float = 5.0) -> str:
    deadline = time.monotonic() + timeout
    while _state(pid) not in states and time.monotonic() < deadline:
        time.sleep(0.02)
    return _state(pid)


def test_sigtstp_stops_the_command_with_run_and_sigcont_resumes_both(tmp_path, native, census_dir):
    p = _start(tmp_path, native, census_dir,
               'echo $$ > "$PIDFILE"; touch "$READY"; while :; do sleep 0.05; done')
    try:
        child = int((tmp_path / "pid").read_text())
        p.send_signal(signal.SIGTSTP)
        assert _until(child, "T") == "T"          # the server does not run on while `run` is stopped
        assert _until(p.pid, "T") == "T"
        p.send_signal(signal.SIGCONT)
        assert _until(child, "SR") in "SR" and _until(p.pid, "SR") in "SR"
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=20)
    finally:
        _kill_session(p)
    assert p.returncode == 128 + signal.SIGTERM and "Traceback" not in err
