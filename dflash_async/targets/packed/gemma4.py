"""targets/packed/gemma4.py owns the Gemma 4 text decoder layer of the packed sliding-window forward
(`targets/packed/window.py` runs it, with its masks and a RoPE table per layer kind) and the list
of Gemma 4 features that forward does not run (`gemma4_layout_problem`).

What differs from Gemma 3 (all read from the HF modules): a wider head on full layers (its own
rotary table, "proportional" partial RoPE), query scale 1.0, a scale-free RMSNorm on the values,
values equal to the raw keys on full layers when `attention_k_eq_v` (no v_proj), and the
layer's output multiplied by its `layer_scalar`. Refused (the HF fallback runs them): per-layer
input embeddings, KV sharing across layers, the MoE block, bidirectional attention.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_async.targets.packed.dense import rope_half


def gemma4_layout_problem(config) -> str | None:
    """None when every Gemma 4 text feature the config turns on is one this forward runs."""
    if getattr(config, "hidden_size_per_layer_input", 0):
        return "per-layer input embeddings (hidden_size_per_layer_input)"
    if getattr(config, "num_kv_shared_layers", 0):
        return "KV sharing across layers (num_kv_shared_layers)"
    if getattr(config, "enable_moe_block", False):
        return "the MoE block (enable_moe_block)"
    if getattr(config, "use_bidirectional_attention", None) not in (None, False, "vision"):
        return f"use_bidirectional_attention={config.use_bidirectional_attention!r}"
    return None


def gemma4_attention(layer: nn.Module, x, cos, sin, mask, attend) -> torch.Tensor:
    """Gemma 4 self-attention of the normed x [1, T, d] -> o_proj output [1, T, d]."""
    attn = layer.self_attn
    shape = (1, x.shape[1], -1, attn.head_dim)
    q = rope_half(attn.q_norm(attn.q_proj(x).view(shape)).transpose(1, 2), cos, sin)  # [1,H,T,hd]
    raw = attn.k_proj(x).view(shape)  # [1, T, Hkv, hd]
    v = attn.v_proj(x).view(shape) if attn.v_proj is not None else raw  # k_eq_v: the raw keys
    k = rope_half(attn.k_norm(raw).transpose(1, 2), cos, sin)  # [1, Hkv, T, hd]
    out = attend(q, k, attn.v_norm(v).transpose(1, 2), mask, attn.scaling)  # [1, H, T, hd]
    return attn.o_proj(out.transpose(1, 2).reshape(*x.shape[:2], -1))


def gemma4_layer(layer: nn.Module, hidden, cos, sin, mask, attend) -> torch.Tensor:
    """Gemma 4's decoder layer on hidden [1, T, d]: sandwich norms, then its layer_scalar."""
    a = gemma4_attention(layer, layer.input_layernorm(hidden), cos, sin, mask, attend)
    hidden = hidden + layer.post_attention_layernorm(a)
    m = layer.mlp(layer.pre_feedforward_layernorm(hidden))
    return (hidden + layer.post_feedforward_layernorm(m)) * layer.layer_scalar
