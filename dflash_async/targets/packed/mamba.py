"""The packed target forward for NVIDIA's Nemotron-H hybrids (`nemotron_h`: Nemotron-H, Nemotron
Nano 2, Nemotron 3 Nano): one pack in, its features written in place.

Every Nemotron-H decoder layer is one pre-norm residual block (`layers_block_type`): a Mamba-2
mixer ("linear_attention"), grouped-query attention without positional encoding
("full_attention"), a squared-ReLU MLP ("mlp") or a sigmoid-routed MoE block ("moe"). A pack of
documents end to end equals each document alone when nothing crosses a boundary:
- the Mamba-2 mixer's causal depthwise convolution reads, at row t, only the earlier rows of t's
  own document (packed/short_conv.py's `document_conv`);
- its selective state-space recurrence h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t (per head; the
  output C_t h_t + D x_t) starts from a zero state in every document: the decay into each
  document's first row is zero (its log, -inf), so no state flows across a boundary
  (`document_ssd`);
- attention is document-causal, by packed/dense.py's rule and implementations (SDPA under key spans
  on the CPU, flex's BlockMask on CUDA); it has no positions, so position_ids go unused;
- the MLP and MoE blocks are row-wise: HF's modules run on the pack as they are.

The recurrence is the chunked state-space dual (SSD) form of Mamba-2, in plain torch: within a
chunk of `chunk_size` rows a masked quadratic form (like attention: C_l . B_s times the decay
from s to l), across chunks the states passed chunk to chunk. Why plain torch: the Mamba kernels
(mamba_ssm, causal-conv1d) are not installed on the machines this runs on, and HF's own torch path
cannot reset its state inside a row, so without this a pack costs one HF forward per document
(the generic path). The log-decays with -inf at document starts make every decay product a
plain sum with no subtraction (so never inf - inf), each computed as HF's `segment_sum` computes
its in-chunk ones; the states are fp32 where HF's are (the scan, the gated norm's statistics).

Expected cost (estimated from the operation counts, not measured): the Nemotron-H-8B mixer's
projections are ~220 MFLOP per token; the SSD ~7 MFLOP per token in fp32 batched products
(in-chunk form, chunk states, their read-out and the passing between chunks), plus ~6 passes over a
[rows, chunk, heads] fp32 decay tensor per token, 64 KiB each at chunk 128 and 128 heads: on an
H100 a few percent to ~15% of the layer's time. Memory is bounded by slicing the pack into
SSD_ROWS-row pieces (the state handed from each to the next): at the 8B's shape a piece's decay
tensors are ~270 MB each. On CUDA the mixer's input part (norm, in_proj, convolution, dt), each
piece of the SSD and the output part (D skip, gated norm, out_proj) are torch.compile'd
functions; the MoE block runs eagerly (its routing is data-dependent), as in packed_dense.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from dflash_async.data.packing import document_starts
from dflash_async.targets.packed.dense import (
    MLP_ROWS,
    PackedRange,
    compiled,
    mask_padding,
)
from dflash_async.targets.packed.short_conv import document_conv

# Rows of one SSD piece: its in-chunk decay and score tensors are rows x chunk x heads fp32 each
# (at chunk 128, 128 heads: 268 MB per tensor)
SSD_ROWS = 4096

_BLOCK_TYPES = frozenset({"linear_attention", "full_attention", "mlp", "moe"})
_MAMBA_PARTS = ("in_proj", "conv1d", "act", "dt_bias", "A_log", "D", "norm", "out_proj")
_MAMBA_SIZES = ("num_heads", "head_dim", "n_groups", "ssm_state_size", "chunk_size")
_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")


def mamba_layout_problem(text_model: nn.Module) -> str | None:
    """None when every decoder layer is a Nemotron-H block this forward runs: a norm and one
    mixer, a Mamba-2 mixer with a depthwise convolution and a grouped gated norm, attention
    without positions, or an MLP / MoE block."""
    for layer in text_model.layers:
        kind = getattr(layer, "block_type", None)
        if kind not in _BLOCK_TYPES:
            return f"decoder layer {type(layer).__name__} of block type {kind!r}"
        mixer = getattr(layer, "mixer", None)
        if mixer is None or not hasattr(layer, "norm"):
            return f"decoder layer {type(layer).__name__} lacks a norm or a mixer"
        if kind == "linear_attention":
            missing = [p for p in _MAMBA_PARTS + _MAMBA_SIZES if not hasattr(mixer, p)]
            if missing:
                return f"Mamba mixer {type(mixer).__name__} lacks {missing}"
            conv = mixer.conv1d
            if conv.groups != conv.in_channels or conv.weight.shape[1] != 1:
                return f"Mamba convolution of {type(mixer).__name__} is not depthwise"
            if not hasattr(mixer.norm, "group_size"):
                return f"Mamba norm {type(mixer.norm).__name__} is not a grouped gated norm"
        elif kind == "full_attention":
            missing = [p for p in _ATTENTION_PARTS if not hasattr(mixer, p)]
            if missing:
                return f"attention {type(mixer).__name__} lacks {missing}"
    return None


def segment_sums(v: torch.Tensor) -> torch.Tensor:
    """v [..., n] -> [..., n, n]: out[..., i, j] = v[j+1] + ... + v[i] for j <= i (0 on the
    diagonal), -inf above it. Masked cumulative sums, no differences: a -inf in v (a reset)
    makes every sum across it -inf, never NaN."""
    n = v.shape[-1]
    below = torch.tril(torch.ones(n, n, dtype=torch.bool, device=v.device), diagonal=-1)
    terms = torch.where(below, v[..., :, None], 0.0)  # [..., i, j]: v[i] where i > j
    sums = terms.cumsum(dim=-2)
    on_or_below = torch.tril(torch.ones(n, n, dtype=torch.bool, device=v.device))
    return sums.masked_fill(~on_or_below, float("-inf"))


def ssd_piece(
    log_decay: torch.Tensor,  # [n, Q, H] fp32, -inf at each document's first row
    xdt: torch.Tensor,  # [n, Q, H, P] fp32: x * dt
    B: torch.Tensor,  # [n, Q, G, N] fp32
    C: torch.Tensor,  # [n, Q, G, N] fp32
    state: torch.Tensor,  # [H, P, N] fp32: the state after the row before the piece
) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD recurrence over n chunks of Q rows: (y [n, Q, H, P] without the D skip, the state
    after the piece's last row [H, P, N]). Head h reads group h // (H / G)'s B and C, as HF's
    repeat_interleave. Decays are sums of log_decay: in-chunk from s (exclusive) to l
    (inclusive); to the chunk's end; from the chunk's start; across whole chunks."""
    n, Q, H, P = xdt.shape
    G, N = B.shape[2:]
    r = H // G
    xdt = xdt.view(n, Q, G, r, P)
    # 1. within each chunk: y_l += sum_{s <= l} (C_l . B_s) exp(a_{s+1} + ... + a_l) xdt_s
    decay = torch.exp(segment_sums(log_decay.permute(0, 2, 1)))  # [n, H, Q(l), Q(s)]
    scores = torch.einsum("nlgk,nsgk->ngls", C, B)  # [n, G, Q, Q]
    weights = decay.view(n, G, r, Q, Q) * scores[:, :, None]
    y = torch.einsum("ngrls,nsgrp->nlgrp", weights, xdt)
    # 2. each chunk's own contribution to the state after its last row
    inclusive = log_decay.flip(1).cumsum(1).flip(1)  # a_s + ... + a_{Q-1}
    to_end = torch.cat([inclusive[:, 1:], torch.zeros_like(inclusive[:, :1])], dim=1)
    states = torch.einsum("nsgr,nsgk,nsgrp->ngrpk", torch.exp(to_end).view(n, Q, G, r), B, xdt)
    # 3. the state entering every chunk: the piece's incoming state and each chunk's own,
    # decayed across the whole chunks between (zero across a document start)
    whole = F.pad(log_decay.sum(1).T, (1, 0))  # [H, n + 1]: 0, then each chunk's total
    passing = torch.exp(segment_sums(whole))  # [H, n + 1, n + 1]
    sources = torch.cat([state[None], states.reshape(n, H, P, N)])  # [n + 1, H, P, N]
    entering = torch.einsum("hij,jhpk->ihpk", passing, sources)  # [n + 1, H, P, N]
    # 4. read the entering state out, decayed from the chunk's start to row l
    from_start = torch.exp(log_decay.cumsum(1)).view(n, Q, G, r)
    carried = torch.einsum("nlgk,ngrpk->nlgrp", C, entering[:n].view(n, G, r, P, N))
    y = y + carried * from_start[..., None]
    return y.reshape(n, Q, H, P), entering[n]


