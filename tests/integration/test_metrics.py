"""Census metrics over the wire: real segments (written by the native tally from real CUPTI
records) read by the real reader, exported by the sidecar through OTLP gRPC, OTLP HTTP and a
Prometheus endpoint, and decoded on the other side."""
from __future__ import annotations

import logging
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from otel_gpu_census.telemetry import setup as exporters
from otel_gpu_census.telemetry.census_metrics import CENSUS_INSTRUMENTS
from otel_gpu_census.telemetry.sidecar import start_sidecar
from otlp_receiver import OtlpReceiver, latest
from ports import free_port

GC_STATE_ACTIVE = 1
T0 = 1_000_000_000_000          # a CUPTI timestamp (ns)
US = 1000
UUID_A = bytes.fromhex("11111111222233334444555555555555")
UUID_B = bytes.fromhex("aaaaaaaabbbbccccddddeeeeeeeeeeee")
HW_A = "GPU-11111111-2222-3333-4444-555555555555"
HW_B = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"
SPECS = {s.name: s for s in CENSUS_INSTRUMENTS}


@pytest.fixture(autouse=True)
def clean_otel_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("OTEL_"):
            monkeypatch.delenv(k)


def _uuids(mapping):
    def edit(seg):
        for d in seg.devices:
            if d.in_use and d.device_id in mapping:
                for i, b in enumerate(mapping[d.device_id]):
                    d.uuid[i] = b
    return edit


def _start_ticks(pid):
    from otel_gpu_census.census import proctree
    return proctree.proc_start_ticks(pid)


@pytest.fixture
def child():
    """A real child process of this test (stands for a CUDA worker the server forked)."""
    p = subprocess.Popen(["sleep", "60"])
    yield p
    p.kill()
    p.wait()


@pytest.fixture
def server_tree(segments, records, census_dir, child, dead_pid):
    """Segments for this process ("llama-server", GPU A) and its child ("worker", GPU B), plus a
    stranger outside the tree that must never be exported."""
    r = records
    a = [
        r.kernel(T0, T0 + 100 * US), r.kernel(T0 + 50 * US, T0 + 150 * US, corr=2),   # overlap: busy 150 us
        r.kernel(T0 + 1000 * US, T0 + 1200 * US, corr=3),                              # busy 200 us
        r.memcpy("htod", 1_000_000, T0 + 300 * US, T0 + 310 * US, src="pageable"),
        r.memcpy("htod", 1_000_000, T0 + 320 * US, T0 + 330 * US, src="pageable"),
        r.memcpy("dtoh", 4096, T0 + 400 * US, T0 + 402 * US, dst="pinned"),
        r.memcpy("dtod", 8192, T0 + 500 * US, T0 + 501 * US),
        r.memset(256, T0 + 600 * US, T0 + 603 * US),
        r.peer(65536, T0 + 700 * US, T0 + 704 * US, src_device=1, dst_device=0),   # GPU B sends, A receives
    ]
    segments.segment(census_dir, a, comm="llama-server", final=True, state=GC_STATE_ACTIVE,
                     edit=_uuids({0: UUID_A, 1: UUID_B}))
    b = [r.kernel(T0, T0 + 1000 * US, device=1), r.memcpy("dtoh", 123, T0 + 2000 * US, T0 + 2005 * US,
                                                          dst="pageable", device=1),
         r.graph_trace(T0 + 3000 * US, T0 + 3040 * US, device=1)]                   # one graph launch

    def edit_b(seg):
        _uuids({1: UUID_B})(seg)
        seg.dropped = 5
    segments.segment(census_dir, b, comm="worker", final=True, state=GC_STATE_ACTIVE, pid=child.pid,
                     ppid=os.getpid(), start_ticks=_start_ticks(child.pid), edit=edit_b)
    segments.segment(census_dir, [r.kernel(T0, T0 + 5 * US)], comm="stranger", pid=dead_pid, ppid=1,
                     edit=_uuids({0: UUID_A}))
    return {"a_pid": os.getpid(), "b_pid": child.pid, "stranger": dead_pid}


