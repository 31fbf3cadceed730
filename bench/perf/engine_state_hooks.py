"""The engine thread's cost of the step hooks with and without the engine state (issue 62), per step.

What vLLM's EngineCore thread runs for one step of `--batch` running requests: execute_model's hook
(EngineTelemetry.begin_execute, then end_step), with the records going to a settling process (recorded, not
sent: the shipper and the child are off, the deque is emptied between rounds). "off": the state reader is
not set (vLLM releases whose scheduler fields differ); "on": vLLM's own Scheduler parts (its running list,
FCFS waiting queues, KV-cache manager) read every step. The injector's tagging is stubbed out (both sides
alike). Needs vLLM (make test-vllm's .venv-vllm):

    PYTHONPATH=src .venv-vllm/bin/python bench/perf/engine_state_hooks.py [--batch 64] [--steps 20000]

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
    args = ap.parse_args()
    os.environ["OTEL_GPU_CENSUS_SETTLE"] = "process"
    import support_vllm
    from test_vllm_engine_state import scheduler
    from vllm.v1.request import RequestStatus

    from otel_gpu_census import injector
    from otel_gpu_census.integrations.vllm.engine import EngineTelemetry

    injector.step_begin = lambda sid: True
    injector.step_end = lambda: None
    s = scheduler(cap=args.batch)
    reqs = [support_vllm.make_request(f"r{i}", 32) for i in range(args.batch)]
    for r in reqs:
        r.status = RequestStatus.RUNNING
        s.requests[r.request_id] = r
        s.running.append(r)
    so = support_vllm.make_scheduler_output({r.request_id: 1 for r in reqs})

    def per_step(state: bool) -> float:
        eng = EngineTelemetry(settle_in="process")
        eng.has_scheduler = True
        eng._ensure_settler = lambda: None          # no child, no shipper: the engine thread's own work only
        if state:
            eng.scheduler_seen(s)
            assert eng._state is not None
        best = float("inf")
        for _ in range(args.rounds):
            t0 = time.perf_counter_ns()
            for _ in range(args.steps):
                eng.end_step(eng.begin_execute(so))
            best = min(best, (time.perf_counter_ns() - t0) / args.steps)
            eng.remote._events.clear()
        return best

    off, on = per_step(False), per_step(True)
    off, on = min(off, per_step(False)), min(on, per_step(True))     # interleaved, against drift
    print(json.dumps({"batch": args.batch, "steps": args.steps, "rounds": args.rounds,
                      "ns_per_step_off": round(off), "ns_per_step_on": round(on), "state_ns_per_step": round(on - off),
                      "python": sys.version.split()[0]}))


if __name__ == "__main__":
    main()
