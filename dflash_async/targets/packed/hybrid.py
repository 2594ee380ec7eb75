"""The packed target forward for Qwen3.5 (dense, MoE) and Qwen3-Next hybrids: Gated DeltaNet
layers varlen, attention layers document-causal, one pack in one shape, features written in place.

A Qwen3.5 text decoder interleaves Gated DeltaNet ("linear_attention") layers with gated full
attention layers. Packing documents end to end is exact only if no state crosses a boundary:
- the short causal convolution and the delta-rule recurrence run per segment, with the segment
  boundaries (`cu_seqlens`: each document, then the padding as one more segment) handed to the
  varlen kernels: flash-linear-attention's `chunk_gated_delta_rule` and its `causal_conv1d`
  (backend "cuda" = the causal-conv1d package when installed, else fla's triton kernel);
- the full-attention layers use the document-causal BlockMask of `packed_dense`, with Qwen3.5's
  output gate (sigmoid of the second half of q_proj) and partial rotary (the first `cos.shape[-1]`
  dims of each head).
Qwen3.5-MoE's layers are the same with an MoE block in place of the MLP (`packed_hybrid_moe`: our
router and gated shared expert around the HF grouped experts, run eagerly between compiled parts).
Qwen3-Next's too, except its Gated DeltaNet's fused projections (`next_delta_inputs`), its plain
1-D rotary (partial as well) and a dense MLP in its `mlp_only_layers`.
Everything else (norms, projections, MLP, the gated RMSNorm) is the HF modules' own code. The
kernels are passed in (`HybridKernels`) so the CPU tests can check the packing with plain torch
ones; the product uses `fla_kernels()` on CUDA only (triton has no CPU backend).

Sync point: none. The segment boundaries come from the host (the pack's document lengths) and so
does fla's chunk table (`chunk_indices`: segment and chunk of each 64-token chunk); both are
copied to the device from pinned memory without blocking. Left to itself, fla would build that
table on the host from `cu_seqlens_cpu` and copy it from pageable memory, a blocking copy (a stream
synchronisation) once per forward. fla's triton kernels autotune on their first call of each shape;
benchmarks/fla_configs holds one fixed config per kernel (FLA_CONFIG_DIR, as benchmarks/gpu.sh
sets it: 7 compiles per shape instead of autotuning 75 configs).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dflash_async.targets.packed.dense import (
    attend_flex,
    attend_sdpa,
    compiled,
    document_causal_block_mask,
    document_causal_mask,
    mask_padding,
    mlp_block,
    rotate_half,
    stage_columns,
)
from dflash_async.targets.packed.hybrid_moe import MoeBlock, moe_layout_problem

_GDN_PARTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "norm", "out_proj")
# Qwen3-Next's Gated DeltaNet: q, k, v, z fused in one projection grouped per key head, b and a in
# another (its `fix_query_key_value_ordering` undoes the grouping)
_NEXT_GDN_PARTS = (
    "in_proj_qkvz",
    "in_proj_ba",
    "fix_query_key_value_ordering",
    "conv1d",
    "norm",
    "out_proj",
)


FLA_CHUNK = 64  # fla's chunk length for chunk_gated_delta_rule and the triton causal_conv1d


@dataclass(frozen=True)
class Segments:
    """A pack's segments: `cu` [N+1] int64 on the device, `cu_cpu` its host copy, and `chunks`
    [NT, 2] int64 on the device: (segment, chunk within it) of every FLA_CHUNK-token chunk."""

    cu: torch.Tensor
    cu_cpu: torch.Tensor
    chunks: torch.Tensor


def chunk_table(cuts: np.ndarray, chunk: int = FLA_CHUNK) -> np.ndarray:
    """(segment, chunk index) rows of every `chunk`-token chunk of every segment [NT, 2]."""
    counts = -(-np.diff(cuts) // chunk)  # ceil
    segment = np.repeat(np.arange(len(counts)), counts)
    within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.stack([segment, within], axis=1).astype(np.int64)


def pack_segments(lengths: np.ndarray, T: int, device) -> Segments:
    """A pack's segments: each document (`lengths`, host), then the padding rows as one."""
    cuts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    if cuts[-1] < T:
        cuts = np.append(cuts, T)
    host, chunks = torch.from_numpy(cuts), torch.from_numpy(chunk_table(cuts))
    if device.type == "cuda":  # fresh pinned blocks: the allocator guards them (see produce)
        host, chunks = host.pin_memory(), chunks.pin_memory()
    to_device = lambda x: x.to(device, non_blocking=True)  # noqa: E731
    return Segments(to_device(host), host, to_device(chunks))


