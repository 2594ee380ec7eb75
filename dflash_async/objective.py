"""The DFlash training objective for one packed batch: anchors, blocks, mask, labels, weights, loss.

For a batch in the fixed layout (packing.PackedBatch) and A anchors:
- block j is `[x[a_j], MASK, ..., MASK]` at positions `pos[a_j] + k`, k = 0..B-1;
- slot k predicts x[a_j + k] (same-position labels; slot 0 is the anchor and is not trained);
- w[j,k] = valid_j * (k>0) * (a_j+k in the document) * loss_mask[a_j+k] * exp(-(k-1)/gamma);
- the objective returns SUMS (weighted CE, weights, metric counts) rather than a ratio: the loss of
  an optimizer step is sum(w*CE)/sum(w) over every block of every drafter GPU (DFLASH.md s.4).

Everything here is fixed-shape and sync-free: hyper-parameters are fixed when the objective is
built, per-step inputs are tensors, no op reads device data on the host. The lm_head over the
A*(B-1) trained slots x vocab is never materialised at once: CE runs in chunks under activation
checkpointing (one chunk of logits alive at a time, recomputed in backward).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dflash_async.attention import dense_rule_mask, flex_attend, flex_block_mask, sdpa_attend
from dflash_async.drafter import DFlashDrafter
from dflash_async.packing import PackedBatch

# DFLASH.md s.4: the decay of the loss weight along the block, per block size.
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
    flex_tile: int = 128  # flex BlockMask tile; T and A*B must be multiples of it


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

    def __add__(self, other: StepSums) -> StepSums:  # type: ignore[override]
        return StepSums(*(a + b for a, b in zip(self, other, strict=True)))


def step_metrics(sums: StepSums) -> dict[str, torch.Tensor]:
    """loss, acc and the acceptance proxy tau_hat (DFLASH.md s.4), still on the device."""
    return {
        "loss": sums.ce_sum / sums.weight_sum.clamp_min(1e-12),
        "acc": sums.correct / sums.supervised.clamp_min(1),
        "tau_hat": 1 + sums.accepted / sums.blocks.clamp_min(1),
    }


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
    keys = torch.rand(T, generator=generator, device=device)
    by_key = keys.argsort()
    doc_key = torch.where(cand, doc_ids, T)[by_key]  # non-candidates sort last
    order = by_key[doc_key.argsort(stable=True)]  # candidates by (doc, random key), then the rest
    count = cand.sum()  # C, stays on the device
    slots = torch.arange(A, device=device, dtype=torch.float64)
    offset = torch.rand((), generator=generator, device=device, dtype=torch.float64)
    spaced = ((slots + offset) * count / A).floor().long()  # C >= A: A distinct picks
    index = torch.where(count >= A, spaced, slots.long())  # C < A: take every candidate
    valid = index < count
    positions = torch.where(valid, order[index.clamp(max=T - 1)], T)
    positions = positions.sort().values  # valid ones ascending; invalid (= T) last
    return Anchors(torch.where(valid, positions, 0), valid)


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
        self.flex_fn = flex_fn
        B = config.block_size
        decay = torch.tensor([0.0] + [math.exp(-(k - 1) / config.gamma) for k in range(1, B)])
        self.register_buffer("decay", decay, persistent=False)  # [B]; slot 0 never trained

    def _attend(self, batch: PackedBatch, anchors: Anchors):
        B = self.config.block_size
        if self.config.attention == "flex":
            mask = flex_block_mask(
                batch.doc_ids, anchors.positions, anchors.valid, B, self.config.flex_tile
            )
            return flex_attend(mask, self.flex_fn)
        return sdpa_attend(dense_rule_mask(batch.doc_ids, anchors.positions, anchors.valid, B))

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
        weights = supervised * self.decay.to(batch.features.device)  # decay[0] = 0
        tokens = torch.where(slot == 0, batch.input_ids[a][:, None], self.config.mask_token_id)
        positions = batch.position_ids[a][:, None] + slot
        return tokens, positions, batch.input_ids[target], weights

    def _hidden(self, batch: PackedBatch, anchors: Anchors, tokens, positions) -> torch.Tensor:
        """Drafter output norm(x) for every block slot, [A, B, d]."""
        embeds = F.embedding(tokens.flatten(), self.embed_weight)  # [Q, d]
        hidden = self.drafter(
            embeds,
            positions.flatten(),
            batch.features,
            batch.position_ids,
            self._attend(batch, anchors),
        )
        return hidden.view(*tokens.shape, -1)

    def forward(self, batch: PackedBatch, anchors: Anchors) -> StepSums:
        tokens, positions, labels, weights = self._blocks(batch, anchors)
        hidden = self._hidden(batch, anchors, tokens, positions)
        # slot 0 (the anchor) is never trained: decode slots 1..B-1 only
        ce, correct_pred = chunked_cross_entropy(
            hidden[:, 1:].flatten(0, 1),
            self.lm_head_weight,
            labels[:, 1:].flatten(),
            self.config.ce_chunk_size,
        )  # [A*(B-1)] each
        w = weights[:, 1:].flatten()
        trained = w > 0
        # select, never multiply by 0: a non-finite CE at an untrained slot must not leak in
        ce_sum = torch.where(trained, w * ce, 0.0).sum()
        hit = (correct_pred & trained).view(-1, self.config.block_size - 1)  # [A, B-1]
        accepted = hit.long().cumprod(dim=1).sum()  # a miss or an untrained slot ends the run
        return StepSums(
            ce_sum=ce_sum,
            weight_sum=w.sum(),
            correct=hit.sum(),
            supervised=trained.sum(),
            accepted=accepted,
            blocks=anchors.valid.sum(),
        )

    @torch.no_grad()
    def block_logits(self, batch: PackedBatch, anchors: Anchors) -> torch.Tensor:
        """Full logits [A, B, V] (tests and small shapes only: materialises A*B x vocab)."""
        tokens, positions, _, _ = self._blocks(batch, anchors)
        hidden = self._hidden(batch, anchors, tokens, positions)
        return hidden @ self.lm_head_weight.to(hidden.dtype).T


def _ce_chunk(
    hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = (hidden @ lm_head_weight.to(hidden.dtype).T).float()  # [c, V]
    ce = F.cross_entropy(logits, labels, reduction="none")
    return ce, logits.argmax(-1) == labels


def chunked_cross_entropy(
    hidden: torch.Tensor,  # [N, d]
    lm_head_weight: torch.Tensor,  # [V, d]
    labels: torch.Tensor,  # [N]
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position CE [N] and argmax==label [N], one [chunk, V] block of logits at a time.

    Each chunk runs under non-reentrant activation checkpointing: only `hidden` is saved, the
    logits are recomputed in backward. The chunk count is static (N and chunk_size are fixed).
    """
    ces, hits = [], []
    for start in range(0, hidden.shape[0], chunk_size):
        h, y = hidden[start : start + chunk_size], labels[start : start + chunk_size]
        if torch.is_grad_enabled() and h.requires_grad:
            ce, hit = checkpoint(_ce_chunk, h, lm_head_weight, y, use_reentrant=False)
        else:
            ce, hit = _ce_chunk(h, lm_head_weight, y)
        ces.append(ce)
        hits.append(hit)
    return torch.cat(ces), torch.cat(hits)
