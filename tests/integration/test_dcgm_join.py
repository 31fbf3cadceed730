"""The census's series join dcgm-exporter's on the GPU's UUID (docs/dcgm.md): the sidecar's Prometheus
endpoint next to a dcgm-exporter stand-in (its exposition format and labels, for the same GPU), read as
Prometheus reads them, and with a real Prometheus (Debian `prometheus`) every query of
collector-config/grafana-dcgm-panels.json. Server tests are skipped without a `prometheus` binary."""
from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import threading
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from otel_gpu_census import census
from otel_gpu_census.telemetry.sidecar import start_sidecar
from prometheus_server import Prometheus
from test_metrics_prometheus import prometheus_names

ROOT = Path(__file__).resolve().parents[2]
PANELS = ROOT / "collector-config" / "grafana-dcgm-panels.json"
DOC = ROOT / "docs" / "dcgm.md"
HW = "GPU-d56d3e36-3dce-04ce-466c-fd86813f8b53"
OTHER = "GPU-0a1b2c3d-0000-1111-2222-333344445555"     # a GPU of the node the census never saw
LABELS = 'gpu="{i}",UUID="{u}",pci_bus_id="00000000:4{i}:00.0",device="nvidia{i}",modelName="NVIDIA H200",' \
         'Hostname="gpu-node",DCGM_FI_DRIVER_VERSION="580.159.04"'
DCGM = {"DCGM_FI_DEV_GPU_UTIL": (94, 3), "DCGM_FI_PROF_GR_ENGINE_ACTIVE": (0.5, 0.01),
        "DCGM_FI_PROF_SM_OCCUPANCY": (0.125, 0.0), "DCGM_FI_PROF_PCIE_RX_BYTES": (4e9, 1e3),
        "DCGM_FI_PROF_PCIE_TX_BYTES": (1e8, 1e3)}


def dcgm_exposition() -> str:
    """What dcgm-exporter serves for two GPUs: gauges, one line per field and GPU, its labels."""
    out = []
    for name, values in DCGM.items():
        out += [f"# HELP {name} {name}.", f"# TYPE {name} gauge"]
        out += [f"{name}{{{LABELS.format(i=i, u=u)}}} {v}" for i, (u, v) in enumerate(zip((HW, OTHER), values))]
    return "\n".join(out) + "\n"


@pytest.fixture(autouse=True)
def clean_otel_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("OTEL_"):
            monkeypatch.delenv(k)


@pytest.fixture
def dcgm():
    """A dcgm-exporter stand-in on a free port: (port)."""
    body = dcgm_exposition().encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture
def sidecar(segments, records, census_dir):
    """The sidecar's Prometheus endpoint over one process that used GPU `HW` (its UUID as CUDA gives it:
    16 raw bytes in the segment, formatted by the reader)."""
    r = records
    raw = bytes.fromhex(HW[4:].replace("-", ""))

    def edit(seg):
        for i, b in enumerate(raw):
            seg.devices[0].uuid[i] = b
    segments.segment(census_dir, [r.kernel(10**12, 10**12 + 5000),
                                  r.memcpy("htod", 65536, 10**12 + 6000, 10**12 + 7000, src="pinned")],
                     comm="vllm", final=True, state=census.STATE_ACTIVE, edit=edit)
    handle = start_sidecar(census_dir, root_pid=os.getpid(), exporter="prometheus", prometheus_port=0, nvml=False)
    yield handle.prometheus_port
    handle.stop()


def _scrape(port: int):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def test_the_census_hw_id_is_dcgms_uuid_for_the_same_gpu(sidecar, dcgm):
    ours = [s for s in _scrape(sidecar) if "hw_id" in s.labels]
    theirs = {s.labels["UUID"]: s.labels for s in _scrape(dcgm)}
    assert ours and {s.labels["hw_id"] for s in ours} == {HW}
    joined = [(s, theirs[s.labels["hw_id"]]) for s in ours if s.labels["hw_id"] in theirs]
    assert len(joined) == len(ours)
    assert {d["modelName"] for _, d in joined} == {"NVIDIA H200"} and {d["device"] for _, d in joined} == {"nvidia0"}
    assert all(s.labels["hw_type"] == "gpu" and s.labels["hw_vendor"] == "NVIDIA" for s, _ in joined)


