"""`otel-gpu-census` as a user runs it: exit codes, signals, messages, and exact report figures."""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from otel_gpu_census.cli import main as cli

from otel_gpu_census.cli import launcher
from otel_gpu_census._native import LAYOUT_VERSION

ROOT = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1] / "support"   # helpers the subprocesses import
MS = 1_000_000
T0 = 7_000 * 20 * MS


@pytest.fixture
def env(native, tmp_path):
    """Environment for the CLI: the test build of the library, a private default folder."""
    e = dict(os.environ)
    e["OTEL_GPU_CENSUS_LIB"] = native[2]
    e["XDG_RUNTIME_DIR"] = str(tmp_path / "xdg")
    (tmp_path / "xdg").mkdir(mode=0o700)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), e.get("PYTHONPATH", "")])
    for v in ("OTEL_GPU_CENSUS_DIR", "CUDA_INJECTION64_PATH", "OTEL_GPU_CENSUS_DISABLED", "OTEL_METRICS_EXPORTER",
              "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"):
        e.pop(v, None)
    return e


def cli_cmd(*args):
    return [sys.executable, "-m", "otel_gpu_census.cli", *args]


def run_cli(env, *args, timeout=60):
    p = subprocess.run(cli_cmd(*args), env=env, capture_output=True, text=True, timeout=timeout)
    assert "Traceback" not in p.stderr, p.stderr
    return p


# ---- run: exit codes -------------------------------------------------------------------------

def test_run_true_exits_0_and_says_no_gpu_activity(env, census_dir):
    p = run_cli(env, "run", "--dir", str(census_dir), "--", "true")
    assert p.returncode == 0
    assert "no GPU activity was recorded: no process of this run initialised CUDA" in p.stderr
    assert p.stdout == ""           # the report goes to stderr; the command's stdout stays its own


def test_run_passes_the_exit_code_and_output_through(env, census_dir):
    p = run_cli(env, "run", "--dir", str(census_dir), "--", "sh", "-c", "echo out; echo err >&2; exit 3")
    assert p.returncode == 3
    assert p.stdout == "out\n" and p.stderr.startswith("err\n")


def test_run_sets_the_census_environment_for_the_child(env, census_dir, native):
    p = run_cli(env, "run", "--dir", str(census_dir), "--", "sh", "-c",
                'echo "$CUDA_INJECTION64_PATH|$OTEL_GPU_CENSUS_DIR"')
    assert p.returncode == 0
    assert p.stdout.strip() == f"{Path(native[2]).resolve()}|{census_dir}"


def test_run_gives_the_default_collector_preloaded_and_precise_without(env, census_dir):
    """The default collector: LD_PRELOAD names the very file CUDA loads as its injector (one copy in the process),
    before what the user preloads; --precise (or OTEL_GPU_CENSUS_COLLECTOR=precise) takes CUPTI and leaves
    LD_PRELOAD as it was; a bad collector name is said and the default kept."""
    env.pop("OTEL_GPU_CENSUS_COLLECTOR", None)
    env["LD_PRELOAD"] = "libm.so.6"
    show = ["--", "sh", "-c", 'echo "$CUDA_INJECTION64_PATH|$LD_PRELOAD|$OTEL_GPU_CENSUS_COLLECTOR"']
    default = run_cli(env, "run", "--dir", str(census_dir), *show)
    inj, pre, coll = default.stdout.strip().split("|")
    assert default.returncode == 0 and inj.endswith("libotel_gpu_census.so") and pre == f"{inj}:libm.so.6", default
    assert coll == "default"
    precise = run_cli(env, "run", "--dir", str(census_dir), "--precise", *show)
    assert precise.returncode == 0 and precise.stdout.strip().split("|")[1:] == ["libm.so.6", "precise"]
    env["OTEL_GPU_CENSUS_COLLECTOR"] = "precise"
    by_env = run_cli(env, "run", "--dir", str(census_dir), *show)
    assert by_env.stdout.strip().split("|")[1:] == ["libm.so.6", "precise"]
    env["OTEL_GPU_CENSUS_COLLECTOR"] = "sometimes"
    bad = run_cli(env, "run", "--dir", str(census_dir), *show)
    assert bad.stdout.strip().split("|")[1:] == [f"{inj}:libm.so.6", "default"]
    assert "OTEL_GPU_CENSUS_COLLECTOR='sometimes' is not one of default | precise: using default" in bad.stderr


