"""The packed target forward for DeepSeek-V3-style MoE decoders (targets/packed/mla.py): multi-head
latent attention (DeepSeek-V3, Kimi-K2.x, Moonlight, Mistral 4) and GLM-4.5's partial-rotary GQA,
all with a grouped top-k router and shared experts.

It is `PackedDenseForward` (targets/packed/dense.py: the pack layout, the document-causal SDPA mask
on the CPU or flex BlockMask on CUDA, the layer range and `stage()` of a split target, the feature
columns and zeroed padding rows) with a different layer function:
- attention, DeepSeek-V3 MLA: q from q_proj, or q_a_proj -> q_a_layernorm -> q_b_proj (q_lora_rank);
  kv_a_proj_with_mqa gives the kv latent (kv_a_layernorm, then kv_b_proj to per-head k_nope and v)
  and one k_rope shared by all heads. RoPE (rotate_half, or the interleaved pairs of
  `rope_interleave`) touches only the qk_rope_head_dim dims, which come last in q and k. q/k are
  nope+rope wide, v is v_head_dim wide: SDPA and flex both take a value dim other than q/k's.
  The scale is the HF module's own (yarn's mscale folded in). Mistral 4 also multiplies the
  queries by Llama 4's position-dependent scale (`llama4_query_scale`, a per-pack input of the
  layer: `PackedMLAForward.layer_inputs`), from the positions restarting in every document, which
  are the ones each document has alone;
- attention, GLM-4.5: packed/dense.py's GQA block with RoPE on the first rotary dims only (cos/sin are
  partial_rotary_factor * head_dim wide), after the optional per-head q/k norms;
- MLP: the first `first_k_dense_replace` layers are the HF dense MLP; the MoE layers route here
  (the family's router, the HF TopkRouter's rule spelt out from its weights, sync-free:
  `grouped_topk`, sigmoid scores with a score-correction bias, DeepSeek-V3 and GLM-4.5;
  `softmax_grouped_topk`, softmax scores, Mistral 4) and run the HF experts module (its
  configured experts implementation: the grouped path where set) plus the shared experts. The
  routers are ours so that one MoE block serves every family.
The attention may be compiled (CUDA); the MoE runs eagerly after it (data-dependent routing), as
packed/dense.py's Qwen3-MoE does. `mla_attention`, the MLA core before its residual add, also serves
LongCat-Flash's sublayers (targets/packed/shortcut_moe.py), with the LoRA scales its modules hold.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from dflash_async.targets.packed.dense import PackedDenseForward, compiled, rope_half


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved RoPE: pairs (x0, x1), (x2, x3)... each rotated by one frequency,
    output de-interleaved (evens' rotation first), as HF's apply_rotary_pos_emb_interleave.
    x [1, H, T, r], cos/sin [1, T, r] (cat(freqs, freqs): the first half holds each pair's angle)."""
    half = cos.shape[-1] // 2
    c, s = cos[:, None, :, :half], sin[:, None, :, :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * c - odd * s, odd * c + even * s], dim=-1)


