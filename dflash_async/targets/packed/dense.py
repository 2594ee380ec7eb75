"""The packed target forward for dense (and MoE) decoders: one pack in, its features written in place.

Input is the fixed drafter layout itself: input_ids [T], position_ids [T] restarting at 0 in every
document, doc_ids [T] (-1 for padding, padding last). One forward over the whole row, in one shape:
- positions restart per document, so the rotary embedding (the HF module's own `rotary_emb`) is
  what each document sees alone; a multimodal rotary (`mrope`: Qwen3-VL's, one position row per
  grid axis t, h, w) gets the 1-D positions as three equal rows [3, 1, T], which is what text
  tokens have in HF (and then its angles are plain 1-D RoPE's: PackedDenseForward);
- attention is document-causal: row q sees key k iff doc(k) == doc(q) and k <= q, so nothing
  crosses a document boundary (padding rows only see padding, and come out zero at the end);
- the decoder layers run up to the last captured one, and each captured layer's output is copied
  into its column block of `features` [T, k*d] (the slot's buffer): no re-batching, no gather.

The layers are the HF modules (norms, q/k/v/o projections with their biases and q/k norms, the MLP
or MoE block): only the attention core is ours, in two implementations of one rule:
- `document_causal_mask` [T, T] for SDPA: the simple reference (tests);
- `document_causal_spans` for SDPA on the CPU (the demo, long documents): the same rule as each
  row's first visible key, attended in chunks of query rows against only the keys the chunk may
  see, so no [T, T] tensor exists and memory grows linearly with T (one chunk's mask is
  SDPA_QUERY_ROWS x its keys); `sdpa_mask` picks it on the CPU, the dense mask on CUDA;
- `document_causal_block_mask` for flex_attention on CUDA, built from doc_ids with fixed-shape
  tensor ops (no host sync), with each layer run through one torch.compile'd function: the layer
  module is an argument, so its weights are graph inputs and one compilation serves every layer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dflash_async.data.packing import document_starts
from dflash_async.targets.fp8.fp8_linear import project  # q, k, v: an FP8 input quantized once
from dflash_async.targets.packed import (
    hybrid_moe as packed_hybrid_moe,  # its `route`, the same for Qwen3-MoE
)

try:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover
    BlockMask = None
    flex_attention = None

FLEX_TILE = 128  # flex_attention's block size: T must be a multiple of it on the flex path
# torch's flex_attention kernels take heads of 16 dimensions or more (Inductor refuses smaller:
# "NYI: embedding dimension of the query, key, and value must be at least 16"); tiny targets
# (llama2.c's stories260K: 8), and the drafters that copy their heads, have smaller ones
FLEX_MIN_HEAD_DIM = 16
# Query rows per SDPA call on the chunked path: its mask is 1024 x (keys seen) bools, 100 MB for
# a 98304-token document (torch's CPU flash kernel takes the mask and never forms the scores).
SDPA_QUERY_ROWS = 1024
# Rows per MLP call of a long pack: Qwen3-8B's gate, up and product at 131072 rows are 9.7 GB
# of bf16 at once, at 16384 rows 1.2 GB.
MLP_ROWS = 16384


def document_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """[T] -> [T, T] bool, True where query row q may see key row k (same document, k <= q)."""
    rows = torch.arange(doc_ids.shape[0], device=doc_ids.device)
    return (doc_ids[:, None] == doc_ids[None, :]) & (rows[None, :] <= rows[:, None])


@dataclass(frozen=True)
class KeySpans:
    """A rule whose row q sees exactly the keys [lo[q], hi[q]] (lo and hi nondecreasing:
    documents are contiguous), attended `rows` query rows at a time (`attend_sdpa`). hi None is
    the causal rule, hi[q] = q; a row inside a block it attends bidirectionally (Gemma 3's image
    tokens: targets/packed/image_text_gemma3.py) sees up to the block's last row."""

    lo: torch.Tensor  # [T] first visible key of each row
    rows: int = SDPA_QUERY_ROWS
    hi: torch.Tensor | None = None  # [T] last visible key of each row

    def pieces(self) -> Iterator[tuple[int, int, int, torch.Tensor]]:
        """(s, e, first, mask [e - s, end - first] bool) per chunk of query rows [s, e): the
        chunk sees keys [first, end) only, first the smallest lo of its rows and end one past
        the largest hi (e when causal). One host sync (the bounds)."""
        T, n = self.lo.shape[0], self.rows
        index = torch.arange(T, device=self.lo.device)
        hi = index if self.hi is None else self.hi
        firsts = F.pad(self.lo, (0, -T % n), value=T).view(-1, n).amin(1)
        ends = F.pad(hi, (0, -T % n), value=-1).view(-1, n).amax(1) + 1
        bounds = torch.stack([firsts, ends], 1).tolist()
        for s, (first, end) in zip(range(0, T, n), bounds, strict=True):
            e = min(s + n, T)
            keys = torch.arange(first, end, device=self.lo.device)
            yield s, e, first, (keys >= self.lo[s:e, None]) & (keys <= hi[s:e, None])