def test_env_prints_the_census_environment_run_gives(env, census_dir):
    """A container or unit that can only set variables gets run's census: `env` prints exactly the census variables
    `run` hands its command, in shell, docker and systemd forms."""
    env.pop("OTEL_GPU_CENSUS_COLLECTOR", None)
    env.pop("LD_PRELOAD", None)
    names = ("CUDA_INJECTION64_PATH", "LD_PRELOAD", "OTEL_GPU_CENSUS_DIR", "OTEL_GPU_CENSUS_CUPTI",
             "OTEL_GPU_CENSUS_COLLECTOR")
    shown = run_cli(env, "run", "--dir", str(census_dir), "--", "sh", "-c",
                    " ".join(f'echo "{n}=${n}";' for n in names))
    under_run = {k: v for k, v in (line.split("=", 1) for line in shown.stdout.split()) if v}
    sh = run_cli(env, "env", "--dir", str(census_dir))
    assert sh.returncode == 0, sh.stderr
    printed = dict(line[len("export "):].split("=", 1) for line in sh.stdout.splitlines())
    assert {k: v.strip("'") for k, v in printed.items()} == under_run
    assert under_run["OTEL_GPU_CENSUS_COLLECTOR"] == "default" and under_run["LD_PRELOAD"]
    # the printed lines, evaluated by a shell, give a child the same variables
    child = subprocess.run(["sh", "-c", sh.stdout + "\n" + " ".join(f'echo "{n}=${n}";' for n in names)],
                           env={"PATH": os.environ["PATH"]}, capture_output=True, text=True)
    assert {k: v for k, v in (line.split("=", 1) for line in child.stdout.split()) if v} == under_run
    docker = run_cli(env, "env", "--dir", str(census_dir), "--format", "docker").stdout.splitlines()
    systemd = run_cli(env, "env", "--dir", str(census_dir), "--format", "systemd").stdout.splitlines()
    assert dict(line.split("=", 1) for line in docker) == under_run
    assert systemd == [f'Environment="{k}={v}"' for k, v in under_run.items()]
    precise = run_cli(env, "env", "--dir", str(census_dir), "--precise").stdout
    assert "OTEL_GPU_CENSUS_COLLECTOR=precise" in precise and "LD_PRELOAD" not in precise


def test_run_keeps_another_injector_and_warns(env, census_dir):
    env["CUDA_INJECTION64_PATH"] = "/opt/nsight/libToolsInjection64.so"
    p = run_cli(env, "run", "--dir", str(census_dir), "--", "sh", "-c", 'echo "$CUDA_INJECTION64_PATH"')
    assert p.returncode == 0
    assert p.stdout.strip() == "/opt/nsight/libToolsInjection64.so"
    assert "census off for this run: CUDA_INJECTION64_PATH is already set" in p.stderr
    assert "no GPU activity was recorded: the census was off" in p.stderr


def test_run_missing_command_is_127_like_a_shell(env, census_dir):
    p = run_cli(env, "run", "--dir", str(census_dir), "--", "no-such-command-xyz", "a")
    assert p.returncode == 127
    assert "no-such-command-xyz: command not found" in p.stderr


def test_run_not_executable_is_126(env, census_dir, tmp_path):
    f = tmp_path / "script"
    f.write_text("#!/bin/sh\necho hi\n")
    f.chmod(0o644)
    p = run_cli(env, "run", "--dir", str(census_dir), "--", str(f))
    assert p.returncode == 126 and "cannot run" in p.stderr


def test_run_without_command_is_a_usage_error(env, census_dir):
    for args in (["run"], ["run", "--dir", str(census_dir), "--"]):
        p = run_cli(env, *args)
        assert p.returncode == 2 and "no command given" in p.stderr


@pytest.mark.parametrize("args", [
    ["run", "--requests", "abc", "--", "true"],
    ["run", "--requests", "0", "--", "true"],
    ["run", "--exporter", "carrier-pigeon", "--", "true"],
    ["run", "--prometheus-port", "70000", "--", "true"],
    ["run", "--precise=yes", "--", "true"],
    ["env", "--format", "json"],
    ["report", "--bogus"],
    ["report", "--pid", "x"],
    ["frobnicate"],
    [],
])
def test_bad_flags_exit_2_without_traceback(env, args):
    p = run_cli(env, *args)
    assert p.returncode == 2
    assert "usage:" in p.stderr


def test_run_refuses_an_unusable_census_folder(env, tmp_path):
    marker = tmp_path / "ran"
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    for d, why in ((not_a_dir, "is not a folder"), (shared, "writable by group or others")):
        p = run_cli(env, "run", "--dir", str(d), "--", "touch", str(marker))
        assert p.returncode == 1 and why in p.stderr
        assert not marker.exists()           # the command is not started into a broken census