def _expect(tree):
    """(name, attributes, value) that must arrive, computed from the records above."""
    gpu = {"hw.type": "gpu", "hw.vendor": "NVIDIA"}           # on every series of a GPU (no NVML here)
    A = {"hw.id": HW_A, **gpu, "process.pid": tree["a_pid"], "process.executable.name": "llama-server"}
    B = {"hw.id": HW_B, **gpu, "process.pid": tree["b_pid"], "process.executable.name": "worker"}

    def cp(base, d, m):
        return {**base, "gpu_census.copy.direction": d, "gpu_census.copy.memory_kind": m}
    return [
        ("gpu_census.kernel.count", A, 3), ("gpu_census.kernel.count", B, 1),
        # B: its kernel and its graph launch (layout 3: a launch of a graph whose contents were not
        # learned counts its span as kernel time, no kernels: native/src/core/tally.c gc_tally_graph_launch)
        ("gpu_census.kernel.time", A, 400e-6), ("gpu_census.kernel.time", B, 1040e-6),
        ("gpu_census.busy.time", A, 350e-6), ("gpu_census.busy.time", B, 1040e-6),   # B: its kernel and its graph launch
        ("gpu_census.graph.count", B, 1), ("gpu_census.graph.time", B, 40e-6),
        ("gpu_census.copy.count", cp(A, "htod", "pageable"), 2),
        ("gpu_census.copy.bytes", cp(A, "htod", "pageable"), 2_000_000),
        ("gpu_census.copy.time", cp(A, "htod", "pageable"), 20e-6),
        ("gpu_census.copy.bytes", cp(A, "dtoh", "pinned"), 4096),
        ("gpu_census.copy.bytes", cp(A, "dtod", "device"), 8192),
        ("gpu_census.copy.bytes", cp(B, "dtoh", "pageable"), 123),
        ("gpu_census.copy.bytes", cp({**A, "hw.id": HW_B}, "ptop", "device"), 65536),
        ("gpu_census.peer.received.count", A, 1), ("gpu_census.peer.received.bytes", A, 65536),
        ("gpu_census.peer.received.time", A, 4e-6),
        ("gpu_census.memset.count", A, 1), ("gpu_census.memset.bytes", A, 256),
        ("gpu_census.memset.time", A, 3e-6),
        ("gpu_census.records.dropped", {"process.pid": tree["b_pid"], "process.executable.name": "worker"}, 5),
        ("gpu_census.records.dropped", {"process.pid": tree["a_pid"], "process.executable.name": "llama-server"}, 0),
        ("gpu_census.process.counting", {"process.pid": tree["a_pid"], "process.executable.name": "llama-server"}, 1),
        ("gpu_census.host.io", {"hw.id": HW_A, **gpu, "network.io.direction": "receive"}, 2_000_000),
        ("gpu_census.host.io", {"hw.id": HW_A, **gpu, "network.io.direction": "transmit"}, 4096),
        ("gpu_census.host.io", {"hw.id": HW_B, **gpu, "network.io.direction": "transmit"}, 123),
        ("gpu_census.host.io", {"hw.id": HW_B, **gpu, "network.io.direction": "receive"}, 0),
    ]


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_otlp_carries_exact_census_values(protocol, server_tree, census_dir, monkeypatch):
    with OtlpReceiver() as rx:
        endpoint = rx.grpc_endpoint if protocol == "grpc" else rx.http_endpoint
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
        monkeypatch.setenv("OTEL_SERVICE_NAME", "census-under-test")
        monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=ci,host.name=box1")
        monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "200")
        handle = start_sidecar(census_dir, root_pid=os.getpid(), nvml=False)   # exporter from the env
        try:
            assert handle.active and "OTLP " + protocol in handle.describe()
            pts = rx.wait_for(lambda p: {x.name for x in p} >= set(SPECS) and rx.requests >= 2)
        finally:
            handle.stop()
    transport = "grpc" if protocol == "grpc" else "http"
    assert {p.transport for p in pts} == {transport}
    for name, attrs, value in _expect(server_tree):
        p = latest(pts, name, attrs)
        assert p is not None, f"{name} {attrs} not exported"
        assert p.attributes == attrs, name       # exactly these attributes, nothing more
        if isinstance(value, int):
            assert p.is_int and p.value == value, (name, attrs, p.value)
        else:
            assert p.value == pytest.approx(value, rel=1e-12), (name, attrs, p.value)
    for p in pts:
        spec = SPECS[p.name]
        assert p.unit == spec.unit
        assert set(p.attributes) == set(spec.attributes), p.name
        assert p.resource["service.name"] == "census-under-test"
        assert p.resource["deployment.environment"] == "ci" and p.resource["host.name"] == "box1"
        if spec.instrument == "counter":
            assert (p.kind, p.monotonic, p.temporality) == ("sum", True, "cumulative"), p.name
        else:
            assert p.kind == "gauge", p.name
        # the process outside the run's tree never shows up
        assert p.attributes.get("process.pid") != server_tree["stranger"]
    busy = [p for p in pts if p.name == "gpu_census.busy.ratio"]
    assert {p.attributes["hw.id"] for p in busy} == {HW_A, HW_B}
    assert all(0.0 <= p.value <= 1.0 for p in busy)
    # Series most processes never start exist only where they counted something: peer copies
    # received (the llama-server's GPU A), memsets (A), graph launches (the worker's GPU B).
    def where(name):
        return {(p.attributes["hw.id"], p.attributes["process.pid"]) for p in pts if p.name == name}
    a, b = (HW_A, server_tree["a_pid"]), (HW_B, server_tree["b_pid"])
    for name in ("gpu_census.peer.received.count", "gpu_census.peer.received.bytes", "gpu_census.peer.received.time",
                 "gpu_census.memset.count", "gpu_census.memset.bytes", "gpu_census.memset.time"):
        assert where(name) == {a}, name
    assert where("gpu_census.graph.count") == where("gpu_census.graph.time") == {b}
    assert where("gpu_census.kernel.count") >= {a, b}     # every (GPU, process) pair, counted or not


