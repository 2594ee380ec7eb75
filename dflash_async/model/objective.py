"""The DFlash training objective for one packed batch: anchors, blocks, mask, labels, weights, loss.

For a batch in the fixed layout (packing.PackedBatch) and A anchors:
- block j is `[x[a_j], MASK, ..., MASK]` at positions `pos[a_j] + k`, k = 0..B-1;
- slot k predicts x[a_j + k] (same-position labels; slot 0 is the anchor and is not trained);
- w[j,k] = valid_j * (k>0) * (a_j+k in the document) * loss_mask[a_j+k] * exp(-(k-1)/gamma);
- the objective returns SUMS (weighted CE, weights, metric counts) rather than a ratio: the loss of
  an optimizer step is sum(w*CE)/sum(w) over every block of every drafter GPU (docs/DFLASH.md s.4).

Everything here is fixed-shape and sync-free: hyper-parameters are fixed when the objective is
built, per-step inputs are tensors, no op reads device data on the host. The lm_head over the
A*(B-1) trained slots x vocab is never materialised at once: CE runs in chunks, and each chunk's
gradient is made in the forward pass (one chunk of logits alive at a time, nothing recomputed).
The drafter variants (docs/DFLASH.md s.10) plug in here: one mask per distinct layer rule (two at
most) and the logit transforms inside each CE chunk, as at inference (logit_transforms.py).
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dflash_async.data.packing import PackedBatch
from dflash_async.model.attention_rule import (
    FLASH_DTYPES,
    SDPA_QUERY_ROWS,
    FlexBackend,
    chunked_rule_attend,
    dense_rule_mask,
    flex_attend,
    flex_block_mask,
    resolve_flex_backend,
    sdpa_attend,
)
from dflash_async.model.chunked_ce import (  # re-exported: the objectives' CE
    ce_and_grad_from_logits,
    linear_weighted_cross_entropy,
)
from dflash_async.model.drafter import Attend, DFlashDrafter, compute_dtype
from dflash_async.model.layer_rules import AttentionRule
from dflash_async.model.logit_transforms import logit_transform_of
from dflash_async.model.step_ranges import step_range

# docs/DFLASH.md s.4: the decay gamma of the loss weight along the block, per block size.
DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    if block_size not in DEFAULT_GAMMA:
        raise ValueError(
            f"no default gamma for block_size={block_size} (known: {sorted(DEFAULT_GAMMA)}); set it"
        )
    return DEFAULT_GAMMA[block_size]


@dataclass(frozen=True)
class ObjectiveConfig:
    block_size: int
    num_anchors: int
    mask_token_id: int
    gamma: float
    ce_chunk_size: int = 2048  # trained slots per CE chunk: chunk x vocab fp32 logits alive at once
    attention: Literal["sdpa", "flex"] = "sdpa"
    # sdpa: block rows per attention call (attention_rule.chunked_rule_attend), whole blocks
    sdpa_query_rows: int = SDPA_QUERY_ROWS
    flex_tile: int = 128  # flex BlockMask tile; T and A*B must be multiples of it
    compile: bool = False  # torch.compile the CE elementwise work and the drafter layers (GPU)
    # flex_attention kernel_options (torch's FlexKernelOptions: tiles, USE_TMA, WRITE_DQ, ...),
    # as sorted (name, value) pairs; () = torch's defaults
    flex_kernel_options: tuple[tuple[str, bool | int | str], ...] = ()
    # flex_attention's kernels: torch's Triton ones or flash-attn-4's (FLASH backend); auto:
    # flash where it runs (attention.resolve_flex_backend)
    flex_backend: FlexBackend = "auto"
    flex_autotune: bool = False  # compile flex_attention with max-autotune (block-size search)
    # the CE chunk's elementwise pass: the hand-written Triton kernel of ce_kernel.py (GPU only),
    # or ce_and_grad_from_logits (torch.compile'd when `compile`); auto: Triton on a GPU
    ce_kernel: Literal["auto", "compiled", "triton"] = "auto"


class Anchors(NamedTuple):
    positions: torch.Tensor  # [A] int64: valid anchors first, ascending; invalid slots hold 0
    valid: torch.Tensor  # [A] bool


class StepSums(NamedTuple):
    """Every field is a sum over blocks (0-d tensors), so drafters and micro-batches add them."""

    ce_sum: torch.Tensor  # sum of w * CE; the only differentiable field
    weight_sum: torch.Tensor  # sum of w
    correct: torch.Tensor  # positions with w > 0 and argmax == label
    supervised: torch.Tensor  # positions with w > 0
    accepted: torch.Tensor  # sum over valid blocks of the accepted-prefix length
    blocks: torch.Tensor  # valid blocks
    # DFlash2's (its objective in model/kinds/); 0 for a DFlash drafter
    topk_hits: torch.Tensor  # positions with w > 0 whose label is in the unary top-k
    selector_correct: torch.Tensor  # of those, the selector's teacher-forced argmax is right


def anchor_multiple(block_size: int, tile: int) -> int:
    """The anchor counts the flex mask takes are the multiples of this: Q = A * B rows must fill
    whole tiles of `tile` rows (B = 16, tile 128: multiples of 8; B = 10: of 64)."""
    return tile // math.gcd(tile, block_size)


def pad_anchors(anchors: Anchors, multiple: int) -> Anchors:
    """`anchors` with invalid slots appended up to a multiple of `multiple` (position 0, not
    valid: no loss, no block keys, empty attention rows, not counted as blocks), so that any
    anchor count trains on flex; unchanged when it already is one. Fixed shapes: capturable."""
    missing = -anchors.positions.shape[0] % multiple
    if not missing:
        return anchors
    pad = anchors.positions.new_zeros(missing)
    return Anchors(torch.cat([anchors.positions, pad]), torch.cat([anchors.valid, pad.bool()]))


def anchor_candidates(loss_mask: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
    """[T] bool: p and p+1 both supervised and in the same document (padding never qualifies)."""
    cand = torch.zeros_like(loss_mask, dtype=torch.bool)
    cand[:-1] = loss_mask[:-1] & loss_mask[1:] & (doc_ids[:-1] == doc_ids[1:]) & (doc_ids[:-1] >= 0)
    return cand


def sample_anchors(
    loss_mask: torch.Tensor,  # [T] bool
    doc_ids: torch.Tensor,  # [T] int64, documents contiguous and ascending, -1 padding
    num_anchors: int,
    generator: torch.Generator | None = None,
    *,
    noise: torch.Tensor | None = None,
) -> Anchors:
    """Draw `num_anchors` anchors without replacement, spread over documents by candidate count.

    Systematic sampling over a random permutation: candidates are ordered by (document, random
    key), then every (C/A)-th of them is taken from a random offset. Each candidate is chosen with
    probability A/C exactly, documents get floor or ceil of A*c_d/C anchors, and within a document
    the chosen subset is uniformly random. With C <= A every candidate is taken and the remaining
    slots are invalid. Sync-free: sort, cumsum and gathers only.
    """
    T, A, device = loss_mask.shape[0], num_anchors, loss_mask.device
    cand = anchor_candidates(loss_mask, doc_ids)
    if noise is None:
        noise = torch.rand(T + 1, generator=generator, device=device, dtype=torch.float64)
    keys, offset = noise[:T], noise[T].to(torch.float64)
    by_key = keys.argsort()
    doc_key = torch.where(cand, doc_ids, T)[by_key]  # non-candidates sort last
    order = by_key[doc_key.argsort(stable=True)]  # candidates by (doc, random key), then the rest
    count = cand.sum()  # C, stays on the device
    slots = torch.arange(A, device=device, dtype=torch.float64)
    spaced = ((slots + offset) * count / A).floor().long()  # C >= A: A distinct picks
    index = torch.where(count >= A, spaced, slots.long())  # C < A: take every candidate
    valid = index < count
    positions = torch.where(valid, order[index.clamp(max=T - 1)], T)
    positions = positions.sort().values  # valid ones ascending; invalid (= T) last
    return Anchors(torch.where(valid, positions, 0), valid)


def compiled_flex_attention(*, autotune: bool = False):
    """flex_attention compiled (it is fast, and sync-free, only compiled; compiled at the first
    call). autotune: inductor's max-autotune searches the kernel's block sizes at that call
    (minutes, once per shape; without CUDA graphs of its own: the step captures its own)."""
    from torch.nn.attention.flex_attention import flex_attention

    mode = "max-autotune-no-cudagraphs" if autotune else None
    return torch.compile(flex_attention, dynamic=False, mode=mode)


class DFlashObjective(nn.Module):
    """Weighted block CE of a DFlash drafter on one packed batch; returns StepSums.

    `embed_weight` and `lm_head_weight` are the target's frozen tensors (the same tensor when tied);
    they are held as plain attributes, never registered as parameters or buffers of this module.
    """

    def __init__(
        self,
        config: ObjectiveConfig,
        drafter: DFlashDrafter,
        embed_weight: torch.Tensor,  # [V, d]
        lm_head_weight: torch.Tensor,  # [V, d]
        flex_fn=None,  # compiled flex_attention (GPU); None = eager
    ) -> None:
        super().__init__()
        self.config = config
        self.drafter = drafter
        self.embed_weight = embed_weight.detach()
        self.lm_head_weight = lm_head_weight.detach()
        if config.attention == "flex" and flex_fn is None and self.lm_head_weight.is_cuda:
            flex_fn = compiled_flex_attention(autotune=config.flex_autotune)
        self.flex_fn = flex_fn
        # resolved: "triton" or "flash" (_flex_options_for_this_call adds BACKEND for flash)
        self.flex_backend, self.flex_kernel_options = "triton", dict(config.flex_kernel_options)
        if config.attention == "flex":
            if "BACKEND" in self.flex_kernel_options:
                raise ValueError("choose flex_attention's backend with flex_backend, not BACKEND")
            tunes_triton = bool(self.flex_kernel_options) or config.flex_autotune
            self.flex_backend = resolve_flex_backend(
                config.flex_backend, device=self.lm_head_weight.device, tunes_triton=tunes_triton
            )
        self.ce_kernel = config.ce_kernel  # resolved: "triton" or "compiled"
        if self.ce_kernel == "auto":
            self.ce_kernel = "triton" if self.lm_head_weight.is_cuda else "compiled"
        if self.ce_kernel == "triton" and not self.lm_head_weight.is_cuda:
            raise ValueError("ce_kernel='triton' needs the lm_head on a CUDA device")
        self.ce_elementwise = self.ce_pass(
            reference=ce_and_grad_from_logits, triton="ce_and_grad_triton"
        )
        if config.compile:
            drafter.compile_layers()
        self.rules = drafter.config.attention_rules()  # one per layer
        self.logit_transform = logit_transform_of(drafter.config)
        B = config.block_size
        decay = [0.0] + [math.exp(-(k - 1) / config.gamma) for k in range(1, B)]
        # [B], on the step's device from the start (no host->device copy inside a captured step)
        self.decay = torch.tensor(decay, dtype=torch.float64, device=self.lm_head_weight.device)

    @property
    def anchor_multiple(self) -> int:
        """Anchor counts must be multiples of this (flex's tiles; 1 for sdpa): DrafterStep pads
        the sampled anchors up to one with invalid slots (pad_anchors)."""
        if self.config.attention != "flex":
            return 1
        return anchor_multiple(self.config.block_size, self.config.flex_tile)

    def ce_pass(
        self, *, reference: Callable, triton: str, kernel_module: str = "ce_kernel", **options
    ) -> Callable:
        """The CE chunk's elementwise pass for the resolved `self.ce_kernel`: the function named
        `triton` of kernels/`kernel_module`.py (imported only then: it needs triton), else
        `reference`, torch.compile'd where the config compiles; `options` are bound to either
        (both take the same keywords). One place for the choice, so that a subclass asking for a
        pass with more outputs (DFlash2's group maxima) or another loss (DSpark's) chooses it
        exactly as DFlash's is chosen."""
        if self.ce_kernel == "triton":
            # lazy: a kernel module needs triton
            kernels = importlib.import_module(f"dflash_async.kernels.{kernel_module}")
            return functools.partial(getattr(kernels, triton), **options)
        fn = functools.partial(reference, **options)
        return torch.compile(fn, dynamic=False) if self.config.compile else fn

    def _attend(self, batch: PackedBatch, anchors: Anchors) -> tuple[Attend, ...]:
        """One attend per drafter layer, one mask per distinct rule (full and sliding at most)."""
        made: dict[AttentionRule, Attend] = {}
        for rule in self.rules:
            if rule not in made:
                made[rule] = self._rule_attend(batch, anchors, rule)
        return tuple(made[rule] for rule in self.rules)

    def _rule_attend(self, batch: PackedBatch, anchors: Anchors, rule: AttentionRule) -> Attend:
        B, args = self.config.block_size, (batch.doc_ids, anchors.positions, anchors.valid)
        if self.config.attention == "flex":
            mask = flex_block_mask(*args, B, self.config.flex_tile, rule=rule)
            return flex_attend(mask, self.flex_fn, self._flex_options_for_this_call())
        if batch.doc_ids.is_cuda:  # the GPU reference: sync-free, so a CUDA graph may capture it
            return sdpa_attend(dense_rule_mask(*args, B, rule=rule))
        return chunked_rule_attend(*args, B, rule=rule, query_rows=self.config.sdpa_query_rows)

    def _flex_options_for_this_call(self) -> dict:
        """flex_attention's kernel options: BACKEND=FLASH where flash was resolved, except that
        flash-attn-4 takes bf16/fp16 only: attention in another dtype (fp32 on a GPU: tests and
        library use; the step runs under bf16 autocast) gets torch's Triton kernels under auto
        and an error under flash."""
        if self.flex_backend != "flash":
            return self.flex_kernel_options
        dtype = compute_dtype(self.drafter.fc.weight)  # q, k and v's dtype: metadata, no sync
        if dtype in FLASH_DTYPES:
            return {**self.flex_kernel_options, "BACKEND": "FLASH"}
        if self.config.flex_backend == "flash":
            raise ValueError(f"flex_backend='flash' runs bf16 or fp16 attention, not {dtype}")
        return self.flex_kernel_options

    def _blocks(self, batch: PackedBatch, anchors: Anchors):
        """Block tokens, positions, labels and weights, each [A, B]."""
        B, T = self.config.block_size, batch.num_tokens
        a, valid = anchors.positions, anchors.valid
        slot = torch.arange(B, device=a.device)
        target = a[:, None] + slot  # [A, B] row of the token slot k predicts
        inside = target < T
        target = target.clamp(max=T - 1)
        same_doc = inside & (batch.doc_ids[target] == batch.doc_ids[a][:, None])
        supervised = valid[:, None] & same_doc & batch.loss_mask[target]
        weights = supervised * self.decay  # decay[0] = 0: slot 0 never trained
        tokens = torch.where(slot == 0, batch.input_ids[a][:, None], self.config.mask_token_id)
        positions = batch.position_ids[a][:, None] + slot
        return tokens, positions, batch.input_ids[target], weights

    def _hidden(self, batch: PackedBatch, anchors: Anchors, tokens, positions) -> torch.Tensor:
        """Drafter output norm(x) for every block slot, [A, B, d]."""
        with step_range("features"):
            embeds = F.embedding(tokens.flatten(), self.embed_weight)  # [Q, d]
        with step_range("block_mask"):
            attend = self._attend(batch, anchors)
        hidden = self.drafter(
            embeds, positions.flatten(), batch.features, batch.position_ids, attend
        )
        return hidden.view(*tokens.shape, -1)

    def forward(self, batch: PackedBatch, anchors: Anchors) -> StepSums:
        tokens, positions, labels, weights = self._blocks(batch, anchors)
        hidden = self._hidden(batch, anchors, tokens, positions)
        # slot 0 (the anchor) is never trained: decode slots 1..B-1 only
        w = weights[:, 1:].flatten()  # [A*(B-1)]
        with step_range("lm_head_ce"):
            ce_sum, correct_pred = linear_weighted_cross_entropy(
                hidden[:, 1:].flatten(0, 1),
                self.lm_head_weight,
                labels[:, 1:].flatten(),
                w,
                self.config.ce_chunk_size,
                self.ce_elementwise,
                self.logit_transform,
            )
        trained = w > 0
        hit = (correct_pred & trained).view(-1, self.config.block_size - 1)  # [A, B-1]
        accepted = hit.long().cumprod(dim=1).sum()  # a miss or an untrained slot ends the run
        none = torch.zeros((), dtype=torch.long, device=w.device)  # no selector in DFlash
        return StepSums(
            ce_sum=ce_sum,
            weight_sum=w.sum(),
            correct=hit.sum(),
            supervised=trained.sum(),
            accepted=accepted,
            blocks=anchors.valid.sum(),
            topk_hits=none,
            selector_correct=none,
        )

    @torch.no_grad()
    def block_logits(self, batch: PackedBatch, anchors: Anchors) -> torch.Tensor:
        """Full logits [A, B, V] after the logit transforms (tests and small shapes only:
        materialises A*B x vocab)."""
        tokens, positions, _, _ = self._blocks(batch, anchors)
        hidden = self._hidden(batch, anchors, tokens, positions)
        logits = hidden @ self.lm_head_weight.to(hidden.dtype).T
        return logits if self.logit_transform.is_identity else self.logit_transform(logits)
