"""The dashboard's request panels: in flight beside busy, TTFT, device-to-host bytes per request,
each reading series the code emits, with the labels it sets."""
from __future__ import annotations

import json
import re
from pathlib import Path

import request_metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "collector-config" / "grafana-dashboard.json"


def _panel(title: str) -> dict:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return next(p for p in panels if p["title"] == title)


def _series(expr: str):
    """(series name, {label: value}) of every selector in a PromQL expression."""
    out = []
    expr = re.sub(r"\b(?:by|without)\s*\([^)]*\)", "", expr)
    for name, sel in re.findall(r"\b([a-z_]+)(?:\{([^}]*)\})?", expr):
        if name.startswith(("gen_ai_", "gpu_census_")):
            out.append((name, dict(re.findall(r'(\w+)=~?"([^"]*)"', sel or ""))))
    return out


def _prom(attributes):
    return {a.replace(".", "_") for a in attributes}


def _labels(expr: str):
    return set(re.findall(r"\bby \(([^)]*)\)", expr)) - {"le"}


def test_request_panels_read_emitted_series_with_their_labels():
    known = request_metrics.prometheus_names()
    for title, wanted in (("Requests in flight vs census busy", "gpu_census.requests.in_flight"),
                          ("Time to first token", "gen_ai.server.time_to_first_token"),
                          ("Device-to-host bytes per request", "gpu_census.request.copy.size")):
        exprs = [t["expr"] for t in _panel(title)["targets"]]
        seen = set()
        for expr in exprs:
            for name, labels in _series(expr):
                if name == "gpu_census_busy_ratio":
                    continue                     # a census gauge: test_metrics_prometheus checks it
                assert name in known, (title, name, sorted(known))
                m = known[name]
                seen.add(m.name)
                assert set(labels) <= _prom(m.attributes), (title, name, labels, m.attributes)
            for group in _labels(expr):
                for label in (x.strip() for x in group.split(",")):
                    if label != "hw_id":          # the census gauge's label
                        assert any(label in _prom(m.attributes) for m in known.values()), (title, label)
        assert wanted in seen, title


def test_device_to_host_panel_selects_that_direction():
    exprs = [t["expr"] for t in _panel("Device-to-host bytes per request")["targets"]]
    assert all('gpu_census_copy_direction="dtoh"' in e for e in exprs)
    assert any(e.startswith("histogram_quantile(0.9") for e in exprs)
