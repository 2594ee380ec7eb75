"""FP8 matmuls of the trainable drafter's linears (DFLASH_TRAIN__FP8_MATMULS).

Owns the training recipe of the drafter's FP8 linears and how it is installed: `Fp8Matmul`
(y = x @ W^T as an autograd.Function), its three products (`forward_product`, `input_gradient`,
`weight_gradient`), the kernel-free reference of the FP8 product (`dequantized_product`), and
`use_fp8_matmuls(drafter)`, which makes the drafter's linears compute through it.

The recipe follows torchao float8's row-wise recipes (torchtitan's `--float8.recipe_name`), in
the row-wise e4m3 format of kernels/fp8_format.py (one fp32 scale per row, amax / 448, scales not
rounded to powers of two):
- forward, y = x @ W^T: x [M, K] quantized per row (token), W [N, K] per output row;
  `torch._scaled_mm(x_q, w_q.t(), scale_a [M, 1], scale_b [1, N], out_dtype=bf16,
  use_fast_accum=True)` (Hopper's fast accumulation, as torchao and the target's FP8 use it);
- grad_x = dy @ W: dy [M, N] quantized per row, W^T [K, N] per row of W^T (per input column of
  W, as torchao's `rowwise`; its `rowwise_with_gw_hp` takes one tensor-wise scale of W here),
  fp32 accumulation (use_fast_accum=False, torchao's default for gradients);
- grad_W = dy^T @ x from the unquantized dy and x, in the compute dtype (bf16 on a GPU, what a
  bf16 linear's backward computes), as torchao's `rowwise_with_gw_hp` (its `rowwise` runs this
  one in FP8 too). Why high precision: this product sums over the M tokens, so row-wise scales
  of its operands would run along the tokens (one scale per feature for all of a pack's tokens:
  one outlier token coarsens every other token's contribution), and its result goes straight
  into AdamW. Two of the three matmuls run in FP8.

Weights: the modules keep their parameters (fp32 masters; step.py's bf16 working copies are
read in their place): each forward quantizes the weight tensor it reads, and its gradient is the
bf16 grad_W above. Nothing is renamed, so state dicts, checkpoints and exports are unchanged.
Scales: amax per row on the device, never read back, nothing made on the host: no sync, and the
step captures as a CUDA graph and compiles with fullgraph=True (dynamo traces the Function).

The kernel runs on a CUDA device of compute capability >= 8.9 (`rowwise_kernel_problem`) with
bf16 outputs (the compute dtype on a GPU, and the one row-wise `_scaled_mm` is known to take).
Elsewhere (the CPU, older GPUs, another output dtype) the same quantization feeds
`dequantized_product`: (x_q * s_x) @ (w_q * s_w)^T in fp32, rounded once to the output dtype, the
kernel's result but for how it accumulates, so CPU tests cover the recipe. It is only for tests:
it is slower than the plain matmul, and a run refuses the setting on such devices
(pipeline/specs.py).

Alignment: `_scaled_mm` needs K and N multiples of 16 (ALIGN); a linear that is not (or has a
bias: the drafter's have none) stays a plain linear in the compute dtype, and
`use_fp8_matmuls` names it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dflash_async.kernels.fp8_format import (
    ALIGN,
    quantize_rows,
    rowwise_kernel_problem,
    rowwise_mm,
)
from dflash_async.model.drafter import compute_dtype

KERNEL = "scaled_mm_rowwise"
REFERENCE = "dequantized_reference"
FORWARD_FAST_ACCUM = True  # y: Hopper's fast FP8 accumulation (torchao's default for the output)
GRADIENT_FAST_ACCUM = False  # grad_x: fp32 accumulation (torchao's default for gradients)


def dequantized_product(a_q, a_scale, b_q, b_scale, *, out_dtype: torch.dtype) -> torch.Tensor:
    """(a_q * a_scale) @ (b_q * b_scale)^T in fp32, rounded once to out_dtype: a_q [M, K] and
    b_q [N, K] e4m3 with one scale per row ([M], [N]). What `_scaled_mm` computes, but for its
    accumulation order; autocast is off inside, so the product stays fp32 under it."""
    with torch.autocast(a_q.device.type, enabled=False):
        a = a_q.float() * a_scale[:, None]
        b = b_q.float() * b_scale[:, None]
        y = a @ b.t()
    # No `.to` when it would be a no-op (fp32 out, the CPU tests): torch 2.11's dynamo gives an
    # autograd.Function whose output is `t.to(t.dtype)` zero gradients (reproduced on the CPU
    # with torch 2.11.0; 2.13 is right). Eager, both spellings are the same tensor.
    return y if y.dtype == out_dtype else y.to(out_dtype)


def rowwise_product(
    a: torch.Tensor, b: torch.Tensor, *, out_dtype: torch.dtype, kernel: bool, fast_accum: bool
) -> torch.Tensor:
    """a [M, K] @ b [N, K]^T with both quantized per row to e4m3: `_scaled_mm` row-wise (kernel)
    or `dequantized_product`. The e4m3 operands are made contiguous: `_scaled_mm` takes a
    row-major first operand and a column-major second (b_q.t() of a row-major b_q), and a
    transposed b (W^T in the backward) quantizes with W's strides."""
    a_q, a_scale = quantize_rows(a)
    b_q, b_scale = quantize_rows(b)
    a_q, b_q = a_q.contiguous(), b_q.contiguous()
    if not kernel:
        return dequantized_product(a_q, a_scale, b_q, b_scale, out_dtype=out_dtype)
    return rowwise_mm(
        a_q, a_scale[:, None], b_q, b_scale[None, :], out_dtype=out_dtype, fast_accum=fast_accum
    )


