"""targets/packed/moe_window.py owns the packed forward of MoE targets with sliding-window layers
and learned attention sinks, gpt-oss (`gpt_oss`), and of MiniMax-M2 (`minimax_m2`: neither, but
its own router and q/k norms). One pack in, its features written in place.

The layout is `packed_dense`'s (input_ids / position_ids restarting at 0 / doc_ids, -1 padding
last), and so is the rule that nothing crosses a document. What gpt-oss adds, and where it lives:
- sliding windows: a layer whose `self_attn.sliding_window` is W lets query row q see key row k
  iff same document, k <= q and q - k < W (HF's `sliding_window_overlay`: kv > q - W). Documents
  are contiguous, so q sees exactly the interval [lo(q), q], lo(q) = max(start(q), q - W + 1):
  `packed_window.window_causal_mask` (dense, SDPA-style reference), `window_spans` (the same rule in chunks of query
  rows: the CPU path, memory linear in T) and `window_block_mask` (flex, CUDA; its mask_mod is
  tested on the CPU on index tensors);
- sinks: one learned logit s_h per head in the softmax denominator and no value. With the
  log-sum-exp of the visible logits L (per head and row), softmax-with-sink = softmax * Z/(Z+e^s),
  so out_sink = out * sigmoid(L - s_h) (`with_sinks`), on the dense path and on flex
  (`return_lse`) alike;
- RoPE: HF's gpt-oss rotary returns cos/sin of width hd/2 (YaRN scaling already folded in by
  `rotary_emb`), applied to the two halves of each head (`rope_halves`);
- MoE: our router (`gpt_oss_route`: linear with bias, top-k, softmax over the k selected), then
  the HF experts module itself (its clamped SwiGLU with alpha/limit and biases, run through
  whatever `config._experts_implementation` transformers picked: grouped_mm or the eager loop),
  kept out of the compiled region as the Qwen3-MoE packed path does.
MiniMax-M2 (`minimax_qkv`, `minimax_route`): full causal attention, RMSNorm over the whole q and k
projections, partial RoPE (`rope_partial`, the first r dims of each head), a sigmoid router
whose choice adds `e_score_correction_bias` and whose weights are the chosen scores renormalised.
Sync points: none in this module's steady state (masks, sinks, routing are fixed-shape device
ops). The HF experts module is theirs: its grouped_mm path (transformers' default; run eagerly
here, so CUDA's native grouped_mm on Hopper) has none; its fallback (`offs.tolist()`, once per
MoE layer) and its "eager" loop (`nonzero()` over the hit experts) each sync.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from dflash_async.targets.packed.dense import (
    KeySpans,
    PackedRange,
    compiled,
    mask_padding,
    rotate_half,
)
from dflash_async.targets.packed.dense import sdpa_mask as window_spans
from dflash_async.targets.packed.window import window_block_mask

try:
    from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention
except ImportError:  # pragma: no cover
    AuxRequest = BlockMask = flex_attention = None


@dataclass(frozen=True)
class MoeWindowLayers:
    """A family's decoder layers as this forward runs them (its entry in targets/families.py).

    qkv: (self_attn, normed x [1, T, d], cos, sin) -> q [1, H, T, hd], k/v [1, Hkv, T, hd].
    route: (mlp, x [N, d]) -> (experts [N, k] int64, weights [N, k]).
    layer_problem: decoder layer -> why this forward cannot run it (None: it can).
    """

    qkv: Callable
    route: Callable
    layer_problem: Callable[[nn.Module], str | None]


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """out [1, H, T, hd] of a sink-less softmax, lse [1, H, T] its log-sum-exp, sinks [H]:
    the output with each head's sink logit in the denominator, out * sigmoid(lse - sink).
    sinks None (a family without them): out itself."""
    if sinks is None:
        return out
    gate = torch.sigmoid(lse.float() - sinks.float()[None, :, None])  # [1, H, T]
    return out * gate[..., None].to(out.dtype)


def attend_dense_sinks(q, k, v, mask, scale: float, sinks: torch.Tensor | None) -> torch.Tensor:
    """q [1, H, T, hd], k/v [1, Hkv, T, hd], mask [T, T] bool or KeySpans -> [1, H, T, hd] (CPU
    reference: explicit logits, so the log-sum-exp is at hand; every row sees at least itself).
    KeySpans: one chunk of query rows at a time against the keys it may see, so the logits are
    [H, rows, keys seen], never [H, T, T]."""
    if isinstance(mask, KeySpans):
        return torch.cat(
            [
                attend_dense_sinks(q[:, :, s:e], k[:, :, a:e], v[:, :, a:e], part, scale, sinks)
                for s, e, a, part in mask.pieces()
            ],
            dim=2,
        )
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)  # HF's repeat_kv
    logits = (q @ k.transpose(-1, -2)) * scale  # [1, H, T, T]
    logits = logits.masked_fill(~mask, float("-inf"))
    lse = logits.logsumexp(-1)  # [1, H, T]
    out = torch.softmax(logits, dim=-1) @ v
    return with_sinks(out, lse, sinks)


def attend_flex_sinks(q, k, v, mask, scale: float, sinks: torch.Tensor | None) -> torch.Tensor:
    """flex_attention (its lse is natural-log) with `mask` a BlockMask; then the sinks (if any)."""
    out, aux = flex_attention(
        q, k, v, block_mask=mask, scale=scale, enable_gqa=True, return_aux=AuxRequest(lse=True)
    )
    return with_sinks(out, aux.lse, sinks)


def rope_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """gpt-oss RoPE: x [1, H, T, hd], cos/sin [1, T, hd/2] rotate (first, second) halves."""
    first, second = x.chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def rope_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """MiniMax-M2 RoPE: x [1, H, T, hd], cos/sin [1, T, r] (r <= hd, HF's rotate_half form) on
    the first r dims of each head; the other hd - r pass through."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    rot = rot * cos[:, None] + rotate_half(rot) * sin[:, None]
    return torch.cat((rot, rest), dim=-1)


def gpt_oss_qkv(attn: nn.Module, x, cos, sin) -> tuple[torch.Tensor, ...]:
    """x [1, T, d] -> q [1, H, T, hd], k/v [1, Hkv, T, hd]: biased projections, RoPE halves."""
    shape = (1, x.shape[1], -1, attn.head_dim)
    q = rope_halves(attn.q_proj(x).view(shape).transpose(1, 2), cos, sin)
    k = rope_halves(attn.k_proj(x).view(shape).transpose(1, 2), cos, sin)
    return q, k, attn.v_proj(x).view(shape).transpose(1, 2)


def minimax_qkv(attn: nn.Module, x, cos, sin) -> tuple[torch.Tensor, ...]:
    """MiniMax-M2: RMSNorm over the whole q (k) projection, all heads at once, then partial RoPE."""
    shape = (1, x.shape[1], -1, attn.head_dim)
    q = rope_partial(attn.q_norm(attn.q_proj(x)).view(shape).transpose(1, 2), cos, sin)
    k = rope_partial(attn.k_norm(attn.k_proj(x)).view(shape).transpose(1, 2), cos, sin)
    return q, k, attn.v_proj(x).view(shape).transpose(1, 2)


def attention_block(layer: nn.Module, hidden, cos, sin, mask, attend, qkv) -> torch.Tensor:
    """hidden [1, T, d] + the HF layer's self-attention (pre-norm residual): window by `mask`,
    the sinks of the layer if it has them (gpt-oss), q/k/v by the family's `qkv`."""
    attn = layer.self_attn
    q, k, v = qkv(attn, layer.input_layernorm(hidden), cos, sin)
    out = attend(q, k, v, mask, attn.scaling, getattr(attn, "sinks", None))  # [1, H, T, hd]
    return hidden + attn.o_proj(out.transpose(1, 2).reshape(*hidden.shape[:2], -1))


def gpt_oss_route(moe: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, d] -> (experts [N, k] int64, weights [N, k]): top-k of the biased router logits,
    then a softmax over the k selected (not over all experts)."""
    router = moe.router
    logits = nn.functional.linear(x, router.weight, router.bias)  # [N, E]
    top, experts = torch.topk(logits, router.top_k, dim=-1)  # [N, k] each
    return experts, torch.softmax(top, dim=-1)


def minimax_route(moe: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MiniMax-M2: sigmoid scores (fp32); the choice is top-k of score + e_score_correction_bias,
    the weights are the chosen experts' plain scores renormalised to sum 1."""
    gate = moe.gate
    scores = torch.sigmoid(nn.functional.linear(x.to(gate.weight.dtype), gate.weight).float())
    _, experts = torch.topk(scores + moe.e_score_correction_bias, gate.top_k, dim=-1, sorted=False)
    weights = scores.gather(1, experts)  # [N, k]
    return experts, weights / weights.sum(dim=-1, keepdim=True)


def moe_block(layer: nn.Module, hidden: torch.Tensor, route) -> torch.Tensor:
    """hidden [1, T, d] + the MoE (our `route`, HF's experts) on the post-attention norm."""
    x = layer.post_attention_layernorm(hidden)[0]  # [T, d]
    experts, weights = route(layer.mlp, x)
    return hidden + layer.mlp.experts(x, experts, weights)[None]


def gpt_oss_layer_problem(layer: nn.Module) -> str | None:
    """gpt-oss: every layer has its attention sinks and a router."""
    if getattr(layer.self_attn, "sinks", None) is None or not hasattr(
        getattr(layer, "mlp", None), "router"
    ):
        return f"decoder layer {type(layer).__name__} without sinks or a router"
    return None


def minimax_layer_problem(layer: nn.Module) -> str | None:
    """MiniMax-M2: every layer's router is the corrected sigmoid one."""
    if not hasattr(getattr(layer, "mlp", None), "e_score_correction_bias"):
        return f"decoder layer {type(layer).__name__} without a corrected sigmoid router"
    return None


def layout_problem(text_model: nn.Module, *, family: MoeWindowLayers) -> str | None:
    """None when every decoder layer has the shape of `family` that this forward runs."""
    for layer in text_model.layers:
        if problem := family.layer_problem(layer):
            return problem
    rope = getattr(text_model.rotary_emb, "rope_type", None)
    if rope not in ("default", "yarn"):
        return f"rope_type {rope!r} (only 'default' and 'yarn')"
    return None


class PackedWindowMoeForward(PackedRange):
    """Features of a packed layout for gpt-oss or MiniMax-M2 (module docstring), whose qkv and
    router `family` gives; a PackedRange (packed/dense.py: the call, the layer range,
    `attention`) whose `compile` wraps the attention blocks (the MoE runs eagerly between them)."""

    def __init__(
        self,
        text_model: nn.Module,
        layer_ids: Sequence[int],
        *,
        family: MoeWindowLayers,
        attention: str,
        compile: bool,
        layers: range | None = None,
    ) -> None:
        super().__init__(text_model, layer_ids, attention=attention, layers=layers)
        self._windows = {
            i: getattr(layer.self_attn, "sliding_window", None) for i, layer in self._layers.items()
        }
        self._qkv, self._route = family.qkv, family.route
        self._attend = attend_flex_sinks if attention == "flex" else attend_dense_sinks
        self._attention_fn = compiled(attention_block, compile=compile)

    def masks(self, doc_ids: torch.Tensor) -> dict[int | None, object]:
        """window (None: full attention) -> the mask of that window, for this range's layers."""
        if self.attention == "flex":
            build = window_block_mask
        else:
            build = functools.partial(window_spans, rows=self.query_rows)
        return {w: build(doc_ids, w) for w in set(self._windows.values())}

    @torch.no_grad()
    def stage(self, hidden, input_ids, position_ids, doc_ids, features) -> torch.Tensor:
        """Run this range on `hidden` [1, T, d] (None: embed `input_ids`), write its captured
        columns (padding rows zero), return its output hidden [1, T, d]."""
        d = self.hidden_size
        masks = self.masks(doc_ids)
        if hidden is None:
            hidden = self._embed(input_ids[None])  # [1, T, d]
        cos, sin = self._rotary(hidden, position_ids[None])  # [1, T, hd/2] or [1, T, r] each
        for i, layer in self._layers.items():
            mask = masks[self._windows[i]]
            hidden = self._attention_fn(layer, hidden, cos, sin, mask, self._attend, self._qkv)
            hidden = moe_block(layer, hidden, self._route)
            self.capture(i, hidden, features)
        mask_padding(features, doc_ids, self._columns.values(), d)
        return hidden
