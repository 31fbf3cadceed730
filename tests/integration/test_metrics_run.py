"""`otel-gpu-census run --exporter otlp` end to end: the CLI starts the sidecar, the command writes
its census segment through the native library (standing in for the injector: there is no GPU here),
and the totals arrive at the OTLP receiver while it runs and, final, after it exits."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from otlp_receiver import OtlpReceiver, latest

ROOT = Path(__file__).resolve().parents[2]

# The command under `run`: a process that maps its own segment in $OTEL_GPU_CENSUS_DIR and tallies
# real CUPTI records into it in two bursts, the second after the sidecar has exported the first.
WORKER = textwrap.dedent("""
    import os, sys, time
    sys.path[:0] = [{tests!r}]
    import cupti_records as cr
    import segments
    ffi, lib, _ = cr.native()
    path = os.path.join(os.environ["OTEL_GPU_CENSUS_DIR"], "gpu-census-%d-x.seg" % os.getpid())
    mm, seg = segments.map_segment(path, b"fake-server")
    tally = lib.gc_tally_create(seg)
    def burst(recs, state):
        lib.gc_segment_begin_update(seg)
        for r in recs:
            lib.gc_tally_record(tally, r)
        lib.gc_tally_publish(tally, 1)
        seg.state = state
        lib.gc_segment_end_update(seg)
    t = 10**12
    burst([cr.kernel(t, t + 1000), cr.memcpy("dtoh", 1000, t + 2000, t + 3000, dst="pageable")], 1)
    sys.stdout.write("first\\n"); sys.stdout.flush()
    sys.stdin.readline()              # the test says when the first burst was exported
    burst([cr.kernel(t + 5000, t + 6000), cr.memcpy("dtoh", 24, t + 7000, t + 8000, dst="pageable")], 2)
""")


def test_run_exports_while_the_command_runs_and_its_final_totals(native, census_dir, tmp_path, monkeypatch):
    for k in list(os.environ):
        if k.startswith("OTEL_"):
            monkeypatch.delenv(k)
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(tests=str(ROOT / "tests" / "support")))
    with OtlpReceiver(http_enabled=False) as rx:
        env = dict(os.environ, OTEL_EXPORTER_OTLP_ENDPOINT=rx.grpc_endpoint, OTEL_SERVICE_NAME="run-e2e",
                   OTEL_GPU_CENSUS_LIB=native[2], PYTHONPATH=str(ROOT / "src"))
        run = subprocess.Popen([sys.executable, "-m", "otel_gpu_census.cli", "run", "--exporter", "otlp",
                                "--metrics-interval", "0.2", "--dir", str(census_dir), "--", sys.executable, str(script)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            assert run.stdout.readline() == "first\n"
            pts = rx.wait_for(lambda p: any(x.name == "gpu_census.host.io" and x.value == 1000 for x in p))
            first = latest(pts, "gpu_census.kernel.count")
            assert first.value == 1 and first.attributes["process.executable.name"] == "fake-server"
            assert latest(pts, "gpu_census.process.counting").value == 1
            run.stdin.write("go\n")
            run.stdin.flush()
            out, err = run.communicate(timeout=60)
        finally:
            if run.poll() is None:
                run.kill()
                run.communicate()
        assert run.returncode == 0, err
        pts = rx.snapshot()
    final = latest(pts, "gpu_census.kernel.count")
    assert final.value == 2 and final.resource["service.name"] == "run-e2e"
    io = latest(pts, "gpu_census.host.io", {"network.io.direction": "transmit"})
    assert io.value == 1024 and io.is_int
    assert latest(pts, "gpu_census.process.counting").value == 0      # exited
