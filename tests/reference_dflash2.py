"""An independent, slow reference of the DFlash2 drafter and objective, from the contract alone.

Written from docs/DFLASH.md s.9-10 and sharing no code with `dflash_async.model.kinds.dflash2` (its drafter) or
its objective; it reuses only the DFlash reference's own Qwen3 pieces
(tests/reference_dflash.py: norms, RoPE, attention over an explicit list of visible keys).
Float64, one block at a time, and the convolutions as a loop over block positions and taps:
position t of a block reads positions t, t-1, ..., t-K+1 OF THAT BLOCK ONLY (nothing before its
slot 0), channel c takes the dynamic tap of group c // group_size, and the dynamic taps of side s,
tap o, group g are column (s*K + o)*G + g of kernel_projection(h). The selector walks the trained
slots one by one with the previous slot's gold token (the anchor for slot 1) as predecessor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from reference_dflash import (
    Params,
    attend_listed,
    block_weights,
    fused_context,
    layer_slot_keys,
    linear,
    rms_norm,
    rope,
    transformed_logits,
    visible_context_rows,
)

from dflash_async.data.packing import PackedBatch
from dflash_async.model.drafter_config import DrafterConfig


@dataclass
class Reference2:
    ce_sum: torch.Tensor  # unary DFlash sum + alpha * selector sum, differentiable
    unary_sum: torch.Tensor
    selector_sum: torch.Tensor
    weight_sum: float
    supervised: int
    topk_hits: int  # trained slots whose gold token is in the unary top-k
    selector_correct: int  # of those, the selector's argmax is the gold token
    block_logits: list[torch.Tensor]  # [B, V] per anchor


def conv(
    h: torch.Tensor, taps: torch.Tensor, base: torch.Tensor, side: int, config: DrafterConfig
) -> torch.Tensor:
    """One block's convolution, side `side`: h [B, d], taps [B, 2*K*G] (the projection), base
    [2, K, d]."""
    K, G = config.conv_kernel_size, config.hidden_size // config.conv_group_size
    group_of = torch.arange(config.hidden_size) // config.conv_group_size  # [d]
    rows = []
    for t in range(h.shape[0]):
        out = torch.zeros(config.hidden_size, dtype=torch.float64)
        for o in range(K):
            if t - o < 0:  # before the block's first position: zero, never the previous block
                continue
            dynamic = taps[t, (side * K + o) * G + group_of]  # [d]
            out = out + (base[side, o] + dynamic) * h[t - o]
        rows.append(out)
    return torch.stack(rows)


def decoder_layer2(
    params: Params,
    i: int,
    config: DrafterConfig,
    x: torch.Tensor,
    block_pos: Sequence[int],
    ctx: torch.Tensor,
    ctx_pos: Sequence[int],
    seen: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """One DFlash2 layer on one block x [B, d] with the visible context ctx [n, d]; seen: what
    each block slot sees of [ctx; block] (reference_dflash.slot_keys; None: everything)."""
    p = f"layers.{i}."
    H, Hkv, hd, eps = (
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.rms_norm_eps,
    )
    base_a, base_m = params[p + "attention_conv.base_kernel"], params[p + "mlp_conv.base_kernel"]
    h = rms_norm(x, params[p + "input_layernorm.weight"], eps)
    taps = linear(h, params[p + "attention_conv.kernel_projection.weight"])
    h = conv(h, taps, base_a, 0, config)

    def keys(src: torch.Tensor, pos: Sequence[int]) -> torch.Tensor:
        k = linear(src, params[p + "self_attn.k_proj.weight"]).view(-1, Hkv, hd)
        return rope(rms_norm(k, params[p + "self_attn.k_norm.weight"], eps), pos, config.rope_theta)

    def values(src: torch.Tensor) -> torch.Tensor:
        return linear(src, params[p + "self_attn.v_proj.weight"]).view(-1, Hkv, hd)

    q = linear(h, params[p + "self_attn.q_proj.weight"]).view(-1, H, hd)
    q = rope(rms_norm(q, params[p + "self_attn.q_norm.weight"], eps), block_pos, config.rope_theta)
    k = torch.cat([keys(ctx, ctx_pos), keys(h, block_pos)], dim=0)
    v = torch.cat([values(ctx), values(h)], dim=0)
    out = attend_listed(q, k, v, seen)  # s.10, as in the DFlash reference
    a = linear(out, params[p + "self_attn.o_proj.weight"])
    x = x + conv(a, taps, base_a, 1, config)
    h = rms_norm(x, params[p + "post_attention_layernorm.weight"], eps)
    taps = linear(h, params[p + "mlp_conv.kernel_projection.weight"])
    h = conv(h, taps, base_m, 0, config)
    m = torch.nn.functional.silu(linear(h, params[p + "mlp.gate_proj.weight"]))
    m = linear(m * linear(h, params[p + "mlp.up_proj.weight"]), params[p + "mlp.down_proj.weight"])
    return x + conv(m, taps, base_m, 1, config)


def block_hidden(
    params: Params,
    config: DrafterConfig,
    embed: torch.Tensor,
    batch: PackedBatch,
    context: torch.Tensor,
    anchor: int,
) -> torch.Tensor:
    """norm(x) [B, d] of the block at `anchor`, seen by its visible context only."""
    B = config.block_size
    positions = batch.position_ids.tolist()
    block_pos = [positions[anchor] + k for k in range(B)]
    tokens = [int(batch.input_ids[anchor])] + [config.mask_token_id] * (B - 1)
    x = embed[torch.tensor(tokens)] * config.input_embedding_scale
    rows = visible_context_rows(batch.doc_ids, anchor)
    ctx = context[rows] if rows else context[:0]
    ctx_pos = [positions[p] for p in rows]
    for i in range(config.num_hidden_layers):
        seen = layer_slot_keys(config, i, rows, anchor)
        x = decoder_layer2(params, i, config, x, block_pos, ctx, ctx_pos, seen)
    return rms_norm(x, params["norm.weight"], config.rms_norm_eps)


def strict_top_k(logits: torch.Tensor, k: int) -> list[int]:
    """The k tokens of largest unary logit (the test data has no ties)."""
    return sorted(range(logits.shape[0]), key=lambda c: -float(logits[c].detach()))[:k]


def reference2(
    params: Params,
    config: DrafterConfig,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    batch: PackedBatch,
    anchors: Sequence[int],
    *,
    gamma: float,
    alpha: float,
) -> Reference2:
    """s.4's DFlash sums plus alpha x the teacher-forced selector CE, block by block, slot by slot."""
    embed, lm_head = embed.double(), lm_head.double()
    context = fused_context(params, config, batch.features)
    ids = batch.input_ids.tolist()
    pred, succ = (params[f"candidate_selector.{n}_codebook"] for n in ("predecessor", "successor"))
    unary = torch.zeros((), dtype=torch.float64)
    selector = torch.zeros((), dtype=torch.float64)
    weight_sum, supervised, hits, correct, all_logits = 0.0, 0, 0, 0, []
    for a in anchors:
        hidden = block_hidden(params, config, embed, batch, context, a)  # [B, d]
        logits = transformed_logits(config, linear(hidden, lm_head))  # [B, V] s.10 transforms
        all_logits.append(logits)
        weights = block_weights(batch, a, config.block_size, gamma)
        for k in range(1, config.block_size):
            if weights[k] <= 0:
                continue
            gold, previous = ids[a + k], ids[a + k - 1]  # slot 1: previous = the anchor token
            unary = unary - weights[k] * torch.log_softmax(logits[k], dim=-1)[gold]
            weight_sum += weights[k]
            supervised += 1
            candidates = strict_top_k(logits[k], config.selector_top_k)
            if gold not in candidates:  # no selector target
                continue
            z = linear(hidden[k], params["candidate_selector.hidden_projection.weight"])
            scores = torch.stack(
                [logits[k, c] + (pred[previous] * z * succ[c]).sum() for c in candidates]
            )
            target = candidates.index(gold)
            selector = selector - weights[k] * torch.log_softmax(scores, dim=-1)[target]
            hits += 1
            correct += int(int(scores.argmax()) == target)
    return Reference2(
        unary + alpha * selector, unary, selector, weight_sum, supervised, hits, correct, all_logits
    )


def reference2_with_gradients(
    named_params, config, embed, lm_head, batch, anchors, *, gamma, alpha
):
    """reference2 on float64 CPU leaf copies; d(ce_sum)/d(param) by autograd."""
    leaves = {n: t.detach().double().requires_grad_(True) for n, t in named_params.items()}
    result = reference2(leaves, config, embed, lm_head, batch, anchors, gamma=gamma, alpha=alpha)
    result.ce_sum.backward()
    grads = {n: t.grad if t.grad is not None else torch.zeros_like(t) for n, t in leaves.items()}
    return result, grads
