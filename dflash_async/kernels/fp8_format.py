"""The row-wise e4m3 format that both FP8 paths share: the frozen target's matmuls
(`targets/fp8/fp8_linear.py`) and the trainable drafter's (`model/fp8_training.py`).

Owns the e4m3 dtype, its largest value, `quantize_rows` (one fp32 scale per row), `_scaled_mm`'s
alignment, which devices run it row-wise (`rowwise_kernel_problem`), the row-wise product
(`rowwise_mm`) and the target's choice of its accumulation (`FAST_ACCUM`). It lives in model/ because target/ imports model/ (tests/test_layering.py: no
circle of parts), so this is the one place both may import it from.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448: the largest e4m3 value, where a row's amax lands
ALIGN = 16  # _scaled_mm: K and N multiples of 16 (16-byte rows of e4m3)
# The target's FP8 modules' default for the products' fast_accum: Hopper's fast FP8
# accumulation, on since it was measured in whole forwards (H200, 2026-12-03, `bench target
# --quantize none,fp8,fp8-fast`, T = 16384): Qwen3-8B 68.0k -> 73.4k tokens/s, Qwen3-30B-A3B
# 46.4k -> 71.4k, feature error against bf16 0.4637 -> 0.4640 and 0.0997 -> 0.0993 (the e4m3
# rounding dominates; bf16's own noise 0.049 and 0.0091).
FAST_ACCUM = True


def quantize_rows(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """values [..., R, C] -> (e4m3 [..., R, C], scales [..., R] fp32): each row scaled so its
    largest |value| is 448 (an all-zero row gets scale 1). On the values' device, no sync; the
    e4m3 tensor has the values' strides (a transposed view stays transposed)."""
    values = values.float()
    amax = values.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    quantized = (values / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized, scale


def rowwise_kernel_problem(device: torch.device) -> str | None:
    """None when this device runs `torch._scaled_mm` row-wise on e4m3 (CUDA, compute capability
    >= 8.9: Ada, Hopper, Blackwell), else why not."""
    if device.type != "cuda":
        return f"FP8 matmuls run on CUDA only (device is {device.type})"
    if not hasattr(torch, "_scaled_mm"):
        return "this torch has no torch._scaled_mm"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return f"compute capability {major}.{minor} has no FP8 tensor cores"
    return None


def rowwise_mm(
    x_q, x_scale, w_q, w_scale, *, out_dtype: torch.dtype, fast_accum: bool = False
) -> torch.Tensor:
    """x_q [T, K] e4m3 (row-major) @ w_q [N, K]^T (passed column-major as w_q.t()), scaled by
    x_scale [T, 1] and w_scale [1, N]: y [T, N] in out_dtype, fp32 accumulation unless
    `fast_accum` (Hopper's faster FP8 accumulation: the modules' default, FAST_ACCUM)."""
    return torch._scaled_mm(
        x_q,
        w_q.t(),
        scale_a=x_scale,
        scale_b=w_scale,
        out_dtype=out_dtype,
        use_fast_accum=fast_accum,
    )
