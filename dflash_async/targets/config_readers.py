"""Which target architectures a drafter can be trained for, and how their configs are read.

`SUPPORTED` is the plain table of the model_types start-up accepts (the README's list is generated
from it); anything else exits 2 at start-up naming it (`unsupported_reason`), and so does a
quantized checkpoint whose `quant_method` is not in `SUPPORTED_QUANT_METHODS`. The readers below
take the shape fields a drafter and the FLOP count need from a TEXT config, whatever its family
calls them: MoE configs without a dense `intermediate_size`, Gemma 4's per-layer head_dim, the
MLA head dimensions of DeepSeek-V3. Only `transformers` config objects are read: no model built.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

# model_type (of config.json, wrappers included) -> the family, as the README lists it. Multimodal
# wrappers (`*ForConditionalGeneration`) train on their language model alone (targets/loading.py).
SUPPORTED: dict[str, str] = {
    "llama": "Llama 2/3",
    "qwen2": "Qwen2/2.5",
    "qwen3": "Qwen3",
    "mistral": "Mistral (sliding window)",
    "qwen3_moe": "Qwen3-MoE",
    "qwen3_next": "Qwen3-Next (hybrid)",
    "qwen3_5_text": "Qwen3.5 (hybrid)",
    "qwen3_5": "Qwen3.5 multimodal wrapper",
    "qwen3_5_moe_text": "Qwen3.5-MoE (hybrid)",
    "qwen3_5_moe": "Qwen3.5-MoE multimodal wrapper",
    "qwen3_vl": "Qwen3-VL multimodal wrapper",
    "qwen3_vl_text": "Qwen3-VL language model",
    "glm4_moe": "GLM-4.5",
    "gemma3_text": "Gemma 3",
    "gemma3": "Gemma 3 multimodal wrapper",
    "gemma4_text": "Gemma 4",
    "gpt_oss": "gpt-oss",
    "minimax_m2": "MiniMax-M2",
    "deepseek_v3": "DeepSeek-V3 (MLA)",
}

# quantization_config.quant_method -> the format, as the README lists it; targets/quantized.py
# reads these tensors (every other quantized checkpoint exits 2 at start-up, never loads as bf16).
SUPPORTED_QUANT_METHODS: dict[str, str] = {
    "fp8": "FP8 e4m3 with weight_scale_inv per weight_block_size block (DeepSeek-V3, Qwen3-FP8)",
    "compressed-tensors": "compressed-tensors FP8 (float-quantized: tensor, channel or block)",
    "mxfp4": "gpt-oss MXFP4 experts (e2m1 pairs, an e8m0 exponent per 32 values)",
}

# Families whose `intermediate_size` is the width of ONE routed expert, not of a dense MLP.
_EXPERT_WIDTH_IS_INTERMEDIATE = frozenset({"gpt_oss", "minimax_m2"})


def text_config_of(config: Any) -> Any:
    """The language model's config: a wrapper's `text_config`, else the config itself."""
    return getattr(config, "text_config", None) or config


def is_wrapper(config: Any) -> bool:
    """A multimodal wrapper: its language model's config is a separate `text_config`."""
    return text_config_of(config) is not config


def unsupported_reason(config: Any) -> str | None:
    """None for a supported target config, else one line naming its model_type, or its
    quantization_config's quant_method, and what is supported."""
    model_type = getattr(config, "model_type", None)
    if model_type in SUPPORTED:
        return quantization_problem(config)
    return f"target model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED)})"


def quant_method_of(config: Any) -> str | None:
    """The checkpoint's `quantization_config.quant_method` (a dict in config.json, an object once
    transformers has read it); None for an unquantized checkpoint."""
    quant = getattr(config, "quantization_config", None)
    if quant is None:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else quant.quant_method
    return str(getattr(method, "value", method))


def _quant_dict(config: Any) -> dict[str, Any]:
    quant = config.quantization_config
    return quant if isinstance(quant, dict) else quant.to_dict()


