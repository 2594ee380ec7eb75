"""An independent, deliberately slow reference of the DFlash training objective (docs/DFLASH.md s.1-4).

Written from the doc alone and sharing no code with `dflash_async.model.drafter` / `dflash_async.model.objective`:
plain Python loops over blocks, layers and heads, float64 throughout, and NO attention masks at all.
For every valid anchor the visible keys are listed explicitly (context rows of the same document
strictly before the anchor, then the block's own B slots) and attention runs over exactly that list,
so a masking bug in the vectorised implementation cannot be mirrored here.

Conventions taken from HF Qwen3 (the doc's drafter layers): RMSNorm(x) = w * x / sqrt(mean(x^2) + eps);
MLP = down(silu(gate(x)) * up(x)); q/k get a per-head RMSNorm then RoPE (rotate_half form, cos/sin
duplicated to head_dim); v has no norm; attention scale 1/sqrt(head_dim); GQA: q head i reads kv head
i // (H / Hkv). The fused context C = hidden_norm(fc(features)) gets no input_layernorm and is projected
by every layer's own k_proj / v_proj.

The drafter variants (docs/DFLASH.md s.10), from the contract alone: layer i is a sliding layer iff
config.layer_types[i] == "sliding_attention"; there block slot k (position anchor + k) sees only
the keys within sliding_window of its own position (z-lab's per-slot window): context rows p with
(anchor + k) - p < sliding_window, block slots s with |k - s| < sliding_window. Inside the block,
slot k sees slots 0..k (causal) in a sliding layer and every slot in a full one, unless
config.is_causal says true (causal everywhere) or false (bidirectional everywhere). A layer whose
slots see different keys (causal or sliding) lists each query's keys one query at a time. The
block's embeddings are multiplied by input_embedding_scale; the logits are lm_head(norm(x)) *
output_multiplier, then final_logit_softcapping * tanh(logits / final_logit_softcapping) when set.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from dflash_async.data.packing import PackedBatch
from dflash_async.model.drafter_config import DrafterConfig

Params = Mapping[str, torch.Tensor]


@dataclass
class ReferenceResult:
    """Sums over the valid blocks, as docs/DFLASH.md s.4 defines them, plus every block's logits."""

    ce_sum: torch.Tensor  # 0-d float64, differentiable w.r.t. the params handed in
    weight_sum: float
    correct: int  # #(w > 0 and argmax == label)
    supervised: int  # #(w > 0)
    accepted: int  # sum over blocks of the leading run of c[j, k], k = 1..B-1
    blocks: int
    block_logits: list[torch.Tensor]  # one [B, V] per valid anchor, in the order given

    @property
    def loss(self) -> float:
        return float(self.ce_sum) / self.weight_sum

    @property
    def acc(self) -> float:
        return self.correct / self.supervised

    @property
    def tau_hat(self) -> float:
        return 1.0 + self.accepted / self.blocks


def candidate_anchors(loss_mask: torch.Tensor, doc_ids: torch.Tensor) -> list[int]:
    """s.3: p is a candidate iff loss_mask[p] and loss_mask[p+1] and p+1 is in p's document."""
    mask, docs = loss_mask.tolist(), doc_ids.tolist()
    return [
        p
        for p in range(len(mask) - 1)
        if mask[p] and mask[p + 1] and docs[p] >= 0 and docs[p + 1] == docs[p]
    ]


def visible_context_rows(doc_ids: torch.Tensor, anchor: int) -> list[int]:
    """s.2: context row p is visible to the block at `anchor` iff same document and p < anchor."""
    docs = doc_ids.tolist()
    return [p for p in range(anchor) if docs[p] == docs[anchor]]


def slot_keys(
    rows: Sequence[int], anchor: int, block_size: int, *, window: int | None, causal: bool
) -> list[list[int]]:
    """s.10, per block slot k: the indices into the keys [rows; block slots 0..B-1] it sees.
    Context row p iff window is None or (anchor + k) - p < window; block slot s iff s <= k
    (causal) and |k - s| < window (a sliding layer)."""
    n, out = len(rows), []
    near = lambda gap: window is None or gap < window  # noqa: E731
    for k in range(block_size):
        context = [i for i, p in enumerate(rows) if near(anchor + k - p)]
        block = [n + s for s in range(block_size) if (s <= k or not causal) and near(abs(k - s))]
        out.append(context + block)
    return out


def layer_is_sliding(config: DrafterConfig, i: int) -> bool:
    return bool(config.layer_types) and config.layer_types[i] == "sliding_attention"


def layer_is_causal(config: DrafterConfig, i: int) -> bool:
    """s.10: causal inside the block in sliding layers by default; is_causal overrides it."""
    return layer_is_sliding(config, i) if config.is_causal is None else config.is_causal


