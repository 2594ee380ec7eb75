"""Mistral 4 on the packed MLA forward (targets/packed/mla.py): DeepSeek-V3's latent attention with
its queries multiplied by Llama 4's position-dependent scale (`llama4_query_scale`), and a
softmax-scored grouped router (`softmax_grouped_topk`). Every packed row equals its document run
alone through HF's Mistral4ForCausalLM; the scale is taken at the positions restarting in every
document, which are the ones HF sees for a document alone.

The scale is 1 + beta * log(1 + floor(position / original_max_position_embeddings)): a step at
every multiple of that period. The published period is 8192, so every test document here would
sit on the first step (scale 1, nothing to check); the tiny config's period is 4 (yarn's factor
128 as published, so its context stays 512), and the documents (5 to 12 tokens, packed up to
position 32) cross several steps in themselves and many more as pack positions.

Tolerance 1e-5 in fp32, as tests/targets/test_target_packed_mla.py derives it: both sides run
the same matmuls on the same rows and differ only in summation order, a few fp32 ulps of values
of order 1 (measured 3.6e-6 here). The router is discrete; a flip between two experts needs their
scores within those ulps, which with these seeds none are (a flip shows as an O(0.1) row error).
Weights are drawn with initializer_range 0.1 so that every term moves features by far more than
the tolerance; the mutants below are caught by the same check (measured distances to HF: scale
from pack positions 3.2, scale dropped 1.5, top-k weights unnormalised 2.4, sigmoid scores for
the softmax 2.3).
"""

from __future__ import annotations

from functools import partial

import packed_kit as kit
import pytest
import torch
from transformers import (
    AutoModelForImageTextToText,
    Mistral3Config,
    Mistral4Config,
    PretrainedConfig,
)

from dflash_async.targets.families import FAMILIES, planned_path
from dflash_async.targets.forward import select_target_forward
from dflash_async.targets.loading import load_target, random_target, text_model
from dflash_async.targets.packed import mla as packed_mla

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

ATOL = 1e-5  # see the module docstring
LENGTHS = (7, 12, 5, 9)  # four documents, the first not the longest
TOKEN_BUDGET = 40  # 33 real rows + 7 padding rows
LAYER_IDS = (0, 2, 4)  # a dense layer (first_k_dense_replace=1) and two MoE layers
VOCAB = 300
WIDTH = len(LAYER_IDS) * 64  # the features' width: hidden 64 per listed layer
PERIOD = 4  # original_max_position_embeddings: the scale's step (see the module docstring)


def _config(**over) -> PretrainedConfig:
    """A tiny Mistral 4: q/k 24 wide (16 nope + 8 rope), v 16 wide, low-rank q and kv, 8 experts
    in 4 groups; yarn RoPE and the Llama 4 scale's beta as published, its period 4."""
    rope = dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=128.0,
        original_max_position_embeddings=PERIOD,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
        llama_4_scaling_beta=0.1,
    )
    shape = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
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
        max_position_embeddings=PERIOD * 128,
        rope_parameters=rope,
    )
    return Mistral4Config(**(shape | over))


@pytest.fixture(scope="module")
def model():
    """A random tiny Mistral4ForCausalLM, fp32 on the CPU."""
    return random_target(_config(), seed=1)


_documents = partial(kit.documents, vocab=VOCAB, lengths=LENGTHS)
_packed = partial(kit.run_packed, budget=TOKEN_BUDGET, width=WIDTH)
_distance_to_hf = partial(kit.distance_to_hf, layer_ids=LAYER_IDS)


def _forward(model, module=packed_mla, attention: str = "sdpa", compile: bool = False, **over):
    """The family's packed forward (its entry's block, router and scale, as `module` names
    them, so that a mutant module runs its own), `over` replacing any of them."""
    path = FAMILIES["mistral4"].forward
    pieces = dict(
        attention_block=getattr(module, path.attention_block.__name__),
        router=getattr(module, path.router.__name__),
        query_scale=getattr(module, path.query_scale.__name__),
    )
    return module.PackedMLAForward(
        text_model(model),
        LAYER_IDS,
        attention=attention,
        compile=compile,
        **(pieces | over),
    )


def test_the_scale_steps_at_every_period_and_is_one_before_the_first() -> None:
    scale = packed_mla.llama4_query_scale(_config(), torch.arange(13))[0, 0, :, 0]
    steps = 1 + 0.1 * torch.log(1 + torch.tensor([0.0] * 4 + [1.0] * 4 + [2.0] * 4 + [3.0]))
    assert scale.shape == (13,) and torch.equal(scale, steps) and scale[0] == 1


def test_mistral4_plans_and_selects_the_packed_mla_path_with_its_router_and_scale(model) -> None:
    family = FAMILIES["mistral4"]
    assert family.forward.router is packed_mla.softmax_grouped_topk
    assert family.forward.query_scale is packed_mla.llama4_query_scale
    assert "packed MLA" in planned_path("mistral4")
    path = select_target_forward(model, LAYER_IDS, token_budget=TOKEN_BUDGET, max_batch_tokens=64)
    assert path.name == "packed_mla" and path.reason.startswith("mistral4:"), path.reason


