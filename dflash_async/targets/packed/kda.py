"""The packed target forward for Moonshot's Kimi-Linear (`kimi_linear`): Kimi Delta Attention (KDA)
layers per document, NoPE MLA layers document-causal, grouped-router MoE blocks; one pack in, its
features written in place.

A Kimi-Linear decoder interleaves KDA layers (`layer_types` "linear_attention") with multi-head
latent attention layers ("full_attention"), each followed by a dense MLP (the first layers) or a
DeepSeek-V3-style MoE block. A pack of documents end to end equals each document alone when no
state crosses a boundary:
- KDA: q, k and v projections, one causal depthwise convolution over their concatenation (then
  SiLU), a per-channel forget gate g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias) and
  beta = sigmoid(b_proj(x)) feed the gated delta rule (q, k L2-normalised in it); its output
  passes a gated RMSNorm per head (gate g_b(g_a(x)), sigmoid) and o_proj. The convolution reads
  only rows of the row's own document (packed/short_conv.py's `document_conv`, plain torch on any
  device) and the delta rule's state starts at zero in every document: the kernel gets the
  segments (each document, then the padding as one more, as packed/hybrid.py's `pack_segments`);
- MLA: packed/mla.py's `mla_attention` under packed/dense.py's document-causal rule (SDPA under key
  spans on the CPU, flex's BlockMask on CUDA). Kimi-Linear's MLA has no RoPE (the model has no
  rotary module): it reads no positions at all, so positions need not restart per document;
- MoE: HF's KimiLinearTopkRouter is DeepSeek-V3's rule (sigmoid scores, score-correction bias,
  groups, renormalised top k times routed_scaling_factor), so packed/mla.py's `moe_mlp_block` with
  `grouped_topk` runs it, with the HF experts and shared experts.

The delta-rule kernel (`KdaKernel`) is passed in:
- `fla_kda()` on CUDA: flash-linear-attention's `chunk_kda`, varlen over the segments'
  `cu_seqlens` (one call per layer), as packed_hybrid calls its gated delta rule;
- `torch_kda()` anywhere: HF's own torch fallback (`chunk_kimi_delta_attention`, chunks of 64)
  run once per segment. Exact (the very code HF runs on each document alone), but slow: Python
  loops over the chunks of every document, one call per document per layer; the CPU product
  path and the reference of the tests.
Ours besides: the order of the projections around the kernel; the norms, projections, gated
RMSNorm, MLP and experts are the HF modules. On CUDA the KDA parts before and after the kernel
and the MLA block are torch.compile'd functions taking the layer as an argument; the kernel and
the MoE block run eagerly between them.

Sync point: the segment boundaries come from the host (the pack's document lengths), so the torch
kernel's loop reads no device value. fla's `chunk_kda` takes no precomputed chunk table: it builds
one from `cu_seqlens_cpu` on the host and copies it to the device in every KDA layer (from
pageable memory: a blocking copy), where packed_hybrid hands its kernel a pinned table.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dflash_async.targets.packed.dense import (
    PackedRange,
    compiled,
    mask_padding,
)
from dflash_async.targets.packed.hybrid import Segments, pack_segments
from dflash_async.targets.packed.mla import grouped_topk, mla_attention, moe_mlp_block
from dflash_async.targets.packed.short_conv import document_conv

_KDA_PARTS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "conv1d",
    "forget_gate",
    "b_proj",
    "g_a_proj",
    "g_b_proj",
    "o_norm",
    "o_proj",
)
_MLA_PARTS = ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj", "scaling")
_GATE_PARTS = ("f_a_proj", "f_b_proj", "dt_bias", "A_log")
_ROUTER_PARTS = ("weight", "e_score_correction_bias", "num_group", "topk_group", "top_k")
_LAYER_TYPES = frozenset({"linear_attention", "full_attention"})


@dataclass(frozen=True)
class KdaKernel:
    """delta(q [1,T,H,K], k [1,T,H,K], v [1,T,H,V], g [1,T,H,K] log decay, beta [1,T,H],
    segments) -> o [1,T,H,V]: the gated delta rule with per-channel decay, q and k
    L2-normalised inside, scale K**-0.5, zero initial state in every segment."""

    delta: Callable
    name: str


def torch_kda() -> KdaKernel:
    """HF's torch chunked KDA, one call per segment (exact, slow: the module doc)."""
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

    def delta(q, k, v, g, beta, s: Segments):
        bounds = s.cu_cpu.tolist()
        out = torch.empty_like(v)
        for lo, hi in itertools.pairwise(bounds):
            part, _ = chunk_kimi_delta_attention(
                *(t[:, lo:hi] for t in (q, k, v)),
                g=g[:, lo:hi],
                beta=beta[:, lo:hi],
                use_qk_l2norm_in_kernel=True,
            )
            out[:, lo:hi] = part
        return out

    return KdaKernel(delta, "torch chunk_kimi_delta_attention per document")