def document_causal_spans(
    doc_ids: torch.Tensor,
    window: int | None = None,
    rows: int = SDPA_QUERY_ROWS,
    *,
    last_key: torch.Tensor | None = None,
) -> KeySpans:
    """The rule of `document_causal_mask` (with a `window`: q - k < window too; with `last_key`
    [T]: row q sees up to that key instead of itself) as KeySpans."""
    return KeySpans(first_visible_key(doc_ids, window), rows, last_key)


def sdpa_mask(
    doc_ids: torch.Tensor,
    window: int | None = None,
    rows: int = SDPA_QUERY_ROWS,
    *,
    last_key: torch.Tensor | None = None,
) -> KeySpans | torch.Tensor:
    """The document-causal rule (with a `window`; with `last_key` [T], each row sees up to that
    key instead of itself) for `attend_sdpa`: KeySpans on the CPU (memory linear in T, one host
    sync); on CUDA the dense [T, T] mask, sync-free, so that a CUDA graph may capture the
    forward (CUDA packs of a multiple of FLEX_TILE rows, every long one, take flex instead)."""
    if not doc_ids.is_cuda:
        return document_causal_spans(doc_ids, window, rows, last_key=last_key)
    mask = (
        document_causal_mask(doc_ids)
        if last_key is None
        else document_mask_up_to(doc_ids, last_key)
    )
    if window is not None:
        index = torch.arange(doc_ids.shape[0], device=doc_ids.device)
        mask &= index[:, None] - index[None, :] < window
    return mask


def document_mask_up_to(doc_ids: torch.Tensor, last_key: torch.Tensor) -> torch.Tensor:
    """[T, T] bool: same document and k <= last_key[q]."""
    index = torch.arange(doc_ids.shape[0], device=doc_ids.device)
    return (doc_ids[:, None] == doc_ids[None, :]) & (index[None, :] <= last_key[:, None])


