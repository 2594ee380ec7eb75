"""The packed Qwen3-Next forward equals each document run alone through HF, row for row, and the
comparison catches a state crossing documents, a changed top-k renormalisation and a dropped
shared-expert gate.

Qwen3-Next differs from Qwen3.5-MoE where the packed forward must follow it: its Gated DeltaNet
fuses q, k, v, z (and b, a) in projections grouped per key head, its rotary is plain 1-D with a
partial rotary factor (0.25: 8 of 32 dims), its router renormalises only when `norm_topk_prob`
says so (both settings are tested), and `mlp_only_layers` gives some layers a dense MLP (layer 2
here). The kernels are test_target_hybrid.py's CPU references, the tolerance is
test_target_hybrid_moe.py's (2e-5 in fp32, derived there; mutants asserted beyond 10 x that).
"""

from __future__ import annotations

import pytest
from test_target_hybrid import REFERENCE
from test_target_hybrid_moe import ATOL, LAYER_IDS, MUTANT_MIN, TOKEN_BUDGET, _errors, _one_segment
from transformers import Qwen3NextConfig

from dflash_async.targets.families import planned_path
from dflash_async.targets.forward import select_target_forward
from dflash_async.targets.loading import random_target
from dflash_async.targets.packed import hybrid_moe as packed_hybrid_moe

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def tiny_qwen3_next(**overrides) -> Qwen3NextConfig:
    """4 Gated DeltaNet + 1 gated attention layers, heads of 32, 8 experts (top 2) and a shared
    expert in every layer but layer 2 (a dense MLP), weights at initializer_range 0.1."""
    shape = dict(
        hidden_size=64,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        vocab_size=300,
        num_experts=8,
        num_experts_per_tok=2,
        intermediate_size=96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        initializer_range=0.1,
        mlp_only_layers=[2],
        layer_types=["linear_attention"] * 3 + ["full_attention", "linear_attention"],
    )
    return Qwen3NextConfig(**{**shape, **overrides})


@pytest.fixture(scope="module", params=[True, False], ids=["norm_topk", "raw_topk"])
def next_model(request):
    return random_target(tiny_qwen3_next(norm_topk_prob=request.param), seed=0)


def test_packed_qwen3_next_rows_equal_each_document_alone_and_padding_is_zero(next_model) -> None:
    assert type(next_model.model.layers[2].mlp).__name__ == "Qwen3NextMLP"  # a dense layer too
    errors = _errors(next_model)
    assert max(errors) < ATOL, errors


def test_qwen3_next_recurrent_state_crossing_documents_is_caught(next_model) -> None:
    errors = _errors(next_model, _one_segment(REFERENCE))
    assert errors[0] < ATOL and min(errors[1:]) > MUTANT_MIN, errors


def test_qwen3_next_router_with_the_other_top_k_normalisation_is_caught(
    next_model, monkeypatch
) -> None:
    route = packed_hybrid_moe.route

    def flipped(gate, x):
        gate.norm_topk_prob = not gate.norm_topk_prob
        try:
            return route(gate, x)
        finally:
            gate.norm_topk_prob = not gate.norm_topk_prob

    monkeypatch.setattr(packed_hybrid_moe, "route", flipped)
    assert min(_errors(next_model)) > MUTANT_MIN


def test_qwen3_next_shared_expert_without_its_gate_is_caught(next_model, monkeypatch) -> None:
    monkeypatch.setattr(
        packed_hybrid_moe, "gated_shared_expert", lambda mlp, x: mlp.shared_expert(x)
    )
    assert min(_errors(next_model)) > MUTANT_MIN


def test_cpu_qwen3_next_keeps_the_hf_path_because_fla_needs_cuda(next_model) -> None:
    """Its layers qualify (the old code refused them for their model_type); the device does not."""
    path = select_target_forward(
        next_model, LAYER_IDS, token_budget=TOKEN_BUDGET, max_batch_tokens=64
    )
    assert path.name == "hf" and "CUDA" in path.reason, path.reason


def test_planned_path_of_qwen3_next_is_the_packed_hybrid_forward() -> None:
    assert planned_path("qwen3_next").startswith("packed hybrid")


@pytest.mark.gpu
def test_gpu_fla_packed_qwen3_next_rows_equal_each_document_alone() -> None:
    """test_target_hybrid_moe's GPU comparison (relative 5e-3 per document) on Qwen3-Next."""
    from test_target_hybrid_moe import gpu_relative_errors

    model = random_target(tiny_qwen3_next(), seed=0).cuda()
    relative = gpu_relative_errors(model)
    assert max(relative) < 5e-3, relative