def _mla_query(attn: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x [1, T, d] -> q [1, H, T, nope+rope] (the low-rank path when q_lora_rank is set)."""
    if attn.q_lora_rank is None:
        q = attn.q_proj(x)
    else:
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
    return q.view(1, x.shape[1], -1, attn.qk_head_dim).transpose(1, 2)


def mla_attention(
    attn: nn.Module, x: torch.Tensor, cos, sin, mask, attend, query_scale=None
) -> torch.Tensor:
    """The HF MLA module `attn` on its normed input x [1, T, d], document-causal, before the
    residual add: -> [1, T, d]. cos/sin [1, T, rope] from the model's rotary_emb. The module's
    LoRA scales where it has them (LongCat-Flash: q times mla_scale_q_lora before RoPE, the
    normed kv latent times mla_scale_kv_lora); RoPE interleaved unless the config says not.
    `query_scale` [1, 1, T, 1]: each query row, after RoPE, multiplied by it (Mistral 4's
    `llama4_query_scale`); None: by nothing. cos None: no RoPE at all (Kimi-Linear's NoPE
    MLA: the rope dims pass as they are, k's shared by all heads)."""
    T, nope, r = x.shape[1], attn.qk_nope_head_dim, attn.qk_rope_head_dim
    rope = rope_interleaved if getattr(attn.config, "rope_interleave", True) else rope_half
    q = _mla_query(attn, x)  # [1, H, T, nope+r]
    q_scale = getattr(attn, "mla_scale_q_lora", None)
    if q_scale is not None:
        q = q * q_scale
    latent, k_rope = attn.kv_a_proj_with_mqa(x).split([attn.kv_lora_rank, r], dim=-1)
    latent = attn.kv_a_layernorm(latent)
    kv_scale = getattr(attn, "mla_scale_kv_lora", None)
    if kv_scale is not None:
        latent = latent * kv_scale
    kv = attn.kv_b_proj(latent)  # [1, T, H*(nope+v)]
    kv = kv.view(1, T, -1, nope + attn.v_head_dim).transpose(1, 2)  # [1, H, T, nope+v]
    k_nope, v = kv.split([nope, attn.v_head_dim], dim=-1)
    k_rope = k_rope.view(1, 1, T, r)
    if cos is not None:
        k_rope = rope(k_rope, cos, sin)
        q = torch.cat([q[..., :nope], rope(q[..., nope:], cos, sin)], dim=-1)
    k_rope = k_rope.expand(-1, k_nope.shape[1], -1, -1)
    if query_scale is not None:
        q = q * query_scale.to(q.dtype)
    k = torch.cat([k_nope, k_rope], dim=-1)  # [1, H, T, nope+r]
    out = attend(q, k, v, mask, attn.scaling)  # [1, H, T, v]
    return attn.o_proj(out.transpose(1, 2).reshape(1, T, -1))


def mla_attention_block(
    layer: nn.Module, hidden, cos, sin, mask, attend, query_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """hidden [1, T, d] + the HF DeepseekV3Attention (or Mistral4Attention) of `layer` (pre-norm
    residual), document-causal; cos/sin [1, T, rope] from the model's rotary_emb; `query_scale`:
    see `mla_attention`."""
    x = layer.input_layernorm(hidden)
    return hidden + mla_attention(layer.self_attn, x, cos, sin, mask, attend, query_scale)


def _partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (rotate_half) on the first cos.shape[-1] dims of x [1, H, T, hd]; the rest passes."""
    r = cos.shape[-1]
    return torch.cat([rope_half(x[..., :r], cos, sin), x[..., r:]], dim=-1)


def partial_rotary_attention_block(layer: nn.Module, hidden, cos, sin, mask, attend):
    """hidden [1, T, d] + the HF GLM-4.5 (Glm4MoeAttention) self-attention, document-causal:
    GQA with optional per-head q/k norms and RoPE on the first rotary dims (cos [1, T, r])."""
    attn = layer.self_attn
    x = layer.input_layernorm(hidden)
    shape = (1, hidden.shape[1], -1, attn.head_dim)
    q, k = attn.q_proj(x).view(shape), attn.k_proj(x).view(shape)
    if getattr(attn, "q_norm", None) is not None:  # use_qk_norm
        q, k = attn.q_norm(q), attn.k_norm(k)
    v = attn.v_proj(x).view(shape).transpose(1, 2)  # [1, Hkv, T, hd]
    q = _partial_rope(q.transpose(1, 2), cos, sin)  # [1, H, T, hd]
    k = _partial_rope(k.transpose(1, 2), cos, sin)  # [1, Hkv, T, hd]
    out = attend(q, k, v, mask, attn.scaling)  # [1, H, T, hd]
    return hidden + attn.o_proj(out.transpose(1, 2).reshape(*hidden.shape[:2], -1))


def llama4_query_scale(config, positions: torch.Tensor) -> torch.Tensor:
    """Llama 4's query scale at `positions` [T] (Mistral 4's attention):
    1 + llama_4_scaling_beta * log(1 + floor(position / original_max_position_embeddings)),
    as [1, 1, T, 1] fp32. `positions` must be each token's position in its own document."""
    rope = config.rope_parameters
    beta, period = rope["llama_4_scaling_beta"], rope["original_max_position_embeddings"]
    scale = 1 + beta * torch.log(1 + torch.floor(positions / period))
    return scale[None, None, :, None]


def _grouped_choice(gate, scores, choice, masked: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The grouped top-k rule on scores/choice [N, E] (see `grouped_topk`); the experts of the
    groups left out get `masked` as their choice value, as the HF router sets them."""
    n = gate.num_experts
    by_group = choice.view(-1, gate.num_group, n // gate.num_group)  # [N, G, E/G]
    group_score = by_group.topk(2, dim=-1)[0].sum(-1)  # [N, G]
    best = group_score.topk(gate.topk_group, dim=-1, sorted=False)[1]  # [N, topk_group]
    keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)  # [N, G]
    choice = by_group.masked_fill(~keep[..., None], masked).view(-1, n)
    experts = choice.topk(gate.top_k, dim=-1, sorted=False)[1]  # [N, k]
    weights = scores.gather(1, experts)  # [N, k]
    if gate.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * gate.routed_scaling_factor, experts


def grouped_topk(gate: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The DeepSeek-V3 / GLM-4.5 router on x [N, d]: -> (weights [N, k] fp32, experts [N, k]).

    Sigmoid scores of fp32 logits; the choice uses scores + e_score_correction_bias: the experts
    split into n_group groups, each scored by the sum of its best two, only the topk_group best
    groups stay eligible, then the top_k experts among them. The weights are the plain scores of
    the chosen experts, normalised to sum 1 when norm_topk_prob, times routed_scaling_factor."""
    scores = torch.sigmoid(x.float() @ gate.weight.float().t())  # [N, E]
    return _grouped_choice(gate, scores, scores + gate.e_score_correction_bias, float("-inf"))


def softmax_grouped_topk(gate: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Mistral 4 router on x [N, d]: -> (weights [N, k] in x's dtype, experts [N, k]).

    `grouped_topk`'s rule on softmax scores of the logits (in their dtype, as HF computes them),
    chosen by the scores themselves (no correction bias)."""
    scores = F.linear(x, gate.weight).softmax(-1)  # [N, E]
    return _grouped_choice(gate, scores, scores, 0.0)


def moe_mlp_block(
    layer: nn.Module, hidden: torch.Tensor, router: Callable = grouped_topk
) -> torch.Tensor:
    """hidden [1, T, d] + the layer's MLP on its post-attention norm: the dense MLP of the first
    layers, else routed experts (HF experts module, the family's `router`) plus the shared
    experts."""
    x = layer.post_attention_layernorm(hidden)  # [1, T, d]
    mlp = layer.mlp
    if not hasattr(mlp, "gate") or not hasattr(mlp, "experts"):  # a first_k_dense_replace layer
        return hidden + mlp(x)
    flat = x.view(-1, x.shape[-1])  # [T, d]
    weights, experts = router(mlp.gate, flat)
    routed = mlp.experts(flat, experts, weights).view_as(x)  # [1, T, d]
    return hidden + routed + mlp.shared_experts(x)


def _layer(
    layer, hidden, cos, sin, mask, attend, *, attention: Callable, router: Callable, **inputs
) -> torch.Tensor:
    """One decoder layer: `attention` (maybe compiled; `inputs`: the per-pack ones it takes),
    then the MoE/MLP block eagerly."""
    return moe_mlp_block(layer, attention(layer, hidden, cos, sin, mask, attend, **inputs), router)


class PackedMLAForward(PackedDenseForward):
    """PackedDenseForward for DeepSeek-V3 / Mistral 4 (MLA, `mla_attention_block`) or GLM-4.5
    (partial-rotary GQA, `partial_rotary_attention_block`) decoders, whose attention block,
    router and query scale (None: none) the family's entry in targets/families.py gives, with
    grouped-router MoE layers; same calls (`__call__`, `stage`), same layout contract."""

    def __init__(
        self,
        text_model: nn.Module,
        layer_ids: Sequence[int],
        *,
        attention_block: Callable,
        attention: str,
        compile: bool,
        router: Callable = grouped_topk,
        query_scale: Callable | None = None,
        layers: range | None = None,
    ) -> None:
        super().__init__(text_model, layer_ids, attention=attention, compile=False, layers=layers)
        self._layer_fn = partial(
            _layer, attention=compiled(attention_block, compile=compile), router=router
        )
        self._config = text_model.config
        self._query_scale = query_scale

    def layer_inputs(self, position_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The query scale at the pack's positions [T], which restart in every document (as
        each document's alone), when the family has one."""
        if self._query_scale is None:
            return {}
        return {"query_scale": self._query_scale(self._config, position_ids)}
