"""The FP8 experts' SiLU gate and its quantization as one Triton kernel (GPU only, imported lazily).

Same contract as `quantize_rows(F.silu(gate.float()) * up.float())` on a grouped gate_up output
h [S, 2I] (gate = h[:, :I], up = h[:, I:]; what fp8_linear's compiled `_gated_rows` computes, in
fp32 from the bf16 rows): e4m3 rows [S, I], each scaled so its largest |value| is 448, and their
fp32 scales [S] (an all-zero row gets scale 1). Each program owns whole rows, so a row's amax
is a reduction inside one program and each input byte is read once. Why a kernel of our own:
torch.compile's reduction kernel moved those bytes at ~1.2 TB/s (0.436 ms per Qwen3-30B-A3B
layer, S = 131072 rows of 2 x 768; the bf16 gate alone runs at ~4.4), this one at 2.3 (0.216 ms),
and the FP8 target forward went from 1.19x to 1.26x the bf16 one's speed (H200, BENCHMARKS.md).

The arithmetic follows torch's: silu(x) = x / (1 + exp(-x)), the scale amax / 448 as an IEEE
division rounds it (tl.div_rn; torch's eager division by a scalar on CUDA multiplies by the
scalar's reciprocal, so its scales can differ from these by one fp32 ulp), each value times
448 / amax, saturated to +-448 and rounded to
nearest e4m3. exp and the per-value division are Triton's fast ones (ex2.approx of x * log2(e),
within ~|x| * 2^-23 relative; div.full, 2 ulp) and the product by the reciprocal is within
1.5 ulp of the quotient: IEEE divisions per value ran the kernel at ~1.45 TB/s at best, no faster
than the compiled torch function (H200, BENCHMARKS.md). So a value can differ from torch's by a
few ulp and, rarely, its e4m3 rounding by one step.
`quantize_rows_kernel` is the same kernel without the gate: `quantize_rows(x)` of bf16 rows
(what the routed experts, whose gate_up product applies the gate itself, quantize between their
two products, and their tokens before the first).
tests/kernels/test_fp8_gate_kernel_gpu.py compares both with the torch reference on a GPU (and the
comparison with mutants); where the kernel does not run, the compiled torch function does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dflash_async.kernels.fp8_format import FP8_DTYPE, FP8_MAX

# Rows per program and warps (benchmarks/fp8_experts_gpu.py times 1-4 rows, 4-8 warps, H200) at
# the Qwen3-30B-A3B shape (T = 16384, top 8): 4 rows, 8 warps took 0.184 ms for the gate (1 row,
# 4 warps: 0.216; 2026-12-04), 0.053 ms for the tokens' rows [16384, 2048] (0.066) and 0.114
# ms for the gate output's [131072, 768] (0.118; 2026-12-05), the same e4m3 values.
ROWS_PER_PROGRAM = 4
NUM_WARPS = 8


@triton.jit
def _silu_gate_quantize_kernel(
    h_ptr,
    q_ptr,
    scale_ptr,
    num_rows,
    width,
    stride_h,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    FP8_LIMIT: tl.constexpr,
    GATED: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]  # [ROWS, 1]
    columns = tl.arange(0, BLOCK)[None, :]  # [1, BLOCK]: the row's output values, padded to 2^n
    here = (rows < num_rows) & (columns < width)
    values = tl.load(h_ptr + rows * stride_h + columns, mask=here, other=0.0).to(tl.float32)
    if GATED:  # values is the gate half; 0 on padded columns either way
        up = tl.load(h_ptr + rows * stride_h + width + columns, mask=here, other=0.0)
        values = values / (1.0 + tl.exp(-values)) * up.to(tl.float32)
    amax = tl.max(tl.abs(values), axis=1, keep_dims=True)  # [ROWS, 1]
    scale = tl.where(amax > 0, tl.div_rn(amax, FP8_LIMIT), 1.0)  # torch's, exactly
    # x * (448 / amax), not x / scale: one division a row instead of one a value
    inverse = tl.where(amax > 0, tl.div_rn(FP8_LIMIT, amax), 1.0)
    scaled = tl.clamp(values * inverse, -FP8_LIMIT, FP8_LIMIT)
    tl.store(q_ptr + rows * width + columns, scaled.to(q_ptr.dtype.element_ty), mask=here)
    tl.store(scale_ptr + rows, scale, mask=rows < num_rows)


def silu_gate_quantize(
    h: torch.Tensor, *, rows_per_program: int = ROWS_PER_PROGRAM, num_warps: int = NUM_WARPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """h [S, 2I] (a grouped gate_up output, last dim contiguous) -> (e4m3 [S, I], scales [S]
    fp32): the module docstring's contract. No host sync."""
    if h.dim() != 2 or h.shape[1] % 2 or h.stride(1) != 1:
        raise ValueError(f"h {tuple(h.shape)} strides {h.stride()} is not [S, 2I], rows dense")
    return _launch(
        h, h.shape[1] // 2, gated=True, rows_per_program=rows_per_program, num_warps=num_warps
    )


def quantize_rows_kernel(
    x: torch.Tensor, *, rows_per_program: int = ROWS_PER_PROGRAM, num_warps: int = NUM_WARPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] (last dim contiguous) -> (e4m3 [R, C], scales [R] fp32): `quantize_rows(x)`
    within the module docstring's rounding. No host sync."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x {tuple(x.shape)} strides {x.stride()} is not [R, C], rows dense")
    return _launch(
        x, x.shape[1], gated=False, rows_per_program=rows_per_program, num_warps=num_warps
    )


def _launch(h, width: int, *, gated: bool, rows_per_program: int, num_warps: int):
    num_rows = h.shape[0]
    quantized = torch.empty((num_rows, width), dtype=FP8_DTYPE, device=h.device)
    scale = torch.empty(num_rows, dtype=torch.float32, device=h.device)
    grid = (triton.cdiv(num_rows, rows_per_program),)
    _silu_gate_quantize_kernel[grid](
        h,
        quantized,
        scale,
        num_rows,
        width,
        h.stride(0),
        ROWS=rows_per_program,
        BLOCK=triton.next_power_of_2(width),
        FP8_LIMIT=FP8_MAX,
        GATED=gated,
        num_warps=num_warps,
    )
    return quantized, scale
