"""DFlash2's settings fields: DFLASH_DRAFTER__* (its shape) and DFLASH_TRAIN__* (its objective).

This module owns their names, defaults, checks and descriptions; settings/recipe.py composes
them into the `drafter` and `train` sections, model/drafter_config.py into DrafterConfig and
DrafterSpec, and model/build.py into StepSpec. Pydantic only: the settings read it without torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class DFlash2DrafterFields(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True)

    conv_kernel_size: int = Field(2, ge=1)
    """dflash2: taps K of each layer's causal convolutions along the block (2 in every release)."""
    conv_group_size: int = Field(16, ge=1)
    """dflash2: channels sharing one dynamic kernel; must divide the hidden size."""
    selector_rank: int = Field(256, ge=1)
    """dflash2: rank r of the candidate selector's codebooks and hidden projection."""
    selector_top_k: int = Field(16, ge=1)
    """dflash2: candidates per slot the selector chooses among (the unary top-k)."""


class DFlash2TrainFields(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True)

    conv_kernel: Literal["auto", "compiled", "triton"] = "auto"
    """dflash2: the convolutions' kernels: kernels/conv_kernel.py's Triton kernels (GPU only;
    `auto` picks them on a GPU where the drafter's hidden size and conv_group_size allow) or the
    torch ops, compiled with the layers where `compile` is on (same result up to fp32 rounding
    order). The CPU always runs the plain torch ops."""
    selector_alpha: float = Field(1.0, ge=0)
    """dflash2: weight of the candidate selector's cross-entropy next to the DFlash loss; 0 trains
    the unary DFlash loss alone (the selector then learns nothing)."""
