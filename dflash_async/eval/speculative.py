"""Greedy speculative decoding of one sequence with a DFlash(2) drafter: the reference decoder.

The algorithm that measures acceptance length (tau, docs/DFLASH.md section 8). batched.py decodes
many prompts at once and must give the same tokens and tau; this one is the simple reference it
is tested against, and the decoder for hybrid targets. Batch 1, greedy, KV caches on both sides:

    prefill: the target runs the prompt (HF DynamicCache) and its captured layers become the
             drafter's context; the target's next token is the first committed token.
    loop:    the drafter fills [last committed token, MASK x (B-1)] at positions pos..pos+B-1,
             seeing every committed token's features (all at positions < pos) and its own block;
             its drafts are selector.py's (unary argmax, or the DFlash2 selector's walk);
             the target verifies the block in one forward: t_i = its argmax after block token i.
             accepted = leading drafts with d_{i+1} == t_i; commit t_0..t_accepted (the accepted
             drafts ARE the target's tokens, t_accepted is the bonus token), record accepted+1,
             crop the target cache to the committed tokens and append their features (block
             rows 0..accepted) to the drafter's context cache.

Hybrid targets (Gated DeltaNet layers) cannot crop their recurrent state: the verify step
snapshots it and, after a rejection, restores it and advances by the accepted tokens
(hybrid_state.py). The output equals plain greedy decoding up to numerical ties (lossless.py).

The last step may commit past `max_new_tokens`; its accepted length is recorded as drafted (it
measures the drafter), the output is cut. Each step syncs the host once (the accept decision).

With a Sampler (T > 0, sampling.py) the same loop samples: the first token ~ p, drafts ~ q (the
drafter's, or the selector's walk), the verdict by rejection sampling; T = 0 runs the greedy code.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, PreTrainedModel

from dflash_async.eval import hybrid_state, recompute
from dflash_async.eval.block_masks import layer_masks
from dflash_async.eval.lossless import (
    GreedyResult,
    SpecResult,
    cut_at_stop,
    eos_set,
    first_difference,
)
from dflash_async.eval.sampling import Sampler
from dflash_async.eval.selector import draft_confidence, draft_tokens, sampled_draft_tokens
from dflash_async.model.drafter import DFlashDrafter, apply_rope, rope_cos_sin
from dflash_async.model.drafter_config import DrafterConfig
from dflash_async.targets.generic import layer_input, layer_output
from dflash_async.targets.loading import decoder_layers, text_config
from dflash_async.targets.stream_taps import stream_tap


class BlockDrafter(Protocol):
    """What the decode loop needs from a drafter (the real one below, or a test's oracle)."""

    def extend_context(self, features: torch.Tensor, positions: torch.Tensor) -> None:
        """Append committed tokens' target features [n, k*d] at RoPE positions [n]."""

    def draft(self, anchor_token: int, anchor_position: int) -> torch.Tensor:
        """Draft tokens [B-1] for the block slots 1..B-1 after the anchor."""


class DFlashBlockDrafter:
    """A DFlashDrafter with a per-layer KV cache of its (fused) context, for one sequence.

    Context keys/values depend only on the committed features, so each is computed once when
    its token is committed; a block pass then runs the drafter on the B block rows with an
    `attend` that puts the cached context in front of the block's own keys (full visibility:
    the context holds only positions < anchor). Lifecycle: one instance per decoded sequence.
    """

    def __init__(
        self,
        drafter: DFlashDrafter,
        config: DrafterConfig,
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor,
        *,
        max_context: int,
    ) -> None:
        self.drafter, self.config = drafter, config
        self.embed_weight, self.lm_head_weight = embed_weight, lm_head_weight
        weight = drafter.fc.weight
        shape = (1, config.num_key_value_heads, max_context, config.head_dim)
        self.keys = [weight.new_zeros(shape) for _ in drafter.layers]  # [1, Hkv, Tmax, hd]
        self.values = [weight.new_zeros(shape) for _ in drafter.layers]
        self.length = 0

    @torch.no_grad()
    def extend_context(self, features: torch.Tensor, positions: torch.Tensor) -> None:
        end, hd = self.length + features.shape[0], self.config.head_dim
        if end > self.keys[0].shape[2]:
            raise ValueError(f"context of {end} tokens exceeds max_context={self.keys[0].shape[2]}")
        device = self.keys[0].device  # the drafter's: it may sit on another GPU than the target
        context = self.drafter.fuse(features.to(device))  # [n, d]
        cos, sin = rope_cos_sin(positions.to(device), hd, self.config.rope_theta, context.dtype)
        for layer, keys, values in zip(self.drafter.layers, self.keys, self.values, strict=True):
            attn = layer.self_attn  # same math as DraftAttention's context keys/values
            k = attn.k_norm(attn.k_proj(context).unflatten(-1, (-1, hd))).transpose(0, 1)
            keys[0, :, self.length : end] = apply_rope(k, cos, sin)  # [Hkv, n, hd]
            values[0, :, self.length : end] = (
                attn.v_proj(context).unflatten(-1, (-1, hd)).transpose(0, 1)
            )
        self.length = end

    def _cached_attend(self) -> tuple[Callable[..., torch.Tensor], Iterator[Any]]:
        """An `attend` for one block pass: layer i's call prepends layer i's cached context,
        masked by layer i's trained rule (block_masks.py; none for a full bidirectional one)."""
        anchor = torch.tensor([self.length], device=self.keys[0].device)
        masks = layer_masks(
            self.config.attention_rules(),
            anchor,
            slots=self.length,
            block_size=self.config.block_size,
        )
        layers = iter(zip(self.keys, self.values, masks, strict=True))

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            context_k, context_v, mask = next(layers)  # one call per layer, in order
            k = torch.cat([context_k[:, :, : self.length], k], dim=2)  # [1, Hkv, T+B, hd]
            v = torch.cat([context_v[:, :, : self.length], v], dim=2)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

        return attend, layers

    @torch.no_grad()
    def block_hidden(self, anchor_token: int, anchor_position: int) -> torch.Tensor:
        """Drafter states [B-1, d] (after the final norm) of block slots 1..B-1 for the block
        [anchor, MASK x (B-1)]."""
        cfg, embed = self.config, self.embed_weight
        block = torch.full((cfg.block_size,), cfg.mask_token_id, device=embed.device)
        block[0] = anchor_token
        block_embeds = embed[block].to(self.keys[0].device)  # [B, d]
        positions = torch.arange(cfg.block_size, device=block_embeds.device) + anchor_position
        no_features = block_embeds.new_zeros(0, cfg.num_features * cfg.hidden_size)
        attend, unused = self._cached_attend()
        hidden = self.drafter(block_embeds, positions, no_features, positions[:0], attend)
        assert next(unused, None) is None, "the drafter skipped a layer's attention"
        return hidden[cfg.block_size - cfg.drafts_per_block :]  # the slots that draft

    def block_logits(self, anchor_token: int, anchor_position: int) -> torch.Tensor:
        """Unary logits [B-1, V] of block slots 1..B-1."""
        lm_head = self.lm_head_weight
        hidden = self.block_hidden(anchor_token, anchor_position)
        return hidden.to(lm_head.device, lm_head.dtype) @ lm_head.T

    @torch.no_grad()
    def draft(self, anchor_token: int, anchor_position: int) -> torch.Tensor:
        """Drafts [B-1]: the unary argmax, or a DFlash2 drafter's selector walk (selector.py)."""
        hidden = self.block_hidden(anchor_token, anchor_position)[None]  # [1, B-1, d]
        anchor = torch.tensor([anchor_token], device=self.lm_head_weight.device)
        drafts = draft_tokens(self.drafter, hidden, self.lm_head_weight, anchor)
        confidence = draft_confidence(self.drafter, hidden, drafts, anchor)
        # [n] predicted acceptances of these drafts, or None (the kind has no confidence head)
        self.confidence = None if confidence is None else confidence[0]
        return drafts[0]

    @torch.no_grad()
    def draft_sampled(
        self, anchor_token: int, anchor_position: int, sampler: Sampler
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(drafts [B-1], their q [B-1, V]) sampled at the sampler's temperature."""
        hidden = self.block_hidden(anchor_token, anchor_position)[None]  # [1, B-1, d]
        anchor = torch.tensor([anchor_token], device=self.lm_head_weight.device)
        drafts, q = sampled_draft_tokens(
            self.drafter, hidden, self.lm_head_weight, anchor, sampler=sampler
        )
        confidence = draft_confidence(self.drafter, hidden, drafts, anchor)
        self.confidence = None if confidence is None else confidence[0]  # as in draft()
        return drafts[0], q[0]


@contextmanager
def captured_layers(target: PreTrainedModel, layer_ids: Sequence[int]) -> Iterator[dict[int, Any]]:
    """Forward hooks that keep the latest raw output of each layer in `layer_ids` (not the HF
    final-norm'd last hidden state: the same features TargetFeatures gives the trainer), taken
    as it enters the next layer where there is one: what a multimodal wrapper adds between
    layers (Qwen3-VL's deepstack visual features) is in it, as in the multimodal target
    forward's features (targets/multimodal.py); for every other model the same tensor. A type
    whose layers return several residual streams per token is collapsed by its STREAM_TAPS entry
    (targets/stream_taps.py), as the training forward's hooks do (targets/generic.py)."""
    outputs: dict[int, Any] = {}
    layers = decoder_layers(target)
    tap = stream_tap(text_config(target))
    collapse = {i: tap(target, layers, i) for i in layer_ids} if tap is not None else {}

    def keep(i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            hidden = layer_output(output)
            outputs[i] = collapse[i](hidden) if i in collapse else hidden

        return hook

    width = text_config(target).hidden_size

    def entering(i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            hidden = layer_input(args, kwargs)
            if isinstance(hidden, torch.Tensor) and hidden.shape[-1] == width:
                outputs[i] = hidden

        return hook

    handles = [layers[i].register_forward_hook(keep(i)) for i in layer_ids]
    handles += [  # the streams entering the next layer are the collapsed output itself
        layers[i + 1].register_forward_pre_hook(entering(i), with_kwargs=True)
        for i in layer_ids
        if i + 1 < len(layers) and i not in collapse
    ]
    try:
        yield outputs
    finally:
        for handle in handles:
            handle.remove()


def cache_kwarg(model: nn.Module) -> str:
    """transformers renamed `past_key_values` to `cache` during 5.x; accept both."""
    return _cache_kwarg_of(type(model))


@functools.cache
def _cache_kwarg_of(model_class: type) -> str:
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _suppressed(logits: torch.Tensor, suppress: torch.Tensor | None) -> torch.Tensor:
    return logits if suppress is None else logits.index_fill(-1, suppress, float("-inf"))


def _suppress_tensor(ids: Sequence[int], device: torch.device) -> torch.Tensor | None:
    return torch.tensor(sorted(ids), dtype=torch.long, device=device) if ids else None


def _prompt_tensor(prompt_ids: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(1, -1).to(device)  # [1, P]
    if prompt.shape[1] == 0:
        raise ValueError("prompt_ids is empty: decoding needs at least one prompt token")
    return prompt


def _decode_start(
    target: PreTrainedModel,
    prompt_ids: Sequence[int] | torch.Tensor,
    eos_token_id: int | Sequence[int] | None,
    suppress_token_ids: Sequence[int],
    vision: Mapping[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, frozenset[int], torch.Tensor | None, DynamicCache]:
    """What both decoders start from: (prompt [1, P] on the target's device, eos ids, suppressed
    ids [S] or None, an empty target KV cache; an image prompt's: a RecomputeCache holding its
    `vision` inputs)."""
    device = next(target.parameters()).device
    prompt = _prompt_tensor(prompt_ids, device)
    suppress = _suppress_tensor(suppress_token_ids, device)
    return prompt, eos_set(eos_token_id), suppress, recompute.decoding_state(target, vision)


@torch.no_grad()
def greedy_generate(
    target: PreTrainedModel,
    prompt_ids: Sequence[int] | torch.Tensor,
    max_new_tokens: int,
    eos_token_id: int | Sequence[int] | None,
    *,
    suppress_token_ids: Sequence[int] = (),
    vision: Mapping[str, torch.Tensor] | None = None,
) -> GreedyResult:
    """Plain greedy decoding with a KV cache, one token per target forward (the baseline); an
    image prompt (its `vision` inputs: ImageTextSample.model_inputs) by recomputation."""
    prompt, eos, suppress, cache = _decode_start(
        target, prompt_ids, eos_token_id, suppress_token_ids, vision
    )
    cache_kw = cache_kwarg(target)
    ids, tokens, runner_up, margins = prompt, [], [], []
    while len(tokens) < max_new_tokens and not eos.intersection(tokens[-1:]):
        out = recompute.target_forward(target, ids, cache, logits_to_keep=1, cache_kw=cache_kw)
        logits = _suppressed(out[0, -1].float(), suppress)  # [V]
        token = logits.argmax()
        second = logits.index_fill(0, token[None], float("-inf")).argmax()
        # Sync point: the next input token is needed on the host (one per generated token).
        token_id, second_id, margin = torch.stack(
            [token.double(), second.double(), logits[token] - logits[second]]
        ).tolist()
        tokens.append(int(token_id))
        runner_up.append(int(second_id))
        margins.append(margin)
        ids = token.reshape(1, 1)
    return GreedyResult(tokens, runner_up, margins)


def _target_step(
    target: PreTrainedModel,
    outputs: dict[int, Any],
    layer_ids: Sequence[int],
    ids: torch.Tensor,  # [1, n]
    cache: DynamicCache,
    logits_to_keep: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One cached target forward -> (logits [m, V], features [n, k*d] of the n input tokens)."""
    logits = recompute.target_forward(
        target, ids, cache, logits_to_keep=logits_to_keep, cache_kw=cache_kwarg(target)
    )
    # the last n rows: all of them after a cached forward, the new ones after a recomputation
    features = torch.cat([outputs[i][0, -ids.shape[1] :] for i in layer_ids], dim=-1)  # [n, k*d]
    return logits[0].float(), features


def _verify(
    target: PreTrainedModel,
    outputs: dict[int, Any],
    layer_ids: Sequence[int],
    cache: DynamicCache,
    block: torch.Tensor,  # [1, B]: the anchor, then the B-1 drafts
    suppress: torch.Tensor | None,
    sampled: tuple[Sampler, torch.Tensor] | None = None,  # T > 0: (sampler, q [B-1, V])
) -> tuple[int, list[int], torch.Tensor]:
    """The target's verdict on a block: (accepted drafts, the target's tokens t_0..t_accepted,
    features [B, k*d] of the block rows). t_i is the target's argmax after block token i (T > 0:
    the accepted drafts, then the residual or bonus token: Sampler.verdict)."""
    logits, features = _target_step(target, outputs, layer_ids, block, cache, logits_to_keep=0)
    if sampled is not None:
        sampler, q = sampled
        accepted, committed = sampler.verdict(_suppressed(logits, suppress), block[0, 1:], q)
        return accepted, committed, features
    verified = _suppressed(logits, suppress).argmax(-1)  # [B]
    # Sync point: drafts and the target's tokens come to the host for the accept decision.
    both = torch.cat([block[0, 1:], verified]).tolist()
    drafted, target_tokens = both[: block.shape[1] - 1], both[block.shape[1] - 1 :]
    accepted = first_difference(drafted, target_tokens[:-1])
    accepted = len(drafted) if accepted is None else accepted
    return accepted, target_tokens[: accepted + 1], features


def _roll_back(
    target: PreTrainedModel,
    cache: DynamicCache,
    snapshot: hybrid_state.LinearStateSnapshot,
    position: int,
    committed: torch.Tensor,  # [1, a+1]: the anchor and the accepted drafts
) -> None:
    """Linear-attention states as if the target had seen only `committed` after `position`."""
    hybrid_state.restore_linear_states(snapshot)
    hybrid_state.crop_attention(cache, position)
    recompute.target_forward(
        target, committed, cache, logits_to_keep=1, cache_kw=cache_kwarg(target)
    )


@torch.no_grad()
def speculative_decode(
    target: PreTrainedModel,
    drafter: BlockDrafter,
    prompt_ids: Sequence[int] | torch.Tensor,
    *,
    layer_ids: Sequence[int],
    max_new_tokens: int,
    eos_token_id: int | Sequence[int] | None,
    suppress_token_ids: Sequence[int] = (),
    sampler: Sampler | None = None,
    vision: Mapping[str, torch.Tensor] | None = None,
) -> SpecResult:
    """Speculative decoding of one prompt with any BlockDrafter (see the module doc): greedy, or
    sampled with `sampler` (its drafter must also have `draft_sampled`); an image prompt (its
    `vision` inputs: ImageTextSample.model_inputs) by recomputation."""
    prompt, eos, suppress, cache = _decode_start(
        target, prompt_ids, eos_token_id, suppress_token_ids, vision
    )
    device, hybrid = prompt.device, hybrid_state.has_linear_layers(cache)
    with captured_layers(target, layer_ids) as outputs:
        logits, features = _target_step(target, outputs, layer_ids, prompt, cache, logits_to_keep=1)
        position = prompt.shape[1]  # of the newest committed token: the next anchor
        drafter.extend_context(features, torch.arange(position, device=device))
        # Sync point: the first new token (the first anchor) is needed on the host.
        first = _suppressed(logits[-1], suppress)
        tokens = [sampler.first_token(first) if sampler else int(first.argmax())]
        accepted_lengths: list[int] = []
        confidence: list[list[float]] = []  # a confidence head's predictions, per step
        while len(tokens) < max_new_tokens and not eos.intersection(tokens):
            if sampler is None:
                drafts, sampled = drafter.draft(tokens[-1], position).to(device), None  # [B-1]
            else:
                drafts, q = drafter.draft_sampled(tokens[-1], position, sampler)  # type: ignore[attr-defined]
                drafts, sampled = drafts.to(device), (sampler, q)
            predicted = getattr(drafter, "confidence", None)
            if predicted is not None:
                confidence.append(predicted.float().tolist())
            block = torch.cat([torch.tensor([tokens[-1]], device=device), drafts])[None]  # [1, B]
            snapshot = hybrid_state.snapshot_linear_states(cache) if hybrid else None
            accepted, committed, features = _verify(
                target, outputs, layer_ids, cache, block, suppress, sampled
            )
            tokens += committed
            accepted_lengths.append(accepted + 1)
            new_positions = torch.arange(position, position + accepted + 1, device=device)
            if snapshot is not None and accepted + 1 < block.shape[1]:
                _roll_back(target, cache, snapshot, position, block[:, : accepted + 1])
            # keeps the anchor and the accepted drafts
            recompute.crop(cache, position + accepted + 1)
            drafter.extend_context(features[: accepted + 1], new_positions)
            position += accepted + 1
    return SpecResult(cut_at_stop(tokens, max_new_tokens, eos), accepted_lengths, confidence)


def speculative_generate(
    target: PreTrainedModel,
    drafter: DFlashDrafter,
    drafter_config: DrafterConfig,
    embed_weight: torch.Tensor,
    lm_head_weight: torch.Tensor,
    prompt_ids: Sequence[int] | torch.Tensor,
    *,
    max_new_tokens: int,
    eos_token_id: int | Sequence[int] | None,
    suppress_token_ids: Sequence[int] = (),
    sampler: Sampler | None = None,
    vision: Mapping[str, torch.Tensor] | None = None,
) -> SpecResult:
    """Speculative decoding of one prompt with a DFlash drafter (batch 1, KV caches): greedy, or
    sampled with `sampler` (T > 0); `vision`: an image prompt's inputs."""
    max_context = len(prompt_ids) + max_new_tokens + drafter_config.drafts_per_block + 1
    block_drafter = DFlashBlockDrafter(
        drafter, drafter_config, embed_weight, lm_head_weight, max_context=max_context
    )
    return speculative_decode(
        target,
        block_drafter,
        prompt_ids,
        layer_ids=drafter_config.target_layer_ids,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,
        suppress_token_ids=suppress_token_ids,
        sampler=sampler,
        vision=vision,
    )
