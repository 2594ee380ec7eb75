"""The DSpark kind (docs/DFLASH.md s.11): the DFlash backbone with anchor-first slots, a
Markov head on the logits and a confidence head, trained against the target's next-token
distribution.

This package owns everything DSpark's: its fields (fields.py), the drafter (drafter.py), the
objective (objective.py), the chain drafting (decoding.py), and here the kind record: its config
checks, run identity, export ("Qwen3DSparkModel" with the config fields DeepSpec's and SGLang's
loaders read, the extra tensors) and FLOPs. The model modules are imported at their call:
model/drafter_config.py reads this package while it is being imported.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dflash_async.model.kinds.dspark.fields import DSparkDrafterFields, DSparkTrainFields
from dflash_async.model.kinds.interface import DrafterKind

NAME = "dspark"
DRAFTER_FIELDS = tuple(DSparkDrafterFields.model_fields)
# The paper's Qwen3-8B recipe for the settings every kind shares: block 7, decay exp(-k/4).
TRAIN_DEFAULTS = {"block_size": 7, "gamma": 4.0}


def check_config(config: Any) -> None:
    if config.confidence_head and config.confidence_head_with_markov and not config.markov_rank:
        raise ValueError("confidence_head_with_markov needs markov_rank > 0")
    if config.output_multiplier != 1.0 or config.final_logit_softcapping is not None:
        raise ValueError("a dspark drafter takes no logit transforms (output multiplier, softcap)")
    if config.num_target_layers - 1 in config.target_layer_ids:
        raise ValueError(
            f"target_layer_ids={list(config.target_layer_ids)} holds the target's last layer "
            f"({config.num_target_layers - 1}), which a dspark drafter reads for the target's "
            "distribution"
        )


def identity(config: Any) -> dict[str, Any]:
    """The kind and its shape fields: a DSpark run differs from a DFlash one of equal shape."""
    return {"kind": NAME, **{name: getattr(config, name) for name in DRAFTER_FIELDS}}


def run_identity(spec: Any) -> dict[str, Any]:
    """The three loss weights change every step's loss and so the weights."""
    return {
        "DFLASH_TRAIN__CE_ALPHA": spec.ce_alpha,
        "DFLASH_TRAIN__L1_ALPHA": spec.l1_alpha,
        "DFLASH_TRAIN__CONFIDENCE_ALPHA": spec.confidence_alpha,
    }


def step_values(train: Any, *, cuda: bool) -> dict[str, Any]:
    return {
        "ce_alpha": train.ce_alpha,
        "l1_alpha": train.l1_alpha,
        "confidence_alpha": train.confidence_alpha,
    }


def make_drafter(config: Any):
    from dflash_async.model.kinds.dspark.drafter import DSparkDrafter  # see the module doc

    return DSparkDrafter(config)


def make_objective(config, drafter, embed, lm_head, *, spec: Any, flex_fn=None, target_norm=None):
    """DSparkObjective with the spec's loss weights; `target_norm`: the target's final norm
    weight [d] (the step's builder reads it: captures_final_hidden)."""
    from dflash_async.model.kinds.dspark.objective import DSparkObjective  # see the module doc

    if target_norm is None:
        raise ValueError("a dspark objective needs the target's final norm weight")
    return DSparkObjective(
        config,
        drafter,
        embed,
        lm_head,
        target_norm=target_norm,
        alphas=(spec.ce_alpha, spec.l1_alpha, spec.confidence_alpha),
        flex_fn=flex_fn,
    )


def no_entries(_: Any) -> dict[str, Any]:
    return {}


def export_fields(config: Any) -> dict[str, Any]:
    """dflash_config's entries: the heads' fields."""
    return {name: getattr(config, name) for name in DRAFTER_FIELDS}


def top_level_fields(config: Any) -> dict[str, Any]:
    """The config.json fields DeepSpec's Qwen3DSparkModel and SGLang's loader read at the top
    level (DeepSpec's qwen3/config.py): the heads', the mask token, the target layers."""
    fields = {
        "mask_token_id": config.mask_token_id,
        "target_layer_ids": list(config.target_layer_ids),
        "num_anchors": 512,  # DeepSpec's model requires the field; only its trainer reads it
        "markov_rank": config.markov_rank,
        "enable_confidence_head": config.confidence_head,
    }
    if config.markov_rank > 0:
        fields["markov_head_type"] = config.markov_head_type
    if config.confidence_head:
        fields["confidence_head_with_markov"] = config.confidence_head_with_markov
    return fields


