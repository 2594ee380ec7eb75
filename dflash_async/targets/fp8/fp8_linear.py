"""FP8 linears of the target on a GPU, and the swap of its decoder into FP8 modules.

Owns the target's linears in the row-wise FP8 format (its quantizer, `quantize_rows`, is
kernels/fp8_format.py's, shared with the drafter's FP8 training; the MoE experts' are
targets/fp8/fp8_experts.py's), and the swap of a loaded target's decoder modules into them
(`swap_fp8_matmuls`):
- weights: e4m3 [N, K] with one fp32 scale per output row (W ~= W_q * s_w[n]); no bf16 copy kept;
- activations: quantized on the device per token (one scale per row of x: amax / 448), so a
  token's scale depends on its own values alone and nothing crosses tokens (or documents);
- the matmul: `torch._scaled_mm` row-wise (scale_a [T, 1], scale_b [1, N], fp32; bf16 out), the
  experts `torch._scaled_grouped_mm` row-wise (scale_a [S], scale_b [E, N]).

Why row-wise and not the checkpoints' 128x128 blocks: row-wise `_scaled_mm` runs on Hopper in
every torch we use (2.11 on the GPU box); `F.scaled_mm` with BlockWise1x128 x BlockWise128x128
exists in torch 2.13's Python API, but is refused on the CPU and untested here on a GPU (not an
option yet). A block-scaled checkpoint weight is therefore requantized per output row on the
device, one weight at a time: dequantized in fp32 (W = W_q * s_block, exact but for fp32's
2^-24), then each row scaled so its amax is 448 and rounded to e4m3 again. That second rounding
is the cost of the format: per element |W_row - W| <= 2^-4 |W| + 2^-10 s_row (e4m3 keeps 3
mantissa bits: half an ulp is 2^-4 relative for normal values; below 2^-6 the subnormal spacing
is 2^-9 of the scale, half of it 2^-10), a fresh e4m3 rounding of the value, zero where the row
scale is the block's scale times a power of two. `tests/targets/test_fp8_linear.py` checks the bound.

CPU-GPU syncs: none in the forwards (amax and scales stay on the device).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dflash_async.kernels.fp8_format import (
    ALIGN,
    FAST_ACCUM,
    quantize_rows,
    rowwise_kernel_problem,
    rowwise_mm,
)
from dflash_async.targets.fp8.fp8_experts import GROUPED_KERNEL, Fp8Experts
from dflash_async.targets.grouped_experts import experts_problem
from dflash_async.targets.quantized import (
    _ROUTERS as ROUTERS,  # kept bf16, as served checkpoints do
)
from dflash_async.targets.quantized import WeightFormat, dequantize_fp8

MIN_FEATURES = 16  # smaller linears (Qwen3.5's shared_expert_gate, N = 1) stay in bf16
KERNEL = "scaled_mm_rowwise"


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (x_q [T, K] e4m3 row-major, scale [T, 1] fp32): one scale per token."""
    x_q, scale = quantize_rows(x)
    return x_q, scale.unsqueeze(-1)


