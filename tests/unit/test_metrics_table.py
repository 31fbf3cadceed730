"""The llama-server metrics table's whole path on a CPU: a stand-in server whose synthetic census
segment follows the load (40 % busy, 3.28 MB/s device-to-host while requests run), `run`'s sidecar
exporting over real OTLP/gRPC to a real receiver, and the per-second table built only from what
arrived. On the GPU the same script reads llama-server's real census (docs/measurements.md)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_table_from_otlp_follows_load_and_idle(tmp_path, native):
    out = tmp_path / "lmt"
    p = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "llama_metrics_table.py"),
                        "--server", "standin-census", "--no-proxy", "--load-s", "4", "--idle-s", "3",
                        "--max-s", "100", "--out", str(out)], capture_output=True, text=True, timeout=110)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    table = json.loads((out / "table.json").read_text())
    assert (out / "table.md").read_text().count("\n| ") > 8
    rows = table["rows"]
    busy = {ph: [r["census_busy"] for r in rows if r["phase"] == ph and r.get("census_busy") is not None]
            for ph in ("load 1", "idle 1", "load 2")}
    d2h = {ph: [r["d2h_Bps"] / 1e6 for r in rows if r["phase"] == ph and r.get("d2h_Bps") is not None]
           for ph in ("load 1", "idle 1", "load 2")}
    # under load the synthetic census is 40 % busy and copies 3.28 MB/s; idle, nothing
    assert any(0.3 < b < 0.5 for b in busy["load 1"] + busy["load 2"]), busy
    assert any(2.5 < x < 4.0 for x in d2h["load 1"] + d2h["load 2"]), d2h
    # idle: back to nothing (the first idle row may still carry the last second of load)
    assert busy["idle 1"][1:] and max(busy["idle 1"][1:]) < 0.05 and max(d2h["idle 1"][1:]) < 0.1, (busy, d2h)
    assert "equal" in p.stdout
