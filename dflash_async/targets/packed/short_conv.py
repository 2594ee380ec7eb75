"""The packed target forward for LFM2 and LFM2-MoE, Liquid's decoders of gated short convolutions
and attention layers: one pack in, its features written in place.

Each LFM2 decoder layer mixes tokens either by grouped-query attention (RMSNorm over each q and k
head, RoPE) or by a gated short convolution (HF's `Lfm2ShortConv`): `in_proj` splits each row into
B, C and x; B * x runs through a causal depthwise convolution `conv_L_cache` taps wide (3 in the
published checkpoints); C gates its output before `out_proj`. Then the layer's MLP, or past
LFM2-MoE's `num_dense_layers` a sigmoid-routed MoE block. A pack of documents end to end equals
each document alone when nothing crosses a boundary:
- the convolution at row t reads row t - s (s < width) only where that row belongs to t's
  document (equal doc_ids): every document's convolution starts from zero history, as it does
  alone (`document_conv`);
- attention is document-causal, by packed/dense.py's rule and implementations (SDPA under key spans
  on the CPU, flex's BlockMask on CUDA): none of its own;
- RoPE takes the layout's positions, which restart at 0 in every document.

The convolution is plain torch, on CPU and CUDA alike: `width` shifted multiply-adds over the
[T, d] rows (three taps: a few element-wise passes, negligible next to the layer's projections),
each shift a fixed-shape gather masked by the doc_ids, so it needs no kernel and no host sync, and
compiles with the rest of the layer. Ours besides: the attention core (q/k norms, RoPE) and the
MoE router (`sigmoid_route`); the norms, projections, MLP and routed experts are HF's modules.
On CUDA each layer's token mixer with its MLP (or with the MoE norm and router) is one
torch.compile'd function taking the layer as an argument; the experts run eagerly after it, as in
packed/dense.py's MoE path.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from dflash_async.targets.fp8.fp8_linear import project
from dflash_async.targets.packed.dense import (
    MLP_ROWS,
    PackedRange,
    compiled,
    mask_padding,
    moe_residual,
    rope_half,
)

_CONV_PARTS = ("in_proj", "conv", "out_proj")
_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "out_proj", "q_layernorm", "k_layernorm")
_ROUTER_PARTS = ("weight", "top_k", "norm_topk_prob", "routed_scaling_factor")
_LAYER_TYPES = frozenset({"conv", "full_attention"})


def short_conv_layout_problem(text_model: nn.Module) -> str | None:
    """None when every decoder layer is an LFM2 one: a short convolution (depthwise, causal) or
    q/k-normed attention, with an MLP or a sigmoid-routed experts block."""
    other = set(getattr(text_model.config, "layer_types", None) or ()) - _LAYER_TYPES
    if other:
        return f"layer_types {sorted(other)} (only {sorted(_LAYER_TYPES)})"
    for layer in text_model.layers:
        mixer = getattr(layer, "conv", None) or getattr(layer, "self_attn", None)
        parts = _CONV_PARTS if hasattr(layer, "conv") else _ATTENTION_PARTS
        missing = [p for p in parts if not hasattr(mixer, p)]
        missing += [
            p for p in ("operator_norm", "ffn_norm", "feed_forward") if not hasattr(layer, p)
        ]
        if missing:
            return f"decoder layer {type(layer).__name__} lacks {missing}"
        if hasattr(layer, "conv"):
            conv = layer.conv.conv
            if conv.groups != conv.in_channels or conv.weight.shape[1] != 1:
                return f"short convolution {type(layer.conv).__name__} is not depthwise"
        block = layer.feed_forward
        if hasattr(block, "experts"):
            gate = getattr(block, "gate", None)
            missing = [f"gate.{p}" for p in _ROUTER_PARTS if not hasattr(gate, p)]
            if missing or not hasattr(block, "use_expert_bias"):
                return f"MoE block {type(block).__name__} lacks {missing or ['use_expert_bias']}"
    return None


def document_conv(x: torch.Tensor, conv: nn.Conv1d, doc_ids: torch.Tensor) -> torch.Tensor:
    """x [T, C] -> [T, C]: `conv`'s causal depthwise convolution (weight [C, 1, W], bias) run
    over each document alone: out[t] = bias + sum_k weight[:, k] * x[t - (W - 1 - k)], the terms
    whose row lies before t's document (or before the pack) left out, as a zero history would.
    Accumulated in fp32, returned in the weight's dtype (HF convolves in the weight's dtype)."""
    weight = conv.weight[:, 0]  # [C, W]
    T, W = x.shape[0], weight.shape[1]
    rows = torch.arange(T, device=x.device)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for k in range(W):
        lag = W - 1 - k
        source = rows - lag
        row = source.clamp(0, T - 1)
        same = (source >= 0) & (doc_ids[row] == doc_ids)  # [T]: a row of t's own document
        taken = torch.where(same[:, None], x[row], 0.0)
        out = out + taken.float() * weight[:, k].float()
    if conv.bias is not None:
        out = out + conv.bias.float()
    return out.to(weight.dtype)


def short_conv_block(layer: nn.Module, hidden: torch.Tensor, doc_ids: torch.Tensor):
    """hidden [1, T, d] + the layer's gated short convolution (HF Lfm2ShortConv) per document:
    out_proj(C * conv(B * x)), B, C, x the thirds of in_proj of the normed rows."""
    conv = layer.conv
    B, C, x = conv.in_proj(layer.operator_norm(hidden))[0].chunk(3, dim=-1)  # [T, d] each
    y = C * document_conv(B * x, conv.conv, doc_ids).to(x.dtype)
    return hidden + conv.out_proj(y)[None]


def attention_block(layer: nn.Module, hidden, cos, sin, mask, attend) -> torch.Tensor:
    """hidden [1, T, d] + the layer's attention (HF Lfm2Attention: GQA, RMSNorm over each q and
    k head before RoPE), document-causal."""
    attn = layer.self_attn
    x = layer.operator_norm(hidden)
    shape = (1, hidden.shape[1], -1, attn.head_dim)
    q, k, v = (p.view(shape) for p in project((attn.q_proj, attn.k_proj, attn.v_proj), x))
    q, k = attn.q_layernorm(q).transpose(1, 2), attn.k_layernorm(k).transpose(1, 2)
    q, k = rope_half(q, cos, sin), rope_half(k, cos, sin)  # [1, H, T, hd], [1, Hkv, T, hd]
    out = attend(q, k, v.transpose(1, 2), mask, attn.scaling)  # [1, H, T, hd]
    return hidden + attn.out_proj(out.transpose(1, 2).reshape(*hidden.shape[:2], -1))


def mix(layer: nn.Module, hidden, doc_ids, cos, sin, mask, attend) -> torch.Tensor:
    """The layer's token mixer with its residual: attention or short convolution."""
    if hasattr(layer, "conv"):
        return short_conv_block(layer, hidden, doc_ids)
    return attention_block(layer, hidden, cos, sin, mask, attend)