def _panel_queries():
    dash = json.loads(PANELS.read_text())
    return [(p["title"], t) for p in dash["panels"] for t in p.get("targets", [])]


def test_each_panel_reads_census_names_the_code_emits_and_dcgm_fields_the_doc_names():
    doc = DOC.read_text()
    ours = set(prometheus_names())
    panels = {}
    for title, t in _panel_queries():
        panels.setdefault(title, []).append(t["expr"])
    assert len(panels) == 4
    for title, exprs in panels.items():
        text = " ".join(exprs)
        census_names = set(re.findall(r"\b(gpu_census_[a-z_]+|hw_gpu_[a-z_]+)\b", text))
        dcgm_names = set(re.findall(r"\bDCGM_FI_[A-Z_]+\b", text))
        assert census_names and dcgm_names, title               # each panel sets both side by side (or joins them)
        assert census_names <= ours, (title, census_names - ours)
        assert all(n in doc for n in dcgm_names), (title, dcgm_names)
        for e in exprs:                                         # every DCGM series is put under the census's key
            assert e.count("DCGM_FI_") == e.count('label_replace(') - e.count('"network_io_direction"'), e
            assert "DCGM_FI_" not in e or '"hw_id", "$1", "UUID", "(.+)"' in e, e


@pytest.mark.skipif(not shutil.which("prometheus"),
                    reason="no prometheus server binary: apt-get install prometheus (Debian)")
def test_a_real_prometheus_joins_every_panel_query(sidecar, dcgm, tmp_path):
    prom = Prometheus(tmp_path, {"census": sidecar, "dcgm": dcgm})
    try:
        def both_scraped_twice():                    # two scrapes of both: rates and the join have data
            a = prom.query("rate(gpu_census_kernel_count_total[1m])")
            b = prom.query("count_over_time(DCGM_FI_DEV_GPU_UTIL[1m]) >= 2")
            return a.get("data", {}).get("result") and b.get("data", {}).get("result")
        prom.wait_until(both_scraped_twice, "Prometheus never scraped both exporters twice")
        # the dashboard's GPU variable: the census's GPUs (Grafana's "All" is those values, joined by |)
        variable = json.loads(PANELS.read_text())["templating"]["list"][1]["query"]["query"]
        name = re.fullmatch(r"label_values\((\w+), hw_id\)", variable).group(1)
        gpus = sorted({r["metric"]["hw_id"] for r in prom.query(name)["data"]["result"]})
        assert gpus == [HW]
        got = {}
        for title, t in _panel_queries():
            q = t["expr"].replace("$__rate_interval", "1m").replace("$gpu", "|".join(gpus))
            res = prom.query(q)
            assert res["status"] == "success", (title, q, res.get("error"))
            rows = res["data"]["result"]
            # under the census's key, for the census's GPU only (DCGM's other GPU stays out)
            assert rows and {r["metric"]["hw_id"] for r in rows} == {HW}, (title, t["refId"], rows)
            got[(title, t["refId"])] = rows
        by_title = {title: rows for (title, _), rows in got.items()}
        engine = [r for (title, ref), rows in got.items() if ref == "B" and "SM occupancy" in title for r in rows]
        assert [float(r["value"][1]) for r in engine] == [0.5]                       # DCGM's value, now under hw_id
        pcie = [r for (title, ref), rows in got.items() if ref == "B" and "PCIe" in title for r in rows]
        assert [(r["metric"]["network_io_direction"], float(r["value"][1])) for r in pcie] == [("receive", 4e9)]
        table = next(rows for title, rows in by_title.items() if "table" in title.lower() or "model" in title)
        assert [(r["metric"]["modelName"], r["metric"]["Hostname"], float(r["value"][1])) for r in table] == \
            [("NVIDIA H200", "gpu-node", 1.0)]                                      # the census's one kernel
    finally:
        prom.stop()
