"""Qwen3-VL-MoE's language model on text packs: the packed MoE forward (packed_dense with
`moe_eager` and `mrope`), equal to each document run alone through the HF wrapper, row for row.

Why that path is exact for it: its decoder layers are Qwen3-MoE's (q/k norms, rotate-half RoPE,
a softmax top-k router and fused experts) with Qwen3-VL's interleaved M-RoPE, which on text
positions (three equal rows) is 1-D RoPE (tests/targets/test_target_packed_mrope.py proves that
for the rotary both share); its deepstack inputs apply at image positions only. Its router is
Qwen3-MoE's but for the switch: it has no `norm_topk_prob` and always renormalises the top k, as
`packed_hybrid_moe.route` does for a router without the switch; its block is in packed/dense.py's
ROUTED_BLOCKS, so the router is ours, compiled with the attention on CUDA, and the experts the
HF module's own call. With `mlp_only_layers` some layers are dense MLPs and every MoE block then
runs whole, eagerly (the `moe_eager` path).

M-RoPE replaced by 1-D RoPE is no mutant on text: one position row gives the very cos/sin of
three equal rows (checked below), so the two forwards agree exactly. What the comparison catches
is M-RoPE fed rows that differ (an image's grid, not a text token's).

Tolerance 1e-5 in fp32, as in test_target_packed.py: both sides run the same matmuls on the same
rows and differ only in summation order (measured 1.2e-6 here, 1.5e-6 with a dense layer). The router is discrete, a flip
between two experts needs their probabilities within a few ulps, which with these seeds none are.
Weights are drawn with initializer_range 0.1 (HF's 0.02 keeps the MoE terms small); the mutants
are caught by the same check (measured distances to HF: unequal position rows 1.3, top-k
weights not renormalised 1.0).
"""

from __future__ import annotations

from functools import partial

import packed_kit as kit
import pytest
import torch
from transformers import AutoModelForImageTextToText, Qwen3VLMoeConfig, Qwen3VLMoeTextConfig

from dflash_async.data.packing import layout_pack
from dflash_async.targets.families import FAMILIES
from dflash_async.targets.forward import select_target_forward
from dflash_async.targets.loading import text_model
from dflash_async.targets.packed import hybrid_moe as packed_hybrid_moe
from dflash_async.targets.packed.dense import PackedDenseForward

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

ATOL = 1e-5  # see the module docstring
LENGTHS = (7, 12, 5, 9)  # four documents, the first not the longest
TOKEN_BUDGET = 40  # 33 real rows + 7 padding rows
LAYER_IDS = (0, 2, 3)
VOCAB = 300
WIDTH = len(LAYER_IDS) * 64  # the features' width: hidden 64 per listed layer
SECTIONS = [4, 2, 2]  # Qwen3-VL-30B-A3B's [24, 20, 20] of 64 frequencies, scaled to 8


def _text_config(**over) -> Qwen3VLMoeTextConfig:
    """Qwen3-VL-MoE's language model at hidden 64: 4 layers, GQA 4/2 heads of 16, 8 experts
    (top 2) of width 32."""
    rope = dict(rope_type="default", rope_theta=10000.0, mrope_section=SECTIONS)
    shape = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        vocab_size=VOCAB,
        initializer_range=0.1,
        rope_parameters=rope | {"mrope_interleaved": True},
    )
    return Qwen3VLMoeTextConfig(**(shape | over))


def _wrapper(**over):
    """A random Qwen3-VL-MoE wrapper (one-block vision tower, never run on text), fp32, CPU."""
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        deepstack_visual_indexes=[],
    )
    text = _text_config(**over).to_dict()
    config = Qwen3VLMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    return model.eval().requires_grad_(False)


VARIANTS = {
    "every_layer_moe": {},
    "mlp_only_layers": {"mlp_only_layers": [1]},  # a dense layer among the MoE ones
}


@pytest.fixture(scope="module")
def wrapper():
    return _wrapper()


_documents = partial(kit.documents, vocab=VOCAB, lengths=LENGTHS)
_run = partial(kit.run_path, budget=TOKEN_BUDGET, width=WIDTH)  # a path's forward on the pack
_distance_to_hf = partial(kit.distance_to_hf, layer_ids=LAYER_IDS)


def _path(model, budget: int = TOKEN_BUDGET, **options):
    return select_target_forward(
        model, LAYER_IDS, token_budget=budget, max_batch_tokens=budget, **options
    )


