"""The FP8 MoE experts of the target on a GPU: `Fp8Experts`, HF's fused experts call
with e4m3 row-wise expert weights, in three ways (its docstring), and the grouped FP8 product
(`grouped_kernel`) the sorted and split ways run.

The format is targets/fp8/fp8_linear.py's (weights per output row, activations per token on the
device); targets/fp8/fp8_routed.py and fp8_moe_kernel.py own the routed kernel, fp8_gate_kernel.py the
gate and row kernels, grouped_experts.py the routing layout, the combine and which HF experts modules either
drop-in computes exactly (`experts_problem`).

CPU-GPU syncs: none (the routing offsets and the block table stay on the device), except the
per-expert loop `_grouped_loop` (offs.tolist(), one sync per call), used only where
`torch._scaled_grouped_mm` does not exist or cannot run (the CPU tests).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from dflash_async.kernels.fp8_format import FAST_ACCUM, quantize_rows, rowwise_mm
from dflash_async.kernels.fp8_moe_launch import DOWN_LAUNCH, GATE_UP_LAUNCH, launch_problem
from dflash_async.targets.fp8.fp8_routed import routed_reference, routed_rows
from dflash_async.targets.grouped_experts import (
    combine,
    gated,
    sort_by_expert,
    sum_over_k,
)

GROUPED_KERNEL = "scaled_grouped_mm_rowwise"


def _grouped_native(x_q, x_scale, w_q, w_scale, offsets, *, out_dtype, fast_accum=False):
    """torch._scaled_grouped_mm row-wise: x_q [S, K] rows grouped by expert (offsets [E] int32,
    cumulative), w_q [E, N, K] passed column-major; x_scale [S], w_scale [E, N]."""
    return torch._scaled_grouped_mm(
        x_q,
        w_q.transpose(-2, -1),
        x_scale,
        w_scale,
        offs=offsets,
        out_dtype=out_dtype,
        use_fast_accum=fast_accum,
    )


def _grouped_loop(x_q, x_scale, w_q, w_scale, offsets, *, out_dtype, fast_accum=False):
    """The same product, one `_scaled_mm` per expert. Sync point: offsets.tolist() (once per call);
    only where _scaled_grouped_mm is missing or has no kernel (the CPU)."""
    out = torch.zeros(x_q.shape[0], w_q.shape[1], dtype=out_dtype, device=x_q.device)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            out[start:end] = rowwise_mm(
                x_q[start:end],
                x_scale[start:end, None],
                w_q[e],
                w_scale[e][None],
                out_dtype=out_dtype,
                fast_accum=fast_accum,
            )
        start = end
    return out


def grouped_kernel(device: torch.device) -> tuple[Callable, str]:
    """(the experts' grouped FP8 product, its name). `_scaled_grouped_mm` (one launch for every
    expert, no sync) where torch has it on a CUDA device; else the per-expert loop, which syncs
    once per layer and launches up to E matmuls (chosen without measurement: the grouped kernel
    is one launch over the same FLOPs, the loop cannot be faster). fbgemm-gpu-genai 1.6's
    `f8f8bf16_rowwise_grouped_stacked` was measured against it on an H200 (2026-12-05,
    benchmarks/fp8_experts_gpu.py): the same outputs bit for bit and the same time at the
    Qwen3-30B-A3B experts' shapes (0.833 / 0.837 ms gate_up, 0.604 / 0.606 down), torch's being
    the same CUTLASS kernel; so no second dependency."""
    if device.type == "cuda" and hasattr(torch, "_scaled_grouped_mm"):
        return _grouped_native, GROUPED_KERNEL
    return _grouped_loop, "scaled_mm_rowwise_per_expert_loop"


def is_silu(act_fn: Callable) -> bool:
    """Whether an experts module's activation is SiLU: torch's module, or transformers'
    SiLUActivation (what ACT2FN["silu"] gives in transformers 5.x, F.silu underneath)."""
    from transformers import activations

    silu_types = tuple(t for t in (nn.SiLU, getattr(activations, "SiLUActivation", None)) if t)
    return isinstance(act_fn, silu_types)


def _sorted_rows(hidden_states, top_k_index, num_experts: int):
    """grouped_experts.sort_by_expert's rows quantized per row: (x_q [S, d] e4m3, x_scale [S],
    perm [S], offsets [E] int32), S = T * k. A routed row is its token's row, so the tokens are
    quantized first and their e4m3 rows and scales gathered: the same values as quantizing the
    S gathered rows, with k times fewer rows reduced and 1-byte rows moved (the gather and
    quantize of the rows took 0.43 ms per Qwen3-30B-A3B layer at T = 16384 on an H200,
    2026-12-03, benchmarks/profile_target_gpu.py)."""
    tokens_q, token_scale = quantize_rows(hidden_states)  # [T, d], [T]
    x_q, perm, offsets = sort_by_expert(tokens_q, top_k_index, num_experts)
    return x_q, token_scale[perm // top_k_index.shape[1]], perm, offsets


def _gated_rows(h, act_fn):
    """grouped_experts.gated (act(gate) * up) of the grouped gate_up output, quantized per row."""
    return quantize_rows(gated(h, act_fn))


def _routed_problem(gate_up, down, *, silu: bool, on_gpu: bool) -> str | None:
    """None when the routed kernel can run these e4m3 experts (on the CPU its reference takes
    any shape), else why not."""
    if not silu:
        return "the routed kernel gates with SiLU only"
    if not on_gpu:
        return None
    return launch_problem(gate_up, GATE_UP_LAUNCH, gated=True) or launch_problem(down, DOWN_LAUNCH)


WAYS = ("routed", "split", "sorted")  # Fp8Experts' ways, see there


class Fp8Experts(nn.Module):
    """The HF experts call `(hidden [T, d], top_k_index [T, k], top_k_weights [T, k]) -> [T, d]`
    with e4m3 row-wise expert weights: the tokens quantized per row (a routed row is one
    token), the two grouped FP8 products, the gate between them (its output quantized per row),
    the routing weights, the sum over k in fp32. Three ways to run it (`way`):
    - "split" (the default where fp8_moe_launch.launch_problem allows, with the gate kernel): the
      routed kernel's gate_up product (fp8_moe_kernel: it gathers the token rows through the
      routing and applies the SiLU gate, fp8_routed's module doc), then the down product through
      `torch._scaled_grouped_mm` on the rows in expert order and `combine`; the tokens and the
      gate output are quantized by fp8_gate_kernel's row kernel;
    - "routed": the same, but the routed kernel's down product too (it weights and scatters the
      rows to their routed pairs, then a contiguous sum over k). Its down product ran 0.68-0.74
      ms a Qwen3-30B-A3B layer against `_scaled_grouped_mm`'s 0.58-0.63 (the scatter gaining
      nothing over `combine`), hence split (H200, 2026-12-05, BENCHMARKS.md);
    - "sorted": the rows gathered in expert order, the grouped kernel for both products (or the
      CPU's per-expert loop), the gate, the routing weights and the inverse permutation in
      `combine`.
    The routed kernel accumulates the fast way only, so "routed" and "split" run as "sorted"
    while `fast_accum` is off. On the CPU (tests) the routed kernel's place is taken by
    fp8_routed.routed_reference and its row kernel's by `quantize_rows`. `set_way` changes the
    way after construction (`set_experts_way`: bench target times them side by side).

    `compile` (default: on CUDA) runs the parts around the grouped products (routing and
    quantization; gate and quantization; the weights and the sum) each as one torch.compile'd
    function: eager, they are ~15 elementwise passes over the [T * k, d] rows per layer, which
    made the Qwen3-30B-A3B shape's FP8 target forward slower than bf16 (641 ms against 394 ms
    at T = 16384, H200, 2026-12-02). The grouped products stay eager, outside the graphs.
    `gate_kernel` (default: with `compile`, for a SiLU gate) runs the sorted way's gate and its
    quantization as fp8_gate_kernel's Triton kernel instead of the compiled function (the same
    values but for rare one-step e4m3 roundings: 82 of 100.7M at the Qwen3-30B-A3B shape,
    BENCHMARKS.md).
    """

    takes_residual = True  # forward's `residual` is added in the last compiled pass (combine)

    def __init__(
        self,
        experts: nn.Module,
        *,
        out_dtype: torch.dtype,
        compile: bool | None = None,
        gate_kernel: bool | None = None,
        way: str | None = None,
    ) -> None:
        super().__init__()
        self.num_experts, self.act_fn = experts.num_experts, experts.act_fn
        self.out_dtype = out_dtype
        gate_up, gate_up_scale = quantize_rows(experts.gate_up_proj.detach())
        down, down_scale = quantize_rows(experts.down_proj.detach())
        for name, value in (
            ("gate_up_proj", gate_up),
            ("gate_up_scale", gate_up_scale),
            ("down_proj", down),
            ("down_scale", down_scale),
        ):
            setattr(self, name, nn.Parameter(value, requires_grad=False))
        on_gpu = gate_up.device.type == "cuda"
        compile = on_gpu if compile is None else compile
        wrap = (lambda fn: torch.compile(fn, dynamic=False)) if compile else (lambda fn: fn)
        self._sorted_rows, self._combined = wrap(_sorted_rows), wrap(combine)
        silu = is_silu(self.act_fn)
        gate_kernel = compile and silu if gate_kernel is None else gate_kernel
        if gate_kernel and not silu:
            raise ValueError(f"the gate kernel computes SiLU gates, not {self.act_fn}")
        if gate_kernel:
            from dflash_async.kernels.fp8_gate_kernel import silu_gate_quantize  # GPU: triton

            self._gated_rows = silu_gate_quantize
        else:
            self._gated_rows = functools.partial(wrap(_gated_rows), act_fn=self.act_fn)
        self.launches = (GATE_UP_LAUNCH, DOWN_LAUNCH)
        self.grouped, self.kernel = grouped_kernel(gate_up.device)
        self.routed_problem = _routed_problem(gate_up, down, silu=silu, on_gpu=on_gpu)
        if self.routed_problem is None:
            if on_gpu:
                from dflash_async.kernels.fp8_gate_kernel import quantize_rows_kernel
                from dflash_async.kernels.fp8_moe_kernel import routed_mm  # GPU: triton

                self._routed_mm, self._quantized = routed_mm, quantize_rows_kernel
            else:  # the CPU's reference takes any shape
                self._routed_mm, self._quantized = routed_reference, quantize_rows
            routing = {
                "num_experts": self.num_experts,
                "block_rows": GATE_UP_LAUNCH.block_rows,
                "weight_dtype": out_dtype,
            }
            self._routing = functools.partial(wrap(routed_rows), **routing)
            self._summed = wrap(sum_over_k)
        if way is None:
            way = "split" if gate_kernel and self.routed_problem is None else "sorted"
        self.set_way(way)
        self.fast_accum = FAST_ACCUM  # set_fast_accum

    def set_way(self, way: str) -> None:
        """Run the experts `way` (one of WAYS); ValueError when this module cannot (compiled
        callers must be rebuilt: torch._dynamo.reset)."""
        if way not in WAYS:
            raise ValueError(f"experts way {way!r}: one of {', '.join(WAYS)}")
        if way != "sorted" and self.routed_problem:
            raise ValueError(f"the routed kernel cannot run these experts: {self.routed_problem}")
        self.way = way

    @property
    def _routes(self) -> bool:
        """Whether a call starts with the routed gate_up product (the routed and split ways,
        while fast accumulation is on: the kernel's only accumulation)."""
        return self.way != "sorted" and self.fast_accum

    def quantized_tokens(self, hidden_states: torch.Tensor):
        """(e4m3 [T, d], scales [T]) of the tokens as `forward(..., tokens=)` takes them, or None
        where this way does not take them (sorted). Torch ops, for a compiled caller to fuse
        with what makes the tokens (the packed forward's post-attention norm:
        packed_dense.attention_and_route), instead of the row kernel reading them again."""
        return quantize_rows(hidden_states) if self._routes else None

    def forward(
        self, hidden_states, top_k_index, top_k_weights, residual=None, tokens=None
    ) -> torch.Tensor:
        """HF's experts call; `residual` [T, d] added to the output (`takes_residual`), `tokens`
        the hidden states already quantized per row (`quantized_tokens`; else done here)."""
        if self._routes:
            return self._routed(hidden_states, top_k_index, top_k_weights, residual, tokens)
        x_q, x_scale, perm, offsets = self._sorted_rows(
            hidden_states, top_k_index, self.num_experts
        )
        h = self.grouped(
            x_q,
            x_scale,
            self.gate_up_proj,
            self.gate_up_scale,
            offsets,
            out_dtype=self.out_dtype,
            fast_accum=self.fast_accum,
        )
        h_q, h_scale = self._gated_rows(h)
        out = self.grouped(
            h_q,
            h_scale,
            self.down_proj,
            self.down_scale,
            offsets,
            out_dtype=self.out_dtype,
            fast_accum=self.fast_accum,
        )
        return self._combined(out, top_k_weights, perm, hidden_states.dtype, residual)

    def _routed(self, hidden_states, top_k_index, top_k_weights, residual, tokens):
        """The routed and the split way: both start with the routed gate_up product."""
        # a routed row is one token: the tokens quantized, not the T * k rows
        tokens_q, token_scale = tokens or self._quantized(hidden_states)
        token, perm, offsets, blocks, pair_weights = self._routing(top_k_index, top_k_weights)
        gate_up, down = self.launches
        h = self._routed_mm(
            tokens_q,
            token_scale,
            self.gate_up_proj,
            self.gate_up_scale,
            offsets,
            blocks,
            a_rows=token,
            gated=True,
            out_dtype=self.out_dtype,
            launch=gate_up,
        )
        h_q, h_scale = self._quantized(h)
        if self.way == "split":  # rows in expert order, then combined as the sorted way does
            out = self.grouped(
                h_q,
                h_scale,
                self.down_proj,
                self.down_scale,
                offsets,
                out_dtype=self.out_dtype,
                fast_accum=True,
            )
            return self._combined(out, top_k_weights, perm, hidden_states.dtype, residual)
        out = self._routed_mm(
            h_q,
            h_scale,
            self.down_proj,
            self.down_scale,
            offsets,
            blocks,
            out_rows=perm,
            row_weights=pair_weights,
            out_dtype=self.out_dtype,
            launch=down,
        )
        return self._summed(out, top_k_index.shape[1], hidden_states.dtype, residual)


def set_experts_way(layers: nn.Module, way: str) -> int:
    """`Fp8Experts.set_way` on every FP8 experts module under `layers` (bench target times the
    ways side by side). Returns how many changed; compiled callers must be rebuilt."""
    modules = [m for m in layers.modules() if isinstance(m, Fp8Experts)]
    for module in modules:
        module.set_way(way)
    return len(modules)
