"""Census modes side by side on one running server, through the census's control file.

A server started under `otel-gpu-census run` keeps one segment per CUDA process; beside each, the
injector reads `<segment>.control` at every flush (native/src/injector.c, control_poll). Writing
`census=off`, `census=on graphs=launch` or `census=on graphs=node` there switches the running census,
so throughput of the modes can be compared on one server, in alternating phases, without the
restart-to-restart spread of separate servers (±15 % seen with vLLM on the H200).

    phases = Phases(census_dir)
    phases.set("launch")          # every segment's control file; waits until each segment says so
    before = phases.totals(); ...load...; delta = phases.totals() - before
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Dict

MODES = {
    "off": "census=off\n",                       # nothing traced: what the server pays without records
    "launch": "census=on graphs=launch\n",       # the default: graphs per launch, contents learned
    "node": "census=on graphs=node\n",           # every graph node traced (the exact per-node mode)
}


class Phases:
    def __init__(self, census_dir):
        self.dir = Path(census_dir)

    def segments(self):
        return sorted(self.dir.glob("*.seg"))

    def set(self, mode: str, timeout: float = 10.0) -> bool:
        """Write the mode to every segment's control file and wait until each segment shows it."""
        from otel_gpu_census.census.reader import read_segment
        want = MODES[mode]
        for seg in self.segments():
            seg.with_suffix(".control").write_text(want)
        paused = mode == "off"
        graph_mode = {"launch": 1, "node": 0}.get(mode)
        t0 = time.time()
        while time.time() - t0 < timeout:
            ok = True
            for seg in self.segments():
                c = read_segment(str(seg), detail=False)
                if c.graphs.paused != paused or (graph_mode is not None and c.graphs.mode != graph_mode):
                    ok = False
            if ok:
                return True
            time.sleep(0.1)
        return False

    def totals(self) -> Dict[str, int]:
        """Summed figures of every segment's devices: kernels, kernel time, copies per direction and
        host memory kind (count and bytes), memsets, graph launches."""
        from otel_gpu_census.census.reader import read_segment
        out: Dict[str, int] = {}

        def add(k, v):
            out[k] = out.get(k, 0) + int(v)
        for seg in self.segments():
            c = read_segment(str(seg), detail=False)
            for d in c.devices.values():
                add("kernel_count", d.kernel_count)
                add("kernel_ns", d.kernel_ns)
                add("busy_ns", d.busy_ns)
                add("graph_launches", d.graph_launches)
                add("graph_kernel_count", d.graph_kernel_count)
                add("memset_count", d.memset.count)
                add("memset_bytes", d.memset.bytes)
                for (direction, mem), s in d.copies.cells.items():
                    add(f"copy.{direction}.{mem}.count", s.count)
                    add(f"copy.{direction}.{mem}.bytes", s.bytes)
            add("graph_unknown", c.graphs.unknown)
            add("graph_inexact", c.graphs.inexact)
        return out


def delta(after: Dict[str, int], before: Dict[str, int]) -> Dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}
