"""The packed target forward for sparse-attention MLA MoE decoders (targets/packed/dsa.py):
DeepSeek-V3.2 and GLM-5 (GLM-MoE-DSA), each attention layer an MLA whose queries see only the
`index_topk` keys a lightning indexer selects for them.

It is `PackedDenseForward` (targets/packed/dense.py: the pack layout, positions restarting per
document, the layer range and `stage()` of a split target, the feature columns and zeroed padding
rows) with its own attention rule, computed per layer:
- the indexer, as HF's: q = wq_b(q_resid) [T, Hi, Di] (q_resid = q_a_layernorm(q_a_proj(x)), the
  MLA's own low-rank query), one key k = LayerNorm(wk(x)) [T, Di] shared by the heads; RoPE on
  the first qk_rope_head_dim dims of both (rotate_half for DeepSeek-V3.2, interleaved pairs for
  GLM-5: the family's `indexer_rope`), at the document's own positions; the score of key t for
  query s is sum_h w[s, h] * relu(q[s, h] . k[t] * Di^-0.5), w = weights_proj(x) * Hi^-0.5, all
  in fp32;
- the selection, per query row: the `index_topk` best-scored keys among those it sees
  document-causally (its own document, k <= q), all of them where it sees fewer. HF scores a
  document alone with the other keys at -inf and takes the top min(index_topk, length): the same
  set, whatever the pack around the document. The rule the attention then applies is a [T, T]
  bool, `allowed` = document-causal & selected;
- GLM-5's "shared" layers (`indexer_types`) have no indexer and reuse the previous layer's
  selection, as HF passes its top-k down the stack; a stage of a split target must therefore
  start on a layer with an indexer (`ValueError` otherwise);
- the MLA attention is packed/mla.py's (RoPE always on interleaved pairs here: these configs have no
  `rope_interleave`), attended under `allowed`: SDPA in chunks of SDPA_QUERY_ROWS query rows
  against the keys [0, end of chunk) (any device), or flex on CUDA with a BlockMask whose tiles
  are the ones `allowed` touches and whose mask_mod reads `allowed` itself;
- the MLP is packed/mla.py's (dense first layers, grouped-router MoE with shared experts).
The top-k is discrete: two keys whose scores are within rounding of each other at a row's edge
may be chosen differently here and in the document alone (in bf16 more often than in fp32), as
they may by HF's own forward of the document at another length; elsewhere the rows are equal up
to summation order (tests/targets/test_target_packed_dsa.py checks fp32 seeds without such ties).

Memory, O(T^2) per layer (one layer's at a time): `allowed` and the document-causal mask are
T x T bools (T = 16384: 256 MiB each), and the indexer scores one chunk of INDEX_QUERY_ROWS
query rows at a time against every earlier key, [rows, Hi, T] fp32 (rows = 128, DeepSeek-V3.2's
Hi = 64, T = 16384: 512 MiB). The selection runs eagerly (a data-dependent top-k per chunk);
with `compile` only the MLA attention block is compiled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from dflash_async.targets.packed.dense import (
    FLEX_TILE,
    SDPA_QUERY_ROWS,
    BlockMask,
    PackedDenseForward,
    attend_flex,
    compiled,
    document_causal_mask,
    mask_padding,
    tiles_in_order,
)
from dflash_async.targets.packed.mla import moe_mlp_block, rope_interleaved

# Query rows per indexer chunk: its scores are [rows, index_n_heads, T] fp32 (see the module doc).
INDEX_QUERY_ROWS = 128


def indexer_scores(indexer: nn.Module, x, q_resid, cos, sin, *, rope: Callable) -> tuple:
    """The indexer's per-row inputs: (q [T, Hi, Di], k [Di, T], w [T, Hi]) fp32, RoPE'd at the
    positions of cos/sin [1, T, r]; a chunk's scores are
    `chunk_scores(q[s:e], k[:, :e], w[s:e], indexer.softmax_scale)`.
    x [1, T, d] is the layer's normed input, q_resid [1, T, q_lora_rank] the MLA's."""
    T, Hi, Di, r = x.shape[1], indexer.n_heads, indexer.head_dim, indexer.qk_rope_head_dim
    q = indexer.wq_b(q_resid).view(1, T, Hi, Di).transpose(1, 2)  # [1, Hi, T, Di]
    k = indexer.k_norm(indexer.wk(x)).view(1, 1, T, Di)
    q = torch.cat([rope(q[..., :r], cos, sin), q[..., r:]], dim=-1)
    k = torch.cat([rope(k[..., :r], cos, sin), k[..., r:]], dim=-1)
    w = indexer.weights_proj(x.to(indexer.weights_proj.weight.dtype)).float()  # [1, T, Hi]
    w = w * indexer.n_heads**-0.5
    q = q[0].transpose(0, 1).float()  # [T, Hi, Di]
    return q, k[0, 0].t().float(), w[0]


def chunk_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, scale: float) -> torch.Tensor:
    """Index scores [rows, keys] of q [rows, Hi, Di] against k [Di, keys], head weights w
    [rows, Hi]: sum_h w[s, h] relu(q[s, h] . k[:, t] * scale), HF's order of operations."""
    scores = F.relu(torch.matmul(q, k) * scale)  # [rows, Hi, keys]
    return torch.matmul(w[:, None, :], scores)[:, 0]  # [rows, keys]