def forward_product(x, weight, *, out_dtype: torch.dtype, kernel: bool) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W [N, K]^T: x per token, W per output row, fast accumulation."""
    return rowwise_product(
        x, weight, out_dtype=out_dtype, kernel=kernel, fast_accum=FORWARD_FAST_ACCUM
    )


def input_gradient(grad_out, weight, *, out_dtype: torch.dtype, kernel: bool) -> torch.Tensor:
    """grad_x [M, K] = dy [M, N] @ W [N, K]: dy per token, W^T [K, N] per row (per input column
    of W), fp32 accumulation."""
    return rowwise_product(
        grad_out, weight.t(), out_dtype=out_dtype, kernel=kernel, fast_accum=GRADIENT_FAST_ACCUM
    )


def weight_gradient(grad_out, x, *, dtype: torch.dtype) -> torch.Tensor:
    """grad_W [N, K] = dy [M, N]^T @ x [M, K] in `dtype` from the unquantized tensors (the
    high-precision weight gradient of the recipe, the module doc says why)."""
    return grad_out.to(dtype).t() @ x.to(dtype)


class Fp8Matmul(torch.autograd.Function):
    """y = x @ W^T (x [M, K], W [N, K]) in the recipe of the module doc. Saves x and W as they
    came (what a bf16 linear saves) and quantizes in the backward again."""

    @staticmethod
    def forward(ctx, x, weight, out_dtype: torch.dtype, kernel: bool):
        ctx.save_for_backward(x, weight)
        ctx.out_dtype, ctx.kernel = out_dtype, kernel
        return forward_product(x, weight, out_dtype=out_dtype, kernel=kernel)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_x = input_gradient(grad_out, weight, out_dtype=ctx.out_dtype, kernel=ctx.kernel)
            grad_x = grad_x.to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_weight = weight_gradient(grad_out, x, dtype=ctx.out_dtype).to(weight.dtype)
        return grad_x, grad_weight, None, None


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, *, kernel: bool) -> torch.Tensor:
    """x [..., K] @ W [N, K]^T through `Fp8Matmul`, in the dtype a plain linear would give (the
    autocast dtype when autocast is on, else x's); the kernel only for bf16 outputs."""
    out_dtype = compute_dtype(x)
    flat = x.reshape(-1, x.shape[-1])
    y = Fp8Matmul.apply(flat, weight, out_dtype, kernel and out_dtype == torch.bfloat16)
    return y.view(*x.shape[:-1], weight.shape[0])


class Fp8TrainingLinear(nn.Linear):
    """An nn.Linear (no bias) whose matmul runs through `Fp8Matmul`; `fp8_kernel`: the
    `_scaled_mm` kernel, else the reference product.

    Installed by `use_fp8_matmuls` as a class swap of the existing module (`__class__`), not a
    new module: the parameters stay the very same objects under the same names (state dict,
    optimizer, checkpoints, exports, step.py's working copies by name untouched), the module
    stays an nn.Linear (initialisation, `isinstance` checks), and `forward` reads `self.weight`
    the way nn.Linear does, so step.py's functional_call swap of the bf16 working copies reaches
    the Function. A forward assigned on the instance would do as much but is invisible in the
    module's type and repr, and dynamo guards on a class more simply than on an instance
    attribute holding a function."""

    fp8_kernel: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_matmul(x, self.weight, kernel=self.fp8_kernel)

    def extra_repr(self) -> str:
        path = KERNEL if self.fp8_kernel else REFERENCE
        return f"{super().extra_repr()}, e4m3 row-wise ({path})"


@dataclass(frozen=True)
class Fp8Matmuls:
    """What `use_fp8_matmuls` did: the path, why (when it is the reference), the linears now in
    FP8 and those kept in the compute dtype (not aligned to 16, or with a bias), by name."""

    path: str  # KERNEL or REFERENCE
    reason: str | None
    fp8: tuple[str, ...]
    kept: tuple[str, ...]


def fp8_problem(linear: nn.Linear) -> str | None:
    """None when `Fp8Matmul` can run this linear, else why it stays as it is."""
    if linear.bias is not None:
        return "has a bias"
    if linear.in_features % ALIGN or linear.out_features % ALIGN:
        return f"{linear.in_features}x{linear.out_features} is not a multiple of {ALIGN}"
    return None


def use_fp8_matmuls(drafter: nn.Module, *, kernel: bool | None = None) -> Fp8Matmuls:
    """Make every nn.Linear of `drafter` that `Fp8Matmul` can run (attention q/k/v/o, MLP
    gate/up/down, fc, DFlash2's kernel and hidden projections, when aligned) an
    `Fp8TrainingLinear`, in place; call before the first forward (compiled layers trace the
    class). kernel: `_scaled_mm` (True), the reference (False), or None: the kernel where the
    drafter's device runs it. Parameters, their names and values are untouched."""
    device = next(drafter.parameters()).device
    reason = rowwise_kernel_problem(device)
    if kernel is None:
        kernel = reason is None
    fp8, kept = [], []
    for name, module in drafter.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if fp8_problem(module) is not None:
            kept.append(name)
            continue
        module.__class__ = Fp8TrainingLinear
        module.fp8_kernel = kernel
        fp8.append(name)
    if not kernel:
        reason = reason or "the reference asked for (kernel=False)"
    return Fp8Matmuls(
        KERNEL if kernel else REFERENCE, None if kernel else reason, tuple(fp8), tuple(kept)
    )
