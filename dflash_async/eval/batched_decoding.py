"""Batched greedy and speculative decoding: many prompts at once, each row at its own length.

The reference decoder (speculative.py) runs one prompt with HF's growing DynamicCache and crops
it after every rejection. Here a batch of b prompts shares static-shape buffers and every row
keeps its own committed length `length[b]` (a device tensor), so rows accept different numbers
of drafts in the same verify forward:

    SlottedKVCache   target KV [b, Hkv, S, hd] per layer (keys and values may differ in hd:
                     MLA); a forward of n tokens writes row b's keys at slots length[b]..length[b]+n-1 (scatter), and a row's queries see
                     slots <= their own position (a [b, 1, n, S] mask). Slot index == position, so
                     rejected drafts need no crop: they sit past `length` (invisible) and the next
                     block overwrites them.
    RowsBlockDrafter the drafter's context KV [b, Hkv, S, hd] per layer, written the same way;
                     a block at anchor position p sees context slots < p and its own B slots;
                     its drafts are selector.py's (unary argmax, or the DFlash2 selector walk).
    BatchedDecode    prefill (right-padded prompts, in row chunks), then verify steps: draft,
                     verify, accepted = leading matches (cumprod), commit accepted+1 tokens per
                     live row, advance its length; finished rows (eos, max_new_tokens) ride along
                     without advancing. `draft=None` gives plain greedy decoding (blocks of 1),
                     the baseline, with its runner-up and margin per token.

Shapes never change between steps (b, B, S fixed) and a step has no host sync inside (the host
only learns, after it, whether all rows are done): a verify step could be captured as a CUDA
graph; it is not captured yet (eager launches). Dense (attention-only) targets with sdpa or
eager attention only: hybrids go through the reference decoder.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from dflash_async.eval.block_masks import layer_masks
from dflash_async.eval.lossless import GreedyResult, SpecResult, cut_at_stop
from dflash_async.eval.recompute import decodes_by_recompute
from dflash_async.eval.selector import draft_confidence, draft_tokens
from dflash_async.eval.speculative import cache_kwarg, captured_layers
from dflash_async.model.drafter import DFlashDrafter, apply_rope, rope_cos_sin
from dflash_async.model.drafter_config import DrafterConfig
from dflash_async.targets.loading import is_hybrid, text_config, text_model

_MASKED_LAYER_TYPES = {"full_attention", "sliding_attention"}
ALTERNATIVES = 3  # the target's next choices kept per greedy token (numerical-tie check)


def batched_unsupported_reason(target: PreTrainedModel) -> str | None:
    """Why `target` cannot use the batched decoder (None: it can)."""
    if decodes_by_recompute(target):
        return "its family decodes by recomputation (no cache rule: eval/recompute.py)"
    if is_hybrid(target):
        return "linear-attention layers (their state cannot be written per row)"
    implementation = text_config(target)._attn_implementation
    if implementation not in ("sdpa", "eager"):
        return f"attention implementation {implementation!r} takes no custom mask"
    other = set(getattr(text_config(target), "layer_types", None) or ()) - _MASKED_LAYER_TYPES
    return f"layer types {sorted(other)}" if other else None


def cache_capacity(prompts: Sequence[Sequence[int]], max_new_tokens: int, block_size: int) -> int:
    """Slots a batch can fill: a row's last verify step writes B slots from its last committed
    position (< prompt + max_new_tokens). Rounded up to 64: aligned mask rows keep SDPA on its
    fused masked kernels."""
    return -(-(max(map(len, prompts)) + max_new_tokens + block_size) // 64) * 64


class SlottedKVCache(Cache):
    """Static KV cache with a write offset per row (see the module doc). Set `write_at` [b] and
    `rows` before each forward; layers are allocated on their first update."""

    def __init__(self, *, batch: int, capacity: int) -> None:
        super().__init__(layers=[])
        self.batch, self.capacity = batch, capacity
        self.keys: dict[int, torch.Tensor] = {}  # layer -> [b, Hkv, S, hd]
        self.values: dict[int, torch.Tensor] = {}
        self.write_at = torch.zeros(batch, dtype=torch.long)
        self.rows = slice(0, batch)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # Keys and values may differ in head_dim: MLA (DeepSeek-V3) caches keys of
        # qk_nope+qk_rope and values of v_head_dim per head, so each gets its own shape.
        if layer_idx not in self.keys:
            self.keys[layer_idx] = self._buffer(key_states)
            self.values[layer_idx] = self._buffer(value_states)
        keys, values = self.keys[layer_idx][self.rows], self.values[layer_idx][self.rows]
        keys.scatter_(2, self._slots(key_states), key_states)  # views: writes land in the cache
        values.scatter_(2, self._slots(value_states), value_states)
        return keys, values

    def _buffer(self, states: torch.Tensor) -> torch.Tensor:
        return states.new_zeros(self.batch, states.shape[1], self.capacity, states.shape[3])

    def _slots(self, states: torch.Tensor) -> torch.Tensor:
        """The scatter index of a write of `states` [rows, H, n, hd] at each row's offset."""
        n = states.shape[2]
        slots = self.write_at[self.rows, None] + torch.arange(n, device=states.device)
        return slots[:, None, :, None].expand(-1, states.shape[1], n, states.shape[3])

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.capacity


