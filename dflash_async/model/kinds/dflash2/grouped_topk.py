"""An exact top-k over a large vocabulary in two small steps: group maxima, then the best groups.

This module owns `grouped_topk`, the DFlash2 objective's unary top-k (objective.py here).
A row of V logits is viewed as G groups of S contiguous columns. If an element is among the
row's top k, its group's maximum is at least that element, and so are the maxima of the k groups
with the largest maxima; if its group were not among those k, the k maxima (k distinct elements,
one per group) and the element itself would be k+1 values >= it, so it could be in the top k only
as a tie with the k-th value. Hence the top k of the row lies in its k best groups, and a second
top-k over those k*S values gives the same values as a top-k over the whole row (indices equal
too, except that ties may pick another of the equal columns, which torch.topk leaves open too).

Why not `torch.topk` over the row: at a 2048 x 248320 bf16 chunk its radix select took 2.3 ms on
an H200 (18 ms of a DFlash2 step over 8 chunks, BENCHMARKS.md), ~0.45 TB/s; the group maxima are
one reduction over the row (a memory-bound pass) and the two top-ks run on [c, G] and [c, k*S].
Sync-free: views, a reduction, gathers and top-ks of static shapes. On the GPU the reduction
(the group maxima) comes from the CE chunk's Triton pass, which reads the logits anyway
(ce_kernel.ce_grad_and_group_max_triton).
"""

from __future__ import annotations

import torch

# group widths tried, widest first: a width must divide V and leave at least k groups
GROUP_WIDTHS = (256, 128, 64, 32, 16)


def group_width(vocab: int, k: int) -> int | None:
    """The widest S in GROUP_WIDTHS that divides `vocab` with vocab / S >= 4k groups, or None
    (then the two steps buy nothing over one top-k: a small or odd vocabulary)."""
    for width in GROUP_WIDTHS:
        if vocab % width == 0 and vocab // width >= 4 * k:
            return width
    return None


def group_maxima(z: torch.Tensor, width: int) -> torch.Tensor:
    """[c, V] -> [c, V / width]: the maximum of each row's `width`-wide column groups (the first
    step of grouped_topk; the DFlash2 CE pass can return it from its own loads instead)."""
    rows, vocab = z.shape
    return z.view(rows, vocab // width, width).amax(dim=-1)


def grouped_topk(
    z: torch.Tensor, k: int, *, group_max: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [c, k], indices [c, k] int64) of each row's k largest of z [c, V], largest first:
    the values of `z.topk(k, dim=-1)` (see the module doc for ties). Falls back to z.topk where
    V has no group width (group_width). `group_max`: `group_maxima(z, group_width(V, k))`
    computed elsewhere (it must be exactly that), else computed here."""
    rows, vocab = z.shape
    width = group_width(vocab, k)
    if width is None:
        top = z.topk(k, dim=-1)
        return top.values, top.indices
    if group_max is None:
        group_max = group_maxima(z, width)
    groups = z.view(rows, vocab // width, width)  # [c, G, S]
    best = group_max.topk(k, dim=-1, sorted=False).indices  # [c, k] groups
    members = groups.gather(1, best[:, :, None].expand(rows, k, width))  # [c, k, S]
    values, within = members.flatten(1).topk(k, dim=-1)  # [c, k], within [0, k*S)
    columns = best.gather(1, within // width) * width + within % width
    return values, columns
