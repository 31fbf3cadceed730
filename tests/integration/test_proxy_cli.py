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

from proxy_process import listening_port, start_proxy
from llama_standin import Standin
from otlp_receiver import OtlpReceiver
from ports import free_port
from otel_gpu_census.integrations.llamacpp import ConfigError, add_proxy_arguments, config_from_args, upstream_from_server_args
from otel_gpu_census.integrations.llamacpp.config import check_upstream, parse_host_port

pytestmark = pytest.mark.timeout(60)
SRC = Path(__file__).resolve().parents[2] / "src"


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
                      "--upstream-timeout", "5", "--upstream-pid", "12", "--dir", "/x", "--gpu-wait", "0.5"])
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


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_command_exports_spans_from_the_environment_and_stops_cleanly(protocol):
    st = Standin().start()
    with OtlpReceiver() as rx:
        endpoint = rx.grpc_endpoint if protocol == "grpc" else f"http://127.0.0.1:{rx.http_port}"
        proc = start_proxy(["--upstream", st.url, "--listen", "127.0.0.1:0", "--no-gpu"],
                      {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
                       "OTEL_SERVICE_NAME": "llama-front", "OTEL_BSP_SCHEDULE_DELAY": "100"})
        try:
            port, _ = listening_port(proc)
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            c.request("POST", "/completion", json.dumps({"prompt": "x", "stream": True}).encode())
            assert c.getresponse().read().count(b"data: ") == 6
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(20) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
        spans = rx.wait_for_spans(lambda ss: ss)
        assert spans[0].transport == ("grpc" if protocol == "grpc" else "http")
        assert spans[0].resource["service.name"] == "llama-front"
        assert spans[0].attributes["gen_ai.usage.output_tokens"] == 5
        assert "Traceback" not in proc.stderr.read()
    st.stop()


def test_bad_upstream_is_a_message_not_a_traceback():
    proc = start_proxy(["--upstream", "ftp://nowhere:1"])
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 2 and "only http://" in err and "Traceback" not in err