# ---- run: signals ------------------------------------------------------------------------------

def _start_run(env, census_dir, tmp_path, script):
    ready = tmp_path / "ready"
    cmd = cli_cmd("run", "--dir", str(census_dir), "--", "sh", "-c", f"{script}")
    env = dict(env, READY=str(ready))
    # own session: signals come from kill(), as from a supervisor (systemd, docker stop, kubelet)
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    deadline = time.time() + 20
    while not ready.exists():
        assert p.poll() is None and time.time() < deadline, p.communicate()
        time.sleep(0.02)
    return p


@pytest.mark.parametrize("sig,name", [(signal.SIGTERM, "TERM"), (signal.SIGINT, "INT"), (signal.SIGHUP, "HUP"),
                                      (signal.SIGQUIT, "QUIT")])
def test_signals_are_forwarded_to_the_command(env, census_dir, tmp_path, sig, name):
    if signal.getsignal(sig) == signal.SIG_IGN:
        # under nohup the command inherits SIGHUP ignored, as it should, and sh cannot trap an ignored signal
        pytest.skip(f"SIG{name} is ignored in this test process (nohup?); the command inherits that")
    p = _start_run(env, census_dir, tmp_path,
                   f'trap "echo got-{name}; exit 42" {name}; touch "$READY"; while :; do sleep 0.05; done')
    p.send_signal(sig)
    out, err = p.communicate(timeout=20)
    assert p.returncode == 42, err
    assert f"got-{name}" in out
    assert "Traceback" not in err


def test_command_killed_by_a_signal_exits_128_plus_signal(env, census_dir, tmp_path):
    p = _start_run(env, census_dir, tmp_path, 'touch "$READY"; exec sleep 30')
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=20)
    assert p.returncode == 128 + signal.SIGTERM, err


# ---- a command whose processes write census segments ------------------------------------

# Stands for a CUDA process under the injector: writes its own segment in $OTEL_GPU_CENSUS_DIR
# through the native tally, from real CUPTI records.
_FAKE_CUDA = textwrap.dedent(r"""
    import json, os, sys, time
    sys.path[:0] = [sys.argv[1]]
    import cupti_records as cr
    ffi, lib, _ = cr.native()
    spec = json.loads(sys.argv[2])
    time.sleep(spec.get("sleep", 0))
    seg = ffi.new("gc_segment *")
    lib.gc_segment_init(seg, spec.get("comm", "fake-cuda").encode(), 0, 0)
    t = lib.gc_tally_create(seg)
    lib.gc_segment_begin_update(seg)
    start = spec["t0"]
    for kind, n, nbytes in spec["records"]:
        for i in range(n):
            if kind == "kernel":
                r = cr.kernel(start, start + nbytes)
            elif kind == "memset":
                r = cr.memset(nbytes, start, start + 1000)
            else:
                copy, host = kind.split("-")
                src, dst = (host, "device") if copy == "htod" else ("device", host)
                r = cr.memcpy(copy, nbytes, start, start + 1000, src=src, dst=dst)
            lib.gc_tally_record(t, r)
            start += 3_000_000          # apart: kernels of up to 3 ms do not overlap
    lib.gc_tally_publish(t, 1)
    seg.state = 2
    lib.gc_segment_end_update(seg)
    d = os.environ["OTEL_GPU_CENSUS_DIR"]
    with open(os.path.join(d, f"gpu-census-{seg.pid}-{seg.proc_start_ticks}.seg"), "wb") as f:
        f.write(bytes(ffi.buffer(seg)))
""")


@pytest.fixture
def fake_cuda(tmp_path):
    script = tmp_path / "fake_cuda.py"
    script.write_text(_FAKE_CUDA)

    def argv(records, **extra):
        return [sys.executable, str(script), str(TESTS), json.dumps(dict(records=records, t0=T0, **extra))]
    return argv


