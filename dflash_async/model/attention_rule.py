"""The DFlash training attention rule, in two implementations that must agree.

Query = slot k of block j, with anchor a_j in document d_j (docs/DFLASH.md section 2). Keys are the
T context rows followed by the Q = A*B block slots.
- context row p is visible iff doc(p) == d_j and p < a_j (STRICTLY: at inference the anchor's own
  target hidden state does not exist yet);
- block slot s is visible iff it belongs to block j (bidirectional inside the block);
- nothing is visible to an invalid anchor slot (its output is 0, and its loss is excluded).
A layer's `AttentionRule` (layer_rules.py, the drafter variants of s.10) narrows both parts. A
window W is z-lab's per-slot rule (its `_attention_mask`, the servable contract): slot k sits at
position a_j + k and sees key position p iff |(a_j + k) - p| < W, so context rows with
a_j + k - p < W, and block slots s with |k - s| < W (binding only when W < B). `causal` lets slot
k see slots 0..k of its block only. The default rule is the one above, and builds the very same
mask.

`dense_rule_mask` spells the rule literally as a [Q, T+Q] boolean mask for SDPA: the reference,
usable on CPU with autograd. `chunked_rule_attend` is the CPU training path: the same rule for
SDPA one chunk of whole blocks at a time, each chunk against only the context keys its rows may
see (one interval, documents being contiguous) and its own blocks' keys, recomputed in backward
(activation checkpointing), so no [Q, T] tensor exists and memory grows linearly with T. `flex_block_mask` builds a flex_attention BlockMask for the same rule
directly from fixed-shape tensors (no compile, no host sync, so it can live inside a CUDA graph):
since documents are contiguous, the visible context of slot k of block j is the interval
[max(start(d_j), a_j + k - (W - 1)), a_j), and its visible block slots one interval too.
`resolve_flex_backend` picks flex_attention's kernels: torch's Triton ones, or flash-attn-4's
(CuTe DSL) through flex's FLASH backend where that is installed and the GPU is a Hopper or
Blackwell.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dflash_async.data.packing import document_starts
from dflash_async.model.drafter import Attend
from dflash_async.model.layer_rules import AttentionRule

FULL_RULE = AttentionRule()

try:  # flex_attention exists on every torch we support; keep the import local to this module
    from torch.nn.attention.flex_attention import BlockMask, FlexKernelOptions, flex_attention
except ImportError:  # pragma: no cover
    BlockMask = FlexKernelOptions = None
    flex_attention = None


def dense_rule_mask(
    doc_ids: torch.Tensor,  # [T]
    anchors: torch.Tensor,  # [A]
    valid: torch.Tensor,  # [A] bool
    block_size: int,
    *,
    rule: AttentionRule = FULL_RULE,
) -> torch.Tensor:
    """The rule as a [Q, T+Q] boolean mask (True = visible). Memory O(Q*(T+Q)): CPU/tests only."""
    T, A, B = doc_ids.shape[0], anchors.shape[0], block_size
    rows = torch.arange(T, device=doc_ids.device)
    anchor_doc = doc_ids[anchors]  # [A]
    context = (doc_ids[None, :] == anchor_doc[:, None]) & (rows[None, :] < anchors[:, None])
    own_block = torch.eye(A, dtype=torch.bool, device=doc_ids.device)  # block j sees block j
    per_block = torch.cat([context, own_block.repeat_interleave(B, dim=1)], dim=1)  # [A, T+Q]
    per_block = per_block & valid[:, None]
    mask = per_block.repeat_interleave(B, dim=0)  # [Q, T+Q]
    slots = torch.arange(A * B, device=doc_ids.device)  # query row q = j*B+k, block key T+s
    if rule.causal:  # q sees block key T+s of its own block iff s <= q
        mask[:, T:] &= slots[None, :] <= slots[:, None]
    if rule.window is not None:  # z-lab: query position a_j + k, key position p: |a_j+k - p| < W
        position = anchors.repeat_interleave(B) + slots % B  # [Q]: a_j + k
        mask[:, :T] &= position[:, None] - rows[None, :] < rule.window
        mask[:, T:] &= (slots[:, None] - slots[None, :]).abs() < rule.window  # own block: k - s
    return mask


def sdpa_attend(mask: torch.Tensor) -> Attend:
    """SDPA with a boolean mask (True = attend). Fully masked rows come out as 0, not NaN."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    return attend