def select_keys(
    indexer: nn.Module,
    x,
    q_resid,
    cos,
    sin,
    visible: torch.Tensor,
    *,
    rope: Callable,
    rows: int = INDEX_QUERY_ROWS,
) -> torch.Tensor:
    """`visible` [T, T] bool (document-causal) -> allowed [T, T] bool: each row's index_topk
    best-scored visible keys (all its visible keys where it has no more), in chunks of `rows`
    query rows, each scored against the keys [0, end of chunk) (the later ones it never sees)."""
    T = visible.shape[0]
    q, k, w = indexer_scores(indexer, x, q_resid, cos, sin, rope=rope)
    allowed = torch.zeros_like(visible)
    for s in range(0, T, rows):
        e = min(s + rows, T)
        scores = chunk_scores(q[s:e], k[:, :e], w[s:e], indexer.softmax_scale)  # [e - s, e]
        scores = scores.masked_fill(~visible[s:e, :e], float("-inf"))
        best = scores.topk(min(indexer.index_topk, e), dim=-1).indices  # [e - s, topk]
        chosen = torch.zeros_like(visible[s:e, :e]).scatter_(1, best, True)
        allowed[s:e, :e] = chosen & visible[s:e, :e]
    return allowed


def selected_block_mask(allowed: torch.Tensor, tile: int = FLEX_TILE) -> BlockMask:
    """`allowed` [T, T] bool as a flex BlockMask (T % tile == 0), sync-free: the tiles it
    touches, the full ones skipping the mask_mod, which reads `allowed` itself."""
    T = allowed.shape[0]
    if T % tile:
        raise ValueError(f"flex attention needs T={T} to be a multiple of {tile}")
    n = T // tile
    tiles = allowed.view(n, tile, n, tile)
    some, full = tiles.any(3).any(1), tiles.all(3).all(1)  # [n, n]

    def mask_mod(b, h, q_idx, kv_idx):
        return allowed[q_idx, kv_idx]

    return BlockMask.from_kv_blocks(
        *tiles_in_order(some & ~full),
        *tiles_in_order(full),
        BLOCK_SIZE=tile,
        mask_mod=mask_mod,
        seq_lengths=(T, T),
    )


def attend_allowed_sdpa(q, k, v, allowed, scale, rows: int = SDPA_QUERY_ROWS):
    """SDPA under `allowed` [T, T] bool, rows query rows at a time against the keys [0, e) of
    the chunk (a query never sees a later key): the same softmax over the same keys."""
    T = q.shape[2]
    return torch.cat(
        [
            F.scaled_dot_product_attention(
                q[:, :, s:e],
                k[:, :, :e],
                v[:, :, :e],
                attn_mask=allowed[s:e, :e],
                scale=scale,
                enable_gqa=True,
            )
            for s, e in ((s, min(s + rows, T)) for s in range(0, T, rows))
        ],
        dim=2,
    )


def dsa_attention_block(layer: nn.Module, hidden, x, q_resid, cos, sin, mask, attend):
    """hidden [1, T, d] + the layer's MLA (DeepseekV32Attention / GlmMoeDsaAttention) on its
    normed input x [1, T, d] with the low-rank query q_resid [1, T, q_lora_rank], under `mask`
    (allowed, as `attend` takes it); RoPE on interleaved pairs, cos/sin [1, T, rope]."""
    attn = layer.self_attn
    T, nope, r = hidden.shape[1], attn.qk_nope_head_dim, attn.qk_rope_head_dim
    q = attn.q_b_proj(q_resid).view(1, T, -1, attn.qk_head_dim).transpose(1, 2)  # [1, H, T, qk]
    latent, k_rope = attn.kv_a_proj_with_mqa(x).split([attn.kv_lora_rank, r], dim=-1)
    kv = attn.kv_b_proj(attn.kv_a_layernorm(latent))  # [1, T, H*(nope+v)]
    kv = kv.view(1, T, -1, nope + attn.v_head_dim).transpose(1, 2)  # [1, H, T, nope+v]
    k_nope, v = kv.split([nope, attn.v_head_dim], dim=-1)
    k_rope = rope_interleaved(k_rope.view(1, 1, T, r), cos, sin).expand(-1, k_nope.shape[1], -1, -1)
    q = torch.cat([q[..., :nope], rope_interleaved(q[..., nope:], cos, sin)], dim=-1)
    k = torch.cat([k_nope, k_rope], dim=-1)  # [1, H, T, nope+r]
    out = attend(q, k, v, mask, attn.scaling)  # [1, H, T, v]
    return hidden + attn.o_proj(out.transpose(1, 2).reshape(1, T, -1))


