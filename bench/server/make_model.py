#!/usr/bin/env python3
"""Write a random-weight llama GGUF fast, with the standard library only.

  python bench/server/make_model.py OUT.gguf --vocab ggml-vocab-llama-bpe.gguf [--preset 8b|tiny]
         [--n-embd N --n-layer N --n-head N --n-head-kv N --n-ff N --ctx N]

The tokenizer keys (tokenizer.*) are copied byte for byte from a vocab-only GGUF (llama.cpp ships
them in models/); the vocabulary size follows from it. Weights are F16 (norms F32 ones), drawn once
as a 64 MiB random block whose exponents are pinned to 2^-11..2^-7 (|w| < 0.016: no NaN or
overflow through 32 layers) and reused at rotating offsets, so 16 GB is written at disk speed.
No numpy, no gguf package: the bare GPU machine has neither.
"""
from __future__ import annotations

import argparse
import os
import struct
import sys
import time
from pathlib import Path
from typing import BinaryIO, List, Tuple

ALIGN = 32
F32, F16 = 0, 1
T_U32, T_F32, T_STRING = 4, 6, 8
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

PRESETS = {
    # Llama-3-8B shape
    "8b": dict(n_embd=4096, n_layer=32, n_head=32, n_head_kv=8, n_ff=14336, ctx=131072),
    # tiny: starts in a second; for reliability cycles
    "tiny": dict(n_embd=256, n_layer=2, n_head=4, n_head_kv=2, n_ff=512, ctx=131072),
}


class GGUFError(Exception):
    pass


def _read_value(buf: bytes, pos: int, vtype: int) -> int:
    """Position after one value of type vtype starting at pos."""
    if vtype in _SCALAR:
        return pos + _SCALAR[vtype]
    if vtype == T_STRING:
        (n,) = struct.unpack_from("<Q", buf, pos)
        return pos + 8 + n
    if vtype == 9:  # array: item type, count, items
        itype, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if itype in _SCALAR:
            return pos + count * _SCALAR[itype]
        for _ in range(count):
            pos = _read_value(buf, pos, itype)
        return pos
    raise GGUFError(f"unknown GGUF value type {vtype}")


def tokenizer_kvs(vocab_path: Path) -> Tuple[List[bytes], int]:
    """Raw bytes of every tokenizer.* key/value of a GGUF, and the vocabulary size."""
    buf = vocab_path.read_bytes()
    if buf[:4] != b"GGUF":
        raise GGUFError(f"{vocab_path} is not a GGUF file")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version < 2:
        raise GGUFError(f"{vocab_path}: GGUF version {version} is too old")
    pos, out, n_vocab = 24, [], 0
    for _ in range(n_kv):
        start = pos
        (klen,) = struct.unpack_from("<Q", buf, pos)
        key = buf[pos + 8:pos + 8 + klen].decode()
        pos += 8 + klen
        (vtype,) = struct.unpack_from("<I", buf, pos)
        if key == "tokenizer.ggml.tokens":
            n_vocab = struct.unpack_from("<IQ", buf, pos + 4)[1]
        pos = _read_value(buf, pos + 4, vtype)
        if key.startswith("tokenizer."):
            out.append(buf[start:pos])
    if not n_vocab:
        raise GGUFError(f"{vocab_path} has no tokenizer.ggml.tokens")
    return out, n_vocab


def _s(x: str) -> bytes:
    b = x.encode()
    return struct.pack("<Q", len(b)) + b


def kv_u32(k: str, v: int) -> bytes:
    return _s(k) + struct.pack("<II", T_U32, v)


def kv_f32(k: str, v: float) -> bytes:
    return _s(k) + struct.pack("<If", T_F32, v)


def kv_str(k: str, v: str) -> bytes:
    return _s(k) + struct.pack("<I", T_STRING) + _s(v)


def tensors(c: dict, n_vocab: int) -> List[Tuple[str, Tuple[int, ...], int]]:
    """(name, ggml ne dims, type) of a llama model; ne0 is the row length."""
    e, hd = c["n_embd"], c["n_embd"] // c["n_head"]
    t = [("token_embd.weight", (e, n_vocab), F16), ("output_norm.weight", (e,), F32),
         ("output.weight", (e, n_vocab), F16)]
    for i in range(c["n_layer"]):
        b = f"blk.{i}."
        t += [(b + "attn_norm.weight", (e,), F32),
              (b + "attn_q.weight", (e, c["n_head"] * hd), F16),
              (b + "attn_k.weight", (e, c["n_head_kv"] * hd), F16),
              (b + "attn_v.weight", (e, c["n_head_kv"] * hd), F16),
              (b + "attn_output.weight", (c["n_head"] * hd, e), F16),
              (b + "ffn_norm.weight", (e,), F32),
              (b + "ffn_gate.weight", (e, c["n_ff"]), F16),
              (b + "ffn_up.weight", (e, c["n_ff"]), F16),
              (b + "ffn_down.weight", (c["n_ff"], e), F16)]
    return t


def nbytes(dims: Tuple[int, ...], ttype: int) -> int:
    n = 1
    for d in dims:
        n *= d
    return n * (4 if ttype == F32 else 2)


