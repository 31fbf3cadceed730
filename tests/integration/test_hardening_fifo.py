"""Nothing in a census folder may block a reader: a FIFO (or socket, device, symlink) named like a
segment is refused with a reason, never opened for a blocking read. Each reader is tried with a real
mkfifo under a timeout: `report`, `run` (its read after the command exits, and its tidy-up of the
default folder before the command starts) and the proxy's census thread."""
from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llama_standin import Standin
from otlp_receiver import OtlpReceiver
from otel_gpu_census.census import folder, proctree, reader

pytestmark = pytest.mark.timeout(90)
SRC = Path(__file__).resolve().parents[2] / "src"
FIFO_NAME = "gpu-census-4242-4242.seg"


def _env(tmp_path, native=None):
    e = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "CUDA_INJECTION"))}
    e["PYTHONPATH"] = str(SRC)
    e["XDG_RUNTIME_DIR"] = str(tmp_path / "xdg")
    (tmp_path / "xdg").mkdir(mode=0o700, exist_ok=True)
    if native is not None:
        e["OTEL_GPU_CENSUS_LIB"] = native[2]
    return e


def _cli(env, *args, timeout=20):
    p = subprocess.run([sys.executable, "-m", "otel_gpu_census.cli", *args], env=env, capture_output=True,
                       text=True, timeout=timeout)
    assert "Traceback" not in p.stderr, p.stderr
    return p


@pytest.fixture
def fifo_dir(census_dir):
    os.mkfifo(census_dir / FIFO_NAME)
    return census_dir


def test_reader_refuses_a_fifo_at_once_and_says_what_it_is(fifo_dir):
    t0 = time.monotonic()
    with pytest.raises(reader.SegmentError, match=r"not a regular file \(a FIFO\)"):
        reader.read_segment(fifo_dir / FIFO_NAME)
    good, bad = reader.scan(fifo_dir)
    assert good == [] and [e.path for e in bad] == [str(fifo_dir / FIFO_NAME)]
    assert time.monotonic() - t0 < 2


def test_reader_refuses_a_socket_and_a_symlink(census_dir, segments):
    real = segments.segment(census_dir.parent, [], pid=1, start_ticks=1)
    (census_dir / "gpu-census-1-1.seg").symlink_to(real)
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(census_dir / "gpu-census-2-2.seg"))
    try:
        _, bad = reader.scan(census_dir)
    finally:
        s.close()
    reasons = {Path(e.path).name: e.reason for e in bad}
    assert "symbolic link" in reasons["gpu-census-1-1.seg"]
    assert "a socket" in reasons["gpu-census-2-2.seg"]


def test_cleanup_leaves_a_fifo_alone(fifo_dir):
    # not a file the census wrote: never read, never removed
    assert folder.cleanup(fifo_dir, older_than_s=0, now=time.time() + 10 * 86400) == []
    assert (fifo_dir / FIFO_NAME).exists()


def test_report_on_a_folder_with_a_fifo_does_not_hang(fifo_dir, tmp_path):
    p = _cli(_env(tmp_path), "report", str(fifo_dir))
    assert p.returncode == 1
    assert f"could not read {fifo_dir / FIFO_NAME}: not a regular file (a FIFO)" in p.stderr


def test_run_with_a_fifo_in_its_folder_keeps_the_exit_code(fifo_dir, tmp_path, native):
    p = _cli(_env(tmp_path, native), "run", "--dir", str(fifo_dir), "--", "sh", "-c", "echo ran; exit 3")
    assert p.returncode == 3 and p.stdout == "ran\n"


def test_run_with_a_fifo_in_the_default_folder_starts_the_command(tmp_path, native):
    default = tmp_path / "xdg" / "otel-gpu-census"
    default.mkdir(parents=True, mode=0o700)
    os.mkfifo(default / FIFO_NAME)
    old = time.time() - 3 * 86400          # old enough for the tidy-up to look at it
    os.utime(default / FIFO_NAME, (old, old))
    p = _cli(_env(tmp_path, native), "run", "--", "sh", "-c", "echo ran; exit 5")
    assert p.returncode == 5 and p.stdout == "ran\n"
    assert (default / FIFO_NAME).exists()


def test_proxy_census_thread_with_a_fifo_exports_spans_and_stops_on_sigterm(fifo_dir, tmp_path):
    st = Standin().start()
    env = _env(tmp_path)
    try:
        with OtlpReceiver(grpc_enabled=False) as rx:
            env.update({"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{rx.http_port}",
                        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "100"})
            proc = subprocess.Popen([sys.executable, "-m", "otel_gpu_census.integrations.llamacpp", "--upstream", st.url,
                                     "--listen", "127.0.0.1:0", "--dir", str(fifo_dir), "--gpu-wait", "0.5"],
                                    env=env, stderr=subprocess.PIPE, text=True)
            try:
                port = None
                for _ in range(50):
                    m = re.search(r"listening on http://[^:]+:(\d+)", proc.stderr.readline())
                    if m:
                        port = int(m.group(1))
                        break
                assert port, "the proxy did not start"
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                c.request("POST", "/completion", json.dumps({"prompt": "x", "stream": True}).encode())
                assert c.getresponse().status == 200
                spans = rx.wait_for_spans(lambda ss: ss, timeout=15)
                assert spans[0].attributes["gpu_census.attribution.status"] == "no_segment"
                assert FIFO_NAME in spans[0].attributes["gpu_census.attribution.note"]
                t0 = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(10) == 0
                assert time.monotonic() - t0 < 5
                err = proc.stderr.read()
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        assert "not a regular file (a FIFO)" in err and "Traceback" not in err
    finally:
        st.stop()
