"""Pack planning and the fixed drafter layout.

Every drafter step sees exactly one `PackedBatch` of `token_budget` rows (T): whole documents laid
end to end, then padding. Fixed shapes are what let a drafter thread capture its step once as a
CUDA graph and replay it (docs/DESIGN.md, "The fixed drafter layout").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedBatch:
    """One drafter step's inputs in the fixed layout. T = token budget, k*d = feature width.

    Documents are contiguous and in ascending `doc_ids` order; padding rows sit at the end with
    doc_id -1, loss_mask False and position 0. A padding row is never an anchor and never context.
    """

    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool: supervised (assistant) tokens
    doc_ids: torch.Tensor  # [T] int64, -1 for padding
    position_ids: torch.Tensor  # [T] int64, restarts at 0 in every document
    features: torch.Tensor  # [T, k*d] target hidden states of the layers in target_layer_ids

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        return PackedBatch(
            **{
                name: getattr(self, name).to(device, non_blocking=non_blocking)
                for name in ("input_ids", "loss_mask", "doc_ids", "position_ids", "features")
            }
        )
