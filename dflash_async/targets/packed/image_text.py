"""The packed forward of image+text packs for Qwen3-VL, Qwen3-VL-MoE and Qwen3.5: the whole pack
in one pass of the language model, as its text packs run (targets/packed/dense.py; Qwen3.5's
hybrid: targets/packed/hybrid.py), instead of the wrapper's HF forward once per document
(targets/multimodal.py, the reference it must equal, and the table of the wrappers that have a
packed one: Gemma 3's is image_text_gemma3.py).

What the wrapper's own forward does for one document, done for the pack:
1. the vision tower once over every image of the pack (its blocks attend within each image,
   by the grid's extents, so images batched are images alone);
2. the text embedding of the pack, each image's merged features written at its placeholder
   rows, in document order (a document's images in the order its placeholders come);
3. each image document's own 3-D rope positions (`get_rope_index` on that document alone: its
   text after an image continues from the image's largest position); text documents keep
   their 1-D positions on all three axes, as the wrapper gives a document without images;
4. the language model's layers on the pack under the document-causal mask (Qwen3.5's Gated
   DeltaNet layers restarting their state in every document), Qwen3-VL's deepstack features
   added to the first layers' outputs at the image rows (`VisualRows`; Qwen3.5's tower has
   none), the captured layers' outputs (after that addition) in the features, padding rows
   zero.

Only documents with pixel inputs take image features: an image placeholder id in a text
document stays the token it is, as it does when that document runs alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from dflash_async.data.packing import pack_row_offsets
from dflash_async.targets.packed.dense import PackedDenseForward, VisualRows
from dflash_async.targets.packed.hybrid import PackedHybridForward

IMAGE_INPUTS = frozenset({"pixel_values", "image_grid_thw", "mm_token_type_ids"})


def documents_with_images(
    lengths: Any, vision: Sequence[Mapping[str, torch.Tensor]] | None
) -> tuple[np.ndarray, Sequence[Mapping[str, torch.Tensor]], list[int]]:
    """A pack's document lengths (host int64), its vision inputs per document (None: all text)
    and the indices of the documents with pixel inputs; ValueError when they disagree."""
    lengths = np.asarray(lengths, dtype=np.int64)
    vision = [{}] * len(lengths) if vision is None else vision
    if len(vision) != len(lengths):
        raise ValueError(f"{len(vision)} vision inputs for {len(lengths)} documents")
    return lengths, vision, [r for r, inputs in enumerate(vision) if "pixel_values" in inputs]


class PackedImageTextForward:
    """The FeatureForward of image+text packs for PACKED_WRAPPERS (see the module doc).

    Called as MultimodalForward is: the layout, `lengths` (host numpy, the documents' extents)
    and `vision`, one mapping of vision inputs per document in pack order (an empty mapping,
    or one without pixel values, for a text document; None: all text)."""

    summary = "the vision tower once per pack, each document's 3-D positions"

    def __init__(self, model: nn.Module, text: PackedDenseForward | PackedHybridForward) -> None:
        self.model = model
        self.text = text
        self.image_token_id = int(model.config.image_token_id)

    @staticmethod
    def problem(text: Any) -> str | None:
        """None when `text` (the language model's forward for text packs) is the packed M-RoPE
        forward this one extends, else why not."""
        if not isinstance(text, (PackedDenseForward, PackedHybridForward)) or not text.mrope:
            return "its language model's forward here is not a packed M-RoPE one"
        return None

    def _stage(self, hidden, input_ids, positions, doc_ids, features, lengths, visual=None):
        """The language model's packed forward on the pack: the dense one adds the deepstack
        rows; the hybrid one takes the documents' lengths (its recurrences restart in each) and
        has no deepstack to add."""
        if isinstance(self.text, PackedHybridForward):
            if visual is not None and visual.adds:
                raise ValueError("deepstack features for a hybrid language model")
            return self.text.stage(hidden, input_ids, positions, doc_ids, features, lengths)
        return self.text.stage(hidden, input_ids, positions, doc_ids, features, visual=visual)

    @torch.no_grad()
    def __call__(
        self,
        input_ids: torch.Tensor,  # [T]
        position_ids: torch.Tensor,  # [T], restarting at 0 in every document
        doc_ids: torch.Tensor,  # [T]
        features: torch.Tensor,  # [T, k*d], written in place
        lengths: Any,
        vision: Sequence[Mapping[str, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        lengths, vision, pictured = documents_with_images(lengths, vision)
        if not pictured:  # a text pack: the language model's own packed forward
            self._stage(None, input_ids, position_ids, doc_ids, features, lengths)
            return features
        offsets = pack_row_offsets(lengths).tolist()
        positions = position_ids[None].repeat(3, 1)  # [3, T]
        rows = []
        for r in pictured:
            inputs, lo, n = vision[r], offsets[r], int(lengths[r])
            if set(inputs) - IMAGE_INPUTS:
                raise ValueError(f"unsupported vision inputs {sorted(set(inputs) - IMAGE_INPUTS)}")
            ids = input_ids[lo : lo + n]
            positions[:, lo : lo + n] = self._document_positions(ids, inputs)
            rows.append(lo + torch.nonzero(ids == self.image_token_id)[:, 0])
        rows = torch.cat(rows)
        merged, deepstack = self._images([vision[r] for r in pictured])
        if merged.shape[0] != rows.numel():
            raise ValueError(f"{rows.numel()} image placeholders for {merged.shape[0]} features")
        hidden = self.text.embed(input_ids)  # [1, T, d]
        hidden[0, rows] = merged.to(hidden.dtype)
        visual = VisualRows(rows, [add.to(hidden.dtype) for add in deepstack])
        self._stage(hidden, input_ids, positions, doc_ids, features, lengths, visual)
        return features

    def _document_positions(self, ids: torch.Tensor, inputs: Mapping) -> torch.Tensor:
        """One document's 3-D rope positions [3, n], as the wrapper computes them alone."""
        positions, _ = self.model.model.get_rope_index(
            ids[None],
            mm_token_type_ids=inputs["mm_token_type_ids"],
            image_grid_thw=inputs["image_grid_thw"],
        )
        return positions[:, 0]

    def _images(self, inputs: Sequence[Mapping]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The tower once over the documents' images: merged features [n, d] and the deepstack
        features (one [n, d] per layer that takes them; none for Qwen3.5), rows in placeholder
        order."""
        out = self.model.model.get_image_features(
            torch.cat([x["pixel_values"] for x in inputs]),
            torch.cat([x["image_grid_thw"] for x in inputs]),
            return_dict=True,
        )
        deepstack = getattr(out, "deepstack_features", None) or []
        return _rows(out.pooler_output), [_rows(f) for f in deepstack]

    def close(self) -> None:
        """Nothing to release (no hooks, unlike MultimodalForward); the same call shape."""


def _rows(value: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-image features as one [n, d] tensor (transformers returns them split per image, or
    whole, by version)."""
    return value if isinstance(value, torch.Tensor) else torch.cat(list(value))
