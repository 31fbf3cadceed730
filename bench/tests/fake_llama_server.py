"""A llama-server command line in front of tests/llama_standin.py, for CPU tests of the bench scripts.

Takes llama-server's arguments (only --host and --port matter) and serves the stand-in's /health and
streaming /completion: FAKE_TOKENS tokens (default 64) FAKE_TOKEN_DELAY s apart (default 0.002).
"""
import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from aiohttp import web  # noqa: E402
from llama_standin import Standin, _Forgetful  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--host", default="127.0.0.1")
ap.add_argument("--port", type=int, default=8080)
a, _ = ap.parse_known_args()
# what the census would have been told, for tests that read the server log
print("fake-llama-server: OTEL_GPU_CENSUS_KERNELS=" + os.environ.get("OTEL_GPU_CENSUS_KERNELS", "(unset)"),
      "CUDA_INJECTION64_PATH=" + ("set" if os.environ.get("CUDA_INJECTION64_PATH") else "(unset)"), flush=True)
st = Standin(tokens=int(os.environ.get("FAKE_TOKENS", "64")),
             token_delay=float(os.environ.get("FAKE_TOKEN_DELAY", "0.002")))
st.seen = _Forgetful()
web.run_app(st.app, host=a.host, port=a.port, print=None)