def test_both_qwen3_vl_moe_model_types_plan_the_packed_moe_path_with_mrope() -> None:
    for kind in ("qwen3_vl_moe", "qwen3_vl_moe_text"):
        assert FAMILIES[kind].forward.name == "packed_moe"
        assert FAMILIES[kind].forward.moe_eager and FAMILIES[kind].forward.mrope
    assert FAMILIES["qwen3_vl_moe"].language_model == "qwen3_vl_moe_text"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_packed_row_of_a_qwen3_vl_moe_target_equals_its_document_alone_through_hf(
    variant: str,
) -> None:
    model = _wrapper(**VARIANTS[variant])
    path = _path(model)
    assert path.name == "packed_moe" and path.reason.startswith("qwen3_vl_moe_text:")
    forward = path.forward.packed
    assert forward._routed == (variant == "every_layer_moe")  # the router ours, or HF's block
    docs = _documents(seed=1)
    assert _distance_to_hf(model, docs, _run(path.forward, docs)) < ATOL


def test_one_position_row_is_the_same_rope_as_three_equal_rows(wrapper, monkeypatch) -> None:
    """M-RoPE replaced by 1-D RoPE (positions [1, T]): the same features, bit for bit."""
    docs = _documents(seed=1)
    mrope = _run(_path(wrapper).forward, docs)
    monkeypatch.setattr(PackedDenseForward, "rope_positions", lambda self, p: p[None])
    assert torch.equal(_run(_path(wrapper).forward, docs), mrope)


def _unequal_rows(self, p):
    """The t row right, h and w left at 0 (as if every token sat at the grid origin)."""
    return torch.stack([p, torch.zeros_like(p), torch.zeros_like(p)])[:, None]


def _route_not_renormalised(gate, x):
    """packed_hybrid_moe.route without the renormalisation of the top k."""
    probs = torch.softmax(torch.nn.functional.linear(x, gate.weight), dim=-1, dtype=torch.float)
    top, indices = torch.topk(probs, gate.top_k, dim=-1)
    return top.to(x.dtype), indices


MUTANTS = {
    "unequal_position_rows": (PackedDenseForward, "rope_positions", _unequal_rows),
    "topk_weights_not_renormalised": (packed_hybrid_moe, "route", _route_not_renormalised),
}


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_the_parity_check_catches_a_mutant_forward(wrapper, monkeypatch, mutant: str) -> None:
    docs = _documents(seed=1)
    monkeypatch.setattr(*MUTANTS[mutant])
    assert _distance_to_hf(wrapper, docs, _run(_path(wrapper).forward, docs)) > 100 * ATOL


def test_the_mrope_gets_three_equal_rows_restarting_in_every_document(wrapper) -> None:
    inner = text_model(wrapper)
    seen: list[torch.Tensor] = []
    hook = inner.rotary_emb.register_forward_hook(lambda m, args, out: seen.append(args[1]))
    try:
        docs = _documents()
        _run(_path(wrapper).forward, docs)
    finally:
        hook.remove()
    restarting = layout_pack(docs, TOKEN_BUDGET).position_ids
    assert seen[0].shape == (3, 1, TOKEN_BUDGET)
    assert all(torch.equal(row[0], restarting) for row in seen[0])


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graph", [False, True])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_gpu_flex_compiled_qwen3_vl_moe_rows_equal_each_document_alone(
    variant: str, cuda_graph: bool
) -> None:
    """fp32 on CUDA (no TF32), flex attention, compiled layers and the experts as a run takes
    them (CompiledExperts): the same 1e-5 bound. T = 256 (flex tiles of 128) with documents
    crossing tile edges."""
    model = _wrapper(**VARIANTS[variant]).cuda()
    path = _path(model, 256, cuda_graph=cuda_graph)
    assert path.name == "packed_moe" and "flex" in path.reason, path.reason
    # fp32 experts take torch._grouped_mm's syncing fallback: asked for, the graph is refused
    assert ("not graphed (torch.float32 experts" in path.reason) == cuda_graph, path.reason
    docs = _documents(seed=5, lengths=(70, 100, 3, 50))
    for _ in range(2):  # a CUDA graph is captured on the first call and replayed on the second
        assert (
            _distance_to_hf(model, docs, _run(path.forward, docs, budget=256, device="cuda")) < ATOL
        )
