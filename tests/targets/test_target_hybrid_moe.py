"""The packed Qwen3.5-MoE forward equals each document run alone through HF, row for row, and the
comparison is sharp enough to catch the mistakes a packed hybrid MoE forward can make.

On the CPU the packed forward runs with test_target_hybrid.py's plain torch kernels (`REFERENCE`:
per-segment causal conv, the token-by-token gated delta rule), as the Qwen3.5 test does; the MoE
block is the product's (our router and gated shared expert around HF's experts module).

Tolerance 2e-5 in fp32, as test_target_hybrid.py derives it: HF runs the chunked delta rule, the
reference its recurrence, a few ulps apart per step; the MoE block adds no difference of its own
(the same routing in fp32, and the same expert rows: a token's experts don't depend on the pack;
fp32 near-ties in the top-k would show as an O(0.1) jump, not a drift). The mutants below move
the features by orders of magnitude more (each test asserts at least 10 x ATOL), with the weights
at initializer_range 0.1 so that the MoE block's output is of the residual's order, not 2% of it.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import transformers
from arch_targets import tiny_config
from target_kit import capture_features
from test_target_hybrid import REFERENCE, _documents, _packed, _per_document_errors
from transformers import Qwen3_5MoeTextConfig

from dflash_async.data.packing import layout_pack
from dflash_async.targets.families import family_of, planned_path
from dflash_async.targets.forward import select_target_forward
from dflash_async.targets.loading import random_target, text_model
from dflash_async.targets.packed import hybrid_moe as packed_hybrid_moe
from dflash_async.targets.packed.hybrid import (
    HybridKernels,
    PackedHybridForward,
    Segments,
    hybrid_layout_problem,
)

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

LENGTHS = (7, 12, 5, 9)
TOKEN_BUDGET = 40
LAYER_IDS = (1, 3, 4)  # the layer ids test_target_hybrid's _per_document_errors captures
WIDTH = 3 * 64
ATOL = 2e-5  # see the module docstring
MUTANT_MIN = 10 * ATOL


def tiny_qwen35_moe(**overrides) -> Qwen3_5MoeTextConfig:
    """test_target_hybrid's tiny Qwen3.5 layout (4 Gated DeltaNet + 1 gated attention layers,
    heads of 32) with an MoE block in every layer: 8 experts, top 2, a shared expert."""
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
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        initializer_range=0.1,
        layer_types=["linear_attention"] * 3 + ["full_attention", "linear_attention"],
    )
    return Qwen3_5MoeTextConfig(**{**shape, **overrides})


@pytest.fixture(scope="module")
def moe_model():
    return random_target(tiny_qwen35_moe(), seed=0)


def _errors(model, kernels: HybridKernels = REFERENCE) -> list[float]:
    """Each document's max abs error, packed vs alone, after checking that the packed forward
    takes these layers (select_target_forward would, on CUDA with fla)."""
    assert hybrid_layout_problem(text_model(model)) is None
    forward = PackedHybridForward(
        text_model(model),
        LAYER_IDS,
        kernels=kernels,
        mrope=family_of(text_model(model).config).forward.mrope,  # Qwen3-Next's: 1-D
        attention="sdpa",
        compile=False,
    )
    docs = _documents(LENGTHS)
    return _per_document_errors(model, docs, _packed(forward, docs, TOKEN_BUDGET, WIDTH))


def test_packed_qwen35_moe_rows_equal_each_document_alone_and_padding_is_zero(moe_model) -> None:
    errors = _errors(moe_model)
    assert max(errors) < ATOL, errors


def test_packed_qwen35_moe_wrapper_rows_equal_each_document_alone() -> None:
    """The multimodal wrapper (`qwen3_5_moe`): its language model, text rows only."""
    config = tiny_config("qwen3_5_moe")
    config.text_config.vocab_size = 300
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForImageTextToText.from_config(config).eval()
    assert hybrid_layout_problem(text_model(model)) is None
    forward = PackedHybridForward(
        text_model(model), (0, 1), kernels=REFERENCE, mrope=True, attention="sdpa", compile=False
    )
    docs = _documents(LENGTHS)
    packed = _packed(forward, docs, TOKEN_BUDGET, 2 * 64)
    offsets = np.concatenate([[0], np.cumsum(LENGTHS)])
    for j, (ids, _) in enumerate(docs):
        ids = torch.as_tensor(ids)[None]
        alone = capture_features(model, ids, torch.ones_like(ids), (0, 1))[0]
        error = float((packed[offsets[j] : offsets[j + 1]] - alone).abs().max())
        assert error < ATOL, (j, error)
    assert not packed[offsets[-1] :].any(), "padding rows must be zero"


def test_qwen35_moe_splits_into_two_stages_that_write_the_unsplit_features_bit_for_bit(
    moe_model,
) -> None:
    """The packed forward takes these layers, so a split target (targets/split.py) can run them:
    stage() over layers 0-2 then 3-4 is the same ops as the whole range."""
    assert hybrid_layout_problem(text_model(moe_model)) is None  # else: HF, which cannot split
    docs = _documents(LENGTHS)
    layout = layout_pack(docs, TOKEN_BUDGET)
    args = (layout.input_ids, layout.position_ids, layout.doc_ids)
    lengths = np.array(LENGTHS)
    make = lambda layers: PackedHybridForward(  # noqa: E731
        text_model(moe_model),
        LAYER_IDS,
        kernels=REFERENCE,
        mrope=True,  # Qwen3.5 (targets/families.py)
        attention="sdpa",
        compile=False,
        layers=layers,
    )
    whole = make(None)(*args, torch.zeros(TOKEN_BUDGET, WIDTH), lengths)
    split = torch.zeros(TOKEN_BUDGET, WIDTH)
    hidden = make(range(0, 3)).stage(None, *args, split, lengths)
    make(range(3, 5)).stage(hidden, *args, split, lengths)
    assert torch.equal(split, whole)


def _one_segment(kernels: HybridKernels) -> HybridKernels:
    """The mutant: cu_seqlens of one document for the whole pack (state crosses documents)."""

    def whole(s: Segments) -> Segments:
        cu = torch.tensor([0, int(s.cu_cpu[-1])])
        return Segments(cu, cu, s.chunks[:1])

    conv = lambda x, w, s: kernels.conv(x, w, whole(s))  # noqa: E731
    delta = lambda q, k, v, g, b, s: kernels.delta(q, k, v, g, b, whole(s))  # noqa: E731
    return HybridKernels(conv, delta, "one segment")


def test_recurrent_state_crossing_documents_is_caught(moe_model) -> None:
    errors = _errors(moe_model, _one_segment(REFERENCE))
    assert errors[0] < ATOL and min(errors[1:]) > MUTANT_MIN, errors  # the first is alone anyway


def test_router_without_top_k_renormalisation_is_caught(moe_model, monkeypatch) -> None:
    route = packed_hybrid_moe.route

    def unnormalised(gate, x):
        gate.norm_topk_prob = False
        try:
            return route(gate, x)
        finally:
            del gate.norm_topk_prob

    monkeypatch.setattr(packed_hybrid_moe, "route", unnormalised)
    assert min(_errors(moe_model)) > MUTANT_MIN


def test_shared_expert_without_its_gate_is_caught(moe_model, monkeypatch) -> None:
    monkeypatch.setattr(
        packed_hybrid_moe, "gated_shared_expert", lambda mlp, x: mlp.shared_expert(x)
    )
    assert min(_errors(moe_model)) > MUTANT_MIN


def test_cpu_qwen35_moe_keeps_the_hf_path_because_fla_needs_cuda(moe_model) -> None:
    """Its layers qualify (the old code refused them for their model_type); the device does not."""
    path = select_target_forward(
        moe_model, LAYER_IDS, token_budget=TOKEN_BUDGET, max_batch_tokens=64
    )
    assert path.name == "hf" and "CUDA" in path.reason, path.reason


def test_planned_path_of_qwen35_moe_is_the_packed_hybrid_forward() -> None:
    for model_type in ("qwen3_5_moe_text", "qwen3_5_moe"):
        assert planned_path(model_type).startswith("packed hybrid"), model_type


def gpu_relative_errors(model) -> list[float]:
    """Each document's max abs error, packed (the selected path: fla kernels, flex attention,
    compiled, grouped experts) vs alone through HF, relative to its features' max, on CUDA."""
    path = select_target_forward(model, LAYER_IDS, token_budget=256, max_batch_tokens=256)
    assert path.name == "packed_hybrid", path.reason
    docs = _documents((70, 100, 3, 50), seed=1)
    packed = _packed(path.forward, docs, 256, WIDTH, "cuda")
    offsets = np.concatenate([[0], np.cumsum([len(d[0]) for d in docs])])
    errors = _per_document_errors(model, docs, packed)
    scales = [float(packed[lo:hi].abs().max()) for lo, hi in itertools.pairwise(offsets)]
    return [e / s for e, s in zip(errors, scales, strict=True)]


@pytest.mark.gpu
def test_gpu_fla_packed_qwen35_moe_rows_equal_each_document_alone() -> None:
    """fp32: the bound of test_target_hybrid's GPU test (relative 5e-3 per document, from the
    TF32 dots in fla's kernels); the grouped experts run fp32 GEMMs (no TF32 by default)."""
    relative = gpu_relative_errors(random_target(tiny_qwen35_moe(), seed=0).cuda())
    assert max(relative) < 5e-3, relative
