"""The census metrics through a real OpenTelemetry collector: rotel (PyPI `rotel`, a Rust collector
shipped in a wheel) between the sidecar and our OTLP receiver. Its agent binary comes from $ROTEL_AGENT
(tests/support_rotel.sh installs rotel in a venv of its own and prints it: CI does), else from an importable
rotel package. Skipped when neither is there."""
from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from otel_gpu_census import census
from otel_gpu_census.telemetry.sidecar import start_sidecar
from otlp_receiver import OtlpReceiver, latest
from ports import free_port

def _agent() -> Path:
    if os.environ.get("ROTEL_AGENT"):
        return Path(os.environ["ROTEL_AGENT"])
    rotel = pytest.importorskip("rotel", reason="no rotel: set ROTEL_AGENT (tests/support_rotel.sh prints it)")
    return Path(rotel.__file__).parent / "rotel-agent"


AGENT = _agent()
HW = "GPU-12345678-9abc-def0-1234-56789abcdef0"


@pytest.fixture(autouse=True)
def clean_otel_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("OTEL_"):
            monkeypatch.delenv(k)


def _wait_listening(port: int, proc, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"rotel exited with {proc.returncode}: {proc.stdout.read()}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    pytest.fail(f"rotel did not listen on {port} within {timeout}s")


@pytest.mark.parametrize("into,out_of", [("grpc", "grpc"), ("http/protobuf", "http")])
def test_census_metrics_through_rotel(into, out_of, segments, records, census_dir, monkeypatch, tmp_path):
    if not AGENT.exists():
        pytest.skip(f"rotel installed without its agent binary ({AGENT})")
    r = records
    uuid = bytes.fromhex(HW[4:].replace("-", ""))

    def edit(seg):
        for i, b in enumerate(uuid):
            seg.devices[0].uuid[i] = b
    segments.segment(census_dir, [r.kernel(10, 1010), r.memcpy("dtoh", 32_800_000, 2000, 3000, dst="pageable")],
                     comm="llama-server", final=True, state=census.STATE_ACTIVE, edit=edit)
    grpc_in, http_in = free_port(), free_port()
    with OtlpReceiver() as rx:
        sink = f"http://127.0.0.1:{rx.grpc_port if out_of == 'grpc' else rx.http_port}"
        agent = subprocess.Popen(
            [str(AGENT), "start", "--otlp-grpc-endpoint", f"127.0.0.1:{grpc_in}",
             "--otlp-http-endpoint", f"127.0.0.1:{http_in}", "--exporter", "otlp",
             "--otlp-exporter-endpoint", sink, "--otlp-exporter-protocol", out_of,
             "--batch-timeout", "100ms", "--pid-file", str(tmp_path / "rotel.pid"),
             "--log-file", str(tmp_path / "rotel.log")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            _wait_listening(grpc_in if into == "grpc" else http_in, agent)
            monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT",
                               f"http://127.0.0.1:{grpc_in if into == 'grpc' else http_in}")
            monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", into)
            monkeypatch.setenv("OTEL_SERVICE_NAME", "via-rotel")
            handle = start_sidecar(census_dir, root_pid=os.getpid(), interval_s=0.2, nvml=False)
            try:
                pts = rx.wait_for(lambda p: any(x.name == "gpu_census.host.io" for x in p)
                                  and any(x.name == "gpu_census.busy.time" for x in p))
            finally:
                handle.stop()
        finally:
            agent.terminate()
            try:
                agent.wait(10)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()
    assert {p.transport for p in pts} == {"grpc" if out_of == "grpc" else "http"}
    me = {"hw.id": HW, "process.pid": os.getpid(), "process.executable.name": "llama-server"}
    io = latest(pts, "gpu_census.host.io", {"hw.id": HW, "network.io.direction": "transmit"})
    assert (io.value, io.is_int, io.unit, io.temporality) == (32_800_000, True, "By", "cumulative")
    busy = latest(pts, "gpu_census.busy.time", me)
    assert busy.value == pytest.approx(1e-6) and busy.unit == "s" and busy.monotonic
    copy = latest(pts, "gpu_census.copy.bytes", {**me, "gpu_census.copy.direction": "dtoh",
                                                 "gpu_census.copy.memory_kind": "pageable"})
    assert copy.value == 32_800_000
    assert pts[0].resource["service.name"] == "via-rotel"
