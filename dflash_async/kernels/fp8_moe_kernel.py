"""The FP8 experts' routed grouped product as one Triton kernel (GPU only, imported lazily).

Computes targets/fp8/fp8_routed.py's contract (gather the A rows through the routing, e4m3 x e4m3
products in fp32, both row-wise scales, the SiLU gate, the routing weight, scatter to the routed
pairs' rows). Gated, a program keeps two accumulators, its gate columns' and the same up
columns', and writes silu(gate) * up (as fp8_gate_kernel computes it), so the [S, 2I] gate_up
output is never written: half the bytes out, and no gate pass.
One program per (block of <= block_rows rows of one expert, block_n output columns): the block
table (grouped_experts.expert_blocks) gives its expert and first row; the blocks past the last
exit at once. Programs run block-major, a block's column tiles next to each other, so the
programs in flight at a time share a few experts' weights in L2. The product is Triton's
tl.dot on e4m3 (wgmma on Hopper) with its default Hopper accumulation, the fast one (triton
3.6: max_num_imprecise_acc defaults to 2^30 on compute capability 9.0), as the modules'
FAST_ACCUM asks of `torch._scaled_grouped_mm`. N and K must be whole tiles
(fp8_moe_launch.launch_problem): the loads then need no column masks, and a block's rows past its
expert's end read real rows (its own expert's neighbours, or row 0) whose results are never
stored. Its ungated products equal `_scaled_grouped_mm`'s (fast accumulation) bit for bit on an
H200. A persistent variant (one program an SM, the tiles' reduction steps one loop) ran 2-10x
slower under triton 3.6 and was dropped (BENCHMARKS.md, 2026-12-04).

tests/kernels/test_fp8_moe_kernel_gpu.py compares it with fp8_routed.routed_reference on a GPU (and the
comparison with mutants). Syncs: none (the table and offsets stay on the device).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dflash_async.kernels.fp8_moe_launch import LAUNCH, Launch, launch_problem


@triton.jit
def _block(
    block,
    block_expert_ptr,
    block_start_ptr,
    ends_ptr,
    a_rows_ptr,
    GATHER: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):
    """A block's expert, its sorted rows, which of them are its expert's, and their A rows."""
    expert = tl.load(block_expert_ptr + block)
    rows = tl.load(block_start_ptr + block) + tl.arange(0, BLOCK_ROWS)  # sorted rows
    here = rows < tl.load(ends_ptr + expert)
    if GATHER:
        sources = tl.load(a_rows_ptr + rows, mask=here, other=0)
    else:
        sources = tl.where(here, rows, 0)
    return expert, rows, here, sources.to(tl.int64)


@triton.jit
def _store(
    acc,
    up,
    expert,
    rows,
    here,
    sources,
    columns,
    a_scale_ptr,
    w_scale_ptr,
    out_ptr,
    out_rows_ptr,
    row_weight_ptr,
    N,
    SCATTER: tl.constexpr,
    GATED: tl.constexpr,
):
    """A tile's epilogue: both scales, the gate, the routing weight, the store."""
    w_rows = 2 * N if GATED else N
    a_scale = tl.load(a_scale_ptr + sources)
    w_scale = tl.load(w_scale_ptr + expert * w_rows + columns)
    acc = acc * a_scale[:, None] * w_scale[None, :]
    if GATED:  # silu(gate) * up, as fp8_gate_kernel computes it
        up_scale = tl.load(w_scale_ptr + expert * w_rows + N + columns)
        up = up * a_scale[:, None] * up_scale[None, :]
        acc = acc / (1.0 + tl.exp(-acc)) * up
    if SCATTER:
        targets = tl.load(out_rows_ptr + rows, mask=here, other=0).to(tl.int64)
        weight = tl.load(row_weight_ptr + targets, mask=here, other=0.0).to(tl.float32)
        acc = acc * weight[:, None]
    else:
        targets = rows.to(tl.int64)
    out_tile = out_ptr + targets[:, None] * N + columns[None, :]
    tl.store(out_tile, acc.to(out_ptr.dtype.element_ty), mask=here[:, None])


