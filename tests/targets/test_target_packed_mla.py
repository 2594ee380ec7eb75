"""The packed MLA / grouped-router MoE forward (targets/packed/mla.py) equals each document run
alone through HF, row for row, for DeepSeek-V3 (MLA) and GLM-4.5 (partial-rotary GQA) targets.

Tolerance 1e-5 in fp32, as tests/targets/test_target_packed.py derives it: both sides run the same
matmuls on the same rows and differ only in summation order (masked keys add exact zeros), a few
fp32 ulps (1.2e-7) of values of order 1, measured below 4.1e-6 over the variants. The router is discrete, but a flip between two experts
needs their scores within those ulps: with these seeds none does (a flip would show as an O(0.1)
row error, never as a silent pass). The weights are drawn with initializer_range 0.1 (not HF's
0.02) and the score-correction bias at random, so that the expert, shared-expert and routing terms
each move features by far more than the tolerance: the mutant tests below check that (measured:
RoPE on the nope dims 3.1, shared experts dropped 2.3, top-k weights unnormalised 2.7 or
softmax-normalised 0.6).
"""

from __future__ import annotations

from functools import partial

import packed_kit as kit
import pytest
import torch
from transformers import DeepseekV3Config, Glm4MoeConfig, PretrainedConfig

from dflash_async.targets.families import family_of, planned_path
from dflash_async.targets.loading import random_target, text_model
from dflash_async.targets.packed import mla as packed_mla

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

ATOL = 1e-5  # see the module docstring
LENGTHS = (7, 12, 5, 9)  # four documents, the first not the longest
TOKEN_BUDGET = 40  # 33 real rows + 7 padding rows
LAYER_IDS = (0, 2, 4)  # a dense layer (first_k_dense_replace=1) and two MoE layers
VOCAB = 300
WIDTH = len(LAYER_IDS) * 64  # the features' width: hidden 64 per listed layer

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=5,
    num_attention_heads=4,
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
)


def _deepseek(**over) -> PretrainedConfig:
    """A tiny DeepSeek-V3: q/k 24 wide (16 nope + 8 rope), v 16 wide, low-rank q and kv."""
    mla = dict(
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        rope_interleave=True,
    )
    return DeepseekV3Config(**(_COMMON | mla | over))


def _glm(**over) -> PretrainedConfig:
    """A tiny GLM-4.5: GQA 4/2 heads of 16, RoPE on the first half of each head, q/k norms."""
    gqa = dict(num_key_value_heads=2, head_dim=16, use_qk_norm=True, attention_bias=True)
    config = Glm4MoeConfig(**(_COMMON | gqa | over))
    assert config.rope_parameters.get("partial_rotary_factor", 1.0) == 0.5
    return config


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
VARIANTS = {
    "deepseek_v3": lambda: _deepseek(),  # interleaved RoPE (the config's default)
    "deepseek_v3_rotate_half": lambda: _deepseek(rope_interleave=False),
    "deepseek_v3_yarn": lambda: _deepseek(rope_parameters=_YARN),  # mscale in the scale
    "moonlight_no_q_lora": lambda: _deepseek(q_lora_rank=None),
    "glm4_moe": lambda: _glm(),
}