def document_ssd(
    x: torch.Tensor,  # [T, H, P] fp32
    dt: torch.Tensor,  # [T, H] fp32, after bias, softplus and limits
    A: torch.Tensor,  # [H] fp32, negative
    B: torch.Tensor,  # [T, G, N] fp32
    C: torch.Tensor,  # [T, G, N] fp32
    starts: torch.Tensor,  # [T] bool: the first row of a document
    *,
    chunk: int,
    piece: Callable = ssd_piece,
) -> torch.Tensor:
    """y [T, H, P]: y_t = C_t . h_t with h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t^T, the state
    zero before every document's first row (the decay into that row is zero), without the D
    skip. Chunks of `chunk` rows, run in pieces of SSD_ROWS rows by `piece`, each from the state
    the last one left; the last piece padded to whole chunks (zero rows, never read). Each
    piece's decays and x * dt are formed as it runs: no second [T, H, P] copy of x."""
    T, H, P = x.shape
    rows = max(chunk, SSD_ROWS // chunk * chunk)
    state = x.new_zeros(H, P, B.shape[-1])
    y = torch.empty_like(x)
    for s in range(0, T, rows):
        e = min(s + rows, T)
        log_decay = torch.where(starts[s:e, None], float("-inf"), dt[s:e] * A)  # [rows, H]
        part = (log_decay, x[s:e] * dt[s:e, :, None], B[s:e], C[s:e])
        pad = -(e - s) % chunk
        if pad:
            part = tuple(F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)) for t in part)
        n = (e - s + pad) // chunk
        out, state = piece(*(t.reshape(n, chunk, *t.shape[1:]) for t in part), state)
        y[s:e] = out.reshape(n * chunk, H, P)[: e - s]
    return y