@dataclass(frozen=True)
class HybridKernels:
    """conv(x [1,T,C], weight [C,W], segments) -> silu(causal conv) [1,T,C] per segment;
    delta(q [1,T,H,K], k, v [1,T,HV,V], g [1,T,HV], beta [1,T,HV], segments) -> o [1,T,HV,V]
    (q and k L2-normalised inside, scale K**-0.5, zero initial state per segment)."""

    conv: Callable
    delta: Callable
    name: str


def fla_kernels() -> HybridKernels:
    """flash-linear-attention's varlen kernels (CUDA only)."""
    from fla.modules.causal_conv1d import causal_conv1d
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    backend = "cuda" if importlib.util.find_spec("causal_conv1d") else "triton"

    # chunk_indices only where the kernel chunks by FLA_CHUNK (the triton conv and the delta rule)
    table = (lambda s: {"chunk_indices": s.chunks}) if backend == "triton" else (lambda s: {})

    def conv(x, weight, s: Segments):
        out, _ = causal_conv1d(
            x,
            weight,
            activation="silu",
            backend=backend,
            cu_seqlens=s.cu,
            cu_seqlens_cpu=s.cu_cpu,
            **table(s),
        )
        return out

    def delta(q, k, v, g, beta, s: Segments):
        out, _ = chunk_gated_delta_rule(
            q,
            k,
            v,
            g,
            beta,
            use_qk_l2norm_in_kernel=True,
            cu_seqlens=s.cu,
            cu_seqlens_cpu=s.cu_cpu,
            chunk_indices=s.chunks,
            chunk_size=FLA_CHUNK,
        )
        return out

    return HybridKernels(conv, delta, f"fla chunk_gated_delta_rule + causal_conv1d[{backend}]")


def hybrid_layout_problem(text_model: nn.Module) -> str | None:
    """None when every layer is a Qwen3.5- or Qwen3-Next-style Gated DeltaNet or gated-attention
    layer with an MLP or a router + experts + gated shared expert MoE block."""
    for layer in text_model.layers:
        if hasattr(layer, "linear_attn"):
            parts = _NEXT_GDN_PARTS if hasattr(layer.linear_attn, "in_proj_qkvz") else _GDN_PARTS
            missing = [p for p in parts if not hasattr(layer.linear_attn, p)]
            if missing:
                return f"Gated DeltaNet {type(layer.linear_attn).__name__} lacks {missing}"
        elif hasattr(layer, "self_attn"):
            attn = layer.self_attn
            if attn.q_proj.out_features != 2 * attn.o_proj.in_features:
                return f"attention {type(attn).__name__} without Qwen3.5's output gate"
        else:
            return f"decoder layer {type(layer).__name__} is neither linear nor full attention"
        if not hasattr(layer, "mlp"):
            return f"decoder layer {type(layer).__name__} has no MLP"
        problem = moe_layout_problem(layer.mlp) if hasattr(layer.mlp, "experts") else None
        if problem:
            return problem
    return None