@triton.jit
def _routed_kernel(
    a_ptr,
    a_scale_ptr,
    a_rows_ptr,
    w_ptr,
    w_scale_ptr,
    out_ptr,
    out_rows_ptr,
    row_weight_ptr,
    block_expert_ptr,
    block_start_ptr,
    ends_ptr,
    num_experts,
    N,
    K,
    GATHER: tl.constexpr,
    SCATTER: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One program a tile. N: the output's columns (I when GATED: the weight then has 2N rows,
    gate then up)."""
    tiles_n = N // BLOCK_N
    block = tl.program_id(0) // tiles_n
    if tl.load(block_expert_ptr + block) >= num_experts:  # past the last block
        return
    expert, rows, here, sources = _block(
        block, block_expert_ptr, block_start_ptr, ends_ptr, a_rows_ptr, GATHER, BLOCK_ROWS
    )
    columns = (tl.program_id(0) % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    reduced = tl.arange(0, BLOCK_K)
    a_tile = a_ptr + sources[:, None] * K + reduced[None, :]  # [BLOCK_ROWS, BLOCK_K]
    w_rows = 2 * N if GATED else N
    w_expert = w_ptr + expert.to(tl.int64) * w_rows * K
    w_tile = w_expert + columns[None, :].to(tl.int64) * K + reduced[:, None]  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_ROWS, BLOCK_N), dtype=tl.float32)
    up = acc
    for step in range(0, K, BLOCK_K):
        a = tl.load(a_tile + step)
        acc = tl.dot(a, tl.load(w_tile + step), acc)
        if GATED:  # the up rows' tile, N weight rows further
            up = tl.dot(a, tl.load(w_tile + N * K + step), up)
    _store(
        acc,
        up,
        expert,
        rows,
        here,
        sources,
        columns,
        a_scale_ptr,
        w_scale_ptr,
        out_ptr,
        out_rows_ptr,
        row_weight_ptr,
        N,
        SCATTER,
        GATED,
    )


def routed_mm(
    a_q: torch.Tensor,
    a_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    offsets: torch.Tensor,
    blocks: tuple[torch.Tensor, torch.Tensor],
    *,
    a_rows: torch.Tensor | None = None,
    out_rows: torch.Tensor | None = None,
    row_weights: torch.Tensor | None = None,
    gated: bool = False,
    out_dtype: torch.dtype = torch.bfloat16,
    launch: Launch = LAUNCH,
) -> torch.Tensor:
    """fp8_routed's contract: a_q [R, K] e4m3 and a_scale [R] fp32 (R = S, or the gathered
    tokens), w_q [E, N, K] e4m3 and w_scale [E, N] fp32, offsets [E] int32, blocks the
    expert_blocks table for launch.block_rows; a_rows / out_rows [S] int32, row_weights [S]
    (scatter only). Returns [S, N] ([S, N / 2] `gated`) in out_dtype, every row written. No
    host sync."""
    problem = launch_problem(w_q, launch, gated=gated)
    if problem is not None:
        raise ValueError(problem)
    if (out_rows is None) != (row_weights is None):
        raise ValueError("out_rows and row_weights come together (the down product's scatter)")
    rows = a_q.shape[0] if a_rows is None else a_rows.shape[0]
    num_experts, n, k = w_q.shape
    n = n // 2 if gated else n
    if a_q.shape[1] != k or not a_q.is_contiguous():
        raise ValueError(f"a_q {tuple(a_q.shape)} is not [R, {k}] contiguous")
    out = torch.empty((rows, n), dtype=out_dtype, device=a_q.device)
    block_expert, block_start = blocks
    unused = offsets  # a pointer for the arguments a launch does not read
    grid = (block_expert.numel() * (n // launch.block_n),)
    _routed_kernel[grid](
        a_q,
        a_scale.float(),
        unused if a_rows is None else a_rows,
        w_q,
        w_scale,
        out,
        unused if out_rows is None else out_rows,
        unused if row_weights is None else row_weights,
        block_expert,
        block_start,
        offsets,
        num_experts,
        n,
        k,
        GATHER=a_rows is not None,
        SCATTER=out_rows is not None,
        GATED=gated,
        BLOCK_ROWS=launch.block_rows,
        BLOCK_N=launch.block_n,
        BLOCK_K=launch.block_k,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    return out
