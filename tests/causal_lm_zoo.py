"""Tiny configs of every causal-LM model_type the installed transformers has.

The list is transformers' own (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`), read when called, never
written here. Each config is built from its class with the common tiny shape (`COMMON`: hidden 32,
2 layers, a 512-token vocabulary) where the class takes those fields, then the type's own fix-ups
from `FIXUPS`, the one table of per-type exceptions: extra fields a type needs at tiny size, or
`Excluded(reason)` for a type that cannot train here.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from transformers import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

VOCAB = 512
# The tiny shape, passed where a config class takes the field (under its own name or an
# attribute_map alias): dense, MoE (4 experts, 2 per token), latent attention, the decoder
# half of an encoder-decoder config, short convolutions and state-space sizes.
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=64,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    kv_lora_rank=16,
    q_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    decoder_layers=2,
    encoder_layers=2,
    decoder_attention_heads=4,
    encoder_attention_heads=4,
    decoder_ffn_dim=64,
    encoder_ffn_dim=64,
    rotary_dim=4,
)


@dataclass(frozen=True)
class Excluded:
    """A model_type the test does not train, and why (the README lists it)."""

    reason: str


# A multimodal wrapper's towers (one small block each: the product never builds them onto the
# device or runs them), passed where the sub-config class takes the field.
TOWER: dict[str, Any] = dict(
    hidden_size=32,
    num_hidden_layers=1,
    depth=1,
    num_attention_heads=2,
    num_heads=2,
    intermediate_size=64,
    out_hidden_size=32,
    image_size=28,
    patch_size=14,
)

_MLA = dict(num_key_value_heads=4)  # latent attention: as many KV heads as query heads
_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16)

# model_type -> its fix-ups at tiny size, or why it is not trained here.
FIXUPS: dict[str, dict[str, Any] | Excluded] = {
    "axk1": _MLA,
    "axk2": _MLA,
    "bamba": _MAMBA2,
    "deepseek_v2": _MLA,
    "deepseek_v3": _MLA,
    "deepseek_v32": _MLA,
    "dots3_note_text": dict(num_key_value_heads=4),
    "gemma3n": Excluded("its vision tower needs timm, which is not installed"),
    "gemma4_assistant": dict(hidden_size_per_layer_input=0),
    "glm4_moe_lite": _MLA,
    "glm_moe_dsa": _MLA,
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),
    "granitemoehybrid": _MAMBA2,
    "kolibri1_1": dict(head_dim=16),
    "longcat_flash": _MLA,
    "mamba2": dict(num_heads=4, head_dim=16, n_groups=1, state_size=16),
    "minicpm3": _MLA,
    "musicgen": Excluded("a text-to-audio model: its decoder reads several codebooks per step"),
    "musicgen_melody": Excluded(
        "a text-to-audio model: its decoder reads several codebooks per step"
    ),
    "sarvam_mla": _MLA,
    "xlnet": dict(d_head=8),
    "xmod": Excluded("its forward needs a language adapter chosen first (set_default_language)"),
    "youtu": _MLA,
    "zaya": dict(num_experts_per_tok=1),
}


def causal_lm_types() -> list[str]:
    """Every model_type transformers maps to a causal-LM class, sorted."""
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _accepted(cls: type) -> set[str]:
    names = set(inspect.signature(cls.__init__).parameters)
    return names | set(getattr(cls, "attribute_map", {}))


def _shaped(cls: type, shape: dict[str, Any], fix: dict[str, Any]) -> Any:
    accepted = _accepted(cls)
    return {k: v for k, v in shape.items() if k in accepted} | fix


def tiny_config(model_type: str) -> Any:
    """The tiny config of `model_type` (see the module doc); ValueError for an excluded type.
    A multimodal wrapper gets a tiny text config and one-block towers."""
    fix = FIXUPS.get(model_type, {})
    if isinstance(fix, Excluded):
        raise ValueError(f"{model_type} is excluded: {fix.reason}")
    cls = CONFIG_MAPPING[model_type]
    subs = getattr(cls, "sub_configs", None) or {}
    if "text_config" not in subs:
        return cls(**_shaped(cls, COMMON, fix))
    default = cls()
    kwargs = {}
    for name in subs:
        sub = getattr(default, name, None)
        if sub is None or not hasattr(sub, "to_dict"):
            continue
        shape = COMMON if name == "text_config" else TOWER
        kwargs[name] = _shaped(type(sub), shape, {}) | {"model_type": sub.model_type}
    top = {k: v for k, v in COMMON.items() if k in ("tie_word_embeddings",)}
    return cls(**(_shaped(cls, top, fix) | kwargs))
