"""What the vLLM integration costs the engine's thread a decode step, and its shipper thread a step's records, on
the CPU alone (no GPU, no vLLM: the hooks take the objects vLLM hands them, built here).

A launch-bound engine's thread is its bottleneck, so every µs the hooks add to a step is throughput lost. Per step:
begin_execute and end_step around execute_model, begin_sample and end_step around sample_tokens, step_output and
outputs after update_from_output, with N requests decoding one token each; the records go to a settling process
(its recorder, as a real engine's do), whose shipper then pickles them (the GIL held, beside the engine's thread).

    python3 bench/perf/engine_hook_cost.py [--requests 64,256] [--steps 5000] [--out F.json]

Prints one JSON line per N: hooks_us_per_step (the engine's thread, the step's own dict building taken off),
pickle_us_per_step and bytes_per_step (the shipper's).
"""
from __future__ import annotations

import argparse
import json
import pickle
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))


class _Request:                      # weakly referenced by the engine, as vLLM's Request is
    def __init__(self, rid: str):
        self.request_id, self.num_prompt_tokens, self.trace_headers = rid, 64, None
        self.arrival_time = time.time()


def measure(n: int, steps: int) -> dict:
    from otel_gpu_census.integrations.vllm.engine import EngineTelemetry
    eng = EngineTelemetry(settle_in="process")
    eng.remote.ensure = lambda: True     # no child: the engine's side alone
    ids = [f"cmpl-{i:032x}-0" for i in range(n)]
    reqs = [_Request(r) for r in ids]
    for r in reqs:
        eng.start_request(r.request_id, start_ns=time.time_ns(), operation="text_completion", model="m", headers={},
                          attributes={"gen_ai.request.id": r.request_id}, prompt_tokens=64, obj=r)
    eng.first_due.clear()
    outs = {0: types.SimpleNamespace(outputs=[types.SimpleNamespace(request_id=r, new_token_ids=[5]) for r in ids])}

    def step():
        so = types.SimpleNamespace(num_scheduled_tokens={r: 1 for r in ids})
        sid = eng.begin_execute(so)
        eng.end_step(sid)
        sid = eng.begin_sample()
        if sid:
            eng.end_step(sid)
        eng.step_output(so)
        eng.outputs(outs)

    for _ in range(200):
        step()
    eng.remote._events.clear()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    hooks = (time.perf_counter() - t) / steps
    t = time.perf_counter()
    for _ in range(steps):
        types.SimpleNamespace(num_scheduled_tokens={r: 1 for r in ids})
    base = (time.perf_counter() - t) / steps
    events = list(eng.remote._events)
    t = time.perf_counter()
    data = pickle.dumps(events, protocol=pickle.HIGHEST_PROTOCOL)
    pk = time.perf_counter() - t
    return {"requests": n, "steps": steps, "hooks_us_per_step": round(1e6 * (hooks - base), 2),
            "pickle_us_per_step": round(1e6 * pk / steps, 2), "bytes_per_step": round(len(data) / steps),
            "records_per_step": round(len(events) / steps, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", default="64,256")
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    rows = [measure(int(n), a.steps) for n in a.requests.split(",")]
    for r in rows:
        print(json.dumps(r))
    if a.out:
        Path(a.out).write_text(json.dumps({"python": sys.version.split()[0], "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
