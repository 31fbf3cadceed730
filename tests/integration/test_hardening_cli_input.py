"""Values and bytes a careless or hostile user feeds the commands: numbers that are not finite, and
terminal escape sequences in what a segment says about its process. One clear line, no traceback,
nothing raw reaches the terminal."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)
SRC = Path(__file__).resolve().parents[2] / "src"
ESCAPES = "\x1b]0;owned\x07\x1b[2J\x1b[31m"


def _cli(tmp_path, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "CUDA_INJECTION"))}
    env.update(PYTHONPATH=str(SRC), XDG_RUNTIME_DIR=str(tmp_path))
    p = subprocess.run([sys.executable, "-m", "otel_gpu_census.cli", *args], env=env, capture_output=True,
                       timeout=30)
    out, err = p.stdout.decode("utf-8", "replace"), p.stderr.decode("utf-8", "replace")
    assert "Traceback" not in err, err
    return p.returncode, out, err


@pytest.mark.parametrize("option", ["--gpu-wait", "--upstream-timeout", "--connect-timeout", "--upstream-keepalive"])
@pytest.mark.parametrize("value,why", [("inf", "must be a finite number"), ("nan", "must be a finite number"),
                                       ("1e300", "must be at most")])
def test_proxy_numbers_that_are_not_finite_are_usage_errors(tmp_path, option, value, why):
    rc, _, err = _cli(tmp_path, "proxy", "--upstream", "http://127.0.0.1:9", "--listen", "127.0.0.1:0",
                      "--no-gpu", option, value)
    assert rc == 2 and f"argument {option}: {why}" in err


def test_run_metrics_interval_inf_is_a_usage_error(tmp_path):
    rc, _, err = _cli(tmp_path, "run", "--metrics-interval", "inf", "--", "true")
    assert rc == 2 and "argument --metrics-interval: must be a finite number" in err


def test_report_escapes_a_comm_with_terminal_escapes(census_dir, segments, tmp_path):
    segments.segment(census_dir, [], comm=ESCAPES, pid=4242, start_ticks=1)
    rc, out, err = _cli(tmp_path, "report", str(census_dir))
    assert rc == 0 and "\x1b" not in out and "\x07" not in out
    assert "\\x1b]0;owned\\x07\\x1b[2J" in out
    # JSON keeps the exact comm (escaped the JSON way)
    rc, out, _ = _cli(tmp_path, "report", str(census_dir), "--json")
    assert rc == 0 and "\x1b" not in out
    assert json.loads(out)["processes"][0]["comm"] == ESCAPES


def test_report_escapes_a_file_name_with_terminal_escapes(census_dir, tmp_path):
    os.mkfifo(census_dir / f"gpu-census-{ESCAPES}.seg")
    rc, out, err = _cli(tmp_path, "report", str(census_dir))
    assert rc == 1 and "\x1b" not in err and "\x1b" not in out
    assert "gpu-census-\\x1b]0;owned\\x07" in err


T = 1_764_400_000_000_000_000
_TTFT = "gen_ai.latency.time_to_first_token"


def _otlp(spans):
    return json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": spans}]}]})


def _server_span(ttft_value):
    return {"kind": 2, "startTimeUnixNano": str(T), "endTimeUnixNano": str(T + 10**9),
            "attributes": [{"key": _TTFT, "value": ttft_value}]}


@pytest.mark.parametrize("log, why", [
    ('{"resourceSpans": [1]}', "an item of resourceSpans is not an object: 1"),
    ('{"resourceSpans": [{"scopeSpans": [{"spans": [{"kind": 2, "attributes": "x"}]}]}]}',
     "startTimeUnixNano is not a whole number of nanoseconds: None"),
    (_otlp([_server_span({"doubleValue": "Infinity"})]), f"{_TTFT} is not a finite number of seconds: 'Infinity'"),
    (_otlp([_server_span({"intValue": "1" + "0" * 400})]), f"{_TTFT} is not a finite number of seconds"),
    (_otlp([_server_span("fast")]), f"the value of {_TTFT} is not an object: 'fast'"),
    (json.dumps({"start_time_unix_nano": 1, "end_time_unix_nano": 2}),
     "start_time_unix_nano 1 is not a time between the years 2000 and 2100"),
    (json.dumps({"start_time_unix_nano": T, "end_time_unix_nano": 10**26}),
     "end_time_unix_nano 100000000000000000000000000 is not a time between the years 2000 and 2100"),
    ("[" * 50_000 + "]" * 50_000, "not JSON (JSON nested too deeply to read)"),
])
def test_report_refuses_a_request_log_with_wrong_types_or_values_in_one_line(census_dir, tmp_path, log, why):
    f = tmp_path / "requests.jsonl"
    f.write_text(log + "\n")
    rc, out, err = _cli(tmp_path, "report", str(census_dir), "--request-log", str(f))
    assert rc == 1 and out == "" and why in err and len(err.strip().splitlines()) == 1, err


def test_a_request_log_named_with_terminal_escapes_is_named_escaped(census_dir, tmp_path):
    f = tmp_path / f"log{ESCAPES}.jsonl"
    f.write_text('{"resourceSpans": 5}\n')
    rc, out, err = _cli(tmp_path, "report", str(census_dir), "--request-log", str(f))
    assert rc == 1 and "\x1b" not in err and "log\\x1b]0;owned\\x07" in err


@pytest.mark.parametrize("value", ["1e-9", "0.01"])
def test_run_metrics_interval_too_small_for_the_sdk_is_a_usage_error(tmp_path, value):
    rc, _, err = _cli(tmp_path, "run", "--exporter", "console", "--metrics-interval", value, "--", "true")
    assert rc == 2 and "argument --metrics-interval: must be at least 0.1 seconds" in err


def test_run_json_into_a_fifo_nobody_reads_is_refused_before_the_command_starts(tmp_path):
    fifo = tmp_path / "report.json"
    os.mkfifo(fifo)
    marker = tmp_path / "ran"
    rc, _, err = _cli(tmp_path, "run", "--json", str(fifo), "--", "touch", str(marker))
    assert rc == 1 and "a FIFO that nobody reads" in err and len(err.strip().splitlines()) == 1
    assert not marker.exists()


def _env_cli(tmp_path, native, *args, stdout=subprocess.PIPE):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "CUDA_INJECTION", "LD_PRELOAD"))}
    env.update(PYTHONPATH=str(SRC), XDG_RUNTIME_DIR=str(tmp_path), OTEL_GPU_CENSUS_LIB=native[2])
    p = subprocess.run([sys.executable, "-m", "otel_gpu_census.cli", *args], env=env, stdout=stdout,
                       stderr=subprocess.PIPE, timeout=30)
    err = p.stderr.decode("utf-8", "replace")
    assert "Traceback" not in err, err
    return p.returncode, (p.stdout or b"").decode("utf-8", "replace"), err


WEIRD_DIR = 'census "x"\nLD_PRELOAD=evil.so %h\\'


def test_env_for_systemd_escapes_a_folder_name_and_docker_refuses_a_line_break(tmp_path, native):
    d = tmp_path / WEIRD_DIR
    d.mkdir(mode=0o700)
    rc, out, err = _env_cli(tmp_path, native, "env", "--dir", str(d), "--format", "systemd")
    assert rc == 0, err
    lines = out.splitlines()
    assert all(line.startswith('Environment="') and line.endswith('"') for line in lines)
    assert not [line for line in lines if line.startswith("LD_PRELOAD")]
    [line] = [x for x in lines if "OTEL_GPU_CENSUS_DIR=" in x]
    assert 'census \\"x\\"\\x0aLD_PRELOAD=evil.so %%h\\\\"' in line
    rc, out, err = _env_cli(tmp_path, native, "env", "--dir", str(d), "--format", "docker")
    assert rc == 1 and out == "" and "docker's --env-file cannot carry" in err and len(err.splitlines()) == 1


def test_env_for_docker_without_line_breaks_is_as_before(tmp_path, native):
    d = tmp_path / 'plain "quoted" name'
    d.mkdir(mode=0o700)
    rc, out, _ = _env_cli(tmp_path, native, "env", "--dir", str(d), "--format", "docker")
    assert rc == 0 and f"OTEL_GPU_CENSUS_DIR={d}" in out.splitlines()


@pytest.mark.parametrize("args", [["report", str(SRC.parent / "examples" / "census" / "llama-default")],
                                  ["report", "--json", str(SRC.parent / "examples" / "census" / "llama-default")],
                                  ["env"], ["doctor"]])
def test_output_to_a_full_disk_is_one_line(tmp_path, native, args):
    if args == ["env"]:
        args = ["env", "--dir", str(tmp_path / "c")]
        (tmp_path / "c").mkdir(mode=0o700)
    with open("/dev/full", "wb") as full:
        rc, _, err = _env_cli(tmp_path, native, *args, stdout=full)
    assert rc == 1 and err.strip().splitlines()[-1] == "otel-gpu-census: cannot write its output: No space left on device"
    assert "Exception ignored" not in err
