"""FLOP accounting and MFU for the drafter step and the frozen target's forward.

FLOPs count the useful matmul work once (2 per multiply-add): activation recomputation (the CE
chunks' checkpointing) is not counted, and attention counts only visible (query, key) pairs.
Training a layer costs 3x its forward (forward, input grad, weight grad); the frozen lm_head and
the fc over frozen features cost 2x (one of the two backward matmuls is not needed).
"""

from __future__ import annotations

from dflash_async.model.drafter_config import DrafterConfig
from dflash_async.model.kinds import kind_of
from dflash_async.targets.config_readers import experts_per_token
from dflash_async.targets.families import (
    attention_head_dim,
    attention_heads,
    dense_mlp_width,
    key_value_heads,
    routed_expert_width,
)

H200_BF16_PEAK_FLOPS = 780e12  # measured dense bf16 matmul peak (docs/GPU.md)


def drafter_step_flops_by_part(
    config: DrafterConfig, *, token_budget: int, num_anchors: int, visible_pairs: float
) -> dict[str, float]:
    """Train FLOPs of one drafter step by part (the parts of bench/step_profile.py that do
    matmul work; norms, elementwise work and the optimizer count 0): T context rows,
    Q = A*B block slots; then the parts the drafter's kind adds (model/kinds/).

    visible_pairs: attended (query, key) pairs summed over all queries (context + own block).
    """
    d, hd = config.hidden_size, config.head_dim
    H, Hkv, f = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    T, Q, L = token_budget, num_anchors * config.block_size, config.num_hidden_layers
    projections = 2 * (
        Q * d * H * hd  # q_proj
        + 2 * (T + Q) * d * Hkv * hd  # k_proj, v_proj over context and block
        + Q * H * hd * d  # o_proj
    )
    attention_forward = L * 2 * 2 * H * hd * visible_pairs  # QK^T and PV
    kind = kind_of(config.kind)
    drafts = config.block_size - kind.first_draft_slot  # the slots that draft (and train)
    return {
        "features": float(2 * 2 * T * config.num_features * d * d),  # fc over frozen features
        "attn_proj": float(3 * L * projections),
        "attn_fwd": float(attention_forward),
        "attn_bwd": float(2 * attention_forward),
        "mlp": float(3 * L * 2 * 3 * Q * d * f),  # gate, up, down
        "lm_head_ce": float(2 * 2 * num_anchors * drafts * d * config.vocab_size),
        **kind.flops(config, slots=Q),  # the kind's own matmul work
    }


def drafter_step_flops(
    config: DrafterConfig, *, token_budget: int, num_anchors: int, visible_pairs: float
) -> float:
    """Train FLOPs of one drafter step: the sum of drafter_step_flops_by_part."""
    parts = drafter_step_flops_by_part(
        config, token_budget=token_budget, num_anchors=num_anchors, visible_pairs=visible_pairs
    )
    return float(sum(parts.values()))


def target_forward_flops(
    config, *, layers_run: int, tokens: float, attention_pairs: float
) -> float:
    """Forward FLOPs of the target's first `layers_run` decoder layers over `tokens` real tokens.

    `config`: the target's (text) Hugging Face config. Per layer and token: the q, k, v, o
    projections and the MLP (2 FLOPs per weight; MoE: the routed experts a token uses plus a
    shared expert when the config has one); attention: QK^T and PV over `attention_pairs` visible
    (query, key) pairs summed over the pack (document-causal: n(n+1)/2 per document). Embedding
    lookups, norms and the lm_head (never run: early exit) are not counted. A generic-family
    config is counted as if its layers were attention + MLP ones of its shape (an estimate). Linear-attention
    layers of hybrid targets are counted as full attention (an over-count of their
    attention term, which is ~1% of the total at 700-token documents).
    """
    d, heads = config.hidden_size, attention_heads(config)
    kv_heads = key_value_heads(config)
    head_dim = attention_head_dim(config)
    experts = experts_per_token(config)
    if experts:
        ffn = experts * routed_expert_width(config)
        ffn += getattr(config, "shared_expert_intermediate_size", 0) or 0
    else:  # a dense intermediate_size (4x hidden for a generic config without one)
        ffn = dense_mlp_width(config)
    weights = d * heads * head_dim * 2 + d * kv_heads * head_dim * 2 + 3 * d * ffn
    attention = 2 * 2 * heads * head_dim * attention_pairs
    return float(layers_run * (2 * weights * tokens + attention))


def mfu(flops: float, seconds: float, peak: float = H200_BF16_PEAK_FLOPS) -> float:
    return flops / max(seconds, 1e-12) / peak
