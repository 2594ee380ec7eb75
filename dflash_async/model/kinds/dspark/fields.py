"""DSpark's settings fields: DFLASH_DRAFTER__* (its shape) and DFLASH_TRAIN__* (its objective).

This module owns their names, defaults, checks and descriptions; the defaults are the DSpark
paper's Qwen3-8B recipe (docs/DFLASH.md s.11). settings/recipe.py composes them into the
`drafter` and `train` sections, model/drafter_config.py into DrafterConfig and DrafterSpec, and
model/build.py into StepSpec. Pydantic only: the settings read it without torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class DSparkDrafterFields(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True)

    markov_rank: int = Field(256, ge=0)
    """dspark: rank r of the Markov head, the low-rank bias W2 @ W1[previous token] on each
    slot's logits; 0 drafts without it."""
    markov_head_type: Literal["vanilla", "gated"] = "vanilla"
    """dspark: `vanilla` adds W2 @ W1[prev]; `gated` scales W1[prev] by
    sigmoid(gate_proj([h, W1[prev]])) first (h: the slot's hidden state)."""
    confidence_head: bool = True
    """dspark: the confidence head, sigmoid(Linear(...)), which predicts each slot's acceptance."""
    confidence_head_with_markov: bool = True
    """dspark: the confidence head reads [h, W1[prev]] (needs markov_rank > 0), else h alone."""


class DSparkTrainFields(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True)

    ce_alpha: float = Field(0.1, ge=0)
    """dspark: weight of the cross-entropy against the data's tokens."""
    l1_alpha: float = Field(0.9, ge=0)
    """dspark: weight of ||softmax(draft) - softmax(target)||_1 over the full vocabulary."""
    confidence_alpha: float = Field(1.0, ge=0)
    """dspark: weight of the confidence head's BCE against 1 - L1/2 (detached)."""