def test_every_packed_row_of_a_mistral4_target_equals_its_document_alone_through_hf(model) -> None:
    path = select_target_forward(model, LAYER_IDS, token_budget=TOKEN_BUDGET, max_batch_tokens=64)
    docs = _documents()
    out = kit.run_path(path.forward, docs, budget=TOKEN_BUDGET, width=WIDTH)
    assert _distance_to_hf(model, docs, out) < ATOL


def test_two_chained_stages_write_the_same_features_as_the_whole_forward(model) -> None:
    """A split target (targets/split.py): layers [0, 3) then [3, 5); each stage takes the scale
    from the positions itself."""
    docs = _documents()
    splits = (range(0, 3), range(3, 5))
    out = kit.staged_features(
        model, docs, splits=splits, layer_ids=LAYER_IDS, budget=TOKEN_BUDGET, width=WIDTH
    )
    assert torch.equal(out, _packed(_forward(model), docs))


def test_flex_attention_path_writes_the_sdpa_features_on_the_cpu(model) -> None:
    """The GPU path's attention (flex over tiles of 128) run eagerly on the CPU, T = 256 with
    documents across tile edges; same 1e-5 bound (summation order only)."""
    docs = _documents(seed=5, lengths=(70, 100, 3, 50))
    kit.assert_flex_writes_the_sdpa_features(
        lambda attention: _forward(model, attention=attention), docs, width=WIDTH, atol=ATOL
    )


def test_a_mistral3_wrapper_loads_its_mistral4_language_model_alone_and_packs_exactly(
    tmp_path,
) -> None:
    """Mistral Small 4 as released: a Mistral 3 wrapper (vision tower, projector) whose text
    config is mistral4. Loading takes Mistral4ForCausalLM alone (the tower's tensors unread),
    and its packed rows equal each document alone through the HF wrapper."""
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        head_dim=16,
        image_size=28,
        patch_size=14,
    )
    config = Mistral3Config(
        text_config=_config().to_dict(), vision_config=vision, tie_word_embeddings=False
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        wrapper = AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    wrapper.save_pretrained(tmp_path)
    model = load_target(tmp_path, device="cpu")
    assert type(model).__name__ == "Mistral4ForCausalLM"
    path = select_target_forward(model, LAYER_IDS, token_budget=TOKEN_BUDGET, max_batch_tokens=64)
    assert path.name == "packed_mla" and path.reason.startswith("mistral4:"), path.reason
    docs = _documents(seed=2)
    assert _distance_to_hf(wrapper, docs, _packed(path.forward.packed, docs)) < ATOL


def _pack_positions(config, positions: torch.Tensor) -> torch.Tensor:
    """Mutant scale: at each row's position in the pack, not in its document."""
    return packed_mla.llama4_query_scale(config, torch.arange(positions.shape[0]))


def _mutant(old: str, new: str):
    """packed_mla with the one occurrence of `old` in its source replaced by `new`."""
    return kit.mutant_module(packed_mla, (old, new))


MUTANTS = {
    "scale_from_pack_positions": lambda m: _forward(m, query_scale=_pack_positions),
    "scale_dropped": lambda m: _forward(m, query_scale=None),
    "topk_weights_not_normalised": lambda m: _forward(
        m, _mutant("weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)", "pass")
    ),
    "sigmoid_scores_for_the_softmax": lambda m: _forward(
        m,
        _mutant(
            "scores = F.linear(x, gate.weight).softmax(-1)",
            "scores = F.linear(x, gate.weight).sigmoid()",
        ),
    ),
}


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_the_parity_check_catches_a_mutant_forward(model, mutant: str) -> None:
    docs = _documents()
    assert _distance_to_hf(model, docs, _packed(_forward(model), docs)) < ATOL
    assert _distance_to_hf(model, docs, _packed(MUTANTS[mutant](model), docs)) > 100 * ATOL


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True])
def test_gpu_flex_packed_mistral4_rows_equal_each_document_alone(compile: bool) -> None:
    """fp32 on CUDA (no TF32), the path a run selects (flex over T = 256, tiles of 128, with
    documents across tile edges; the experts as CompiledExperts), the scale a per-pack input
    of the compiled attention block. Same 1e-5 bound."""
    model = random_target(_config(), seed=1).cuda()
    path = select_target_forward(
        model, LAYER_IDS, token_budget=256, max_batch_tokens=256, compile=compile
    )
    assert path.name == "packed_mla" and "flex" in path.reason, path.reason
    docs = _documents(seed=5, lengths=(70, 100, 3, 50))
    out = kit.run_path(path.forward, docs, budget=256, width=WIDTH, device="cuda")
    assert _distance_to_hf(model, docs, out) < ATOL
