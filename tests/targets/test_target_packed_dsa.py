"""The packed sparse-MLA forward (targets/packed/dsa.py) equals each document run alone through HF,
row for row, for DeepSeek-V3.2 and GLM-5 (GLM-MoE-DSA) targets, whose attention sees only the keys
the lightning indexer selects per query.

Tolerance 1e-5 in fp32, as tests/targets/test_target_packed_mla.py derives it: the same matmuls on
the same rows, differing only in summation order, a few fp32 ulps of values of order 1 (measured
below 4e-6 over the variants). The indexer's top-k is discrete: a near-tie between the k-th and
the (k+1)-th best key of a row would flip under those ulps and show as an O(0.1) row error. The
seeds here were chosen so that none is near: `test_no_row_has_a_near_tie_at_its_top_k_edge`
reads HF's own index scores of every document and asserts that the gap at every row's top-k edge
is at least MARGIN = 1e-4, ~100x the largest difference measured between an index score of a
packed row and the same score of its document alone (1.2e-6, for scores up to 2 in magnitude).
Measured gaps with these seeds: 4.4e-4 to 8.3e-4 over the sparse variants, 5.6e-4 and 1.1e-3 in
the flex case; other seeds had gaps of 1e-5 or exact ties at 0 (a key whose every indexer head
is clipped by the relu scores exactly 0), which would make the parity flaky, not wrong. It also
asserts that the sparse configs do select (rows with more visible keys than index_topk exist),
so the parity below exercises the selection: index_topk 4 with documents of 7-12 tokens, and
one config with index_topk above every document's length (all causal keys: dense MLA). The weights are drawn with
initializer_range 0.1 (as the MLA test) and 8 indexer heads, so that an index score is exactly 0
(every head's relu at 0) rarely, and the mutants below move features far beyond the tolerance.
"""

from __future__ import annotations

from functools import partial

import packed_kit as kit
import pytest
import torch
from target_kit import capture_features
from torch.overrides import TorchFunctionMode
from transformers import DeepseekV32Config, GlmMoeDsaConfig, PretrainedConfig

from dflash_async.targets.families import family_of, planned_path
from dflash_async.targets.forward import select_target_forward
from dflash_async.targets.loading import random_target, text_model
from dflash_async.targets.packed import dsa as packed_dsa
from dflash_async.targets.packed.dense import rope_half
from dflash_async.targets.packed.mla import rope_interleaved

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

ATOL = 1e-5  # see the module docstring
MARGIN = 1e-4  # the smallest gap at a top-k edge (see the module docstring)
LENGTHS = (7, 12, 8, 10)  # four documents, the first not the longest, all longer than TOPK
TOPK = 4
TOKEN_BUDGET = 40  # 37 real rows + 3 padding rows
LAYER_IDS = (0, 2, 4)  # a dense layer (first_k_dense_replace=1) and two MoE layers
VOCAB = 300
FLEX_LENGTHS = (70, 100, 3, 50)  # T = 256: documents across flex's 128-row tiles
FLEX_TOPK = 90  # the last 10 rows of the 100-token document select

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=4,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=4,
    topk_group=2,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    initializer_range=0.1,
    max_position_embeddings=512,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    index_topk=TOPK,
    index_n_heads=8,
    index_head_dim=16,  # RoPE on its first 8 dims (qk_rope_head_dim), the other 8 pass
)
WIDTH = len(LAYER_IDS) * _COMMON["hidden_size"]  # the features' width
_YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    mscale=1.0,
    mscale_all_dim=1.0,
    original_max_position_embeddings=128,
    beta_fast=32,
    beta_slow=1,
)


def _deepseek(**over) -> PretrainedConfig:
    return DeepseekV32Config(**(_COMMON | over))


def _glm(**over) -> PretrainedConfig:
    return GlmMoeDsaConfig(**(_COMMON | over))


VARIANTS = {
    "deepseek_v32": lambda: _deepseek(),  # the indexer's RoPE: rotate_half
    "deepseek_v32_yarn": lambda: _deepseek(rope_parameters=_YARN),  # mscale in the scale
    "deepseek_v32_topk_above_every_document": lambda: _deepseek(index_topk=64),
    "glm_moe_dsa": lambda: _glm(),  # the indexer's RoPE: interleaved pairs
    # layers 1, 3 and 4 reuse the selection of the layer before them (shared top-k)
    "glm_moe_dsa_shared": lambda: _glm(index_topk_pattern="FSFSS"),
}
SPARSE = [v for v in VARIANTS if "above" not in v]


