"""Greedy speculative decoding with a DFlash drafter, checked against plain greedy decoding.

The algorithm that measures acceptance length (tau, docs/DFLASH.md section 8; the harness that
runs it over prompts is evaluate.py). Batch 1, greedy, KV caches on both sides:

    prefill: the target runs the prompt (HF DynamicCache) and its captured layers become the
             drafter's context; the target's next token is the first committed token.
    loop:    the drafter fills [last committed token, MASK x (B-1)] at positions pos..pos+B-1,
             seeing every committed token's features (all at positions < pos) and its own block;
             the target verifies the block in one forward: t_i = its argmax after block token i.
             accepted = leading drafts with d_{i+1} == t_i; commit t_0..t_accepted (the accepted
             drafts ARE the target's tokens, t_accepted is the bonus token), record accepted+1,
             crop the target cache to the committed tokens and append their features (block
             rows 0..accepted) to the drafter's context cache.

Every committed token is the target's own argmax given the committed prefix, so the output equals
plain greedy decoding up to floating point: a verify pass over B tokens and a one-token step run
different kernels, and where the target's top two logits are within rounding of each other the
two runs may pick different tokens. `check_lossless` raises LosslessError on a difference unless
the first difference is such a tie (greedy's runner-up, margin <= tie_tolerance_for(dtype)); the
caller counts ties (`numerical_ties`), since the rest of that sample legitimately differs.

The last step may commit past `max_new_tokens`; its accepted length is recorded as drafted (it
measures the drafter), the output is cut. Each step syncs the host once (the accept decision).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, PreTrainedModel

from dflash_async.model.drafter import DFlashDrafter, apply_rope, rope_cos_sin
from dflash_async.model.drafter_config import DrafterConfig
from dflash_async.target.loading import decoder_layers

# Largest |logit(greedy) - logit(runner-up)| at which a divergence counts as a numerical tie.
_TIE_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4, torch.bfloat16: 0.5, torch.float16: 0.1}


class LosslessError(RuntimeError):
    """Speculative decoding produced a token that plain greedy decoding of the target did not."""


@dataclass(frozen=True)
class SpecResult:
    tokens: list[int]  # new tokens (prompt excluded), cut after eos / max_new_tokens
    accepted_lengths: list[int]  # accepted drafts + 1 per verify step, each in 1..B

    @property
    def tau(self) -> float | None:
        """Mean committed tokens per verify step; None when no step ran (max_new_tokens=1)."""
        steps = len(self.accepted_lengths)
        return sum(self.accepted_lengths) / steps if steps else None


@dataclass(frozen=True)
class GreedyResult:
    tokens: list[int]  # new tokens, cut after eos / max_new_tokens
    runner_up: list[int]  # the target's second choice at each new token
    margins: list[float]  # logit(token) - logit(runner_up), >= 0


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
        """An `attend` for one block pass: layer i's call prepends layer i's cached context."""
        layers = iter(zip(self.keys, self.values, strict=True))

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            context_k, context_v = next(layers)  # the drafter calls attend once per layer, in order
            k = torch.cat([context_k[:, :, : self.length], k], dim=2)  # [1, Hkv, T+B, hd]
            v = torch.cat([context_v[:, :, : self.length], v], dim=2)
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        return attend, layers

    @torch.no_grad()
    def block_logits(self, anchor_token: int, anchor_position: int) -> torch.Tensor:
        """Logits [B-1, V] of block slots 1..B-1 for the block [anchor, MASK x (B-1)]."""
        cfg, embed, lm_head = self.config, self.embed_weight, self.lm_head_weight
        block = torch.full((cfg.block_size,), cfg.mask_token_id, device=embed.device)
        block[0] = anchor_token
        block_embeds = embed[block].to(self.keys[0].device)  # [B, d]
        positions = torch.arange(cfg.block_size, device=block_embeds.device) + anchor_position
        no_features = block_embeds.new_zeros(0, cfg.num_features * cfg.hidden_size)
        attend, unused = self._cached_attend()
        hidden = self.drafter(block_embeds, positions, no_features, positions[:0], attend)
        assert next(unused, None) is None, "the drafter skipped a layer's attention"
        return hidden[1:].to(lm_head.device, lm_head.dtype) @ lm_head.T  # [B-1, V]

    def draft(self, anchor_token: int, anchor_position: int) -> torch.Tensor:
        return self.block_logits(anchor_token, anchor_position).argmax(-1)  # [B-1]


@contextmanager
def captured_layers(target: PreTrainedModel, layer_ids: Sequence[int]) -> Iterator[dict[int, Any]]:
    """Forward hooks that keep the latest raw output of each layer in `layer_ids` (not the HF
    final-norm'd last hidden state: the same features TargetFeatures gives the trainer)."""
    outputs: dict[int, Any] = {}
    layers = decoder_layers(target)

    def keep(i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            outputs[i] = output[0] if isinstance(output, tuple) else output

        return hook

    handles = [layers[i].register_forward_hook(keep(i)) for i in layer_ids]
    try:
        yield outputs
    finally:
        for handle in handles:
            handle.remove()


def _cache_kwarg(target: PreTrainedModel) -> str:
    """transformers renamed `past_key_values` to `cache` during 5.x; accept both."""
    return _cache_kwarg_of(type(target))


@functools.cache
def _cache_kwarg_of(model_class: type) -> str:
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _crop(cache: DynamicCache, length: int) -> None:
    """Drop cached positions >= length. crop(-n) removes n in every 5.x (crop(0) differs)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def _suppressed(logits: torch.Tensor, suppress: torch.Tensor | None) -> torch.Tensor:
    return logits if suppress is None else logits.index_fill(-1, suppress, float("-inf"))


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where a and b differ (the shorter one's length if one is a prefix of the
    other); None if they are equal."""
    differ = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if differ is None and len(a) != len(b):
        return min(len(a), len(b))
    return differ


def _cut(tokens: list[int], max_new_tokens: int, eos: frozenset[int]) -> list[int]:
    """The generated tokens as plain greedy would return them: up to and including an eos."""
    tokens = tokens[:max_new_tokens]
    stop = next((i for i, t in enumerate(tokens) if t in eos), None)
    return tokens if stop is None else tokens[: stop + 1]


def eos_set(eos_token_id: int | Sequence[int] | None) -> frozenset[int]:
    """The stop tokens as a set: a generation config's eos_token_id may be None, an id or a list."""
    if eos_token_id is None:
        return frozenset()
    return frozenset([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)


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
) -> tuple[torch.Tensor, frozenset[int], torch.Tensor | None, DynamicCache]:
    """What both decoders start from: (prompt [1, P] on the target's device, eos ids, suppressed
    ids [S] or None, an empty target KV cache)."""
    device = next(target.parameters()).device
    prompt = _prompt_tensor(prompt_ids, device)
    suppress = _suppress_tensor(suppress_token_ids, device)
    return prompt, eos_set(eos_token_id), suppress, DynamicCache(config=target.config)


@torch.no_grad()
def greedy_generate(
    target: PreTrainedModel,
    prompt_ids: Sequence[int] | torch.Tensor,
    max_new_tokens: int,
    eos_token_id: int | Sequence[int] | None,
    *,
    suppress_token_ids: Sequence[int] = (),
) -> GreedyResult:
    """Plain greedy decoding with a KV cache, one token per target forward (the baseline)."""
    prompt, eos, suppress, cache = _decode_start(
        target, prompt_ids, eos_token_id, suppress_token_ids
    )
    cache_kw = _cache_kwarg(target)
    ids, tokens, runner_up, margins = prompt, [], [], []
    while len(tokens) < max_new_tokens and not eos.intersection(tokens[-1:]):
        out = target(input_ids=ids, **{cache_kw: cache}, use_cache=True, logits_to_keep=1)
        logits = _suppressed(out.logits[0, -1].float(), suppress)  # [V]
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
    out = target(
        input_ids=ids,
        **{_cache_kwarg(target): cache},
        use_cache=True,
        logits_to_keep=logits_to_keep,
    )
    features = torch.cat([outputs[i][0] for i in layer_ids], dim=-1)  # [n, k*d]
    return out.logits[0].float(), features


def _verify(
    target: PreTrainedModel,
    outputs: dict[int, Any],
    layer_ids: Sequence[int],
    cache: DynamicCache,
    block: torch.Tensor,  # [1, B]: the anchor, then the B-1 drafts
    suppress: torch.Tensor | None,
) -> tuple[int, list[int], torch.Tensor]:
    """The target's verdict on a block: (accepted drafts, the target's tokens t_0..t_accepted,
    features [B, k*d] of the block rows). t_i is the target's argmax after block token i."""
    logits, features = _target_step(target, outputs, layer_ids, block, cache, logits_to_keep=0)
    verified = _suppressed(logits, suppress).argmax(-1)  # [B]
    # Sync point: drafts and the target's tokens come to the host for the accept decision.
    both = torch.cat([block[0, 1:], verified]).tolist()
    drafted, target_tokens = both[: block.shape[1] - 1], both[block.shape[1] - 1 :]
    accepted = _first_difference(drafted, target_tokens[:-1])
    accepted = len(drafted) if accepted is None else accepted
    return accepted, target_tokens[: accepted + 1], features


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
) -> SpecResult:
    """Greedy speculative decoding of one prompt with any BlockDrafter (see the module doc)."""
    prompt, eos, suppress, cache = _decode_start(
        target, prompt_ids, eos_token_id, suppress_token_ids
    )
    device = prompt.device
    with captured_layers(target, layer_ids) as outputs:
        logits, features = _target_step(target, outputs, layer_ids, prompt, cache, logits_to_keep=1)
        position = prompt.shape[1]  # of the newest committed token: the next anchor
        drafter.extend_context(features, torch.arange(position, device=device))
        # Sync point: the first new token (the first anchor) is needed on the host.
        tokens = [int(_suppressed(logits[-1], suppress).argmax())]
        accepted_lengths: list[int] = []
        while len(tokens) < max_new_tokens and not eos.intersection(tokens):
            drafts = drafter.draft(tokens[-1], position).to(device)  # [B-1]
            block = torch.cat([torch.tensor([tokens[-1]], device=device), drafts])[None]  # [1, B]
            accepted, committed, features = _verify(
                target, outputs, layer_ids, cache, block, suppress
            )
            tokens += committed
            accepted_lengths.append(accepted + 1)
            new_positions = torch.arange(position, position + accepted + 1, device=device)
            _crop(cache, position + accepted + 1)  # keeps the anchor and the accepted drafts
            drafter.extend_context(features[: accepted + 1], new_positions)
            position += accepted + 1
    return SpecResult(_cut(tokens, max_new_tokens, eos), accepted_lengths)


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
) -> SpecResult:
    """Greedy speculative decoding of one prompt with a DFlash drafter (batch 1, KV caches)."""
    max_context = len(prompt_ids) + max_new_tokens + drafter_config.block_size
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
    )


def tie_tolerance_for(dtype: torch.dtype) -> float:
    """The numerical-tie margin for a target computing in `dtype` (0.5 for unknown dtypes)."""
    return _TIE_TOLERANCE.get(dtype, 0.5)


def check_lossless(
    index: int, greedy: GreedyResult, spec: SpecResult, tolerance: float
) -> int | None:
    """None if the outputs agree; the first differing position if it is a numerical tie; else
    LosslessError naming the sample and the position."""
    differ = _first_difference(greedy.tokens, spec.tokens)
    if differ is None:
        return None
    if differ < min(len(greedy.tokens), len(spec.tokens)):
        tie = (
            spec.tokens[differ] == greedy.runner_up[differ] and greedy.margins[differ] <= tolerance
        )
        if tie:
            return differ
        margin = f"greedy margin {greedy.margins[differ]:.3g}"
    else:
        margin = f"lengths {len(greedy.tokens)} vs {len(spec.tokens)}"
    raise LosslessError(
        f"sample {index}: speculative output differs from greedy at new token {differ} "
        f"({spec.tokens[differ : differ + 4]} vs {greedy.tokens[differ : differ + 4]}, {margin})"
    )