def dsa_layout_problem(inner: nn.Module) -> str | None:
    """None when the decoder stack is the one this forward runs: every layer an MLA with a
    q_lora_rank and an indexer, or (GLM-5) a shared layer after one, and RoPE without a
    length-dependent update; else what differs."""
    rope = getattr(getattr(inner, "rotary_emb", None), "rope_type", None)
    if rope not in ("default", "linear", "yarn"):
        return f"rope_type {rope!r} (only default, linear, yarn)"
    if getattr(inner.config, "hidden_act", "silu") != "silu":
        return f"hidden_act {inner.config.hidden_act!r}"
    if getattr(inner.layers[0].self_attn, "indexer", None) is None:
        return "the first layer has no indexer (a shared one): there is no selection to share"
    for layer in inner.layers:
        attn = layer.self_attn
        if not hasattr(attn, "indexer") or getattr(attn, "q_lora_rank", None) is None:
            return f"decoder layer {type(layer).__name__}: attention {type(attn).__name__}"
    return None


class PackedDSAForward(PackedDenseForward):
    """PackedDenseForward for DeepSeek-V3.2 / GLM-5 decoders (see the module doc): the family's
    indexer RoPE (`indexer_rope`, targets/families.py), same calls (`__call__`, `stage`), same
    layout contract."""

    def __init__(
        self,
        text_model: nn.Module,
        layer_ids: Sequence[int],
        *,
        indexer_rope: Callable,
        attention: str,
        compile: bool,
        layers: range | None = None,
    ) -> None:
        super().__init__(text_model, layer_ids, attention=attention, compile=False, layers=layers)
        first = self._layers[self.layers.start]
        if first.self_attn.indexer is None:
            raise ValueError(
                f"a stage starting at layer {self.layers.start}: that layer shares the previous "
                "layer's top-k selection, which this stage does not compute"
            )
        self._indexer_rope = indexer_rope
        self.index_rows = INDEX_QUERY_ROWS  # query rows per indexer chunk
        self._block = compiled(dsa_attention_block, compile=compile)

    def attention_mask(self, allowed: torch.Tensor):
        """The mask `attend` takes for the allowed [T, T] rule (a BlockMask for flex)."""
        return selected_block_mask(allowed) if self.attention == "flex" else allowed

    @torch.no_grad()
    def stage(self, hidden, input_ids, position_ids, doc_ids, features) -> torch.Tensor:
        """Run the layer range on `hidden` [1, T, d] (None: embed `input_ids`), write the captured
        layers' columns (padding rows zero), return the range's output hidden [1, T, d]."""
        visible = document_causal_mask(doc_ids)  # [T, T]
        if hidden is None:
            hidden = self._embed(input_ids[None])  # [1, T, d]
        cos, sin = self._rotary(hidden, position_ids[None])  # [1, T, rope] each
        mask = None
        attend = attend_flex
        if self.attention == "sdpa":
            attend = partial(attend_allowed_sdpa, rows=self.query_rows)
        for i, layer in self._layers.items():
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q_resid = attn.q_a_layernorm(attn.q_a_proj(x))  # [1, T, q_lora_rank]
            if attn.indexer is not None:  # else a shared layer: the previous selection
                allowed = select_keys(
                    attn.indexer,
                    x,
                    q_resid,
                    cos,
                    sin,
                    visible,
                    rope=self._indexer_rope,
                    rows=self.index_rows,
                )
                mask = self.attention_mask(allowed)
            hidden = self._block(layer, hidden, x, q_resid, cos, sin, mask, attend)
            hidden = moe_mlp_block(layer, hidden)
            self.capture(i, hidden, features)
        mask_padding(features, doc_ids, self._columns.values(), self.hidden_size)
        return hidden
