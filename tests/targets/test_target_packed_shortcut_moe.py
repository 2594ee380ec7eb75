"""The packed shortcut-MoE forward (targets/packed/shortcut_moe.py, LongCat-Flash) equals each
document run alone through HF, row for row, at the listed layers' outputs (the generic path's
taps), with the padding rows zero.

Tolerance 1e-5 in fp32, as tests/targets/test_target_packed.py derives it: both sides run the same
matmuls on the same rows and differ only in summation order (masked keys add exact zeros; the
zero experts' stand-in rows add exact zeros), a few fp32 ulps of the features, which reach ~10
here (ulp 9.5e-7 at 8): measured below 4.6e-6 over the variants. The router is discrete, but a
flip between two experts needs their choice scores within those ulps: the check asserts that
with these seeds every token's k-th and (k+1)-th choices of every layer are at least
ROUTER_MARGIN apart in the HF run (no near-ties; a flip would show as an O(0.1) row error, never
as a silent pass). The weights are drawn with initializer_range 0.1 (not HF's 0.02) and the
score-correction bias at random, so the zero experts, the shortcut MoE's input, each sublayer
and the bias's role each move features by far more than the tolerance: the mutant tests below
check that (measured on document 0: zero experts dropped 2.8, the shortcut MoE reading the second
sublayer's norm 2.2 or the unnormed hidden 3.1, the second sublayer skipped 7.9, the bias in the
weights 1.6). Positions counted over the pack are the one wrong forward no parity check can see
(RoPE is relative): a test checks the rotary's input instead.
"""

from __future__ import annotations

from functools import partial

import packed_kit as kit
import pytest
import torch
import torch.nn.functional as F
import transformers

from dflash_async.data.packing import layout_pack
from dflash_async.targets.families import planned_path
from dflash_async.targets.forward import select_target_forward
from dflash_async.targets.grouped_experts import swap_compiled_experts
from dflash_async.targets.loading import random_target, text_model
from dflash_async.targets.packed import shortcut_moe as packed_shortcut_moe

LongcatFlashConfig = getattr(transformers, "LongcatFlashConfig", None)  # not in older versions
# transformers 5.17 keeps the zero experts inside the experts module: the packed path refuses
# that layout (the generic path runs it), so there is nothing here to compare
_MODELING = getattr(transformers.models, "longcat_flash", None)
_OLD_LAYOUT = LongcatFlashConfig is not None and "num_routed_experts" not in (
    _MODELING.modeling_longcat_flash.LongcatFlashMoE.__init__.__code__.co_names
)
pytestmark = [
    pytest.mark.usefixtures("one_intra_op_thread"),
    pytest.mark.skipif(LongcatFlashConfig is None, reason="transformers has no LongcatFlashConfig"),
    pytest.mark.skipif(
        _OLD_LAYOUT, reason=f"transformers {transformers.__version__}'s LongCat-Flash MoE layout"
    ),
]

ATOL = 1e-5  # see the module docstring
# The smallest gap allowed between a token's k-th and (k+1)-th choice scores in the HF run. The
# router reads the normed input (order 1), off by <= ~5e-7 where the features (order 10) are off
# by <= 5e-6; its 64-term logits with weights ~0.1 move by <= ~3e-6, the softmax scores (< 1) by
# less: 1e-5 leaves a factor 3 or more. Measured minimum gaps with the seeds used: 1.1e-4
# (longcat_flash), 7.9e-4 (yarn), 1.6e-4 (no zero experts), 6.1e-4 (selected path), 5.3e-5 (the
# T = 256 documents of the flex tests).
ROUTER_MARGIN = 1e-5
LENGTHS = (7, 12, 5, 9)  # four documents, the first not the longest
TOKEN_BUDGET = 40  # 33 real rows + 7 padding rows
LAYER_IDS = (0, 2)  # listed layers (num_hidden_layers counts 6 sublayers)
D = 64
VOCAB = 300
WIDTH = len(LAYER_IDS) * D  # the features' width


def _config(**over):
    """A tiny LongCat-Flash: 3 layers of 2 MLA sublayers (q/k 24 = 16 nope + 8 rope, v 16),
    8 routed + 4 zero experts, top 3."""
    shape = dict(
        vocab_size=VOCAB,
        hidden_size=D,
        num_layers=3,
        num_attention_heads=4,
        ffn_hidden_size=128,
        expert_ffn_hidden_size=32,
        n_routed_experts=8,
        zero_expert_num=4,
        moe_topk=3,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        head_dim=8,  # the rotary's width: the rope dims, as in the published config
        v_head_dim=16,
        routed_scaling_factor=2.0,
        initializer_range=0.1,
        max_position_embeddings=512,
    )
    return LongcatFlashConfig(**(shape | over))


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
    "longcat_flash": lambda: _config(),
    "longcat_flash_yarn": lambda: _config(rope_parameters=_YARN),  # mscale in the scale
    "no_zero_experts": lambda: _config(zero_expert_num=0),
}