def tiles_in_order(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[nq, nk] bool -> (counts [1,1,nq] int32, indices [1,1,nq,nk] int32), set tiles first."""
    counts = tiles.sum(-1, dtype=torch.int32)
    order = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts[None, None], order[None, None]


def first_visible_key(doc_ids: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """[T] -> [T] lo(q): the first key row q sees (its document's start, or q - window + 1)."""
    starts = document_starts(doc_ids)
    if window is None:
        return starts
    rows = torch.arange(doc_ids.shape[0], device=doc_ids.device)
    return torch.maximum(starts, rows - (window - 1))


def document_causal_block_mask(
    doc_ids: torch.Tensor,
    tile: int = FLEX_TILE,
    *,
    window: int | None = None,
    last_key: torch.Tensor | None = None,
) -> BlockMask:
    """The rule of `document_causal_mask` as a flex BlockMask, sync-free (T % tile == 0); with
    a `window`, also q - k < window (sliding-window layers: targets/packed/window.py); with
    `last_key` [T], row q sees up to key last_key[q] instead of q (KeySpans' hi).

    Documents are contiguous, so row q sees exactly the keys [lo(q), hi(q)], lo(q) its
    document's start (or q - window + 1), hi(q) = q (or last_key[q]). A key tile is "full" for a
    query tile when every row of it sees every key of the tile, "partial" when some row sees
    some key; only partial tiles evaluate the mask_mod.
    """
    T = doc_ids.shape[0]
    if T % tile:
        raise ValueError(f"flex attention needs T={T} to be a multiple of {tile}")
    lo = first_visible_key(doc_ids, window)  # [T]
    rows = torch.arange(T, device=doc_ids.device)
    hi = rows if last_key is None else last_key
    tile_lo = torch.arange(0, T, tile, device=doc_ids.device)  # [n]
    tile_hi = tile_lo + tile
    sees_some = (lo[:, None] < tile_hi) & (tile_lo <= hi[:, None])  # [T, n]
    sees_all = (lo[:, None] <= tile_lo) & (tile_hi - 1 <= hi[:, None])  # [T, n]
    n = T // tile
    some = sees_some.view(n, tile, n).any(1)
    full = sees_all.view(n, tile, n).all(1)

    def causal(b, h, q_idx, kv_idx):  # `ahead` with hi = q_idx, without reading hi per element
        return (kv_idx <= q_idx) & (kv_idx >= lo[q_idx])

    def ahead(b, h, q_idx, kv_idx):
        return (kv_idx <= hi[q_idx]) & (kv_idx >= lo[q_idx])

    return BlockMask.from_kv_blocks(
        *tiles_in_order(some & ~full),
        *tiles_in_order(full),
        BLOCK_SIZE=tile,
        mask_mod=causal if last_key is None else ahead,
        seq_lengths=(T, T),
    )


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (HF's non-interleaved rotate_half form); x [1, H, T, hd], cos [1, T, hd]."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def attend_sdpa(q, k, v, mask, scale):
    """SDPA under a dense [T, T] mask, or under KeySpans one chunk of query rows at a time (each
    against the keys [first, end) it may see: the same softmax, the unseen keys left out)."""
    if isinstance(mask, KeySpans):
        out = []
        for s, e, first, part in mask.pieces():
            end = first + part.shape[1]
            out.append(
                attend_sdpa(q[:, :, s:e], k[:, :, first:end], v[:, :, first:end], part, scale)
            )
        return torch.cat(out, dim=2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


# Heads wider than 256 (Gemma 4's 512-wide full-attention layers): flex's default tiles asked
# 256 KiB of shared memory, over the H200's 227 KiB ("No valid triton configs", 2026-12-03).
# Smaller tiles and one stage: q 64 x 512 plus k and v 32 x 512 are 128 KiB in bf16; in fp32
# (the parity checks) q 32 x 512 plus k and v 32 x 512 are 192 KiB. Forward only (the target
# is frozen); all divide the block mask's 128-token blocks.
WIDE_HEAD_DIM = 256
WIDE_HEAD_KERNEL = {"BLOCK_M": 64, "BLOCK_N": 32, "num_stages": 1}
WIDE_HEAD_KERNEL_FP32 = {"BLOCK_M": 32, "BLOCK_N": 32, "num_stages": 1}


def attend_flex(q, k, v, mask, scale):
    options = None
    if q.shape[-1] > WIDE_HEAD_DIM:
        options = WIDE_HEAD_KERNEL_FP32 if q.dtype == torch.float32 else WIDE_HEAD_KERNEL
    return flex_attention(
        q, k, v, block_mask=mask, scale=scale, enable_gqa=True, kernel_options=options
    )


def attention_block(layer: nn.Module, hidden, cos, sin, mask, attend) -> torch.Tensor:
    """hidden [1, T, d] + self-attention of the HF `layer` (pre-norm residual), document-causal."""
    attn = layer.self_attn
    x = layer.input_layernorm(hidden)
    shape = (1, hidden.shape[1], -1, attn.head_dim)
    q, k, v = (p.view(shape) for p in project((attn.q_proj, attn.k_proj, attn.v_proj), x))
    if getattr(attn, "q_norm", None) is not None:  # Qwen3: RMSNorm over each head
        q, k = attn.q_norm(q), attn.k_norm(k)
    v = v.transpose(1, 2)  # [1, Hkv, T, hd]
    q, k = rope_half(q.transpose(1, 2), cos, sin), rope_half(k.transpose(1, 2), cos, sin)
    out = attend(q, k, v, mask, attn.scaling)  # [1, H, T, hd]
    return hidden + attn.o_proj(out.transpose(1, 2).reshape(*hidden.shape[:2], -1))


def mlp_block(layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """hidden [1, T, d] + the HF layer's MLP (or MoE block) on its post-attention norm, over
    MLP_ROWS rows at a time: the MLP is row-wise, so its [rows, 3 ffn] intermediates stay those
    of MLP_ROWS rows however long the pack (below MLP_ROWS: one call, as before)."""
    T = hidden.shape[1]
    if T <= MLP_ROWS:
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    parts = [
        layer.mlp(layer.post_attention_layernorm(hidden[:, s : s + MLP_ROWS]))
        for s in range(0, T, MLP_ROWS)
    ]
    return hidden + torch.cat(parts, dim=1)


def _whole_layer(layer, hidden, cos, sin, mask, attend):
    return mlp_block(layer, attention_block(layer, hidden, cos, sin, mask, attend))


# MoE blocks whose forward is exactly "route the normed rows (softmax, top-k, renormalised
# where the router says so), then the experts call": `attention_and_route` computes their
# router itself (packed_hybrid_moe.route, the same ops in the same order as HF's router; Qwen3-VL-
# MoE's router has no norm_topk_prob switch and always renormalises, as route does without one).
ROUTED_BLOCKS = frozenset({"Qwen3MoeSparseMoeBlock", "Qwen3VLMoeTextSparseMoeBlock"})


def attention_and_route(layer, hidden, cos, sin, mask, attend):
    """`attention_block`, then the MoE block's inputs: (hidden [1, T, d], its post-attention
    norm x [T, d], the routing weights [T, k] and experts [T, k], and x quantized for FP8
    experts that take it (Fp8Experts.quantized_tokens; else None)). Compiled as one function,
    the norm, its quantization and the router's softmax and top-k fuse with the attention's
    residual add (run eagerly they were ~10 passes over [T, d] and [T, E] per layer); the
    experts call, whose grouping is data-dependent, runs after it, outside the graph."""
    hidden = attention_block(layer, hidden, cos, sin, mask, attend)
    x = layer.post_attention_layernorm(hidden)[0]
    weights, indices = packed_hybrid_moe.route(layer.mlp.gate, x)
    experts = layer.mlp.experts
    tokens = experts.quantized_tokens(x) if hasattr(experts, "quantized_tokens") else None
    return hidden, x, weights, indices, tokens


def moe_residual(experts: nn.Module, hidden, x, weights, indices, tokens=None) -> torch.Tensor:
    """hidden [1, T, d] + experts(x, indices, weights): inside the experts' last compiled pass
    where they take the residual (`takes_residual`: CompiledExperts, Fp8Experts; the same
    values), else added here. `tokens`: x quantized, for FP8 experts (attention_and_route)."""
    if tokens is not None:
        return experts(x, indices, weights, residual=hidden[0], tokens=tokens)[None]
    if getattr(experts, "takes_residual", False):
        return experts(x, indices, weights, residual=hidden[0])[None]
    return hidden + experts(x, indices, weights)[None]


def compiled(fn: Callable, *, compile: bool) -> Callable:
    """`fn` under torch.compile with static shapes where `compile` (CUDA), else `fn` itself."""
    return torch.compile(fn, dynamic=False) if compile else fn


class PackedRange:
    """What every packed forward of a layer range shares: the attention argument ("sdpa": key
    spans in query chunks, CPU, any T; "flex": CUDA, T % 128 == 0) with its attention call and
    its document-causal mask (`mask`; a family with windows or sinks builds its own), the
    captured layer ids, the range it runs
    (`layers`: a split target's stage, targets/split.py; default up to the last captured
    layer) and its modules, the embedding and rotary modules, the column block of each
    captured layer in the range, `__call__` as the whole range's `stage`, and the copy of a
    captured layer's output into its columns. A subclass defines `stage`. `rotary`: the
    rotary module where the model does not call it `rotary_emb` (LFM2-MoE's `pos_emb`; None
    for a model without one, Nemotron-H); `embed`: the token embedding where the model does not
    call it `embed_tokens` (Nemotron-H's `embeddings`)."""

    def __init__(
        self,
        text_model: nn.Module,
        layer_ids: Sequence[int],
        *,
        attention: str,
        layers: range | None,
        rotary: nn.Module | None = None,
        embed: nn.Module | None = None,
    ) -> None:
        if attention not in ("sdpa", "flex"):
            raise ValueError(f"attention={attention!r} must be 'sdpa' or 'flex'")
        self.layer_ids = tuple(int(i) for i in layer_ids)
        self.hidden_size = text_model.config.hidden_size
        self.layers = layers or range(max(self.layer_ids) + 1)
        self._embed = text_model.embed_tokens if embed is None else embed
        self._rotary = getattr(text_model, "rotary_emb", None) if rotary is None else rotary
        self._layers = dict(
            zip(self.layers, text_model.layers[self.layers.start : self.layers.stop], strict=True)
        )
        self._columns = stage_columns(self.layer_ids, self.layers)  # layer -> column block
        self.attention = attention
        self.query_rows = SDPA_QUERY_ROWS  # query rows per SDPA call on the "sdpa" path
        self._attend = attend_flex if attention == "flex" else attend_sdpa

    def mask(self, doc_ids: torch.Tensor):
        """The document-causal mask of `attention` for `doc_ids` [T] (built on its device)."""
        if self.attention == "flex":
            return document_causal_block_mask(doc_ids)
        return sdpa_mask(doc_ids, rows=self.query_rows)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings [1, T, d] of `input_ids` [T]: the first stage's input."""
        return self._embed(input_ids[None])

    def layer_modules(self) -> list[nn.Module]:
        """The decoder layers this range runs, in order."""
        return list(self._layers.values())

    @torch.no_grad()
    def __call__(
        self,
        input_ids: torch.Tensor,  # [T]
        position_ids: torch.Tensor,  # [T]
        doc_ids: torch.Tensor,  # [T]
        features: torch.Tensor,  # [T, k*d], written in place
    ) -> torch.Tensor:
        """Write the captured layers' outputs into `features` (padding rows zero); returns it."""
        self.stage(None, input_ids, position_ids, doc_ids, features)
        return features

    def capture(self, i: int, hidden: torch.Tensor, features: torch.Tensor) -> None:
        """Copy layer i's output hidden [1, T, d] into its columns when it is a captured one."""
        if i in self._columns:
            d, j = self.hidden_size, self._columns[i]
            features[:, j * d : (j + 1) * d].copy_(hidden[0])


@dataclass(frozen=True)
class VisualRows:
    """A multimodal wrapper's additions to its first decoder layers' outputs on an image+text
    pack: `adds[i]` [n, d] is added to layer i's output at the pack's image rows `rows` [n]
    (Qwen3-VL's deepstack visual features, one tensor per layer that takes them)."""

    rows: torch.Tensor
    adds: Sequence[torch.Tensor]


class PackedDenseForward(PackedRange):
    """Features of a packed layout for a dense or MoE HF decoder (see the module docstring).

    `attention` is "sdpa" (query chunks under key spans: CPU, any T) or "flex" (CUDA, T % 128 == 0).
    `compile` wraps each layer in torch.compile (CUDA only; compile once, on one thread, before
    the workers start: the first call compiles). `moe_eager` keeps the MLP (an MoE block with
    data-dependent routing) out of the compiled region and runs it as HF does; for the blocks
    of ROUTED_BLOCKS only the experts call stays out, the norm and router compiled with the
    attention (`attention_and_route`).

    `mrope` (the family's, targets/families.py): the rotary is a multimodal one taking a position
    row per grid axis (Qwen3-VL's interleaved M-RoPE). Text tokens have the three rows equal (HF
    expands [B, T] positions so), and then each frequency slot, whichever axis the sections give
    it, turns by the same angle position * inv_freq: the cos/sin are 1-D RoPE's at those
    positions, and the deepstack inputs, which apply at image positions only, never arise. On
    image+text packs (packed/image_text.py) `stage` takes the embeddings with the images'
    features, one position row per axis ([3, T]) and the deepstack additions (`visual`).
    """

    def __init__(
        self,
        text_model: nn.Module,
        layer_ids: Sequence[int],
        *,
        attention: str,
        compile: bool,
        moe_eager: bool = False,
        mrope: bool = False,
        layers: range | None = None,
    ) -> None:
        super().__init__(text_model, layer_ids, attention=attention, layers=layers)
        self.mrope = mrope  # the rotary takes one position row per grid axis
        self._moe_eager = moe_eager
        routed = {type(layer.mlp).__name__ for layer in self._layers.values()} <= ROUTED_BLOCKS
        self._routed = moe_eager and routed
        layer_fn = attention_block if moe_eager else _whole_layer
        if self._routed:
            layer_fn = attention_and_route
        self._layer_fn = compiled(layer_fn, compile=compile)

    def rope_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """The rotary's position input for `position_ids` [T]: [3, 1, T], three equal rows, for
        an mrope; [1, T] otherwise. An mrope's [3, T] (image+text packs, one row per grid axis:
        packed/image_text.py) is taken as it is."""
        if self.mrope and position_ids.dim() == 2:
            return position_ids[:, None]
        if self.mrope:
            return position_ids[None, None].expand(3, 1, -1)
        return position_ids[None]

    def layer_inputs(self, position_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-pack tensors the layer function takes as keywords besides the rotary tables, made
        from the positions [T] once per stage (a subclass's: packed/mla.py's query scale); none."""
        return {}

    @torch.no_grad()
    def stage(
        self,
        hidden,
        input_ids,
        position_ids,
        doc_ids,
        features,
        *,
        visual: VisualRows | None = None,
    ) -> torch.Tensor:
        """Run this forward's layer range on `hidden` [1, T, d] (None: embed `input_ids`, the
        first stage), write the columns of the captured layers in the range (padding rows
        zero), and return the range's output hidden states [1, T, d]. The mask and rotary
        tables are rebuilt from the layout by every stage: the same ops, so the same values.
        `visual`: what the wrapper adds to the first layers' outputs at image rows (Qwen3-VL's
        deepstack), added before those outputs are captured or passed on."""
        d = self.hidden_size
        mask = self.mask(doc_ids)
        if hidden is None:
            hidden = self.embed(input_ids)  # [1, T, d]
        cos, sin = self._rotary(hidden, self.rope_positions(position_ids))  # [1, T, hd] each
        inputs = self.layer_inputs(position_ids)
        for i, layer in self._layers.items():
            if self._routed:
                hidden, *routing = self._layer_fn(layer, hidden, cos, sin, mask, self._attend)
                hidden = moe_residual(layer.mlp.experts, hidden, *routing)
            else:
                hidden = self._layer_fn(layer, hidden, cos, sin, mask, self._attend, **inputs)
                if self._moe_eager:
                    hidden = mlp_block(layer, hidden)
            if visual is not None and i < len(visual.adds):
                hidden = hidden.index_add(1, visual.rows, visual.adds[i][None])
            self.capture(i, hidden, features)
        mask_padding(features, doc_ids, self._columns.values(), d)
        return hidden


def stage_columns(layer_ids: Sequence[int], layers: range) -> dict[int, int]:
    """layer -> its column block in the features, for the captured layers inside `layers`."""
    return {i: j for j, i in enumerate(layer_ids) if i in layers}


def mask_padding(features, doc_ids, columns, d: int) -> None:
    """Zero the padding rows of the column blocks `columns` (all of them: the whole width)."""
    padding = (doc_ids < 0)[:, None]
    blocks = sorted(columns)
    if blocks == list(range(features.shape[1] // d)):  # the whole width at once (unsplit)
        features.masked_fill_(padding, 0)
        return
    for j in blocks:
        features[:, j * d : (j + 1) * d].masked_fill_(padding, 0)
