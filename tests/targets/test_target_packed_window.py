"""The packed gpt-oss forward (sliding windows, attention sinks, its MoE) equals each document run
alone through HF, row for row; and the parity test catches a window off by one, missing sinks
and the router's top-k normalisation changed. The same for MiniMax-M2 (target/packed_moe_window).

Tolerance 1e-5 in fp32: both sides run the same projections on the same rows and differ only in
summation order (masked keys add exact zeros; the sink enters as sigmoid(lse - s) here and as an
extra softmax column in HF: the same quotient Z/(Z+e^s), rounded differently), i.e. a few fp32
ulps of the features, whose magnitude here is below 0.14 (ulp <= 1.5e-8): measured 1.5e-8 to
3e-8 (sdpa and flex, both families). 1e-5 leaves a 300x margin over that and sits 400x below the
smallest mutant's deviation (measured: gpt-oss router 1.7e-2, window 2.3e-2, sinks 5.3e-2;
MiniMax-M2 renormalisation 4.1e-3, correction bias 5.5e-3), asserted above `_MUTANT_GAP`.

MiniMax-M2 (its own q/k norms, partial RoPE and sigmoid router; no windows, no sinks) is held to
the same parity and its router mutants to the same gap.
"""

from __future__ import annotations

import copy
import dataclasses
from functools import partial

import packed_kit as kit
import pytest
import torch
from arch_targets import SLIDING_WINDOW, tiny_config

from dflash_async.data.packing import layout_pack
from dflash_async.targets.families import family_of, planned_path
from dflash_async.targets.forward import select_target_forward
from dflash_async.targets.loading import random_target, text_model
from dflash_async.targets.packed import moe_window as pmw
from dflash_async.targets.packed.dense import KeySpans, first_visible_key
from dflash_async.targets.packed.window import window_causal_mask

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

ATOL = 1e-5  # see the module docstring
_MUTANT_GAP = 1e-3  # a mutant's largest deviation must exceed this (100x ATOL)
LENGTHS = (7, 12, 5, 9)  # three documents longer than the window (6), one shorter
TOKEN_BUDGET = 40  # 33 real rows + 7 padding rows
LAYER_IDS = (0, 1)  # layer 0 sliding, layer 1 full attention


@pytest.fixture(scope="module")
def model():
    config = tiny_config("gpt_oss")
    assert config.sliding_window == SLIDING_WINDOW < max(LENGTHS)
    assert list(config.layer_types) == ["sliding_attention", "full_attention"]
    return random_target(config, seed=1)


_docs = partial(kit.documents, lengths=LENGTHS)
_alone = partial(kit.alone_features, layer_ids=LAYER_IDS)


def _packed(forward, docs, token_budget: int = TOKEN_BUDGET) -> torch.Tensor:
    width = len(LAYER_IDS) * forward.hidden_size
    return kit.run_packed(forward, docs, budget=token_budget, width=width)


def _family(model) -> pmw.MoeWindowLayers:
    """The family's qkv and router (targets/families.py), looked up in pmw by name, so that a
    mutant patched into pmw is the one that runs."""
    layers = family_of(text_model(model).config).forward.layers
    return dataclasses.replace(
        layers, qkv=getattr(pmw, layers.qkv.__name__), route=getattr(pmw, layers.route.__name__)
    )


def _forward(model, attention: str = "sdpa", layers: range | None = None):
    return pmw.PackedWindowMoeForward(
        text_model(model),
        LAYER_IDS,
        family=_family(model),
        attention=attention,
        compile=False,
        layers=layers,
    )


def test_every_packed_gpt_oss_row_equals_its_document_run_alone_through_hf(model) -> None:
    docs = _docs(vocab=model.config.vocab_size)
    assert kit.max_deviation(_packed(_forward(model), docs), _alone(model, docs)) < ATOL


def test_flex_path_with_its_window_mask_mod_and_lse_sinks_is_exact_too(model) -> None:
    """flex_attention runs eagerly on the CPU (slow, exact): the GPU path's block mask,
    mask_mod and LSE sinks, at T = 128 (one flex tile)."""
    docs = _docs(vocab=model.config.vocab_size, seed=3)
    packed = _packed(_forward(model, "flex"), docs, token_budget=128)
    assert kit.max_deviation(packed, _alone(model, docs)) < ATOL


