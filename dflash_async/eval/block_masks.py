"""The attention masks of one decoding block pass, per drafter layer, as the layer trained.

Both decoders (speculative.py one sequence, batched.py per row) run the drafter on the block
[anchor, MASK x (B-1)] with its queries on keys [context slots (S), block (B)]. Each layer's
AttentionRule (model/layer_rules.py, docs/DFLASH.md s.10) narrows that exactly as the training
mask of model/attention_rule.py does:
- context slot p (slot index = RoPE position) is visible to block slot k iff p < anchor, and in
  a sliding layer also (anchor + k) - p < W, with `anchor` the position of the block's first
  token: z-lab's per-slot window (its `_attention_mask`, each query windowed from its own
  position anchor + k), the mask a served drafter sees;
- block slot s is visible to slot k iff s <= k in a causal layer, always in a bidirectional one,
  and in a sliding layer only where |k - s| < W (binding only when W < B).
A full, bidirectional layer gets None here: the decoder keeps its own plain mask (bit for bit
what it decoded before variants existed). One mask per distinct rule, so two at most.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dflash_async.model.layer_rules import AttentionRule

FULL_RULE = AttentionRule()


def rule_mask(
    rule: AttentionRule,
    anchors: torch.Tensor,  # [b] int64: the block's first position per row
    *,
    slots: int,  # S: context key slots in front of the block (slot index = position)
    block_size: int,
) -> torch.Tensor:
    """[b, 1, B, S+B] boolean (True = visible) for one rule."""
    device, b = anchors.device, anchors.shape[0]
    slot = torch.arange(slots, device=device)[None, None, :]  # [1, 1, S]: p
    k = torch.arange(block_size, device=device)  # the block's query slots
    context = (slot < anchors[:, None, None]).expand(b, block_size, slots)  # [b, B, S]
    block = torch.ones(block_size, block_size, dtype=torch.bool, device=device)
    if rule.causal:  # slot k sees block slots 0..k
        block = block.tril()
    if rule.window is not None:  # query position anchor + k: (anchor + k) - p < W
        context = context & ((anchors[:, None, None] + k[None, :, None]) - slot < rule.window)
        block = block & ((k[:, None] - k[None, :]).abs() < rule.window)  # |k - s| < W
    mask = torch.cat([context, block.expand(b, -1, -1)], dim=2)
    return mask[:, None]  # [b, 1, B, S+B]


def layer_masks(
    rules: Sequence[AttentionRule],
    anchors: torch.Tensor,
    *,
    slots: int,
    block_size: int,
) -> list[torch.Tensor | None]:
    """One mask per layer (None: a full bidirectional layer, the decoder's default)."""
    built: dict[AttentionRule, torch.Tensor] = {}
    out: list[torch.Tensor | None] = []
    for rule in rules:
        if rule == FULL_RULE:
            out.append(None)
            continue
        if rule not in built:
            built[rule] = rule_mask(rule, anchors, slots=slots, block_size=block_size)
        out.append(built[rule])
    return out
