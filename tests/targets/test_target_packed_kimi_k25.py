"""Kimi K2.5 (Kimi_K25ForConditionalGeneration: a vision tower and projector around a DeepSeek-V3
language model, its text config model_type `deepseek_v3`) on text packs: the family is
DeepSeek-V3's wrapped (targets/families.py), so a Kimi K2.5 target trains on its language model
alone through the packed MLA forward, and every packed row equals its document run alone through
the HF wrapper's language model.

Loading (targets/loading.py) takes the language model alone: DeepseekV3ForCausalLM, the class
transformers has for the text config, reads the wrapper checkpoint's `language_model.model.*`
tensors renamed (WRAPPER_KEYS) and never the tower's. A checkpoint transformers saves names the
layers `language_model.model.blocks.*` (see WRAPPER_KEYS), so the check that the loaded model is
the wrapper's language model is a real one: without that rule, the layers load as fresh random
weights (transformers only warns) and the features are another model's, which the comparison
catches.

Tolerance 1e-5 in fp32, as tests/targets/test_target_packed_mla.py derives it for this path
(summation order only; measured 2.0e-6 loaded, 4.3e-6 on the wrapper itself). Weights drawn
with initializer_range 0.1 and the routers' score-correction biases at random, as there; the
mutant moves features by 5.5.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import packed_kit as kit
import pytest
import torch
from transformers import AutoModelForImageTextToText, DeepseekV3ForCausalLM, Kimi_K25Config

from dflash_async.targets import loading
from dflash_async.targets.families import FAMILIES
from dflash_async.targets.forward import select_target_forward
from dflash_async.targets.loading import load_target, text_model

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

ATOL = 1e-5  # see the module docstring
LENGTHS = (7, 12, 5, 9)  # four documents, the first not the longest
TOKEN_BUDGET = 40  # 33 real rows + 7 padding rows
LAYER_IDS = (0, 2, 4)  # a dense layer (first_k_dense_replace=1) and two MoE layers
VOCAB = 300
WIDTH = len(LAYER_IDS) * 64  # the features' width: hidden 64 per listed layer


def _config() -> Kimi_K25Config:
    """A tiny Kimi K2.5: test_target_packed_mla.py's DeepSeek-V3 language model (MLA with
    interleaved RoPE, 8 experts in 4 groups) and a one-block vision tower (never run)."""
    text = dict(
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
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    vision = dict(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        pos_emb_height=4,
        pos_emb_width=4,
    )
    return Kimi_K25Config(
        text_config=text,
        vision_config=vision,
        projection_hidden_size=32,  # the projector's norm is over the tower's width
        tie_word_embeddings=False,
    )


def _wrapper():
    """A random tiny Kimi K2.5 wrapper, fp32 on the CPU, its routers' biases random too."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = AutoModelForImageTextToText.from_config(_config(), dtype=torch.float32)
        for layer in text_model(model).layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                bias = gate.e_score_correction_bias
                bias.copy_(0.2 * torch.randn(bias.shape))
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def wrapper():
    return _wrapper()


@pytest.fixture(scope="module")
def folder(wrapper, tmp_path_factory) -> Path:
    """The wrapper saved as transformers saves it (vision tower included)."""
    path = tmp_path_factory.mktemp("kimi_k25")
    wrapper.save_pretrained(path)
    return path


_documents = partial(kit.documents, vocab=VOCAB, lengths=LENGTHS)
_distance_to_hf = partial(kit.distance_to_hf, layer_ids=LAYER_IDS)


def _run(model, docs, budget: int = TOKEN_BUDGET, device: str = "cpu") -> torch.Tensor:
    """The packed features select_target_forward's path writes for `docs` (asserted packed_mla,
    chosen by the language model's config)."""
    path = select_target_forward(model, LAYER_IDS, token_budget=budget, max_batch_tokens=budget)
    assert path.name == "packed_mla" and path.reason.startswith("deepseek_v3:"), path.reason
    return kit.run_path(path.forward, docs, budget=budget, width=WIDTH, device=device)


def test_kimi_k25_is_the_deepseek_v3_family_wrapped() -> None:
    kimi, deepseek = FAMILIES["kimi_k25"], FAMILIES["deepseek_v3"]
    assert kimi.language_model == "deepseek_v3" and _config().text_config.model_type == (
        "deepseek_v3"
    )
    assert (kimi.forward, kimi.planned, kimi.reader) == (
        deepseek.forward,
        deepseek.planned,
        deepseek.reader,
    )


def test_loading_takes_the_wrappers_language_model_alone(wrapper, folder) -> None:
    model = load_target(folder, device="cpu")
    assert type(model) is DeepseekV3ForCausalLM
    assert not any("vision" in name or "mm_projector" in name for name, _ in model.named_modules())
    want = text_model(wrapper).state_dict()
    got = text_model(model).state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert torch.equal(model.lm_head.weight, wrapper.lm_head.weight)


def test_every_packed_row_of_a_loaded_kimi_k25_equals_its_document_alone_through_hf(
    wrapper, folder
) -> None:
    docs = _documents()
    assert _distance_to_hf(wrapper, docs, _run(load_target(folder, device="cpu"), docs)) < ATOL


def test_the_wrapper_itself_takes_the_packed_mla_path_of_its_language_model(wrapper) -> None:
    docs = _documents(seed=1)
    assert _distance_to_hf(wrapper, docs, _run(wrapper, docs)) < ATOL


def test_a_loaded_model_that_is_not_the_wrappers_language_model_is_caught(
    wrapper, folder, monkeypatch
) -> None:
    """Mutant: the checkpoint's layers not renamed (WRAPPER_KEYS without its `blocks` rule), so
    DeepseekV3ForCausalLM draws them at random."""
    keys = {k: v for k, v in loading.WRAPPER_KEYS.items() if "blocks" not in k}
    monkeypatch.setattr(loading, "WRAPPER_KEYS", keys)
    docs = _documents()
    assert _distance_to_hf(wrapper, docs, _run(load_target(folder, device="cpu"), docs)) > (
        100 * ATOL
    )


@pytest.mark.gpu
def test_gpu_flex_packed_kimi_k25_rows_equal_each_document_alone(folder) -> None:
    """fp32 on CUDA (no TF32), the loaded language model on flex over T = 256 (tiles of 128),
    compiled as a run takes it, documents across tile edges; same 1e-5 bound."""
    wrapper = _wrapper().cuda()
    model = load_target(folder, device="cuda", dtype=torch.float32)
    docs = _documents(seed=5, lengths=(70, 100, 3, 50))
    assert _distance_to_hf(wrapper, docs, _run(model, docs, 256, "cuda")) < ATOL
