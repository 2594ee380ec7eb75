"""The DFlash2 kind (docs/DFLASH.md s.9): DFlash plus per-layer dynamic convolutions and a
candidate selector whose walk over the unary top-k makes the drafts.

This package owns everything DFlash2's: its fields (fields.py), the drafter (drafter.py), the
objective and its conv kernel choice (objective.py), the objective's top-k (grouped_topk.py), the
decoding walk (decoding.py), and here the kind record: its config checks, run identity, export
("DFlash2DraftModel", the dflash_config fields, the extra tensors) and FLOPs.
The model modules are imported at their call: model/drafter_config.py reads this package while
it is being imported, and the drafter imports model/drafter_config.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dflash_async.model.kinds.dflash2.fields import DFlash2DrafterFields, DFlash2TrainFields
from dflash_async.model.kinds.interface import DrafterKind

NAME = "dflash2"
# The fields only a DFlash2 drafter reads (docs/DFLASH.md s.9), in its dflash_config's order.
DRAFTER_FIELDS = tuple(DFlash2DrafterFields.model_fields)


def conv_groups(config: Any) -> int:
    """G: dynamic kernels per convolution tap (hidden_size / conv_group_size)."""
    return config.hidden_size // config.conv_group_size


def check_config(config: Any) -> None:
    if config.hidden_size % config.conv_group_size:
        raise ValueError(
            f"conv_group_size={config.conv_group_size} does not divide "
            f"hidden_size={config.hidden_size}"
        )
    if not 1 <= config.selector_top_k <= config.vocab_size:
        raise ValueError(f"selector_top_k={config.selector_top_k} is outside [1, vocab_size]")
    if min(config.conv_kernel_size, config.selector_rank) < 1:
        raise ValueError("conv_kernel_size and selector_rank must be at least 1")


def identity(config: Any) -> dict[str, Any]:
    """The kind and its shape fields: a DFlash2 run differs from a DFlash one of equal shape."""
    return {"kind": NAME, **export_fields(config)}


def run_identity(spec: Any) -> dict[str, Any]:
    """The selector's weight changes every step's loss and so the weights."""
    return {"DFLASH_TRAIN__SELECTOR_ALPHA": spec.selector_alpha}


def step_values(train: Any, *, cuda: bool) -> dict[str, Any]:
    """The step's conv kernel (the CPU runs the torch ops) and the selector's weight."""
    return {
        "conv_kernel": train.conv_kernel if cuda else "compiled",
        "selector_alpha": train.selector_alpha,
    }


def make_drafter(config: Any):
    from dflash_async.model.kinds.dflash2.drafter import DFlash2Drafter  # see the module doc

    return DFlash2Drafter(config)


def make_objective(config, drafter, embed, lm_head, *, spec: Any, flex_fn=None):
    """DFlash2Objective with the spec's selector weight and conv kernel choice."""
    from dflash_async.model.kinds.dflash2.objective import DFlash2Objective  # see the module doc

    return DFlash2Objective(
        config,
        drafter,
        embed,
        lm_head,
        selector_alpha=spec.selector_alpha,
        conv_kernel=spec.conv_kernel,
        flex_fn=flex_fn,
    )


def kernels_chosen(objective: Any) -> dict[str, Any]:
    """The convolutions' kernel as resolved on the objective's device ("triton" or "compiled")."""
    return {"conv_kernel": objective.conv_kernel}


def export_fields(config: Any) -> dict[str, Any]:
    """dflash_config's convolution and selector fields."""
    return {name: getattr(config, name) for name in DRAFTER_FIELDS}


def weight_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """DFlash2's tensors (docs/DFLASH.md s.9): two convolutions per layer and the selector,
    whose codebooks are plain tensors (no `.weight`)."""
    d, k, r = config.hidden_size, config.conv_kernel_size, config.selector_rank
    conv = {"base_kernel": (2, k, d), "kernel_projection.weight": (2 * k * conv_groups(config), d)}
    shapes = {
        f"layers.{i}.{which}.{name}": shape
        for i in range(config.num_hidden_layers)
        for which in ("attention_conv", "mlp_conv")
        for name, shape in conv.items()
    }
    shapes["candidate_selector.hidden_projection.weight"] = (r, d)
    shapes["candidate_selector.predecessor_codebook"] = (config.vocab_size, r)
    shapes["candidate_selector.successor_codebook"] = (config.vocab_size, r)
    return shapes


def fields_from_export(dflash_config: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Its fields from an export's dflash_config; every one is required."""
    missing = [f"dflash_config.{name}" for name in DRAFTER_FIELDS if name not in dflash_config]
    if missing:
        raise ValueError(f"{where}: missing fields {missing}")
    return {name: int(dflash_config[name]) for name in DRAFTER_FIELDS}


def flops(config: Any, *, slots: int) -> dict[str, float]:
    """DFlash2's matmul work beyond DFlash's (docs/DFLASH.md s.9), trained (3x forward):
    - `conv`: per layer two kernel projections d -> 2*K*G over the Q block slots (the
      convolutions' multiply-adds are elementwise work and count 0, like norms);
    - `selector`: hidden_projection d -> r and the k candidates' rank-r dot products per
      supervised slot (the codebook gathers count 0)."""
    d, L, r = config.hidden_size, config.num_hidden_layers, config.selector_rank
    kg = 2 * config.conv_kernel_size * conv_groups(config)
    supervised = slots // config.block_size * (config.block_size - 1)
    return {
        "conv": float(3 * L * 2 * 2 * slots * d * kg),
        "selector": float(3 * 2 * supervised * (d * r + config.selector_top_k * r)),
    }


def no_top_level_fields(_: Any) -> dict[str, Any]:
    """Every DFlash2 field is in dflash_config."""
    return {}


def no_confidence(drafter, hidden, drafts, anchors) -> None:
    """No confidence head: no predicted acceptance."""
    return None


def draft_tokens(drafter, hidden, unary, anchors):
    from dflash_async.model.kinds.dflash2 import decoding  # see the module doc

    return decoding.draft_tokens(drafter, hidden, unary, anchors)


def sampled_draft_tokens(drafter, hidden, unary, anchors, *, sampler):
    from dflash_async.model.kinds.dflash2 import decoding  # see the module doc

    return decoding.sampled_draft_tokens(drafter, hidden, unary, anchors, sampler=sampler)


KIND = DrafterKind(
    name=NAME,
    architecture="DFlash2DraftModel",
    model_type="qwen3",
    summary=(
        "two grouped dynamic causal convolutions per layer and a candidate selector, "
        "docs/DFLASH.md s.9"
    ),
    drafter_fields=DFlash2DrafterFields,
    train_fields=DFlash2TrainFields,
    check_config=check_config,
    identity=identity,
    run_identity=run_identity,
    step_values=step_values,
    make_drafter=make_drafter,
    make_objective=make_objective,
    kernels_chosen=kernels_chosen,
    export_fields=export_fields,
    weight_shapes=weight_shapes,
    fields_from_export=fields_from_export,
    flops=flops,
    draft_tokens=draft_tokens,
    sampled_draft_tokens=sampled_draft_tokens,
    first_draft_slot=1,
    captures_final_hidden=False,
    train_defaults={},
    top_level_fields=no_top_level_fields,
    draft_confidence=no_confidence,
    speculators_model=(),  # speculators' own converter reads its default export
)
