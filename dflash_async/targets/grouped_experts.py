"""The MoE experts call of a packed target with the work around its grouped products compiled.

Owns the routing layout an experts module computes in (`sort_by_expert`, `combine`), which HF
experts modules the drop-ins compute exactly (`experts_problem`: this one and the FP8 experts)
and `CompiledExperts`, a drop-in for a fused HF experts module (gate_up_proj [E, 2I, d], down_proj
[E, d, I], no biases, the default gate act(g) * u) that keeps HF's math and order of operations:
rows sorted by expert, two grouped products (`torch._grouped_mm` on CUDA), the routing weights on
the down projection's rows, the rows put back in token order and summed over k.

Why: HF's `grouped_mm_experts_forward` runs eagerly in the packed paths (under torch.compile its
dispatcher takes a per-expert fallback), so the sort, gather, gate, weighting, inverse
permutation and sum around its two grouped products are ~12 separate passes over the
[T * k, d] rows of every MoE layer. The FP8 experts (targets/fp8/fp8_experts.py) run the same parts as
three compiled functions: 12.4 -> 6.1 ms per Qwen3-30B-A3B layer at T = 16384 on an H200
(BENCHMARKS.md, 2026-12-02); this module gives bf16 the same structure. The packed forwards use
it on CUDA by default (targets/forward.py): measured by `bench target --experts hf,compiled` on
an H200 (2026-12-03, T = 16384), packed tokens/s with HF's experts -> CompiledExperts:
Moonlight-16B-A3B 62.8k -> 97.4k, Qwen3-30B-A3B 41.6k -> 63.7k (71.3k once `combine` became k
pointwise terms), MiniMax-M2 (8 layers) 137.5k -> 199.8k, Qwen3-Next (16 layers) 95.9k ->
130.5k, features equal within bf16's noise.

CPU-GPU syncs: none on CUDA; the CPU's per-expert loop (`offsets.tolist()`) syncs trivially.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from dflash_async.kernels.fp8_format import FP8_DTYPE


def expert_order(
    top_k_index: torch.Tensor,  # [T, k]
    num_experts: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(perm [S]: sorted row i is routed pair perm[i] of the flattened [T * k], rows grouped by
    expert; offsets [E] int32: cumulative rows per expert), S = T * k. As transformers'
    grouped_mm_experts_forward: sort, histc, cumsum; no sync (histc, not bincount: a fixed
    output size)."""
    expert_ids, perm = torch.sort(top_k_index.reshape(-1))
    # CPU histc takes floats, CUDA's ints (HF's choice, for deterministic algorithms)
    ids = expert_ids.int() if expert_ids.is_cuda else expert_ids.float()
    counts = torch.histc(ids, bins=num_experts, min=0, max=num_experts - 1)
    return perm, torch.cumsum(counts, dim=0).to(torch.int32)


