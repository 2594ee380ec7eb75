"""The packed target forward equals each document run alone through HF, row for row.

The reference is the HF model itself on one document at a time (no padding, no packing), its
captured layers taken by `capture_features`. Tolerance 1e-5 in fp32: both sides do the same
matmuls on the same rows; they differ only in summation order inside SDPA/matmul kernels
(masked keys add exact zeros), a few ulps of values of order 1 (fp32 ulp 1.2e-7), measured
below 3e-6 here; a real mistake (wrong layer, a shifted row, a key from another document, a
position off by the document's offset) moves features by O(0.1) or more.
"""

from __future__ import annotations

from functools import partial

import packed_kit as kit
import pytest
import torch
from transformers import (
    DeepseekV3Config,
    LlamaConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from dflash_async.data.packing import layout_pack
from dflash_async.targets.forward import packed_attention, select_target_forward
from dflash_async.targets.loading import random_target, text_model
from dflash_async.targets.packed import dense as packed_dense
from dflash_async.targets.packed.dense import (
    PackedDenseForward,
    document_causal_block_mask,
    document_causal_mask,
)
from dflash_async.targets.tiny import tiny_target_config, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

ATOL = 1e-5  # see the module docstring
LENGTHS = (7, 12, 5, 9)  # four documents, the first not the longest
TOKEN_BUDGET = 40  # 33 real rows + 7 padding rows
LAYER_IDS = (1, 3, 4)


@pytest.fixture(scope="module")
def tiny_model():
    """The built-in demo target (random Qwen3, 6 layers, hidden 128), fp32 on the CPU."""
    return random_target(tiny_target_config(tiny_tokenizer()), seed=3)


_SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=300,
)


def _family(kind: str) -> PretrainedConfig:
    if kind == "llama":
        return LlamaConfig(**_SMALL, attention_bias=True)
    if kind == "qwen2":
        return Qwen2Config(**_SMALL)  # q/k/v biases
    if kind == "qwen3_moe":
        return Qwen3MoeConfig(
            **_SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32
        )
    assert kind == "qwen3", kind
    return Qwen3Config(**_SMALL)


_documents = partial(kit.documents, lengths=LENGTHS)
_assert_rows_equal_each_document_alone = partial(
    kit.assert_rows_equal_each_document_alone, layer_ids=LAYER_IDS, atol=ATOL
)


def _packed_features(forward, docs) -> torch.Tensor:
    return kit.run_packed(
        forward, docs, budget=TOKEN_BUDGET, width=len(LAYER_IDS) * forward.hidden_size
    )


def test_every_packed_row_equals_its_document_run_alone_through_hf(tiny_model) -> None:
    forward = PackedDenseForward(text_model(tiny_model), LAYER_IDS, attention="sdpa", compile=False)
    docs = _documents(vocab=tiny_model.config.vocab_size)
    _assert_rows_equal_each_document_alone(tiny_model, docs, _packed_features(forward, docs))


@pytest.mark.parametrize("kind", ["qwen3", "qwen2", "llama", "qwen3_moe"])
def test_selected_cpu_path_of_each_dense_family_is_packed_and_exact(kind: str) -> None:
    model = random_target(_family(kind), seed=1)
    name = "packed_moe" if kind == "qwen3_moe" else "packed_dense"
    docs = _documents(vocab=300, seed=2)
    packed = kit.selected_path_features(
        model, docs, name=name, layer_ids=LAYER_IDS, budget=TOKEN_BUDGET, width=len(LAYER_IDS) * 64
    )
    _assert_rows_equal_each_document_alone(model, docs, packed)


def test_hf_fallback_path_is_exact_on_the_packed_layout(tiny_model) -> None:
    from dflash_async.targets.forward import HFPaddedForward

    forward = HFPaddedForward(tiny_model, LAYER_IDS, max_batch_tokens=24)  # several batches
    docs = _documents(vocab=tiny_model.config.vocab_size, seed=4)
    out = kit.run_path(forward, docs, budget=TOKEN_BUDGET, width=len(LAYER_IDS) * 128)
    _assert_rows_equal_each_document_alone(tiny_model, docs, out)
    forward.features.close()


def test_a_model_type_without_packed_forward_falls_back_to_hf_and_says_why() -> None:
    from transformers import GemmaConfig  # same layer parts as Llama, but scales its embeddings

    model = random_target(GemmaConfig(**_SMALL), seed=0)
    path = select_target_forward(model, (0, 1), token_budget=16, max_batch_tokens=16)
    assert path.name == "hf" and "gemma" in path.reason


