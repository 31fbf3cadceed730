"""The "busy is not full" table from `otel-gpu-census run --exporter console` output (not a pytest test).

    otel-gpu-census run --exporter console --metrics-interval 1 -- python3 tests/gpu/busy_loops.py matmul 12 \\
        > matmul.metrics
    python bench/perf/perf_busy_gap.py matmul.metrics [--json table.json]

One row per export and GPU: seconds since the first export, nvidia-smi utilisation
(hw.gpu.utilization), the census busy ratio, GPM SM utilisation and SM occupancy, and the census's
host-to-device and device-to-host copy rates (from gpu_census.host.io, between consecutive exports). A blank
cell means the metric was not exported (no NVML, no GPM, or the first export for a rate).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List, Tuple

GAUGES = {
    "hw.gpu.utilization": "nvidia-smi util",
    "gpu_census.busy.ratio": "census busy",
    "gpu_census.sm.utilization": "SM util",
    "gpu_census.sm.occupancy": "SM occupancy",
}


def exports(text: str) -> List[dict]:
    """The console exporter writes one indented JSON document per export, back to back."""
    dec, out, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i] != "{":
            i += 1                       # skip anything else on stdout (the workload's own prints)
        if i >= len(text):
            return out
        try:
            doc, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            i += 1
            continue
        if isinstance(doc, dict) and "resource_metrics" in doc:
            out.append(doc)


def rows(docs: List[dict]) -> List[dict]:
    """One dict per (export, GPU), values as fractions and bytes/s."""
    table: List[dict] = []
    prev_io: Dict[Tuple[str, str], Tuple[int, int]] = {}     # (hw.id, direction) -> (time ns, bytes)
    t0 = None
    for doc in docs:
        per_gpu: Dict[str, dict] = {}
        t_doc = None
        for rm in doc["resource_metrics"]:
            for sm in rm["scope_metrics"]:
                for m in sm["metrics"]:
                    for dp in m["data"]["data_points"]:
                        hw = dp["attributes"].get("hw.id")
                        if hw is None:
                            continue
                        t = dp["time_unix_nano"]
                        t_doc = t if t_doc is None else max(t_doc, t)
                        row = per_gpu.setdefault(hw, {"hw.id": hw})
                        if m["name"] in GAUGES:
                            row[m["name"]] = dp["value"]
                        elif m["name"] == "gpu_census.host.io":
                            key = (hw, dp["attributes"]["network.io.direction"])
                            if key in prev_io and t > prev_io[key][0]:
                                pt, pv = prev_io[key]
                                name = "htod B/s" if key[1] == "receive" else "dtoh B/s"
                                row[name] = (dp["value"] - pv) / ((t - pt) / 1e9)
                            prev_io[key] = (t, dp["value"])
        if t_doc is None:
            continue
        t0 = t_doc if t0 is None else t0
        for hw, row in sorted(per_gpu.items()):
            row["t"] = (t_doc - t0) / 1e9
            table.append(row)
    return table


def markdown(table: List[dict]) -> str:
    cols = ["t (s)", "GPU"] + list(GAUGES.values()) + ["H2D MB/s", "D2H MB/s"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]

    def pct(v):
        return "" if v is None else f"{100 * v:.1f}%"

    def mbs(v):
        return "" if v is None else f"{v / 1e6:.1f}"
    for r in table:
        cells = [f"{r['t']:.1f}", r["hw.id"][:12]] + [pct(r.get(k)) for k in GAUGES] + \
                [mbs(r.get("htod B/s")), mbs(r.get("dtoh B/s"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("console_output")
    ap.add_argument("--json", help="also write the rows as JSON here")
    a = ap.parse_args()
    try:
        text = open(a.console_output, encoding="utf-8", errors="replace").read()
    except OSError as e:
        print(f"cannot read {a.console_output}: {e.strerror}", file=sys.stderr)
        return 1
    table = rows(exports(text))
    if not table:
        print(f"{a.console_output}: no metric exports with a hw.id found "
              "(was it written by `otel-gpu-census run --exporter console`?)", file=sys.stderr)
        return 1
    print(markdown(table))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(table, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