def gated_rms_norm(y, gate, weight, group_size: int, eps: float) -> torch.Tensor:
    """Nemotron-H's gated norm (HF NemotronHRMSNormGated): y * silu(gate) in fp32, RMS-normalised
    over each group of `group_size` channels, times weight; in y's dtype before the weight."""
    h = y.float() * F.silu(gate.float())
    groups = h.view(*h.shape[:-1], -1, group_size)
    groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + eps)
    return weight * groups.view(h.shape).to(y.dtype)


def mamba_inputs(layer: nn.Module, hidden: torch.Tensor, doc_ids: torch.Tensor):
    """The Mamba-2 mixer up to its scan, on hidden [1, T, d]: (gate z [T, I], x [T, H, P], B and
    C [T, G, N], dt [T, H]; all but z fp32), the convolution per document."""
    mixer = layer.mixer
    H, G, N = mixer.num_heads, mixer.n_groups, mixer.ssm_state_size
    x = layer.norm(hidden.to(layer.norm.weight.dtype))
    projected = mixer.in_proj(x)[0]  # [T, I + conv channels + H]
    conv_dim = mixer.conv1d.in_channels
    z, xbc, dt = projected.split([projected.shape[-1] - conv_dim - H, conv_dim, H], dim=-1)
    xbc = mixer.act(document_conv(xbc, mixer.conv1d, doc_ids)).to(xbc.dtype)
    x, B, C = xbc.split([conv_dim - 2 * G * N, G * N, G * N], dim=-1)
    # dt as HF's scan takes it: bias and softplus in the projection's dtype, then the limits
    dt = F.softplus(dt + mixer.dt_bias.to(dt.dtype))
    dt = torch.clamp(dt, min=mixer.time_step_limit[0], max=mixer.time_step_limit[1])
    T = x.shape[0]
    x = x.float().view(T, H, mixer.head_dim)
    return z, x, B.float().view(T, G, N), C.float().view(T, G, N), dt.float()