def _partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary on the first cos.shape[-1] dims of each head; x [1, H, T, hd], cos [1, T, r]."""
    r = cos.shape[-1]
    rotated = x[..., :r] * cos[:, None] + rotate_half(x[..., :r]) * sin[:, None]
    return torch.cat([rotated, x[..., r:]], dim=-1)


def gated_attention_block(layer, hidden, cos, sin, mask, attend) -> torch.Tensor:
    """hidden [1, T, d] + Qwen3.5 gated self-attention, document-causal."""
    attn = layer.self_attn
    x = layer.input_layernorm(hidden)
    T, hd = hidden.shape[1], attn.head_dim
    q, gate = attn.q_proj(x).view(1, T, -1, 2 * hd).chunk(2, dim=-1)  # per head: [q | gate]
    q = attn.q_norm(q).transpose(1, 2)  # [1, H, T, hd]
    k = attn.k_norm(attn.k_proj(x).view(1, T, -1, hd)).transpose(1, 2)
    v = attn.v_proj(x).view(1, T, -1, hd).transpose(1, 2)
    out = attend(_partial_rope(q, cos, sin), _partial_rope(k, cos, sin), v, mask, attn.scaling)
    out = out.transpose(1, 2).reshape(1, T, -1) * torch.sigmoid(gate.reshape(1, T, -1))
    return hidden + attn.o_proj(out)


def delta_inputs(layer, hidden):
    """Pre-kernel part of a Gated DeltaNet layer: (mixed qkv [1,T,C], z, g, beta)."""
    gdn = layer.linear_attn
    x = layer.input_layernorm(hidden)
    mixed = gdn.in_proj_qkv(x)  # [1, T, 2*key_dim + value_dim]
    z = gdn.in_proj_z(x)  # [1, T, value_dim]
    beta = gdn.in_proj_b(x).sigmoid()  # [1, T, HV]
    g = -gdn.A_log.float().exp() * F.softplus(gdn.in_proj_a(x).float() + gdn.dt_bias)
    return mixed, z, g, beta


def next_delta_inputs(layer, hidden):
    """delta_inputs for Qwen3-Next's fused projections: (mixed qkv [1,T,C], z, g, beta)."""
    gdn = layer.linear_attn
    x = layer.input_layernorm(hidden)
    q, k, v, z, b, a = gdn.fix_query_key_value_ordering(gdn.in_proj_qkvz(x), gdn.in_proj_ba(x))
    mixed = torch.cat([t.reshape(*hidden.shape[:2], -1) for t in (q, k, v)], dim=-1)
    g = -gdn.A_log.float().exp() * F.softplus(a.float() + gdn.dt_bias)  # [1, T, HV]
    return mixed, z, g, b.sigmoid()


def delta_output(layer, hidden, core, z):
    """Post-kernel part: gated RMSNorm per value head, out_proj, residual."""
    gdn = layer.linear_attn
    normed = gdn.norm(core.reshape(-1, gdn.head_v_dim), z.reshape(-1, gdn.head_v_dim))
    return hidden + gdn.out_proj(normed.reshape(*hidden.shape[:2], -1))


def _gated_attention_mlp(layer, hidden, cos, sin, mask, attend):
    return mlp_block(layer, gated_attention_block(layer, hidden, cos, sin, mask, attend))


