"""The launches of the routed FP8 MoE kernel (kernels/fp8_moe_kernel.py) and the check that a
weight fits one: plain torch, importable without triton, so the CPU and the caller choose a
launch without importing the kernel.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class Launch:
    """One launch of the routed kernel: rows, columns and reduction width of a program's tile
    (block_rows is also the routing table's block), its warps and pipeline stages."""

    block_rows: int = 128
    block_n: int = 128
    block_k: int = 128
    num_warps: int = 8
    num_stages: int = 4


LAUNCH = Launch()
SHARED_BYTES = 232448  # a Hopper SM's shared memory for one program (what Triton refuses above)
# Each product's launch, timed alone at the Qwen3-30B-A3B experts' shape (T = 16384, top 8; H200,
# 2026-12-04, benchmarks/fp8_experts_gpu.py --sweep, BENCHMARKS.md). Ungated, 16 launches:
# gate_up (K = 2048) best at 256 columns, 0.798 ms, 1,033 TFLOP/s (`_scaled_grouped_mm`
# 0.835), down (K = 768) at 256 columns and 3 stages, 0.672 ms (0.589). Gated, gate_up's 128
# gate and 128 up columns (the registers of 256 ungated; 256 + 256 are over the shared memory
# at 3 stages): 0.86-0.93 ms on three machines. One block_rows for both: one routing table.
GATE_UP_LAUNCH = Launch()
DOWN_LAUNCH = Launch(block_n=256, num_stages=3)


def launch_problem(weight: torch.Tensor, launch: Launch, *, gated: bool = False) -> str | None:
    """None when the kernel computes this expert weight [E, N, K] (e4m3, contiguous) under
    `launch`: N (each half of it, `gated`) and K whole tiles, so its loads need no column
    masks; else why not."""
    _, n, k = weight.shape
    if not weight.is_contiguous():
        return "the expert weights are not contiguous"
    if (n // 2 if gated else n) % launch.block_n or k % launch.block_k or (gated and n % 2):
        return (
            f"expert weights [{n}, {k}] are not whole {launch.block_n}x{launch.block_k} "
            f"tiles{' per half' if gated else ''}"
        )
    tiles = launch.block_rows + (2 if gated else 1) * launch.block_n  # e4m3 rows per stage
    shared = launch.num_stages * tiles * launch.block_k
    if shared > SHARED_BYTES:
        return f"{launch} needs {shared} bytes of shared memory a program, over {SHARED_BYTES}"
    return None
