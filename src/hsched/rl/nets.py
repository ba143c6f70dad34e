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
