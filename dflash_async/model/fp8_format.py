"""The row-wise e4m3 format that both FP8 paths share: the frozen target's matmuls
(`target/fp8_linear.py`) and the trainable drafter's (`model/fp8_training.py`).

Owns the e4m3 dtype, its largest value and `quantize_rows`, one fp32 scale per row. Here, in
model/, because target/ imports model/ (tests/test_layering.py: no circle of parts), so this is
the one place both may import it from.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448: the largest e4m3 value, where a row's amax lands


def quantize_rows(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """values [..., R, C] -> (e4m3 [..., R, C], scales [..., R] fp32): each row scaled so its
    largest |value| is 448 (an all-zero row gets scale 1). On the values' device, no sync; the
    e4m3 tensor has the values' strides (a transposed view stays transposed)."""
    values = values.float()
    amax = values.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    quantized = (values / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized, scale
