"""The proxy as a command: options, clear errors, OTLP from the environment, clean stop on SIGTERM."""
from __future__ import annotations

import argparse
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
from otlp_trace_receiver import TraceReceiver
from otel_gpu_census.proxy import ConfigError, add_proxy_arguments, config_from_args, upstream_from_server_args
from otel_gpu_census.proxy.config import check_upstream, parse_host_port

pytestmark = pytest.mark.timeout(60)
SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.mark.parametrize("argv,env,want", [
    ([], {}, ("http://127.0.0.1:8080", "")),
    (["-m", "x.gguf", "--port", "9000"], {}, ("http://127.0.0.1:9000", "")),
    (["--host=0.0.0.0", "--port=9001"], {}, ("http://127.0.0.1:9001", "")),
    (["--host", "::", "--port", "1"], {}, ("http://[::1]:1", "")),
    (["--host", "fe80::1"], {}, ("http://[fe80::1]:8080", "")),
    (["--host", "10.0.0.2,127.0.0.1"], {}, ("http://10.0.0.2:8080", "")),
    (["--host", "/run/llama.sock"], {}, ("unix:/run/llama.sock", "")),
    ([], {"LLAMA_ARG_PORT": "7000", "LLAMA_ARG_HOST": "localhost"}, ("http://localhost:7000", "")),
    (["--port", "7001"], {"LLAMA_ARG_PORT": "7000"}, ("http://127.0.0.1:7001", "")),
    (["--api-prefix", "/llm"], {}, ("http://127.0.0.1:8080", "/llm")),
    (["--port"], {}, ("http://127.0.0.1:8080", "")),
])
def test_upstream_from_llama_server_args(argv, env, want):
    assert upstream_from_server_args(argv, env) == want


def test_bad_values_raise_config_errors():
    with pytest.raises(ConfigError, match="not a number"):
        upstream_from_server_args(["--port", "http"], {})
    for bad in ("ftp://x:1", "http://", "http://h:1/?q=1", "unix:", "http://h:99999"):
        with pytest.raises(ConfigError):
            check_upstream(bad)
    assert check_upstream("127.0.0.1:8080") == "http://127.0.0.1:8080"
    assert check_upstream("http://h:1/prefix/") == "http://h:1/prefix"
    assert parse_host_port(":9") == ("0.0.0.0", 9) and parse_host_port("[::1]:9") == ("::1", 9)
    for bad in ("9", "h:x", "h:70000"):
        with pytest.raises(ConfigError):
            parse_host_port(bad)


def test_a_proxy_never_forwards_to_itself():
    p = argparse.ArgumentParser()
    add_proxy_arguments(p)
    for listen, up in (("127.0.0.1:8081", "http://127.0.0.1:8081"), ("0.0.0.0:8081", "http://localhost:8081"),
                       ("127.0.0.1:80", "http://127.0.0.1")):
        with pytest.raises(ConfigError, match="forward to itself"):
            config_from_args(p.parse_args(["--upstream", up, "--listen", listen]))
    assert config_from_args(p.parse_args(["--upstream", "http://127.0.0.1:8080", "--listen", "127.0.0.1:8081"]))
    assert config_from_args(p.parse_args(["--upstream", "http://10.1.1.1:8081", "--listen", "127.0.0.1:8081"]))


