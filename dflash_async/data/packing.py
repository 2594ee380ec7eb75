"""Pack planning and the fixed drafter layout.

Every drafter step sees exactly one `PackedBatch` of `token_budget` rows (T): whole documents laid
end to end, then padding. Fixed shapes are what let a drafter thread capture its step once as a
CUDA graph and replay it (docs/DESIGN.md, "The fixed drafter layout").
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class PackedBatch:
    """One drafter step's inputs in the fixed layout. T = token budget, k*d = feature width.

    Documents are contiguous and in ascending `doc_ids` order; padding rows sit at the end with
    doc_id -1, loss_mask False and position 0. A padding row is never an anchor and never context.
    """

    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool: supervised (assistant) tokens
    doc_ids: torch.Tensor  # [T] int64, -1 for padding
    position_ids: torch.Tensor  # [T] int64, restarts at 0 in every document
    features: torch.Tensor  # [T, k*d] target hidden states of the layers in target_layer_ids

    FIELDS = ("input_ids", "loss_mask", "doc_ids", "position_ids", "features")

    @classmethod
    def empty(
        cls,
        token_budget: int,
        feature_dim: int,
        *,
        device: torch.device,
        feature_dtype: torch.dtype,
        pin_memory: bool = False,
    ) -> PackedBatch:
        """A batch of the fixed layout with every row padding (features zero: masked keys still
        multiply their values, so padding must be finite)."""
        kw: dict = {"device": device, "pin_memory": pin_memory}
        T = token_budget
        return cls(
            input_ids=torch.zeros(T, dtype=torch.int64, **kw),
            loss_mask=torch.zeros(T, dtype=torch.bool, **kw),
            doc_ids=torch.full((T,), -1, dtype=torch.int64, **kw),
            position_ids=torch.zeros(T, dtype=torch.int64, **kw),
            features=torch.zeros(T, feature_dim, dtype=feature_dtype, **kw),
        )

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, name) for name in self.FIELDS)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        return PackedBatch(*(t.to(device, non_blocking=non_blocking) for t in self.tensors()))

    def copy_(self, src: PackedBatch, *, with_features: bool = True) -> None:
        """Copy `src` into these tensors in place (same fixed shapes), asynchronously where it
        can be: on the calling thread's stream of the source's device for device copies."""
        names = self.FIELDS if with_features else self.FIELDS[:-1]
        for name in names:
            getattr(self, name).copy_(getattr(src, name), non_blocking=True)


# ---- the pack planner --------------------------------------------------------------------------
#
# plan_epoch is "sorted next-fit": shuffle, stable-sort by length (so equal lengths land in a
# different order every epoch), then cut the sorted run into consecutive packs, each taking
# samples while they fit the budget. A pack is left short by less than the length of the next
# sample, about half a typical sample: ~1% of a 49152-token budget for chat data of median ~700
# tokens (bench_packing measures it). Neighbours in sorted order have similar lengths, so the
# target's right-padded 2-D batches of a pack waste little. The packs are then shuffled so steps
# do not walk from short to long documents. Everything is numpy; 100k samples plan in ~10 ms.


@dataclass(frozen=True, order=True)
class PackCursor:
    """Where a run stands: pack `index` of epoch `epoch`'s plan is the next one to process."""

    epoch: int = 0
    index: int = 0

    def __post_init__(self) -> None:
        if self.epoch < 0 or self.index < 0:
            raise ValueError(f"{self} must have epoch >= 0 and index >= 0")

    def next(self) -> PackCursor:
        """The cursor after this pack (an index past the epoch's end rolls to the next epoch)."""
        return PackCursor(self.epoch, self.index + 1)

    def anchor_seed(self, seed: int, *, rank: int = 0, world_size: int = 1) -> int:
        """The seed of this pack's anchor noise: a pure function of (seed, epoch, the pack's
        index in the whole epoch's plan), so a pack gets the same anchors on whichever drafter
        or node trains it, in any run. `index` is rank `rank`'s share index (plan_epoch)."""
        index = self.index * world_size + rank  # share i of rank r is pack i*W + r of the plan
        digest = hashlib.blake2b(f"{seed}/{self.epoch}/{index}".encode(), digest_size=8)
        return int.from_bytes(digest.digest(), "little") >> 1  # < 2**63: a generator seed