def test_prometheus_endpoint_scraped_over_http(server_tree, census_dir):
    handle = start_sidecar(census_dir, root_pid=os.getpid(), exporter="prometheus", prometheus_port=0, nvml=False)
    try:
        assert handle.prometheus_port
        url = f"http://localhost:{handle.prometheus_port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
    finally:
        handle.stop()
    samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value, fam.type))

    def one(name, **labels):
        rows = [(v, t) for lab, v, t in samples.get(name, []) if all(lab.get(k) == str(x) for k, x in labels.items())]
        assert len(rows) == 1, (name, labels, samples.get(name))
        return rows[0]
    a = str(server_tree["a_pid"])
    assert one("gpu_census_copy_bytes_total", hw_id=HW_A, process_pid=a, gpu_census_copy_direction="htod",
               gpu_census_copy_memory_kind="pageable") == (2_000_000, "counter")
    assert one("gpu_census_kernel_count_total", hw_id=HW_A, process_pid=a,
               process_executable_name="llama-server") == (3, "counter")
    v, t = one("gpu_census_busy_time_seconds_total", hw_id=HW_A, process_pid=a)
    assert t == "counter" and v == pytest.approx(350e-6)
    assert one("gpu_census_host_io_bytes_total", hw_id=HW_B, network_io_direction="transmit") == (123, "counter")
    assert one("gpu_census_records_dropped_total", process_pid=str(server_tree["b_pid"])) == (5, "counter")
    assert one("gpu_census_process_counting", process_pid=a)[1] == "gauge"
    assert not any(lab.get("process_pid") == str(server_tree["stranger"])
                   for rows in samples.values() for lab, _, _ in rows)


def test_prometheus_port_in_use_warns_once_and_carries_on(server_tree, census_dir, caplog):
    blocker = socket.socket()
    blocker.bind(("localhost", 0))
    blocker.listen()
    try:
        with caplog.at_level(logging.WARNING):
            handle = start_sidecar(census_dir, exporter="prometheus", prometheus_port=blocker.getsockname()[1],
                                   nvml=False)
        handle.stop()
    finally:
        blocker.close()
    assert not handle.active
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "cannot listen" in warnings[0].getMessage()