def fla_kda() -> KdaKernel:
    """flash-linear-attention's `chunk_kda`, varlen over the segments (CUDA only)."""
    from fla.ops.kda import chunk_kda

    def delta(q, k, v, g, beta, s: Segments):
        out, _ = chunk_kda(
            q,
            k,
            v,
            g,
            beta,
            use_qk_l2norm_in_kernel=True,
            cu_seqlens=s.cu,
            cu_seqlens_cpu=s.cu_cpu,
        )
        return out

    return KdaKernel(delta, "fla chunk_kda varlen")


def kda_layout_problem(text_model: nn.Module) -> str | None:
    """None when every decoder layer is a Kimi-Linear one: KDA or MLA, then a dense SiLU MLP or
    a grouped-router MoE block with shared experts."""
    config = text_model.config
    other = set(getattr(config, "layer_types", None) or ()) - _LAYER_TYPES
    if other:
        return f"layer_types {sorted(other)} (only {sorted(_LAYER_TYPES)})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r}"
    if getattr(text_model, "rotary_emb", None) is not None:
        return "a rotary embedding (the packed MLA here is NoPE)"
    for layer in text_model.layers:
        attn = getattr(layer, "self_attn", None)
        kda = hasattr(attn, "conv1d")
        parts = _KDA_PARTS if kda else _MLA_PARTS
        missing = [p for p in parts if not hasattr(attn, p)]
        if kda:
            missing += [f"forget_gate.{p}" for p in _GATE_PARTS if not hasattr(attn.forget_gate, p)]
        missing += [
            p
            for p in ("input_layernorm", "post_attention_layernorm", "mlp")
            if not hasattr(layer, p)
        ]
        if missing:
            return f"decoder layer {type(layer).__name__} lacks {missing}"
        if kda and (attn.conv1d.groups != attn.conv1d.in_channels or attn.conv1d.bias is not None):
            return f"KDA convolution {type(attn).__name__} is not depthwise without bias"
        mlp = layer.mlp
        if hasattr(mlp, "experts"):
            gate = getattr(mlp, "gate", None)
            missing = [f"gate.{p}" for p in _ROUTER_PARTS if not hasattr(gate, p)]
            if missing or not hasattr(mlp, "shared_experts"):
                return f"MoE block {type(mlp).__name__} lacks {missing or ['shared_experts']}"
    return None


def kda_inputs(layer: nn.Module, hidden: torch.Tensor, doc_ids: torch.Tensor):
    """A KDA layer up to its kernel, on hidden [1, T, d]: (q, k, v [1, T, H, hd], g [1, T, H, hd]
    fp32 log decay, beta [1, T, H], the output gate [1, T, H, hd]); the convolution per
    document."""
    kda = layer.self_attn
    x = layer.input_layernorm(hidden)
    T, hd = hidden.shape[1], kda.head_dim
    mixed = torch.cat([kda.q_proj(x), kda.k_proj(x), kda.v_proj(x)], dim=-1)[0]  # [T, 3*H*hd]
    mixed = F.silu(document_conv(mixed, kda.conv1d, doc_ids)).to(x.dtype)
    q, k, v = (t.view(1, T, -1, hd) for t in mixed.split(kda.qkv_dim, dim=-1))
    g = kda.forget_gate(x)  # [1, T, H, hd]
    beta = torch.sigmoid(kda.b_proj(x))  # [1, T, H]
    gate = kda.g_b_proj(kda.g_a_proj(x)).view(1, T, -1, hd)
    return q, k, v, g, beta, gate


