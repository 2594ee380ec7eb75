"""The chunked CE's elementwise pass as one hand-written Triton kernel (GPU only, imported lazily).

Same contract as objective.ce_and_grad_from_logits (the reference, and what torch.compile fuses by
default): for bf16 logits [c, V], labels and weights [c], return sum(w*CE) (fp32), whether argmax
== label [c], and the gradient (softmax - onehot) * w as bf16 [c, V]. One program per row reads the
row twice (pass 1: running max, rescaled sum of exp and the first argmax; pass 2: the gradient,
from the row's end back, where L2 still holds what pass 1 read last) and writes it once: at most
1.87 GB per 2048 x 151936 chunk. The compiled reference moves the same bytes at ~2 TB/s (0.94 ms
per chunk on an H200); this kernel takes 0.59 ms (`benchmarks/ce_launch_sweep.py`, which also
times the launch shapes CeLaunch offers). Rows with w == 0 still get their argmax, and their
gradient and loss are exactly 0 (selected, never multiplied: a non-finite logit there must not leak
in), as in the reference. Ties in the argmax go to the lowest index, as torch.argmax.
For DFlash2 the same launch also writes the maxima of each row's fixed-width column groups
(`ce_grad_and_group_max_triton`), the first step of its unary top-k (grouped_topk, model/kinds/), from the
loads of pass 1: the kernel went 4.73 -> 5.87 ms per Qwen3-8B-shaped DFlash2 step (8 chunks) and
the separate 7.48 ms amax went away (H200, BENCHMARKS.md). tests/kernels/test_ce_kernel_gpu.py
compares both with the reference and with mutants on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _ce_row_kernel(
    logits_ptr,
    grad_ptr,
    labels_ptr,
    weights_ptr,
    ce_ptr,
    hit_ptr,
    gmax_ptr,
    rows,
    V,
    stride_row,
    groups,
    BLOCK: tl.constexpr,
    REVERSE: tl.constexpr,
    STAGES: tl.constexpr,
    GROUP: tl.constexpr,
):
    # programs stride over the rows (one row each by default). Fewer programs than rows, to keep
    # more of each row in L2 for pass 2, lost in the sweep and in the step (CE_LAUNCH below);
    # the loop stays so that benchmarks/ce_launch_sweep.py can retry them
    for row in tl.range(tl.program_id(0), rows, tl.num_programs(0)):
        _ce_row(
            logits_ptr,
            grad_ptr,
            labels_ptr,
            weights_ptr,
            ce_ptr,
            hit_ptr,
            gmax_ptr,
            tl.cast(row, tl.int64),
            V,
            stride_row,
            groups,
            BLOCK,
            REVERSE,
            STAGES,
            GROUP,
        )


@triton.jit
def _ce_row(
    logits_ptr,
    grad_ptr,
    labels_ptr,
    weights_ptr,
    ce_ptr,
    hit_ptr,
    gmax_ptr,
    row,
    V,
    stride_row,
    groups,
    BLOCK: tl.constexpr,
    REVERSE: tl.constexpr,
    STAGES: tl.constexpr,
    GROUP: tl.constexpr,
):
    base = logits_ptr + row * stride_row
    offsets = tl.arange(0, BLOCK)
    label = tl.load(labels_ptr + row)
    weight = tl.load(weights_ptr + row).to(tl.float32)
    trained = weight > 0.0
    # pass 1: max, sum of exp(x - max) and the first argmax, blockwise then per lane
    run_max = tl.full([BLOCK], float("-inf"), tl.float32)
    run_sum = tl.zeros([BLOCK], tl.float32)
    run_arg = tl.zeros([BLOCK], tl.int32)
    for start in tl.range(0, V, BLOCK, num_stages=STAGES):
        cols = start + offsets
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(run_max, x)
        # sum * exp(max - new_max) + exp(x - new_max) with one exp, not two: one of the two
        # exponents is 0 (exp(0) = 1 exactly, so the sum is the same)
        rises = x > run_max
        e = tl.exp(tl.where(rises, run_max - x, x - run_max))
        run_sum = tl.where(rises, run_sum * e + 1.0, run_sum + e)
        # lanes still at -inf keep a sum of 0 (exp(-inf - -inf) is NaN)
        run_sum = tl.where(new_max == float("-inf"), 0.0, run_sum)
        run_arg = tl.where(x > run_max, cols, run_arg)  # strict: a lane keeps its first maximum
        run_max = new_max
        if GROUP > 0:  # the maxima of this block's GROUP-wide column groups (GROUP divides V)
            group_max = tl.max(tl.reshape(x, [BLOCK // GROUP, GROUP]), axis=1)
            group = start // GROUP + tl.arange(0, BLOCK // GROUP)
            tl.store(
                gmax_ptr + row * groups + group,
                group_max.to(gmax_ptr.dtype.element_ty),
                mask=group < groups,
            )
    row_max = tl.max(run_max, axis=0)
    lse = row_max + tl.log(tl.sum(run_sum * tl.exp(run_max - row_max), axis=0))
    # the lowest column among the lanes that reached the row's maximum
    argmax = tl.min(tl.where(run_max == row_max, run_arg, V), axis=0)
    x_label = tl.load(base + label).to(tl.float32)
    tl.store(ce_ptr + row, tl.where(trained, weight * (lse - x_label), 0.0))
    tl.store(hit_ptr + row, argmax == label)
    # pass 2: the gradient, exactly 0 on untrained rows. REVERSE walks the row back from its
    # end: the blocks pass 1 read last are the likeliest to be in L2 still.
    w = tl.where(trained, weight, 0.0)
    out = grad_ptr + row * V
    blocks = tl.cdiv(V, BLOCK)
    for i in tl.range(0, blocks, num_stages=STAGES):
        if REVERSE:
            cols = (blocks - 1 - i) * BLOCK + offsets
        else:
            cols = i * BLOCK + offsets
        x = tl.load(base + cols, mask=cols < V, other=0.0).to(tl.float32)
        g = tl.exp(x - lse) - tl.where(cols == label, 1.0, 0.0)
        g = tl.where(trained, g * w, 0.0)
        tl.store(out + cols, g.to(grad_ptr.dtype.element_ty), mask=cols < V)


@dataclass(frozen=True)
class CeLaunch:
    """How _ce_row_kernel is launched: `programs_per_sm` programs per SM striding over the rows
    (0: one program per row), `num_warps` each, pass 2 reversed or not, `elems_per_warp`
    columns per warp per loop step, `stages`: Triton's software pipelining of each pass's loop
    (None: Triton's default)."""

    programs_per_sm: int = 0
    num_warps: int = 8
    reverse: bool = False
    elems_per_warp: int = 512
    stages: int | None = None


# `benchmarks/ce_launch_sweep.py` on an H200 (2048 x 151936 chunk, BENCHMARKS.md): one 8-warp
# program per row, pass 2 reversed, 256 columns per warp per loop step: 0.593 ms per chunk; 512
# columns 0.730, 1024 1.25; 4 or 16 warps 0.611-0.615; Triton's loop pipelining (stages 3) at best
# 0.669, slower than without at 256 columns. Before: 2 programs per SM x 16 warps 0.859, 1 per SM
# 1.53-1.64 (too few loads in flight).
CE_LAUNCH = CeLaunch(programs_per_sm=0, num_warps=8, reverse=True, elems_per_warp=256)


def ce_and_grad_triton(
    logits: torch.Tensor,  # [c, V], rows contiguous
    labels: torch.Tensor,  # [c]
    weights: torch.Tensor,  # [c]
    launch: CeLaunch = CE_LAUNCH,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ce_and_grad_from_logits through _ce_row_kernel: (sum of w*CE fp32, hit [c], grad [c, V]).
    Sync-free and capturable (one launch, a sum); the gradient comes out contiguous."""
    ce_sum, hit, grad, _ = _launch(logits, labels, weights, launch=launch, group_width=0)
    return ce_sum, hit, grad


def ce_grad_and_group_max_triton(
    logits: torch.Tensor,  # [c, V], rows contiguous
    labels: torch.Tensor,  # [c]
    weights: torch.Tensor,  # [c]
    *,
    group_width: int,
    launch: CeLaunch = CE_LAUNCH,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ce_and_grad_triton's outputs and the maxima of each row's `group_width`-wide column
    groups, [c, V / group_width] in the logits' dtype: DFlash2's objective's ce_grad_and_group_max's
    contract, the same values (a maximum of bf16 values is one of them, exactly). The maxima
    come from pass 1's loads, so grouped_topk's own pass over the chunk goes: that eager amax
    over [2048, 1187, 128] bf16 took 0.94 ms per chunk, 7.5 ms of a Qwen3-8B-shaped DFlash2 step
    on an H200 (2026-12-03, BENCHMARKS.md). group_width must divide V and the loop's column
    block (a power of two up to it)."""
    block = launch.num_warps * launch.elems_per_warp
    vocab = logits.shape[-1]
    if group_width < 1 or vocab % group_width or block % group_width:
        raise ValueError(
            f"group_width {group_width} must divide V = {vocab} and the "
            f"kernel's {block}-column block"
        )
    return _launch(logits, labels, weights, launch=launch, group_width=group_width)


def _launch(
    logits: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    *,
    launch: CeLaunch,
    group_width: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One _ce_row_kernel launch; group_width 0: no group maxima (None)."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [c, V] with contiguous rows, got {tuple(logits.shape)}")
    if logits.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        # the kernel computes in fp32: float64 logits (CPU-style tests) take ce_kernel="compiled"
        raise ValueError(f"the Triton CE pass takes bf16/fp16/fp32 logits, not {logits.dtype}")
    rows, vocab = logits.shape
    grad = torch.empty((rows, vocab), dtype=logits.dtype, device=logits.device)
    ce = torch.empty(rows, dtype=torch.float32, device=logits.device)
    hit = torch.empty(rows, dtype=torch.bool, device=logits.device)
    groups = vocab // group_width if group_width else 0
    # with no groups asked, a 1-element stand-in: the kernel never stores to it (GROUP = 0)
    group_max = torch.empty((rows, groups or 1), dtype=logits.dtype, device=logits.device)
    programs = rows
    if launch.programs_per_sm:
        # CPU tensors reach here only under Triton's interpreter (tests): any count will do
        sms = (
            torch.cuda.get_device_properties(logits.device).multi_processor_count
            if logits.is_cuda
            else 4
        )
        programs = min(rows, launch.programs_per_sm * sms)
    _ce_row_kernel[(programs,)](
        logits,
        grad,
        labels,
        weights,
        ce,
        hit,
        group_max,
        rows,
        vocab,
        logits.stride(0),
        groups,
        BLOCK=launch.num_warps * launch.elems_per_warp,
        REVERSE=launch.reverse,
        STAGES=launch.stages,
        GROUP=group_width,
        num_warps=launch.num_warps,
    )
    return ce.sum(), hit, grad, group_max if groups else None
