"""The packed target forward for Inkling 2's language model (`inkling2_text`, and the `inkling2`
wrapper's): one pack in, its features written in place.

Every Inkling 2 decoder layer reads its input through block attention residuals (a softmax over
the layer inputs kept at each block boundary, per token: HF's `attention_input` / `mlp_input`
modules, run as they are), attends, convolves the attention output, adds it to the block
residual, runs a sigmoid-routed MoE of soft-capped experts (the HF block, eagerly) and convolves
its output. What mixes tokens is ours, each restarting in every document:
- the short convolutions (causal, depthwise, `conv_kernel_size` taps): after attention and after
  the MoE, and over the keys and values of the sliding-window layers, read only rows of their
  own document (packed/short_conv.py's `document_conv`), then (out + x) / sqrt(K + 1);
- the full-attention layers' dynamic convolutions of the keys and values: per token and KV head,
  taps static_weight + weight_proj(input), over the same own-document rows
  (`dynamic_document_conv`), then (out + x) / sqrt(2K + 1);
- attention is document-causal (sliding layers: q - k < sliding_window_size too) under
  packed/dense.py's key spans, in chunks of query rows against the keys they may see, with explicit
  logits (`attend_biased`): q @ k * scaling, plus the relative position bias, masked, with each
  token's per-head sink logit (sink_proj(x)) in the softmax denominator, HF's eager order. The
  bias of query q and key k is rel[q, h, q - k] for 0 <= q - k < rel_extent (zero beyond), where
  rel = clip(scale * linear(x)) @ proj: a distance within one document is the same in the pack,
  and the document-causal mask hides every other;
- positions restart per document: the full-attention layers scale their queries and their
  relative states by 1 + alpha * log(max((position + 1) / n_floor, 1)), at the document's
  positions.
Ours too, per token: the L2 clips (each head vector of q, k and the relative states scaled down
to its threshold, after the learned per-head scale for q and the relative states: `l2_clip`),
and the gated output projection (the attention output times sigmoid(gate_proj(x)), then the
linear: `output_gate`). The norms, embedding (a normed lookup), projections, value norm, block
residuals and MoE are HF's modules.

The same torch code runs on the CPU and on CUDA (no flex: its score_mod would gather the bias
per distance and the sinks are per token); the query chunks keep the logits at
[heads, SDPA_QUERY_ROWS, keys seen]. The block residuals carry every block's input to the later
layers, more than the [1, T, d] hidden a split target's stage hands on: no stages here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from dflash_async.targets.packed.dense import (
    KeySpans,
    PackedRange,
    document_causal_spans,
    mask_padding,
)
from dflash_async.targets.packed.short_conv import document_conv

SLIDING, FULL = "hybrid_sliding", "hybrid"
_LAYER_TYPES = frozenset({SLIDING, FULL})
_LAYER_PARTS = (
    "self_attn",
    "mlp",
    "mlp_input",
    "attention_input",
    "post_attention_layernorm",
    "post_attention_convolution",
    "post_mlp_convolution",
)
_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "sink_proj", "relative_position_bias")


def inkling_layout_problem(text_model: nn.Module) -> str | None:
    """None when every decoder layer is an Inkling 2 one (module doc): sliding or full attention
    with its convolutions, sinks, relative position bias and gated output, block residuals, MoE."""
    other = set(getattr(text_model.config, "layer_types", None) or ()) - _LAYER_TYPES
    if other:
        return f"layer_types {sorted(other)} (only {sorted(_LAYER_TYPES)})"
    if not hasattr(text_model, "final_input"):
        return f"{type(text_model).__name__} has no block attention residuals"
    for layer in text_model.layers:
        missing = [p for p in _LAYER_PARTS if not hasattr(layer, p)]
        missing += [f"self_attn.{p}" for p in _ATTENTION_PARTS if not hasattr(layer.self_attn, p)]
        if missing:
            return f"decoder layer {type(layer).__name__} lacks {missing}"
    return None


def l2_clip(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """Each vector of x [..., n] scaled down to L2 norm `threshold` where longer, in fp32."""
    x = x.float()
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    return x * (threshold / (norm + 1e-6)).clamp(max=1.0)


def head_norm(norm: nn.Module, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [1, T, H, n] through HF's (log-)scaled L2 clip module `norm` (its scale and threshold):
    clip(x * scale), then, where it log-scales, times 1 + alpha * log(max((p + 1) / floor, 1))
    at the positions [T] (each document's own). Returned in x's dtype."""
    dtype = x.dtype
    log_scale = getattr(norm, "log_scale", None)
    threshold = norm.threshold if log_scale is None else norm.l2_clip.threshold
    x = l2_clip(x.float() * norm.scale.float(), threshold).to(dtype)
    if log_scale is None:
        return x
    ratio = (positions + 1).float() / log_scale.log_scaling_n_floor
    tau = 1.0 + log_scale.log_scaling_alpha * torch.log(ratio.clamp(min=1.0))
    return (x.float() * tau[None, :, None, None]).to(dtype)


