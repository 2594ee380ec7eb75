"""The multimodal target forward: a wrapper (`*ForConditionalGeneration`: vision tower, merger,
language model) run whole by its own HF forward on image+text packs, one document at a time.

Exact by construction, as the generic path (targets/generic.py) is for text: each document runs
alone and unpadded with its own vision inputs (data/images.py), so the wrapper computes that
document's image embeddings and its own multimodal RoPE positions (Qwen3-VL's 3-D positions
from `get_rope_index`: a document's text after an image continues from the image's largest
position, not from its token count) and Gemma 3's bidirectional attention inside each image,
and nothing of another document reaches it. The features are the raw outputs of the language
model's tapped decoder layers, image positions included; padding rows are zero.

The drafter keeps its plain 1-D positions (`PackedBatch.position_ids`, restarting at 0 in every
document), as the serving engines run it: the multimodal positions are the target's alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from dflash_async.data.packing import pack_row_offsets
from dflash_async.targets.generic import GenericForward, find_decoder_layers
from dflash_async.targets.paths import TargetPath
from dflash_async.targets.resolve import TargetError


def language_model_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a wrapper's language model (never the vision tower's blocks, which
    may be as many)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = find_decoder_layers(decoder) if decoder is not None else None
    if layers is None:
        raise TargetError(f"{type(model).__name__}: no language model decoder layers found")
    return layers


class MultimodalForward:
    """The FeatureForward of image+text packs (see the module doc).

    Called as the text paths are, plus `vision`: one mapping of the model's vision inputs per
    document of the pack, in pack order, on the target device (ImageTextSample.model_inputs;
    an empty mapping for a text-only document; None: all text).
    """

    def __init__(self, model: nn.Module, layer_ids: Sequence[int]) -> None:
        if getattr(model.config, "vision_config", None) is None:
            raise TargetError(
                f"{type(model).__name__} has no vision tower: image data needs a multimodal "
                "target (its *ForConditionalGeneration checkpoint)"
            )
        layers = language_model_layers(model)
        self.generic = GenericForward(model, layer_ids, max_batch_tokens=1, layers=layers)
        self.model = model

    @torch.no_grad()
    def __call__(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        doc_ids: torch.Tensor,
        features: torch.Tensor,
        lengths: Any,
        vision: Sequence[Mapping[str, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        lengths = np.asarray(lengths, dtype=np.int64)
        vision = [{}] * len(lengths) if vision is None else vision  # text documents
        if len(vision) != len(lengths):
            raise ValueError(f"{len(vision)} vision inputs for {len(lengths)} documents")
        offsets = pack_row_offsets(lengths)
        for r, n in enumerate(lengths.tolist()):
            lo = int(offsets[r])
            ids = input_ids[lo : lo + n][None]  # [1, n]
            features[lo : lo + n] = self.generic.features(ids, **vision[r])[0]
        features[int(offsets[-1]) :] = 0  # padding rows (finite: masked keys still multiply V)
        return features

    def close(self) -> None:
        self.generic.close()


def multimodal_path(model: nn.Module, layer_ids: Sequence[int]) -> TargetPath:
    """The TargetPath of image+text packs: MultimodalForward, named `hf_multimodal`."""
    return TargetPath(
        MultimodalForward(model, layer_ids),
        "hf_multimodal",
        "image+text data: the wrapper's HF forward per document with its vision inputs",
    )