@pytest.mark.parametrize("protocol,timeout", [("grpc", None), ("http/protobuf", "1")])
def test_collector_unreachable_one_warning_run_carries_on(protocol, timeout, server_tree, census_dir, monkeypatch,
                                                          caplog):
    """Nobody listens on the port. With the default OTLP timeout (10 s) the first export is still
    retrying when the run ends; with 1 s, several exports fail before it. Either way: one warning
    from us, none of the exporter's own retry lines, and stop() does not wait out the retries."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    if timeout:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", timeout)
    with caplog.at_level(logging.DEBUG):
        handle = start_sidecar(census_dir, root_pid=os.getpid(), interval_s=0.2, nvml=False)
        otlp = handle._exporting.otlp
        deadline = time.monotonic() + (10 if timeout else 1.5)
        while time.monotonic() < deadline and (otlp.failures < 2 if timeout else True):
            time.sleep(0.05)
        t = time.monotonic()
        handle.stop()
        stop_s = time.monotonic() - t
    assert otlp.successes == 0 and otlp.failures >= (2 if timeout else 1)
    assert stop_s < 4, f"stop() waited {stop_s:.1f}s on a collector that is not there"
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(loud) == 1, [f"{r.name}: {r.getMessage()}" for r in loud]
    assert loud[0].name == "otel_gpu_census.metrics" and "cannot export" in loud[0].getMessage()
    assert handle.census.reads >= 2       # the census kept being read meanwhile


def test_collector_coming_back_is_noticed(server_tree, census_dir, monkeypatch, caplog):
    port = free_port()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
    with caplog.at_level(logging.WARNING, logger="otel_gpu_census.metrics"):
        handle = start_sidecar(census_dir, root_pid=os.getpid(), interval_s=0.2, nvml=False)
        try:
            deadline = time.monotonic() + 15
            while not handle._exporting.otlp.down and time.monotonic() < deadline:
                time.sleep(0.05)
            assert handle._exporting.otlp.down
            with OtlpReceiver(grpc_enabled=False, http_port=port) as rx:
                rx.wait_for(lambda p: any(x.name == "gpu_census.kernel.count" for x in p))
                deadline = time.monotonic() + 5
                while handle._exporting.otlp.down and time.monotonic() < deadline:
                    time.sleep(0.05)
                handle.stop()        # while the collector is up: the last export succeeds
        finally:
            handle.stop()
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("cannot export" in m for m in msgs) == 1
    assert sum("works again" in m for m in msgs) == 1


def test_no_exporter_configured_is_inactive(census_dir):
    handle = start_sidecar(census_dir)
    assert not handle.active and "not exported" in handle.describe()
    handle.stop()


def test_nvml_missing_costs_one_warning_and_census_still_flows(server_tree, census_dir, monkeypatch, caplog):
    from otel_gpu_census.telemetry import nvml
    if nvml.open_nvml()[0] is not None:
        pytest.skip("NVML works on this machine (the GPU tests cover it)")
    with OtlpReceiver(http_enabled=False) as rx, caplog.at_level(logging.WARNING):
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rx.grpc_endpoint)
        handle = start_sidecar(census_dir, root_pid=os.getpid(), interval_s=0.2)   # nvml on
        try:
            pts = rx.wait_for(lambda p: any(x.name == "gpu_census.copy.bytes" for x in p))
        finally:
            handle.stop()
    assert not any(p.name.startswith("hw.gpu.memory") or p.name == "hw.gpu.utilization" for p in pts)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "NVML" in warnings[0] and "census metrics still flow" in warnings[0]


# ---- exporter choice --------------------------------------------------------------------------

@pytest.mark.parametrize("explicit,env,want", [
    (None, {}, []),
    (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, ["otlp"]),
    (None, {"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://c:4318/v1/metrics"}, ["otlp"]),
    (None, {"OTEL_METRICS_EXPORTER": "prometheus, Console,prometheus"}, ["prometheus", "console"]),
    (None, {"OTEL_METRICS_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, []),
    (None, {"OTEL_METRICS_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, []),
    ("prometheus", {"OTEL_METRICS_EXPORTER": "otlp"}, ["prometheus"]),
    ("none", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, []),
])
def test_exporter_choice_follows_flag_then_env(explicit, env, want):
    assert exporters.choose_exporters(explicit, env) == want


def test_span_exporters_default_to_otlp_and_follow_the_sdk_names():
    assert exporters.exporter_names("traces", env={}) == ["otlp"]
    assert exporters.exporter_names("traces", env={"OTEL_TRACES_EXPORTER": "console,none"}) == []
    assert exporters.exporter_names("traces", env={"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "TRUE"}) == []


def test_unknown_exporter_names(caplog):
    with pytest.raises(exporters.ConfigError, match="choose one of otlp, prometheus, console, none"):
        exporters.choose_exporters("jaeger", {})
    with caplog.at_level(logging.WARNING):
        out = exporters.build_readers(["zipkin", "console"])
    assert out.descriptions == ["console (stdout) every 60 s"]
    [w] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert w == ("metrics: zipkin exporter not started: Requested component 'zipkin' not found in entry point "
                 "'opentelemetry_metrics_exporter'")


def test_protocol_and_interval_as_the_sdk_reads_them(monkeypatch, caplog):
    """OTLP's protocol by the SDK's own lookup (the signal's variable first), the period from
    OTEL_METRIC_EXPORT_INTERVAL unless the caller gives one."""
    def described(**kw):
        out = exporters.build_readers(["otlp"], **kw)
        try:
            return out.descriptions
        finally:
            for r in out.readers:
                r.shutdown()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "http://127.0.0.1:9/v1/metrics")
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "1500")
    assert described() == ["OTLP grpc 127.0.0.1:9 every 1.5 s"]
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "http/protobuf")
    assert described(interval_s=2) == ["OTLP http/protobuf http://127.0.0.1:9/v1/metrics every 2 s"]
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "http/json")
    with caplog.at_level(logging.WARNING):
        assert described() == []
    assert "Unsupported OTLP protocol 'http/json'" in caplog.text
    with pytest.raises(exporters.ConfigError):
        exporters.build_readers(["console"], interval_s=0)


def test_default_service_name(monkeypatch):
    """`run`'s census metrics are ours; the spans and request metrics made inside a server are the server's: the
    engine's name, llama.cpp for the proxy. OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES win over either."""
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    from otel_gpu_census.integrations.llamacpp import SERVICE_NAME as PROXY
    from otel_gpu_census.integrations.sglang.engine import SchedulerTelemetry
    from otel_gpu_census.integrations.vllm.engine import EngineTelemetry
    assert exporters.make_resource().attributes["service.name"] == "otel-gpu-census"
    assert PROXY == "llama.cpp" and exporters.make_resource(PROXY).attributes["service.name"] == "llama.cpp"
    for engine, name in ((EngineTelemetry, "vllm"), (SchedulerTelemetry, "sglang")):
        tel = exporters.engine_telemetry(service_name=engine.PROVIDER)
        assert tel.tracer_provider.resource.attributes["service.name"] == name
        assert tel.meter_provider._sdk_config.resource.attributes["service.name"] == name
        tel.shutdown()
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.name=from-attrs")
    assert exporters.make_resource("vllm").attributes["service.name"] == "from-attrs"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "from-name")
    assert exporters.make_resource("vllm").attributes["service.name"] == "from-name"


