"""CPU cost of the vLLM integration's engine side, per step and per request (not a pytest test: run it).

    .venv/bin/python bench/perf/perf_engine_hooks.py [--inflight 64] [--tokens 256] [--requests 2000]
                     [--export otlp-encode|memory|none] [--settle thread|process] [--profile FILE]

Why: on the H200 (docs/measurements.md §12) vLLM under the census with the census paused ("off") served
0.85 of plain vLLM's tokens a second (random 160M Llama, ~15,000 tok/s, ~60 requests/s): what the
integration's own Python costs the engine process at that rate, hooks on the engine's thread and
settling on a thread beside it (which takes the GIL from the engine's loop).

What runs: vLLM's EngineTelemetry with the engine's objects stood in for (tests/support
engine_standins): --inflight requests decode --tokens tokens each, one step per token (every step:
begin_execute, end_step, begin_sample, end_step, outputs; a finished request is freed and a new one
added), the census stand-in completing every step at once; settle() every 25 steps (the settler's
period at ~250 steps/s). Spans go through a BatchSpanProcessor into `--export`: otlp-encode (the
OTLP protobuf encoding vLLM's engine does before sending, then discarded), memory, or none; request
metrics into a delta reader collected once a second of steps. The request log is written to a temp
folder. Prints µs of CPU per step (the hooks) and per request (settle, span end, export, log line).

--settle process: the default of a real engine since 2026-12-02 (integrations/settle_process.py): the
engine records and a child process settles and exports; the figures are then this (the engine's)
process's CPU alone, its shipper thread included, and the child's CPU is printed beside them.
--settle none: the same loop with hooks that do nothing, so the bench's own CPU (building each step's
stand-in objects) can be taken off the other two.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests" / "support"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--inflight", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--export", choices=("otlp-encode", "memory", "none"), default="otlp-encode")
    ap.add_argument("--settle", choices=("thread", "process", "none"), default="thread",
                    help="where requests are settled: a thread of this process (telemetry as --export) or a child "
                         "process (its telemetry from OTEL_*: nothing exported here)")
    ap.add_argument("--profile", default=None, help="cProfile the run into FILE and print the top functions")
    a = ap.parse_args()

    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    from engine_standins import Census, Clock
    from otel_gpu_census.census import Stat, Step
    from otel_gpu_census.integrations.vllm.engine import EngineTelemetry
    from otel_gpu_census.telemetry.request import RequestTelemetry

    class Encode(SpanExporter):
        def __init__(self):
            self.spans = 0
            if a.export == "otlp-encode":
                from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
                self.encode = lambda spans: encode_spans(spans).SerializeToString()
            else:
                self.encode = (lambda spans: list(spans)) if a.export == "memory" else None

        def export(self, spans):
            self.spans += len(spans)
            if self.encode:
                self.encode(spans)
            return SpanExportResult.SUCCESS

        def shutdown(self):
            pass

    exporter = Encode()
    tp = TracerProvider()
    tp.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
    reader = InMemoryMetricReader()
    rt = RequestTelemetry(tp, MeterProvider(metric_readers=[reader]), provider_name="vllm",
                          instrumentation_name="otel_gpu_census.vllm")
    census, clock = Census(), Clock()
    tmp = tempfile.mkdtemp(prefix="perf-engine-")
    if a.settle == "none":
        class Nothing:
            def __getattr__(self, name):
                return lambda *args, **kw: 0
        eng = Nothing()
    elif a.settle == "process":  # the child reads no census here (there is no segment): it settles nothing
        os.environ.update(OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none")
        eng = EngineTelemetry(clock=clock, settle_in="process")
    else:
        eng = EngineTelemetry(telemetry=rt, read=census.read, clock=clock, settle_period_s=3600)
    if a.settle != "none":
        eng.log_segment = lambda: os.path.join(tmp, "gpu-census-1-1.seg")

    def request(n):
        rid = f"cmpl-{n:08x}-0-{n:08x}"
        headers = {"traceparent": f"00-{n + 1:032x}-{n + 1:016x}-01"}
        return SimpleNamespace(request_id=rid, arrival_time=clock.t / 1e9, trace_headers=headers,
                               num_prompt_tokens=64, num_output_tokens=0, num_cached_tokens=0,
                               status=SimpleNamespace(name="FINISHED_LENGTH_CAPPED"), get_finished_reason=lambda: "length")
    sched = SimpleNamespace(vllm_config=SimpleNamespace(model_config=SimpleNamespace(served_model_name=["m"])))

    live, started, finished = {}, 0, 0
    t_steps = t_settle = 0.0
    steps = 0
    prof = cProfile.Profile() if a.profile else None
    cpu0 = time.process_time()
    if prof:
        prof.enable()
    while finished < a.requests:
        while len(live) < a.inflight and started < a.requests:
            r = request(started)
            started += 1
            c = time.process_time()
            eng.request_added(sched, r)
            t_steps += time.process_time() - c
            live[r.request_id] = [r, 0]
        tokens = {rid: (64 if n == 0 else 1) for rid, (_, n) in live.items()}
        so = SimpleNamespace(num_scheduled_tokens=tokens)
        outs = {0: SimpleNamespace(outputs=[SimpleNamespace(request_id=rid, new_token_ids=[1],
                                                            prefill_stats=SimpleNamespace(num_cached_tokens=0))
                                            for rid in live])}
        c = time.process_time()
        sid = eng.begin_execute(so)
        eng.end_step(sid)
        s2 = eng.begin_sample()
        eng.end_step(s2)
        eng.outputs(outs)
        t_steps += time.process_time() - c
        clock.t += 4_000_000                      # a 4 ms step
        census.steps[sid] = Step(id=sid, kernel_count=60, kernel_ns=3_000_000,
                                 copies={"htod": Stat(2, 600, 900), "dtoh": Stat(1, 4 * len(tokens), 900)})
        steps += 1
        c = time.process_time()
        for rid in list(live):
            live[rid][1] += 1
            if live[rid][1] >= a.tokens:
                req = live.pop(rid)[0]
                req.num_output_tokens = a.tokens
                eng.request_freed(req)
                finished += 1
        t_steps += time.process_time() - c
        if steps % 25 == 0 and a.settle == "thread":
            census.complete = clock.t
            c = time.process_time()
            eng.settle()
            t_settle += time.process_time() - c
        if steps % 250 == 0:
            reader.get_metrics_data()
    census.complete = clock.t + 10**9
    c = time.process_time()
    if a.settle == "thread":
        eng.settle()
        tp.force_flush()
    elif a.settle == "process":
        child_rss_kib = _rss_kib(eng.remote.proc.pid)
        eng.shutdown()
    t_settle += time.process_time() - c
    if prof:
        prof.disable()
    cpu = time.process_time() - cpu0
    res = {"inflight": a.inflight, "tokens": a.tokens, "requests": finished, "steps": steps, "settle": a.settle,
           "export": a.export if a.settle == "thread" else "(the child's)",
           "spans_exported": exporter.spans, "python": sys.version.split()[0],
           "us_per_step_hooks": round(t_steps / steps * 1e6, 1),
           "us_per_request_settle": round(t_settle / finished * 1e6, 1),
           "us_per_request_all": round(cpu / finished * 1e6, 1),
           "cpu_s": round(cpu, 3)}
    if a.settle == "process":
        res["child_cpu_s"] = round(sum(os.times()[2:4]), 3)     # the reaped child's user + system
        res["child_rss_mib"] = round(child_rss_kib / 1024, 1)
    # what that is at the H200 load of §12: ~15,000 tok/s = 15,000/inflight steps a second, ~15,000/tokens
    # requests a second
    tok_s = 15000
    res["pct_of_one_core_at_15k_tok_s"] = round(100 * (tok_s / a.inflight * t_steps / steps
                                                       + tok_s / a.tokens * (cpu - t_steps) / finished), 2)
    print(json.dumps(res))
    if prof:
        prof.dump_stats(a.profile)
        pstats.Stats(a.profile).sort_stats("cumulative").print_stats(25)
    return 0


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


if __name__ == "__main__":
    sys.exit(main())
