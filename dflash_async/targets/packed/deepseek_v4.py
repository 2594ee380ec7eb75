"""targets/packed/deepseek_v4.py owns the packed target forward of DeepSeek-V4 (`deepseek_v4`): one
pack in, its features written in place, every row what its document gives alone through HF.

The layout is packed/dense.py's (input_ids, position_ids restarting at 0 per document, doc_ids, -1
padding last); the layers are the HF modules, run here in HF's order, with the attention core and
the compressors' block layout ours. What is per document, and where it lives:
- hyper-connections: each layer's `attn_hc` / `ffn_hc` (HF modules, row-wise) collapse the
  `hc_mult` residual streams into the block's input and give the `post` / `comb` weights that
  expand its output and mix the streams (`decoder_layer`). A tap is the stream collapse the
  generic path takes, the model_type's STREAM_TAPS entry (targets/stream_taps.py; DeepSeek-V4's is
  targets/hyper_connections.py `fed_forward_collapse`: the next layer's `attn_hc`, or `hc_head`
  after the last layer), applied to the same streams;
- RoPE: the model's rotary (`main` for sliding-window layers, `compress` for the others) at the
  document's own positions, on the trailing rope dims of each head, interleaved pairs
  (`rope_tail`); the attention output turned back by the query's angle, as HF does (K = V);
- sliding window: query q sees token key k iff same document, k <= q and q - k < sliding_window;
- compressed blocks (`compressed_blocks`): a block is `rate` consecutive rows of one document
  starting at a position that is a multiple of `rate` (counted from the document's start), and
  only complete ones exist (a document's tail shorter than `rate` gives none), so no block
  straddles a boundary. HCA pools a block's rows under a softmax of gate + position_bias; CSA
  pools its rows' second halves with the previous block's first halves (`pool`), the previous
  block of the same document only (a document's first block has none, as HF's first window);
  each pooled key is RoPE'd at its document position index * rate;
- visibility of a block: same document and complete by the query's position,
  index < (position + 1) // rate; HCA sees every visible block, CSA only the ones the indexer
  selects;
- the indexer (CSA): its own pooled keys (`pool` at index_head_dim), its queries from the
  attention's low-rank query at the document's positions, scores sum_h w[q, h] relu(q_h . k) *
  scale, HF's order; per query the top min(index_topk, candidates) among the visible blocks of its
  document: HF's selection of the document alone, whatever the pack around it;
- attention sinks: a per-head logit in the softmax denominator with no value, HF's eager order
  (`attend_chunk`);
- MoE: the HF block, row-wise: the top-k router reads the row, the hash router the row's own
  token id (`tid2eid[input_ids]`, the pack's input_ids at that row; never a position).
The attention runs in chunks of at most QUERY_ROWS query rows cut at every document start
(`chunk_blocks`, `attention`): each chunk against the token keys [s - window + 1, e) and its
document's blocks complete by its last row, so its logits are [heads, rows, keys seen], never
[T, T]; the indexer of a chunk scores all of its document's blocks in order, the later ones at
-inf, and keeps the top min(index_topk, the document's blocks): the very top-k input HF forms for
the document alone, so even exact ties (blocks whose every indexer head the relu clips score 0)
are broken alike where torch.topk breaks ties alike in equal rows (checked on the CPU). The same torch code runs on the CPU and on CUDA (no flex: the sinks and the
per-query block selection are explicit logits). Sync points: the block layout (`nonzero`) and
the chunks (`tolist`), once per rate per forward. A near-tie (two blocks' scores within rounding)
at a row's top-k edge may still be ranked differently here and alone, as may the MoE router's
(tests/targets/test_target_packed_deepseek_v4.py checks seeds without such near-ties).
Not done here: a split target's stages (the stream tensor [1, T, hc_mult, d] is not the
[1, T, d] a stage hands on), so `stage` is None and a split target is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dflash_async.targets.packed.dense import mask_padding, stage_columns

QUERY_ROWS = 128  # query rows per attention chunk (see the module doc)
_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})  # no length-dependent update
_LAYER_PARTS = {
    "self_attn",
    "mlp",
    "input_layernorm",
    "post_attention_layernorm",
    "attn_hc",
    "ffn_hc",
}
_ATTENTION_KINDS = {
    "sliding_attention": None,
    "heavily_compressed_attention": "heavily_compressed_attention",
    "compressed_sparse_attention": "compressed_sparse_attention",
}


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the trailing 2 * cos.shape[-1] dims of x [1, H, T, D] by interleaved pairs
    (x0, x1) -> (x0 c - x1 s, x1 c + x0 s), in fp32, the leading dims passed; cos/sin [1, T, r/2]
    (one angle per pair, as the V4 rotary gives them)."""
    c = cos.repeat_interleave(2, dim=-1)[:, None]  # [1, 1, T, r]
    s = sin.repeat_interleave(2, dim=-1)[:, None]
    r = c.shape[-1]
    head, tail = x[..., :-r], x[..., -r:]
    pairs = tail.unflatten(-1, (-1, 2))
    turned = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    tail = (tail.float() * c + turned.float() * s).to(x.dtype)
    return torch.cat([head, tail], dim=-1)