def test_otel_config_file_is_said_not_read(monkeypatch, caplog):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    monkeypatch.setenv("OTEL_CONFIG_FILE", "/nonexistent/otel.yaml")
    with caplog.at_level(logging.WARNING):
        exporters.build_telemetry().shutdown()
    assert [r.getMessage() for r in caplog.records if "OTEL_CONFIG_FILE" in r.getMessage()] == [
        "OTEL_CONFIG_FILE is not read here: the OTEL_* variables configure these providers (under "
        "opentelemetry-instrument the vLLM and SGLang hooks use the application's, configured from it)"]


def test_last_export_carries_totals_written_just_before_stop(segments, records, census_dir, monkeypatch):
    """The run stops the sidecar right after the server's final flush: that flush must be exported."""
    r = records
    with OtlpReceiver(http_enabled=False) as rx:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rx.grpc_endpoint)
        segments.segment(census_dir, [r.kernel(T0, T0 + 10)], comm="srv", final=True, state=GC_STATE_ACTIVE)
        handle = start_sidecar(census_dir, root_pid=os.getpid(), interval_s=600, nvml=False)
        for p in census_dir.iterdir():      # the final flush: more kernels, state exited
            p.unlink()
        segments.segment(census_dir, [r.kernel(T0, T0 + 10), r.kernel(T0 + 20, T0 + 30)], comm="srv", final=True)
        handle.stop()
        pts = rx.wait_for(lambda p: any(x.name == "gpu_census.kernel.count" for x in p), timeout=5)
    assert rx.requests == 1
    assert latest(pts, "gpu_census.kernel.count", {"process.pid": os.getpid()}).value == 2


def test_console_exporter_output_makes_the_busy_table(server_tree, census_dir, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench" / "perf"))
    import perf_busy_gap
    handle = start_sidecar(census_dir, root_pid=os.getpid(), exporter="console", interval_s=0.2, nvml=False)
    time.sleep(0.7)
    handle.stop()
    out = capsys.readouterr().out
    docs = perf_busy_gap.exports("workload chatter {not json}\n" + out)
    assert len(docs) >= 2
    table = perf_busy_gap.rows(docs)
    gpus = {r["hw.id"] for r in table}
    assert gpus == {HW_A, HW_B}
    assert all(0 <= r["gpu_census.busy.ratio"] <= 1 for r in table)
    later = [r for r in table if r["hw.id"] == HW_A and "htod B/s" in r]
    assert later and all(r["htod B/s"] == 0 for r in later)      # totals did not change between exports
    assert "| t (s) | GPU | nvidia-smi util | census busy |" in perf_busy_gap.markdown(table)
