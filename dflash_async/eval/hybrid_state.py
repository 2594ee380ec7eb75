"""Exact verification for hybrid targets: roll linear-attention state back to the accepted prefix.

A Gated DeltaNet layer (Qwen3-Next, Qwen3.5) keeps no per-token keys: its cache is a convolution
window (the last kernel-1 inputs) and one recurrent state per head, both overwritten by every
token the layer sees. Verifying a block of B tokens therefore moves them past the rejected drafts,
and unlike attention KV nothing can be cropped afterwards. So, per verify step:

    snapshot = snapshot_linear_states(cache)     # before the verify forward (clones)
    verify the block                             # states now include all B block tokens
    if some drafts were rejected:
        restore_linear_states(snapshot)          # states as before the block
        crop_attention(cache, position)          # attention KV back to the committed prefix
        forward the anchor + accepted drafts     # advance every layer by exactly those tokens

LFM2's short-convolution layers are cached the same way (a linear-attention layer whose one
state is the conv window) and roll back the same way.

The extra forward costs accepted+1 tokens; when every draft is accepted nothing is rolled back.
A decoder that skipped the restore would continue from states that saw rejected drafts and stop
matching greedy decoding (tests/eval/test_evaluate_hybrid.py runs that mutant).

Sliding-window layers (Mistral, Gemma 3/4, gpt-oss) have the same problem in HF's cache: a
DynamicSlidingWindowLayer keeps only the last window-1 positions, so after a block it no longer
holds the keys a rollback would uncover. `decoding_cache` gives them plain growing layers
instead; their attention masks still apply the window (HF masks by position), so the output is
the same and cropping stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import (
    Cache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionCacheLayerMixin,
)


@dataclass(frozen=True)
class LinearStateSnapshot:
    """Clones of every linear-attention layer's conv and recurrent states (None: not yet set),
    and of each layer's token count where the cache keeps one (transformers >= 5.25's
    `cumulative_length_linear`, which its get_seq_length reads)."""

    states: tuple[
        tuple[LinearAttentionCacheLayerMixin, int, torch.Tensor | None, torch.Tensor | None], ...
    ]
    lengths: tuple[tuple[LinearAttentionCacheLayerMixin, torch.Tensor], ...] = ()


def decoding_cache(config: Any) -> DynamicCache:
    """HF's DynamicCache for `config`, its sliding-window layers replaced by plain growing ones
    (see the module doc): every attention layer can then be cropped to any committed length."""
    cache = DynamicCache(config=config)
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicSlidingWindowLayer:  # subclasses mix in linear-attention state
            cache.layers[i] = DynamicLayer()
    return cache


def has_linear_layers(cache: Cache) -> bool:
    return any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in cache.layers)


def snapshot_linear_states(cache: Cache) -> LinearStateSnapshot:
    """Copies of the conv windows [b, channels, kernel] and recurrent states [b, H, dk, dv]."""
    states, lengths = [], []
    for layer in cache.layers:
        if not isinstance(layer, LinearAttentionCacheLayerMixin):
            continue
        length = getattr(layer, "cumulative_length_linear", None)
        if length is not None:
            lengths.append((layer, length.clone()))
        for i in range(layer.number_of_states):
            conv, recurrent = layer.conv_states[i], layer.recurrent_states[i]
            states.append(
                (
                    layer,
                    i,
                    None if conv is None else conv.clone(),
                    None if recurrent is None else recurrent.clone(),
                )
            )
    return LinearStateSnapshot(tuple(states), tuple(lengths))


def restore_linear_states(snapshot: LinearStateSnapshot) -> None:
    """Put the snapshot's states back in place (copy_: the cache tensors keep their addresses)."""
    for layer, i, conv, recurrent in snapshot.states:
        if conv is not None:
            layer.conv_states[i].copy_(conv)
        if recurrent is not None:
            layer.recurrent_states[i].copy_(recurrent)
    for layer, length in snapshot.lengths:
        layer.cumulative_length_linear.copy_(length)


def crop_attention(cache: Cache, length: int) -> None:
    """Drop cached attention positions >= length; linear-attention states are left alone."""
    for layer in cache.layers:
        if isinstance(layer, DynamicLayer) and layer.is_initialized:
            extra = layer.get_seq_length() - length
            if extra > 0:
                DynamicLayer.crop(layer, -extra)  # crop(-n) removes n (crop(0) differs in 5.x)
