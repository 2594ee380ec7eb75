"""The DSpark drafter: the DFlash backbone with anchor-first slots, a Markov head and a
confidence head (docs/DFLASH.md s.11).

This module owns the model half of DSpark; its objective is model/kinds/dspark/objective.py and
its chain drafting model/kinds/dspark/decoding.py. The backbone is DFlashDrafter unchanged (the
same layers, `fc`, norms and parameter names); what differs:
- every block slot predicts: slot k of `[x_a, MASK, ...]` predicts x[a+k+1] (the anchor's slot
  predicts the next token), so a block of B inputs gives B drafts;
- `markov_head`: the bias `W2 @ u` on a slot's logits, u = W1[prev] (`vanilla`) or
  u = sigmoid(gate_proj([h, W1[prev]])) * W1[prev] (`gated`), prev = the token before the slot's
  (the gold one in training, the drafted one when drafting); W1 is `markov_w1` (an embedding
  [V, r]), W2 is `markov_w2` (Linear r -> V, no bias);
- `confidence_head.proj`: Linear([h, W1[prev]] or h -> 1, with bias), whose sigmoid predicts the
  slot's acceptance.
The target's features may carry more columns than the drafter's k layers (the captured final
layer its objective reads): `fuse` reads the first k*d columns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from dflash_async.model.drafter import DFlashDrafter

if TYPE_CHECKING:  # the config is built from every kind's fields (model/kinds/)
    from dflash_async.model.drafter_config import DrafterConfig


class MarkovHead(nn.Module):
    """The low-rank bias from the previous token: latent u [N, r] here, W2 @ u by the caller
    (in the objective's chunks: the [N, V] bias never exists at once)."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        d, v, r = config.hidden_size, config.vocab_size, config.markov_rank
        self.gated = config.markov_head_type == "gated"
        self.markov_w1 = nn.Embedding(v, r)
        self.markov_w2 = nn.Linear(r, v, bias=False)
        if self.gated:
            self.gate_proj = nn.Linear(d + r, r)

    def previous_embeddings(self, previous: torch.Tensor) -> torch.Tensor:
        """W1[prev]: [N] token ids -> [N, r]."""
        return self.markov_w1(previous)

    def latent(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """u [N, r] for slots with states `hidden` [N, d] and previous tokens [N]."""
        e = self.previous_embeddings(previous).to(hidden.dtype)
        if not self.gated:
            return e
        gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, e], dim=-1)))
        return gate.to(e.dtype) * e

    def bias(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """W2 @ u: [N, V] (decoding and tests; the objective chunks it)."""
        u = self.latent(hidden, previous)
        return F.linear(u, self.markov_w2.weight.to(u.dtype))


class ConfidenceHead(nn.Module):
    """Acceptance logits [N] of slots: Linear([h, W1[prev]]) or Linear(h), with bias."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.with_markov = config.confidence_head_with_markov
        width = config.hidden_size + (config.markov_rank if self.with_markov else 0)
        self.proj = nn.Linear(width, 1)

    def forward(self, hidden: torch.Tensor, previous_embeddings: torch.Tensor | None):
        x = hidden
        if self.with_markov:
            x = torch.cat([hidden, previous_embeddings.to(hidden.dtype)], dim=-1)
        return self.proj(x).squeeze(-1)


class DSparkDrafter(DFlashDrafter):
    """The trainable DSpark drafter; forward() returns norm(x) [Q, d] like DFlashDrafter's."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__(config)
        self.markov_head = MarkovHead(config) if config.markov_rank > 0 else None
        self.confidence_head = ConfidenceHead(config) if config.confidence_head else None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """Qwen3's init for the backbone; the heads' linears and W1 normal(0, std), their biases
        0 (also called by DFlashDrafter.__init__, before the heads exist)."""
        super().reset_parameters(std)
        for module in self.modules():
            if isinstance(module, nn.Embedding):
                module.weight.normal_(0.0, std)
            elif isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.zero_()

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """C from the first k*d feature columns (the drafter's layers)."""
        width = self.config.num_features * self.config.hidden_size
        return super().fuse(features[..., :width])

    def draft_logits(self, hidden: torch.Tensor, previous: torch.Tensor, lm_head_weight):
        """Full draft logits [N, V] = lm_head(h) + the Markov bias (decoding and tests)."""
        logits = hidden @ lm_head_weight.to(hidden.dtype).T
        if self.markov_head is None:
            return logits
        return logits + self.markov_head.bias(hidden, previous)

    def confidence_logits(self, hidden: torch.Tensor, previous: torch.Tensor):
        """Acceptance logits [N] (None without a confidence head)."""
        if self.confidence_head is None:
            return None
        e = None
        if self.markov_head is not None:
            e = self.markov_head.previous_embeddings(previous)
        return self.confidence_head(hidden, e)