def test_port_in_use_is_a_message_not_a_traceback():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    proc = start_proxy(["--upstream", "http://127.0.0.1:9", "--listen", f"127.0.0.1:{port}"],
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
    proc = start_proxy(["--upstream", st.url, "--listen", "127.0.0.1:0", "--no-gpu"],
                  {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{dead_port}",
                   "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "50",
                   "OTEL_EXPORTER_OTLP_TIMEOUT": "1"})
    try:
        port, _ = listening_port(proc)
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

    from otel_gpu_census.integrations.llamacpp import ProxyConfig, start_proxy_in_thread
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(ConfigError):
        start_proxy_in_thread(ProxyConfig(upstream=f"http://127.0.0.1:{port}", listen_port=port, gpu=False),
                              TracerProvider(), MeterProvider())


# ---- run --proxy: the server under the census, the proxy beside it ---------------------------


def _run_env(native, extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLAMA_ARG_"))}
    env["PYTHONPATH"] = str(SRC)
    env["OTEL_GPU_CENSUS_LIB"] = native[2]
    env.update(extra or {})
    return env


def _run_cmd(*args):
    return [sys.executable, "-m", "otel_gpu_census.cli", "run", *args]


def _wait_ok(port, path="/health", timeout=20):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", path)
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"nothing answered 200 on port {port}{path}")


def test_run_proxy_traces_requests_to_the_command_it_runs(native, census_dir):
    sport, pport = free_port(), free_port()
    standin = [sys.executable, str(Path(__file__).resolve().parents[1] / "support" / "llama_standin.py"), "--port", str(sport),
               "--token-delay", "0"]
    with OtlpReceiver(grpc_enabled=False) as rx:
        env = _run_env(native, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": rx.traces_endpoint,
                                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "100"})
        run = subprocess.Popen(_run_cmd("--dir", str(census_dir), "--proxy", f"127.0.0.1:{pport}", "--", *standin),
                               env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        try:
            said = ""
            for _ in range(20):                 # the proxy says where it listens once the command runs
                line = run.stderr.readline()
                said += line
                m = re.search(r"proxy: listening on http://127\.0\.0\.1:(\d+) → http://127\.0\.0\.1:(\d+) "
                              r"\(census (\S+), pid (\d+) and children\)", line)
                if m or not line:
                    break
            assert m, said
            assert (int(m.group(1)), int(m.group(2)), m.group(3)) == (pport, sport, str(census_dir))
            # the proxy attributes the GPU work of the command it started: its pid
            assert "llama_standin.py" in Path(f"/proc/{m.group(4)}/cmdline").read_text()
            _wait_ok(pport)               # the stand-in answers through the proxy
            c = http.client.HTTPConnection("127.0.0.1", pport, timeout=10)
            c.request("POST", "/completion", json.dumps({"prompt": "x", "n_predict": 3, "stream": True}).encode())
            assert c.getresponse().read().count(b"data: ") == 4
            run.send_signal(signal.SIGTERM)           # forwarded to the stand-in, which exits 0
            assert run.wait(30) == 0
            err = said + run.stderr.read()
        finally:
            if run.poll() is None:
                run.kill()
        span = rx.wait_for_spans(lambda ss: [s for s in ss if s.name.startswith("text_completion")])[0]
    a = span.attributes
    assert a["gen_ai.usage.output_tokens"] == 3 and a["gpu_census.proxy.upstream"] == f"http://127.0.0.1:{sport}"
    assert a["gpu_census.attribution.status"] == "no_segment"     # a CPU stand-in writes no census segment
    assert "Traceback" not in err and "otel-gpu-census report" in err


@pytest.mark.parametrize("case", ["bad-port", "itself", "bad-upstream", "in-use", "upstream-alone"])
def test_run_proxy_checks_its_options_before_starting_the_command(native, census_dir, tmp_path, case):
    mark = tmp_path / "started"
    port = free_port()
    busy = None
    cmd = ["sh", "-c", f"touch {mark}", "--port", str(port + 1)]
    opts, code, said = {
        "bad-port": (["--proxy", "127.0.0.1:http"], 2, "port 'http' is not a number"),
        "itself": (["--proxy", f"127.0.0.1:{port + 1}"], 2, "would forward to itself"),
        "bad-upstream": (["--proxy", f"127.0.0.1:{port}", "--upstream", "ftp://x:1"], 2, "only http://"),
        "in-use": (["--proxy", f"127.0.0.1:{port}"], 1, "cannot listen on"),
        "upstream-alone": (["--upstream", "http://127.0.0.1:1"], 2, "--upstream goes with --proxy"),
    }[case]
    if case == "in-use":
        busy = socket.socket()
        busy.bind(("127.0.0.1", port))
        busy.listen()
    try:
        p = subprocess.run(_run_cmd("--dir", str(census_dir), *opts, "--", *cmd), env=_run_env(native),
                           capture_output=True, text=True, timeout=30)
    finally:
        if busy is not None:
            busy.close()
    assert p.returncode == code and said in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
    assert not mark.exists()          # the command never started


def _run_proxy_with(native, census_dir, exporter_args, extra_env=None):
    """`run <exporter_args> --proxy` around the stand-in: (process, proxy port, stand-in port, lines said
    before the proxy listened). The caller sends requests, then SIGTERM."""
    sport, pport = free_port(), free_port()
    standin = [sys.executable, str(Path(__file__).resolve().parents[1] / "support" / "llama_standin.py"), "--port", str(sport),
               "--token-delay", "0"]
    env = _run_env(native, {"OTEL_TRACES_EXPORTER": "none", **(extra_env or {})})
    run = subprocess.Popen(_run_cmd("--dir", str(census_dir), *exporter_args, "--proxy", f"127.0.0.1:{pport}",
                                    "--", *standin), env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE,
                           text=True)
    said = ""
    for _ in range(20):
        line = run.stderr.readline()
        said += line
        if "proxy: listening on" in line or not line:
            break
    said += run.stderr.readline()          # the proxy's traces line follows its listening line
    _wait_ok(pport)
    return run, pport, said


def _complete(port):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("POST", "/completion", json.dumps({"prompt": "x", "n_predict": 3}).encode())
    assert c.getresponse().status == 200


def test_run_proxy_with_prometheus_serves_the_proxys_metrics_on_its_one_port(native, census_dir):
    prom = free_port()
    run, pport, said = _run_proxy_with(native, census_dir, ["--exporter", "prometheus", "--prometheus-port",
                                                            str(prom)])
    try:
        assert f"metrics → Prometheus http://localhost:{prom}/metrics" in said
        assert "traces → none" in said
        _complete(pport)
        deadline, page = time.monotonic() + 15, ""
        while time.monotonic() < deadline and "gen_ai_server_request_duration" not in page:
            time.sleep(0.2)
            c = http.client.HTTPConnection("127.0.0.1", prom, timeout=5)
            c.request("GET", "/metrics")
            page = c.getresponse().read().decode()
        assert "gen_ai_server_request_duration" in page and "gpu_census_requests_in_flight" in page, page[-2000:]
        run.send_signal(signal.SIGTERM)
        assert run.wait(30) == 0
        err = said + run.stderr.read()
    finally:
        if run.poll() is None:
            run.kill()
    assert "Prometheus endpoint not started" not in err and "Traceback" not in err


def test_run_proxy_sends_the_proxys_metrics_where_exporter_says(native, census_dir):
    run, pport, said = _run_proxy_with(native, census_dir, ["--exporter", "console", "--metrics-interval", "0.5"])
    try:
        assert "metrics → console (stdout) every 0.5 s" in said
        _complete(pport)
        time.sleep(1.0)                    # the request's metrics follow its (empty) census wait
        run.send_signal(signal.SIGTERM)
        assert run.wait(30) == 0
        out = run.stdout.read()
    finally:
        if run.poll() is None:
            run.kill()
    assert '"gen_ai.server.request.duration"' in out and '"otel_gpu_census.proxy"' in out


def test_with_the_sdk_disabled_the_proxy_announces_no_exporter():
    """OTEL_SDK_DISABLED=true: the SDK exports nothing whatever OTEL_TRACES_EXPORTER says, and the proxy
    says that rather than 'traces → console'."""
    proc = start_proxy(["--upstream", "http://127.0.0.1:9", "--listen", "127.0.0.1:0"],
                       {"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "console", "OTEL_METRICS_EXPORTER": "console"})
    try:
        listening_port(proc)
        said = [proc.stderr.readline() for _ in range(2)]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert [x.strip() for x in said] == ["otel-gpu-census proxy: traces → none (OTEL_SDK_DISABLED=true)",
                                         "otel-gpu-census proxy: metrics → none (OTEL_SDK_DISABLED=true)"]
    assert proc.stdout.read() == ""                       # no console exporter wrote anything either