def _model(config: PretrainedConfig, seed: int = 2):
    """A random target whose routers' score-correction biases are random too (HF zeroes them)."""
    model = random_target(config, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    for layer in text_model(model).layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            bias = gate.e_score_correction_bias
            bias.copy_(0.2 * torch.randn(bias.shape, generator=generator))
    return model


_documents = partial(kit.documents, vocab=VOCAB, lengths=LENGTHS, seed=3)
_packed = partial(kit.run_packed, budget=TOKEN_BUDGET, width=WIDTH)
_assert_rows_equal_each_document_alone = partial(
    kit.assert_rows_equal_each_document_alone, layer_ids=LAYER_IDS, atol=ATOL
)


def _forward(model, module=packed_dsa, attention: str = "sdpa", compile: bool = False):
    rope = family_of(text_model(model).config).forward.indexer_rope
    return module.PackedDSAForward(
        text_model(model),
        LAYER_IDS,
        indexer_rope=getattr(module, rope.__name__, rope),
        attention=attention,
        compile=compile,
    )


class _IndexScores(TorchFunctionMode):
    """Records the input of every top-k HF takes over a [1, n, n] tensor: the indexer's scores of
    a document of n tokens (the routers' top-k run over [n, experts] and [n, groups, ...])."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n, self.scores = n, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.topk and tuple(args[0].shape) == (1, self.n, self.n):
            self.scores.append(args[0][0].detach().clone())
        return func(*args, **(kwargs or {}))


def _edge_gaps(model, docs, topk: int) -> tuple[float, int]:
    """(the smallest gap between a row's topk-th and (topk+1)-th index score, how many rows
    have more than topk visible keys) over HF's indexer calls on each document alone."""
    gaps, sparse_rows = [float("inf")], 0
    for ids, _ in docs:
        ids = torch.as_tensor(ids)[None]
        with _IndexScores(ids.shape[1]) as recorded:
            capture_features(model, ids, torch.ones_like(ids), LAYER_IDS)
        assert recorded.scores, "no indexer call was recorded"
        for scores in recorded.scores:  # [n, n], -inf at the keys a row does not see
            visible = torch.isfinite(scores).sum(-1)
            ordered = scores.sort(dim=-1, descending=True).values
            rows = visible > topk
            sparse_rows += int(rows.sum())
            if rows.any():
                gaps.append(float((ordered[rows, topk - 1] - ordered[rows, topk]).min()))
    return min(gaps), sparse_rows


@pytest.mark.parametrize("variant", SPARSE)
def test_no_row_has_a_near_tie_at_its_top_k_edge(variant: str) -> None:
    """The seeds' property the parity tests rely on (see the module docstring)."""
    gap, sparse_rows = _edge_gaps(_model(VARIANTS[variant]()), _documents(), TOPK)
    assert sparse_rows > 0 and gap >= MARGIN, (gap, sparse_rows)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_packed_row_equals_its_document_run_alone_through_hf(variant: str) -> None:
    model, docs = _model(VARIANTS[variant]()), _documents()
    _assert_rows_equal_each_document_alone(model, docs, _packed(_forward(model), docs))


@pytest.mark.parametrize("kind", ["deepseek_v32", "glm_moe_dsa"])
def test_selected_cpu_path_is_packed_and_exact(kind: str) -> None:
    model, docs = _model(VARIANTS[kind]()), _documents()
    packed = kit.selected_path_features(
        model, docs, name="packed_dsa", layer_ids=LAYER_IDS, budget=TOKEN_BUDGET, width=WIDTH
    )
    assert "packed sparse MLA" in planned_path(kind)
    _assert_rows_equal_each_document_alone(model, docs, packed)


@pytest.mark.parametrize("variant", ["deepseek_v32", "glm_moe_dsa_shared"])
def test_two_chained_stages_write_the_same_features_as_the_whole_forward(variant: str) -> None:
    """A split target (targets/split.py): layers [0, 2) then [2, 5), hidden handed over; a stage
    may not start on a shared layer (its selection is the previous stage's)."""
    model, docs = _model(VARIANTS[variant]()), _documents()
    splits = (range(0, 2), range(2, 5))
    out = kit.staged_features(
        model, docs, splits=splits, layer_ids=LAYER_IDS, budget=TOKEN_BUDGET, width=WIDTH
    )
    assert torch.equal(out, _packed(_forward(model), docs))
    if variant == "glm_moe_dsa_shared":
        with pytest.raises(ValueError, match="layer 3: that layer shares"):
            select_target_forward(
                model, LAYER_IDS, token_budget=TOKEN_BUDGET, max_batch_tokens=64, layers=range(3, 5)
            )


@pytest.mark.parametrize("variant", ["deepseek_v32", "glm_moe_dsa_shared"])
def test_chunks_of_query_rows_keep_every_row_equal_to_its_document_alone(variant: str) -> None:
    """The indexer's chunks of 7 query rows and SDPA's of 5 (keys [0, end of chunk) each) cut
    the 40-row pack inside documents: the same rows as one chunk."""
    model, docs = _model(VARIANTS[variant]()), _documents()
    forward = _forward(model)
    forward.index_rows, forward.query_rows = 7, 5
    _assert_rows_equal_each_document_alone(model, docs, _packed(forward, docs))


def _flex_case(kind: str):
    model = _model(VARIANTS[kind]().__class__(**(_COMMON | {"index_topk": FLEX_TOPK})))
    return model, _documents(lengths=FLEX_LENGTHS, seed=6)


@pytest.mark.parametrize("kind", ["deepseek_v32", "glm_moe_dsa"])
def test_flex_attention_path_writes_the_sdpa_features_on_the_cpu(kind: str) -> None:
    """The GPU path's attention (flex, a BlockMask of the selection's 128-row tiles whose mask_mod
    reads the selection) run eagerly on the CPU, T = 256 with documents across tile edges and
    index_topk 90; same 1e-5 bound (summation order only), no near-tie (checked)."""
    model, docs = _flex_case(kind)
    gap, sparse_rows = _edge_gaps(model, docs, FLEX_TOPK)
    assert sparse_rows > 0 and gap >= MARGIN, (gap, sparse_rows)
    kit.assert_flex_writes_the_sdpa_features(
        lambda attention: _forward(model, attention=attention), docs, width=WIDTH, atol=ATOL
    )


def _mutant(old: str, new: str):
    """packed_dsa with the one occurrence of `old` in its source replaced by `new`."""
    return kit.mutant_module(packed_dsa, (old, new))


_VISIBLE = 'scores = scores.masked_fill(~visible[s:e, :e], float("-inf"))'
_TOPK = "best = scores.topk(min(indexer.index_topk, e), dim=-1).indices"
_INDEX_ROPE = (
    "q = torch.cat([rope(q[..., :r], cos, sin), q[..., r:]], dim=-1)\n"
    "    k = torch.cat([rope(k[..., :r], cos, sin), k[..., r:]], dim=-1)"
)
# Not among them: the indexer's RoPE at pack positions instead of the document's. Its scores
# depend on a query's and a key's positions through their difference only, which is the same
# in both (a document's rows shift together): an equivalent forward, not a bug to catch.
MUTANTS = {
    # every earlier key of the pack eligible: other documents' keys take top-k places
    "topk_over_the_whole_pack": (
        _VISIBLE,
        'scores = scores.masked_fill(~torch.ones_like(visible[s:e, :e]).tril(s), float("-inf"))',
    ),
    # the document's later keys eligible too (the selection is then cut to the causal ones)
    "indexer_without_the_causal_mask": (
        _VISIBLE,
        'scores = scores.masked_fill(~(visible[s:e, :e] | visible[:e, s:e].t()), float("-inf"))',
    ),
    "k_one_more": (_TOPK, _TOPK.replace("index_topk,", "index_topk + 1,")),
    "k_one_less": (_TOPK, _TOPK.replace("index_topk,", "index_topk - 1,")),
    # RoPE on the indexer's last dims, not its first qk_rope_head_dim ones
    "indexer_rope_on_the_pass_dims": (
        _INDEX_ROPE,
        "q = torch.cat([q[..., :-r], rope(q[..., -r:], cos, sin)], dim=-1)\n"
        "    k = torch.cat([k[..., :-r], rope(k[..., -r:], cos, sin)], dim=-1)",
    ),
    "indexer_ignored_dense_mla": (
        "mask = self.attention_mask(allowed)",
        "mask = self.attention_mask(visible)",
    ),
}


@pytest.mark.parametrize("variant", ["deepseek_v32", "glm_moe_dsa"])
@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_the_parity_check_catches_a_mutant_forward(mutant: str, variant: str) -> None:
    model, docs = _model(VARIANTS[variant]()), _documents()
    broken = _forward(model, _mutant(*MUTANTS[mutant]))
    with pytest.raises(AssertionError, match="document"):
        _assert_rows_equal_each_document_alone(model, docs, _packed(broken, docs))


@pytest.mark.parametrize("variant", ["deepseek_v32", "glm_moe_dsa"])
def test_the_parity_check_catches_the_other_familys_indexer_rope(variant: str) -> None:
    """DeepSeek-V3.2's indexer turns rotate_half halves, GLM-5's interleaved pairs."""
    model, docs = _model(VARIANTS[variant]()), _documents()
    ours = family_of(text_model(model).config).forward.indexer_rope
    other = rope_interleaved if ours is rope_half else rope_half
    broken = packed_dsa.PackedDSAForward(
        text_model(model), LAYER_IDS, indexer_rope=other, attention="sdpa", compile=False
    )
    with pytest.raises(AssertionError, match="document"):
        _assert_rows_equal_each_document_alone(model, docs, _packed(broken, docs))


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("kind", ["deepseek_v32", "glm_moe_dsa"])
def test_gpu_flex_packed_rows_equal_each_document_alone(kind: str, compile: bool) -> None:
    """fp32 on CUDA (no TF32), flex over T = 256 (tiles of 128) with documents across tile edges,
    index_topk 90 (the near-tie gap checked on the CPU above); the same 1e-5 bound."""
    model, docs = _flex_case(kind)
    model = model.cuda()
    forward = _forward(model, attention="flex", compile=compile)
    packed = kit.run_packed(forward, docs, budget=256, width=WIDTH, device="cuda")
    _assert_rows_equal_each_document_alone(model, docs, packed)