def weight_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """DSpark's tensors: the Markov head (W1 an embedding [V, r], W2 [V, r], the gated
    variant's gate_proj) and the confidence head's projection."""
    d, v, r = config.hidden_size, config.vocab_size, config.markov_rank
    shapes: dict[str, tuple[int, ...]] = {}
    if r > 0:
        shapes["markov_head.markov_w1.weight"] = (v, r)
        shapes["markov_head.markov_w2.weight"] = (v, r)
        if config.markov_head_type == "gated":
            shapes["markov_head.gate_proj.weight"] = (r, d + r)
            shapes["markov_head.gate_proj.bias"] = (r,)
    if config.confidence_head:
        width = d + (r if config.confidence_head_with_markov else 0)
        shapes["confidence_head.proj.weight"] = (1, width)
        shapes["confidence_head.proj.bias"] = (1,)
    return shapes


def fields_from_export(dflash_config: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Its fields from an export's config: ours (dflash_config) or DeepSpec's top-level names."""
    rank = dflash_config.get("markov_rank")
    if rank is None:
        raise ValueError(f"{where}: missing field markov_rank")
    confidence = dflash_config.get("confidence_head", dflash_config.get("enable_confidence_head"))
    if confidence is None:
        raise ValueError(f"{where}: missing field enable_confidence_head")
    return {
        "markov_rank": int(rank),
        "markov_head_type": str(dflash_config.get("markov_head_type", "vanilla")),
        "confidence_head": bool(confidence),
        "confidence_head_with_markov": bool(
            dflash_config.get("confidence_head_with_markov", False)
        ),
    }


def flops(config: Any, *, slots: int) -> dict[str, float]:
    """DSpark's matmul work beyond DFlash's, trained 3x forward where it learns, 2x where only
    an input gradient flows: the target's lm_head over every slot (forward only: the L1 term's
    distribution), the Markov head's W2 (r -> V, trained) and the gate and confidence
    projections (the W1 gathers count 0). The anchor slot's lm_head is in the common part."""
    d, v, r = config.hidden_size, config.vocab_size, config.markov_rank
    parts = {"target_lm_head": float(2 * slots * d * v)}
    if r > 0:
        parts["markov"] = float(3 * 2 * slots * r * v)
        if config.markov_head_type == "gated":
            parts["markov"] += float(3 * 2 * slots * (d + r) * r)
    if config.confidence_head:
        parts["confidence"] = float(3 * 2 * slots * (d + r))
    return parts


def draft_tokens(drafter, hidden, unary, anchors):
    from dflash_async.model.kinds.dspark import decoding  # see the module doc

    return decoding.draft_tokens(drafter, hidden, unary, anchors)


def sampled_draft_tokens(drafter, hidden, unary, anchors, *, sampler):
    from dflash_async.model.kinds.dspark import decoding  # see the module doc

    return decoding.sampled_draft_tokens(drafter, hidden, unary, anchors, sampler=sampler)


def draft_confidence(drafter, hidden, drafts, anchors):
    from dflash_async.model.kinds.dspark import decoding  # see the module doc

    return decoding.confidence(drafter, hidden, drafts, anchors)


KIND = DrafterKind(
    name=NAME,
    architecture="Qwen3DSparkModel",
    model_type="qwen3",
    summary=(
        "anchor-first slots, a Markov head and a confidence head, trained against the target's "
        "next-token distribution, docs/DFLASH.md s.11"
    ),
    drafter_fields=DSparkDrafterFields,
    train_fields=DSparkTrainFields,
    check_config=check_config,
    identity=identity,
    run_identity=run_identity,
    step_values=step_values,
    make_drafter=make_drafter,
    make_objective=make_objective,
    kernels_chosen=no_entries,
    export_fields=export_fields,
    weight_shapes=weight_shapes,
    fields_from_export=fields_from_export,
    flops=flops,
    draft_tokens=draft_tokens,
    sampled_draft_tokens=sampled_draft_tokens,
    first_draft_slot=0,
    captures_final_hidden=True,
    train_defaults=TRAIN_DEFAULTS,
    top_level_fields=top_level_fields,
    draft_confidence=draft_confidence,
    speculators_model=(NAME, "DSparkSpeculator"),
)
