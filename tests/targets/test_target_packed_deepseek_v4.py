"""The packed DeepSeek-V4 forward (targets/packed/deepseek_v4.py) equals each document run alone
through HF, row for row: the generic path's features of the document alone (its hooks collapse
each tapped layer's residual streams by STREAM_TAPS, targets/hyper_connections.py), so a drafter
trained on either path reads the same tensor.

The tiny configs exercise every per-document part: a sliding window of 4 with documents of 9-17
tokens; CSA blocks of 2 rows and HCA blocks of 3 (a document holds 3-8 of each, and its tail
block may be incomplete), and a last document of 2 tokens (one CSA block, no HCA one, shorter
than the window); index_topk 2, fewer than the blocks most rows see; two hash-routed MoE
layers (tid2eid drawn at random, HF leaves it zero) and two top-k routed ones; 4 residual streams
whose hyper-connection weights, sinks and pooling position biases are drawn O(1) (HF's init
makes the streams equal and the biases zero, where a wrong mix or pooling would not show). The
taps are layers 0 (sliding), 2 (HCA) and 3, the last (its hc_head collapse).

Tolerance 1e-5 in fp32: both sides run the same modules on the same rows; the packed attention
adds masked keys as exact zeros and the MoE groups other rows into its experts' matmuls, so the
rows differ by summation order only, a few fp32 ulps of values of order 1 (measured below 1.5e-6
over the variants). The indexer's and the router's top-k are discrete: a near-tie at a row's
edge would flip under those ulps and show as an O(0.1) row error. `test_no_row_has_a_near_tie...`
reads HF's own top-k inputs of every document alone and asserts every edge gap is at least
MARGIN = 1e-4, over 300x the largest difference measured between an index score of a packed row
and the same score of its document alone (3e-7, for scores up to 0.6), and that rows with more
visible blocks than index_topk exist (the selection is exercised). Measured with these seeds:
edge gaps from 1.0e-3 (indexer) and 5.2e-4 (router), 60 such rows; other document seeds gave
gaps near 1e-5. The mutants below move some row by 0.77 to 3.5, far beyond the tolerance.
"""

from __future__ import annotations

from functools import partial
from types import MappingProxyType

import packed_kit as kit
import pytest
import torch
from tap_kit import generic_features
from torch.overrides import TorchFunctionMode
from transformers import DeepseekV4Config

from dflash_async.errors import SettingsError
from dflash_async.targets import paths, stream_taps
from dflash_async.targets.families import planned_path
from dflash_async.targets.forward import select_target_forward
from dflash_async.targets.loading import random_target, text_model
from dflash_async.targets.packed import deepseek_v4 as packed_deepseek_v4
from dflash_async.targets.stream_taps import stream_tap

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

ATOL = 1e-5  # see the module docstring
MARGIN = 1e-4  # the smallest gap at a top-k edge (see the module docstring)
LENGTHS = (13, 17, 9, 11, 2)  # the last shorter than the window and an HCA block, one CSA block
TOKEN_BUDGET = 56  # 52 real rows + 4 padding rows
LAYER_IDS = (0, 2, 3)  # sliding, HCA, and the last layer (CSA; the hc_head collapse)
VOCAB = 300
EXPERTS, TOP_K = 8, 2
INDEX_TOPK = 2
HIDDEN = 32
WIDTH = len(LAYER_IDS) * HIDDEN  # the features' width

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    num_hidden_layers=4,
    num_attention_heads=4,
    head_dim=16,
    partial_rotary_factor=0.5,  # RoPE on the last 8 dims of each head
    q_lora_rank=16,
    o_groups=2,
    o_lora_rank=8,
    moe_intermediate_size=16,
    n_routed_experts=EXPERTS,
    num_experts_per_tok=TOP_K,
    sliding_window=4,
    compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 3},
    layer_types=[
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    mlp_layer_types=["hash_moe", "moe", "hash_moe", "moe"],
    hc_mult=4,
    index_n_heads=8,
    index_head_dim=16,  # RoPE on its last 8 dims
    index_topk=INDEX_TOPK,
    initializer_range=0.1,
    max_position_embeddings=256,
)
# V4-Flash's compressed branches use yarn (attention_factor folded into cos/sin)
_YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)

VARIANTS = {
    "deepseek_v4": lambda: DeepseekV4Config(**_COMMON),
    "deepseek_v4_yarn": lambda: DeepseekV4Config(**_COMMON, rope_parameters=dict(_YARN)),
}
_O1 = ("sinks", "position_bias", "base", "scale", "hc_base", "hc_scale")