def test_options_parse_into_a_config():
    p = argparse.ArgumentParser()
    add_proxy_arguments(p)
    a = p.parse_args(["--upstream", "http://127.0.0.1:8080", "--listen", "0.0.0.0:9", "--max-body-bytes", "64m",
                      "--upstream-timeout", "5", "--upstream-pid", "12", "--census-dir", "/x", "--gpu-wait", "0.5"])
    c = config_from_args(a)
    assert (c.listen_host, c.listen_port, c.max_body_bytes, c.upstream_timeout_s) == ("0.0.0.0", 9, 64 << 20, 5.0)
    assert (c.upstream_pid, c.census_dir, c.gpu_max_wait_s, c.gpu_margin_s) == (12, "/x", 0.5, 0.5)
    with pytest.raises(SystemExit):
        p.parse_args(["--upstream", "x", "--max-body-bytes", "lots"])
    # `run --proxy` knows the upstream from the server's arguments
    q = argparse.ArgumentParser()
    add_proxy_arguments(q, upstream_required=False)
    c = config_from_args(q.parse_args([]), upstream="http://127.0.0.1:8080", upstream_pid=77, api_prefix="/v")
    assert (c.upstream, c.upstream_pid, c.api_prefix) == ("http://127.0.0.1:8080", 77, "/v")


def _start(args, env_extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONPATH"] = str(SRC)
    env.update(env_extra or {})
    return subprocess.Popen([sys.executable, "-m", "otel_gpu_census.proxy", *args], env=env,
                            stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _port_from(proc):
    deadline = time.monotonic() + 20
    lines = []
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"listening on http://[^:]+:(\d+)", line)
        if m:
            return int(m.group(1)), lines
    proc.kill()
    raise AssertionError("proxy did not start: " + "".join(lines))


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_command_exports_spans_from_the_environment_and_stops_cleanly(protocol):
    st = Standin().start()
    with TraceReceiver(http_enabled=True, grpc_enabled=True) as rx:
        endpoint = rx.grpc_endpoint if protocol == "grpc" else f"http://127.0.0.1:{rx.http_port}"
        proc = _start(["--upstream", st.url, "--listen", "127.0.0.1:0", "--no-gpu"],
                      {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
                       "OTEL_SERVICE_NAME": "llama-front", "OTEL_BSP_SCHEDULE_DELAY": "100"})
        try:
            port, _ = _port_from(proc)
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            c.request("POST", "/completion", json.dumps({"prompt": "x", "stream": True}).encode())
            assert c.getresponse().read().count(b"data: ") == 6
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(20) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
        spans = rx.wait_for(lambda ss: ss)
        assert spans[0].transport == ("grpc" if protocol == "grpc" else "http")
        assert spans[0].resource["service.name"] == "llama-front"
        assert spans[0].attributes["gen_ai.usage.output_tokens"] == 5
        assert "Traceback" not in proc.stderr.read()
    st.stop()


def test_bad_upstream_is_a_message_not_a_traceback():
    proc = _start(["--upstream", "ftp://nowhere:1"])
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 2 and "only http://" in err and "Traceback" not in err


def test_port_in_use_is_a_message_not_a_traceback():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    proc = _start(["--upstream", "http://127.0.0.1:9", "--listen", f"127.0.0.1:{port}"],
                  {"OTEL_TRACES_EXPORTER": "none"})
    out, err = proc.communicate(timeout=20)
    s.close()
    assert proc.returncode == 1 and "cannot listen" in err and "Traceback" not in err


def test_collector_down_costs_one_warning():
    st = Standin().start()
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    dead_port = dead.getsockname()[1]
    dead.close()
    proc = _start(["--upstream", st.url, "--listen", "127.0.0.1:0", "--no-gpu"],
                  {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{dead_port}",
                   "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "50",
                   "OTEL_EXPORTER_OTLP_TIMEOUT": "1"})
    try:
        port, _ = _port_from(proc)
        for _ in range(3):
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            c.request("POST", "/completion", b'{"prompt":"x"}')
            assert c.getresponse().status == 200
            time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        st.stop()
    assert err.count("traces: cannot export") == 1 and "Traceback" not in err


def test_start_in_thread_refuses_itself_too():
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider

    from otel_gpu_census.proxy import ProxyConfig, start_proxy_in_thread
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(ConfigError):
        start_proxy_in_thread(ProxyConfig(upstream=f"http://127.0.0.1:{port}", listen_port=port, gpu=False),
                              TracerProvider(), MeterProvider())