def test_run_reports_a_process_tree_through_shells_exactly(env, census_dir, fake_cuda, tmp_path):
    # pageable device-to-host copies of 3 requests, pinned host-to-device, kernels of 2 ms
    recs = [["dtoh-pageable", 6, 104_857_601], ["htod-pinned", 3, 1_000_000], ["kernel", 9, 2 * MS]]
    # the worker sits under two shells that write no segment (neither is exec'd away)
    inner = tmp_path / "inner.sh"
    inner.write_text(shlex.join(fake_cuda(recs, sleep=1.2, comm="worker")) + "\ntrue\n")
    script = f"sh {shlex.quote(str(inner))}; true"
    out_json = tmp_path / "report.json"
    p = run_cli(env, "run", "--dir", str(census_dir), "--json", str(out_json), "--requests", "3", "--",
                "sh", "-c", script)
    assert p.returncode == 0, p.stderr
    dtoh_total = 6 * 104_857_601
    assert dtoh_total % 3 == 0
    per = dtoh_total // 3
    assert f"{per:,} bytes ({per / 1e6:.1f} MB) device-to-host per request, in 2 copies" in p.stderr
    assert f"{3 * 1_000_000 // 3:,} bytes (1.0 MB) host-to-device per request, in 1 copy" in p.stderr
    assert "3 kernels per request, 0.006000 s kernel time per request" in p.stderr
    assert f"{dtoh_total:,}" in p.stderr             # the process's total, exact
    assert "worker" in p.stderr and "exited" in p.stderr

    data = json.loads(out_json.read_text())
    [proc] = data["processes"]
    [dev] = proc["devices"]
    assert dev["copies"]["dtoh"]["bytes"] == dtoh_total
    assert dev["copies"]["dtoh"]["by_host_memory"] == {"pageable": {"count": 6, "bytes": dtoh_total, "ns": 6000}}
    assert dev["copies"]["htod"]["by_host_memory"]["pinned"]["bytes"] == 3_000_000
    assert (dev["kernel_count"], dev["kernel_ns"], dev["busy_ns"]) == (9, 18 * MS, 18 * MS)
    assert data["per_request"]["copies"]["dtoh"] == {"count": 2, "bytes": per, "ns": 2000}
    assert data["no_activity"] is None


def test_run_report_leaves_out_segments_of_other_processes(env, census_dir, fake_cuda):
    # a segment already in the folder from some other process
    subprocess.run(fake_cuda([["dtoh-pinned", 1, 12_345]], comm="stranger"),
                   env=dict(env, OTEL_GPU_CENSUS_DIR=str(census_dir)), check=True)
    p = run_cli(env, "run", "--dir", str(census_dir), "--", *fake_cuda([["dtoh-pinned", 1, 777]], comm="mine"))
    assert p.returncode == 0
    assert "mine" in p.stderr and "stranger" not in p.stderr and "12,345" not in p.stderr


# ---- report --------------------------------------------------------------------------------

def _write(segments, census_dir, records, **kw):
    return segments.segment(census_dir, records, **kw)


def test_report_exact_figures_and_request_division(env, census_dir, segments, records):
    recs = [records.memcpy("dtoh", 214_748_365, T0 + i * MS, T0 + i * MS + 500, src="device", dst="pageable")
            for i in range(4)]
    recs += [records.memcpy("htod", 10, T0 + 9 * MS, T0 + 9 * MS + 5, src="pinned", dst="device")]
    recs += [records.kernel(T0 + 20 * MS, T0 + 30 * MS), records.kernel(T0 + 25 * MS, T0 + 35 * MS)]
    _write(segments, census_dir, recs, comm="llama-server")
    p = run_cli(env, "report", str(census_dir), "--requests", "4")
    assert p.returncode == 0, p.stderr
    total = 4 * 214_748_365
    assert f"{total:,}" in p.stdout and f"{total / 1e6:.1f} MB" in p.stdout
    assert "214,748,365 bytes (214.7 MB) device-to-host per request, in 1 copy" in p.stdout
    assert "2.5 bytes (2.5 B) host-to-device per request, in 0.25 copies" in p.stdout   # quotients keep fractions
    assert "0.5 kernels per request, 0.005000 s kernel time per request" in p.stdout
    # busy is the union of the two overlapping kernels: 15 ms of 20 ms kernel time
    assert "kernel time 0.020000 s" in p.stdout and "busy 0.015000 s" in p.stdout
    assert "pageable host" in p.stdout and "pinned host" in p.stdout
    assert "MB = 10^6 bytes" in p.stdout


def test_report_json(env, census_dir, segments, records):
    _write(segments, census_dir, [records.memset(4096, T0, T0 + 100), records.kernel(T0, T0 + MS)])
    p = run_cli(env, "report", str(census_dir), "--json", "--requests", "2")
    assert p.returncode == 0
    data = json.loads(p.stdout)
    [proc] = data["processes"]
    assert proc["pid"] == os.getpid() and proc["state"] == "exited"
    assert proc["devices"][0]["memset"] == {"count": 1, "bytes": 4096, "ns": 100}
    assert data["per_request"]["memset"] == {"count": 0.5, "bytes": 2048, "ns": 50}


