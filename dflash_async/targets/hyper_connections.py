"""targets/hyper_connections.py owns the taps of hyper-connection targets (DeepSeek-V4, HY-V4,
Qwen4-Exp): the one hidden-size feature per token a tap at layer i gives, from the layer's `hc_mult`
residual streams [.., hc_mult, D] (Qwen4-Exp: `hc_count` streams flattened, [.., hc_count * D],
collapsed alike by its own modules: `gated_residual_collapse`).

The model itself never reads the streams whole: each block collapses them with its `attn_hc`
module's `pre` weights (computed from the streams alone) into the one [.., D] tensor the block's
attention reads, and the model collapses the last layer's streams with its `hc_head` before the
final norm. A tap at layer i is that collapse: the next layer's `attn_hc` collapse of layer i's
output streams (exactly what the next layer reads), and for the last layer the `hc_head` collapse
(exactly what the final norm reads), so it is a function of layer i's output alone and is the
tensor the model feeds forward from it. Taking one stream, or their mean, is neither. The
serving engines' capture for these families is not checked here.

Both the training forward's hooks (targets/generic.py) and the decoding hooks
(eval/speculative.py `captured_layers`) apply the same collapse, so the drafter trains and
decodes on the same tensor. `STREAM_TAPS` (targets/stream_taps.py) names the
model_types that use it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

Collapse = Callable[[torch.Tensor], torch.Tensor]


def _hc_head(model: nn.Module) -> nn.Module:
    """The model's final stream collapse (the module named `hc_head`)."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "hc_head":
            return module
    raise ValueError(f"{type(model).__name__} has no hc_head to collapse its last layer's streams")


def fed_forward_collapse(model: nn.Module, layers: nn.ModuleList, index: int) -> Collapse:
    """Layer `index`'s streams [.., hc_mult, D] -> the [.., D] tensor the model reads from them
    next (see the module doc): the next layer's `attn_hc` collapse (its last output, in both
    families), or the `hc_head` collapse after the last layer."""
    if index + 1 < len(layers):
        attn_hc = layers[index + 1].attn_hc
        return lambda streams: attn_hc(streams)[-1]
    return _hc_head(model)


def _named(model: nn.Module, name: str) -> nn.Module:
    """The model's module named `name` (the last part of its dotted name)."""
    for full, module in model.named_modules():
        if full.rsplit(".", 1)[-1] == name:
            return module
    raise ValueError(f"{type(model).__name__} has no {name} to collapse its last layer's streams")


def gated_residual_collapse(model: nn.Module, layers: nn.ModuleList, index: int) -> Collapse:
    """Qwen4-Exp's layer `index` output, its `hc_count` streams flattened [.., hc_count * D] ->
    the [.., D] tensor the model reads from them next: the next layer's `attn_hyper_connection`
    mix (its first output), or after the last layer the `hyper_connection_mixer` mix the
    lm_head reads. A next layer with a per-layer n-gram embedding (`ple`, on the layers
    `ple_layer_ids` names) adds it to the streams before mixing; that addition reads the token
    ids, not the streams, so the tap mixes the streams alone (the default config has none)."""
    if index + 1 < len(layers):
        mix = layers[index + 1].attn_hyper_connection
        return lambda streams: mix(streams)[0]
    return _named(model, "hyper_connection_mixer")