# heads of 8 dimensions (llama2.c's stories260K: hidden 64, 8 heads) and of 64; MLA heads whose
# value dimension alone is below flex_attention's 16
_HEADS_8 = LlamaConfig(hidden_size=64, num_attention_heads=8)
_HEADS_64 = LlamaConfig(hidden_size=512, num_attention_heads=8)
_MLA = DeepseekV3Config(qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
_MLA_SMALL_V = DeepseekV3Config(qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=8)


@pytest.mark.parametrize(
    ("config", "cuda", "token_budget", "attention"),
    [
        (_HEADS_64, True, 2048, "flex"),
        (_HEADS_64, False, 2048, "sdpa"),  # flex runs on CUDA only
        (_HEADS_64, True, 2000, "sdpa"),  # T not a multiple of flex's 128-row tile
        (_HEADS_8, True, 2048, "sdpa"),  # heads below the 16 dimensions flex compiles for
        (_MLA, True, 2048, "flex"),
        (_MLA_SMALL_V, True, 2048, "sdpa"),  # MLA's own value heads, not hidden / heads (112)
    ],
    ids=["heads64-cuda", "heads64-cpu", "untiled-budget", "heads8-cuda", "mla", "mla-small-v"],
)
def test_packed_attention_takes_flex_only_where_its_kernels_take_the_pack_and_the_heads(
    config, cuda: bool, token_budget: int, attention: str
) -> None:
    assert packed_attention(config, cuda=cuda, token_budget=token_budget) == attention


def test_document_causal_mask_sees_exactly_the_earlier_rows_of_the_same_document() -> None:
    doc_ids = torch.tensor([0, 0, 1, 1, 1, -1])
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [0, 0, 1, 0, 0, 0],
            [0, 0, 1, 1, 0, 0],
            [0, 0, 1, 1, 1, 0],
            [0, 0, 0, 0, 0, 1],  # padding sees only padding: finite, and zeroed afterwards
        ],
        dtype=torch.bool,
    )
    assert torch.equal(document_causal_mask(doc_ids), expected)


def test_flex_block_mask_spells_the_same_rule_as_the_dense_mask() -> None:
    tile = 4
    lengths = [3, 6, 1, 9, 2]  # 21 real rows, documents across tile edges, 3 padding rows
    doc_ids = torch.cat(
        [torch.full((n,), j) for j, n in enumerate(lengths)] + [torch.full((3,), -1)]
    )
    mask = document_causal_block_mask(doc_ids, tile=tile)
    assert torch.equal(mask.to_dense()[0, 0].bool(), _tiles(document_causal_mask(doc_ids), tile))
    rows = torch.arange(24)
    element = mask.mask_mod(0, 0, rows[:, None], rows[None, :])  # [T, T]
    visible_tiles = (
        mask.to_dense()[0, 0].bool().repeat_interleave(tile, 0).repeat_interleave(tile, 1)
    )
    assert torch.equal(element & visible_tiles, document_causal_mask(doc_ids))


def _tiles(dense: torch.Tensor, tile: int) -> torch.Tensor:
    n = dense.shape[0] // tile
    return dense.view(n, tile, n, tile).any(3).any(1)


def test_rotary_embedding_gets_the_positions_restarting_in_every_document(tiny_model) -> None:
    """RoPE makes attention depend on q-k position differences only, so positions that do not
    restart (each document shifted by its offset) give the same features in exact arithmetic and
    differ only by angle rounding, which grows with the position (visible in bf16 at long
    contexts, not at this size). So this mutant is caught here, at the rotary's input."""
    inner = text_model(tiny_model)
    seen: list[torch.Tensor] = []
    hook = inner.rotary_emb.register_forward_hook(lambda m, args, out: seen.append(args[1]))
    try:
        forward = PackedDenseForward(inner, LAYER_IDS, attention="sdpa", compile=False)
        docs = _documents(vocab=tiny_model.config.vocab_size)
        _packed_features(forward, docs)
    finally:
        hook.remove()
    assert torch.equal(seen[0][0], layout_pack(docs, TOKEN_BUDGET).position_ids)


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True])
def test_gpu_flex_packed_rows_equal_each_document_alone(compile: bool) -> None:
    """fp32 on CUDA (no TF32: torch's default for matmuls and flex): same 1e-5 bound as the CPU.
    T = 256 (flex tiles of 128) with documents crossing tile edges."""
    model = random_target(tiny_target_config(tiny_tokenizer()), seed=3).cuda()
    forward = PackedDenseForward(text_model(model), LAYER_IDS, attention="flex", compile=compile)
    docs = kit.documents(vocab=1000, lengths=(70, 100, 3, 50), seed=5)
    out = kit.run_packed(forward, docs, budget=256, width=len(LAYER_IDS) * 128, device="cuda")
    _assert_rows_equal_each_document_alone(model, docs, out)


