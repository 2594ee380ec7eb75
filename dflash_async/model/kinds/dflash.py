"""The DFlash kind (docs/DFLASH.md s.1-8): the block drafter with its unary argmax drafts.

This module owns what is DFlash's alone: no fields of its own, the plain DFlashDrafter and
DFlashObjective, the export architecture "DFlashDraftModel", and a run identity with no kind
entries, the one its checkpoints had before other kinds existed (so that they still resume).
The drafter and the objective are imported at the call: model/drafter_config.py reads this
module while it is being imported, and model/drafter.py imports model/drafter_config.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from dflash_async.model.kinds.interface import DrafterKind

if TYPE_CHECKING:  # torch is imported by the model, not by the settings that read this table
    import torch


class DFlashDrafterFields(BaseModel):
    """DFlash has no DFLASH_DRAFTER__* fields beyond every kind's."""


class DFlashTrainFields(BaseModel):
    """DFlash has no DFLASH_TRAIN__* fields beyond every kind's."""


def check_config(config: Any) -> None:
    """Every DrafterConfig check of a DFlash drafter is every kind's (drafter_config.py)."""


def no_entries(_: Any) -> dict[str, Any]:
    """No identity entries, step values, kernels or export fields of its own."""
    return {}


def step_values(_train: Any, *, cuda: bool) -> dict[str, Any]:
    return {}


def make_drafter(config: Any) -> torch.nn.Module:
    from dflash_async.model.drafter import DFlashDrafter  # at the call: see the module doc

    return DFlashDrafter(config)


def make_objective(config, drafter, embed, lm_head, *, spec: Any, flex_fn=None):
    """DFlash's objective (model/objective.py); `spec` holds nothing it reads."""
    from dflash_async.model.objective import DFlashObjective  # at the call: see the module doc

    return DFlashObjective(config, drafter, embed, lm_head, flex_fn=flex_fn)


def weight_shapes(_: Any) -> dict[str, tuple[int, ...]]:
    return {}


def fields_from_export(_dflash_config: Any, _where: str) -> dict[str, Any]:
    return {}


def flops(_config: Any, *, slots: int) -> dict[str, float]:
    return {}


def no_confidence(drafter, hidden, drafts, anchors) -> None:
    """No confidence head: no predicted acceptance."""
    return None


def draft_tokens(drafter, hidden, unary: torch.Tensor, anchors) -> torch.Tensor:
    """The unary argmax per slot [b, n]."""
    return unary.argmax(-1)


def sampled_draft_tokens(drafter, hidden, unary: torch.Tensor, anchors, *, sampler):
    """Each slot drawn from the filtered unary distribution q; (drafts [b, n], q [b, n, V])."""
    q = sampler.probs(unary)
    return sampler.draw(q), q


KIND = DrafterKind(
    name="dflash",
    architecture="DFlashDraftModel",
    model_type="qwen3",
    summary="docs/DFLASH.md s.1-8",
    drafter_fields=DFlashDrafterFields,
    train_fields=DFlashTrainFields,
    check_config=check_config,
    identity=no_entries,
    run_identity=no_entries,
    step_values=step_values,
    make_drafter=make_drafter,
    make_objective=make_objective,
    kernels_chosen=no_entries,
    export_fields=no_entries,
    weight_shapes=weight_shapes,
    fields_from_export=fields_from_export,
    flops=flops,
    draft_tokens=draft_tokens,
    sampled_draft_tokens=sampled_draft_tokens,
    first_draft_slot=1,
    captures_final_hidden=False,
    train_defaults={},
    top_level_fields=no_entries,
    draft_confidence=no_confidence,
    speculators_model=(),  # speculators' own converter reads its default export
)
