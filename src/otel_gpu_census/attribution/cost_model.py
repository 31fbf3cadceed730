"""What one request costs in one engine step, by the model's arithmetic: the weights of the FLOPs split.

Splitting a step's kernel time by scheduled tokens is fair to the linear layers (each token goes
through every weight matrix once) but not to attention, whose work per token grows with the context
the token attends to: a decode token at 32k context reads 16 times the keys of one at 2k, and a
prefill chunk late in a long prompt does about twice the attention of one at its start. The engine's
scheduler knows, for every request in a step, the tokens it computes (``new``) and the tokens
already computed before them (``before``: its prompt prefix, prefix-cache hits, earlier chunks, the
tokens generated so far); the model's configuration gives the shape. A request's weight in the step
is the floating-point work of its tokens:

    linear layers:  2 x (non-embedding weights a token meets) x new
    attention:      4 x layers x query width x (query, key) pairs,
                    pairs = new x before + new x (new + 1) / 2       (causal: token j sees before + j keys)
    output layer:   2 x hidden x vocabulary x sampled                (logits only where a token is sampled:
                                                                      not for a prompt chunk that ends short)

Integers throughout, so the split of each step stays exact (``shares.split_weights``). This is an
allocation of the measured step totals in proportion to estimated work, not a measurement of each
request: memory-bound phases (decode reading the KV cache and the weights) and fixed per-launch costs
do not follow FLOPs, and full (not sliding-window) attention is assumed.

Those costs are what :class:`CostFit` adds: a step's measured kernel time against its FLOPs, fitted over the
run's steps, gives what a step costs whatever it computes (its intercept), which a request run alone would pay
on every step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Hashable, List, Mapping, Optional, Sequence


def _int(cfg: Any, *names: str) -> Optional[int]:
    """The first of `names` that `cfg` has as a positive integer."""
    for n in names:
        v = getattr(cfg, n, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer that its FLOPs per token follow."""

    layers: int
    hidden: int
    q_dim: int                  # attention heads x head size
    kv_dim: int                 # key-value heads x head size
    intermediate: int           # MLP width a token meets (mixture of experts: the experts it is routed to)
    vocab: int
    gated: bool = True          # SwiGLU-style MLP: three matrices, not two

    @classmethod
    def of(cls, cfg: Any) -> Optional["ModelShape"]:
        """From a Hugging Face model configuration (``PretrainedConfig`` or anything with its field
        names), or None when a size it needs is missing."""
        if cfg is None:
            return None
        text = getattr(cfg, "text_config", None)         # multimodal wrappers keep the decoder's here
        if text is not None and _int(text, "num_hidden_layers") is not None:
            cfg = text
        layers = _int(cfg, "num_hidden_layers", "n_layer", "num_layers")
        hidden = _int(cfg, "hidden_size", "n_embd", "d_model")
        heads = _int(cfg, "num_attention_heads", "n_head")
        vocab = _int(cfg, "vocab_size")
        if None in (layers, hidden, heads, vocab):
            return None
        head = _int(cfg, "head_dim") or hidden // heads
        kv_heads = _int(cfg, "num_key_value_heads", "num_kv_heads") or heads
        experts = _int(cfg, "num_experts_per_tok", "moe_topk")
        moe = _int(cfg, "moe_intermediate_size")
        if experts and moe:
            intermediate = experts * moe + (_int(cfg, "shared_expert_intermediate_size") or 0)
        else:
            intermediate = _int(cfg, "intermediate_size", "n_inner", "ffn_dim") or 4 * hidden
        act = str(getattr(cfg, "hidden_act", "") or getattr(cfg, "activation_function", "") or "silu")
        return cls(layers=layers, hidden=hidden, q_dim=heads * head, kv_dim=kv_heads * head,
                   intermediate=intermediate, vocab=vocab, gated=act in ("silu", "swiglu", "geglu", "gelu_pytorch_tanh"))

    @property
    def linear_flops(self) -> int:
        """Per token: q, k, v and output projections and the MLP, every layer."""
        mlp = (3 if self.gated else 2) * self.hidden * self.intermediate
        return 2 * self.layers * (2 * self.hidden * self.q_dim + 2 * self.hidden * self.kv_dim + mlp)

    @property
    def pair_flops(self) -> int:
        """Per (query, key) pair: the score and the weighted value, every layer."""
        return 4 * self.layers * self.q_dim

    @property
    def head_flops(self) -> int:
        """Per sampled token: the logits."""
        return 2 * self.hidden * self.vocab

    def flops(self, new: int, before: int, sampled: int) -> int:
        """The FLOPs of computing `new` tokens after `before`, `sampled` of them sampled."""
        pairs = new * before + new * (new + 1) // 2
        return new * self.linear_flops + pairs * self.pair_flops + sampled * self.head_flops


def step_weights(shape: ModelShape, keys: Sequence[Hashable], tokens: Mapping[Hashable, int],
                 before: Mapping[Hashable, int], prompt: Mapping[Hashable, Optional[int]]) -> List[int]:
    """Each of `keys`' FLOPs in one step: `tokens` it computes, `before` them (0 where unknown); a token
    is sampled unless the step ends inside the request's prompt (`prompt`: its length, where known)."""
    out = []
    for k in keys:
        n = tokens[k]
        b = before.get(k) or 0
        p = prompt.get(k)
        out.append(shape.flops(n, b, 0 if p is not None and b + n < p else 1))
    return out


FIT_MIN_STEPS = 32      # steps fitted before the fit weighs a split (until then: FLOPs)
FIXED_FLOPS_MAX = 1e24  # a fixed cost beyond this many FLOPs' worth: every part costs the same (equal shares)


class CostFit:
    """A step's kernel time against its FLOPs, fitted by least squares over the steps split so far:
    time = fixed + per_flop x FLOPs. `fixed` is what a step costs whatever it computes (reading the
    weights, launch-bound kernels, sampling); a request run alone pays it on every step, so the alone
    split (``steps.ALONE_METHOD``) weighs each request in a step by what its part would cost alone,
    FLOPs + fixed / per_flop."""

    def __init__(self) -> None:
        self.n = 0
        self.mx = self.my = self.cxx = self.cxy = 0.0

    def add(self, flops: int, y: float) -> None:
        """One step's (one process's) kernel time `y`, the FLOPs of the requests it served."""
        self.n += 1
        dx = flops - self.mx
        self.mx += dx / self.n
        self.my += (y - self.my) / self.n
        self.cxx += dx * (flops - self.mx)
        self.cxy += dx * (y - self.my)

    def fixed_flops(self) -> Optional[int]:
        """A step's fixed cost in FLOPs' worth (fixed / per_flop); -1: no cost grows with FLOPs (equal
        shares); None: too few steps, or all of one size, to tell."""
        if self.n < FIT_MIN_STEPS or self.cxx <= 0:
            return None
        slope = self.cxy / self.cxx
        fixed = (self.my - slope * self.mx) / slope if slope > 0 else math.inf
        if not fixed < FIXED_FLOPS_MAX:      # nothing grows with FLOPs, or next to nothing (also inf, nan)
            return -1
        return max(0, int(fixed))
