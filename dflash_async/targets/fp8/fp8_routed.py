"""The FP8 experts' routed grouped product: its contract, its launch and its torch reference.

`Fp8Experts` (targets/fp8/fp8_experts.py) runs, on a GPU, its gate_up product (the split way, the
default) or both grouped products (the routed way) as one Triton kernel
(kernels/fp8_moe_kernel.py) that reads and writes rows through the routing itself:
- the gate_up product gathers each sorted row's token row from the token-quantized hidden
  states (`a_rows`), so the [S, d] routed copy of the rows is never written;
- the down product multiplies each row by its routing weight and writes it at its routed pair's
  row (`out_rows`, pair p = t * k + j), so the outputs need only a contiguous sum over k
  (grouped_experts.sum_over_k) instead of a gather through the inverse permutation.
`torch._scaled_grouped_mm` has no gather or scatter. Measured per Qwen3-30B-A3B layer at
T = 16384 (H200, 2026-12-04, benchmarks/fp8_experts_gpu.py --profile): the sorted way's
quantize-and-gather of the rows took 0.25 ms and its gate 0.15, which the routed way leaves
out (its two row quantizations take 0.12); its combine took 0.15 ms, the sum over k 0.14, so
the scatter itself gains nothing there, while this kernel's down product runs 0.66-0.74 ms
against `_scaled_grouped_mm`'s 0.58-0.63 (gate_up, gated: 0.86-0.93 against 0.83-0.88
ungated). The experts: 2.0-2.1 ms routed, 2.1-2.4 sorted (BENCHMARKS.md); hence the split way
(2026-12-05): this kernel's gate_up, `_scaled_grouped_mm`'s down, 2.18 ms against 2.26 routed.

The contract, `routed_mm(a_q, a_scale, w_q, w_scale, offsets, blocks, *, a_rows, out_rows,
row_weights, gated, out_dtype, launch)` -> out [S, N]: for sorted row i of expert e (offsets,
cumulative) with a = a_rows[i] (else i) and o = out_rows[i] (else i),
    y[n] = sum_k a_q[a, k] * w_q[e, n, k] * a_scale[a] * w_scale[e, n]     (in fp32)
    out[o] = round(y * r_o)   or, `gated` (w_q [E, 2N, K]: gate rows, then up rows),
    out[o] = round(silu(y[:N]) * y[N:] * r_o)
with r_o = row_weights[o] (else 1), one rounding to `out_dtype`. The gate_up product runs
gated, so its bf16 output is the gate's, half the bytes of the [S, 2I] products, and the gate
needs no pass of its own (the gate output's per-row quantization still does). `blocks` is
grouped_experts.expert_blocks' table for `launch.block_rows` (one program per block and column
tile). `routed_reference` computes it in fp32 from the dequantized values, block by block as
the kernel walks the table (a sync per call: the table read to the host; tests only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash_async.kernels.fp8_moe_launch import (
    LAUNCH,
    Launch,
)
from dflash_async.targets.grouped_experts import blocks_bound, expert_blocks, expert_order
from dflash_async.targets.grouped_experts import gated as gated_values


def routed_rows(
    top_k_index, top_k_weights, *, num_experts: int, block_rows: int, weight_dtype: torch.dtype
):
    """The routing a routed product reads: (token [S] int32: sorted row i is token token[i]'s;
    perm [S] int32: and routed pair perm[i]; offsets [E] int32; blocks: expert_blocks' table;
    pair_weights [T * k] in `weight_dtype`, the routing weights in pair order, rounded as
    grouped_experts.combine rounds them). No sync; one shape for every routing."""
    k = top_k_index.shape[1]
    perm, offsets = expert_order(top_k_index, num_experts)
    bound = blocks_bound(perm.numel(), num_experts, block_rows)
    blocks = expert_blocks(offsets, block_rows=block_rows, num_blocks=bound)
    token = (perm // k).to(torch.int32)
    pair_weights = top_k_weights.reshape(-1).to(weight_dtype)
    return token, perm.to(torch.int32), offsets, blocks, pair_weights


@torch.no_grad()
def routed_reference(
    a_q,
    a_scale,
    w_q,
    w_scale,
    offsets,
    blocks,
    *,
    a_rows=None,
    out_rows=None,
    row_weights=None,
    gated=False,
    out_dtype=torch.bfloat16,
    launch: Launch = LAUNCH,
):
    """The module doc's contract in fp32, a block of the table at a time (sync: the table and
    offsets read to the host)."""
    rows = a_q.shape[0] if a_rows is None else a_rows.shape[0]
    columns = w_q.shape[1] // 2 if gated else w_q.shape[1]
    out = torch.full((rows, columns), float("nan"), dtype=out_dtype, device=a_q.device)
    ends = offsets.tolist()
    for expert, start in zip(*(t.tolist() for t in blocks), strict=True):
        if expert >= w_q.shape[0]:
            continue
        sorted_rows = torch.arange(
            start, min(start + launch.block_rows, ends[expert]), device=a_q.device
        )
        source = sorted_rows if a_rows is None else a_rows[sorted_rows].long()
        x = a_q[source].float() * a_scale[source].float().unsqueeze(-1)
        w = w_q[expert].float() * w_scale[expert].float().unsqueeze(-1)
        y = gated_values(x @ w.T, F.silu) if gated else x @ w.T
        target = sorted_rows if out_rows is None else out_rows[sorted_rows].long()
        if row_weights is not None:
            y = y * row_weights[target].float().unsqueeze(-1)
        out[target] = y.to(out_dtype)
    return out