def requantize_blocks_to_rows(
    weight: torch.Tensor, scale_inv: torch.Tensor, *, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A block-scaled e4m3 weight [N, K] (scale_inv [ceil(N/bm), ceil(K/bn)]) -> row-wise
    (e4m3 [N, K], scales [N]): dequantized in fp32 on its device, then `quantize_rows` (the
    error bound is in the module doc)."""
    return quantize_rows(dequantize_fp8(weight, scale_inv, block=block, dtype=torch.float32))


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Fp8Linear(nn.Module):
    """y = x @ W^T + b with W in e4m3 and a scale per output row, x quantized per token.

    weight [N_pad, K_pad] e4m3 and weight_scale [N_pad] fp32 are frozen parameters (so `.to`,
    parameter counts and split placement see them); rows and columns are zero-padded to
    multiples of 16 (`_scaled_mm`'s alignment), and the output is cut back to N.
    """

    def __init__(self, weight_q, weight_scale, bias, *, out_dtype: torch.dtype) -> None:
        super().__init__()
        n, k = weight_q.shape
        self.in_features, self.out_features, self.out_dtype = k, n, out_dtype
        padded = weight_q.new_zeros(_padded(n), _padded(k))
        padded[:n, :k] = weight_q
        scales = weight_scale.new_ones(_padded(n))
        scales[:n] = weight_scale
        self.weight = nn.Parameter(padded, requires_grad=False)
        self.weight_scale = nn.Parameter(scales.float(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.fast_accum = FAST_ACCUM  # set_fast_accum

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, out_dtype: torch.dtype) -> Fp8Linear:
        """Quantize a linear's weight per row, on the weight's device."""
        weight_q, scale = quantize_rows(linear.weight.detach())
        return cls(weight_q, scale, linear.bias, out_dtype=out_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        flat = x.reshape(-1, k)
        if k != self.weight.shape[1]:
            flat = F.pad(flat, (0, self.weight.shape[1] - k))  # zero columns: no change to y
        return self.quantized_forward(*quantize_tokens(flat)).reshape(*lead, self.out_features)

    def quantized_forward(self, x_q: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
        """y [T, N] from x already quantized per token (x_q [T, K_pad] e4m3, x_scale [T, 1])."""
        y = rowwise_mm(
            x_q,
            x_scale,
            self.weight,
            self.weight_scale.view(1, -1),
            out_dtype=self.out_dtype,
            fast_accum=self.fast_accum,
        )[:, : self.out_features]
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 row-wise"


def project(linears: Sequence[nn.Module], x: torch.Tensor) -> list[torch.Tensor]:
    """[linear(x) for linear in linears] (an attention's q, k and v projections of one input),
    with x quantized once when every linear is an `Fp8Linear` of x's width: the same e4m3 rows
    and scales each would compute. Why: torch.compile does not merge the three quantizations
    (it fuses them into one kernel that still computes and writes three copies of the e4m3
    rows; inductor's output code, torch 2.13)."""
    k = x.shape[-1]
    if not all(isinstance(m, Fp8Linear) and m.weight.shape[1] == k for m in linears):
        return [linear(x) for linear in linears]
    x_q, x_scale = quantize_tokens(x.reshape(-1, k))
    return [
        m.quantized_forward(x_q, x_scale).reshape(*x.shape[:-1], m.out_features) for m in linears
    ]


def set_fast_accum(layers: nn.Module, enabled: bool) -> int:
    """Turn Hopper's fast FP8 accumulation on or off in every FP8 linear and experts module
    under `layers` (on after the swap, FAST_ACCUM; `bench target --quantize fp8,fp8-fast`
    compares both).
    Returns how many modules changed; compiled callers must be rebuilt (torch._dynamo.reset)."""
    modules = [m for m in layers.modules() if isinstance(m, Fp8Linear | Fp8Experts)]
    for module in modules:
        module.fast_accum = enabled
    return len(modules)


def kernel_problem(device: torch.device) -> str | None:
    """None when this device runs `torch._scaled_mm` row-wise on e4m3 (CUDA, compute capability
    >= 8.9: Ada, Hopper, Blackwell), else why not (the target is then dequantized)."""
    problem = rowwise_kernel_problem(device)
    return None if problem is None else f"{problem}: dequantized"


def matmul_kernel(weights: WeightFormat, device: torch.device, *, enabled: bool) -> WeightFormat:
    """The format with the matmul kernel its decoder layers will run and why (target_path_chosen)."""
    if weights.name == "bf16":
        return dataclasses.replace(weights, kernel_reason="an unquantized target, QUANTIZE=none")
    if weights.name == "mxfp4":
        return dataclasses.replace(
            weights,
            kernel_reason="mxfp4 experts dequantized to the compute dtype (no MXFP4 kernel here)",
        )
    problem = kernel_problem(device) if enabled else "FP8 matmuls turned off: dequantized"
    if problem:
        return dataclasses.replace(weights, kernel_reason=problem)
    grouped = GROUPED_KERNEL if hasattr(torch, "_scaled_grouped_mm") else "a per-expert loop"
    why = (
        f"e4m3 weights with a scale per output row, activations per token on the device, "
        f"fast accumulation; "
        f"fused SiLU MoE experts' gate_up through the routed Triton kernel (fp8_moe_kernel: "
        f"the routing's gather and the gate in the product) and their down through "
        f"{grouped}, other experts' products through {grouped}; "
        f"128x128 block checkpoints requantized per row"
    )
    return dataclasses.replace(weights, dequantized=False, kernel=KERNEL, kernel_reason=why)


@torch.no_grad()
def swap_fp8_matmuls(
    layers: nn.Module,
    *,
    device: torch.device,
    out_dtype: torch.dtype = torch.bfloat16,
    sources: dict[str, Callable[[], tuple]] | None = None,
) -> dict[str, int]:
    """Replace the decoder's linears (but routers and tiny ones) by `Fp8Linear` and its fused
    HF experts by `Fp8Experts` (where `experts_problem` is None), one module at a time: each
    weight is moved to `device`, quantized there and its bf16 copy dropped. `sources` maps a
    module name (relative to `layers`) to a loader of its checkpoint's (e4m3, scale_inv, block),
    requantized from the block format instead of the (dequantized) weight. Returns counts."""
    sources = sources or {}
    swapped = {"linear": 0, "experts": 0, "kept": 0}
    for name, module in list(layers.named_modules()):
        parent_name, _, last = name.rpartition(".")
        parent = layers.get_submodule(parent_name) if name else None
        if isinstance(module, nn.Linear) and last not in ROUTERS:
            if min(module.in_features, module.out_features) < MIN_FEATURES:
                swapped["kept"] += 1
                continue
            if name in sources:
                fp8, scale_inv, block = sources[name]()
                weight_q, scale = requantize_blocks_to_rows(
                    fp8.to(device), scale_inv.to(device), block=block
                )
                bias = None if module.bias is None else module.bias.to(device)
                new = Fp8Linear(weight_q, scale, bias, out_dtype=out_dtype)
            else:
                new = Fp8Linear.from_linear(module.to(device), out_dtype=out_dtype)
            setattr(parent, last, new)
            swapped["linear"] += 1
        elif last == "experts" and experts_problem(module) is None:
            setattr(parent, last, Fp8Experts(module.to(device), out_dtype=out_dtype))
            swapped["experts"] += 1
    return swapped
