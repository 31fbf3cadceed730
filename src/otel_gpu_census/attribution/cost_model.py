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

:class:`StepModel` needs no model shape: it fits each kind of step's kernel time (decode steps by their CUDA-graph
batch size, prefill and mixed steps together) on the census's own steps, T = alpha + beta N + gamma Q + delta C
(N requests, Q new tokens, C attention pairs), non-negative, robust and forgetting, and weighs a request in a step
by its part of that, alpha / N + beta + gamma new + delta pairs; tokens (gamma alone) and FLOPs (roughly gamma and
delta) are its special cases. Until a kind's fit is ready its steps are split by tokens, and their requests say so.
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


# -- the step model: a step's kernel time fitted on the census's own steps, per kind of step -----------------

MODEL_MIN_STEPS = 32        # steps of a kind fitted before its fit weighs a split (until then: tokens)
MODEL_HALF_LIFE = 2000      # steps of a kind after which a step's weight in the fit has halved
MODEL_REFIT = 16            # steps of a kind between two solves of its fit
HUBER = 3.0                 # a step whose residual exceeds this many mean absolute residuals weighs less
FEATURES = ("fixed", "requests", "tokens", "attention")


def attention_work(new: int, before: int) -> int:
    """(query, key) pairs of computing `new` tokens after `before` (causal: token j sees before + j keys)."""
    return new * before + new * (new + 1) // 2


def graph_size(n: int) -> int:
    """The CUDA-graph batch size a decode step of `n` requests runs padded to (vLLM's default capture sizes:
    1, 2, 4, then multiples of 8)."""
    return n if n <= 2 else 4 if n <= 4 else -(-n // 8) * 8


def _solve(a: List[List[float]], b: List[float]) -> Optional[List[float]]:
    """a x = b by Gaussian elimination with partial pivoting; None when `a` is singular (to rounding)."""
    n = len(b)
    m = [row[:] + [v] for row, v in zip(a, b)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-9:
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(c + 1, n):
            f = m[r][c] / m[c][c]
            for k in range(c, n + 1):
                m[r][k] -= f * m[c][k]
    x = [0.0] * n
    for c in range(n - 1, -1, -1):
        x[c] = (m[c][n] - sum(m[c][k] * x[k] for k in range(c + 1, n))) / m[c][c]
    return x


class KindFit:
    """One kind of step's fit, T = alpha + beta*N + gamma*Q + delta*C: exponentially forgetting least squares
    (half-life MODEL_HALF_LIFE steps), steps far off the fit weighed down (Huber), coefficients kept
    non-negative (the best of the least-squares fits over every subset of the features whose coefficients
    all come out >= 0; collinear features, as requests and tokens in decode, leave those subsets singular)."""

    def __init__(self) -> None:
        self.sxx = [[0.0] * 4 for _ in range(4)]
        self.sxy = [0.0] * 4
        self.steps = 0
        self.coef: Optional[List[float]] = None
        self.mad = 0.0                      # mean absolute residual, clipped as the fit's (over ~64 steps)
        self.why = "fewer than %d steps of its kind fitted" % MODEL_MIN_STEPS
        self._lam = 0.5 ** (1 / MODEL_HALF_LIFE)
        self._warm: Optional[List[tuple]] = []   # the first steps, kept to weigh them once a fit exists

    def add(self, x: Sequence[float], y: float) -> None:
        w = 1.0
        if self.coef is not None:
            pred = sum(c * v for c, v in zip(self.coef, x))
            r = abs(y - pred)
            k = HUBER * max(self.mad, 1e-3 * abs(pred))      # never 0: a fit that shifts can follow
            if r > k:
                w, r = k / r, k                              # the scale follows the steps, not the stalls
            self.mad += (r - self.mad) / 64
        self._accumulate(x, y, w)
        self.steps += 1
        if self._warm is not None:
            self._warm.append((x, y))
            if self.steps >= MODEL_MIN_STEPS:
                self._robust_start()
        elif self.steps % MODEL_REFIT == 0:
            self._refit()

    def _accumulate(self, x: Sequence[float], y: float, w: float) -> None:
        lam = self._lam
        for i in range(4):
            row = self.sxx[i]
            wx = w * x[i]
            for j in range(4):
                row[j] = lam * row[j] + wx * x[j]
            self.sxy[i] = lam * self.sxy[i] + wx * y

    def _robust_start(self) -> None:
        """The first fit: the warm-up steps refitted a few times, each weighed by its residual (Huber, against
        the median absolute residual), so that a stall among them does not stay in the fit."""
        warm, self._warm = self._warm, None
        self._refit()
        for _ in range(3):
            if self.coef is None:
                return
            res = [abs(y - sum(c * v for c, v in zip(self.coef, x))) for x, y in warm]
            scale = sorted(res)[len(res) // 2]
            self.sxx, self.sxy = [[0.0] * 4 for _ in range(4)], [0.0] * 4
            for (x, y), r in zip(warm, res):
                self._accumulate(x, y, HUBER * scale / r if scale > 0 and r > HUBER * scale else 1.0)
            self._refit()
        self.mad = sum(min(r, HUBER * scale) for r in res) / len(res)

    def _refit(self) -> None:
        d = [math.sqrt(self.sxx[i][i]) for i in range(4)]
        best, best_obj = None, 0.0
        for mask in range(1, 16):
            idx = [i for i in range(4) if mask >> i & 1 and d[i] > 0]
            if len(idx) != bin(mask).count("1"):
                continue
            a = [[self.sxx[i][j] / (d[i] * d[j]) for j in idx] for i in idx]     # scaled: columns of unit norm
            sol = _solve(a, [self.sxy[i] / d[i] for i in idx])
            if sol is None or min(sol) < 0:
                continue
            obj = -sum(s * self.sxy[i] / d[i] for s, i in zip(sol, idx))       # at the subset's optimum
            if best is None or obj < best_obj:
                coef = [0.0] * 4
                for s, i in zip(sol, idx):
                    coef[i] = s / d[i]
                best, best_obj = coef, obj
        if best is None:
            self.why = "its fit has no non-negative solution (singular or negative on every subset)"
        self.coef = best

    def weights(self, news: Sequence[int], attns: Sequence[int]) -> Optional[List[int]]:
        """Each request's weight in a step of this kind, alpha/N + beta + gamma*new + delta*attention, as integers
        in proportion (None: the fit is not ready, `why` says so)."""
        if self.coef is None:
            return None
        a, b, g, dl = self.coef
        n = len(news)
        ws = [a / n + b + g * q + dl * c for q, c in zip(news, attns)]
        top = max(ws)
        if not top > 0:
            self.why = "its fit prices every request at nothing"
            return None
        return [max(1, int(w / top * (1 << 40))) for w in ws]


class StepModel:
    """A step's kernel time fitted online on the census's own steps, one KindFit per kind of step: decode steps
    (one new token each) by their CUDA-graph batch size, and every other (prefill or mixed) step as one kind."""

    def __init__(self) -> None:
        self.kinds: dict = {}

    @staticmethod
    def kind(news: Sequence[int]) -> Hashable:
        return ("decode", graph_size(len(news))) if all(q == 1 for q in news) else ("mixed",)

    def fit_of(self, news: Sequence[int]) -> KindFit:
        k = self.kind(news)
        f = self.kinds.get(k)
        if f is None:
            f = self.kinds[k] = KindFit()
        return f

    @staticmethod
    def features(news: Sequence[int], attns: Sequence[int]) -> List[float]:
        return [1.0, float(len(news)), float(sum(news)), float(sum(attns))]
