"""targets/stream_taps.py owns how a tap reads the layers that return several residual streams per
token: `STREAM_TAPS`, model_type -> the collapse of a layer's streams into the one hidden-size
feature the model itself reads from them next (hyper-connections, targets/hyper_connections.py;
Gemma 3n's AltUp predictions, targets/altup.py). Every other model_type's tap is the layer's
output itself. One table for the training forward's hooks (targets/generic.py), DeepSeek-V4's
packed forward (targets/packed/deepseek_v4.py, through targets/paths.py) and the decoding hooks
(eval/speculative.py), so that all three read the same feature.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from torch import nn

from dflash_async.targets.altup import active_prediction_collapse
from dflash_async.targets.hyper_connections import (
    Collapse,
    fed_forward_collapse,
    gated_residual_collapse,
)

StreamTap = Callable[[nn.Module, nn.ModuleList, int], Collapse]
STREAM_TAPS: Mapping[str, StreamTap] = MappingProxyType(
    {
        "deepseek_v4": fed_forward_collapse,
        "hy_v4": fed_forward_collapse,
        "qwen4_exp_text": gated_residual_collapse,
        "gemma3n_text": active_prediction_collapse,
    }
)


def stream_tap(config: Any) -> StreamTap | None:
    """The STREAM_TAPS entry of `config`'s model_type (a text config), None for the others."""
    return STREAM_TAPS.get(getattr(config, "model_type", None))