def test_report_pid_selects_a_process_tree(env, census_dir, segments, records):
    base = 10**9
    _write(segments, census_dir, [records.kernel(T0, T0 + MS)], pid=4_000_001, ppid=4_000_000, start_ticks=base,
           comm="engine")
    _write(segments, census_dir, [records.kernel(T0, T0 + MS)], pid=4_000_002, ppid=4_000_001, start_ticks=base,
           comm="worker")
    _write(segments, census_dir, [records.kernel(T0, T0 + MS)], pid=4_000_003, ppid=1, start_ticks=base,
           comm="unrelated")
    p = run_cli(env, "report", str(census_dir), "--pid", "4000001")
    assert p.returncode == 0
    assert "engine" in p.stdout and "worker" in p.stdout and "unrelated" not in p.stdout
    assert "2 processes" in p.stdout
    p = run_cli(env, "report", str(census_dir), "--pid", "4000009")
    assert p.returncode == 1
    assert "no census segment for pid 4000009" in p.stdout


def test_report_of_a_dead_process_without_final_flush_says_so(env, census_dir, segments, records, dead_pid):
    _write(segments, census_dir, [records.kernel(T0, T0 + MS)], final=False, pid=dead_pid)
    p = run_cli(env, "report", str(census_dir))
    assert "ended without the census's final flush" in p.stdout


def test_report_warnings_for_dropped_records(env, census_dir, segments, records):
    def trouble(seg):
        seg.dropped = 1234
        seg.flags |= 0x2
    _write(segments, census_dir, [records.kernel(T0, T0 + MS)], edit=trouble)
    p = run_cli(env, "report", str(census_dir))
    assert "CUPTI dropped 1,234 activity records" in p.stdout


def test_report_empty_folder_says_no_gpu_activity(env, census_dir):
    p = run_cli(env, "report", str(census_dir))
    assert p.returncode == 0
    assert f"no GPU activity was recorded: no census segment in {census_dir}" in p.stdout


def test_report_segment_without_activity(env, census_dir, segments):
    _write(segments, census_dir, [])
    p = run_cli(env, "report", str(census_dir))
    assert "no GPU activity was recorded: 1 process(es) initialised CUDA under the census but launched no " \
           "kernels" in p.stdout


@pytest.mark.parametrize("damage,message", [
    ("magic", "wrong magic"),
    ("version", f"layout version {LAYOUT_VERSION + 7}; this reader reads version {LAYOUT_VERSION}"),
    ("truncate", "truncated"),
])
def test_report_bad_segment_is_a_clear_message(env, census_dir, segments, records, damage, message):
    good = _write(segments, census_dir, [records.kernel(T0, T0 + MS)], comm="good-one")

    def edit(seg):
        if damage == "magic":
            seg.magic = 42
        elif damage == "version":
            seg.layout_version = LAYOUT_VERSION + 7
    bad = _write(segments, census_dir, [], pid=4_100_000, edit=edit)
    if damage == "truncate":
        bad.write_bytes(bad.read_bytes()[:1000])
    for target in (census_dir, bad):
        p = run_cli(env, "report", str(target))
        assert p.returncode == 1
        assert f"could not read {bad}: " in p.stderr and message in p.stderr
    # the good segment in the same folder is still reported
    p = run_cli(env, "report", str(census_dir))
    assert "good-one" in p.stdout
    p = run_cli(env, "report", str(good))
    assert p.returncode == 0 and "good-one" in p.stdout


@pytest.mark.parametrize("version", [LAYOUT_VERSION - 1, LAYOUT_VERSION + 1])
def test_report_on_a_segment_of_another_layout_alone_is_one_line(env, census_dir, segments, records, version):
    """A folder whose only segment is of an older or a newer layout: one line naming both layouts and which census to
    read it with, exit 1, and no report of nothing (it is not a census with no activity)."""
    def edit(seg):
        seg.layout_version = version
    bad = _write(segments, census_dir, [records.kernel(T0, T0 + MS)], edit=edit)
    for target in (census_dir, bad):
        p = run_cli(env, "report", str(target))
        assert p.returncode == 1 and p.stdout == "" and "Traceback" not in p.stderr
        (line,) = p.stderr.splitlines()
        assert f"layout version {version}; this reader reads version {LAYOUT_VERSION}" in line
        assert ("an older one" if version < LAYOUT_VERSION else "a newer one") in line


def test_report_missing_folder(env, tmp_path):
    p = run_cli(env, "report", str(tmp_path / "nowhere"))
    assert p.returncode == 1 and "does not exist" in p.stderr