def _checked_lengths(lengths: np.ndarray, token_budget: int) -> np.ndarray:
    lengths = np.asarray(lengths)
    if lengths.ndim != 1 or not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(
            f"lengths must be a 1-D integer array, got {lengths.dtype} {lengths.shape}"
        )
    if token_budget < 1:
        raise ValueError(f"token_budget={token_budget} must be >= 1")
    if len(lengths) and (lengths.min() < 1 or lengths.max() > token_budget):
        bad = int(np.flatnonzero((lengths < 1) | (lengths > token_budget))[0])
        raise ValueError(
            f"sample {bad} has {int(lengths[bad])} tokens; every sample needs 1..token_budget"
            f"={token_budget} tokens (lower data.max_len or raise train.token_budget)"
        )
    return lengths.astype(np.int64, copy=False)


def plan_epoch(
    lengths: np.ndarray,
    token_budget: int,
    seed: int,
    epoch: int,
    *,
    rank: int = 0,
    world_size: int = 1,
) -> list[np.ndarray]:
    """Packs (arrays of sample indices) holding every sample exactly once, whole documents only.

    Each pack's lengths sum to <= token_budget; inside a pack, indices ascend in length. The plan
    is a pure function of (lengths, token_budget, seed, epoch); with `world_size` > 1 this returns
    rank `rank`'s share of it (`shard_packs`), and the shares of all ranks are disjoint.

    Samples are taken in ascending length and cut into consecutive packs, so a pack holds
    similar lengths. A long sample (over half the budget: no two fit one pack) opens a pack of
    its own, and the room it leaves is filled with the shortest samples first (`_fill_long`):
    a 100k-token document in a 131072-token pack carries ~31k tokens of short documents instead
    of padding. Without long samples the plan is the plain ascending cut.
    """
    lengths = _checked_lengths(lengths, token_budget)
    rng = np.random.default_rng([seed, epoch])
    shuffled = rng.permutation(len(lengths))
    order = shuffled[np.argsort(lengths[shuffled], kind="stable")]  # ascending, ties shuffled
    long_packs, order = _fill_long(lengths, order, token_budget)
    cumulative = np.cumsum(lengths[order])  # [n]
    ends, filled = [], 0
    while (ends[-1] if ends else 0) < len(order):
        # First sample that would overflow this pack; >= 1 sample always fits (checked above).
        end = int(np.searchsorted(cumulative, filled + token_budget, side="right"))
        ends.append(end)
        filled = int(cumulative[end - 1])
    packs = (np.split(order, ends[:-1]) if ends else []) + long_packs
    return shard_packs([packs[i] for i in rng.permutation(len(packs))], rank, world_size)


def _fill_long(
    lengths: np.ndarray, order: np.ndarray, token_budget: int
) -> tuple[list[np.ndarray], np.ndarray]:
    """(packs of the long samples, the samples left), `order` ascending in length. Each sample
    longer than token_budget // 2, longest first, gets a pack, topped up with the shortest
    samples left while they fit; the samples left keep their ascending order."""
    is_long = lengths[order] > token_budget // 2
    if not is_long.any():
        return [], order
    short, packs, used = order[~is_long], [], 0
    cumulative = np.concatenate([[0], np.cumsum(lengths[short])])  # [n_short + 1]
    for sample in order[is_long][::-1]:
        room = token_budget - int(lengths[sample])
        # the shortest samples left, as many as fit the room: one search, no loop over them
        end = int(np.searchsorted(cumulative, cumulative[used] + room, side="right")) - 1
        packs.append(np.append(short[used:end], sample))
        used = end
    return packs, short[used:]


