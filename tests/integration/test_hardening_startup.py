"""What stops a command before it starts serving (round 3): an OTEL_PROPAGATORS name with nothing
installed behind it costs one line and the proxy starts anyway, propagating what loads (the W3C default
when nothing does), alone or under `run --proxy`. Real processes."""
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
from ports import free_port
from proxy_process import listening_port, start_proxy

pytestmark = pytest.mark.timeout(90)
SRC = Path(__file__).resolve().parents[2] / "src"
SUPPORT = Path(__file__).resolve().parents[1] / "support"
PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.mark.parametrize("names, propagating", [("b3", "tracecontext,baggage"), ("jaeger", "tracecontext,baggage"),
                                                ("tracecontxt,baggage", "baggage")])
def test_a_propagator_that_is_not_installed_is_left_out_with_one_line(names, propagating):
    st = Standin().start()
    proc = start_proxy(["--upstream", st.url, "--listen", "127.0.0.1:0", "--no-gpu"],
                       {"OTEL_PROPAGATORS": names, "OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none"})
    try:
        port, before = listening_port(proc)
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        c.request("GET", "/echo", headers={"traceparent": PARENT})
        seen = {k.lower(): v for k, v in json.loads(c.getresponse().read())["headers"].items()}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        err = "".join(before) + proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        st.stop()
    assert "Traceback" not in err
    said = [x for x in err.splitlines() if "OTEL_PROPAGATORS" in x]
    assert len(said) == 1 and f"propagating {propagating}" in said[0]
    assert said[0].count("not installed") == 1
    if "tracecontext" in propagating:          # the request still joins the client's trace
        assert seen["traceparent"].split("-")[1] == PARENT.split("-")[1]


def test_run_proxy_starts_with_a_propagator_that_is_not_installed(native, census_dir):
    sport, pport = free_port(), free_port()
    standin = [sys.executable, str(SUPPORT / "llama_standin.py"), "--port", str(sport), "--token-delay", "0"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLAMA_ARG_"))}
    env.update(PYTHONPATH=str(SRC), OTEL_GPU_CENSUS_LIB=native[2], OTEL_PROPAGATORS="b3",
               OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none")
    run = subprocess.Popen([sys.executable, "-m", "otel_gpu_census.cli", "run", "--dir", str(census_dir),
                            "--exporter", "none", "--proxy", f"127.0.0.1:{pport}", "--", *standin],
                           env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        said = ""
        for _ in range(30):
            line = run.stderr.readline()
            said += line
            if not line or re.search(r"proxy: listening on", line):
                break
        assert "proxy: listening on" in said, said
        deadline = time.monotonic() + 20
        while True:                            # the stand-in answers through the proxy
            try:
                c = http.client.HTTPConnection("127.0.0.1", pport, timeout=2)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "nothing answered through the proxy"
            time.sleep(0.1)
        run.send_signal(signal.SIGTERM)
        assert run.wait(30) == 0
        err = said + run.stderr.read()
    finally:
        if run.poll() is None:
            run.kill()
    assert "Traceback" not in err and "did not start in time" not in err
    assert sum("left out b3 (not installed)" in x for x in err.splitlines()) == 1


def test_an_upstream_that_is_this_machine_by_its_host_name_is_refused():
    listen = "0.0.0.0"                   # every address of this machine, its host name's among them
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONPATH"] = str(SRC)
    p = subprocess.run([sys.executable, "-m", "otel_gpu_census.cli", "proxy", "--upstream",
                        f"http://{socket.gethostname()}:{port}", "--listen", f"{listen}:{port}", "--no-gpu"],
                       env=env, capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "would forward to itself" in p.stderr