def _model(config: PretrainedConfig, seed: int = 1):
    """A random target whose routers' score-correction biases are random too (HF zeroes them)."""
    model = random_target(config, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    for layer in text_model(model).layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            bias = gate.e_score_correction_bias
            bias.copy_(0.2 * torch.randn(bias.shape, generator=generator))
    return model


_documents = partial(kit.documents, vocab=VOCAB, lengths=LENGTHS)
_packed = partial(kit.run_packed, budget=TOKEN_BUDGET, width=WIDTH)
_assert_rows_equal_each_document_alone = partial(
    kit.assert_rows_equal_each_document_alone, layer_ids=LAYER_IDS, atol=ATOL
)


def _block(model, module=packed_mla):
    """The family's attention block (targets/families.py: MLA or GLM-4.5's partial rotary),
    looked up in `module` by name, so that a mutant module runs its own."""
    block = family_of(text_model(model).config).forward.attention_block
    return getattr(module, block.__name__)


def _forward(model, module=packed_mla, attention: str = "sdpa", compile: bool = False):
    return module.PackedMLAForward(
        text_model(model),
        LAYER_IDS,
        attention_block=_block(model, module),
        attention=attention,
        compile=compile,
    )


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_packed_row_equals_its_document_run_alone_through_hf(variant: str) -> None:
    model, docs = _model(VARIANTS[variant]()), _documents()
    _assert_rows_equal_each_document_alone(model, docs, _packed(_forward(model), docs))


@pytest.mark.parametrize("kind", ["deepseek_v3", "glm4_moe"])
def test_selected_cpu_path_is_packed_and_exact(kind: str) -> None:
    model, docs = _model(VARIANTS[kind](), seed=2), _documents(seed=3)
    name = "packed_mla" if kind == "deepseek_v3" else "packed_moe"
    packed = kit.selected_path_features(
        model, docs, name=name, layer_ids=LAYER_IDS, budget=TOKEN_BUDGET, width=WIDTH
    )
    assert "packed" in planned_path(kind)
    _assert_rows_equal_each_document_alone(model, docs, packed)


@pytest.mark.parametrize("kind", ["deepseek_v3", "glm4_moe"])
def test_two_chained_stages_write_the_same_features_as_the_whole_forward(kind: str) -> None:
    """A split target (targets/split.py): layers [0, 3) then [3, 5), hidden handed over."""
    model, docs = _model(VARIANTS[kind]()), _documents()
    splits = (range(0, 3), range(3, 5))
    out = kit.staged_features(
        model, docs, splits=splits, layer_ids=LAYER_IDS, budget=TOKEN_BUDGET, width=WIDTH
    )
    assert torch.equal(out, _packed(_forward(model), docs))


@pytest.mark.parametrize("kind", ["deepseek_v3", "glm4_moe"])
def test_flex_attention_path_writes_the_sdpa_features_on_the_cpu(kind: str) -> None:
    """The GPU path's attention (flex, its BlockMask over tiles of 128) run eagerly on the CPU:
    flex takes MLA's value dim (16) narrower than q/k's (24). T = 256 with documents across tile
    edges; same 1e-5 bound (summation order only)."""
    model = _model(VARIANTS[kind]())
    docs = _documents(lengths=(70, 100, 3, 50), seed=5)
    kit.assert_flex_writes_the_sdpa_features(
        lambda attention: _forward(model, attention=attention), docs, width=WIDTH, atol=ATOL
    )


def _mutant(old: str, new: str):
    """packed_mla with the one occurrence of `old` in its source replaced by `new`."""
    return kit.mutant_module(packed_mla, (old, new))


MUTANTS = {
    "rope_on_the_nope_dims": (
        "q = torch.cat([q[..., :nope], rope(q[..., nope:], cos, sin)], dim=-1)",
        "q = torch.cat([rope(q[..., :r], cos, sin), q[..., r:]], dim=-1)",
    ),
    "topk_weights_not_normalised": (
        "weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)",
        "pass",
    ),
    "topk_weights_softmax_normalised": (
        "weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)",
        "weights = weights.softmax(-1)",
    ),
    "shared_experts_dropped": (
        "return hidden + routed + mlp.shared_experts(x)",
        "return hidden + routed",
    ),
}


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_the_parity_check_catches_a_mutant_forward(mutant: str) -> None:
    model, docs = _model(_deepseek()), _documents()
    broken = _forward(model, _mutant(*MUTANTS[mutant]))
    with pytest.raises(AssertionError, match="document 0"):
        _assert_rows_equal_each_document_alone(model, docs, _packed(broken, docs))


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("kind", ["deepseek_v3", "glm4_moe"])
def test_gpu_flex_packed_rows_equal_each_document_alone(kind: str, compile: bool) -> None:
    """fp32 on CUDA (no TF32), flex over T = 256 (tiles of 128) with documents across tile edges;
    q/k (24) and v (16) head dims differ for MLA. Same 1e-5 bound as the CPU."""
    model = _model(VARIANTS[kind]()).cuda()
    forward = _forward(model, attention="flex", compile=compile)
    docs = _documents(lengths=(70, 100, 3, 50), seed=5)
    packed = kit.run_packed(forward, docs, budget=256, width=WIDTH, device="cuda")
    _assert_rows_equal_each_document_alone(model, docs, packed)
