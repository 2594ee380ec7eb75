"""The packed target forward for shortcut-connected MoE decoders (LongCat-Flash): each listed
decoder layer holds two MLA attention + dense MLP sublayers and one MoE whose router may also
choose zero-computation (identity) experts.

It is `PackedDenseForward` (targets/packed/dense.py: the pack layout, per-document positions, the
document-causal SDPA key spans on the CPU or flex BlockMask on CUDA, the layer range and `stage()`
of a split target, the feature columns and zeroed padding rows) with this layer function, which
runs the HF modules of one layer as its own forward does:
- sublayer 1: h = x + attention_0(norm_a0(x)); m = norm_m0(h); h = h + mlps_0(m);
- the shortcut MoE reads m, the first sublayer's post-attention norm (not the layer's output);
- sublayer 2: h = h + attention_1(norm_a1(h)); out = h + mlps_1(norm_m1(h)) + moe(m).
The attention is packed/mla.py's `mla_attention` (the module's LoRA scales, interleaved RoPE). The
tap of a listed layer is `out`, the layer's output, as the generic path's hooks take it.

The router (`zero_expert_route`): softmax of the fp32 logits over the routed and the zero experts
(the classifier's weight only, as HF's router: its bias is never applied); the choice adds the
score-correction bias, the weights are the plain chosen scores times routed_scaling_factor (no
renormalisation). A zero expert adds the MoE's input m times its weight; its slot is handed to the
experts module as a real expert with weight 0 (spread over the experts as HF spreads them), so
any experts implementation (HF's, CompiledExperts on CUDA) runs unchanged: a zero weight adds an
exact zero, at the price of those rows' products.

The attention sublayer may be compiled (CUDA: one compilation, the modules are arguments); the
MoE runs eagerly after it (data-dependent routing), as packed/mla.py's does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from dflash_async.targets.packed.dense import PackedDenseForward, compiled
from dflash_async.targets.packed.mla import mla_attention

_PARTS = {"self_attn", "mlps", "mlp", "input_layernorm", "post_attention_layernorm"}


def shortcut_parts_problem(inner: nn.Module) -> str | None:
    """None when every decoder layer has the parts we run: two attention + MLP sublayers (the
    ModuleLists self_attn, mlps and their norms) and the shortcut MoE `mlp`."""
    for layer in inner.layers:
        parts = {name for name, _ in layer.named_children()}
        pairs = all(
            isinstance(getattr(layer, name, None), nn.ModuleList) and len(getattr(layer, name)) == 2
            for name in ("self_attn", "mlps", "input_layernorm", "post_attention_layernorm")
        )
        if parts != _PARTS or not pairs:
            return f"decoder layer {type(layer).__name__} with parts {sorted(parts)}"
        if not hasattr(layer.mlp, "num_routed_experts"):
            # older transformers (5.17) keep the zero experts inside the experts module (its
            # gate_up_proj has a row block per zero expert), a layout shortcut_moe does not read
            return f"{type(layer.mlp).__name__} with the zero experts inside its experts module"
    return None


def zero_expert_route(router: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The router on x [N, d] -> (weights [N, k] fp32, experts [N, k]), experts indexing the
    routed experts then the zero experts (see the module doc)."""
    scores = F.linear(x.float(), router.classifier.weight.float()).softmax(dim=-1)  # [N, E+Z]
    choice = scores + router.e_score_correction_bias  # the bias picks, never weighs
    experts = choice.topk(router.top_k, dim=-1, sorted=False)[1]  # [N, k]
    return scores.gather(1, experts) * router.routed_scaling_factor, experts


def shortcut_moe(moe: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The HF MoE module `moe` on x [1, T, d] (the first sublayer's post-attention norm):
    routed experts plus x times the zero experts' weights -> [1, T, d]."""
    flat = x.view(-1, x.shape[-1])  # [T, d]
    weights, experts = zero_expert_route(moe.router, flat)
    n, zeros = moe.num_routed_experts, moe.zero_expert_num
    if not zeros:
        return moe.experts(flat, experts, weights).view_as(x)
    zero = experts >= n  # [T, k]
    identity = weights.masked_fill(~zero, 0.0).sum(-1, keepdim=True)  # [T, 1]
    stand_in = (experts - n) * n // zeros  # a real expert for each zero slot, weight 0 below
    experts = torch.where(zero, stand_in, experts)
    routed = moe.experts(flat, experts, weights.masked_fill(zero, 0.0))  # [T, d]
    return (routed + (flat * identity).to(routed.dtype)).view_as(x)


def attention_sublayer(attn: nn.Module, norm: nn.Module, hidden, cos, sin, mask, attend):
    """hidden [1, T, d] + the MLA module `attn` on norm(hidden), document-causal."""
    return hidden + mla_attention(attn, norm(hidden), cos, sin, mask, attend)


def shortcut_layer(layer, hidden, cos, sin, mask, attend, *, attention: Callable):
    """One decoder layer (see the module doc); `attention`: `attention_sublayer`, maybe
    compiled."""
    hidden = attention(layer.self_attn[0], layer.input_layernorm[0], hidden, cos, sin, mask, attend)
    x = layer.post_attention_layernorm[0](hidden)
    shortcut = shortcut_moe(layer.mlp, x)
    hidden = hidden + layer.mlps[0](x)
    hidden = attention(layer.self_attn[1], layer.input_layernorm[1], hidden, cos, sin, mask, attend)
    return hidden + layer.mlps[1](layer.post_attention_layernorm[1](hidden)) + shortcut


class PackedShortcutMoeForward(PackedDenseForward):
    """PackedDenseForward with `shortcut_layer` (see the module doc); same calls (`__call__`,
    `stage`), same layout contract."""

    def __init__(
        self,
        text_model: nn.Module,
        layer_ids: Sequence[int],
        *,
        attention: str,
        compile: bool,
        layers: range | None = None,
    ) -> None:
        super().__init__(text_model, layer_ids, attention=attention, compile=False, layers=layers)
        sublayer = compiled(attention_sublayer, compile=compile)
        self._layer_fn = partial(shortcut_layer, attention=sublayer)