def sort_by_expert(
    hidden_states: torch.Tensor,  # [T, d]
    top_k_index: torch.Tensor,  # [T, k]
    num_experts: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows [S, d]: each token's row once per routed expert, grouped by expert; perm [S];
    offsets [E] int32): `expert_order`'s layout with the rows gathered."""
    perm, offsets = expert_order(top_k_index, num_experts)
    return hidden_states[perm // top_k_index.shape[1]], perm, offsets


def expert_blocks(
    offsets: torch.Tensor, *, block_rows: int, num_blocks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sorted rows cut into blocks of at most `block_rows` rows of one expert, for a
    grouped kernel whose programs each own one block: (expert [num_blocks] int32, start
    [num_blocks] int32), block b holding rows start[b] .. min(start[b] + block_rows,
    offsets[expert[b]]) - 1. Expert e's c_e rows take ceil(c_e / block_rows) blocks, in expert
    order; the blocks past the last are marked expert = E (their programs do nothing).
    `num_blocks` is fixed so the layout has one shape whatever the routing (no sync):
    cdiv(S, block_rows) + E always suffices (`blocks_bound`). Blocks past `num_blocks` are
    dropped silently, so a caller must pass at least that bound."""
    ends = offsets.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    per_expert = (counts + block_rows - 1) // block_rows
    last = torch.cumsum(per_expert, dim=0)  # expert e owns blocks last[e] - per_expert[e] ..
    block = torch.arange(num_blocks, device=offsets.device)
    expert = torch.searchsorted(last, block, right=True)  # E past the last block
    owner = expert.clamp(max=offsets.numel() - 1)
    first = last[owner] - per_expert[owner]
    start = (ends[owner] - counts[owner]) + (block - first) * block_rows
    return expert.to(torch.int32), start.to(torch.int32)


def blocks_bound(rows: int, num_experts: int, block_rows: int) -> int:
    """How many blocks `expert_blocks` can need for `rows` sorted rows: sum over experts of
    ceil(c_e / b) <= sum (c_e / b + 1) = rows / b + E."""
    return -(-rows // block_rows) + num_experts


def combine(
    out: torch.Tensor,  # [S, d] the experts' outputs, rows sorted by expert
    top_k_weights: torch.Tensor,  # [T, k]
    perm: torch.Tensor,  # [S]
    dtype: torch.dtype,
    residual: torch.Tensor | None = None,  # [T, d] in `dtype`
) -> torch.Tensor:
    """The routed outputs weighted, put back in token order and summed over k: [T, d] in
    `dtype`. The sum runs in fp32 (as HF's reshape + sum does for bf16), over j = 0..k-1 in order.
    With a `residual`, returns residual + that sum, rounded to `dtype` first as the decoder
    layer's own residual add sees it (the same values; compiled, one kernel fewer: `with_residual`).

    Each token's k rows are gathered through the inverse permutation (an [S] scatter of
    indices). The k-sum is written as k terms added in turn, not `.sum(dim=1)`: compiled, that
    is one pointwise kernel over [T, d] whose k loads each read whole contiguous rows. As a
    reduction over the [T, k, d] view (Inductor's persistent reduction over k, whose tiles likely
    ran along k rather than along the rows; its code was not read), the kernel moved ~0.9 TB/s:
    0.63 ms per Qwen3-30B-A3B layer at T = 16384 on an H200 (2026-12-03,
    benchmarks/profile_target_gpu.py), after HF's scatter of the [S, d] rows into token order
    (restored[perm] = out, 0.27 ms) was already gone. As k terms the whole forward went 254.7 ->
    229.6 ms with bf16 experts and 214.7 -> 192.7 ms with FP8 ones (`bench target --shapes
    qwen3-30b-a3b`, BENCHMARKS.md)."""
    tokens, k = top_k_weights.shape
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(
        perm.numel(), dtype=perm.dtype, device=perm.device
    )  # p: row inverse[p]
    index = inverse.view(tokens, k)
    weights = top_k_weights.to(out.dtype)
    total = (out[index[:, 0]] * weights[:, :1]).float()  # [T, d]
    for j in range(1, k):  # k is static (the config's experts per token)
        total = total + (out[index[:, j]] * weights[:, j : j + 1]).float()
    return with_residual(total.to(dtype), residual)


def with_residual(out: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """residual + out in out's dtype (the decoder layer's add after its MoE block), or out.
    Inside the compiled combine this add reads the residual once more but writes [T, d] once
    instead of twice, and skips a launch: ~0.06 ms per Qwen3-30B-A3B layer at T = 16384 (a
    bf16 [T, d] is 64 MB, written and read back at ~3 TB/s on an H200)."""
    return out if residual is None else residual + out


def sum_over_k(
    weighted: torch.Tensor, k: int, dtype: torch.dtype, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """`combine` for outputs already weighted and in pair order (row t * k + j is token t's
    j-th routed expert, as fp8_moe_kernel's down product writes them): [T * k, d] -> [T, d] in
    `dtype`, summed in fp32 over j = 0..k-1 in order. Compiled, one pointwise kernel whose k
    loads each read contiguous rows: nothing is gathered. `residual` as in `combine`."""
    pairs = weighted.view(-1, k, weighted.shape[-1])
    total = pairs[:, 0].float()
    for j in range(1, k):
        total = total + pairs[:, j].float()
    return with_residual(total.to(dtype), residual)


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [S, K] (rows grouped by expert) @ weight[e] [N, K]^T per group: [S, N]. One
    `torch._grouped_mm` launch on CUDA; elsewhere one matmul per expert (offsets.tolist():
    one sync, the CPU only)."""
    if x.is_cuda and hasattr(torch, "_grouped_mm"):
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    out = x.new_zeros(x.shape[0], weight.shape[1])
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            out[start:end] = x[start:end] @ weight[e].T
        start = end
    return out


def gated(h: torch.Tensor, act_fn: Callable) -> torch.Tensor:
    """act(gate) * up of a grouped gate_up output h [S, 2I] (HF's default gate): [S, I]."""
    gate, up = h.chunk(2, dim=-1)
    return act_fn(gate) * up


def experts_problem(experts: nn.Module) -> str | None:
    """None when `CompiledExperts` and the FP8 experts (targets/fp8/fp8_experts.py) compute exactly what this HF experts module does: fused
    [gate; up] weights [E, 2I, d] and down [E, d, I] in a float dtype (not e4m3 already), no
    biases, the default gate act(g) * u."""
    from transformers.integrations.moe import _default_apply_gate

    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
        return f"{type(experts).__name__} has no fused gate_up_proj / down_proj"
    if FP8_DTYPE in (gate_up.dtype, down.dtype):  # Fp8Experts: HF's names, e4m3 values
        return f"{type(experts).__name__} already holds e4m3 weights"
    flags = {
        "has_bias": False,
        "is_transposed": False,
        "is_concatenated": True,
        "has_post_expert_norm": False,
        "has_gate": True,
    }
    for flag, wanted in flags.items():
        if getattr(experts, flag, wanted) != wanted:
            return f"{type(experts).__name__} has {flag}={not wanted}"
    if getattr(type(experts), "_apply_gate", _default_apply_gate) is not _default_apply_gate:
        return f"{type(experts).__name__} has its own gating (clamped SwiGLU)"
    return None


class CompiledExperts(nn.Module):
    """HF's fused experts call `(hidden [T, d], top_k_index [T, k], top_k_weights [T, k]) ->
    [T, d]` on the same weight tensors (shared, not copied), with `sort_by_expert`, the gate and
    `combine` each one torch.compile'd function where `compile` (default: on CUDA); the grouped
    products stay eager. Build it only where `experts_problem(experts)` is None.
    `takes_residual`: forward's `residual` [T, d] is added to the output inside the compiled
    combine (the packed forwards pass the decoder layer's residual stream; `combine`)."""

    takes_residual = True

    def __init__(self, experts: nn.Module, *, compile: bool | None = None) -> None:
        super().__init__()
        self.num_experts, self.act_fn = experts.num_experts, experts.act_fn
        self.gate_up_proj, self.down_proj = experts.gate_up_proj, experts.down_proj
        compile = self.gate_up_proj.is_cuda if compile is None else compile
        wrap = (lambda fn: torch.compile(fn, dynamic=False)) if compile else (lambda fn: fn)
        self._sort, self._gated, self._combine = map(wrap, (sort_by_expert, gated, combine))

    def forward(self, hidden_states, top_k_index, top_k_weights, residual=None) -> torch.Tensor:
        rows, perm, offsets = self._sort(hidden_states, top_k_index, self.num_experts)
        h = self._gated(grouped_mm(rows, self.gate_up_proj, offsets), self.act_fn)
        out = grouped_mm(h, self.down_proj, offsets)
        return self._combine(out, top_k_weights, perm, hidden_states.dtype, residual)


def swap_compiled_experts(layers: nn.Module, *, compile: bool | None = None) -> dict[str, int]:
    """Replace every fused HF experts module under `layers` that `CompiledExperts` computes
    exactly (`experts_problem` None: not FP8 experts, whose e4m3 weights carry HF's
    names) by one; the others stay. Returns counts."""
    counts = {"swapped": 0, "kept": 0}
    for name, module in list(layers.named_modules()):
        parent_name, _, last = name.rpartition(".")
        if last != "experts" or isinstance(module, CompiledExperts):
            continue
        if experts_problem(module) is not None:
            counts["kept"] += 1
            continue
        setattr(layers.get_submodule(parent_name), last, CompiledExperts(module, compile=compile))
        counts["swapped"] += 1
    return counts
