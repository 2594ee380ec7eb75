"""Which attention rule each drafter layer trains under (docs/DFLASH.md s.10, the drafter variants).

A layer is `full_attention` (the rule of s.2: its document's context before the anchor, the whole
block) or `sliding_attention` (z-lab's per-slot window: block slot k, at position anchor + k,
sees only the context rows with `(anchor + k) - p < W` and the block slots with |k - s| < W).
Inside the block a layer is bidirectional or causal (slot k sees slots 0..k): sliding layers are
causal and full layers bidirectional by default, and `is_causal` overrides that for every layer.
This module owns that mapping and nothing else; the two mask implementations of a rule are
attention.py's. Pure Python: the settings import it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

LayerType = Literal["full_attention", "sliding_attention"]
FULL_ATTENTION: LayerType = "full_attention"
SLIDING_ATTENTION: LayerType = "sliding_attention"
LAYER_TYPES: tuple[LayerType, ...] = (FULL_ATTENTION, SLIDING_ATTENTION)


@dataclass(frozen=True)
class AttentionRule:
    """One layer's mask rule. window None: every context row of the document before the anchor;
    W: slot k only rows p with (anchor + k) - p < W, and block slots s with |k - s| < W.
    causal: block slot k sees block slots 0..k only."""

    window: int | None = None
    causal: bool = False


def layer_types_of(layer_types: tuple[str, ...], num_layers: int) -> tuple[str, ...]:
    """The per-layer types, `()` meaning every layer full attention."""
    return layer_types or (FULL_ATTENTION,) * num_layers


def layer_rules(
    layer_types: tuple[str, ...],
    *,
    num_layers: int,
    sliding_window: int | None,
    is_causal: bool | None,
) -> tuple[AttentionRule, ...]:
    """One AttentionRule per layer; at most two distinct ones (a full and a sliding rule)."""
    rules = []
    for kind in layer_types_of(layer_types, num_layers):
        sliding = kind == SLIDING_ATTENTION
        causal = sliding if is_causal is None else is_causal
        rules.append(AttentionRule(window=sliding_window if sliding else None, causal=causal))
    return tuple(rules)


def layer_rule_problem(
    layer_types: tuple[str, ...], *, num_layers: int, sliding_window: int | None
) -> str | None:
    """What is wrong with a layer layout, or None: a count other than num_layers, an unknown
    type, or sliding layers without a window W >= 1. The message names the config field."""
    if layer_types and len(layer_types) != num_layers:
        return f"layer_types names {len(layer_types)} layers, the drafter has {num_layers}"
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        return f"layer_types {unknown} are not {' or '.join(LAYER_TYPES)}"
    if SLIDING_ATTENTION in layer_types and (sliding_window is None or sliding_window < 1):
        return f"sliding_window={sliding_window} must be at least 1 with sliding_attention layers"
    return None
