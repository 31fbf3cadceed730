"""A llama-server command line in front of tests/llama_standin.py, for CPU tests of the bench scripts.

Takes llama-server's arguments (only --host and --port matter) and serves the stand-in's /health and
streaming /completion: FAKE_TOKENS tokens (default 64) FAKE_TOKEN_DELAY s apart (default 0.002).

FAKE_CENSUS=1 (with the injector's OTEL_GPU_CENSUS_DIR, CUDA_INJECTION64_PATH and
OTEL_GPU_CENSUS_KERNELS=ON_MS/PERIOD_MS set) writes a stand-in census segment (fake_census.py):
every /completion request counts FAKE_KERNELS kernels (default 40) when it starts and again when it
ends, if that moment is in a traced phase, and FAKE_DTOH_BYTES (default 65536) device-to-host bytes.
FAKE_TRACED_EXTRA_S delays requests that start in a traced phase (tracing made costly, so tests can
tell the sides apart); FAKE_SLOW=LO-HI:S delays requests whose body "seed" is in [LO, HI] by S s.
"""
import argparse
import asyncio
import atexit
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tests"))
sys.path.insert(0, str(HERE.parents[1] / "src"))
sys.path.insert(0, str(HERE))
from aiohttp import web  # noqa: E402
from llama_standin import Standin, _Forgetful  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--host", default="127.0.0.1")
ap.add_argument("--port", type=int, default=8080)
a, _ = ap.parse_known_args()
# what the census would have been told, for tests that read the server log
print("fake-llama-server: OTEL_GPU_CENSUS_KERNELS=" + os.environ.get("OTEL_GPU_CENSUS_KERNELS", "(unset)"),
      "CUDA_INJECTION64_PATH=" + ("set" if os.environ.get("CUDA_INJECTION64_PATH") else "(unset)"), flush=True)

census = None
if os.environ.get("FAKE_CENSUS") == "1" and os.environ.get("CUDA_INJECTION64_PATH"):
    from fake_census import StandinCensus
    census = StandinCensus(os.environ["OTEL_GPU_CENSUS_DIR"], os.environ["CUDA_INJECTION64_PATH"],
                           os.environ.get("OTEL_GPU_CENSUS_KERNELS", ""))
    atexit.register(census.close)
KERNELS = int(os.environ.get("FAKE_KERNELS", "40"))
DTOH_BYTES = int(os.environ.get("FAKE_DTOH_BYTES", "65536"))
TRACED_EXTRA_S = float(os.environ.get("FAKE_TRACED_EXTRA_S", "0"))
slow = os.environ.get("FAKE_SLOW", "")
SLOW = (tuple(map(int, slow.split(":")[0].split("-"))), float(slow.split(":")[1])) if slow else None


class FakeServer(Standin):
    async def completion(self, request):
        try:
            seed = (await request.json()).get("seed")
        except ValueError:
            seed = None
        if SLOW and isinstance(seed, int) and SLOW[0][0] <= seed <= SLOW[0][1]:
            await asyncio.sleep(SLOW[1])
        if census is not None:
            if TRACED_EXTRA_S and census.traced():
                await asyncio.sleep(TRACED_EXTRA_S)
            census.add(kernels=KERNELS)
        resp = await super().completion(request)
        if census is not None:
            census.add(kernels=KERNELS, dtoh_bytes=DTOH_BYTES)
        return resp


st = FakeServer(tokens=int(os.environ.get("FAKE_TOKENS", "64")),
                token_delay=float(os.environ.get("FAKE_TOKEN_DELAY", "0.002")))
st.seen = _Forgetful()
web.run_app(st.app, host=a.host, port=a.port, print=None)
