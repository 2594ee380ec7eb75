"""The decode step's attention over a static cache: grouped-query attention without copying K, V.

HF's sdpa attention, given a mask (a static cache always needs one: its unfilled tail, and left
padding), repeats K and V to every query head (`repeat_kv`) because torch's fused kernels take no
GQA together with a mask. On a decode step that copies the whole cache of every layer: 4x its
size for Qwen3-8B (32 query heads, 8 KV heads), written and read again, ~9x the bytes the step
has to read, at a batch of 200 rows x 2,304 cached tokens ~0.6 TB a step. `gqa_attention` does a
decode step (one query row) per KV head as two batched matmuls over the cache as it is (K and V
read once; the float32 scores, [B, H, 1, L], are small); every other call (the prefill, no mask)
goes to HF's sdpa unchanged.

`gqa_decode(model)` registers it with transformers' AttentionInterface (and the sdpa mask under
the same name, AttentionMaskInterface) and switches a model that uses sdpa to it, restoring the
model's own implementation on exit. Masked scores are the float32 minimum, not -inf: a row with
every key masked gets finite weights instead of NaN (exp(min - max) is exactly 0 for every other
row, so nothing else changes).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

NAME = "regen_gqa_decode"  # no "flash" in it: transformers takes such names for flash kernels


def gqa_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF's attention-function contract: q [B, H, q, D], k/v [B, KVH, L, D], the mask [B, 1, q, L]
    (True: attend) -> ([B, q, H, D], None). One query row with a mask: grouped matmuls."""
    b, heads, rows, dim = query.shape
    kv_heads = key.shape[1]
    mask = attention_mask
    if (
        rows != 1
        or not isinstance(mask, torch.Tensor)
        or mask.dim() != 4
        or mask.shape[1] != 1
        or dropout
        or kwargs.get("position_bias") is not None
    ):
        return ALL_ATTENTION_FUNCTIONS["sdpa"](
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    groups = heads // kv_heads
    scale = scaling if scaling is not None else dim**-0.5
    q = query.reshape(b, kv_heads, groups, dim)  # head h = kv head h // groups (as repeat_kv)
    scores = torch.matmul(q, key.transpose(-1, -2)).float() * scale  # [B, KVH, G, L]
    # the mask, [B, 1, 1, L], broadcasts over the KV heads and their groups
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, torch.finfo(torch.float32).min)
    else:
        scores = scores + mask.float()
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.matmul(probs, value)  # [B, KVH, G, D]
    return out.reshape(b, 1, heads, dim), None


@contextmanager
def gqa_decode(model: Any) -> Iterator[None]:
    """`model` attends with `gqa_attention` inside the block when it uses sdpa (else as it is)."""
    previous = model.config._attn_implementation
    if previous != "sdpa":
        yield
        return
    AttentionInterface.register(NAME, gqa_attention)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation(NAME)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)