def _window_off_by_one(doc_ids, window, rows, last_key=None):
    """The CPU path's spans with q - k <= window (one key too many at the window's edge)."""
    return KeySpans(first_visible_key(doc_ids, None if window is None else window + 1), rows)


def _route_softmax_before_topk(moe, x):
    router = moe.router
    probs = torch.softmax(torch.nn.functional.linear(x, router.weight, router.bias), dim=-1)
    weights, experts = torch.topk(probs, router.top_k, dim=-1)
    return experts, weights


MUTANTS = {
    "window_off_by_one": ("window_spans", _window_off_by_one),
    "sinks_missing": ("with_sinks", lambda out, lse, sinks: out),
    "router_softmax_over_all_experts_before_topk": ("gpt_oss_route", _route_softmax_before_topk),
}


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_parity_check_catches_the_mutant(model, monkeypatch, mutant: str) -> None:
    name, replacement = MUTANTS[mutant]
    monkeypatch.setattr(pmw, name, replacement)
    docs = _docs(vocab=model.config.vocab_size)
    assert kit.max_deviation(_packed(_forward(model), docs), _alone(model, docs)) > _MUTANT_GAP


def test_flex_window_mask_mod_spells_the_dense_window_rule() -> None:
    tile, window = 4, 3
    lengths = [3, 6, 1, 9, 2]  # 21 real rows, documents across tile edges, 3 padding rows
    doc_ids = torch.cat(
        [torch.full((n,), j) for j, n in enumerate(lengths)] + [torch.full((3,), -1)]
    )
    dense = window_causal_mask(doc_ids, window)
    mask = pmw.window_block_mask(doc_ids, window, tile=tile)
    tiles = mask.to_dense()[0, 0].bool()
    n = 24 // tile
    assert torch.equal(tiles, dense.view(n, tile, n, tile).any(3).any(1))
    rows = torch.arange(24)
    element = mask.mask_mod(0, 0, rows[:, None], rows[None, :])  # [T, T] on index tensors
    visible = tiles.repeat_interleave(tile, 0).repeat_interleave(tile, 1)
    assert torch.equal(element & visible, dense)
    assert not dense[14, 11] and dense[14, 12]  # q - k = 3 is out of a window of 3, 2 is in


def test_two_stages_of_a_split_gpt_oss_write_what_the_whole_forward_writes(model) -> None:
    docs = _docs(vocab=model.config.vocab_size)
    whole = _packed(_forward(model), docs)
    layout = layout_pack(docs, TOKEN_BUDGET)
    args = (layout.input_ids, layout.position_ids, layout.doc_ids)
    out = torch.full_like(whole, float("nan"))
    hidden = None
    for layers in (range(0, 1), range(1, 2)):
        stage = _forward(model, layers=layers)
        hidden = stage.stage(hidden, *args, out)
    assert torch.equal(out, whole)


def test_selected_cpu_path_of_gpt_oss_is_packed_and_exact(model) -> None:
    path = select_target_forward(model, LAYER_IDS, token_budget=TOKEN_BUDGET, max_batch_tokens=64)
    assert path.name == "packed_moe_window" and path.stage is not None, path.reason
    assert planned_path("gpt_oss").startswith("packed MoE with sliding windows")
    docs = _docs(vocab=model.config.vocab_size, seed=2)
    out = kit.run_path(path.forward, docs, budget=TOKEN_BUDGET, width=len(LAYER_IDS) * 64)
    assert kit.max_deviation(out, _alone(model, docs)) < ATOL


# MiniMax-M2: no windows, no sinks; its own q/k norms, partial RoPE and sigmoid router.


