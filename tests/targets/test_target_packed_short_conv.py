"""The packed LFM2 / LFM2-MoE forward (targets/packed/short_conv.py) equals each document run alone
through HF, row for row: short convolutions per document, document-causal attention, RoPE
positions restarting per document, LFM2-MoE's sigmoid router.

Tolerance 1e-5 in fp32, as tests/targets/test_target_packed.py derives it: both sides run the same
matmuls on the same rows and differ only in summation order (masked keys add exact zeros; the
convolution's taps are added in another order than F.conv1d's), a few fp32 ulps per layer over
5 layers, of features up to 6.4 in size (ulp 4.8e-7 between 4 and 8): measured at most 5.1e-6
over the variants. The router is discrete, but a flip between two experts needs their scores
within those ulps: with these seeds none does (a flip would show as an O(0.1) row error, never
as a silent pass). The weights are drawn with initializer_range 0.1 (not HF's 0.02) and the
expert bias at random (HF zeroes it), so that every term moves features by far more than the
tolerance: the mutant tests below check that (measured, the largest error over the documents a
mutant breaks: convolution across a boundary 4.1, reading the next row 6.8, B and C swapped
6.3, expert weights unnormalised 2.2). RoPE positions that do not restart per document are
invisible to this check (its own test says why and catches them). The third document (2 rows)
is shorter than the convolution.
"""

from __future__ import annotations

from functools import partial

import packed_kit as kit
import pytest
import torch
from transformers import Lfm2Config, Lfm2MoeConfig, PretrainedConfig

from dflash_async.data.packing import layout_pack
from dflash_async.targets.families import planned_path
from dflash_async.targets.forward import select_target_forward
from dflash_async.targets.loading import random_target, text_model
from dflash_async.targets.packed import short_conv as packed_short_conv

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

ATOL = 1e-5  # see the module docstring
LENGTHS = (7, 12, 2, 9)  # four documents, the first not the longest, one shorter than the conv
TOKEN_BUDGET = 40  # 30 real rows + 10 padding rows
LAYER_IDS = (0, 2, 4)  # a convolution (dense MLP in LFM2-MoE), an attention and a later layer
VOCAB = 300
WIDTH = len(LAYER_IDS) * 64  # the features' width: hidden 64 per listed layer
# attention second, so that every later layer sees the positions of every document
LAYER_TYPES = ["conv", "full_attention", "conv", "conv", "full_attention"]

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=2,
    layer_types=LAYER_TYPES,
    initializer_range=0.1,
    max_position_embeddings=512,
)


def _moe(**over) -> PretrainedConfig:
    """A tiny LFM2-MoE: 8 experts of width 32 (top 2) past one dense layer."""
    moe = dict(
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        num_dense_layers=1,
        routed_scaling_factor=2.5,
    )
    return Lfm2MoeConfig(**(_COMMON | moe | over))


VARIANTS = {
    "lfm2": lambda: Lfm2Config(**_COMMON),  # 3 taps, no biases (the published shape)
    "lfm2_wide_conv_biases": lambda: Lfm2Config(**_COMMON, conv_L_cache=4, conv_bias=True),
    "lfm2_moe": lambda: _moe(),  # expert bias, top-k weights normalised
    "lfm2_moe_plain_router": lambda: _moe(use_expert_bias=False, norm_topk_prob=False),
}


