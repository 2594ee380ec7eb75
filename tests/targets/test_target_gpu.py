"""GPU: the compiled flex packed forward in bf16 at a real width, and the packed MoE path.

bf16 tolerance, from the reference's own noise: the HF path itself in bf16 is some distance from
the same model in fp32. The packed path does the same ops in the same precision on the same rows
(only kernel choices and summation order differ), so it must be no farther from fp32 than HF is:
relative error <= 1.5x HF's (margin for kernel differences: flex vs SDPA softmax, fused compiled
norms), per document.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from target_kit import capture_features
from transformers import Qwen3Config, Qwen3MoeConfig

from dflash_async.data.packing import layout_pack, pack_row_offsets
from dflash_async.targets.forward import select_target_forward
from dflash_async.targets.loading import random_target

pytestmark = pytest.mark.gpu

LAYERS = (1, 3, 5)


def _qwen3_8b_width(num_layers: int = 6) -> Qwen3Config:
    """Qwen3-8B's layer shape (d 4096, 32 q / 8 kv heads of 128, MLP 12288), 6 layers."""
    return Qwen3Config(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=num_layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )


def _docs(lengths, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, vocab, n), np.ones(n, dtype=bool)) for n in lengths]


def _packed(model, docs, token_budget: int, width: int) -> torch.Tensor:
    path = select_target_forward(
        model, LAYERS, token_budget=token_budget, max_batch_tokens=token_budget
    )
    assert path.name in ("packed_dense", "packed_moe"), path.reason
    layout = layout_pack(docs, token_budget).to("cuda")
    out = torch.full((token_budget, width), float("nan"), device="cuda", dtype=layout_dtype(model))
    lengths = np.array([len(d[0]) for d in docs])
    return path.forward(layout.input_ids, layout.position_ids, layout.doc_ids, out, lengths)


def layout_dtype(model) -> torch.dtype:
    return next(model.parameters()).dtype


def _alone(model, ids) -> torch.Tensor:
    ids = torch.as_tensor(ids, device="cuda")[None]
    return capture_features(model, ids, torch.ones_like(ids), LAYERS)[0].float()


def _relative(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref).norm() / ref.norm())


def test_bf16_packed_rows_at_the_qwen3_8b_width_are_as_close_to_fp32_as_hf_is() -> None:
    with torch.device("cuda"):
        model = random_target(_qwen3_8b_width(), seed=0, dtype=torch.bfloat16)
    reference = copy.deepcopy(model).float()
    docs = _docs((300, 1000, 57, 640), 151936)  # 1997 rows, 51 padding rows
    packed = _packed(model, docs, 2048, len(LAYERS) * 4096)
    offsets = pack_row_offsets(np.array([len(d[0]) for d in docs]))
    for j, (ids, _) in enumerate(docs):
        exact = _alone(reference, ids)
        hf_error = _relative(_alone(model, ids), exact)
        packed_error = _relative(packed[offsets[j] : offsets[j + 1]], exact)
        assert packed_error <= 1.5 * hf_error, (j, packed_error, hf_error)
    assert not packed[offsets[-1] :].any()


def test_fp32_packed_moe_rows_equal_each_document_alone() -> None:
    """Qwen3-MoE, fp32 on CUDA: compiled attention + the HF MoE block; 1e-4 (fp32, deeper sums
    in the routed experts than the CPU test's 1e-5 bound assumes)."""
    config = Qwen3MoeConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=500,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
    )
    model = random_target(config, seed=1).cuda()
    docs = _docs((70, 100, 3, 50), 500, seed=2)
    packed = _packed(model, docs, 256, len(LAYERS) * 128)
    offsets = pack_row_offsets(np.array([len(d[0]) for d in docs]))
    for j, (ids, _) in enumerate(docs):
        torch.testing.assert_close(
            packed[offsets[j] : offsets[j + 1]], _alone(model, ids), atol=1e-4, rtol=0
        )
    assert not packed[offsets[-1] :].any()


def _graph_model(kind: str):
    if kind == "qwen3_moe":
        config = Qwen3MoeConfig(
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            vocab_size=500,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=128,
        )
    else:
        config = Qwen3Config(
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            vocab_size=500,
        )
    return random_target(config, seed=1).to("cuda", torch.bfloat16)


def _features(path, docs, token_budget: int = 512) -> torch.Tensor:
    layout = layout_pack(docs, token_budget).to("cuda")
    out = torch.full(
        (token_budget, len(LAYERS) * 256), float("nan"), device="cuda", dtype=torch.bfloat16
    )
    lengths = np.array([len(d[0]) for d in docs])
    return path.forward(layout.input_ids, layout.position_ids, layout.doc_ids, out, lengths)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_the_forward_replayed_from_one_cuda_graph_writes_the_eager_features_bit_for_bit(
    kind: str,
) -> None:
    """DFLASH_TARGET__CUDA_GRAPH (targets/graphed.py): the first call runs eagerly and captures;
    later packs, of other documents, replay the graph. The same kernels on the same values, so
    the same bits as the eager forward (bf16, compiled, the CompiledExperts swap for the MoE);
    a replay that kept the captured pack's layout would differ (different documents)."""
    from dflash_async.targets.graphed import GraphedForward

    model = _graph_model(kind)
    options = {"token_budget": 512, "max_batch_tokens": 512}
    eager = select_target_forward(model, LAYERS, **options)
    graphed = select_target_forward(model, LAYERS, cuda_graph=True, **options)
    assert isinstance(graphed.forward, GraphedForward) and "one CUDA graph" in graphed.reason
    packs = [
        _docs(lengths, 500, seed=seed)
        for seed, lengths in enumerate([(100, 300, 50), (511,), (7, 200, 90, 150)])
    ]
    for docs in packs:
        assert torch.equal(_features(graphed, docs), _features(eager, docs))
    assert graphed.forward.graph is not None  # captured by the first call
    assert not torch.equal(_features(graphed, packs[1]), _features(eager, packs[2]))