def _compressed_tensors_problem(quant: dict[str, Any]) -> str | None:
    """compressed-tensors checkpoints are read when their weights are 8-bit floats (FP8), stored
    as such (`float-quantized`, `naive-quantized`); int4/int8 packings exit 2."""
    fmt = quant.get("format")
    weights = [g.get("weights") or {} for g in (quant.get("config_groups") or {}).values()]
    fp8 = all(w.get("type") == "float" and w.get("num_bits") == 8 for w in weights)
    if fmt in ("float-quantized", "naive-quantized") and weights and fp8:
        return None
    return (
        f"target quantization_config quant_method 'compressed-tensors' with format {fmt!r} and "
        f"weights {weights} is not supported (supported: FP8 weights, float-quantized)"
    )


def quantization_problem(config: Any) -> str | None:
    """None for an unquantized checkpoint or a supported `quant_method`, else one line naming it
    and the supported ones (a weight format we cannot read must never load as random bf16)."""
    method = quant_method_of(config)
    if method is None:
        return None
    if method == "compressed-tensors":
        return _compressed_tensors_problem(_quant_dict(config))
    if method == "mxfp4" and getattr(config, "model_type", None) != "gpt_oss":
        return f"quant_method 'mxfp4' is read for gpt_oss targets only, not {config.model_type!r}"
    if method in SUPPORTED_QUANT_METHODS:
        return None
    return (
        f"target quantization_config quant_method {method!r} is not supported "
        f"(supported: {', '.join(SUPPORTED_QUANT_METHODS)}, or an unquantized checkpoint)"
    )


def layer_attribute(cfg: Any, name: str, default: Any = None) -> Any:
    """`cfg.name`, or for a per-layer attribute (Gemma 4's head_dim: sliding layers 256, full
    layers 512) the value most layers have, ties to the first layer's. Most layers: the drafter
    is a stack of identical layers, and the majority (Gemma 4's sliding layers, the config's
    own `head_dim`) is the shape the target mostly computes in."""
    per_layer = getattr(cfg, "per_layer_attributes", None) or ()
    if name not in per_layer:
        return getattr(cfg, name, default)
    values = [getattr(layer, name) for layer in cfg.per_layer_config]
    return Counter(values).most_common(1)[0][0]


def attention_head_dim(cfg: Any) -> int:
    """The head dimension the drafter's (GQA) attention copies from the target.

    MLA (DeepSeek-V3: q/k heads of qk_nope+qk_rope = 192, v heads of 128, a latent KV) has no
    GQA equivalent. The drafter is a normal Qwen3-style layer, so it takes hidden/heads (56 for
    DeepSeek-V3): q_proj stays d -> d as in the targets z-lab drafts for, where 192 x 128 heads
    would make every projection 3.4x wider than the hidden size for no measured gain.
    """
    heads = cfg.num_attention_heads
    if getattr(cfg, "qk_rope_head_dim", None) is not None and getattr(cfg, "kv_lora_rank", None):
        return cfg.hidden_size // heads
    return layer_attribute(cfg, "head_dim") or cfg.hidden_size // heads


def routed_expert_width(cfg: Any) -> int:
    """The FFN width of one routed expert (MoE configs)."""
    if cfg.model_type in _EXPERT_WIDTH_IS_INTERMEDIATE:
        return cfg.intermediate_size
    return cfg.moe_intermediate_size


def experts_per_token(cfg: Any) -> int:
    """Routed experts a token runs through (0 for a dense target)."""
    return getattr(cfg, "num_experts_per_tok", None) or 0


def dense_mlp_width(cfg: Any) -> int:
    """The drafter's dense MLP width (its layers are dense Qwen3-style, as z-lab's released
    drafters for MoE targets are).

    A dense `intermediate_size` when the target has one (dense targets; MoE families with dense
    layers: Qwen3-MoE, GLM-4.5, DeepSeek-V3, Qwen3-Next). Otherwise the active FFN width of one
    token: experts_per_token x expert width, plus the shared expert's (Qwen3.5-35B-A3B: 8 x 512
    + 512 = 4608 for hidden 2048, gpt-oss-120b: 4 x 2880 for hidden 2880): the drafter then
    spends per token what the target's MLP does, and stays near the usual 2-4x of the hidden
    size, which a per-expert width (often < hidden) would not.
    """
    if cfg.model_type in _EXPERT_WIDTH_IS_INTERMEDIATE:
        dense = None
    else:
        dense = layer_attribute(cfg, "intermediate_size")
    if dense:
        return int(dense)
    shared = getattr(cfg, "shared_expert_intermediate_size", None) or 0
    return experts_per_token(cfg) * routed_expert_width(cfg) + shared
