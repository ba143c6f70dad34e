"""Networks shared by the agents (PyTorch).

Every placement network here is a *per-item scorer*: it reads a set of items (servers, hosts or clusters),
each described by the same features, plus one vector of global features (the task), and returns one value
per item. The same weights therefore serve a room of 24 servers or of 672, and a fleet of any size: what
must match between a checkpoint and the fleet it serves is the number of features, not the number of
items (the services check exactly that before using a model).

- `mlp`: the 128-64 hidden stack of paper 000 table 5 (ReLU), used on its own for the path DQN.
- `SelfAttentionScorer`: paper 000's actor/critic trunk — item and task features embedded, one multi-head
  self-attention layer over the items (each item sees the others, so a score can depend on where else the
  task could go), then the 128-64 MLP applied to every item. Optional per-item input (an action value
  for the DDPG critic) is concatenated before the MLP.
- `PooledScorer`: the same interface with a mean/max pooled context instead of attention, O(items) rather
  than O(items²) — for rooms of hundreds of servers where the 1 ms serving budget rules attention out.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

HIDDEN = (128, 64)  # paper 000 table 5


def mlp(inputs: int, outputs: int, hidden: Sequence[int] = HIDDEN) -> nn.Sequential:
    layers: list[nn.Module] = []
    width = inputs
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, outputs))
    return nn.Sequential(*layers)


class SelfAttentionScorer(nn.Module):
    """items [B, N, item_features], task [B, task_features] (, extra [B, N, extra]) → scores [B, N]."""

    def __init__(self, item_features: int, task_features: int, *, embed: int = 64, heads: int = 4,
                 hidden: Sequence[int] = HIDDEN, extra_features: int = 0) -> None:
        super().__init__()
        self.item_features, self.task_features, self.extra_features = item_features, task_features, extra_features
        self.embed = nn.Linear(item_features + task_features, embed)
        self.attention = nn.MultiheadAttention(embed, heads, batch_first=True)
        self.norm = nn.LayerNorm(embed)
        self.head = mlp(embed + extra_features, 1, hidden)

    def forward(self, items: torch.Tensor, task: torch.Tensor, extra: torch.Tensor | None = None,
                key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = torch.cat([items, task.unsqueeze(1).expand(-1, items.shape[1], -1)], dim=-1)
        h = torch.relu(self.embed(x))
        attended, _ = self.attention(h, h, h, key_padding_mask=key_padding_mask, need_weights=False)
        h = self.norm(h + attended)
        if extra is not None:
            h = torch.cat([h, extra], dim=-1)
        return self.head(h).squeeze(-1)


class PooledScorer(nn.Module):
    """Like `SelfAttentionScorer` with a pooled context: each item sees the mean and max of all items.

    Mathematically ``head(cat(h_i, context, extra_i))``; computed with the head's first layer split by
    input, so the context's share is one product per row rather than per item (a 672-server room then
    costs one small matmul per item), and the max pool as ``max(dim).values`` (~4× faster than ``amax``
    over the item axis on the CPU in torch 2.13)."""

    def __init__(self, item_features: int, task_features: int, *, embed: int = 64,
                 hidden: Sequence[int] = HIDDEN, extra_features: int = 0) -> None:
        super().__init__()
        self.item_features, self.task_features, self.extra_features = item_features, task_features, extra_features
        self.embed = nn.Linear(item_features + task_features, embed)
        self.head = mlp(3 * embed + extra_features, 1, hidden)

    def encode(self, items: torch.Tensor, task: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-item embeddings h [B, N, E] and the context's pre-activation share of the head [B, H]."""
        x = torch.cat([items, task.unsqueeze(1).expand(-1, items.shape[1], -1)], dim=-1)
        h = torch.relu(self.embed(x))
        e = h.shape[-1]
        context = torch.cat([h.mean(dim=1), h.max(dim=1).values], dim=-1)
        first = self.head[0]
        return h, F.linear(context, first.weight[:, e:3 * e], first.bias)

    def score(self, h: torch.Tensor, context: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        """Scores of embeddings h [..., E] given their rows' context share (broadcast against h)."""
        first, e = self.head[0], h.shape[-1]
        z = F.linear(h, first.weight[:, :e]) + context
        if extra is not None:
            z = z + F.linear(extra, first.weight[:, 3 * e:])
        return self.head[1:](z).squeeze(-1)

    def forward(self, items: torch.Tensor, task: torch.Tensor, extra: torch.Tensor | None = None,
                key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        h, context = self.encode(items, task)
        return self.score(h, context.unsqueeze(1), extra)


# Served scores are rounded to this many decimals: a BLAS product's rounding may depend on an item's row, so
# two items with equal features could differ in the last bits and the tie rule (lowest node index) would not
# hold; far below any difference between distinct items' scores.
SERVE_DECIMALS = 6
SERVE_DTYPE = np.float32  # as the torch models compute


class PooledNumpy:
    """A `PooledScorer`'s forward for one row in numpy (float64, rounded to SERVE_DECIMALS), for serving: a
    decision over ~100 items is a few small matrix products, where torch's per-operator overhead (~20-40 µs
    each, a dozen operators) would cost more than the arithmetic. Same weights, same formula; equal to the
    torch float32 forward up to its rounding. items [N, item_features], task [task_features] (, extra [N, extra_features]) → scores [N]."""

    def __init__(self, net: PooledScorer) -> None:
        def arr(t: torch.Tensor) -> np.ndarray:
            return t.detach().cpu().numpy().astype(SERVE_DTYPE)

        # The weights stay torch's [out, in] transposed (Fortran order): a C-contiguous copy is faster but OpenBLAS
        # then takes other kernels for a few rows (small-matrix, gemv paths) whose sums may differ in the last bit.
        self.embed_w, self.embed_b = arr(net.embed.weight).T, arr(net.embed.bias)
        e = self.embed_w.shape[1]
        first = net.head[0]
        w = arr(first.weight).T  # [3e + extra, H]
        self.h_w, self.ctx_w, self.extra_w, self.first_b = w[:e], w[e:3 * e], w[3 * e:], arr(first.bias)
        self.rest = [(arr(m.weight).T, arr(m.bias)) for m in net.head[1:] if isinstance(m, nn.Linear)]

    def __call__(self, items: np.ndarray, task: np.ndarray, extra: np.ndarray | None = None) -> np.ndarray:
        # in place where the formula allows: the same operations on the same operands, fewer temporaries
        f = items.shape[1]
        h = items @ self.embed_w[:f]
        h += task @ self.embed_w[f:] + self.embed_b
        np.maximum(h, 0.0, out=h)
        z = h @ self.h_w
        z += np.concatenate([h.mean(axis=0), h.max(axis=0)]) @ self.ctx_w + self.first_b
        if extra is not None:
            z += extra @ self.extra_w
        for w, b in self.rest:
            np.maximum(z, 0.0, out=z)
            z = z @ w
            z += b
        return np.round(z[:, 0], SERVE_DECIMALS)


class AttentionNumpy:
    """A `SelfAttentionScorer`'s forward for one row in numpy (float64, rounded), for serving, as `PooledNumpy`: the
    same weights and formula (embedding, multi-head self-attention, residual + LayerNorm, the MLP), equal to
    the torch forward up to its float32 rounding. items [N, item_features], task [task_features] → scores [N]."""

    def __init__(self, net: SelfAttentionScorer, fold: bool = True) -> None:
        def arr(t: torch.Tensor) -> np.ndarray:
            return t.detach().cpu().numpy().astype(SERVE_DTYPE)

        if net.extra_features:
            raise ValueError("AttentionNumpy serves scorers without extra per-item inputs")
        att = net.attention
        self.heads = att.num_heads
        self.embed_w, self.embed_b = arr(net.embed.weight).T, arr(net.embed.bias)
        self.in_w, self.in_b = arr(att.in_proj_weight).T, arr(att.in_proj_bias)  # [E, 3E]: q, k, v
        self.out_w, self.out_b = arr(att.out_proj.weight).T, arr(att.out_proj.bias)
        self.norm_w, self.norm_b, self.eps = arr(net.norm.weight), arr(net.norm.bias), net.norm.eps
        self.layers = [(arr(m.weight).T, arr(m.bias)) for m in net.head if isinstance(m, nn.Linear)]
        # The logits' 1/√d folded into the query's weights and bias when √d is a power of two (d = 16: 4): scaling
        # by a power of two is exact, so q/√d · k = (q · k)/√d to the bit (the products and sums scale exactly), one
        # product over [N, E] instead of a division over [H, N, N]
        e = self.in_w.shape[0]
        d = e // self.heads
        self.scale = np.float32(np.sqrt(d))
        mantissa, _ = np.frexp(self.scale)
        self.folded = fold and bool(mantissa == 0.5)  # √d = 2^k (fold=False: divide the logits, for tests)
        if self.folded:
            self.in_w[:, :e] /= self.scale  # in_w is a transposed copy of the weights: ours to change
            self.in_b[:e] /= self.scale
        # C-contiguous copies of the [N, E] × [E, ·] weights: those products take ~35 % less time at 65 rows (a
        # decision 115 → 92 µs at 33) and give the transposed layout's sums bit for bit there (OpenBLAS packs
        # either layout for the same gemm kernel; compared at 19-800 rows), but below 19 rows OpenBLAS takes
        # small-matrix kernels whose sums differ in the last bit: fewer rows than CONTIGUOUS_ROWS keep torch's.
        c = np.ascontiguousarray
        self._contiguous = (c(self.in_w), c(self.out_w), [(c(w), b) for w, b in self.layers])

    CONTIGUOUS_ROWS = 24  # both layouts sum alike from 19 rows here: a margin over it

    def __call__(self, items: np.ndarray, task: np.ndarray) -> np.ndarray:
        # in place where the formula allows: the same operations on the same operands in the same order as
        # the plain expression (h + attended, (x − mean) / sqrt(var + eps) · w + b), fewer temporaries; the means
        # and maxima by the ufuncs' reductions that ndarray.mean / .max call (mean: the sum, divided by the count as
        # an intp, in place), without their Python wrappers
        n, f = items.shape
        in_w, out_w, layers = self._contiguous if n >= self.CONTIGUOUS_ROWS else (self.in_w, self.out_w, self.layers)
        h = items @ self.embed_w[:f]
        h += task @ self.embed_w[f:] + self.embed_b
        np.maximum(h, 0.0, out=h)  # [N, E]
        e = h.shape[1]
        d = e // self.heads
        qkv = h @ in_w
        qkv += self.in_b
        qkv = qkv.reshape(n, 3, self.heads, d).transpose(1, 2, 0, 3)  # [3, H, N, d]
        logits = qkv[0] @ qkv[1].transpose(0, 2, 1)  # [H, N, N]
        if not self.folded:
            logits /= self.scale
        logits -= np.maximum.reduce(logits, axis=-1, keepdims=True)
        np.exp(logits, out=logits)
        logits /= np.add.reduce(logits, axis=-1, keepdims=True)
        x = (logits @ qkv[2]).transpose(1, 0, 2).reshape(n, e) @ out_w  # [N, E]
        x += self.out_b
        x += h
        count = np.intp(e)
        mean = np.add.reduce(x, axis=-1, keepdims=True)
        np.true_divide(mean, count, out=mean, casting="unsafe")  # computed in float64, stored as float32: mean's
        x -= mean
        var = np.add.reduce(np.square(x), axis=-1, keepdims=True)
        np.true_divide(var, count, out=var, casting="unsafe")
        var += np.float32(self.eps)
        x /= np.sqrt(var)
        x *= self.norm_w
        x += self.norm_b
        z = x
        for i, (w, b) in enumerate(layers):
            if i:
                np.maximum(z, 0.0, out=z)
            z = z @ w
            z += b
        return z[:, 0].round(SERVE_DECIMALS)