def _model(config: PretrainedConfig, seed: int = 1):
    """A random target whose experts' routing biases are random too (HF zeroes them)."""
    model = random_target(config, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    for layer in text_model(model).layers:
        bias = getattr(layer.feed_forward, "expert_bias", None)
        if bias is not None:
            bias.copy_(0.2 * torch.randn(bias.shape, generator=generator))
    return model


_documents = partial(kit.documents, vocab=VOCAB, lengths=LENGTHS)
_packed = partial(kit.run_packed, budget=TOKEN_BUDGET, width=WIDTH)
_assert_rows_equal_each_document_alone = partial(
    kit.assert_rows_equal_each_document_alone, layer_ids=LAYER_IDS, atol=ATOL
)


def _forward(model, module=packed_short_conv, attention: str = "sdpa"):
    return module.PackedShortConvForward(
        text_model(model), LAYER_IDS, attention=attention, compile=False
    )


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_packed_row_equals_its_document_run_alone_through_hf(variant: str) -> None:
    model, docs = _model(VARIANTS[variant]()), _documents()
    _assert_rows_equal_each_document_alone(model, docs, _packed(_forward(model), docs))


@pytest.mark.parametrize("kind", ["lfm2", "lfm2_moe"])
def test_selected_cpu_path_is_packed_and_exact(kind: str) -> None:
    model, docs = _model(VARIANTS[kind](), seed=2), _documents(seed=3)
    packed = kit.selected_path_features(
        model, docs, name="packed_short_conv", layer_ids=LAYER_IDS, budget=TOKEN_BUDGET, width=WIDTH
    )
    assert "packed" in planned_path(kind)
    _assert_rows_equal_each_document_alone(model, docs, packed)


@pytest.mark.parametrize("kind", ["lfm2", "lfm2_moe"])
def test_two_chained_stages_write_the_same_features_as_the_whole_forward(kind: str) -> None:
    """A split target (targets/split.py): layers [0, 3) then [3, 5), hidden handed over."""
    model, docs = _model(VARIANTS[kind]()), _documents()
    splits = (range(0, 3), range(3, 5))
    out = kit.staged_features(
        model, docs, splits=splits, layer_ids=LAYER_IDS, budget=TOKEN_BUDGET, width=WIDTH
    )
    assert torch.equal(out, _packed(_forward(model), docs))


@pytest.mark.parametrize("kind", ["lfm2", "lfm2_moe"])
def test_flex_attention_path_writes_the_sdpa_features_on_the_cpu(kind: str) -> None:
    """The GPU path's attention (flex, its BlockMask over tiles of 128) run eagerly on the CPU,
    T = 256 with documents across tile edges; same 1e-5 bound (summation order only)."""
    model = _model(VARIANTS[kind]())
    docs = _documents(lengths=(70, 100, 3, 50), seed=5)
    kit.assert_flex_writes_the_sdpa_features(
        lambda attention: _forward(model, attention=attention), docs, width=WIDTH, atol=ATOL
    )


def _mutant(old: str, new: str):
    """packed_short_conv with the one occurrence of `old` in its source replaced by `new`."""
    return kit.mutant_module(packed_short_conv, (old, new))


# name -> (old, new, the variant it runs on, the first document it breaks)
MUTANTS = {
    "conv_history_crosses_documents": (
        "(source >= 0) & (doc_ids[row] == doc_ids)",
        "source >= 0",
        "lfm2",
        1,  # the first document has no document before it
    ),
    "conv_reads_the_next_row": ("lag = W - 1 - k", "lag = W - 2 - k", "lfm2", 0),
    "gates_b_and_c_swapped": ("B, C, x = conv.in_proj", "C, B, x = conv.in_proj", "lfm2", 0),
    "expert_weights_unnormalised": (
        "weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)",
        "pass",
        "lfm2_moe",
        0,
    ),
}


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_the_parity_check_catches_a_mutant_forward(mutant: str) -> None:
    old, new, variant, document = MUTANTS[mutant]
    model, docs = _model(VARIANTS[variant]()), _documents()
    broken = _forward(model, _mutant(old, new))
    with pytest.raises(AssertionError, match=f"document {document}"):
        _assert_rows_equal_each_document_alone(model, docs, _packed(broken, docs))


def _rotary_positions(model, module=packed_short_conv) -> torch.Tensor:
    """The positions [T] the forward hands the model's rotary module, for the test pack."""
    seen: list[torch.Tensor] = []
    rotary = text_model(model).rotary_emb
    hook = rotary.register_forward_hook(lambda m, args, out: seen.append(args[1]))
    try:
        _packed(_forward(model, module), _documents())
    finally:
        hook.remove()
    return seen[0][0]


def test_rotary_embedding_gets_the_positions_restarting_in_every_document() -> None:
    """RoPE makes attention depend on q-k position differences only, so positions that do not
    restart (each document shifted by its offset) give the same features in exact arithmetic,
    differing by angle rounding only (below the tolerance at this size: the parity check does
    not see that mutant). So it is caught here, at the rotary's input."""
    model = _model(VARIANTS["lfm2"]())
    restarting = layout_pack(_documents(), TOKEN_BUDGET).position_ids
    assert torch.equal(_rotary_positions(model), restarting)
    mutant = _mutant(
        "self._rotary(hidden, position_ids[None])",
        "self._rotary(hidden, torch.arange(position_ids.shape[0])[None])",
    )
    assert not torch.equal(_rotary_positions(model, mutant), restarting)


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("kind", ["lfm2", "lfm2_moe"])
def test_gpu_flex_packed_rows_equal_each_document_alone(kind: str, compile: bool) -> None:
    """fp32 on CUDA (no TF32), the product's path (select_target_forward: flex over T = 256,
    tiles of 128, with documents across tile edges; LFM2-MoE's experts as CompiledExperts),
    compiled or not. The reference is a copy of the model, run before the experts are swapped.
    Same 1e-5 bound as the CPU."""
    import copy

    model = _model(VARIANTS[kind]()).cuda()
    reference = copy.deepcopy(model)
    path = select_target_forward(
        model, LAYER_IDS, token_budget=256, max_batch_tokens=256, compile=compile
    )
    assert path.name == "packed_short_conv" and "flex" in path.reason, path.reason
    docs = _documents(lengths=(70, 100, 3, 50), seed=5)
    out = kit.run_path(path.forward, docs, budget=256, width=WIDTH, device="cuda")
    _assert_rows_equal_each_document_alone(reference, docs, out)
