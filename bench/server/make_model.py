#!/usr/bin/env python3
"""Write a random-weight llama or granitehybrid GGUF fast, with the standard library only.

  python bench/server/make_model.py OUT.gguf --vocab ggml-vocab-llama-bpe.gguf
         [--preset 8b|tiny|hybrid|hybrid-tiny]
         [--n-embd N --n-layer N --n-head N --n-head-kv N --n-ff N --ctx N]
         [--d-state N --n-ssm-head N --attn-every N]            (hybrid presets)

The tokenizer keys (tokenizer.*) are copied byte for byte from a vocab-only GGUF (llama.cpp ships
them in models/); the vocabulary size follows from it. Weights are F16 (norms F32 ones), drawn once
as a random block (up to 64 MiB) whose exponents are pinned to 2^-11..2^-7 (|w| < 0.016: no NaN or
overflow through 40 layers) and reused at rotating offsets, so 16 GB is written at disk speed.
No numpy, no gguf package: the bare GPU machine has neither.

The hybrid presets are llama.cpp's `granitehybrid` (Granite 4.0-H): Mamba2 layers with attention
every `attn_every` layers; a layer is recurrent where attention.head_count_kv is 0. Their per-sequence
recurrent state (F32, fixed size, saved whole in every prompt-cache entry and context checkpoint) is
printed after writing; see recurrent_state_bytes().
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
T_U32, T_F32, T_STRING, T_ARRAY = 4, 6, 8, 9
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

PRESETS = {
    # Llama-3-8B shape
    "8b": dict(n_embd=4096, n_layer=32, n_head=32, n_head_kv=8, n_ff=14336, ctx=131072),
    # tiny: starts in a second; for reliability cycles
    "tiny": dict(n_embd=256, n_layer=2, n_head=4, n_head_kv=2, n_ff=512, ctx=131072),
    # granitehybrid, 40 layers (36 Mamba2, 4 attention at 5/15/25/35), dense FFN: 7.9B parameters with
    # the 128k llama-bpe vocabulary (15.8 GB F16). The Mamba2 mixer has Granite-4.0-H-Small's shape
    # (d_inner 8192 = 128 heads x 64, d_state 128, 1 group, conv 4): 4.1 MiB of F32 state per
    # recurrent layer per sequence, 147.5 MiB per sequence. CUDA-kernel shape (see cuda_ssm_problem).
    "hybrid": dict(arch="granitehybrid", n_embd=4096, n_layer=40, n_head=32, n_head_kv=8, n_ff=6144,
                   ctx=131072, attn_every=10, d_state=128, n_ssm_head=128, n_group=1, d_conv=4),
    # hybrid-tiny: 4 layers (Mamba2 at 0 and 2, attention at 1 and 3), tied output; 4 MB with the 32k
    # llama-spm vocabulary, 16 MB with llama-bpe. Same CUDA-valid SSM shape rules as "hybrid".
    "hybrid-tiny": dict(arch="granitehybrid", n_embd=64, n_layer=4, n_head=4, n_head_kv=2, n_ff=128,
                        ctx=131072, attn_every=2, d_state=128, n_ssm_head=4, n_group=1, d_conv=4,
                        tied_output=True),
}
HYBRID_KEYS = ("d_state", "n_ssm_head", "attn_every")


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


def kv_u32_array(k: str, vs: List[int]) -> bytes:
    return _s(k) + struct.pack("<IIQ", T_ARRAY, T_U32, len(vs)) + struct.pack(f"<{len(vs)}I", *vs)


# A tensor is (name, ggml ne dims, type, fill): ne0 is the row length; fill None = random F16,
# a float = that constant in every F32 element.
Tensor = Tuple[str, Tuple[int, ...], int, object]


def is_attention_layer(c: dict, i: int) -> bool:
    """Hybrid: attention in the middle of every attn_every layers (Granite 4.0-H: 5, 15, 25, 35)."""
    if c.get("arch", "llama") == "llama":
        return True
    k = c["attn_every"]
    return i % k == k // 2


def _attention(b: str, c: dict) -> List[Tensor]:
    e, hd = c["n_embd"], c["n_embd"] // c["n_head"]
    return [(b + "attn_q.weight", (e, c["n_head"] * hd), F16, None),
            (b + "attn_k.weight", (e, c["n_head_kv"] * hd), F16, None),
            (b + "attn_v.weight", (e, c["n_head_kv"] * hd), F16, None),
            (b + "attn_output.weight", (c["n_head"] * hd, e), F16, None)]


def _ffn(b: str, c: dict) -> List[Tensor]:
    e = c["n_embd"]
    return [(b + "ffn_norm.weight", (e,), F32, 1.0),
            (b + "ffn_gate.weight", (e, c["n_ff"]), F16, None),
            (b + "ffn_up.weight", (e, c["n_ff"]), F16, None),
            (b + "ffn_down.weight", (c["n_ff"], e), F16, None)]


def _mamba2(b: str, c: dict) -> List[Tensor]:
    """llama.cpp's granitehybrid recurrent layer (llama_model_granite_hybrid::load_arch_tensors).

    A = -1 and dt bias 0 keep the scan decaying (exp(dt*A) = 0.5 per token at dt = softplus(0));
    the conv averages its 4 taps. All F32: the CPU and CUDA SSM kernels read them as float."""
    e, di, ds, nh, ng = c["n_embd"], d_inner(c), c["d_state"], c["n_ssm_head"], c["n_group"]
    conv_ch = di + 2 * ng * ds
    return [(b + "ssm_in.weight", (e, 2 * di + 2 * ng * ds + nh), F16, None),
            (b + "ssm_conv1d.weight", (c["d_conv"], conv_ch), F32, 1.0 / c["d_conv"]),
            (b + "ssm_conv1d.bias", (conv_ch,), F32, 0.0),
            (b + "ssm_dt.bias", (nh,), F32, 0.0),
            (b + "ssm_a", (1, nh), F32, -1.0),
            (b + "ssm_d", (1, nh), F32, 1.0),
            (b + "ssm_norm.weight", (di // ng, ng), F32, 1.0),
            (b + "ssm_out.weight", (di, e), F16, None)]


def d_inner(c: dict) -> int:
    return 2 * c["n_embd"]   # llama.cpp asserts expansion factor 2 for granitehybrid


def tensors(c: dict, n_vocab: int) -> List[Tensor]:
    """Every tensor of the model, in file order."""
    e = c["n_embd"]
    t = [("token_embd.weight", (e, n_vocab), F16, None), ("output_norm.weight", (e,), F32, 1.0)]
    if not c.get("tied_output"):
        t.append(("output.weight", (e, n_vocab), F16, None))
    for i in range(c["n_layer"]):
        b = f"blk.{i}."
        t.append((b + "attn_norm.weight", (e,), F32, 1.0))
        t += _attention(b, c) if is_attention_layer(c, i) else _mamba2(b, c)
        t += _ffn(b, c)
    return t


def metadata(c: dict, n_vocab: int) -> List[bytes]:
    """The architecture's keys (tokenizer keys come from the vocab file)."""
    arch = c.get("arch", "llama")
    hd = c["n_embd"] // c["n_head"]
    kvs = [kv_str("general.architecture", arch), kv_str("general.name", f"random-{c['preset']}"),
           kv_u32("general.file_type", 1), kv_u32("general.alignment", ALIGN),
           kv_u32(f"{arch}.block_count", c["n_layer"]), kv_u32(f"{arch}.context_length", c["ctx"]),
           kv_u32(f"{arch}.embedding_length", c["n_embd"]), kv_u32(f"{arch}.feed_forward_length", c["n_ff"]),
           kv_u32(f"{arch}.attention.head_count", c["n_head"])]
    if arch == "llama":
        kvs += [kv_u32("llama.attention.head_count_kv", c["n_head_kv"]),
                kv_f32("llama.rope.freq_base", 500000.0)]
    else:
        # per layer: 0 marks a recurrent layer
        kvs += [kv_u32_array(f"{arch}.attention.head_count_kv",
                             [c["n_head_kv"] if is_attention_layer(c, i) else 0 for i in range(c["n_layer"])]),
                kv_f32(f"{arch}.rope.freq_base", 10000.0),
                kv_u32(f"{arch}.ssm.conv_kernel", c["d_conv"]), kv_u32(f"{arch}.ssm.inner_size", d_inner(c)),
                kv_u32(f"{arch}.ssm.state_size", c["d_state"]),
                kv_u32(f"{arch}.ssm.time_step_rank", c["n_ssm_head"]),
                kv_u32(f"{arch}.ssm.group_count", c["n_group"])]
    return kvs + [kv_f32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
                  kv_u32(f"{arch}.vocab_size", n_vocab), kv_u32(f"{arch}.rope.dimension_count", hd)]