def _model(config, seed: int = 2):
    """A random target with O(1) sinks, pooling biases and hyper-connection weights, random
    hash tables (distinct experts per token id) and score-correction biases."""
    model = random_target(config, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            last = name.rsplit(".", 1)[-1]
            if last in _O1:
                param.copy_(torch.randn(param.shape, generator=generator))
            elif last in ("fn", "hc_fn"):
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
        for name, buffer in model.named_buffers():
            if name.endswith("tid2eid"):
                draws = [torch.randperm(EXPERTS, generator=generator)[:TOP_K] for _ in range(VOCAB)]
                buffer.copy_(torch.stack(draws))
            elif name.endswith("e_score_correction_bias"):
                buffer.copy_(0.2 * torch.randn(buffer.shape, generator=generator))
    return model


def _generic_alone(model, ids: torch.Tensor) -> torch.Tensor:
    """The generic path's features [n, k*d] of the document `ids` [1, n], the streams collapsed."""
    return generic_features(model, LAYER_IDS, ids)[0]


_documents = partial(kit.documents, vocab=VOCAB, lengths=LENGTHS, seed=4)
_packed = partial(kit.run_packed, budget=TOKEN_BUDGET, width=WIDTH)
_assert_rows_equal_each_document_alone = partial(
    kit.assert_rows_equal_each_document_alone,
    layer_ids=LAYER_IDS,
    atol=ATOL,
    features=_generic_alone,
)
_selected = partial(  # asserted packed
    kit.selected_path_features,
    name="packed_deepseek_v4",
    layer_ids=LAYER_IDS,
    budget=TOKEN_BUDGET,
    width=WIDTH,
)


def _forward(model, module=packed_deepseek_v4):
    inner = text_model(model)
    return module.PackedDeepseekV4Forward(inner, LAYER_IDS, tap=stream_tap(inner.config))


class _TopkInputs(TorchFunctionMode):
    """Records the input and k of every top-k HF takes: the indexer's [1, n, blocks] scores
    (-inf at the blocks a row may not see) and the routers' [n, experts] choice scores."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[torch.Tensor, int]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.topk, torch.Tensor.topk):
            k = args[1] if len(args) > 1 else kwargs["k"]
            self.calls.append((args[0].detach().reshape(-1, args[0].shape[-1]).clone(), int(k)))
        return func(*args, **kwargs)


def _edge_gaps(model, docs) -> tuple[float, float, int]:
    """(smallest indexer edge gap, smallest router edge gap, rows with more visible blocks
    than index_topk) over HF's top-k calls on each document alone."""
    index_gaps, router_gaps, sparse_rows = [float("inf")], [float("inf")], 0
    for ids, _ in docs:
        with _TopkInputs() as recorded:
            generic_features(model, LAYER_IDS, torch.as_tensor(ids)[None])
        for scores, k in recorded.calls:
            if scores.shape[0] != len(ids):  # the generic forward's probe, not the document
                continue
            router = scores.shape[-1] == EXPERTS and k == TOP_K and torch.isfinite(scores).all()
            keep = INDEX_TOPK if not router else TOP_K
            ordered = scores.sort(dim=-1, descending=True).values
            rows = torch.isfinite(scores).sum(-1) > keep
            if not router:
                sparse_rows += int(rows.sum())
            if rows.any():
                gap = float((ordered[rows, keep - 1] - ordered[rows, keep]).min())
                (router_gaps if router else index_gaps).append(gap)
    return min(index_gaps), min(router_gaps), sparse_rows


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_no_row_has_a_near_tie_at_a_top_k_edge(variant: str) -> None:
    """The seeds' property the parity tests rely on (see the module docstring)."""
    index_gap, router_gap, sparse_rows = _edge_gaps(_model(VARIANTS[variant]()), _documents())
    assert sparse_rows > 0 and index_gap >= MARGIN and router_gap >= MARGIN, (
        index_gap,
        router_gap,
        sparse_rows,
    )


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_packed_row_equals_its_document_run_alone_through_hf(variant: str) -> None:
    model, docs = _model(VARIANTS[variant]()), _documents()
    _assert_rows_equal_each_document_alone(model, docs, _packed(_forward(model), docs))


def test_exact_ties_at_the_indexers_edge_are_broken_as_hf_breaks_them() -> None:
    """One indexer head: blocks whose head the relu clips score exactly 0, and such blocks tie
    at rows' top-k edges (checked). The packed indexer ranks each row's document's blocks in
    HF's order, the later ones at -inf, with HF's k: the same top-k input as the document
    alone, so even exact ties are broken alike (torch.topk on equal rows)."""
    model = _model(DeepseekV4Config(**(_COMMON | dict(index_n_heads=1))))
    docs = _documents()
    index_gap, _, sparse_rows = _edge_gaps(model, docs)
    assert index_gap == 0 and sparse_rows > 0, (index_gap, sparse_rows)
    _assert_rows_equal_each_document_alone(model, docs, _packed(_forward(model), docs))


def test_selected_cpu_path_is_packed_and_exact() -> None:
    model, docs = _model(VARIANTS["deepseek_v4"]()), _documents()
    packed = _selected(model, docs)
    assert "compressed blocks per document" in planned_path("deepseek_v4")
    _assert_rows_equal_each_document_alone(model, docs, packed)


def test_a_refused_config_takes_the_generic_forward_whose_taps_collapse_the_streams(
    monkeypatch,
) -> None:
    """The fallback is HF on each document alone (targets/generic.py), never the padded one,
    whose hooks would copy the raw [.., hc_mult, d] streams."""
    monkeypatch.setattr(paths, "deepseek_v4_layout_problem", lambda inner: "a layout it lacks")
    model, docs = _model(VARIANTS["deepseek_v4"]()), _documents()
    path = select_target_forward(model, LAYER_IDS, token_budget=TOKEN_BUDGET, max_batch_tokens=64)
    assert path.name == "hf" and "a layout it lacks" in path.reason, path.reason
    assert "each document alone" in path.reason
    out = kit.run_path(path.forward, docs, budget=TOKEN_BUDGET, width=WIDTH)
    _assert_rows_equal_each_document_alone(model, docs, out)


def test_the_packed_taps_follow_the_stream_taps_table_as_the_generic_ones_do(
    monkeypatch,
) -> None:
    """One table says how a tap collapses the streams (stream_taps.STREAM_TAPS): with another
    collapse there (the streams' mean), the packed rows still equal the generic path's."""
    mean = MappingProxyType({"deepseek_v4": lambda model, layers, index: lambda s: s.mean(-2)})
    monkeypatch.setattr(stream_taps, "STREAM_TAPS", mean)
    model, docs = _model(VARIANTS["deepseek_v4"]()), _documents()
    _assert_rows_equal_each_document_alone(model, docs, _selected(model, docs))


def test_a_split_target_is_refused_in_one_line() -> None:
    model = _model(VARIANTS["deepseek_v4"]())
    with pytest.raises(SettingsError, match=r"packed_deepseek_v4 .* cannot be split by layers"):
        select_target_forward(
            model, LAYER_IDS, token_budget=TOKEN_BUDGET, max_batch_tokens=64, layers=range(0, 2)
        )


def test_chunks_of_query_rows_keep_every_row_equal_to_its_document_alone() -> None:
    """Chunks of 5 query rows cut the pack inside documents and inside blocks: each chunk's
    token keys and block range are its own, the rows the same."""
    model, docs = _model(VARIANTS["deepseek_v4"]()), _documents()
    forward = _forward(model)
    forward.query_rows = 5
    _assert_rows_equal_each_document_alone(model, docs, _packed(forward, docs))


def _mutant(*edits: tuple[str, str]):
    """packed_deepseek_v4 with each `old` of `edits` (every occurrence) replaced by its `new`."""
    return kit.mutant_module(packed_deepseek_v4, *edits, every=True)


_MIX = "mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)"
MUTANTS = {
    # blocks aligned to pack rows, not documents: a block may hold rows of two documents
    "blocks_straddle_documents": (
        ("(position_ids % rate == 0)", "(rows % rate == 0)"),
        ("starts &= doc_ids[last] == doc_ids", "starts &= doc_ids[last] >= 0"),
    ),
    # CSA's overlap reads the previous block across a document's start
    "overlap_across_documents": (
        ("has_previous = (blocks.index > 0)", "has_previous = (blocks.start >= r)"),
    ),
    # the indexer ranks every block of the pack complete before the row, other documents' too
    # (the attention still sees its own document's blocks alone)
    "indexer_across_documents": (
        ("lo = torch.searchsorted(blocks.start, starts)", "lo = torch.zeros_like(starts)"),
        ("min(last, first + (e - a) // rate)", "last"),
        (
            'scores = scores.masked_fill(~visible, float("-inf"))',
            "scores = scores.masked_fill("
            '~(blocks.start[lo:hi][None] + blocks.rate <= rows + 1), float("-inf"))',
        ),
    ),
    "indexer_top_k_one_more": (("indexer.index_topk, hi", "indexer.index_topk + 1, hi"),),
    # the sliding window reaches back into the previous document
    "window_not_restarted_per_document": (
        ("near &= doc_ids[a:e][None] == doc_ids[s:e, None]", "near = near"),
    ),
    # the streams averaged instead of mixed by comb
    "hyper_connection_mix_dropped": (
        (_MIX, "mixed = streams.mean(dim=-2, keepdim=True).expand_as(streams)"),
    ),
    # the hash router given the pack's positions, or the previous row's token id
    "hash_router_reads_positions": (("input_ids=input_ids[None]", "input_ids=positions[None]"),),
    "hash_router_reads_the_previous_token": (
        ("input_ids=input_ids[None]", "input_ids=input_ids.roll(1)[None]"),
    ),
    # the pooled keys RoPE'd at their pack row, not their document position
    "blocks_at_pack_positions": (
        ("positions = (blocks.index * r)[None]", "positions = blocks.start[None]"),
    ),
}


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_the_parity_check_catches_a_mutant_forward(mutant: str) -> None:
    model, docs = _model(VARIANTS["deepseek_v4"]()), _documents()
    broken = _forward(model, _mutant(*MUTANTS[mutant]))
    with pytest.raises(AssertionError, match="document"):
        _assert_rows_equal_each_document_alone(model, docs, _packed(broken, docs))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_gpu_packed_rows_equal_each_document_alone(variant: str) -> None:
    """fp32 on CUDA (no TF32), the same torch code as on the CPU; the same 1e-5 bound (the
    near-tie gaps checked on the CPU above)."""
    model = _model(VARIANTS[variant]()).cuda()
    docs = _documents()
    packed = _packed(_forward(model), docs, device="cuda")
    _assert_rows_equal_each_document_alone(model, docs, packed)