def shard_packs(packs: list[np.ndarray], rank: int, world_size: int) -> list[np.ndarray]:
    """Rank `rank`'s share of an epoch's packs: packs rank, rank + W, rank + 2W, ...

    Every rank must make the same number of steps, so an epoch of P packs is first padded to
    ceil(P / W) * W packs by repeating its first packs (fewer than W repeats; nothing dropped).
    Strided shares mean step s of rank r trains on pack s*W + r of the epoch: W ranks of one
    drafter each see exactly the packs one process with W drafters would, step for step.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is not a rank of world_size={world_size}")
    if world_size == 1:
        return packs
    padded = packs + packs[: -len(packs) % world_size] if packs else packs
    return padded[rank::world_size]


def iter_packs(
    lengths: np.ndarray,
    token_budget: int,
    seed: int,
    *,
    start: PackCursor = PackCursor(),
    epochs: int | None = None,
    rank: int = 0,
    world_size: int = 1,
) -> Iterator[tuple[PackCursor, np.ndarray]]:
    """(cursor, pack) for every pack from `start` on, epoch after epoch (forever if epochs=None).

    Resuming: save `cursor.next()` once a pack is consumed; `iter_packs(..., start=saved)` then
    yields exactly the packs an uninterrupted run would have yielded next. With several ranks,
    the packs and cursor indices are those of this rank's share (plan_epoch).
    """
    epoch, index = start.epoch, start.index
    while epochs is None or epoch < epochs:
        plan = plan_epoch(lengths, token_budget, seed, epoch, rank=rank, world_size=world_size)
        if index > len(plan):
            raise ValueError(f"{start} is past the {len(plan)} packs of epoch {epoch}")
        for i in range(index, len(plan)):
            yield PackCursor(epoch, i), plan[i]
        epoch, index = epoch + 1, 0


def target_batches(lengths_of_pack: np.ndarray, max_batch_tokens: int) -> list[np.ndarray]:
    """Split one pack into right-padded 2-D target batches: arrays of positions in the pack.

    Rows are taken longest first; a batch holds as many rows as fit rows * (its longest row)
    <= max_batch_tokens, so neighbouring lengths share a batch and padding stays small.
    """
    lengths = np.asarray(lengths_of_pack, dtype=np.int64)
    if len(lengths) and lengths.max() > max_batch_tokens:
        raise ValueError(
            f"a sample of {int(lengths.max())} tokens exceeds max_batch_tokens={max_batch_tokens}"
        )
    order = np.argsort(-lengths, kind="stable")
    batches, i = [], 0
    while i < len(order):
        rows = max_batch_tokens // int(lengths[order[i]])
        batches.append(order[i : i + rows])
        i += rows
    return batches


def pack_row_offsets(lengths: np.ndarray) -> np.ndarray:
    """[n+1] int64: sample j of a pack occupies drafter rows row_offsets[j]:row_offsets[j+1]."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def layout_pack(
    samples: Sequence[tuple[Any, Any]],
    token_budget: int,
    *,
    features: torch.Tensor | None = None,
    pad_id: int = 0,
) -> PackedBatch:
    """The fixed drafter layout of one pack: documents contiguous in the given order, then padding.

    `samples` are (input_ids, loss_mask) pairs (numpy arrays, tensors or lists). Without
    `features` the batch carries an empty [T, 0] tensor; the target side fills features at the
    rows `pack_row_offsets` gives.
    """
    ids = [np.asarray(s[0], dtype=np.int64) for s in samples]
    masks = [np.asarray(s[1], dtype=bool) for s in samples]
    lengths = np.array([len(x) for x in ids], dtype=np.int64)
    if any(len(m) != len(x) for x, m in zip(ids, masks, strict=True)):
        raise ValueError(f"input_ids and loss_mask lengths differ: {[len(m) for m in masks]}")
    offsets = pack_row_offsets(lengths)
    total = int(offsets[-1])
    if total > token_budget:
        raise ValueError(f"pack holds {total} tokens, more than token_budget={token_budget}")
    if features is not None and features.shape[0] != token_budget:
        raise ValueError(f"features has {features.shape[0]} rows, expected {token_budget}")
    input_ids = np.full(token_budget, pad_id, dtype=np.int64)  # [T]
    loss_mask = np.zeros(token_budget, dtype=bool)  # [T]
    doc_ids = np.full(token_budget, -1, dtype=np.int64)  # [T]
    position_ids = np.zeros(token_budget, dtype=np.int64)  # [T]
    if total:
        input_ids[:total] = np.concatenate(ids)
        loss_mask[:total] = np.concatenate(masks)
        doc_ids[:total] = np.repeat(np.arange(len(ids)), lengths)
        position_ids[:total] = np.arange(total) - np.repeat(offsets[:-1], lengths)
    return PackedBatch(
        input_ids=torch.from_numpy(input_ids),
        loss_mask=torch.from_numpy(loss_mask),
        doc_ids=torch.from_numpy(doc_ids),
        position_ids=torch.from_numpy(position_ids),
        features=features if features is not None else torch.empty(token_budget, 0),
    )


def document_starts(doc_ids: torch.Tensor) -> torch.Tensor:
    """First row of each row's document, [T] -> [T], sync-free (cummax of start indices)."""
    rows = torch.arange(doc_ids.shape[0], device=doc_ids.device)
    is_start = torch.ones_like(doc_ids, dtype=torch.bool)
    is_start[1:] = doc_ids[1:] != doc_ids[:-1]
    return torch.where(is_start, rows, 0).cummax(0).values