@pytest.fixture(scope="module")
def minimax():
    """The tiny MiniMax-M2 with partial RoPE (8 of 16 dims), router logits of order 1 (at init
    they are ~0.02, so every sigmoid score is ~0.5 and renormalising two of them changes little)
    and a nonzero correction bias (zero at init, hiding whether the choice adds it)."""
    config = tiny_config("minimax_m2")
    config.rope_parameters["partial_rotary_factor"] = 0.5
    model = random_target(config, seed=4)
    generator = torch.Generator().manual_seed(0)
    for layer in text_model(model).layers:
        layer.mlp.gate.weight.mul_(30)
        bias = layer.mlp.e_score_correction_bias
        bias.copy_(torch.randn(bias.shape, generator=generator) * 0.2)
    assert text_model(model).rotary_emb.inv_freq.numel() == 4  # r = 8 rotary dims of 16
    return model


def test_every_packed_minimax_m2_row_equals_its_document_run_alone_through_hf(minimax) -> None:
    docs = _docs(vocab=minimax.config.vocab_size, seed=5)
    assert kit.max_deviation(_packed(_forward(minimax), docs), _alone(minimax, docs)) < ATOL


def test_flex_path_of_minimax_m2_is_exact_too(minimax) -> None:
    docs = _docs(vocab=minimax.config.vocab_size, seed=6)
    packed = _packed(_forward(minimax, "flex"), docs, token_budget=128)
    assert kit.max_deviation(packed, _alone(minimax, docs)) < ATOL


def _minimax_choice_without_bias(moe, x):
    scores = torch.sigmoid(torch.nn.functional.linear(x, moe.gate.weight).float())
    _, experts = torch.topk(scores, moe.gate.top_k, dim=-1)
    weights = scores.gather(1, experts)
    return experts, weights / weights.sum(dim=-1, keepdim=True)


def _minimax_weights_not_renormalised(moe, x):
    scores = torch.sigmoid(torch.nn.functional.linear(x, moe.gate.weight).float())
    _, experts = torch.topk(scores + moe.e_score_correction_bias, moe.gate.top_k, dim=-1)
    return experts, scores.gather(1, experts)


MINIMAX_MUTANTS = {
    "router_choice_without_correction_bias": _minimax_choice_without_bias,
    "router_weights_not_renormalised": _minimax_weights_not_renormalised,
}


@pytest.mark.parametrize("mutant", sorted(MINIMAX_MUTANTS))
def test_parity_check_catches_the_minimax_router_mutant(minimax, monkeypatch, mutant) -> None:
    monkeypatch.setattr(pmw, "minimax_route", MINIMAX_MUTANTS[mutant])
    docs = _docs(vocab=minimax.config.vocab_size, seed=5)
    assert kit.max_deviation(_packed(_forward(minimax), docs), _alone(minimax, docs)) > _MUTANT_GAP


def test_selected_cpu_path_of_minimax_m2_is_packed_and_exact(minimax) -> None:
    path = select_target_forward(minimax, LAYER_IDS, token_budget=TOKEN_BUDGET, max_batch_tokens=64)
    assert path.name == "packed_moe_window" and path.stage is not None, path.reason
    docs = _docs(vocab=minimax.config.vocab_size, seed=7)
    out = kit.run_path(path.forward, docs, budget=TOKEN_BUDGET, width=len(LAYER_IDS) * 64)
    assert kit.max_deviation(out, _alone(minimax, docs)) < ATOL


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("kind", ["gpt_oss", "minimax_m2"])
def test_gpu_flex_packed_rows_equal_each_document_alone(request, kind: str, compile: bool) -> None:
    """fp32 on CUDA (no TF32), flex tiles of 128 at T = 256, documents across tile edges and
    longer than the window: the same 1e-5 bound as on the CPU."""
    model = copy.deepcopy(request.getfixturevalue("model" if kind == "gpt_oss" else "minimax"))
    model = model.cuda()  # a copy: the module-scoped fixture stays on the CPU
    forward = pmw.PackedWindowMoeForward(
        text_model(model), LAYER_IDS, family=_family(model), attention="flex", compile=compile
    )
    docs = kit.documents(vocab=300, lengths=(70, 100, 3, 50), seed=8)
    out = kit.run_packed(forward, docs, budget=256, width=len(LAYER_IDS) * 64, device="cuda")
    assert kit.max_deviation(out, _alone(model, docs)) < ATOL