def recurrent_state_bytes(c: dict) -> int:
    """F32 bytes of one sequence's recurrent state, as llama.cpp sizes it (llama_hparams::n_embd_r /
    n_embd_s, llama-memory-recurrent): per Mamba2 layer a conv state of (d_conv-1) x (d_inner +
    2*n_group*d_state) and an SSM state of d_state x d_inner. A context checkpoint of a hybrid model
    is this (plus 12 header bytes per state tensor: < 1 KiB); a prompt-cache entry adds the attention KV."""
    if c.get("arch", "llama") == "llama":
        return 0
    di, ds = d_inner(c), c["d_state"]
    per_layer = (c["d_conv"] - 1) * (di + 2 * c["n_group"] * ds) + ds * di
    n_recr = sum(not is_attention_layer(c, i) for i in range(c["n_layer"]))
    return 4 * per_layer * n_recr


def kv_bytes_per_token(c: dict) -> int:
    """F16 K and V bytes per token of context, over the attention layers."""
    hd = c["n_embd"] // c["n_head"]
    n_attn = sum(is_attention_layer(c, i) for i in range(c["n_layer"]))
    return n_attn * 2 * c["n_head_kv"] * hd * 2


def shape_problem(c: dict) -> str:
    """Why llama.cpp would refuse this shape ('' if it loads)."""
    if c["n_embd"] % c["n_head"] or c["n_head"] % c["n_head_kv"]:
        return "n_embd must divide by n_head, n_head by n_head_kv"
    if c.get("arch", "llama") == "llama":
        return ""
    n_attn = sum(is_attention_layer(c, i) for i in range(c["n_layer"]))
    if not 0 < n_attn < c["n_layer"]:
        return (f"attention every {c['attn_every']} of {c['n_layer']} layers gives {n_attn} attention layers: "
                "a hybrid needs at least one attention and one recurrent layer")
    if d_inner(c) % c["n_ssm_head"] or d_inner(c) % c["n_group"]:
        return f"d_inner (2 x n_embd = {d_inner(c)}) must divide by n_ssm_head and n_group"
    return ""