# ---- doctor, proxy, help -------------------------------------------------------------------

def test_help_lists_every_verb_including_the_reserved_proxy(env):
    p = run_cli(env, "--help")
    assert p.returncode == 0
    for verb in ("run", "report", "doctor", "proxy"):
        assert verb in p.stdout


def test_proxy_help(env):
    p = run_cli(env, "proxy", "--help")
    assert p.returncode == 0 and "usage: otel-gpu-census proxy" in p.stdout and "--upstream URL" in p.stdout
    p = run_cli(env, "proxy")
    assert p.returncode == 2 and "the following arguments are required: --upstream" in p.stderr
    p = run_cli(env, "run", "--help")
    assert "--proxy HOST:PORT" in p.stdout


def test_a_broken_proxy_leaves_the_other_verbs_working(monkeypatch, census_dir, capsys):
    import otel_gpu_census.integrations
    monkeypatch.setitem(sys.modules, "otel_gpu_census.integrations.llamacpp", None)
    monkeypatch.delattr(otel_gpu_census.integrations, "llamacpp", raising=False)
    assert cli.main(["report", str(census_dir)]) == 0
    assert cli.main(["proxy"]) == 1
    assert "proxy is not available" in capsys.readouterr().err


def test_doctor_explains_every_check(env):
    p = run_cli(env, "doctor")
    lines = [line for line in p.stdout.splitlines() if line.strip()]
    checks = lines[:-1]
    assert checks and all(line.split()[0] in ("OK", "WARN", "FAIL") for line in checks)
    assert any("injector" in line and line.startswith("OK") for line in checks)
    can_run = not any(line.startswith("FAIL") for line in checks)
    assert p.returncode == (0 if can_run else 1)
    assert lines[-1] == ("the census can run here" if can_run else lines[-1])


def test_doctor_without_a_driver_says_why(env):
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("this machine has an NVIDIA driver")
    p = run_cli(env, "doctor")
    assert p.returncode == 1
    assert any(line.startswith("FAIL") and "NVIDIA driver" in line and "libcuda.so.1" in line
               for line in p.stdout.splitlines())


def test_doctor_says_whether_the_preloaded_library_answers_the_driver(env, mock_cuda):
    """The default collector needs the library preloaded to answer the driver's lookups: with a driver (the mock
    libcuda.so.1) doctor says it does; without one it says it cannot tell, as a warning."""
    found = run_cli(dict(env, LD_LIBRARY_PATH=os.path.dirname(mock_cuda)), "doctor")
    line = next(l for l in found.stdout.splitlines() if l.split()[1:2] == ["preload"])
    assert line.startswith("OK") and "no CUPTI loaded" in line, found.stdout
    if not os.path.exists("/dev/nvidiactl"):
        none = run_cli(dict(env, LD_LIBRARY_PATH=""), "doctor")
        line = next(l for l in none.stdout.splitlines() if l.split()[1:2] == ["preload"])
        assert line.startswith("WARN") and "not known here" in line, none.stdout


def test_doctor_flags_another_injector(env):
    env["CUDA_INJECTION64_PATH"] = "/opt/nsight/libToolsInjection64.so"
    p = run_cli(env, "doctor")
    assert p.returncode == 1
    assert any(line.startswith("FAIL") and "CUDA_INJECTION64_PATH" in line for line in p.stdout.splitlines())


# ---- launcher and metrics hook, in process --------------------------------------------------

def test_launcher_env(tmp_path, native, monkeypatch):
    lib = Path(native[2])
    cupti = tmp_path / "libcupti.so.13"
    cupti.write_bytes(b"")
    base = {"PATH": "/bin", "OTEL_GPU_CENSUS_CUPTI": str(cupti)}
    plan = launcher.build_env(tmp_path, base=base, library=lib)
    assert plan.census_on and not plan.warnings
    assert plan.env["CUDA_INJECTION64_PATH"] == str(lib)
    assert plan.env["OTEL_GPU_CENSUS_DIR"] == str(tmp_path)
    assert plan.env["OTEL_GPU_CENSUS_CUPTI"] == str(cupti) and plan.env["PATH"] == "/bin"

    plan = launcher.build_env(tmp_path, base={"OTEL_GPU_CENSUS_DISABLED": "1"}, library=lib)
    assert not plan.census_on and "OTEL_GPU_CENSUS_DISABLED" in plan.warnings[0]
    assert "CUDA_INJECTION64_PATH" not in plan.env

    monkeypatch.setenv("OTEL_GPU_CENSUS_LIB", str(tmp_path / "missing.so"))
    plan = launcher.build_env(tmp_path, base={})
    assert not plan.census_on and "not found" in plan.warnings[0]


