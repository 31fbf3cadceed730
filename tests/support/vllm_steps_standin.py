"""A vLLM stand-in whose "GPU" costs what a cost model says, settled by the real step ledger: for CPU
tests of bench/device/attribution_error.py.

``/v1/completions`` (a token-id prompt, ``max_tokens``, ``ignore_eos``; one JSON answer with ``id``
``cmpl-…`` and ``usage``) queues the request; a step loop serves every request in flight each step
(a prompt in chunks of at most CHUNK tokens, then one token a step), as vLLM's scheduler does. Each
request's true kernel time in a step is ``truth(shape, new, before, sampled)`` ns; the step's census
is their sum plus ``step_fixed_ns`` (what a step costs whatever it serves: a launch-bound model). Steps and requests go through the integration's own StepEngine (its real StepLedger,
the method given, request log lines beside a segment path in the census folder), so the bench reads
what it reads from a real engine.
"""
from __future__ import annotations

import asyncio
import itertools
import threading
import time
from types import SimpleNamespace
from typing import Callable, Dict, Optional

from aiohttp import web

from otel_gpu_census.attribution.cost_model import ModelShape
from otel_gpu_census.attribution.steps import METHODS
from otel_gpu_census.census import Step
from otel_gpu_census.integrations.engine.steps import StepEngine
from engine_standins import Census, in_memory_telemetry
from ports import free_port

CHUNK = 512
# a small model whose attention outweighs its linear layers at a long context
SHAPE = ModelShape(layers=4, hidden=64, q_dim=64, kv_dim=64, intermediate=128, vocab=1000)


def flops_truth(shape: ModelShape, new: int, before: int, sampled: int) -> int:
    return shape.flops(new, before, sampled) // 1000


class StepsStandin:
    def __init__(self, census_dir, method: str, truth: Callable[..., int] = flops_truth, step_s: float = 0.0005,
                 step_fixed_ns: int = 0):
        self.census_dir = census_dir
        census_dir.mkdir(parents=True, exist_ok=True)
        self.census = Census(complete=1 << 62)
        rt, self.spans, _ = in_memory_telemetry("vllm", metrics=False)
        eng = self.engine = StepEngine(telemetry=rt, read=self.census.read, settle_period_s=3600)
        eng.method = METHODS[method]
        eng.ledger = eng._new_ledger(self.census.read)
        eng.set_shape(SHAPE)
        eng.tagging = eng.has_scheduler = True
        seg = str(census_dir / "gpu-census-1-1.seg")
        eng.log_segment = lambda: seg
        self.truth, self.step_s, self.step_fixed_ns = truth, step_s, step_fixed_ns
        self.live: Dict[str, SimpleNamespace] = {}
        self.ids = itertools.count(1)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._thread: Optional[threading.Thread] = None

    # -- the engine ----------------------------------------------------------------------------------
    def step(self) -> None:
        """One step: every request in flight gets its chunk or its token; the census counts their truth."""
        eng = self.engine
        tokens, before, cost = {}, {}, self.step_fixed_ns
        for key, r in self.live.items():
            n = min(CHUNK, r.prompt - r.done) if r.done < r.prompt else 1
            sampled = 1 if r.done + n >= r.prompt else 0
            tokens[key], before[key] = n, r.done
            cost += self.truth(SHAPE, n, r.done, sampled)
        if not tokens:
            return
        sid = eng.next_sid()
        now = time.time_ns()
        eng.ledger.step_opened(sid, tokens, now, before=before)
        self.census.steps[sid] = Step(id=sid, kernel_count=10 * len(tokens), kernel_ns=cost)
        eng.ledger.step_touched(sid, now)
        for key, n in tokens.items():
            r = self.live[key]
            r.done += n
            if r.done >= r.prompt:
                r.out += 1
                if r.out == 1:
                    eng.first_token(key, now)
            if r.out >= r.max_tokens:
                del self.live[key]
                eng.request_done(key, {"gen_ai.usage.input_tokens": r.prompt, "gen_ai.usage.output_tokens": r.out})
                r.future.get_loop().call_soon_threadsafe(r.future.set_result, r.out)
        eng.settle()

    async def _steps(self):
        while True:
            self.step()
            await asyncio.sleep(self.step_s)

    # -- the HTTP side ---------------------------------------------------------------------------------
    async def _completions(self, request):
        body = await request.json()
        rid = f"cmpl-{next(self.ids):06d}"
        key = f"{rid}-0-abcdefgh"            # vLLM's internal id: the response id, the prompt index, 8 chars
        fut = asyncio.get_running_loop().create_future()
        self.engine.start_request(key, start_ns=time.time_ns(), operation="text_completion", model="m", headers={},
                                  attributes={"gen_ai.request.id": f"{rid}-0", "gen_ai.response.id": rid},
                                  prompt_tokens=len(body["prompt"]))
        self.live[key] = SimpleNamespace(prompt=len(body["prompt"]), max_tokens=int(body["max_tokens"]), done=0,
                                         out=0, future=fut)
        n = await fut
        return web.json_response({"id": rid, "usage": {"completion_tokens": n, "prompt_tokens": len(body["prompt"])}})

    def __enter__(self):
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._task = self._loop.create_task(self._steps())
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        async def stop():
            self._task.cancel()
            await self._runner.cleanup()
        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self.engine._final_outputs(1.0)