def cuda_ssm_problem(c: dict) -> str:
    """Why llama.cpp's CUDA backend would not run the SSM ops of this shape ('' if it does).

    An unsupported op falls back to the CPU, which adds copies of its own to a measurement
    (ggml-cuda.cu supports_op: SSM_SCAN Mamba2 needs d_state 96/128/256 and head_dim % 16 == 0;
    SSM_CONV needs d_inner + 2*n_group*d_state % 128 == 0)."""
    if c.get("arch", "llama") == "llama":
        return ""
    why = []
    if c["d_state"] not in (96, 128, 256):
        why.append(f"d_state {c['d_state']} not 96/128/256")
    if (d_inner(c) // c["n_ssm_head"]) % 16:
        why.append(f"SSM head dim {d_inner(c) // c['n_ssm_head']} not a multiple of 16")
    if (d_inner(c) + 2 * c["n_group"] * c["d_state"]) % 128:
        why.append("d_inner + 2*n_group*d_state not a multiple of 128")
    return "; ".join(why)


def n_elements(dims: Tuple[int, ...]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def nbytes(dims: Tuple[int, ...], ttype: int) -> int:
    return n_elements(dims) * (4 if ttype == F32 else 2)


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
    kvs = metadata(c, n_vocab) + tok_kvs
    ts = tensors(c, n_vocab)
    infos, offset = [], 0
    for name, dims, ttype, _ in ts:
        infos.append(_s(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
                     + struct.pack("<IQ", ttype, offset))
        offset += -(-nbytes(dims, ttype) // ALIGN) * ALIGN
    total = offset
    # 64 MiB of randomness, less for a small model (an even size keeps offsets on F16 boundaries)
    biggest = max(nbytes(dims, ttype) for _, dims, ttype, fill in ts if fill is None)
    block = random_f16_block(min(64 << 20, max(1 << 16, biggest + biggest % 2)), seed)
    consts = {}
    tmp = out.with_suffix(out.suffix + ".part")
    with open(tmp, "wb") as f:
        head = b"GGUF" + struct.pack("<IQQ", 3, len(ts), len(kvs)) + b"".join(kvs) + b"".join(infos)
        f.write(head + b"\0" * (-len(head) % ALIGN))
        rot = 0
        for name, dims, ttype, fill in ts:
            n = nbytes(dims, ttype)
            if fill is not None:
                if fill not in consts:
                    consts[fill] = struct.pack("<f", fill) * 65536
                _write_repeated(f, consts[fill], n, 0)
            else:
                rot = (rot + 2 * 7919 * 97) % len(block)   # even: stay on F16 boundaries
                _write_repeated(f, block, n, rot)
            f.write(b"\0" * (-n % ALIGN))
    os.replace(tmp, out)
    secs = max(time.monotonic() - t0, 1e-3)
    return {"path": str(out), "bytes": out.stat().st_size, "tensor_bytes": total, "n_vocab": n_vocab,
            "n_params": sum(n_elements(d) for _, d, _, _ in ts),
            "recurrent_state_bytes": recurrent_state_bytes(c), "kv_bytes_per_token": kv_bytes_per_token(c),
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
    for k in ("n_embd", "n_layer", "n_head", "n_head_kv", "n_ff", "ctx") + HYBRID_KEYS:
        ap.add_argument("--" + k.replace("_", "-"), type=_positive)
    ap.add_argument("--seed", type=int, default=1, help="-1: os.urandom")
    ap.add_argument("--force", action="store_true", help="rewrite an existing file")
    a = ap.parse_args()
    c = dict(PRESETS[a.preset], preset=a.preset)
    for k in ("n_embd", "n_layer", "n_head", "n_head_kv", "n_ff", "ctx") + HYBRID_KEYS:
        if getattr(a, k) is not None:
            if k in HYBRID_KEYS and k not in c:
                print(f"make_model: --{k.replace('_', '-')} is for the hybrid presets", file=sys.stderr)
                return 2
            c[k] = getattr(a, k)
    why = shape_problem(c)
    if why:
        print(f"make_model: {why}", file=sys.stderr)
        return 2
    why = cuda_ssm_problem(c)
    if why:
        print(f"make_model: warning: llama.cpp's CUDA backend would run this SSM on the CPU ({why})",
              file=sys.stderr)
    if a.out.exists() and not a.force:
        print(f"make_model: {a.out} exists (use --force to rewrite)")
        return 0
    try:
        info = write_model(a.out, a.vocab, c, a.seed)
    except (OSError, GGUFError, struct.error) as e:
        print(f"make_model: {e}", file=sys.stderr)
        return 1
    size = f"{info['bytes'] / 1e9:.2f} GB" if info["bytes"] >= 1e9 else f"{info['bytes'] / 1e6:.1f} MB"
    params = f"{info['n_params'] / 1e9:.2f}B" if info["n_params"] >= 1e9 else f"{info['n_params'] / 1e6:.1f}M"
    print(f"make_model: wrote {info['path']}: {size} in {info['seconds']} s "
          f"({info['gb_per_s']} GB/s), {c.get('arch', 'llama')}, {params} parameters, "
          f"{c['n_layer']} layers, n_embd {c['n_embd']}, vocab {info['n_vocab']}")
    if info["recurrent_state_bytes"]:
        print(f"make_model: per sequence: recurrent state {info['recurrent_state_bytes']} B "
              f"({info['recurrent_state_bytes'] / 2**20:.3f} MiB, F32), attention KV "
              f"{info['kv_bytes_per_token']} B per token (F16)")
    return 0


def _positive(s: str) -> int:
    # not otel_gpu_census.cli.argtypes: this script runs on the bare GPU machine without the package
    try:
        v = int(s)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}")
    return v


if __name__ == "__main__":
    sys.exit(main())
