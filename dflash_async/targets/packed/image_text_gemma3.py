"""The packed forward of image+text packs for Gemma 3: the whole pack in one pass of its language
model, as its text packs run (targets/packed/window.py), instead of the wrapper's HF forward once
per document (targets/multimodal.py, the reference it must equal).

What the wrapper's own forward does for one document, done for the pack:
1. the vision tower and projector once over every image of the pack (SigLIP attends within an
   image and the projector pools each image alone, so images batched are images alone);
2. the scaled text embedding of the pack (a placeholder id past the vocabulary read as id 0, as
   the wrapper does), each image's projected features written at its placeholder rows, in
   document order;
3. the language model's layers under Gemma 3's image rule: a row of an image sees the whole
   image, the rows after it too (`token_type_ids` 1 marks them; a run of them is one image, as
   HF's `get_block_sequence_ids_for_mask` counts), on full layers and, within the window behind
   the row, on sliding ones. Every other row is document-causal. Each row's visible keys stay
   one interval [lo(q), hi(q)], hi(q) the last row of its image (`image_block_ends`), so the
   masks are the text path's with that upper end (`last_key`).
Positions stay 1-D, restarting in every document, as the wrapper gives one document alone.

Only documents with pixel inputs take image features and the image rule: a placeholder id in a
text document stays the token it is, as it does when that document runs alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from dflash_async.data.packing import pack_row_offsets
from dflash_async.targets.packed.image_text import documents_with_images
from dflash_async.targets.packed.window import PackedWindowForward

IMAGE_INPUTS = frozenset({"pixel_values", "token_type_ids"})


def image_block_ends(is_image: torch.Tensor) -> torch.Tensor:
    """[T] bool -> [T] int64: the last row of the run of image rows each image row is in, and
    the row itself elsewhere (sync-free)."""
    T = is_image.shape[0]
    index = torch.arange(T, device=is_image.device)
    text_rows = torch.where(is_image, T, index)
    # the first text row at or after each row: a suffix minimum
    next_text = torch.flip(torch.cummin(torch.flip(text_rows, (0,)), 0).values, (0,))
    return torch.where(is_image, next_text - 1, index)


class PackedGemma3ImageTextForward:
    """The FeatureForward of Gemma 3's image+text packs (see the module doc), called as
    targets/packed/image_text.py's forward is."""

    summary = "the vision tower once per pack, each image's rows attending to the whole image"

    def __init__(self, model: nn.Module, text: PackedWindowForward) -> None:
        self.model = model
        self.text = text
        self.image_token_id = int(model.config.image_token_id)
        self.vocab_size = int(model.config.get_text_config().vocab_size)

    @staticmethod
    def problem(text: Any) -> str | None:
        """None when `text` (the language model's forward for text packs) is the packed window
        forward this one extends, else why not."""
        if not isinstance(text, PackedWindowForward):
            return "its language model's forward here is not the packed window one"
        return None

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
        embed_ids = input_ids
        if self.image_token_id >= self.vocab_size:  # as the wrapper: such a placeholder reads 0
            embed_ids = input_ids.masked_fill(input_ids == self.image_token_id, 0)
        hidden = self.text.embed(embed_ids)  # [1, T, d], scaled by sqrt(d) inside
        if not pictured:  # a text pack: the language model's own packed forward
            self.text.stage(hidden, input_ids, position_ids, doc_ids, features)
            return features
        offsets = pack_row_offsets(lengths).tolist()
        is_image = torch.zeros_like(input_ids, dtype=torch.bool)
        rows = []
        for r in pictured:
            inputs, lo, n = vision[r], offsets[r], int(lengths[r])
            if set(inputs) - IMAGE_INPUTS:
                raise ValueError(f"unsupported vision inputs {sorted(set(inputs) - IMAGE_INPUTS)}")
            rows.append(lo + torch.nonzero(input_ids[lo : lo + n] == self.image_token_id)[:, 0])
            if "token_type_ids" in inputs:  # without them the wrapper's mask is causal
                is_image[lo : lo + n] = inputs["token_type_ids"].reshape(-1) == 1
        rows = torch.cat(rows)
        images = self._images([vision[r] for r in pictured])
        if images.shape[0] != rows.numel():
            raise ValueError(f"{rows.numel()} image placeholders for {images.shape[0]} features")
        hidden[0, rows] = images.to(hidden.dtype)
        last_key = image_block_ends(is_image)
        self.text.stage(hidden, input_ids, position_ids, doc_ids, features, last_key=last_key)
        return features

    def _images(self, inputs: Sequence[Mapping]) -> torch.Tensor:
        """The tower and projector once over the documents' images: [n, d], rows in placeholder
        order (transformers returns the projected features as `pooler_output`, or as the tensor
        itself, by version)."""
        out = self.model.model.get_image_features(torch.cat([x["pixel_values"] for x in inputs]))
        projected = getattr(out, "pooler_output", out)
        return projected.reshape(-1, projected.shape[-1])

    def close(self) -> None:
        """Nothing to release (no hooks, unlike MultimodalForward); the same call shape."""