def layer_slot_keys(
    config: DrafterConfig, i: int, rows: Sequence[int], anchor: int
) -> list[list[int]] | None:
    """Layer i's `slot_keys` of the block at `anchor` (None: a full bidirectional layer)."""
    window = config.sliding_window if layer_is_sliding(config, i) else None
    causal = layer_is_causal(config, i)
    if window is None and not causal:
        return None
    return slot_keys(rows, anchor, config.block_size, window=window, causal=causal)


def transformed_logits(config: DrafterConfig, logits: torch.Tensor) -> torch.Tensor:
    """s.10: logits * output_multiplier, then the softcap c * tanh(logits / c) when set."""
    logits = logits * config.output_multiplier
    cap = config.final_logit_softcapping
    return logits if cap is None else cap * torch.tanh(logits / cap)


def block_weights(batch: PackedBatch, anchor: int, block_size: int, gamma: float) -> list[float]:
    """s.4: w[k] = (k>0) * (anchor+k inside the document) * loss_mask[anchor+k] * exp(-(k-1)/gamma)."""
    docs, mask = batch.doc_ids.tolist(), batch.loss_mask.tolist()
    weights = [0.0]
    for k in range(1, block_size):
        p = anchor + k
        inside = p < len(docs) and docs[p] == docs[anchor]
        weights.append(math.exp(-(k - 1) / gamma) if inside and mask[p] else 0.0)
    return weights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x: torch.Tensor, positions: Sequence[int], theta: float) -> torch.Tensor:
    """Rotate x [n, heads, hd] by absolute positions (HF rotate_half convention)."""
    hd = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)  # [hd/2]
    angle = torch.tensor(positions, dtype=torch.float64)[:, None] * inv_freq[None, :]  # [n, hd/2]
    cos = torch.cat([angle.cos(), angle.cos()], dim=-1)[:, None, :]  # [n, 1, hd]
    sin = torch.cat([angle.sin(), angle.sin()], dim=-1)[:, None, :]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x @ weight.T


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Every query [Bq, H, hd] attends to ALL keys/values [n, Hkv, hd] given: they are the visible ones."""
    num_heads, num_kv, hd = q.shape[1], k.shape[1], q.shape[2]
    group = num_heads // num_kv
    outs = []
    for h in range(num_heads):
        kv = h // group
        scores = q[:, h, :] @ k[:, kv, :].T / math.sqrt(hd)  # [Bq, n]
        outs.append(torch.softmax(scores, dim=-1) @ v[:, kv, :])  # [Bq, hd]
    return torch.cat(outs, dim=-1)  # [Bq, H*hd]


def attend_listed(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: Sequence[Sequence[int]] | None
) -> torch.Tensor:
    """Block query j attends to keys[j] only, one query at a time (None: every query all keys)."""
    if keys is None:
        return attend(q, k, v)
    return torch.cat(
        [attend(q[j : j + 1], k[list(keys[j])], v[list(keys[j])]) for j in range(q.shape[0])]
    )


def decoder_layer(
    params: Params,
    i: int,
    config: DrafterConfig,
    x: torch.Tensor,
    block_pos: Sequence[int],
    ctx: torch.Tensor,
    ctx_pos: Sequence[int],
    *,
    seen: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """One Qwen3 layer on a block x [B, d] with KV injected from the visible context ctx [n, d];
    seen: what each block slot sees of [ctx; block] (`slot_keys`; None: everything)."""
    p = f"layers.{i}."
    H, Hkv, hd, eps = (
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.rms_norm_eps,
    )
    h = rms_norm(x, params[p + "input_layernorm.weight"], eps)

    def keys(src: torch.Tensor, pos: Sequence[int]) -> torch.Tensor:
        k = linear(src, params[p + "self_attn.k_proj.weight"]).view(-1, Hkv, hd)
        return rope(rms_norm(k, params[p + "self_attn.k_norm.weight"], eps), pos, config.rope_theta)

    def values(src: torch.Tensor) -> torch.Tensor:
        return linear(src, params[p + "self_attn.v_proj.weight"]).view(-1, Hkv, hd)

    q = linear(h, params[p + "self_attn.q_proj.weight"]).view(-1, H, hd)
    q = rope(rms_norm(q, params[p + "self_attn.q_norm.weight"], eps), block_pos, config.rope_theta)
    k = torch.cat([keys(ctx, ctx_pos), keys(h, block_pos)], dim=0)  # context first, then block
    v = torch.cat([values(ctx), values(h)], dim=0)
    out = attend_listed(q, k, v, seen)
    x = x + linear(out, params[p + "self_attn.o_proj.weight"])
    h = rms_norm(x, params[p + "post_attention_layernorm.weight"], eps)
    mlp = torch.nn.functional.silu(linear(h, params[p + "mlp.gate_proj.weight"]))
    mlp = mlp * linear(h, params[p + "mlp.up_proj.weight"])
    return x + linear(mlp, params[p + "mlp.down_proj.weight"])


def block_forward(
    params: Params,
    config: DrafterConfig,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    batch: PackedBatch,
    context: torch.Tensor,
    anchor: int,
    *,
    block_size: int,
    mask_token_id: int,
) -> torch.Tensor:
    """Logits [B, V] of the block [x[anchor], MASK, ...] seen by its visible context only."""
    positions = batch.position_ids.tolist()
    block_pos = [positions[anchor] + k for k in range(block_size)]
    tokens = [int(batch.input_ids[anchor])] + [mask_token_id] * (block_size - 1)
    x = embed[torch.tensor(tokens)] * config.input_embedding_scale  # [B, d]
    rows = visible_context_rows(batch.doc_ids, anchor)
    ctx = context[rows] if rows else context[:0]  # [n, d]
    ctx_pos = [positions[p] for p in rows]
    for i in range(config.num_hidden_layers):
        seen = layer_slot_keys(config, i, rows, anchor)
        x = decoder_layer(params, i, config, x, block_pos, ctx, ctx_pos, seen=seen)
    logits = linear(rms_norm(x, params["norm.weight"], config.rms_norm_eps), lm_head)
    return transformed_logits(config, logits)


def fused_context(params: Params, config: DrafterConfig, features: torch.Tensor) -> torch.Tensor:
    """C = hidden_norm(fc(features)) for every row [T, d] (a per-row map: nothing crosses rows)."""
    fc = linear(features.to(torch.float64), params["fc.weight"])
    return rms_norm(fc, params["hidden_norm.weight"], config.rms_norm_eps)


def reference_objective(
    params: Params,
    config: DrafterConfig,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    batch: PackedBatch,
    anchors: Sequence[int],
    *,
    block_size: int,
    mask_token_id: int,
    gamma: float,
) -> ReferenceResult:
    """s.4 sums over the given VALID anchors. params: float64 drafter tensors by servable name."""
    embed, lm_head = embed.to(torch.float64), lm_head.to(torch.float64)
    context = fused_context(params, config, batch.features)
    ids = batch.input_ids.tolist()
    ce_sum = torch.zeros((), dtype=torch.float64)
    weight_sum, correct, supervised, accepted = 0.0, 0, 0, 0
    all_logits = []
    for a in anchors:
        logits = block_forward(
            params,
            config,
            embed,
            lm_head,
            batch,
            context,
            a,
            block_size=block_size,
            mask_token_id=mask_token_id,
        )
        all_logits.append(logits)
        weights = block_weights(batch, a, block_size, gamma)
        run_alive = True
        for k in range(1, block_size):
            hit = False
            if weights[k] > 0:  # select, never multiply a possibly non-finite CE by 0
                label = ids[a + k]
                ce_sum = ce_sum - weights[k] * torch.log_softmax(logits[k], dim=-1)[label]
                weight_sum += weights[k]
                supervised += 1
                hit = int(logits[k].argmax()) == label
                correct += int(hit)
            run_alive = run_alive and hit  # w == 0 ends the run like a miss
            accepted += int(run_alive)
    return ReferenceResult(
        ce_sum, weight_sum, correct, supervised, accepted, len(anchors), all_logits
    )


def reference_with_gradients(
    named_params: Mapping[str, torch.Tensor],
    config: DrafterConfig,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    batch: PackedBatch,
    anchors: Sequence[int],
    *,
    block_size: int,
    mask_token_id: int,
    gamma: float,
) -> tuple[ReferenceResult, dict[str, torch.Tensor]]:
    """Run the reference on float64 CPU copies of `named_params`; d(ce_sum)/d(param) by autograd."""
    leaves = {
        n: t.detach().to("cpu", torch.float64).requires_grad_(True) for n, t in named_params.items()
    }
    cpu_batch = batch.to("cpu")
    result = reference_objective(
        leaves,
        config,
        embed.detach().cpu(),
        lm_head.detach().cpu(),
        cpu_batch,
        anchors,
        block_size=block_size,
        mask_token_id=mask_token_id,
        gamma=gamma,
    )
    result.ce_sum.backward()
    grads = {n: t.grad if t.grad is not None else torch.zeros_like(t) for n, t in leaves.items()}
    result.ce_sum = result.ce_sum.detach()
    result.block_logits = [x.detach() for x in result.block_logits]
    return result, grads
