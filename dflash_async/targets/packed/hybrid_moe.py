"""The MoE block of the packed hybrid forward (Qwen3.5-MoE, Qwen3-Next): router, grouped
experts, gated shared expert, on the rows of a whole pack at once.

An MoE block is per token, so packing documents changes nothing about it: each row is routed on
its own. What is ours is the arithmetic around the experts, the same as HF's SparseMoeBlock:
- the router: softmax over all experts in fp32, top-k, the k weights renormalised to sum to one
  where the router says so (Qwen3-Next's `norm_topk_prob`; Qwen3.5-MoE's router has no such
  switch and always renormalises), cast back to the logits' dtype;
- the shared expert, an MLP on every row scaled by sigmoid(shared_expert_gate(x)), added.
The routed experts are the HF module's own call (`mlp.experts(x, indices, weights)`), which runs
the model's `_experts_implementation`: "grouped_mm" by default (torch._grouped_mm over the rows
sorted by expert, offsets from a histogram: no host sync), the path the Qwen3-MoE packed forward
takes too; "eager" (a loop over the experts hit) would sync once per layer.

The router and the shared expert are one function (`moe_inputs`) so they can be compiled; the
experts run eagerly after it (data-dependent grouping), as in `packed_dense`'s moe_eager. Eager
also keeps them on grouped_mm: under torch.compile HF's dispatcher takes its per-expert fallback
(`offs.tolist()`, a sync) for any dtype but bf16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_MOE_PARTS = ("gate", "experts", "shared_expert", "shared_expert_gate")
_ROUTER_PARTS = ("weight", "top_k")


def moe_layout_problem(mlp: nn.Module) -> str | None:
    """None when `mlp` is a softmax top-k MoE block with a sigmoid-gated shared expert."""
    missing = [p for p in _MOE_PARTS if not hasattr(mlp, p)]
    missing += [f"gate.{p}" for p in _ROUTER_PARTS if not hasattr(getattr(mlp, "gate", None), p)]
    return f"MoE block {type(mlp).__name__} lacks {missing}" if missing else None


def route(gate: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, d] -> (weights [N, k] in x's dtype, expert indices [N, k]): softmax, top-k,
    renormalised unless the router turns it off (`norm_topk_prob` False)."""
    logits = F.linear(x, gate.weight)  # [N, E]
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    top, indices = torch.topk(probs, gate.top_k, dim=-1)  # [N, k]
    if getattr(gate, "norm_topk_prob", True):
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), indices


def gated_shared_expert(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x [N, d] -> sigmoid(shared_expert_gate(x)) [N, 1] * shared_expert(x) [N, d]."""
    return torch.sigmoid(mlp.shared_expert_gate(x)) * mlp.shared_expert(x)


def moe_inputs(layer: nn.Module, hidden: torch.Tensor):
    """hidden [1, T, d] -> (x [T, d] normed, weights [T, k], indices [T, k], shared [T, d])."""
    x = layer.post_attention_layernorm(hidden)[0]
    weights, indices = route(layer.mlp.gate, x)
    return x, weights, indices, gated_shared_expert(layer.mlp, x)


def moe_output(hidden: torch.Tensor, routed: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """The residual: hidden [1, T, d] + routed [T, d] + shared [T, d]."""
    return hidden + (routed + shared)[None]


class MoeBlock:
    """hidden [1, T, d] + the layer's MoE block; `wrap` compiles the dense parts (or not)."""

    def __init__(self, wrap) -> None:
        self._inputs, self._output = wrap(moe_inputs), wrap(moe_output)

    def __call__(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        x, weights, indices, shared = self._inputs(layer, hidden)
        routed = layer.mlp.experts(x, indices, weights)  # [T, d], the HF grouped experts
        return self._output(hidden, routed, shared)