def random_f16_block(size: int, seed: int) -> bytes:
    """size bytes of finite small F16 values: random sign and mantissa, exponent 4..7.

    Big-integer masks do the bit work at C speed (a few hundred ms for 64 MiB)."""
    rnd = os.urandom(size) if seed < 0 else _seeded_bytes(size, seed)
    x = int.from_bytes(rnd, "little")
    words = size // 2
    keep = int.from_bytes(struct.pack("<H", 0x8000 | 0x0C00 | 0x03FF) * words, "little")
    force = int.from_bytes(struct.pack("<H", 0x1000) * words, "little")  # exponent 0b001xx
    return ((x & keep) | force).to_bytes(size, "little")


def _seeded_bytes(size: int, seed: int) -> bytes:
    import random
    return random.Random(seed).randbytes(size)


def write_model(out: Path, vocab: Path, c: dict, seed: int = 1) -> dict:
    t0 = time.monotonic()
    tok_kvs, n_vocab = tokenizer_kvs(vocab)
    hd = c["n_embd"] // c["n_head"]
    kvs = [kv_str("general.architecture", "llama"), kv_str("general.name", f"random-{c['preset']}"),
           kv_u32("general.file_type", 1), kv_u32("general.alignment", ALIGN),
           kv_u32("llama.block_count", c["n_layer"]), kv_u32("llama.context_length", c["ctx"]),
           kv_u32("llama.embedding_length", c["n_embd"]), kv_u32("llama.feed_forward_length", c["n_ff"]),
           kv_u32("llama.attention.head_count", c["n_head"]),
           kv_u32("llama.attention.head_count_kv", c["n_head_kv"]),
           kv_f32("llama.rope.freq_base", 500000.0),
           kv_f32("llama.attention.layer_norm_rms_epsilon", 1e-5),
           kv_u32("llama.vocab_size", n_vocab), kv_u32("llama.rope.dimension_count", hd)] + tok_kvs
    ts = tensors(c, n_vocab)
    infos, offset = [], 0
    for name, dims, ttype in ts:
        infos.append(_s(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
                     + struct.pack("<IQ", ttype, offset))
        offset += -(-nbytes(dims, ttype) // ALIGN) * ALIGN
    total = offset
    block = random_f16_block(64 << 20, seed)
    ones = struct.pack("<f", 1.0) * 65536
    tmp = out.with_suffix(out.suffix + ".part")
    with open(tmp, "wb") as f:
        head = b"GGUF" + struct.pack("<IQQ", 3, len(ts), len(kvs)) + b"".join(kvs) + b"".join(infos)
        f.write(head + b"\0" * (-len(head) % ALIGN))
        rot = 0
        for name, dims, ttype in ts:
            n = nbytes(dims, ttype)
            if ttype == F32:
                _write_repeated(f, ones, n, 0)
            else:
                rot = (rot + 2 * 7919 * 97) % len(block)   # even: stay on F16 boundaries
                _write_repeated(f, block, n, rot)
            f.write(b"\0" * (-n % ALIGN))
    os.replace(tmp, out)
    secs = time.monotonic() - t0
    return {"path": str(out), "bytes": out.stat().st_size, "tensor_bytes": total, "n_vocab": n_vocab,
            "seconds": round(secs, 1), "gb_per_s": round(out.stat().st_size / secs / 1e9, 2), **c}


def _write_repeated(f: BinaryIO, block: bytes, n: int, start: int) -> None:
    mv = memoryview(block)
    pos = start
    while n > 0:
        k = min(n, len(block) - pos)
        f.write(mv[pos:pos + k])
        n -= k
        pos = 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--vocab", type=Path, required=True, help="vocab-only GGUF (llama.cpp models/)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="8b")
    for k in ("n_embd", "n_layer", "n_head", "n_head_kv", "n_ff", "ctx"):
        ap.add_argument("--" + k.replace("_", "-"), type=int)
    ap.add_argument("--seed", type=int, default=1, help="-1: os.urandom")
    ap.add_argument("--force", action="store_true", help="rewrite an existing file")
    a = ap.parse_args()
    c = dict(PRESETS[a.preset], preset=a.preset)
    for k in ("n_embd", "n_layer", "n_head", "n_head_kv", "n_ff", "ctx"):
        if getattr(a, k) is not None:
            c[k] = getattr(a, k)
    if c["n_embd"] % c["n_head"] or c["n_head"] % c["n_head_kv"]:
        print("make_model: n_embd must divide by n_head, n_head by n_head_kv", file=sys.stderr)
        return 2
    if a.out.exists() and not a.force:
        print(f"make_model: {a.out} exists (use --force to rewrite)")
        return 0
    try:
        info = write_model(a.out, a.vocab, c, a.seed)
    except (OSError, GGUFError, struct.error) as e:
        print(f"make_model: {e}", file=sys.stderr)
        return 1
    print(f"make_model: wrote {info['path']}: {info['bytes'] / 1e9:.2f} GB in {info['seconds']} s "
          f"({info['gb_per_s']} GB/s), {c['n_layer']} layers, n_embd {c['n_embd']}, vocab {info['n_vocab']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