# Block rows per SDPA call of chunked_rule_attend (whole blocks): its mask is 1024 x (keys it
# sees) bools, 100 MB against a 98304-token document; torch's CPU flash kernel takes the boolean
# mask and never forms the [H, rows, keys] scores.
SDPA_QUERY_ROWS = 1024


def chunk_key_ranges(
    lo: torch.Tensor, hi: torch.Tensor, *, rows: int, num_context: int
) -> list[tuple[int, int, int, int]]:
    """(s, e, first, last) per chunk of query rows [s, e): the context keys [first, last) that
    hold every row's visible interval [lo, hi) (empty rows ignored). One host sync."""
    Q, T = lo.shape[0], num_context
    seen = lo < hi
    pad = -Q % rows
    first = F.pad(torch.where(seen, lo, T), (0, pad), value=T).view(-1, rows).amin(1)
    last = F.pad(torch.where(seen, hi, 0), (0, pad), value=0).view(-1, rows).amax(1)
    return [
        (s, min(s + rows, Q), f, max(f, h))
        for s, f, h in zip(range(0, Q, rows), first.tolist(), last.tolist(), strict=True)
    ]


def chunked_rule_attend(
    doc_ids: torch.Tensor,  # [T]
    anchors: torch.Tensor,  # [A]
    valid: torch.Tensor,  # [A] bool
    block_size: int,
    *,
    rule: AttentionRule = FULL_RULE,
    query_rows: int = SDPA_QUERY_ROWS,
) -> Attend:
    """SDPA under the rule of `dense_rule_mask`, in chunks of max(1, query_rows // B) blocks.

    A chunk's rows see context keys inside [first, last) (the smallest lo and largest hi of its
    rows: anchors are sorted, so with a window this is about the anchors' spread plus W) and
    block keys of its own blocks only; each chunk's mask, keys and attention are rebuilt in
    backward from q, k and v (checkpointed), so what stays alive per chunk is its output. One
    host sync where Q > query_rows: the chunks' key ranges (the CPU path)."""
    T, B = doc_ids.shape[0], block_size
    Q = anchors.shape[0] * B
    lo, hi, block_lo, block_hi = _visible_intervals(doc_ids, anchors, valid, B, rule)
    rows = max(1, query_rows // B) * B
    # Q <= rows: one call over every key, [Q, T + Q] mask, no host sync and no shapes read from
    # the data (so a compiled layer keeps one graph whatever the anchors)
    spans = [(0, Q, 0, T)] if rows >= Q else chunk_key_ranges(lo, hi, rows=rows, num_context=T)

    def chunk(q, k, v, s: int, e: int, f: int, h: int) -> torch.Tensor:
        keys = torch.cat([torch.arange(f, h), torch.arange(T + s, T + e)]).to(doc_ids.device)
        within = lambda a, b: (keys >= a[s:e, None]) & (keys < b[s:e, None])  # noqa: E731
        mask = within(lo, hi) | within(block_lo, block_hi)  # [e - s, h - f + e - s]
        k = torch.cat([k[:, :, f:h], k[:, :, T + s : T + e]], dim=2)
        v = torch.cat([v[:, :, f:h], v[:, :, T + s : T + e]], dim=2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if rows >= Q:  # one chunk: nothing to free between chunks, no recomputation
            return chunk(q, k, v, *spans[0])
        parts = [
            checkpoint(chunk, q[:, :, s:e], k, v, s, e, f, h, use_reentrant=False)
            for s, e, f, h in spans
        ]
        return torch.cat(parts, dim=2)

    return attend


def _visible_intervals(
    doc_ids: torch.Tensor,
    anchors: torch.Tensor,
    valid: torch.Tensor,
    block_size: int,
    rule: AttentionRule,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per query row [Q] each: context interval [lo, hi) and own-block interval [block_lo,
    block_hi) in the KV index space (documents are contiguous, so each part is one interval).
    With a window, lo varies inside a block: slot k's lower bound is a_j + k - (W - 1)."""
    T, B = doc_ids.shape[0], block_size
    expand = lambda x: x.repeat_interleave(B)  # noqa: E731  [A] -> [Q]
    slot = torch.arange(anchors.shape[0] * B, device=anchors.device) % B  # [Q]: k
    anchor = expand(anchors)
    lo = expand(document_starts(doc_ids)[anchors])  # [Q]
    if rule.window is not None:  # (a_j + k) - p < W  <=>  p >= a_j + k - W + 1 (may pass a_j)
        lo = torch.maximum(lo, anchor + slot - (rule.window - 1))
    hi = torch.where(expand(valid), anchor, lo)  # empty interval for invalid slots
    block_start = T + torch.arange(anchors.shape[0], device=anchors.device) * B
    block_start = expand(torch.where(valid, block_start, -B))  # invalid: no block keys either
    first, end = torch.zeros_like(slot), (slot + 1 if rule.causal else torch.full_like(slot, B))
    if rule.window is not None:  # block slot s: |k - s| < W  <=>  k - W < s < k + W
        first, end = (slot - (rule.window - 1)).clamp(min=0), end.clamp(max=slot + rule.window)
    # invalid rows stay empty: block_start + end <= 0, below every key index
    return lo, hi, block_start + first, block_start + end


def flex_block_mask(
    doc_ids: torch.Tensor,  # [T]
    anchors: torch.Tensor,  # [A]
    valid: torch.Tensor,  # [A] bool
    block_size: int,
    tile: int = 128,
    *,
    rule: AttentionRule = FULL_RULE,
) -> BlockMask:
    """BlockMask of the rule, from fixed-shape tensor ops only (no host sync, capturable).

    Requires T and Q = A*B to be multiples of `tile`. A KV tile is "full" for a query tile when
    every row of the query tile sees every key of the KV tile (no mask_mod needed there), and
    "partial" when some row sees some key. Both are decided per query row, then reduced over the
    tile's rows (any / all), so bounds that vary from row to row (a window's per-slot lo, a causal
    block's per-slot end) are bounded exactly: a tile no row sees is skipped, none is full unless
    every row sees all of it.
    """
    T, A, B = doc_ids.shape[0], anchors.shape[0], block_size
    Q, S = A * B, doc_ids.shape[0] + A * B
    if T % tile or Q % tile:
        raise ValueError(f"flex attention needs T={T} and Q={Q} to be multiples of {tile}")
    # int32 per-row bounds: the mask_mod reads them at q_idx, which the kernels carry as int32
    intervals = _visible_intervals(doc_ids, anchors, valid, B, rule)
    lo, hi, block_lo, block_hi = (x.to(torch.int32) for x in intervals)  # [Q] each
    tile_lo = torch.arange(0, S, tile, device=doc_ids.device, dtype=torch.int32)  # [S/tile]
    tile_hi = tile_lo + tile
    rows = lambda x: x[:, None]  # noqa: E731  [Q] -> [Q, 1], against [S/tile]
    sees_some = ((rows(lo) < tile_hi) & (tile_lo < rows(hi)) & rows(lo < hi)) | (
        (rows(block_lo) < tile_hi) & (tile_lo < rows(block_hi))
    )  # [Q, S/tile]
    sees_all = (rows(lo) <= tile_lo) & (tile_hi <= rows(hi))  # a B-slot block never fills a tile
    any_row = sees_some.view(Q // tile, tile, -1).any(1)  # [Q/tile, S/tile]
    full = sees_all.view(Q // tile, tile, -1).all(1)
    partial = any_row & ~full

    # The same rule, per element, for partial tiles. It reads only 1-D captured tensors at q_idx
    # and holds no Python constants: torch 2.11's CuTe DSL code generation (flex_attention's
    # FLASH backend) fails on a literal index such as `lo[q_idx, 0]` ("Expected TensorSSA, but
    # got int"), measured on the H200.
    def mask_mod(b, h, q_idx, kv_idx):
        in_context = (kv_idx >= lo[q_idx]) & (kv_idx < hi[q_idx])
        in_block = (kv_idx >= block_lo[q_idx]) & (kv_idx < block_hi[q_idx])
        return in_context | in_block

    return BlockMask.from_kv_blocks(
        *_ordered(partial),
        *_ordered(full),
        BLOCK_SIZE=tile,
        mask_mod=mask_mod,
        seq_lengths=(Q, S),
    )


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[nq, nkv] bool -> (num_blocks [1,1,nq] int32, indices [1,1,nq,nkv] int32), set tiles first."""
    num = tiles.sum(-1, dtype=torch.int32)
    order = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num[None, None], order[None, None]


FlexBackend = Literal["auto", "triton", "flash"]
# The oldest torch whose FLASH backend was measured exact on the drafter's mask (2.11 on an H200):
# auto picks flash only from there on.
FLASH_AUTO_MIN_TORCH = "2.11"
FLASH_DTYPES = (torch.bfloat16, torch.float16)  # what flash-attn-4's kernels take


def flash_unavailable_reason(device: torch.device) -> str | None:
    """Why flex_attention's FLASH backend (flash-attn-4) cannot run on `device`, or None if it can.

    Measured exact and faster on an H200 (torch 2.11, flash-attn-4 4.0.0b36: BENCHMARKS.md);
    flash-attn-4 targets compute capability 9.x and 10.x only.
    """
    if device.type != "cuda":
        return f"it needs a CUDA GPU (the drafter is on {device})"
    if "BACKEND" not in FlexKernelOptions.__annotations__:
        return f"torch {torch.__version__} has no FLASH backend for flex_attention"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in (9, 10):
        return f"flash-attn-4 runs on Hopper (9.x) and Blackwell (10.x), not {major}.{minor}"
    try:  # find_spec of a submodule imports its parent package; a broken install is "absent"
        installed = importlib.util.find_spec("flash_attn.cute") is not None
    except ImportError:
        installed = False
    if not installed:
        return 'flash-attn-4 is not installed (pip install -e ".[flash]")'
    return None


def unknown_flex_options(options: dict) -> str | None:
    """What is wrong with flex_attention kernel options, or None: BACKEND (chosen by
    flex_backend instead) or a name torch's FlexKernelOptions lacks (fwd_/bwd_ prefixes allowed)."""
    if "BACKEND" in options:
        return "choose the backend with DFLASH_TRAIN__FLEX_BACKEND=auto|triton|flash, not BACKEND"
    known = set(FlexKernelOptions.__annotations__)
    unknown = [k for k in options if k.removeprefix("fwd_").removeprefix("bwd_") not in known]
    if unknown:
        return (
            f"unknown option(s) {', '.join(unknown)} (torch's FlexKernelOptions: "
            f"{', '.join(sorted(known))})"
        )
    return None


def resolve_flex_backend(
    requested: FlexBackend, *, device: torch.device, tunes_triton: bool = False
) -> str:
    """The kernels of the drafter's flex_attention on `device`, "triton" or "flash".

    tunes_triton: kernel options or autotuning were asked for; they tune torch's Triton kernels
    (tiles, stages, TMA), so auto keeps those and flash refuses them rather than drop them
    silently. Otherwise auto is flash wherever `flash_unavailable_reason` finds nothing against
    it, else triton; flash where it cannot run raises ValueError saying why.
    """
    if requested == "triton":
        return "triton"
    if tunes_triton:
        if requested == "flash":
            raise ValueError(
                "flex_backend='flash' with flex kernel options or autotuning, which tune torch's "
                "Triton kernels: drop them, or choose flex_backend='triton'"
            )
        return "triton"
    reason = flash_unavailable_reason(device)
    if requested == "flash" and reason is not None:
        raise ValueError(f"flex_backend='flash': {reason}")
    if torch.torch_version.TorchVersion(torch.__version__) < FLASH_AUTO_MIN_TORCH:
        return "triton"  # auto takes only what was measured; flash can still be asked for
    return "flash" if reason is None else "triton"


def flex_attend(
    block_mask: BlockMask, flex_fn: Callable | None = None, kernel_options: dict | None = None
) -> Attend:
    """flex_attention under `block_mask`; pass the compiled function on GPU (eager is slow).
    kernel_options: torch's FlexKernelOptions (None or empty: its defaults)."""
    fn = flex_fn or flex_attention
    options = kernel_options or None

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return fn(q, k, v, block_mask=block_mask, enable_gqa=True, kernel_options=options)

    return attend
