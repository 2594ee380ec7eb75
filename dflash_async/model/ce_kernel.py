"""The chunked CE's elementwise pass as one hand-written Triton kernel (GPU only, imported lazily).

Same contract as objective.ce_and_grad_from_logits (the reference, and what torch.compile fuses
by default): for bf16 logits [c, V], labels and weights [c], return sum(w*CE) (fp32), whether
argmax == label [c], and the gradient (softmax - onehot) * w as bf16 [c, V]. One program per row
reads the row twice (pass 1: running max, rescaled sum of exp and the first argmax; pass 2: the
gradient) and writes it once: 1.87 GB per 2048 x 151936 chunk. The compiled reference moves the
same bytes at ~2 TB/s (0.94 ms per chunk on an H200, `bench drafter --profile` kernels table);
this kernel is for the rest of the HBM bandwidth. Rows with w == 0 still get their argmax, and
their gradient and loss are exactly 0 (selected, never multiplied: a non-finite logit there must
not leak in), as in the reference. Ties in the argmax go to the lowest index, as torch.argmax.
tests/test_gpu_ce_kernel.py compares it with the reference and with mutants on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Elements of a row per loop iteration: 8 warps x 32 threads x 16 bf16 (two 16-byte loads) each.
BLOCK = 4096


@triton.jit
def _ce_row_kernel(
    logits_ptr, grad_ptr, labels_ptr, weights_ptr, ce_ptr, hit_ptr,
    V, stride_row,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    offsets = tl.arange(0, BLOCK)
    label = tl.load(labels_ptr + row)
    weight = tl.load(weights_ptr + row).to(tl.float32)
    trained = weight > 0.0
    # pass 1: max, sum of exp(x - max) and the first argmax, blockwise then per lane
    run_max = tl.full([BLOCK], float("-inf"), tl.float32)
    run_sum = tl.zeros([BLOCK], tl.float32)
    run_arg = tl.zeros([BLOCK], tl.int32)
    for start in tl.range(0, V, BLOCK):
        cols = start + offsets
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(run_max, x)
        # lanes still at -inf keep a sum of 0 (exp(-inf - -inf) would be NaN)
        scale = tl.where(new_max == float("-inf"), 0.0, tl.exp(run_max - new_max))
        grow = tl.where(new_max == float("-inf"), 0.0, tl.exp(x - new_max))
        run_sum = run_sum * scale + grow
        run_arg = tl.where(x > run_max, cols, run_arg)  # strict: a lane keeps its first maximum
        run_max = new_max
    row_max = tl.max(run_max, axis=0)
    lse = row_max + tl.log(tl.sum(run_sum * tl.exp(run_max - row_max), axis=0))
    # the lowest column among the lanes that reached the row's maximum
    argmax = tl.min(tl.where(run_max == row_max, run_arg, V), axis=0)
    x_label = tl.load(base + label).to(tl.float32)
    tl.store(ce_ptr + row, tl.where(trained, weight * (lse - x_label), 0.0))
    tl.store(hit_ptr + row, argmax == label)
    # pass 2: the gradient, exactly 0 on untrained rows
    w = tl.where(trained, weight, 0.0)
    out = grad_ptr + row * V
    for start in tl.range(0, V, BLOCK):
        cols = start + offsets
        x = tl.load(base + cols, mask=cols < V, other=0.0).to(tl.float32)
        g = tl.exp(x - lse) - tl.where(cols == label, 1.0, 0.0)
        g = tl.where(trained, g * w, 0.0)
        tl.store(out + cols, g.to(grad_ptr.dtype.element_ty), mask=cols < V)


def ce_and_grad_triton(
    logits: torch.Tensor,  # [c, V], rows contiguous
    labels: torch.Tensor,  # [c]
    weights: torch.Tensor,  # [c]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ce_and_grad_from_logits through _ce_row_kernel: (sum of w*CE fp32, hit [c], grad [c, V]).
    Sync-free and capturable (one launch, a sum); the gradient comes out contiguous."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [c, V] with contiguous rows, got {tuple(logits.shape)}")
    if logits.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        # the kernel computes in fp32: float64 logits (CPU-style tests) take ce_kernel="compiled"
        raise ValueError(f"the Triton CE pass takes bf16/fp16/fp32 logits, not {logits.dtype}")
    rows, vocab = logits.shape
    grad = torch.empty((rows, vocab), dtype=logits.dtype, device=logits.device)
    ce = torch.empty(rows, dtype=torch.float32, device=logits.device)
    hit = torch.empty(rows, dtype=torch.bool, device=logits.device)
    _ce_row_kernel[(rows,)](
        logits, grad, labels, weights, ce, hit, vocab, logits.stride(0), BLOCK=BLOCK,
        num_warps=8,
    )  # fmt: skip
    return ce.sum(), hit, grad