@pytest.mark.gpu
def test_gpu_selected_path_of_a_target_with_8_dimension_heads_runs_sdpa_and_is_exact() -> None:
    """stories260K's head shape (hidden 64, 8 heads of 8): flex_attention's kernels refuse it, so
    the selected CUDA path must take SDPA and stay exact; fp32, the 1e-5 bound of the module."""
    config = LlamaConfig(**{**_SMALL, "num_attention_heads": 8, "num_key_value_heads": 4})
    config.head_dim = 8
    model = random_target(config, seed=1).cuda()
    path = select_target_forward(model, LAYER_IDS, token_budget=256, max_batch_tokens=256)
    assert path.name == "packed_dense" and "sdpa" in path.reason, path.reason
    docs = kit.documents(vocab=300, lengths=(70, 100, 3, 50), seed=5)
    out = kit.run_path(path.forward, docs, budget=256, width=len(LAYER_IDS) * 64, device="cuda")
    _assert_rows_equal_each_document_alone(model, docs, out)


def _moe_features(model, *, routed: bool) -> torch.Tensor:
    """Features through attention_and_route (`routed`, Qwen3-MoE's default) or, with the block
    taken out of ROUTED_BLOCKS, through the HF block's own call (as any other MoE block)."""
    with pytest.MonkeyPatch.context() as patch:
        if not routed:
            patch.setattr(packed_dense, "ROUTED_BLOCKS", frozenset())
        forward = PackedDenseForward(
            text_model(model), LAYER_IDS, attention="sdpa", compile=False, moe_eager=True
        )
        assert forward._routed == routed
        return _packed_features(forward, _documents(vocab=300, seed=2))


@pytest.mark.parametrize("renormalised", [True, False])
def test_the_packed_moe_router_computes_what_the_hf_block_computes_bit_for_bit(
    renormalised: bool,
) -> None:
    """attention_and_route's router (softmax, top-k, renormalised where the config says) and the
    experts call after it: the same ops in the same order as HF's Qwen3-MoE block, so the same
    bits on the CPU, with and without norm_topk_prob."""
    config = _family("qwen3_moe")
    config.norm_topk_prob = renormalised
    model = random_target(config, seed=1)
    assert torch.equal(_moe_features(model, routed=True), _moe_features(model, routed=False))


def test_the_packed_moe_router_comparison_catches_a_router_that_never_renormalises(
    monkeypatch,
) -> None:
    from dflash_async.targets.packed import hybrid_moe as packed_hybrid_moe

    route = packed_hybrid_moe.route

    def unnormalised(gate, x):
        gate = type(
            "Gate", (), {"weight": gate.weight, "top_k": gate.top_k, "norm_topk_prob": False}
        )()
        return route(gate, x)

    config = _family("qwen3_moe")
    config.norm_topk_prob = True
    model = random_target(config, seed=1)
    want = _moe_features(model, routed=False)
    monkeypatch.setattr(packed_hybrid_moe, "route", unnormalised)
    assert not torch.allclose(_moe_features(model, routed=True), want, atol=1e-3)


def test_the_packed_moe_forward_with_compiled_experts_adds_their_residual_as_hf_does() -> None:
    """The experts swapped into CompiledExperts (the CUDA default; here its parts eager) take the
    residual stream (`moe_residual`): the features equal the HF block's within the experts'
    own difference from HF's (tests/targets/test_grouped_experts.py: rtol 1e-5 in fp32)."""
    from dflash_async.targets.grouped_experts import CompiledExperts, swap_compiled_experts

    want = _moe_features(random_target(_family("qwen3_moe"), seed=1), routed=False)
    model = random_target(_family("qwen3_moe"), seed=1)
    swap_compiled_experts(text_model(model).layers, compile=False)
    assert isinstance(text_model(model).layers[0].mlp.experts, CompiledExperts)
    torch.testing.assert_close(_moe_features(model, routed=True), want, rtol=1e-5, atol=ATOL)


def test_a_cuda_graph_is_asked_for_but_never_taken_on_the_cpu() -> None:
    """DFLASH_TARGET__CUDA_GRAPH on the CPU: the eager forward, and the reason says why."""
    model = random_target(_family("qwen3"), seed=1)
    path = select_target_forward(
        model, LAYER_IDS, token_budget=TOKEN_BUDGET, max_batch_tokens=64, cuda_graph=True
    )
    assert "not graphed (cpu, packed_dense)" in path.reason
    assert type(path.forward).__name__ == "PackedCall"


def test_the_cuda_graph_setting_reaches_the_target_spec_and_is_off_by_default() -> None:
    from dflash_async.pipeline.specs import run_spec
    from dflash_async.settings.env import load_settings

    base = {"DFLASH_ENV_FILE": "none"}
    assert run_spec(load_settings(base)).target.cuda_graph is False
    on = load_settings(base | {"DFLASH_TARGET__CUDA_GRAPH": "true"})
    assert run_spec(on).target.cuda_graph is True