def _target_masks(target: PreTrainedModel, positions: torch.Tensor, capacity: int, dtype):
    """The attention masks of a forward whose row b has queries at `positions[b]` [b, n]: slot s
    is visible iff s <= position (and within the sliding window for sliding layers). A config
    with a sliding_window but no layer_types (Mistral) slides in every layer, as HF's does."""
    cfg = text_config(target)
    layer_types = getattr(cfg, "layer_types", None) or ()
    slots = torch.arange(capacity, device=positions.device)
    visible = slots[None, None, :] <= positions[:, :, None]  # [b, n, S]
    masks = {"full_attention": visible[:, None]}
    window = getattr(cfg, "sliding_window", None)
    if "sliding_attention" in layer_types or (window and not layer_types):
        inside = slots[None, None, :] > positions[:, :, None] - window
        masks["sliding_attention"] = (visible & inside)[:, None]
    if cfg._attn_implementation == "eager":  # eager ADDS the mask (DFLASH.md known bug 6)
        low = torch.finfo(dtype).min
        masks = {k: m.new_zeros((), dtype=dtype).masked_fill(~m, low) for k, m in masks.items()}
    if layer_types:
        return masks
    return masks["sliding_attention"] if window else masks["full_attention"]


class RowsBlockDrafter:
    """A DFlashDrafter with a per-row context KV cache: the batched DFlashBlockDrafter."""

    def __init__(
        self,
        drafter: DFlashDrafter,
        config: DrafterConfig,
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor,
        *,
        batch: int,
        capacity: int,
    ) -> None:
        self.drafter, self.config = drafter, config
        self.embed_weight, self.lm_head_weight = embed_weight, lm_head_weight
        shape = (batch, config.num_key_value_heads, capacity, config.head_dim)
        weight = drafter.fc.weight
        self.keys = [weight.new_zeros(shape) for _ in drafter.layers]  # [b, Hkv, S, hd]
        self.values = [weight.new_zeros(shape) for _ in drafter.layers]

    @torch.no_grad()
    def extend_context(
        self, features: torch.Tensor, positions: torch.Tensor, rows: slice = slice(None)
    ) -> None:
        """Write features [r, n, k*d] of tokens at positions [r, n] into the context slots of
        `rows` (r rows of the batch)."""
        hd, device = self.config.head_dim, self.keys[0].device
        context = self.drafter.fuse(features.to(device))  # [b, n, d]
        positions = positions.to(device)
        cos, sin = rope_cos_sin(positions.flatten(), hd, self.config.rope_theta, context.dtype)
        index = positions[:, None, :, None].expand(-1, self.keys[0].shape[1], -1, hd)
        for layer, keys, values in zip(self.drafter.layers, self.keys, self.values, strict=True):
            attn = layer.self_attn  # same math as DraftAttention's context keys/values
            k = attn.k_norm(attn.k_proj(context).unflatten(-1, (-1, hd)))  # [b, n, Hkv, hd]
            k = apply_rope(k.flatten(0, 1).transpose(0, 1), cos, sin)  # [Hkv, b*n, hd]
            v = attn.v_proj(context).unflatten(-1, (-1, hd))  # [b, n, Hkv, hd]
            keys[rows].scatter_(2, index, k.unflatten(1, positions.shape).transpose(0, 1))
            values[rows].scatter_(2, index, v.transpose(1, 2))

    @torch.no_grad()
    def draft(self, anchors: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Drafts [b, B-1] for blocks [anchor, MASK x (B-1)] at anchor positions [b]: the unary
        argmax, or a DFlash2 drafter's selector walk (selector.py)."""
        hidden = self.block_hidden(anchors, positions)
        drafts = draft_tokens(self.drafter, hidden, self.lm_head_weight, anchors)
        # [b, n] predicted acceptances of these drafts, or None (the kind has no confidence head)
        self.confidence = draft_confidence(self.drafter, hidden, drafts, anchors)
        return drafts

    def block_logits(self, anchors: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Unary logits [b, B-1, V] of block slots 1..B-1."""
        lm_head = self.lm_head_weight
        return self.block_hidden(anchors, positions).to(lm_head.device, lm_head.dtype) @ lm_head.T

    @torch.no_grad()
    def block_hidden(self, anchors: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Drafter states [b, B-1, d] of block slots 1..B-1; row b sees context < positions[b]."""
        cfg, embed, b = self.config, self.embed_weight, anchors.shape[0]
        block = torch.full((b, cfg.block_size), cfg.mask_token_id, device=embed.device)
        block[:, 0] = anchors.to(embed.device)
        device = self.keys[0].device
        block_embeds = embed[block].flatten(0, 1).to(device)  # [b*B, d]
        slot = torch.arange(cfg.block_size, device=device)
        block_positions = (positions.to(device)[:, None] + slot).flatten()  # [b*B]
        capacity = self.keys[0].shape[2]
        context_visible = (
            torch.arange(capacity, device=device)[None] < positions.to(device)[:, None]
        )
        plain = torch.cat([context_visible, context_visible.new_ones(b, cfg.block_size)], dim=1)
        masks = layer_masks(
            cfg.attention_rules(), positions.to(device), slots=capacity, block_size=cfg.block_size
        )  # None: a full bidirectional layer, the plain mask
        masks = [plain[:, None, None] if m is None else m for m in masks]
        layers = iter(zip(self.keys, self.values, masks, strict=True))

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            context_k, context_v, mask = next(layers)  # the drafter calls attend once per layer
            rows = lambda x: x[0].unflatten(1, (b, -1)).transpose(0, 1)  # noqa: E731  [b, H, B, hd]
            k = torch.cat([context_k, rows(k)], dim=2)  # [b, Hkv, S+B, hd]
            v = torch.cat([context_v, rows(v)], dim=2)
            out = F.scaled_dot_product_attention(
                rows(q), k, v, attn_mask=mask, enable_gqa=True
            )  # [b, H, B, hd]
            return out.transpose(0, 1).flatten(1, 2)[None]  # [1, H, b*B, hd]

        no_features = block_embeds.new_zeros(0, cfg.num_features * cfg.hidden_size)
        hidden = self.drafter(
            block_embeds, block_positions, no_features, block_positions[:0], attend
        )
        assert next(layers, None) is None, "the drafter skipped a layer's attention"
        first = cfg.block_size - cfg.drafts_per_block  # the first slot that drafts
        return hidden.unflatten(0, (b, cfg.block_size))[:, first:]  # [b, drafts, d]


class BatchedDecode:
    """Greedy (draft=None) or speculative decoding of one batch of prompts; call `advance()`
    until it returns True, then `results()`. Lifecycle: one batch."""

    def __init__(
        self,
        target: PreTrainedModel,
        prompts: Sequence[Sequence[int]],
        *,
        draft: RowsBlockDrafter | None,  # or any object with its draft/extend_context
        layer_ids: Sequence[int],
        max_new_tokens: int,
        eos: frozenset[int],
        suppress: Sequence[int],
        prefill_tokens: int = 16384,
    ) -> None:
        self.target, self.draft, self.layer_ids = target, draft, tuple(layer_ids)
        self.decoder, self.lm_head = text_model(target), target.get_output_embeddings()
        device = self.lm_head.weight.device
        self.device, self.max_new, self.eos_set = device, max_new_tokens, eos
        self.block = 1 if draft is None else draft.config.drafts_per_block + 1
        b, longest = len(prompts), max(len(p) for p in prompts)
        self.capacity = cache_capacity(prompts, max_new_tokens, self.block)
        self.prompts = torch.zeros(b, longest, dtype=torch.long)
        for i, p in enumerate(prompts):
            self.prompts[i, : len(p)] = torch.as_tensor(list(p), dtype=torch.long)
        self.host_lengths = [len(p) for p in prompts]
        self.prompt_lengths = torch.tensor(self.host_lengths, device=device)
        self.cache = SlottedKVCache(batch=b, capacity=self.capacity)
        self.cache.write_at = self.cache.write_at.to(device)
        self.eos = torch.tensor(sorted(eos), dtype=torch.long, device=device)
        self.suppress = torch.tensor(sorted(suppress), dtype=torch.long, device=device)
        rows_per_chunk = max(1, prefill_tokens // longest)
        self.pending = [slice(i, min(b, i + rows_per_chunk)) for i in range(0, b, rows_per_chunk)]
        width = max_new_tokens + self.block
        self.tokens = torch.zeros(b, width, dtype=torch.long, device=device)
        # The target's next choices after each greedy token and their logit gaps to it: a
        # speculative token that differs but is one of them, within rounding, is a tie.
        self.alternatives = torch.zeros(b, width, ALTERNATIVES, dtype=torch.long, device=device)
        self.gaps = torch.zeros(b, width, ALTERNATIVES, device=device)
        self.length = self.prompt_lengths.clone()  # committed tokens in the caches
        self.count = torch.zeros(b, dtype=torch.long, device=device)  # new tokens committed
        self.anchor = torch.zeros(b, dtype=torch.long, device=device)  # newest, not yet cached
        self.done = torch.zeros(b, dtype=torch.bool, device=device)
        self.accepted_log: list[torch.Tensor] = []  # [b] per step: accepted+1, 0 = finished row
        self.confidence_log: list[torch.Tensor] = []  # [b, n] per step: predicted acceptances

    def _forward(self, ids: torch.Tensor, rows: slice, start: torch.Tensor):
        """Target forward of ids [r, n] at positions start[r]+j -> (hidden [r, n, d] after the
        final norm, features [r, n, k*d])."""
        positions = start[:, None] + torch.arange(ids.shape[1], device=self.device)
        self.cache.rows, self.cache.write_at[rows] = rows, start
        masks = _target_masks(self.target, positions, self.capacity, self.lm_head.weight.dtype)
        with captured_layers(self.target, self.layer_ids) as outputs:
            out = self.decoder(
                input_ids=ids.to(self.device),
                attention_mask=masks,
                position_ids=positions,
                use_cache=True,
                **{cache_kwarg(self.decoder): self.cache},
            )
            captured = [outputs[i] for i in self.layer_ids]
        features = torch.cat(captured, dim=-1) if captured else None
        return out.last_hidden_state, features

    def _choose(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Greedy token [...], the next ALTERNATIVES choices [..., K] and their logit gaps to it
        [..., K] (>= 0) from hidden [..., d]; suppressed ids excluded."""
        logits = self.lm_head(hidden).float()
        if self.suppress.numel():
            logits = logits.index_fill(-1, self.suppress, float("-inf"))
        token = logits.argmax(-1)
        best = logits.gather(-1, token[..., None])
        others = logits.scatter(-1, token[..., None], float("-inf")).topk(ALTERNATIVES, dim=-1)
        return token, others.indices, best - others.values

    def _prefill(self, rows: slice) -> None:
        lengths = self.prompt_lengths[rows]
        ids = self.prompts[rows, : max(self.host_lengths[rows])]  # [r, P] right-padded
        start = torch.zeros_like(lengths)
        hidden, features = self._forward(ids, rows, start)
        last = hidden.gather(1, (lengths - 1)[:, None, None].expand(-1, 1, hidden.shape[-1]))
        token, alternatives, gaps = self._choose(last[:, 0])
        self.anchor[rows], self.tokens[rows, 0] = token, token
        self.alternatives[rows, 0], self.gaps[rows, 0] = alternatives, gaps
        self.count[rows] = 1
        if self.draft is not None:
            positions = torch.arange(ids.shape[1], device=self.device).expand(ids.shape[0], -1)
            self.draft.extend_context(features, positions, rows)
        if not self.pending:
            self.done = torch.isin(self.tokens[:, 0], self.eos) | (self.count >= self.max_new)

    @torch.no_grad()
    def advance(self) -> bool:
        """Run the next prefill chunk or verify step; True when every row is finished."""
        if self.pending:
            self._prefill(self.pending.pop(0))
        else:
            self._step()
        # Sync point: one flag per call decides whether the caller asks for another step.
        return not self.pending and bool(self.done.all())

    def _step(self) -> None:
        every = slice(0, self.anchor.shape[0])
        if self.draft is None:
            block = self.anchor[:, None]  # [b, 1]
        else:
            drafts = self.draft.draft(self.anchor, self.length).to(self.device)  # [b, B-1]
            confidence = getattr(self.draft, "confidence", None)  # a confidence head's
            if confidence is not None:
                self.confidence_log.append(confidence.float())
            block = torch.cat([self.anchor[:, None], drafts], dim=1)  # [b, B]
        hidden, features = self._forward(block, every, self.length)
        verified, alternatives, gaps = self._choose(hidden)  # [b, B], [b, B, K], [b, B, K]
        if self.draft is None:
            accepted = torch.zeros_like(self.length)
        else:
            match = (block[:, 1:] == verified[:, :-1]).long()
            accepted = match.cumprod(dim=1).sum(dim=1)  # [b] leading drafts the target agrees with
            slot = torch.arange(self.block, device=self.device)
            self.draft.extend_context(features, self.length[:, None] + slot)
        self._commit(verified, alternatives, gaps, accepted)

    def _commit(self, verified, alternatives, gaps, accepted) -> None:
        """Append t_0..t_accepted of every live row; finished rows stay as they are."""
        live = ~self.done
        commit = (accepted + 1) * live  # [b] tokens committed now
        slot = torch.arange(verified.shape[1], device=self.device)
        write = slot[None] < commit[:, None]  # [b, B]
        index = (self.count[:, None] + slot).clamp(max=self.tokens.shape[1] - 1)
        self.tokens.scatter_(1, index, torch.where(write, verified, self.tokens.gather(1, index)))
        wide, write_wide = index[..., None].expand_as(gaps), write[..., None]  # [b, B, K]
        for buffer, new in ((self.alternatives, alternatives), (self.gaps, gaps)):
            buffer.scatter_(1, wide, torch.where(write_wide, new, buffer.gather(1, wide)))
        newest = verified.gather(1, accepted[:, None])[:, 0]
        self.anchor = torch.where(live, newest, self.anchor)
        self.length += commit
        self.count += commit
        stopped = (torch.isin(verified, self.eos) & write).any(dim=1)
        self.done = self.done | stopped | (self.count >= self.max_new)
        self.accepted_log.append(commit)

    def _rows_on_host(self) -> tuple[list[list[int]], list[int]]:
        # Sync point: the results come to the host once, at the end of the batch.
        counts = self.count.tolist()
        tokens = [row[:n] for row, n in zip(self.tokens.tolist(), counts, strict=True)]
        return tokens, counts

    def results(self) -> list[GreedyResult] | list[SpecResult]:
        """Per prompt, in order: GreedyResult (draft=None) or SpecResult."""
        return self._greedy_results() if self.draft is None else self._spec_results()

    def _spec_results(self) -> list[SpecResult]:
        tokens, _ = self._rows_on_host()
        log = torch.stack(self.accepted_log, dim=1).tolist() if self.accepted_log else None
        confidence = None
        if self.confidence_log and len(self.confidence_log) == len(self.accepted_log):
            confidence = torch.stack(self.confidence_log, dim=1).tolist()  # [b, steps, n]
        return [
            SpecResult(
                cut_at_stop(row, self.max_new, self.eos_set),
                [n for n in log[i] if n] if log else [],
                [c for c, n in zip(confidence[i], log[i], strict=True) if n] if confidence else [],
            )
            for i, row in enumerate(tokens)
        ]

    def _greedy_results(self) -> list[GreedyResult]:
        tokens, _ = self._rows_on_host()
        alternatives, gaps = self.alternatives.tolist(), self.gaps.tolist()
        results = []
        for i, row in enumerate(tokens):
            kept = len(cut_at_stop(row, self.max_new, self.eos_set))
            alts, alt_gaps = alternatives[i][:kept], gaps[i][:kept]
            results.append(
                GreedyResult(
                    row[:kept], [a[0] for a in alts], [g[0] for g in alt_gaps], alts, alt_gaps
                )
            )
        return results