def test_find_cupti_prefers_explicit_then_wheel(tmp_path, monkeypatch):
    explicit = tmp_path / "libcupti.so.13"
    explicit.write_bytes(b"")
    assert launcher.find_cupti({"OTEL_GPU_CENSUS_CUPTI": str(explicit)}) == explicit
    assert launcher.find_cupti({"OTEL_GPU_CENSUS_CUPTI": str(tmp_path / "nope")}) is None
    wheel = tmp_path / "site" / "nvidia" / "cu13" / "lib"
    wheel.mkdir(parents=True)
    (wheel / "libcupti.so.13").write_bytes(b"")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for name in [m for m in sys.modules if m == "nvidia" or m.startswith("nvidia.")]:
        monkeypatch.delitem(sys.modules, name)
    assert launcher.find_cupti({}) == wheel / "libcupti.so.13"


def test_metrics_hook_survives_a_missing_module(monkeypatch, capsys):
    import otel_gpu_census.telemetry
    monkeypatch.setitem(sys.modules, "otel_gpu_census.telemetry.sidecar", None)
    monkeypatch.delattr(otel_gpu_census.telemetry, "sidecar", raising=False)
    args = cli.build_parser().parse_args(["run", "--exporter", "console", "--", "true"])
    assert cli._start_metrics(args, "/tmp", 1) is None
    assert "metrics export is not available" in capsys.readouterr().err
    args = cli.build_parser().parse_args(["run", "--", "true"])
    assert cli._start_metrics(args, "/tmp", 1) is None          # not asked for: not even imported


def test_metrics_hook_calls_start_sidecar_and_stop(monkeypatch):
    import types
    calls = []

    class Handle:
        def stop(self):
            calls.append("stop")
    fake = types.SimpleNamespace(start_sidecar=lambda **kw: calls.append(kw) or Handle())
    monkeypatch.setitem(sys.modules, "otel_gpu_census.telemetry.sidecar", fake)
    import otel_gpu_census.telemetry
    monkeypatch.setattr(otel_gpu_census.telemetry, "sidecar", fake, raising=False)
    args = cli.build_parser().parse_args(["run", "--exporter", "prometheus", "--prometheus-port", "9464",
                                          "--metrics-interval", "2.5", "--", "true"])
    h = cli._start_metrics(args, "/d", 77)
    cli._stop_metrics(h)
    assert calls == [dict(census_dir="/d", root_pid=77, exporter="prometheus", prometheus_port=9464,
                          interval_s=2.5), "stop"]


_SIGNAL_LOGGER = textwrap.dedent(r"""
    import os, signal, sys
    log, ready, stop = sys.argv[1:4]
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    open(ready, "w").close()
    while not os.path.exists(stop):
        info = signal.sigtimedwait({signal.SIGINT}, 0.05)
        if info:
            with open(log, "a") as f:
                f.write(f"{info.si_code} {info.si_pid}\n")
    sys.exit(5)
""")


def test_ctrl_c_at_a_terminal_reaches_the_command_once(env, census_dir, tmp_path):
    """The terminal sends SIGINT to the whole foreground group: the command already has it, so the
    launcher must not send a second one (a second Ctrl-C makes many servers skip their clean shutdown)."""
    import pty
    log, ready, stop = tmp_path / "ints", tmp_path / "ready", tmp_path / "stop"
    logger = tmp_path / "logger.py"
    logger.write_text(_SIGNAL_LOGGER)
    argv = cli_cmd("run", "--dir", str(census_dir), "--", sys.executable, str(logger), str(log), str(ready), str(stop))
    pid, master = pty.fork()
    if pid == 0:                                   # child: session leader on the new terminal
        os.execve(argv[0], argv, env)
    try:
        deadline = time.time() + 20
        while not ready.exists():
            assert time.time() < deadline
            time.sleep(0.02)
        os.write(master, b"\x03")                  # Ctrl-C
        deadline = time.time() + 10
        while not log.exists() and time.time() < deadline:
            time.sleep(0.02)
        time.sleep(0.5)                            # room for a duplicate to arrive
        stop.touch()
        _, status = os.waitpid(pid, 0)
    finally:
        try:
            while os.read(master, 65536):
                pass
        except OSError:
            pass
        os.close(master)
    assert os.waitstatus_to_exitcode(status) == 5   # the launcher itself was not stopped by Ctrl-C
    senders = [line.split() for line in log.read_text().splitlines()]
    assert senders == [[str(0x80), "0"]]           # one SIGINT, from the terminal (SI_KERNEL), none from us


