"""The drafter's configuration, derived from the frozen target's Hugging Face config.

The drafter shares the target's hidden size (its features and token embeddings live in that space),
vocabulary (it decodes with the target's lm_head) and rope_theta. Heads, head_dim and the MLP width
are copied from the target by default (docs/DFLASH.md section 1), read from its text config by
targets/config_readers.py with its family's options (targets/families.py): MoE widths, per-layer
and MLA head dimensions.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from dflash_async.model.kinds import DEFAULT_KIND, KINDS, kind_of
from dflash_async.model.kinds.interface import with_fields
from dflash_async.model.layer_rules import AttentionRule, layer_rule_problem, layer_rules
from dflash_async.targets.config_readers import text_config_of
from dflash_async.targets.families import (
    attention_head_dim,
    attention_heads,
    decoder_layer_count,
    dense_mlp_width,
    key_value_heads,
    norm_eps,
)

# DFlash mask tokens: an existing, otherwise unused token id of the target's vocabulary.
QWEN3_MASK_TOKEN_ID = 151669
QWEN35_MASK_TOKEN_ID = 248070

# The drafter variants of released drafters (docs/DFLASH.md s.10), for both kinds, and their
# defaults: today's drafter. A run's identity lists one only when it differs from its default, so
# the checkpoints written before the variants existed still resume.
VARIANT_DEFAULTS: dict[str, Any] = {
    "layer_types": (),
    "sliding_window": None,
    "is_causal": None,
    "output_multiplier": 1.0,
    "final_logit_softcapping": None,
    "input_embedding_scale": 1.0,
}


def kinds_drafter_fields() -> tuple[str, ...]:
    """Every kind's own DrafterConfig fields (model/kinds/), in the table's order."""
    return tuple(name for kind in KINDS.values() for name in kind.drafter_fields.model_fields)


@dataclass(frozen=True)
class _DrafterConfig:
    """Shapes of a DFlash drafter. Field names follow the servable config.json (docs/DFLASH.md s.7);
    after these come every kind's own fields (model/kinds/), read only by a drafter of that kind."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    num_target_layers: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int = 16
    kind: str = DEFAULT_KIND  # a key of model/kinds/'s table
    # per layer "full_attention" | "sliding_attention"; () = every layer full (layer_rules.py)
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None  # W of the sliding layers
    is_causal: bool | None = None  # None: causal in the block in sliding layers only
    output_multiplier: float = 1.0  # logits * m after the lm_head
    final_logit_softcapping: float | None = None  # c: c * tanh(logits / c); None = none
    input_embedding_scale: float = 1.0  # s: the block's embeddings * s

    def __post_init__(self) -> None:
        self._check_shapes()
        self._check_variants()
        kind_of(self.kind).check_config(self)

    def identity(self) -> dict[str, Any]:
        """The fields that define a run (checkpoint/state.run_identity): every kind's shared
        fields, then those the kind adds (none for DFlash, whose drafter's identity is the one it
        had before other kinds existed, so its older checkpoints still resume)."""
        kinds_own = {"kind", *kinds_drafter_fields()}
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in kinds_own}
        values |= kind_of(self.kind).identity(self)
        for name, default in VARIANT_DEFAULTS.items():
            if values[name] == default:
                del values[name]
        return values

    def _check_variants(self) -> None:
        problem = layer_rule_problem(
            self.layer_types, num_layers=self.num_hidden_layers, sliding_window=self.sliding_window
        )
        if problem:
            raise ValueError(problem)
        cap = self.final_logit_softcapping
        if cap is not None and not cap > 0:
            raise ValueError(f"final_logit_softcapping={cap} must be > 0 (or unset)")
        if not self.output_multiplier > 0:
            raise ValueError(f"output_multiplier={self.output_multiplier} must be > 0")

    def attention_rules(self) -> tuple[AttentionRule, ...]:
        """Each layer's mask rule (layer_rules.py): the full and the sliding rule at most."""
        return layer_rules(
            self.layer_types,
            num_layers=self.num_hidden_layers,
            sliding_window=self.sliding_window,
            is_causal=self.is_causal,
        )

    def _check_shapes(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if (
            bad
            or not self.target_layer_ids
            or len(set(self.target_layer_ids)) != len(self.target_layer_ids)
        ):
            raise ValueError(
                f"target_layer_ids={list(self.target_layer_ids)} must be non-empty, distinct and within "
                f"[0, {self.num_target_layers})"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id={self.mask_token_id} is outside the vocabulary")
        if self.block_size < 2:
            raise ValueError(f"block_size={self.block_size} must be at least 2")

    @property
    def drafts_per_block(self) -> int:
        """Tokens one block pass drafts: B-1 (slots 1..B-1), or B for an anchor-first kind
        (model/kinds/ `first_draft_slot`); a verified block is the anchor and these."""
        return self.block_size - kind_of(self.kind).first_draft_slot

    @property
    def captured_layer_ids(self) -> tuple[int, ...]:
        """The target layers whose outputs the target captures for this drafter, in the
        features' column order: target_layer_ids, then the last layer where the kind reads the
        target's own distribution (model/kinds/ `captures_final_hidden`)."""
        last = (self.num_target_layers - 1,) if kind_of(self.kind).captures_final_hidden else ()
        return self.target_layer_ids + last

    @property
    def feature_width(self) -> int:
        """Columns of the captured features: d per captured layer."""
        return len(self.captured_layer_ids) * self.hidden_size

    @property
    def num_features(self) -> int:
        """k: how many target layers feed the drafter."""
        return len(self.target_layer_ids)


def default_target_layer_ids(num_target_layers: int, num_features: int) -> tuple[int, ...]:
    """docs/DFLASH.md s.1: k==1 -> [L//2]; else round(1 + i*(L-4)/(k-1)), Python's round (ties to even).

    >>> default_target_layer_ids(36, 5)
    (1, 9, 17, 25, 33)
    >>> default_target_layer_ids(42, 5)
    (1, 10, 20, 30, 39)
    """
    if num_features < 1:
        raise ValueError(f"num_features={num_features} must be at least 1")
    if num_features == 1:
        return (num_target_layers // 2,)
    step = (num_target_layers - 4) / (num_features - 1)
    return tuple(round(1 + i * step) for i in range(num_features))


DrafterConfig = with_fields(_DrafterConfig, [kind.drafter_fields for kind in KINDS.values()])


@dataclass(frozen=True)
class _DrafterSpec:
    """The drafter's own shape settings (DFLASH_DRAFTER__*, DFLASH_TARGET__NUM_FEATURES and
    TARGET_LAYER_IDS, DFLASH_TRAIN__BLOCK_SIZE); the rest of its config comes from the target's
    config.json at start-up (`drafter_config_from_target`), which the settings never read.
    `init` (DFLASH_DRAFTER__INIT) is where its starting weights are (checkpoint/warm.py)."""

    num_layers: int
    num_features: int
    block_size: int
    target_layer_ids: tuple[int, ...] | None  # None: spread over the target's layers
    mask_token_id: int | None  # None: the tokenizer's mask token (built-in target) or family's
    init: Path | None = None  # an export or checkpoint folder; None: random init
    kind: str = DEFAULT_KIND  # a key of model/kinds/'s table; every kind's own fields follow
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    is_causal: bool | None = None
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    input_embedding_scale: float = 1.0

    def variant_fields(self) -> dict[str, Any]:
        """The DrafterConfig fields of the drafter kind (kind and every kind's own shapes) and
        of its variants (sliding layers, logit transforms, embedding scale: VARIANT_DEFAULTS)."""
        names = (*kinds_drafter_fields(), *VARIANT_DEFAULTS)
        return {"kind": self.kind, **{name: getattr(self, name) for name in names}}


DrafterSpec = with_fields(_DrafterSpec, [kind.drafter_fields for kind in KINDS.values()])


def drafter_config_from_target(
    target_config: Any,
    *,
    num_hidden_layers: int = 5,
    num_features: int = 5,
    block_size: int = 16,
    mask_token_id: int | None = None,
    target_layer_ids: tuple[int, ...] | None = None,
    **overrides: Any,
) -> DrafterConfig:
    """Derive a drafter config from a target's HF config; `overrides` replace any field."""
    cfg = text_config_of(target_config)  # multimodal wrappers: the language model's
    num_target_layers = decoder_layer_count(cfg)  # the layers a tap indexes
    heads = attention_heads(cfg)
    rope_theta = getattr(cfg, "rope_theta", None)
    if rope_theta is None:  # transformers 5 keeps it in rope_parameters
        rope = getattr(cfg, "rope_parameters", None) or {}
        # Gemma 3/4 keep one per layer type: the drafter attends over the whole context, as
        # the full-attention layers do
        rope = rope.get("full_attention") or rope
        # a model without rotary positions (GPT-2, Mamba: the generic family) has none at all
        rope_theta = (rope.get("rope_theta") if isinstance(rope, dict) else None) or 10000.0
    if mask_token_id is None:
        mask_token_id = QWEN35_MASK_TOKEN_ID if cfg.vocab_size > 200_000 else QWEN3_MASK_TOKEN_ID
    config = DrafterConfig(
        hidden_size=cfg.hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=heads,
        num_key_value_heads=key_value_heads(cfg),
        head_dim=attention_head_dim(cfg),
        intermediate_size=dense_mlp_width(cfg),
        rms_norm_eps=norm_eps(cfg),
        rope_theta=float(rope_theta),
        vocab_size=cfg.vocab_size,
        num_target_layers=num_target_layers,
        target_layer_ids=tuple(
            target_layer_ids or default_target_layer_ids(num_target_layers, num_features)
        ),
        mask_token_id=mask_token_id,
        block_size=block_size,
    )
    return replace(config, **overrides) if overrides else config