class PackedHybridForward:
    """Features of a packed layout for a Qwen3.5(-MoE) or Qwen3-Next decoder (module docstring)."""

    def __init__(
        self,
        text_model: nn.Module,
        layer_ids: Sequence[int],
        *,
        kernels: HybridKernels,
        mrope: bool,
        attention: str,
        compile: bool,
        layers: range | None = None,
    ) -> None:
        self.layer_ids = tuple(int(i) for i in layer_ids)
        self.hidden_size = text_model.config.hidden_size
        self.kernels = kernels
        self.layers = layers or range(max(self.layer_ids) + 1)  # a stage's range (target/split)
        self._embed, self._rotary = text_model.embed_tokens, text_model.rotary_emb
        # `mrope` (the family's, targets/families.py): Qwen3.5's rotary is an mrope (one position
        # row per grid axis t, h, w) and transformers 5.17 wants those rows given, [3, 1, T] (all
        # equal for text); Qwen3-Next's is 1-D
        self.mrope = mrope
        self._layers = dict(
            zip(self.layers, text_model.layers[self.layers.start : self.layers.stop], strict=True)
        )
        self._columns = stage_columns(self.layer_ids, self.layers)
        self._flex = attention == "flex"
        self._attend = attend_flex if self._flex else attend_sdpa
        wrap = partial(compiled, compile=compile)
        self._attention, self._dense_mlp = wrap(_gated_attention_mlp), wrap(mlp_block)
        self._attention_only, self._moe = wrap(gated_attention_block), MoeBlock(wrap)
        self._delta_in, self._delta_out = wrap(delta_inputs), wrap(delta_output)
        self._next_delta_in = wrap(next_delta_inputs)

    _segments = staticmethod(pack_segments)

    def _delta_layer(self, layer, hidden, segments: Segments):
        gdn = layer.linear_attn
        fused = hasattr(gdn, "in_proj_qkvz")  # Qwen3-Next
        mixed, z, g, beta = (self._next_delta_in if fused else self._delta_in)(layer, hidden)
        weight = gdn.conv1d.weight.squeeze(1)  # [C, W]
        mixed = self.kernels.conv(mixed, weight, segments)
        q, k, v = torch.split(mixed, [gdn.key_dim, gdn.key_dim, gdn.value_dim], dim=-1)
        T = hidden.shape[1]
        q, k = q.view(1, T, -1, gdn.head_k_dim), k.view(1, T, -1, gdn.head_k_dim)
        core = self.kernels.delta(q, k, v.view(1, T, -1, gdn.head_v_dim), g, beta, segments)
        return self._delta_out(layer, hidden, core, z.view(1, T, -1, gdn.head_v_dim))

    def _layer(self, layer, hidden, segments: Segments, attention: tuple) -> torch.Tensor:
        """One decoder layer on hidden [1, T, d]: its token mixer, then its MLP or MoE block
        (the MoE's experts eager between compiled parts); attention = (cos, sin, mask)."""
        moe = hasattr(layer.mlp, "experts")
        if hasattr(layer, "linear_attn"):
            hidden = self._delta_layer(layer, hidden, segments)
        elif moe:
            hidden = self._attention_only(layer, hidden, *attention, self._attend)
        else:  # attention and MLP in one compiled function
            return self._attention(layer, hidden, *attention, self._attend)
        return self._moe(layer, hidden) if moe else self._dense_mlp(layer, hidden)

    @torch.no_grad()
    def _rope_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """The rotary's position input: [3, 1, T] for an mrope (from the pack's positions [T],
        equal on every axis, or an image+text pack's own [3, T]: targets/packed/image_text.py),
        [1, T] otherwise."""
        if position_ids.dim() == 2:
            if not self.mrope:
                raise ValueError("3-D positions for a language model without an mrope")
            return position_ids[:, None]
        if self.mrope:
            return position_ids[None, None].expand(3, 1, -1)
        return position_ids[None]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embedding of a pack's `input_ids` [T]: [1, T, d]."""
        return self._embed(input_ids[None])

    def __call__(self, input_ids, position_ids, doc_ids, features, lengths) -> torch.Tensor:
        """Write the captured layers' outputs into `features` [T, k*d] (padding rows zero)."""
        self.stage(None, input_ids, position_ids, doc_ids, features, lengths)
        return features

    @torch.no_grad()
    def stage(self, hidden, input_ids, position_ids, doc_ids, features, lengths) -> torch.Tensor:
        """This forward's layer range on `hidden` [1, T, d] (None: embed, the first stage); the
        captured columns in the range written (padding rows zero); returns the range's output.
        Every recurrent and convolution state lives inside one layer, so it never crosses a
        stage (nor a document: the segments are rebuilt from `lengths` by every stage)."""
        d, T = self.hidden_size, input_ids.shape[0]
        segments = self._segments(np.asarray(lengths), T, input_ids.device)
        mask = document_causal_block_mask(doc_ids) if self._flex else document_causal_mask(doc_ids)
        if hidden is None:
            hidden = self._embed(input_ids[None])  # [1, T, d]
        cos, sin = self._rotary(hidden, self._rope_positions(position_ids))  # [1, T, r]
        for i, layer in self._layers.items():
            hidden = self._layer(layer, hidden, segments, (cos, sin, mask))
            if i in self._columns:
                j = self._columns[i]
                features[:, j * d : (j + 1) * d].copy_(hidden[0])
        mask_padding(features, doc_ids, self._columns.values(), d)
        return hidden
