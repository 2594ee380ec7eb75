"""What every drafter kind provides: the `DrafterKind` record that model/kinds/'s table lists.

This module owns the kind interface and `with_fields`, which adds a kind's settings fields
to the dataclass fields of DrafterConfig, DrafterSpec and StepSpec (one declaration per field:
its name, type and default are those of DFLASH_DRAFTER__* or DFLASH_TRAIN__*). It imports no
model code: model/drafter_config.py composes DrafterConfig from the table while it is imported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel


@dataclass(frozen=True, kw_only=True)
class DrafterKind:
    """One drafter kind: its fields, model, objective, export, identity, FLOPs and decoding.

    `config` is a DrafterConfig, `spec` a StepSpec, `train` the TrainSettings; every callable is
    a plain function of the kind's module (the model's are imported at their call: see there).
    """

    name: str  # the table's key, DFLASH_DRAFTER__KIND
    architecture: str  # the export's config.json "architectures" (what z-lab and engines read)
    model_type: str  # the export's config.json "model_type"
    summary: str  # what the drafter adds, for DFLASH_DRAFTER__KIND's description
    # DFLASH_DRAFTER__* of the kind, also DrafterConfig's and DrafterSpec's fields (its shape)
    drafter_fields: type[BaseModel]
    # DFLASH_TRAIN__* of the kind, also StepSpec's fields (its objective and kernels)
    train_fields: type[BaseModel]
    check_config: Callable[[Any], None]  # ValueError for a config this kind cannot build
    # the kind's entries of DrafterConfig.identity() (the run identity's drafter shape)
    identity: Callable[[Any], dict[str, Any]]
    # the kind's DFLASH_TRAIN__* keys of checkpoint/state.run_identity, from the step's spec
    run_identity: Callable[[Any], dict[str, Any]]
    # StepSpec values of the kind's train fields from the settings (`cuda`: GPU drafters)
    step_values: Callable[..., dict[str, Any]]
    make_drafter: Callable[[Any], Any]  # config -> the trainable drafter module
    # (ObjectiveConfig, drafter, embed, lm_head, *, spec, flex_fn) -> the kind's objective
    make_objective: Callable[..., Any]
    # objective -> the kernels it resolved on its device, for the drafter_kernels_chosen line
    kernels_chosen: Callable[[Any], dict[str, Any]]
    export_fields: Callable[[Any], dict[str, Any]]  # config -> its dflash_config entries
    weight_shapes: Callable[[Any], dict[str, tuple[int, ...]]]  # config -> its extra tensors
    # (dflash_config, where) -> the DrafterConfig fields of an export of this kind
    fields_from_export: Callable[[Mapping[str, Any], str], dict[str, Any]]
    flops: Callable[..., dict[str, float]]  # (config, *, slots) -> train FLOPs beyond DFlash's
    # (drafter, hidden [b, n, d], unary [b, n, V], anchors [b]) -> drafts [b, n] at T = 0
    draft_tokens: Callable[..., Any]
    # (drafter, hidden, unary, anchors, *, sampler) -> (drafts [b, n], q [b, n, V]) at T > 0
    sampled_draft_tokens: Callable[..., Any]
    # The first block slot that drafts a token. 1: slot k of [x_a, MASK, ...] predicts x[a+k]
    # (the anchor's slot predicts nothing; B-1 drafts per block); 0: anchor-first, slot k
    # predicts x[a+k+1] (B drafts per block). Decoding, FLOPs and the export follow it.
    first_draft_slot: int
    # The objective reads the target's own next-token distribution: the target also captures
    # the output of its last layer (features [T, (k+1)*d], the last d columns), which the
    # objective puts through the target's final norm (make_objective's `target_norm`) and lm_head.
    captures_final_hidden: bool
    # defaults of DFLASH_TRAIN__* fields every kind shares that this kind's recipe changes
    # (used where the settings leave them unset)
    train_defaults: Mapping[str, Any]
    # config -> its config.json entries at the top level (what its engines' loaders read there)
    top_level_fields: Callable[[Any], dict[str, Any]]
    # (drafter, hidden [b, n, d], drafts [b, n], anchors [b]) -> the predicted acceptance
    # probability of each draft [b, n] (a confidence head's), or None for a kind without one
    draft_confidence: Callable[..., Any]
    # (speculators_model_type, architecture) of the vLLM speculators model that loads this
    # kind's weights exactly (checkpoint/speculators.py), () where no such model exists
    speculators_model: tuple[str, ...]


def with_fields(base: type, models: list[type[BaseModel]]) -> type:
    """The frozen dataclass `base` with the fields of `models` added after its own (the name,
    type and default of each model field); named and placed as `base` so that it pickles."""
    added = [
        (name, info.annotation, dataclasses.field(default=info.default))
        for model in models
        for name, info in model.model_fields.items()
    ]
    namespace = {"__module__": base.__module__, "__doc__": base.__doc__}
    name = base.__name__.lstrip("_")
    return dataclasses.make_dataclass(name, added, bases=(base,), frozen=True, namespace=namespace)
