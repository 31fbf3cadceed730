"""The environment a test gives `otel-gpu-census run`: the checkout's sources, the test build of the
library, a private runtime folder, and none of the caller's OTEL_* or injection settings."""
from __future__ import annotations

import os
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def run_env(tmp_path, native, **extra) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "CUDA_INJECTION"))}
    e.update(PYTHONPATH=str(SRC), OTEL_GPU_CENSUS_LIB=native[2], XDG_RUNTIME_DIR=str(tmp_path / "xdg"))
    (tmp_path / "xdg").mkdir(mode=0o700, exist_ok=True)
    e.update(extra)
    return e