@dataclass(frozen=True)
class Blocks:
    """The compressed blocks of one rate in a pack (see the module doc), in row order."""

    start: torch.Tensor  # [N] first row of each block
    doc: torch.Tensor  # [N] its document
    index: torch.Tensor  # [N] its index in the document (first position index * rate)
    rate: int


def compressed_blocks(position_ids: torch.Tensor, doc_ids: torch.Tensor, rate: int) -> Blocks:
    """The complete blocks of `rate` rows of each document, aligned to the document's start."""
    T = doc_ids.shape[0]
    rows = torch.arange(T, device=doc_ids.device)
    last = (rows + rate - 1).clamp(max=T - 1)
    starts = (doc_ids >= 0) & (position_ids % rate == 0) & (rows + rate - 1 < T)
    starts &= doc_ids[last] == doc_ids
    start = rows[starts]
    return Blocks(start, doc_ids[start], position_ids[start] // rate, rate)


def pool(module: nn.Module, x: torch.Tensor, blocks: Blocks, *, overlap: bool) -> torch.Tensor:
    """The pooled, normed, RoPE'd keys [N, D] of `module` (an HCA / CSA compressor or the
    indexer: kv_proj, gate_proj, position_bias, kv_norm, rotary_emb) over `blocks`, from its
    input x [1, T, d]. `overlap` (CSA, indexer): projections are 2D wide; a block pools the
    previous block's first halves and its own second halves over 2 * rate slots."""
    r = blocks.rate
    kv, gate = module.kv_proj(x)[0], module.gate_proj(x)[0]  # [T, C]
    rows = blocks.start[:, None] + torch.arange(r, device=x.device)  # [N, r]
    block_kv, block_gate = kv[rows], gate[rows] + module.position_bias  # [N, r, C]
    if overlap:
        d = block_kv.shape[-1] // 2
        has_previous = (blocks.index > 0)[:, None, None]  # the document's own previous block
        previous = (rows - r).clamp(min=0)
        prev_kv = torch.where(has_previous, kv[previous][..., :d], 0)
        prev_gate = (gate[previous] + module.position_bias)[..., :d]
        prev_gate = prev_gate.masked_fill(~has_previous, float("-inf"))
        block_kv = torch.cat([prev_kv, block_kv[..., d:]], dim=1)  # [N, 2r, D]
        block_gate = torch.cat([prev_gate, block_gate[..., d:]], dim=1)
    weights = block_gate.softmax(dim=1, dtype=torch.float32).to(block_kv.dtype)
    pooled = module.kv_norm((block_kv * weights).sum(dim=1))  # [N, D]
    positions = (blocks.index * r)[None]  # [1, N]
    cos, sin = module.rotary_emb(pooled, position_ids=positions, layer_type="compress")
    return rope_tail(pooled[None, None], cos, sin)[0, 0]


@dataclass(frozen=True)
class Chunks:
    """Query chunks [s, e), each inside one document, the range [lo, hi) of that document's
    blocks (all of them: the indexer's candidates) and [lo, seen) the ones complete by its last
    row (the attention's), for one rate; a host list (one sync)."""

    bounds: list[tuple[int, int, int, int, int]]  # (s, e, lo, seen, hi)


def chunk_blocks(doc_ids: torch.Tensor, blocks: Blocks | None, rows: int) -> Chunks:
    """Chunks of at most `rows` query rows cut at every document start (the padding run counts
    as one document, with no blocks), each with its document's block range (none without
    `blocks`)."""
    T = doc_ids.shape[0]
    is_start = torch.ones_like(doc_ids, dtype=torch.bool)
    is_start[1:] = doc_ids[1:] != doc_ids[:-1]
    starts = torch.nonzero(is_start)[:, 0]  # [documents]
    ends = torch.cat([starts[1:], starts.new_full((1,), T)])
    lo = hi = torch.zeros_like(starts)
    if blocks is not None:
        lo = torch.searchsorted(blocks.start, starts)
        hi = torch.searchsorted(blocks.start, ends)
    rate = blocks.rate if blocks is not None else 1
    bounds = []
    for a, b, first, last in torch.stack([starts, ends, lo, hi], dim=1).tolist():
        for s in range(a, b, rows):
            e = min(s + rows, b)  # its last row's position is e - 1 - a
            bounds.append((s, e, first, min(last, first + (e - a) // rate), last))
    return Chunks(bounds)


def attend_chunk(attn: nn.Module, q, keys, mask) -> torch.Tensor:
    """q [H, rows, D], keys (= values) [n, D], mask [rows, n] bool -> [H, rows, D]: HF's eager
    attention with the module's sinks (a per-head logit beside the keys, dropped after the
    softmax, its max subtracted first)."""
    H, rows = q.shape[0], q.shape[1]
    logits = torch.matmul(q, keys.t()) * attn.scaling  # [H, rows, n]
    logits = logits.masked_fill(~mask, float("-inf"))
    sinks = attn.sinks.reshape(H, 1, 1).expand(H, rows, 1)
    logits = torch.cat([logits, sinks], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(keys.dtype)
    return torch.matmul(probs, keys)


def index_scores(indexer: nn.Module, q, keys, x) -> torch.Tensor:
    """The indexer's scores [rows, n] of queries q [rows, Hi, Di] (RoPE'd) against pooled keys
    [n, Di], head weights from x [rows, d]: sum_h w_h relu(q_h . k) * scale, HF's order."""
    scorer = indexer.scorer
    scores = torch.matmul(q.float(), keys.t().float())  # [rows, Hi, n]
    scores = F.relu(scores) * scorer.softmax_scale
    weights = scorer.weights_proj(x).float() * scorer.weights_scaling  # [rows, Hi]
    return (scores * weights[..., None]).sum(dim=1)


def attention(layer, x, positions, doc_ids, rope, layout) -> torch.Tensor:
    """The HF DeepseekV4Attention of `layer` on its normed input x [1, T, d], per document:
    -> [1, T, d]. rope: {"main", "compress"} -> (cos, sin) [1, T, r/2] at the document
    positions; layout: rate -> (Blocks, Chunks) of the pack."""
    attn = layer.self_attn
    T, D = x.shape[1], attn.head_dim
    cos, sin = rope[attn.rope_layer_type]
    q_residual = attn.q_a_norm(attn.q_a_proj(x))  # [1, T, q_lora_rank]
    q = attn.q_b_norm(attn.q_b_proj(q_residual).view(1, T, -1, D).transpose(1, 2))
    q = rope_tail(q, cos, sin)[0]  # [H, T, D]
    kv = attn.kv_norm(attn.kv_proj(x)).view(1, 1, T, D)
    kv = rope_tail(kv, cos, sin)[0, 0]  # [T, D]
    kind = _ATTENTION_KINDS[attn.layer_type]
    compressor = attn.compressor
    blocks, chunks = layout[compressor.compress_rate if compressor is not None else None]
    sparse = kind == "compressed_sparse_attention"
    pooled = pool(compressor, x, blocks, overlap=sparse) if compressor is not None else None
    if sparse:
        indexer = compressor.indexer
        index_keys = pool(indexer, x, blocks, overlap=True)  # [N, Di]
        icos, isin = indexer.rotary_emb(x, position_ids=positions[None], layer_type="compress")
        index_q = indexer.q_b_proj(q_residual).view(1, T, -1, indexer.head_dim).transpose(1, 2)
        index_q = rope_tail(index_q, icos, isin)[0].transpose(0, 1)  # [T, Hi, Di]
    window = attn.sliding_window
    outs = []
    for s, e, lo, seen, hi in chunks.bounds:
        a = max(0, s - window + 1)
        rows = torch.arange(s, e, device=x.device)[:, None]
        keys_at = torch.arange(a, e, device=x.device)[None]
        near = (keys_at <= rows) & (rows - keys_at < window)
        near &= doc_ids[a:e][None] == doc_ids[s:e, None]  # the window restarts per document
        keys, mask = kv[a:e], near
        if pooled is not None and hi > lo:
            same_document = blocks.doc[lo:hi][None] == doc_ids[s:e, None]
            complete = blocks.index[lo:hi][None] < (positions[s:e, None] + 1) // blocks.rate
            visible = same_document & complete  # [rows, hi - lo]
            if sparse:
                scores = index_scores(indexer, index_q[s:e], index_keys[lo:hi], x[0, s:e])
                scores = scores.masked_fill(~visible, float("-inf"))
                best = scores.topk(min(indexer.index_topk, hi - lo), dim=-1).indices
                visible = torch.zeros_like(visible).scatter_(1, best, True) & visible
            keys = torch.cat([keys, pooled[lo:seen]], dim=0)  # the later ones are not visible
            mask = torch.cat([mask, visible[:, : seen - lo]], dim=1)
        outs.append(attend_chunk(attn, q[:, s:e], keys, mask))
    out = rope_tail(torch.cat(outs, dim=1)[None], cos, -sin)  # [1, H, T, D]
    grouped = out.transpose(1, 2).reshape(1, T, attn.config.o_groups, -1)
    return attn.o_b_proj(attn.o_a_proj(grouped).flatten(2))


def decoder_layer(layer, streams, input_ids, positions, doc_ids, rope, layout):
    """One HF DeepseekV4DecoderLayer on the residual streams [1, T, hc_mult, d]: each block's
    input collapsed by its hyper-connection, its output expanded by `post` and added to the
    streams mixed by `comb` (transposed: out_k = sum_j comb[j, k] in_j)."""
    dtype = streams.dtype
    post, comb, collapsed = layer.attn_hc(streams)
    out = attention(layer, layer.input_layernorm(collapsed), positions, doc_ids, rope, layout)
    mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
    streams = post.to(dtype)[..., None] * out[..., None, :] + mixed
    post, comb, collapsed = layer.ffn_hc(streams)
    out = layer.mlp(layer.post_attention_layernorm(collapsed), input_ids=input_ids[None])
    mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
    return post.to(dtype)[..., None] * out[..., None, :] + mixed


def deepseek_v4_layout_problem(inner: nn.Module) -> str | None:
    """None when the decoder stack is the one this forward runs (HF's DeepSeek-V4 layers: the
    three attention kinds, hyper-connections, a hash or top-k routed MoE, RoPE without a
    length-dependent update), else what differs."""
    rotary = getattr(inner, "rotary_emb", None)
    kinds = getattr(rotary, "rope_type", None)
    if not isinstance(kinds, dict) or any(t not in _ROPE_TYPES for t in kinds.values()):
        return f"rope types {kinds!r} (only {sorted(_ROPE_TYPES)})"
    if not isinstance(getattr(inner.config, "sliding_window", None), int):
        return f"sliding_window {getattr(inner.config, 'sliding_window', None)!r} (not a width)"
    if getattr(inner, "hc_head", None) is None:
        return f"{type(inner).__name__} has no hc_head"
    for layer in inner.layers:
        parts = {name for name, _ in layer.named_children()}
        attn = getattr(layer, "self_attn", None)
        if parts != _LAYER_PARTS or getattr(attn, "layer_type", None) not in _ATTENTION_KINDS:
            return f"decoder layer {type(layer).__name__} with parts {sorted(parts)}"
        if (attn.compressor is None) != (attn.layer_type == "sliding_attention"):
            return f"layer {attn.layer_idx}: {attn.layer_type} with compressor {attn.compressor}"
    return None


class PackedDeepseekV4Forward:
    """The features of a packed layout for a DeepSeek-V4 decoder (see the module doc): the
    captured layers' stream collapses written into their columns, padding rows zero. `tap`:
    the model_type's STREAM_TAPS entry, (model, layers, index) -> that layer's collapse. The
    layers run up to the last captured one; no compile (the block layout and selection are
    data-dependent), the same code on any device."""

    def __init__(self, text_model: nn.Module, layer_ids: Sequence[int], *, tap: Callable) -> None:
        self.layer_ids = tuple(int(i) for i in layer_ids)
        self.hidden_size = text_model.config.hidden_size
        self.layers = range(max(self.layer_ids) + 1)
        self._inner = text_model
        self._columns = stage_columns(self.layer_ids, self.layers)
        self._taps = {i: tap(text_model, text_model.layers, i) for i in self._columns}
        self.query_rows = QUERY_ROWS

    def _layout(self, position_ids, doc_ids) -> dict:
        """rate -> (Blocks, Chunks) of the pack, for every rate of the layers run (None: the
        sliding-window layers' chunks)."""
        rates = {
            layer.self_attn.compressor.compress_rate
            for layer in (self._inner.layers[i] for i in self.layers)
            if layer.self_attn.compressor is not None
        }
        layout = {None: (None, chunk_blocks(doc_ids, None, self.query_rows))}
        for rate in rates:
            blocks = compressed_blocks(position_ids, doc_ids, rate)
            layout[rate] = (blocks, chunk_blocks(doc_ids, blocks, self.query_rows))
        return layout

    @torch.no_grad()
    def __call__(
        self,
        input_ids: torch.Tensor,  # [T]
        position_ids: torch.Tensor,  # [T]
        doc_ids: torch.Tensor,  # [T]
        features: torch.Tensor,  # [T, k*d], written in place
    ) -> torch.Tensor:
        inner = self._inner
        embedded = inner.embed_tokens(input_ids[None])  # [1, T, d]
        streams = embedded[:, :, None].expand(-1, -1, inner.config.hc_mult, -1).contiguous()
        rope = {
            kind: inner.rotary_emb(embedded, position_ids=position_ids[None], layer_type=kind)
            for kind in ("main", "compress")
        }
        layout = self._layout(position_ids, doc_ids)
        d = self.hidden_size
        for i in self.layers:
            layer = inner.layers[i]
            streams = decoder_layer(layer, streams, input_ids, position_ids, doc_ids, rope, layout)
            if i in self._columns:
                j = self._columns[i]
                features[:, j * d : (j + 1) * d].copy_(self._taps[i](streams)[0])
        mask_padding(features, doc_ids, self._columns.values(), d)
        return features
