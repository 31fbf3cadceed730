"""A llama-server command line in front of tests/support/llama_standin.py, for CPU tests of the bench scripts.

Takes llama-server's arguments (only --host and --port matter) and serves the stand-in's /health and
streaming /completion: FAKE_TOKENS tokens (default 64) FAKE_TOKEN_DELAY s apart (default 0.002).

FAKE_SLOW=LO-HI:S delays requests whose body "seed" is in [LO, HI] by S s.
FAKE_TOKEN_JITTER=J (0 <= J < 1) varies the token delay per request: FAKE_TOKEN_DELAY x (1 + J u),
u uniform in [-1, 1] drawn from the request's "seed" (deterministic: the same seeds, the same delays),
so loads differ in their requests' lengths as they do on a real server, not only in scheduling noise.
With it set (0 too), token k goes out at k delays after the first on the event loop's clock (a fixed
schedule: the loop's millisecond timer rounding does not add up over a request, as it does with a
sleep of one delay between tokens, which turned 9-11 ms delays into steps of whole milliseconds).
"""
import argparse
import asyncio
import os
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tests" / "support"))
sys.path.insert(0, str(HERE.parents[1] / "src"))
sys.path.insert(0, str(HERE))
from aiohttp import web  # noqa: E402
from llama_standin import Standin, _Forgetful, dump  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--host", default="127.0.0.1")
ap.add_argument("--port", type=int, default=8080)
a, _ = ap.parse_known_args()
# what the census would have been told, for tests that read the server log
print("fake-llama-server: OTEL_GPU_CENSUS_EVENT_EVERY=" + os.environ.get("OTEL_GPU_CENSUS_EVENT_EVERY", "(unset)"),
      "CUDA_INJECTION64_PATH=" + ("set" if os.environ.get("CUDA_INJECTION64_PATH") else "(unset)"), flush=True)

slow = os.environ.get("FAKE_SLOW", "")
SLOW = (tuple(map(int, slow.split(":")[0].split("-"))), float(slow.split(":")[1])) if slow else None
TOKEN_DELAY = float(os.environ.get("FAKE_TOKEN_DELAY", "0.002"))
PACED = "FAKE_TOKEN_JITTER" in os.environ
JITTER = float(os.environ.get("FAKE_TOKEN_JITTER") or "0")
if not 0 <= JITTER < 1:
    sys.exit(f"fake-llama-server: FAKE_TOKEN_JITTER={JITTER}: want 0 <= J < 1")


class FakeServer(Standin):
    async def completion(self, request):
        try:
            seed = (await request.json()).get("seed")
        except ValueError:
            seed = None
        if SLOW and isinstance(seed, int) and SLOW[0][0] <= seed <= SLOW[0][1]:
            await asyncio.sleep(SLOW[1])
        if PACED and isinstance(seed, int):
            return await self.paced(request, seed)
        return await super().completion(request)

    async def paced(self, request, seed: int):
        """/completion streamed with this request's own token delay (FAKE_TOKEN_JITTER) on a fixed
        schedule: the stand-in's events, final event and timings."""
        body = await request.json()
        n, o = self._n_tokens(body), self.opts
        delay = TOKEN_DELAY * (1 + JITTER * random.Random(seed).uniform(-1, 1))
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for i in range(n):
            if i:
                await asyncio.sleep(max(0.0, t0 + i * delay - loop.time()))
            await resp.write(b"data: " + dump({"index": 0, "content": "tok", "tokens": [], "stop": False,
                                               "id_slot": o.id_slot, "tokens_predicted": i + 1,
                                               "tokens_evaluated": o.prompt_tokens}) + b"\n\n")
        await resp.write(b"data: " + dump({"index": 0, "content": "", "tokens": [], "id_slot": o.id_slot,
                                           "stop": True, "model": o.model, "tokens_predicted": n,
                                           "tokens_evaluated": o.prompt_tokens, "stop_type": "limit",
                                           "timings": self._timings(n, 12.5, 1000 * delay * n)}) + b"\n\n")
        await resp.write_eof()
        return resp


st = FakeServer(tokens=int(os.environ.get("FAKE_TOKENS", "64")),
                token_delay=TOKEN_DELAY)
st.seen = _Forgetful()
web.run_app(st.app, host=a.host, port=a.port, print=None)
