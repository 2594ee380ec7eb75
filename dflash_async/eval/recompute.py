"""Decoding without a cache, for targets whose family says so (the generic family:
targets/families.py `Decoding.recompute`): every target forward runs the whole sequence so far.

An image prompt decodes this way too, whatever its family: the wrapper's forward computes the
image features and multimodal positions from the whole sequence and the prompt's vision inputs
(`RecomputeCache.vision`, data/images.py), so every verify sees exactly what a plain forward of
the sequence sees. The generated tokens are text to it whatever their ids, as in HF's `generate`:
a generated image placeholder is embedded as the token it is, never given image features
(targets/multimodal.py `generated_as_text`).

A generic target's cache may be anything (attention KV, Mamba or RWKV states, a model's own
cache class) and only some can be cut back after a rejected draft. Recomputing needs none of
that: `RecomputeCache` keeps the committed token ids, `target_forward` runs the model on them
plus the new tokens with use_cache=False and returns the new tokens' logits, and `crop` drops
ids. Exact for any causal architecture; the cost is quadratic in the sequence length (one full
forward per verify step), the price of correctness where no cache rule is known.

The decoders (speculative.py, the baseline) call `target_forward` and `crop` for every target:
with an HF cache they are the cached forward and hybrid_state.crop_attention.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from transformers import PreTrainedModel

from dflash_async.data.images import extended_inputs
from dflash_async.eval import hybrid_state
from dflash_async.targets.families import family_of
from dflash_async.targets.loading import text_config
from dflash_async.targets.multimodal import generated_as_text


class RecomputeCache:
    """The committed token ids [1, n] of one sequence (no layer holds state), and the prompt's
    vision inputs for a multimodal wrapper (ImageTextSample.model_inputs; empty for text) with
    the prompt's length (the ids of the first forward), after which every token is text."""

    layers: tuple = ()  # hybrid_state.has_linear_layers: nothing to snapshot

    def __init__(self, vision: Mapping[str, torch.Tensor] | None = None) -> None:
        self.ids: torch.Tensor | None = None
        self.vision = dict(vision or {})
        self.prompt_length = 0


def decodes_by_recompute(target: PreTrainedModel) -> bool:
    """The target's family decodes without a cache (Decoding.recompute)."""
    return family_of(text_config(target)).decoding.recompute


def decoding_state(target: PreTrainedModel, vision: Mapping[str, torch.Tensor] | None = None):
    """An empty decoding cache for `target`: RecomputeCache (with an image prompt's `vision`
    inputs), or HF's (hybrid_state)."""
    if vision or decodes_by_recompute(target):
        return RecomputeCache(vision)
    return hybrid_state.decoding_cache(target.config)


def target_forward(
    target: PreTrainedModel, ids: torch.Tensor, cache, *, logits_to_keep: int, cache_kw: str
) -> torch.Tensor:
    """Logits [1, m, V] of the last m (logits_to_keep; 0: all) of the new tokens `ids` [1, n],
    the cache advanced by them."""
    if not isinstance(cache, RecomputeCache):
        out = target(
            input_ids=ids, **{cache_kw: cache}, use_cache=True, logits_to_keep=logits_to_keep
        )
        return out.logits
    if cache.ids is None:
        whole, cache.prompt_length = ids, ids.shape[1]
    else:
        whole = torch.cat([cache.ids, ids], dim=1)
    if cache.vision:
        vision = extended_inputs(cache.vision, whole.shape[1])
        with generated_as_text(target, whole, cache.prompt_length) as shown:
            logits = target(input_ids=shown, **vision, use_cache=False).logits  # [1, P+n, V]
    else:
        logits = target(input_ids=whole, use_cache=False).logits
    cache.ids = whole
    return logits[:, -(logits_to_keep or ids.shape[1]) :]


def crop(cache, length: int) -> None:
    """Drop committed positions >= length (attention KV; a RecomputeCache's ids)."""
    if isinstance(cache, RecomputeCache):
        if cache.ids is not None:
            cache.ids = cache.ids[:, :length]
        return
    hybrid_state.crop_attention(cache, length)
