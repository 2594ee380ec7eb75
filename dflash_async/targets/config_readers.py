"""targets/config_readers.py owns the reading of a target's config: the shape fields a drafter
and the FLOP count need from a TEXT config, whatever its family calls them, and the checkpoint's
quantization format. Only `transformers` config objects are read: no model built.

A family's options for the shared readers (which field is one routed expert's width, whether the
attention is latent) are a `ConfigReader` in its entry of targets/families.py; the readers here
name no family. Per-layer attributes (Gemma 4's head_dim) and MoE configs without a dense
`intermediate_size` are read from the config's own fields.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

# quantization_config.quant_method -> the format, as the README lists it; targets/quantized.py
# reads these tensors (every other quantized checkpoint exits 2 at start-up, never loads as bf16).
SUPPORTED_QUANT_METHODS: dict[str, str] = {
    "fp8": "FP8 e4m3 with weight_scale_inv per weight_block_size block (DeepSeek-V3, Qwen3-FP8)",
    "compressed-tensors": "compressed-tensors FP8 (float-quantized: tensor, channel or block)",
    "mxfp4": "gpt-oss MXFP4 experts (e2m1 pairs, an e8m0 exponent per 32 values)",
}


def text_config_of(config: Any) -> Any:
    """The language model's config: a wrapper's `text_config`, else the config itself."""
    return getattr(config, "text_config", None) or config


def is_wrapper(config: Any) -> bool:
    """A multimodal wrapper: its language model's config is a separate `text_config`."""
    return text_config_of(config) is not config


def quant_method_of(config: Any) -> str | None:
    """The checkpoint's `quantization_config.quant_method` (a dict in config.json, an object once
    transformers has read it); None for an unquantized checkpoint."""
    quant = getattr(config, "quantization_config", None)
    if quant is None:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else quant.quant_method
    return str(getattr(method, "value", method))


def quant_dict(config: Any) -> dict[str, Any]:
    quant = config.quantization_config
    return quant if isinstance(quant, dict) else quant.to_dict()


def compressed_tensors_problem(quant: dict[str, Any]) -> str | None:
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


def latent_head_dims(cfg: Any) -> tuple[int, int] | None:
    """MLA's own head widths (query-key: nope + rope; value) where the config names them
    (DeepSeek-V3 and its kin), else None."""
    qk = (getattr(cfg, "qk_nope_head_dim", None) or 0) + (
        getattr(cfg, "qk_rope_head_dim", None) or 0
    )
    v = getattr(cfg, "v_head_dim", None)
    return (qk, v) if qk and v else None


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


_EPS_FIELDS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps", "norm_epsilon")


def experts_per_token(cfg: Any) -> int:
    """Routed experts a token runs through (0 for a dense target)."""
    return getattr(cfg, "num_experts_per_tok", None) or 0


@dataclass(frozen=True)
class ConfigReader:
    """A family's options for the shape readers (one per family in targets/families.py).

    expert_width: the config field holding the FFN width of ONE routed expert; gpt-oss and
      MiniMax-M2 name it `intermediate_size` (they have no dense MLP), the other MoE families
      `moe_intermediate_size` next to a dense `intermediate_size`.
    latent_attention: multi-head latent attention (DeepSeek-V3), whose heads the drafter's GQA
      attention cannot copy (`head_dim`).
    """

    expert_width: str = "moe_intermediate_size"
    latent_attention: bool = False

    def attention_heads(self, cfg: Any) -> int:
        """The drafter's attention heads: the target's, or for a config without any (Mamba,
        RWKV: the generic family) heads of gcd(hidden, 128) dims, the common 128 where hidden
        allows it."""
        heads = layer_attribute(cfg, "num_attention_heads")
        if isinstance(heads, int) and heads > 0:
            return heads
        return cfg.hidden_size // math.gcd(cfg.hidden_size, 128)

    def key_value_heads(self, cfg: Any) -> int:
        """The drafter's KV heads: the target's where they divide its heads, else its heads."""
        heads, kv = self.attention_heads(cfg), layer_attribute(cfg, "num_key_value_heads")
        return kv if isinstance(kv, int) and kv > 0 and heads % kv == 0 else heads

    def norm_eps(self, cfg: Any) -> float:
        """The drafter's RMSNorm epsilon: the target's norm epsilon, whatever the field's name
        (GPT-2's layer_norm_epsilon, BERT's layer_norm_eps...), else 1e-6."""
        for name in _EPS_FIELDS:
            value = getattr(cfg, name, None)
            if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
                return float(value)
        return 1e-6

    def head_dim(self, cfg: Any) -> int:
        """The head dimension the drafter's (GQA) attention copies from the target.

        MLA (DeepSeek-V3: q/k heads of qk_nope+qk_rope = 192, v heads of 128, a latent KV) has no
        GQA equivalent. The drafter is a normal Qwen3-style layer, so it takes hidden/heads (56
        for DeepSeek-V3): q_proj stays d -> d as in the targets z-lab drafts for, where 192 x 128
        heads would make every projection 3.4x wider than the hidden size for no measured gain.
        """
        heads = self.attention_heads(cfg)
        latent = getattr(cfg, "qk_rope_head_dim", None) is not None and getattr(
            cfg, "kv_lora_rank", None
        )
        if self.latent_attention and latent:
            return cfg.hidden_size // heads
        head_dim = layer_attribute(cfg, "head_dim")
        return head_dim if isinstance(head_dim, int) and head_dim > 0 else cfg.hidden_size // heads

    def routed_expert_width(self, cfg: Any) -> int:
        """The FFN width of one routed expert (MoE configs); a config without the field (Mixtral,
        OLMoE: the generic family) names it `intermediate_size`."""
        width = getattr(cfg, self.expert_width, None) or layer_attribute(cfg, "intermediate_size")
        return width if isinstance(width, int) and width > 0 else 4 * cfg.hidden_size

    def dense_mlp_width(self, cfg: Any) -> int:
        """The drafter's dense MLP width (its layers are dense Qwen3-style, as z-lab's released
        drafters for MoE targets are).

        A dense `intermediate_size` when the target has one (dense targets; MoE families with
        dense layers: Qwen3-MoE, GLM-4.5, DeepSeek-V3, Qwen3-Next). Otherwise the active FFN
        width of one token: experts_per_token x expert width, plus the shared expert's
        (Qwen3.5-35B-A3B: 8 x 512 + 512 = 4608 for hidden 2048, gpt-oss-120b: 4 x 2880 for
        hidden 2880): the drafter then spends per token what the target's MLP does, and stays
        near the usual 2-4x of the hidden size, which a per-expert width (often < hidden) would
        not.
        A config with neither (GPT-2's n_inner None, Mamba: the generic family) gets 4x hidden.
        """
        dense_field_is_expert = self.expert_width == "intermediate_size"
        dense = None if dense_field_is_expert else layer_attribute(cfg, "intermediate_size")
        if isinstance(dense, int) and dense > 0:
            return dense
        shared = getattr(cfg, "shared_expert_intermediate_size", None) or 0
        routed = experts_per_token(cfg) * (getattr(cfg, self.expert_width, None) or 0) + shared
        return int(routed) if routed > 0 else 4 * cfg.hidden_size
