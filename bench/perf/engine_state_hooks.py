"""The engine thread's cost of the step hooks with and without the engine state (issue 62), per step.

What vLLM's EngineCore thread runs for one step of `--batch` running requests: execute_model's hook
(EngineTelemetry.begin_execute, then end_step), with the records going to a settling process (recorded, not
sent: the shipper and the child are off, the deque is emptied between rounds). "off": the state reader is
not set (vLLM releases whose scheduler fields differ); "on": vLLM's own Scheduler parts (its running list,
FCFS waiting queues, KV-cache manager) read every step. The injector's tagging is stubbed out (both sides
alike). Needs vLLM (make test-vllm's .venv-vllm); `--engine sglang`: SGLang's run_batch hook
(SchedulerTelemetry.batch_begin with a real decode ScheduleBatch, its paged KV allocator on the CPU), needs
make test-sglang's .venv-sglang:

    PYTHONPATH=src .venv-vllm/bin/python bench/perf/engine_state_hooks.py [--batch 64] [--steps 20000]
    PYTHONPATH=src .venv-sglang/bin/python bench/perf/engine_state_hooks.py --engine sglang

Prints one JSON object: ns per step, best of --rounds, for off and on, and their difference.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "support"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "integration"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--engine", choices=("vllm", "sglang"), default="vllm")
    args = ap.parse_args()
    os.environ["OTEL_GPU_CENSUS_SETTLE"] = "process"
    step, setup = (sglang_step if args.engine == "sglang" else vllm_step)(args.batch)

    def per_step(state: bool) -> float:
        eng = setup(state)
        eng.has_scheduler = True
        eng._ensure_settler = lambda: None          # no child, no shipper: the engine thread's own work only
        best = float("inf")
        for _ in range(args.rounds):
            t0 = time.perf_counter_ns()
            for _ in range(args.steps):
                step(eng)
            best = min(best, (time.perf_counter_ns() - t0) / args.steps)
            eng.remote._events.clear()
        return best

    off, on = per_step(False), per_step(True)
    off, on = min(off, per_step(False)), min(on, per_step(True))     # interleaved, against drift
    print(json.dumps({"engine": args.engine, "batch": args.batch, "steps": args.steps, "rounds": args.rounds,
                      "ns_per_step_off": round(off), "ns_per_step_on": round(on), "state_ns_per_step": round(on - off),
                      "python": sys.version.split()[0]}))


def vllm_step(batch: int):
    import support_vllm
    from test_vllm_engine_state import scheduler
    from vllm.v1.request import RequestStatus

    from otel_gpu_census import injector
    from otel_gpu_census.integrations.vllm.engine import EngineTelemetry

    injector.step_begin = lambda sid: True
    injector.step_end = lambda: None
    s = scheduler(cap=batch)
    reqs = [support_vllm.make_request(f"r{i}", 32) for i in range(batch)]
    for r in reqs:
        r.status = RequestStatus.RUNNING
        s.requests[r.request_id] = r
        s.running.append(r)
    so = support_vllm.make_scheduler_output({r.request_id: 1 for r in reqs})

    def setup(state: bool):
        eng = EngineTelemetry(settle_in="process")
        if state:
            eng.scheduler_seen(s)
            assert eng._state is not None
        return eng
    return (lambda eng: eng.end_step(eng.begin_execute(so))), setup


def sglang_step(batch: int):
    import sglang_cpu
    sglang_cpu.prepare()
    import torch
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from otel_gpu_census import injector
    from otel_gpu_census.integrations.sglang.engine import SchedulerTelemetry

    injector.step_begin = lambda sid: True
    injector.step_end = lambda: None
    s = object.__new__(Scheduler)
    s.waiting_queue, s.max_running_requests, s.max_total_num_tokens = [], batch, 1 << 20
    s.token_to_kv_pool_allocator = PagedTokenToKVPoolAllocator(1 << 20, 1, torch.float16, "cpu", None, False)
    reqs = [type("Req", (), {"rid": f"r{i}"})() for i in range(batch)]
    s.running_batch = ScheduleBatch(reqs=reqs, forward_mode=ForwardMode.DECODE)

    def setup(state: bool):
        eng = SchedulerTelemetry(settle_in="process", reports=True)
        eng._sched = s if not state else None           # off: the scheduler seen, no reader
        return eng
    return (lambda eng: eng.end_step(eng.batch_begin(s.running_batch, s))), setup


if __name__ == "__main__":
    main()
