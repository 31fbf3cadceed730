#!/usr/bin/env python3
"""Random-weight Llama models for vLLM in more sizes than the shared writer has.

The writer (../shared/vllm-offline/vllm_model.py, carried as .vllm/part3) makes a launch-bound 160M model, on which a
step costs about the same whatever its requests compute. `1b` is large enough, with contexts of 8k tokens and more,
for attention's growth with context to show in a step's time (the regime the FLOPs and alone splits are for).

    python3 bench/device/vllm_model_sizes.py OUT_DIR --size 1b [--writer .vllm/part3/vllm_model.py]
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WRITER = ROOT / ".vllm" / "part3" / "vllm_model.py"
# Llama shapes; the writer's own sizes (small, tiny) stay as they are
SIZES = {
    # ~1.6B parameters, ~3.2 GB in bf16: 24 layers, grouped-query attention, contexts to 16k
    "1b": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=4,
               intermediate_size=8192, vocab_size=32000, max_position_embeddings=16384),
}


def load_writer(path: Path):
    if not path.is_file():
        raise SystemExit(f"vllm_model_sizes: no model writer at {path} (carry .vllm/part3)")
    spec = importlib.util.spec_from_file_location("vllm_model", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make(out_dir: str, size: str, writer: Path = WRITER) -> None:
    mod = load_writer(writer)
    mod.SIZES.update(SIZES)
    if size not in mod.SIZES:
        raise SystemExit(f"vllm_model_sizes: no size {size!r} (have {', '.join(sorted(mod.SIZES))})")
    mod.make(out_dir, size)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--size", default="1b")
    ap.add_argument("--writer", type=Path, default=WRITER)
    a = ap.parse_args(argv)
    make(a.out_dir, a.size, a.writer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
