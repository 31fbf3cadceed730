"""A real Prometheus server (the Debian `prometheus` package) scrapes the sidecar, and every query of
the Grafana dashboard runs against it. Also: the dashboard only names metrics the code emits, and
promtool accepts collector-config/prometheus.yml (test_collector_config.py checks the collector's side).
Server tests are skipped when no `prometheus` binary is installed."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from otel_gpu_census import census
from otel_gpu_census.telemetry import census_metrics as metrics, nvml
from otel_gpu_census.telemetry.sidecar import start_sidecar
from prometheus_server import Prometheus
import request_metrics

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "collector-config"
DASHBOARD = CONFIGS / "grafana-dashboard.json"
UNIT_SUFFIX = {"By": "_bytes", "s": "_seconds", "By/s": "_bytes_per_second"}


@pytest.fixture(autouse=True)
def clean_otel_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("OTEL_"):
            monkeypatch.delenv(k)


def prometheus_names():
    """{prometheus name: spec} for every instrument, as the OTel exporters name them. Unit-"1"
    gauges may carry `_ratio` (the Collector's exporter adds it, ours does not)."""
    out = {}
    for spec in metrics.CENSUS_INSTRUMENTS + nvml.NVML_INSTRUMENTS:
        base = spec.name.replace(".", "_")
        suffix = UNIT_SUFFIX.get(spec.unit, "")
        if not base.endswith(suffix):
            base += suffix
        if spec.instrument == "counter":
            out[base + "_total"] = spec
        else:
            out[base] = spec
            if spec.unit == "1" and not base.endswith("_ratio"):
                out[base + "_ratio"] = spec
    return out


def dashboard_queries():
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dash["panels"]:
        for t in panel.get("targets", []):
            out.append((panel["title"], t["expr"]))
    return dash, out


def names_in(expr: str):
    """Metric names an expression reads: bare names and {__name__=~"a(_ratio)?"} alternatives."""
    found = set()
    for m in re.finditer(r'__name__=~"([a-z_]+)\(_ratio\)\?"', expr):
        found |= {m.group(1), m.group(1) + "_ratio"}
    stripped = re.sub(r'\{[^}]*\}|\b(?:by|without)\s*\([^)]*\)', "", expr)
    for m in re.finditer(r"\b((?:gpu_census|hw_gpu|gen_ai)_[a-z_]+)\b", stripped):
        found.add(m.group(1))
    return found


def test_dashboard_reads_only_metrics_the_code_emits():
    dash, queries = dashboard_queries()
    known = {**prometheus_names(), **request_metrics.prometheus_names()}
    titles = [p["title"] for p in dash["panels"]]
    assert any("busy is not full" in t.lower() for t in titles)
    assert any("copies by direction" in t.lower() for t in titles)
    seen = set()
    for title, expr in queries:
        names = names_in(expr)
        assert names, (title, expr)
        unknown = names - set(known)
        assert not unknown, f"panel {title!r} reads metrics nothing emits: {sorted(unknown)}"
        seen |= {known[n].name for n in names}
    busy_panel = next(p for p in dash["panels"] if "busy is not full" in p["title"].lower() and p.get("targets"))
    busy_names = {known[n].name for t in busy_panel["targets"] for n in names_in(t["expr"])}
    assert {"hw.gpu.utilization", "gpu_census.busy.ratio", "gpu_census.sm.occupancy"} <= busy_names
    assert "gpu_census.copy.bytes" in seen


@pytest.mark.skipif(not shutil.which("promtool"), reason="no promtool: apt-get install prometheus (Debian)")
def test_prometheus_config_passes_promtool():
    r = subprocess.run(["promtool", "check", "config", str(CONFIGS / "prometheus.yml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.skipif(not shutil.which("prometheus"),
                    reason="no prometheus server binary: apt-get install prometheus (Debian)")
def test_real_prometheus_scrapes_the_sidecar_and_runs_the_dashboard(segments, records, census_dir, tmp_path):
    r = records
    segments.segment(census_dir, [r.kernel(10**12, 10**12 + 5000), r.memcpy("dtoh", 65536, 10**12 + 6000,
                                                                               10**12 + 7000, dst="pageable"),
                                  r.peer(4096, 10**12 + 8000, 10**12 + 9000, src_device=0, dst_device=1)],
                     comm="llama-server", final=True, state=census.STATE_ACTIVE)
    handle = start_sidecar(census_dir, root_pid=os.getpid(), exporter="prometheus", prometheus_port=0, nvml=False)
    # one request through the request lifecycle on the same provider (as `run --proxy` shares it), so the
    # dashboard's request panels have their series too
    from otel_gpu_census.attribution.ledger import COMPLETE, GpuCost
    from otel_gpu_census.attribution.shares import Share
    from otel_gpu_census.telemetry.request import RequestTelemetry
    t0 = time.time_ns()
    req = RequestTelemetry(None, handle.meter_provider, provider_name="llama.cpp").start(
        start_ns=t0, operation="text_completion", model="m", span_name="text_completion m")
    req.first_token(t0 + 100_000_000)
    req.finish(t0 + 900_000_000, output_tokens=9,
               cost=GpuCost(status=COMPLETE, share=Share(kernel_count=3, kernel_ns=3000,
                                                         copies={"dtoh": census.Stat(1, 65536, 1000)})))
    prom = Prometheus(tmp_path, {"census": handle.prometheus_port})
    try:
        def scraped_twice():
            res = prom.query('rate(gpu_census_copy_bytes_total[1m])')      # needs two scrapes
            return res["status"] == "success" and res["data"]["result"]
        prom.wait_until(scraped_twice, "Prometheus never scraped two samples of the sidecar")
        res = prom.query('gpu_census_copy_bytes_total{gpu_census_copy_direction="dtoh"}')
        assert [float(x["value"][1]) for x in res["data"]["result"]] == [65536.0]
        assert res["data"]["result"][0]["metric"]["process_pid"] == str(os.getpid())
        _, queries = dashboard_queries()
        nvml_names = {n for n, s in prometheus_names().items() if s in nvml.NVML_INSTRUMENTS}
        for title, expr in queries:
            q = expr.replace("$__rate_interval", "1m").replace("$gpu", ".*")
            res = prom.query(q)
            assert res["status"] == "success", (title, q, res.get("error"))
            if not names_in(expr) <= nvml_names:    # census series exist here; NVML ones need a GPU
                assert res["data"]["result"], f"panel {title!r} query returned nothing: {q}"
    finally:
        prom.stop()
        handle.stop()