def short_conv(sconv: nn.Module, x: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
    """x [1, T, C] through HF's static short convolution module per document (module doc)."""
    dtype = x.dtype
    x = x[0].float()
    out = document_conv(x, sconv.conv1d, doc_ids).float()
    return ((out + x) / math.sqrt(sconv.conv_kernel_size + 1)).to(dtype)[None]


def dynamic_document_conv(
    x: torch.Tensor, taps: torch.Tensor, doc_ids: torch.Tensor
) -> torch.Tensor:
    """x [T, H, c], taps [T, H, c, K] (tap k weighs the row k back) -> [T, H, c] in fp32:
    out[t] = sum_k taps[t, ..., k] * x[t - k], the rows before t's document left out."""
    T, K = x.shape[0], taps.shape[-1]
    rows = torch.arange(T, device=x.device)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for lag in range(K):
        source = rows - lag
        row = source.clamp(0, T - 1)
        same = (source >= 0) & (doc_ids[row] == doc_ids)  # [T]: a row of t's own document
        out = out + torch.where(same[:, None, None], x[row], 0.0).float() * taps[..., lag]
    return out


def dynamic_short_conv(sconv: nn.Module, x, dynamic_input, doc_ids) -> torch.Tensor:
    """x [1, T, C] through HF's dynamic short convolution module per document: its taps per token
    and KV head are static_weight + weight_proj(dynamic_input) (module doc)."""
    dtype, (T, C) = x.dtype, x.shape[1:]
    H, K = sconv.num_heads, sconv.conv_kernel_size
    dynamic = sconv.weight_proj(dynamic_input[0]).float().view(T, H, 1, K)
    taps = sconv.static_weight.float().T.reshape(H, C // H, K) + dynamic  # [T, H, c, K]
    x = x[0].float()
    out = dynamic_document_conv(x.view(T, H, -1), taps, doc_ids).reshape(T, C)
    return ((out + x) / math.sqrt(2 * K + 1)).to(dtype)[None]


def key_value(proj: nn.Module, x: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
    """HF's key or value projection module on x [1, T, d] -> [1, Hkv, T, hd]: linear, its short
    convolution per document, per head the key's L2 clip or the value's scale-free RMSNorm."""
    states = proj.linear(x)
    if hasattr(proj.sconv, "weight_proj"):
        states = dynamic_short_conv(proj.sconv, states, x, doc_ids)
    else:
        states = short_conv(proj.sconv, states, doc_ids)
    states = states.view(*states.shape[:-1], -1, proj.head_dim)
    if hasattr(proj.norm, "threshold"):  # the key's
        states = l2_clip(states, proj.norm.threshold).to(x.dtype)
    else:
        states = proj.norm(states)
    return states.transpose(1, 2)


def relative_logits(bias: nn.Module, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """HF's relative position bias module on x [1, T, d] -> each token's bias per head and
    backward distance [1, T, H, rel_extent]: its per-head states, clipped (and log-scaled at
    the positions), times its bank of profiles `proj`."""
    states = bias.linear(x).view(*x.shape[:-1], bias.num_heads, -1)
    return head_norm(bias.norm, states, positions) @ bias.proj


def attend_biased(q, k, v, rel, sinks, spans: KeySpans, scale: float) -> torch.Tensor:
    """q [1, H, T, hd], k/v [1, Hkv, T, hd], rel [1, T, H, R], sinks [1, T, H] -> [1, H, T, hd]:
    softmax(q k * scale + bias, sink) v under `spans`, one chunk of query rows at a time (the
    bias rel[q, h, q - k] where 0 <= q - k < R, else 0; the sink a logit without a value)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)  # HF's repeat_kv
    R = rel.shape[-1]
    outs = []
    for s, e, a, part in spans.pieces():
        logits = (q[:, :, s:e] @ k[:, :, a:e].transpose(-1, -2)) * scale  # [1, H, r, n]
        rows = torch.arange(s, e, device=q.device)
        distance = rows[:, None] - torch.arange(a, e, device=q.device)[None, :]  # [r, n]
        table = rel[0, s:e].transpose(0, 1)  # [H, r, R]
        index = distance.clamp(0, R - 1).expand(table.shape[0], -1, -1)
        bias = table.gather(-1, index).masked_fill((distance < 0) | (distance >= R), 0.0)
        logits = (logits + bias[None]).masked_fill(~part, float("-inf"))
        sink = sinks[:, s:e].transpose(1, 2)[..., None].to(logits.dtype)  # [1, H, r, 1]
        weights = torch.softmax(torch.cat([logits, sink], dim=-1).float(), dim=-1)[..., :-1]
        outs.append(weights.to(q.dtype) @ v[:, :, a:e])
    return torch.cat(outs, dim=2)


def output_gate(o_proj: nn.Module, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """HF's gated output projection module: linear(out * sigmoid(gate_proj(x))), the gate in fp32."""
    gate = torch.sigmoid(o_proj.gate_proj(x).float())
    return o_proj.linear((out.float() * gate).to(out.dtype))


def attention(attn: nn.Module, x, kx, vx, positions, doc_ids, spans) -> torch.Tensor:
    """One Inkling 2 attention (sliding or full: HF's module's parts) of the normed query, key
    and value inputs [1, T, d] -> its output [1, T, d], document by document (module doc)."""
    shape = (*x.shape[:-1], -1, attn.head_dim)
    q = head_norm(attn.q_proj.norm, attn.q_proj.linear(x).view(shape), positions).transpose(1, 2)
    k, v = key_value(attn.k_proj, kx, doc_ids), key_value(attn.v_proj, vx, doc_ids)
    rel = relative_logits(attn.relative_position_bias, x, positions)
    out = attend_biased(q, k, v, rel, attn.sink_proj(x), spans, attn.scaling)
    return output_gate(attn.o_proj, out.transpose(1, 2).reshape(*x.shape[:-1], -1), x)


def inkling_layer(layer: nn.Module, hidden, block_states, positions, doc_ids, spans):
    """One decoder layer on hidden [1, T, d] with the block states [1, T, n, d] before it (HF's
    order: block residual inputs, attention, convolution, residual or new block, MoE input, MoE,
    convolution)."""
    dtype = hidden.dtype
    if hasattr(layer, "q_input_layernorm"):  # a full-attention layer: q, k, v inputs apart
        inputs = (hidden,) * 3
        if layer.attention_input is not None:
            inputs = layer.attention_input(block_states, hidden)
        norms = (layer.q_input_layernorm, layer.k_input_layernorm, layer.v_input_layernorm)
        x, kx, vx = (norm(h).to(dtype) for norm, h in zip(norms, inputs, strict=True))
    else:
        h = hidden
        if layer.attention_input is not None:
            h = layer.attention_input(block_states, hidden)[0]
        x = kx = vx = layer.input_layernorm(h).to(dtype)
    a = attention(layer.self_attn, x, kx, vx, positions, doc_ids, spans)
    residual = h = short_conv(layer.post_attention_convolution, a, doc_ids).float()
    if layer.is_block_boundary:
        block_states = torch.cat([block_states, hidden.unsqueeze(-2)], dim=-2)
    else:
        residual = h = hidden.float() + h
    h = layer.mlp_input(block_states, h)[0]
    h = layer.mlp(layer.post_attention_layernorm(h).to(dtype))
    h = short_conv(layer.post_mlp_convolution, h, doc_ids)
    return (residual + h).to(dtype)


class PackedInklingForward(PackedRange):
    """Features of a packed layout for Inkling 2's language model (module docstring). A
    PackedRange (packed/dense.py) of the whole range up to the last captured layer; the same
    torch code on every device (`attention` is accepted and not used)."""

    def __init__(
        self, text_model: nn.Module, layer_ids: Sequence[int], *, attention: str = "sdpa"
    ) -> None:
        super().__init__(text_model, layer_ids, attention=attention, layers=None)
        self.window = text_model.config.sliding_window_size

    def spans(self, doc_ids: torch.Tensor) -> dict[str, KeySpans]:
        """Layer type -> its document-causal key spans (the sliding layers' within the window)."""
        return {
            SLIDING: document_causal_spans(doc_ids, self.window, self.query_rows),
            FULL: document_causal_spans(doc_ids, None, self.query_rows),
        }

    @torch.no_grad()
    def stage(self, hidden, input_ids, position_ids, doc_ids, features) -> torch.Tensor:
        """Run the layers up to the last captured one from the embedding of `input_ids` (hidden
        must be None: no stages), write the captured columns (padding rows zero), return the
        last layer's output [1, T, d]."""
        if hidden is not None:
            raise ValueError("the packed Inkling 2 forward runs whole (its block states)")
        spans = self.spans(doc_ids)
        hidden = self._embed(input_ids[None])  # [1, T, d]
        block_states = hidden.new_zeros(*hidden.shape[:-1], 0, hidden.shape[-1])
        for i, layer in self._layers.items():
            kind = SLIDING if layer.self_attn.sliding_window else FULL
            out = inkling_layer(layer, hidden, block_states, position_ids, doc_ids, spans[kind])
            if layer.is_block_boundary:
                block_states = torch.cat([block_states, hidden.unsqueeze(-2)], dim=-2)
            hidden = out
            self.capture(i, hidden, features)
        mask_padding(features, doc_ids, self._columns.values(), self.hidden_size)
        return hidden
