"""targets/packed/window.py owns the packed forward of dense sliding-window decoders: Mistral (one
window on every layer), Gemma 3 text (interleaved local/full layers, sandwich norms, a RoPE
base per layer kind), Gemma 4 text (its layer: `targets/packed/gemma4.py`) and Muse Glimmer and
Spark's language models (their gated-attention layers: `targets/packed/muse.py`), on the same
fixed pack layout as `targets/packed/dense.py`.

The window is part of the document-causal rule: row q sees key k iff doc(k) == doc(q), k <= q and
q - k < window (HF's `sliding_window_overlay`: kv_idx > q_idx - window), so each row sees the keys
[lo(q), q] with lo(q) = max(start of its document, q - window + 1); full-attention layers use
lo(q) = start. Two implementations of that one interval rule, as in packed_dense:
- `window_causal_mask` [T, T] for SDPA (the reference), and the same rule as
  `packed_dense.sdpa_mask(doc_ids, window)` (query chunks on the CPU, any T);
- `window_block_mask` for flex_attention on CUDA (tile counts from fixed-shape tensor ops, no
  host sync; its mask_mod reads lo[q]).

The layers are the HF modules (norms incl. Gemma's (1 + w) RMSNorm, projections, q/k norms, the
GeGLU or SwiGLU MLP, Gemma's scaled embedding); only the attention core is ours. The query scale
is the module's own `scaling` (Gemma: query_pre_attn_scalar ** -0.5). Attention logit
soft-capping is refused (`window_layout_problem`): transformers 5.x's Gemma 3 attention does not
pass `attn_logit_softcapping` to its attention function, so HF itself ignores it, and a packed
path that applied it (or silently did not) would not be checkably "HF's features".
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from dflash_async.targets.packed.dense import (
    FLEX_TILE,
    PackedRange,
    attention_block,
    compiled,
    document_causal_block_mask,
    document_causal_mask,
    mask_padding,
    mlp_block,
    rope_half,
    sdpa_mask,
)

SLIDING, FULL = "sliding_attention", "full_attention"
_ROPE_TYPES = frozenset(
    {"default", "linear", "llama3", "yarn", "proportional"}
)  # no length-dependent update
PRE_NORM_PARTS = frozenset({"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"})
SANDWICH_PARTS = PRE_NORM_PARTS | {"pre_feedforward_layernorm", "post_feedforward_layernorm"}


@dataclass(frozen=True)
class WindowLayers:
    """A family's decoder layers as this forward runs them (its entry in targets/families.py).

    layer: the layer function, (layer, hidden, cos, sin, mask, attend) -> hidden [1, T, d].
    parts: the children every decoder layer must have (else the HF fallback runs it).
    per_layer_kinds: the config's `layer_types` give each layer's kind (Gemma); False: one kind
      on every layer, sliding iff `sliding_window` is set (Mistral, as HF's Mistral does).
    problem: config -> the family's features this forward does not run (None: none refused).
    """

    layer: Callable
    parts: frozenset[str]
    per_layer_kinds: bool
    problem: Callable[[object], str | None] | None = None


def window_causal_mask(doc_ids: torch.Tensor, window: int | None) -> torch.Tensor:
    """[T] -> [T, T] bool: same document, k <= q and q - k < window (None: no window)."""
    mask = document_causal_mask(doc_ids)
    if window is None:
        return mask
    rows = torch.arange(doc_ids.shape[0], device=doc_ids.device)
    return mask & (rows[:, None] - rows[None, :] < window)


def window_block_mask(
    doc_ids: torch.Tensor,
    window: int | None,
    tile: int = FLEX_TILE,
    *,
    last_key: torch.Tensor | None = None,
):
    """The rule of `window_causal_mask` as a flex BlockMask (packed/dense.py's, with the window;
    `last_key`: see `PackedWindowForward.masks`)."""
    return document_causal_block_mask(doc_ids, tile, window=window, last_key=last_key)


def layer_kinds(config, *, per_layer: bool) -> tuple[str, ...]:
    """Each decoder layer's attention kind: the config's `layer_types` when `per_layer` (Gemma);
    else all one kind (HF's Mistral windows every layer when `sliding_window` is set, whatever
    `layer_types` says)."""
    types = getattr(config, "layer_types", None)
    if types and per_layer:
        return tuple(types)
    kind = SLIDING if getattr(config, "sliding_window", None) else FULL
    return (kind,) * config.num_hidden_layers


def _rope_types(rotary: nn.Module) -> set:
    rope = getattr(rotary, "rope_type", None)
    return set(rope.values()) if isinstance(rope, dict) else {rope}


def window_layout_problem(inner: nn.Module, *, family: WindowLayers) -> str | None:
    """None when `inner` (the decoder stack) has the layers of `family` this forward runs exactly."""
    config = inner.config
    kinds = set(layer_kinds(config, per_layer=family.per_layer_kinds))
    if kinds - {SLIDING, FULL}:
        return f"layer_types {sorted(kinds)}"
    if getattr(config, "use_bidirectional_attention", False):
        return "use_bidirectional_attention (not causal)"
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "attn_logit_softcapping is set, and HF's Gemma 3 attention ignores it (see module)"
    if not _rope_types(inner.rotary_emb) <= _ROPE_TYPES:
        return f"rope_type {_rope_types(inner.rotary_emb)} (only {sorted(_ROPE_TYPES)})"
    if family.problem is not None and (problem := family.problem(config)):
        return problem
    for layer in inner.layers:
        if {name for name, _ in layer.named_children()} != family.parts:
            return f"decoder layer {type(layer).__name__} without the parts {sorted(family.parts)}"
    return None


def attention_core(layer: nn.Module, x, cos, sin, mask, attend) -> torch.Tensor:
    """The HF layer's self-attention of the normed input x [1, T, d] -> o_proj output [1, T, d]."""
    attn = layer.self_attn
    shape = (1, x.shape[1], -1, attn.head_dim)
    q, k = attn.q_norm(attn.q_proj(x).view(shape)), attn.k_norm(attn.k_proj(x).view(shape))
    v = attn.v_proj(x).view(shape).transpose(1, 2)  # [1, Hkv, T, hd]
    q, k = rope_half(q.transpose(1, 2), cos, sin), rope_half(k.transpose(1, 2), cos, sin)
    out = attend(q, k, v, mask, attn.scaling)  # [1, H, T, hd]
    return attn.o_proj(out.transpose(1, 2).reshape(*x.shape[:2], -1))


def sandwich_layer(layer: nn.Module, hidden, cos, sin, mask, attend) -> torch.Tensor:
    """Gemma's decoder layer on hidden [1, T, d]: a norm before and after attention and MLP."""
    a = attention_core(layer, layer.input_layernorm(hidden), cos, sin, mask, attend)
    hidden = hidden + layer.post_attention_layernorm(a)
    m = layer.mlp(layer.pre_feedforward_layernorm(hidden))
    return hidden + layer.post_feedforward_layernorm(m)


def pre_norm_layer(layer: nn.Module, hidden, cos, sin, mask, attend) -> torch.Tensor:
    """The Llama-shaped decoder layer (Mistral) on hidden [1, T, d]."""
    return mlp_block(layer, attention_block(layer, hidden, cos, sin, mask, attend))


class PackedWindowForward(PackedRange):
    """Features of a packed layout for Mistral / Gemma 3 / Gemma 4 / Muse text (see the module
    docstring): `family` says how its layers run (targets/families.py has each family's).

    A PackedRange (packed/dense.py: the call, the layer range, `attention`) whose `compile`
    wraps the layer function.
    """

    def __init__(
        self,
        text_model: nn.Module,
        layer_ids: Sequence[int],
        *,
        family: WindowLayers,
        attention: str,
        compile: bool,
        layers: range | None = None,
    ) -> None:
        super().__init__(text_model, layer_ids, attention=attention, layers=layers)
        config = text_model.config
        self.window: int | None = getattr(config, "sliding_window", None)
        kinds = layer_kinds(config, per_layer=family.per_layer_kinds)
        self._kinds = {i: kinds[i] for i in self.layers}  # layer -> its attention kind
        self._per_kind_rope = isinstance(getattr(self._rotary, "rope_type", None), dict)
        self._layer_fn = compiled(family.layer, compile=compile)

    def kind_window(self, kind: str) -> int | None:
        """The window of a layer kind: the config's on sliding layers, none on full ones."""
        return self.window if kind == SLIDING else None

    def masks(
        self, doc_ids: torch.Tensor, last_key: torch.Tensor | None = None
    ) -> dict[str, object]:
        """kind -> the attention mask of that layer kind for `doc_ids` [T] (on its device).
        `last_key` [T]: row q sees the keys of its document up to last_key[q] (within the window
        behind q) instead of up to q: Gemma 3's image tokens see their whole image
        (targets/packed/image_text_gemma3.py)."""
        if self.attention == "flex":
            build = functools.partial(window_block_mask, last_key=last_key)
        else:
            build = functools.partial(sdpa_mask, rows=self.query_rows, last_key=last_key)
        return {kind: build(doc_ids, self.kind_window(kind)) for kind in set(self._kinds.values())}

    def rotary_tables(self, hidden, position_ids) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """kind -> (cos, sin) [1, T, hd]: Gemma's local and global bases; Mistral's one table."""
        kinds = set(self._kinds.values())
        if self._per_kind_rope:
            return {kind: self._rotary(hidden, position_ids[None], kind) for kind in kinds}
        table = self._rotary(hidden, position_ids[None])
        return dict.fromkeys(kinds, table)

    @torch.no_grad()
    def stage(
        self, hidden, input_ids, position_ids, doc_ids, features, last_key=None
    ) -> torch.Tensor:
        """Run the layer range on hidden [1, T, d] (None: embed `input_ids`), write its captured
        columns (padding rows zero) and return the range's output [1, T, d] (as packed_dense);
        `last_key`: see `masks`."""
        d = self.hidden_size
        masks = self.masks(doc_ids, last_key)
        if hidden is None:
            hidden = self._embed(input_ids[None])  # [1, T, d] (Gemma: scaled by sqrt(d) inside)
        tables = self.rotary_tables(hidden, position_ids)
        for i, layer in self._layers.items():
            kind = self._kinds[i]
            hidden = self._layer_fn(layer, hidden, *tables[kind], masks[kind], self._attend)
            self.capture(i, hidden, features)
        mask_padding(features, doc_ids, self._columns.values(), d)
        return hidden
