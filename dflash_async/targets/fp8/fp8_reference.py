"""The reference FP8 linear that a GPU FP8 kernel is compared against.

Two pure-torch references of y = x @ W^T for a block-quantized weight (targets/quantized.py):
- `linear_dequantized`: y = x @ dequant(W)^T, what the CPU target computes today;
- `linear_fp8_activations`: x also quantized to e4m3, with one scale per token and 128 input
  channels (1x128, DeepSeek-V3's and DeepGEMM's activation layout), then y = dequant(x) @
  dequant(W)^T in fp32. A kernel computes the same sum block by block (acc += (x_q @ W_q^T) *
  s_x * s_w per 128-wide k block), so it equals this up to fp32 summation order.

Activation scales are per token on purpose: in a packed batch, a token's scale then depends on
its own values alone, so nothing crosses documents (one scale per pack would let a document with
a large activation coarsen every other document's features). The scales are computed on the
device by amax: no value is read back to the host (no CPU-GPU sync).
"""

from __future__ import annotations

import math

import torch

from dflash_async.targets.quantized import FP8_DTYPE, FP8_MAX, dequantize_fp8

ACTIVATION_GROUP = 128  # input channels sharing one activation scale, per token


def quantize_activations(
    x: torch.Tensor, *, group: int = ACTIVATION_GROUP
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q [T, K] e4m3, scales [T, ceil(K/group)] fp32): each token's each `group` channels
    scaled so their largest |value| is 448; an all-zero group (padding rows) gets scale 1."""
    tokens, channels = x.shape
    groups = math.ceil(channels / group)
    padded = x.float().new_zeros(tokens, groups * group)
    padded[:, :channels] = x.float()
    amax = padded.view(tokens, groups, group).abs().amax(dim=-1)  # [T, G]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    full = scale.repeat_interleave(group, dim=-1)[:, :channels]
    return (x.float() / full).to(FP8_DTYPE), scale


def dequantize_activations(
    x_q: torch.Tensor, scale: torch.Tensor, *, group: int = ACTIVATION_GROUP
) -> torch.Tensor:
    """x_q * its token's group scale, fp32 [T, K]."""
    full = scale.repeat_interleave(group, dim=-1)[:, : x_q.shape[-1]]
    return x_q.float() * full


def linear_dequantized(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, *, block: tuple[int, int]
) -> torch.Tensor:
    """y [T, N] = x [T, K] @ dequant(W [N, K])^T in fp32: the weight-only reference."""
    return x.float() @ dequantize_fp8(weight, scale_inv, block=block, dtype=torch.float32).T


def linear_fp8_activations(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    *,
    block: tuple[int, int],
    group: int = ACTIVATION_GROUP,
) -> torch.Tensor:
    """y [T, N] with x quantized per token (1 x `group` scales) as an FP8 kernel would see it."""
    x_q, scale = quantize_activations(x, group=group)
    return linear_dequantized(
        dequantize_activations(x_q, scale, group=group), weight, scale_inv, block=block
    )
