"""targets/altup.py owns the taps of AltUp targets (Gemma 3n): the one hidden-size feature per
token a tap at layer i gives, from the layer's `altup_num_inputs` predictions [P, .., D].

The model never reads the predictions whole: each layer's `altup.predict` mixes them and its
attention and residual run on one of the mixed predictions (`altup_active_idx`); after the last
layer the model un-projects the predictions other than the first (`altup_unembed_projections`,
each rescaled to the first's magnitude) and averages them into the tensor its final norm reads. A
tap at layer i is that: the next layer's active prediction from layer i's output (exactly what its
input norm reads), and for the last layer the un-projected average (exactly what the final norm
reads), so it is a function of layer i's output alone and is the tensor the model feeds forward
from it. Taking one prediction, or their mean, is neither.

Both the training forward's hooks (targets/generic.py) and the decoding hooks
(eval/speculative.py `captured_layers`) apply it; `STREAM_TAPS`
(targets/stream_taps.py) names the model_types that use it.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_async.targets.hyper_connections import Collapse


def _unembedded_mean(model: nn.Module, predictions: torch.Tensor) -> torch.Tensor:
    """The last layer's predictions [P, .., D] -> the final norm's input, as the model computes
    it: the first prediction and the others un-projected to its magnitude, averaged."""
    projections = next(
        module
        for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1] == "altup_unembed_projections"
    )
    first = predictions[0]
    target_magnitude = torch.mean(first**2, dim=-1, keepdim=True) ** 0.5
    kept = [first]
    for i, projection in enumerate(projections, start=1):
        state = projection(predictions[i]).to(dtype=first.dtype)
        magnitude = torch.sqrt(torch.mean(state**2, dim=-1, keepdim=True).clamp(min=1e-5))
        kept.append(state * target_magnitude / magnitude)
    return torch.mean(torch.stack(kept), dim=0)


def active_prediction_collapse(model: nn.Module, layers: nn.ModuleList, index: int) -> Collapse:
    """Layer `index`'s predictions [P, .., D] -> the [.., D] tensor the model reads from them
    next (see the module doc): the next layer's active prediction, or the un-projected average
    after the last layer."""
    if index + 1 < len(layers):
        layer = layers[index + 1]
        active = int(layer.config.altup_active_idx)
        return lambda predictions: layer.altup.predict(predictions)[active]
    return lambda predictions: _unembedded_mean(model, predictions)