def kda_output(layer: nn.Module, hidden, core, gate) -> torch.Tensor:
    """The rest of a KDA layer: gated RMSNorm per head of the kernel's output core [1, T, H, hd],
    o_proj, residual."""
    kda = layer.self_attn
    out = kda.o_norm(core, gate).reshape(*hidden.shape[:2], -1)
    return hidden + kda.o_proj(out)


def mla_block(layer: nn.Module, hidden, mask, attend) -> torch.Tensor:
    """hidden [1, T, d] + the layer's NoPE MLA, document-causal."""
    x = layer.input_layernorm(hidden)
    return hidden + mla_attention(layer.self_attn, x, None, None, mask, attend)


class PackedKDAForward(PackedRange):
    """Features of a packed layout for a Kimi-Linear decoder (see the module docstring).

    `attention` is "sdpa" (query chunks under key spans: CPU, any T) or "flex" (CUDA,
    T % 128 == 0); `kernel` the delta rule (`fla_kda` on CUDA, `torch_kda` elsewhere);
    `compile` wraps the KDA parts around the kernel and the MLA block in torch.compile (CUDA).
    Called with the pack's host `lengths`, as packed/hybrid.py's forward: the segments come from
    them, not from a device sync. `stage()` runs a layer range (a split target); every
    convolution and recurrent state lives within one layer, so a stage boundary cuts nothing.
    """

    def __init__(
        self,
        text_model: nn.Module,
        layer_ids: Sequence[int],
        *,
        kernel: KdaKernel,
        attention: str,
        compile: bool,
        layers: range | None = None,
    ) -> None:
        super().__init__(text_model, layer_ids, attention=attention, layers=layers)
        self.kernel = kernel
        wrap = partial(compiled, compile=compile)
        self._kda_in, self._kda_out = wrap(kda_inputs), wrap(kda_output)
        self._mla = wrap(mla_block)

    def __call__(self, input_ids, position_ids, doc_ids, features, lengths) -> torch.Tensor:
        """Write the captured layers' outputs into `features` [T, k*d] (padding rows zero)."""
        self.stage(None, input_ids, position_ids, doc_ids, features, lengths)
        return features

    def _kda_layer(self, layer, hidden, doc_ids, segments: Segments) -> torch.Tensor:
        q, k, v, g, beta, gate = self._kda_in(layer, hidden, doc_ids)
        core = self.kernel.delta(q, k, v, g, beta, segments)
        return self._kda_out(layer, hidden, core, gate)

    @torch.no_grad()
    def stage(self, hidden, input_ids, position_ids, doc_ids, features, lengths) -> torch.Tensor:
        """This forward's layer range on `hidden` [1, T, d] (None: embed, the first stage); the
        captured columns in the range written (padding rows zero); returns the range's output.
        `position_ids` are not read: no layer here takes positions (NoPE MLA)."""
        segments = pack_segments(np.asarray(lengths), input_ids.shape[0], input_ids.device)
        mask = self.mask(doc_ids)
        if hidden is None:
            hidden = self._embed(input_ids[None])  # [1, T, d]
        for i, layer in self._layers.items():
            if hasattr(layer.self_attn, "conv1d"):
                hidden = self._kda_layer(layer, hidden, doc_ids, segments)
            else:
                hidden = self._mla(layer, hidden, mask, self._attend)
            hidden = moe_mlp_block(layer, hidden, grouped_topk)
            self.capture(i, hidden, features)
        mask_padding(features, doc_ids, self._columns.values(), self.hidden_size)
        return hidden