def test_ignored_signals_stay_ignored_for_the_command(env, census_dir):
    # like `nohup otel-gpu-census run ...`: SIGHUP ignored by whoever started us stays ignored,
    # while SIGPIPE, which Python ignores for itself, is back at its default
    p = subprocess.run(cli_cmd("run", "--dir", str(census_dir), "--", "cat", "/proc/self/status"), env=env,
                       capture_output=True, text=True, timeout=60,
                       preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    assert p.returncode == 0, p.stderr
    [ignored] = [int(line.split()[1], 16) for line in p.stdout.splitlines() if line.startswith("SigIgn:")]
    assert ignored & (1 << (signal.SIGHUP - 1))
    assert not ignored & (1 << (signal.SIGPIPE - 1))


def test_report_adds_processes_per_gpu(env, census_dir, segments, records):
    uuid = bytes.fromhex("00112233445566778899aabbccddeeff")

    def on_gpu(seg):
        seg.devices[0].uuid = list(uuid)
    for pid, nbytes in ((4_200_001, 1_000_000_007), (4_200_002, 3)):
        _write(segments, census_dir, [records.memcpy("dtoh", nbytes, T0, T0 + 10, dst="pinned"),
                                      records.kernel(T0, T0 + MS)], pid=pid, edit=on_gpu)
    p = run_cli(env, "report", str(census_dir), "--json")
    gpus = json.loads(p.stdout)["gpus"]
    assert list(gpus) == ["GPU-00112233-4455-6677-8899-aabbccddeeff"]
    [g] = gpus.values()
    assert g["copies"]["dtoh"]["bytes"] == 1_000_000_010 and g["kernel_count"] == 2
    p = run_cli(env, "report", str(census_dir))
    assert ("all 2 processes, per GPU:\n  GPU-00112233-4455-6677-8899-aabbccddeeff: kernels 2 (0.002000 s), "
            "device-to-host 1,000,000,010 bytes (1.00 GB)") in p.stdout


def test_run_with_an_unwritable_json_path_does_not_start(env, census_dir, tmp_path):
    marker = tmp_path / "ran"
    p = run_cli(env, "run", "--dir", str(census_dir), "--json", str(tmp_path / "no" / "such" / "r.json"), "--",
                "touch", str(marker))
    assert p.returncode == 1 and "cannot write" in p.stderr
    assert not marker.exists()


def test_size_and_quotient_formatting():
    from otel_gpu_census.report.figures import exact, human_size, per
    assert [human_size(x) for x in (0, 999, 1000, 999_999, 643_212_345, 999_999_999, 2.5)] == \
        ["0 B", "999 B", "1.0 kB", "1.0 MB", "643.2 MB", "1.00 GB", "2.5 B"]
    assert [exact(per(t, n)) for t, n in ((12, 4), (10, 4), (1, 3), (2001, 1000), (10**12, 7))] == \
        ["3", "2.5", "0.33", "2", "142,857,142,857.14"]


def test_doctor_names_a_library_that_does_not_load(env, tmp_path):
    bogus = tmp_path / "libotel_gpu_census.so"
    bogus.write_text("not a library")
    env["OTEL_GPU_CENSUS_LIB"] = str(bogus)
    p = run_cli(env, "doctor")
    assert p.returncode == 1
    [line] = [line for line in p.stdout.splitlines() if line.split()[1:2] == ["injector"]]
    assert line.startswith("FAIL") and f"cannot load {bogus}" in line


def test_run_tidies_only_the_default_folder(env, segments, dead_pid, tmp_path):
    default = tmp_path / "xdg" / "otel-gpu-census"
    default.mkdir(mode=0o700)
    named = tmp_path / "named"
    named.mkdir(mode=0o700)
    two_days_ago = time.time() - 2 * 86400

    def ended_long_ago(seg):
        seg.wall_start_ns = seg.wall_update_ns = int(two_days_ago * 1e9)
    old = [segments.segment(d, [], pid=dead_pid, edit=ended_long_ago) for d in (default, named)]
    recent = segments.segment(default, [], pid=dead_pid, start_ticks=3)
    for p in old:
        os.utime(p, (two_days_ago, two_days_ago))
    assert run_cli(env, "run", "--dir", str(named), "--", "true").returncode == 0
    assert old[1].exists()
    assert run_cli(env, "run", "--", "true").returncode == 0
    assert not old[0].exists() and recent.exists() and old[1].exists()
