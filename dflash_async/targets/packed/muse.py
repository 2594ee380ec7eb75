"""targets/packed/muse.py owns the Muse text decoder layers of the packed sliding-window forward
(`targets/packed/window.py` runs them, with its per-kind masks and one RoPE table): Muse Glimmer's
(`muse_glimmer_layer`) and Muse Spark's (`muse_spark_layer`), and the parts every such layer must
have (`GLIMMER_PARTS`, `SPARK_PARTS`).

Both layers are Gemma 2's sandwich (a norm before and after attention and MLP) around a gated
attention (`gated_attention`), run on the HF modules themselves: the centered (1 + w) RMSNorms
(Spark's after attention is scale-free, after the MLP norm((1 + w) x)), the scale-free q/k norm,
the projections, the MLP or MoE block. What is ours is the attention core
and its order of operations, read from HF's:
- q and k each normed per head by the scale-free RMSNorm, q then multiplied by `qk_scale_factor`,
  the logits by the module's `scaling` (1/sqrt(head_dim)); no logit soft-capping;
- RoPE (rotate_half) only where the config's `layer_rope_theta` of the layer is nonzero: the
  others are NoPE layers (HF passes them no position embeddings). HF applies the one global
  rotary table on every other layer, whatever nonzero theta the list names, and so does this;
- the attention output, per head scale-free RMSNorm'd first on Spark (`o_norm`), times
  sigmoid(gate_proj(x)) elementwise, then o_proj.
Spark adds, per sublayer, the residual gate (`residual_gate`: alpha * residual + beta * update,
beta = sigmoid(g / temperature), alpha = sqrt(max(sigmoid(-g / temperature) * (1 + beta), eps)),
in fp32 like its fp32 parameter, cast to the residual's dtype), and its MoE block (the HF module:
MiniMax-M2's sigmoid top-k router with the correction bias, its logits times
`output_multiplier`, the weights renormalised and scaled (a per-token scale the post-MLP norm
divides out again); DeepSeek-V3's experts between a down- and an up-projection of the hidden
size, each expert's output normed) or, on its dense layers, the HF MLP. The MoE block runs
outside any compiled region (`eager_mlp`), as the other packed MoE paths keep their experts.
The embedding is HF's normed one (a scale-free RMSNorm after the lookup), called by the window
forward on the ids as they are, as TargetFeatures runs the language model (a wrapper's own
forward embeds its image, video and audio placeholder ids as id 0 instead). The logits' multiplier and soft-cap come after the last layer: not features.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_async.targets.packed.dense import rope_half
from dflash_async.targets.packed.window import SANDWICH_PARTS

GLIMMER_PARTS = SANDWICH_PARTS
SPARK_PARTS = SANDWICH_PARTS | {"post_attention_residual_gate", "post_feedforward_residual_gate"}


def uses_rope(attn: nn.Module) -> bool:
    """Whether the layer of this attention module rotates q and k (its layer_rope_theta != 0)."""
    return bool(attn.config.layer_rope_theta[attn.layer_idx])


def gated_attention(attn: nn.Module, x, cos, sin, mask, attend) -> torch.Tensor:
    """Muse's self-attention of the normed x [1, T, d] -> o_proj output [1, T, d]."""
    shape = (1, x.shape[1], -1, attn.head_dim)
    q = attn.qk_norm(attn.q_proj(x).view(shape).transpose(1, 2)) * attn.qk_scale_factor
    k = attn.qk_norm(attn.k_proj(x).view(shape).transpose(1, 2))  # [1, Hkv, T, hd]
    v = attn.v_proj(x).view(shape).transpose(1, 2)
    if uses_rope(attn):
        q, k = rope_half(q, cos, sin), rope_half(k, cos, sin)
    out = attend(q, k, v, mask, attn.scaling).transpose(1, 2)  # [1, T, H, hd]
    o_norm = getattr(attn, "o_norm", None)  # Spark's, per head
    if o_norm is not None:
        out = o_norm(out)
    out = attention_gate(attn, x, out.reshape(*x.shape[:2], -1))
    return attn.o_proj(out)


def attention_gate(attn: nn.Module, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The attention output [1, T, H*hd] times sigmoid(gate_proj(x)), elementwise."""
    return out * torch.sigmoid(attn.gate_proj(x))


def residual_gate(gate: nn.Module, residual: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    """Spark's gated residual of one sublayer (module doc) from the HF gate's parameter."""
    w = gate.gate / gate.temperature
    beta = torch.sigmoid(w)
    alpha = torch.sqrt(torch.clamp(torch.sigmoid(-w) * (1.0 + beta), min=gate.eps))
    return (alpha * residual + beta * update).to(residual.dtype)


@torch.compiler.disable
def eager_mlp(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The HF MoE block on x [1, T, d], never compiled (its experts dispatch by routing)."""
    return mlp(x)


def muse_glimmer_layer(layer: nn.Module, hidden, cos, sin, mask, attend) -> torch.Tensor:
    """Muse Glimmer's decoder layer on hidden [1, T, d]: Gemma 2's sandwich, gated attention."""
    a = gated_attention(layer.self_attn, layer.input_layernorm(hidden), cos, sin, mask, attend)
    hidden = hidden + layer.post_attention_layernorm(a)
    m = layer.mlp(layer.pre_feedforward_layernorm(hidden))
    return hidden + layer.post_feedforward_layernorm(m)


def muse_spark_layer(layer: nn.Module, hidden, cos, sin, mask, attend) -> torch.Tensor:
    """Muse Spark's decoder layer on hidden [1, T, d]: the sandwich with gated residuals, its
    MoE block (or dense MLP) on the feed-forward side."""
    a = gated_attention(layer.self_attn, layer.input_layernorm(hidden), cos, sin, mask, attend)
    hidden = residual_gate(
        layer.post_attention_residual_gate, hidden, layer.post_attention_layernorm(a)
    )
    x = layer.pre_feedforward_layernorm(hidden)
    m = eager_mlp(layer.mlp, x) if hasattr(layer.mlp, "experts") else layer.mlp(x)
    return residual_gate(
        layer.post_feedforward_residual_gate, hidden, layer.post_feedforward_layernorm(m)
    )