def mamba_output(layer: nn.Module, hidden, y, x, z) -> torch.Tensor:
    """hidden [1, T, d] + the mixer's output from its scan y [T, H, P]: the D skip on x, the gated
    norm, out_proj (in the block's dtype)."""
    mixer, norm = layer.mixer, layer.mixer.norm
    y = (y + mixer.D[:, None] * x).reshape(y.shape[0], -1)  # [T, I] fp32
    y = gated_rms_norm(y, z, norm.weight, norm.group_size, norm.variance_epsilon)
    return hidden + mixer.out_proj(y.to(layer.norm.weight.dtype))[None]


def attention_block(layer: nn.Module, hidden, mask, attend) -> torch.Tensor:
    """hidden [1, T, d] + the block's attention (HF NemotronHAttention: GQA, no positions),
    document-causal."""
    attn = layer.mixer
    x = layer.norm(hidden.to(layer.norm.weight.dtype))
    shape = (1, hidden.shape[1], -1, attn.head_dim)
    q, k, v = (p(x).view(shape).transpose(1, 2) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    out = attend(q, k, v, mask, attn.scaling)  # [1, H, T, hd]
    return hidden + attn.o_proj(out.transpose(1, 2).reshape(*hidden.shape[:2], -1))


def feed_forward_block(layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """hidden [1, T, d] + the block's MLP or MoE (HF's module, row-wise), MLP_ROWS rows at a
    time."""
    parts = [
        layer.mixer(layer.norm(hidden[:, s : s + MLP_ROWS].to(layer.norm.weight.dtype)))
        for s in range(0, hidden.shape[1], MLP_ROWS)
    ]
    return hidden + (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1))


class PackedMambaForward(PackedRange):
    """Features of a packed layout for a Nemotron-H decoder (see the module docstring).

    `attention` is "sdpa" (query chunks under key spans: CPU, any T) or "flex" (CUDA,
    T % 128 == 0); `compile` wraps the mixer's parts, the attention and the MLP blocks in
    torch.compile (CUDA). `stage()` runs a layer range (a split target: targets/split.py); every
    convolution and state-space state lives within one layer and one document, so a stage
    boundary cuts nothing.
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
        super().__init__(
            text_model, layer_ids, attention=attention, layers=layers, embed=text_model.embeddings
        )
        wrap = partial(compiled, compile=compile)
        self._mamba_inputs, self._ssd_piece = wrap(mamba_inputs), wrap(ssd_piece)
        self._mamba_output, self._attention = wrap(mamba_output), wrap(attention_block)
        self._mlp = wrap(feed_forward_block)

    def _mamba(self, layer, hidden, doc_ids, starts) -> torch.Tensor:
        mixer = layer.mixer
        z, x, B, C, dt = self._mamba_inputs(layer, hidden, doc_ids)
        A = -torch.exp(mixer.A_log.float())
        y = document_ssd(x, dt, A, B, C, starts, chunk=mixer.chunk_size, piece=self._ssd_piece)
        return self._mamba_output(layer, hidden, y, x, z)

    @torch.no_grad()
    def stage(self, hidden, input_ids, position_ids, doc_ids, features) -> torch.Tensor:
        """Run this forward's layer range on `hidden` [1, T, d] (None: embed `input_ids`), write
        the captured layers' columns (padding rows zero), return the range's output [1, T, d].
        position_ids go unused: Nemotron-H's attention has no positions."""
        kinds = {layer.block_type for layer in self._layers.values()}
        mask = self.mask(doc_ids) if "full_attention" in kinds else None
        rows = torch.arange(doc_ids.shape[0], device=doc_ids.device)
        starts = document_starts(doc_ids) == rows  # [T] the first row of each document
        if hidden is None:
            hidden = self._embed(input_ids[None])  # [1, T, d]
        for i, layer in self._layers.items():
            if layer.block_type == "linear_attention":
                hidden = self._mamba(layer, hidden, doc_ids, starts)
            elif layer.block_type == "full_attention":
                hidden = self._attention(layer, hidden, mask, self._attend)
            elif layer.block_type == "mlp":
                hidden = self._mlp(layer, hidden)
            else:  # moe: data-dependent routing, eager
                hidden = feed_forward_block(layer, hidden)
            self.capture(i, hidden, features)
        mask_padding(features, doc_ids, self._columns.values(), self.hidden_size)
        return hidden