def _model(config, seed: int = 1):
    """A random target whose routers' score-correction biases are random too (HF zeroes them)."""
    model = random_target(config, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    for layer in text_model(model).layers:
        bias = layer.mlp.router.e_score_correction_bias
        bias.copy_(0.05 * torch.randn(bias.shape, generator=generator))
    return model


_documents = partial(kit.documents, vocab=VOCAB, lengths=LENGTHS)
_packed = partial(kit.run_packed, budget=TOKEN_BUDGET, width=WIDTH)


def _router_margins(model, ids: torch.Tensor) -> float:
    """The smallest gap between a token's k-th and (k+1)-th choice scores, over every router of
    `model` run on `ids` [1, n] through HF."""
    gaps = []

    def keep(router, args):
        x = args[0].reshape(-1, args[0].shape[-1])
        scores = F.linear(x.float(), router.classifier.weight.float()).softmax(-1)
        top = (scores + router.e_score_correction_bias).topk(router.top_k + 1, dim=-1)[0]
        gaps.append(float((top[:, -2] - top[:, -1]).min()))

    routers = [layer.mlp.router for layer in text_model(model).layers]
    handles = [r.register_forward_pre_hook(keep) for r in routers]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in handles:
            h.remove()
    return min(gaps)


def _assert_rows_equal_each_document_alone(model, docs, packed: torch.Tensor) -> None:
    """No router near-tie in any document alone (ROUTER_MARGIN), and every packed row equal to
    its document's."""
    for j, (ids, _) in enumerate(docs):
        ids = torch.as_tensor(ids, device=packed.device)[None]
        assert _router_margins(model, ids) > ROUTER_MARGIN, f"a router near-tie in document {j}"
    kit.assert_rows_equal_each_document_alone(model, docs, packed, layer_ids=LAYER_IDS, atol=ATOL)


def _forward(model, module=packed_shortcut_moe, attention: str = "sdpa", compile: bool = False):
    return module.PackedShortcutMoeForward(
        text_model(model), LAYER_IDS, attention=attention, compile=compile
    )


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_packed_row_equals_its_document_run_alone_through_hf(variant: str) -> None:
    model, docs = _model(VARIANTS[variant]()), _documents()
    _assert_rows_equal_each_document_alone(model, docs, _packed(_forward(model), docs))


def test_selected_cpu_path_is_the_packed_shortcut_moe_and_exact() -> None:
    model, docs = _model(_config(), seed=2), _documents(seed=2)
    name = "packed_shortcut_moe"
    packed = kit.selected_path_features(
        model, docs, name=name, layer_ids=LAYER_IDS, budget=TOKEN_BUDGET, width=WIDTH
    )
    assert "packed" in planned_path("longcat_flash")
    _assert_rows_equal_each_document_alone(model, docs, packed)


def test_two_chained_stages_write_the_same_features_as_the_whole_forward() -> None:
    """A split target (targets/split.py): layers [0, 2) then [2, 3), hidden handed over."""
    model, docs = _model(_config()), _documents()
    splits = (range(0, 2), range(2, 3))
    out = kit.staged_features(
        model, docs, splits=splits, layer_ids=LAYER_IDS, budget=TOKEN_BUDGET, width=WIDTH
    )
    assert torch.equal(out, _packed(_forward(model), docs))


def test_flex_attention_path_writes_the_sdpa_features_on_the_cpu() -> None:
    """The GPU path's attention (flex, its BlockMask over tiles of 128) run eagerly on the CPU:
    flex takes MLA's value dim (16) narrower than q/k's (24). T = 256 with documents across tile
    edges; same 1e-5 bound (summation order only)."""
    model = _model(_config())
    docs = _documents(seed=5, lengths=(70, 100, 3, 50))
    kit.assert_flex_writes_the_sdpa_features(
        lambda attention: _forward(model, attention=attention), docs, width=WIDTH, atol=ATOL
    )


def test_compiled_experts_run_the_zero_experts_stand_in_rows_exactly() -> None:
    """The experts the packed paths swap in on CUDA (grouped_experts.CompiledExperts, here
    eagerly on the CPU) take the zero experts' stand-in rows of weight 0 as HF's module does."""
    model, docs = _model(_config()), _documents()
    swapped = _model(_config())
    assert swap_compiled_experts(text_model(swapped).layers, compile=False)["swapped"] == 3
    packed = _packed(_forward(swapped), docs)
    _assert_rows_equal_each_document_alone(model, docs, packed)


def _mutant(*edits: tuple[str, str]):
    """packed_shortcut_moe with the one occurrence of each `old` in its source replaced."""
    return kit.mutant_module(packed_shortcut_moe, *edits)


_SECOND_ATTENTION = (
    "    hidden = attention(layer.self_attn[1], layer.input_layernorm[1], hidden, cos, sin, "
    "mask, attend)\n"
)
_LAST = "return hidden + layer.mlps[1](layer.post_attention_layernorm[1](hidden)) + shortcut"
MUTANTS = {
    "zero_experts_dropped": (
        ("return (routed + (flat * identity).to(routed.dtype)).view_as(x)", "return routed"),
    ),
    "shortcut_reads_the_second_sublayer": (
        (
            _LAST,
            "return hidden + layer.mlps[1](layer.post_attention_layernorm[1](hidden)) + "
            "shortcut_moe(layer.mlp, layer.post_attention_layernorm[1](hidden))",
        ),
    ),
    "shortcut_reads_the_unnormed_hidden": (
        ("shortcut = shortcut_moe(layer.mlp, x)", "shortcut = shortcut_moe(layer.mlp, hidden)"),
    ),
    "second_sublayer_skipped": (
        (_SECOND_ATTENTION, ""),
        (_LAST, "return hidden + shortcut"),
    ),
    "score_bias_in_the_weights": (
        (
            "return scores.gather(1, experts) * router.routed_scaling_factor, experts",
            "return choice.gather(1, experts) * router.routed_scaling_factor, experts",
        ),
    ),
}


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_the_parity_check_catches_a_mutant_forward(mutant: str) -> None:
    model, docs = _model(_config()), _documents()
    broken = _forward(model, _mutant(*MUTANTS[mutant]))
    with pytest.raises(AssertionError, match="document 0"):
        _assert_rows_equal_each_document_alone(model, docs, _packed(broken, docs))


def _rotary_positions(forward, model, docs) -> torch.Tensor:
    """The positions `forward` hands the model's rotary on the pack of `docs`."""
    seen = []
    rotary = text_model(model).rotary_emb
    handle = rotary.register_forward_pre_hook(lambda module, args: seen.append(args[1].clone()))
    try:
        _packed(forward, docs)
    finally:
        handle.remove()
    return seen[0]


def test_the_rotary_turns_each_row_by_its_document_position_not_its_pack_position() -> None:
    """RoPE is relative and no attention crosses a document, so positions counted over the pack
    (each document shifted by its offset) give the features of document positions up to
    rounding (measured: 5.7e-6 for a document after a 4000-token one, within ATOL): no parity
    check can tell them apart. This checks the rotary's input itself, and catches a forward
    that counts positions over the pack."""
    model, docs = _model(_config()), _documents()
    want = layout_pack(docs, TOKEN_BUDGET).position_ids[None]
    assert torch.equal(_rotary_positions(_forward(model), model, docs), want)

    class PackPositions(packed_shortcut_moe.PackedShortcutMoeForward):
        def rope_positions(self, position_ids):
            return torch.arange(position_ids.shape[0])[None]

    broken = PackPositions(text_model(model), LAYER_IDS, attention="sdpa", compile=False)
    assert not torch.equal(_rotary_positions(broken, model, docs), want)


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True])
def test_gpu_flex_packed_rows_equal_each_document_alone(compile: bool) -> None:
    """fp32 on CUDA (no TF32), flex over T = 256 (tiles of 128) with documents across tile edges;
    q/k (24) and v (16) head dims differ. Same 1e-5 bound as the CPU."""
    model = _model(_config()).cuda()
    docs = _documents(seed=5, lengths=(70, 100, 3, 50))
    forward = _forward(model, attention="flex", compile=compile)
    out = kit.run_packed(forward, docs, budget=256, width=WIDTH, device="cuda")
    _assert_rows_equal_each_document_alone(model, docs, out)


@pytest.mark.gpu
def test_gpu_selected_path_rows_equal_each_document_alone() -> None:
    """What a CUDA run takes: select_target_forward's flex path, compiled, its experts swapped
    into CompiledExperts (in place: the reference is a second model of the same seed)."""
    model, reference = _model(_config()).cuda(), _model(_config()).cuda()
    docs = _documents(seed=5, lengths=(70, 100, 3, 50))
    path = select_target_forward(model, LAYER_IDS, token_budget=256, max_batch_tokens=256)
    assert path.name == "packed_shortcut_moe" and "CompiledExperts" in path.reason, path.reason
    out = kit.run_path(path.forward, docs, budget=256, width=WIDTH, device="cuda")
    _assert_rows_equal_each_document_alone(reference, docs, out)