def feed_forward_block(layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """hidden [1, T, d] + the layer's dense MLP on its ffn_norm, MLP_ROWS rows at a time (row-wise:
    a long pack's intermediates stay those of MLP_ROWS rows)."""
    parts = [
        layer.feed_forward(layer.ffn_norm(hidden[:, s : s + MLP_ROWS]))
        for s in range(0, hidden.shape[1], MLP_ROWS)
    ]
    return hidden + (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1))


def dense_layer(layer, hidden, doc_ids, cos, sin, mask, attend) -> torch.Tensor:
    """A whole layer with a dense MLP: mixer, then MLP."""
    return feed_forward_block(layer, mix(layer, hidden, doc_ids, cos, sin, mask, attend))


def sigmoid_route(block: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """LFM2-MoE's router on x [N, d] -> (weights [N, k] in the logits' dtype, experts [N, k]).

    Sigmoid scores; the choice is the top k of scores + expert_bias where the block uses the bias
    (of the scores otherwise); the weights are the chosen experts' plain scores, divided by their
    sum (+1e-6) when norm_topk_prob, times routed_scaling_factor: HF's Lfm2MoeTopKRouter's rule."""
    gate = block.gate
    logits = F.linear(x, gate.weight)  # [N, E]
    scores = logits.sigmoid()
    choice = scores + block.expert_bias if block.use_expert_bias else scores
    experts = torch.topk(choice, gate.top_k, dim=-1)[1]  # [N, k]
    weights = scores.gather(1, experts).type_as(logits)
    if gate.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)
    return weights * gate.routed_scaling_factor, experts


def mix_and_route(layer, hidden, doc_ids, cos, sin, mask, attend):
    """A MoE layer up to its experts: (hidden [1, T, d] after the mixer, its ffn_norm x [T, d],
    the routing weights [T, k] and experts [T, k])."""
    hidden = mix(layer, hidden, doc_ids, cos, sin, mask, attend)
    x = layer.ffn_norm(hidden)[0]
    weights, experts = sigmoid_route(layer.feed_forward, x)
    return hidden, x, weights, experts


class PackedShortConvForward(PackedRange):
    """Features of a packed layout for an LFM2 or LFM2-MoE decoder (see the module docstring).

    `attention` is "sdpa" (query chunks under key spans: CPU, any T) or "flex" (CUDA,
    T % 128 == 0); `compile` wraps the layer functions in torch.compile (CUDA). `stage()` runs a
    layer range (a split target: targets/split.py); every convolution's history lives within one
    layer and one document, so a stage boundary cuts nothing.
    """

    def __init__(
        self,
        text_model: nn.Module,
        layer_ids: Sequence[int],
        *,
        attention: str,
        compile: bool,
        layers: range | None = None,
    ) -> None:
        rotary = getattr(text_model, "rotary_emb", None)
        rotary = text_model.pos_emb if rotary is None else rotary  # LFM2-MoE's name for it
        super().__init__(text_model, layer_ids, attention=attention, layers=layers, rotary=rotary)
        wrap = partial(compiled, compile=compile)
        self._dense_layer, self._mix_and_route = wrap(dense_layer), wrap(mix_and_route)

    @torch.no_grad()
    def stage(self, hidden, input_ids, position_ids, doc_ids, features) -> torch.Tensor:
        """Run this forward's layer range on `hidden` [1, T, d] (None: embed `input_ids`), write
        the captured layers' columns (padding rows zero), return the range's output [1, T, d]."""
        mask = self.mask(doc_ids)
        if hidden is None:
            hidden = self._embed(input_ids[None])  # [1, T, d]
        cos, sin = self._rotary(hidden, position_ids[None])  # [1, T, hd] each
        args = (doc_ids, cos, sin, mask, self._attend)
        for i, layer in self._layers.items():
            if hasattr(layer.feed_forward, "experts"):
                hidden, x, weights, experts = self._mix_and_route(layer, hidden, *args)
                hidden = moe_residual(layer.feed_forward.experts, hidden, x, weights, experts)
            else:
                hidden = self._dense_layer(layer, hidden, *args)
            self.capture(i, hidden, features)
        mask_padding(features, doc_ids, self._columns.values(), self.hidden_size)
        return hidden
