"""The family table (targets/families.py) is consistent: every supported model_type has a Family
with every part set, the README's target table is its rows, the forward chosen for a tiny config
of each family is the one the table plans, and its decoding rules are what eval/ finds in the
cache HF builds for that config.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
import transformers
from arch_targets import ARCHITECTURES, config_class, tiny_config
from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from dflash_async.eval.hybrid_state import has_linear_layers
from dflash_async.targets.config_readers import text_config_of
from dflash_async.targets.families import (
    FAMILIES,
    GENERIC,
    GENERIC_ROW,
    family_of,
    quantization_problem,
)
from dflash_async.targets.forward import select_target_forward
from dflash_async.targets.loading import random_target

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

README = Path(__file__).resolve().parents[2] / "README.md"
LAYER_IDS = (0, 1)


def _source(model_type: str) -> str | None:
    """The arch_targets entry whose text config is `model_type`'s: its own, or its wrapper's."""
    for kind, (_, text) in ARCHITECTURES.items():
        if (text or kind) == model_type and config_class(kind) is not None:
            return kind
    return None


def _tiny(model_type: str):
    """The tiny text config of a family: arch_targets' (which has no Qwen2: its Qwen3 shape)."""
    if model_type == "qwen2":
        qwen3 = tiny_config("qwen3").to_dict()
        keep = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
        keep += ("num_key_value_heads", "intermediate_size", "eos_token_id")
        return transformers.Qwen2Config(**{k: qwen3[k] for k in keep})
    return text_config_of(tiny_config(_source(model_type)))


def _families_with_a_tiny_config() -> list[str]:
    """Text families (a wrapper's forward is its language model's, checked below) whose config
    class the installed transformers has."""
    text = [kind for kind, family in FAMILIES.items() if family.language_model is None]
    return [kind for kind in text if kind == "qwen2" or _source(kind) is not None]


def test_every_family_has_every_part_and_a_wrapper_runs_its_language_models_forward() -> None:
    for kind, family in FAMILIES.items():
        for field in dataclasses.fields(family):
            if field.name != "language_model":
                assert getattr(family, field.name) is not None, (kind, field.name)
        assert family.label and family.planned, kind
        assert family.forward.name and isinstance(family.forward.needs_cuda, bool), kind
        # the packed hybrid, KDA, short-convolution and Mamba-2 families' caches hold
        # convolution states
        linear = family.forward.name in (
            "packed_hybrid",
            "packed_kda",
            "packed_short_conv",
            "packed_mamba",
        )
        assert family.decoding.linear_state == linear, kind
        if family.language_model is not None:
            text = FAMILIES[family.language_model]
            assert text.language_model is None, kind
            assert (family.forward, family.planned, family.decoding) == (
                text.forward,
                text.planned,
                text.decoding,
            ), kind


def test_the_readme_table_rows_are_the_families() -> None:
    block = re.search(
        r"<!-- architectures:begin[^\n]*-->\n(.*?)\n<!-- architectures:end -->",
        README.read_text(encoding="utf-8"),
        re.S,
    )
    assert block is not None
    rows = [line.strip("|").split(" | ") for line in block[1].splitlines()[2:]]
    want = [[f" `{kind}`", family.label, f"{family.planned} "] for kind, family in FAMILIES.items()]
    want.append([f" `{GENERIC_ROW}`", GENERIC.label, f"{GENERIC.planned} "])
    assert rows == want


def test_any_other_model_type_is_the_generic_family_and_takes_the_generic_forward() -> None:
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64)
    assert family_of(config) is GENERIC and GENERIC.decoding.recompute
    path = select_target_forward(
        random_target(config, seed=0), (0,), token_budget=64, max_batch_tokens=64
    )
    assert path.name == "hf" and "generic" in path.reason


def test_every_text_family_has_a_tiny_config_here() -> None:
    """Only families the installed transformers lacks may go unchecked below."""
    text = {kind for kind, family in FAMILIES.items() if family.language_model is None}
    missing = text - set(_families_with_a_tiny_config())
    assert all(
        kind in ARCHITECTURES or any(t == kind for _, t in ARCHITECTURES.values())
        for kind in missing
    ), missing


@pytest.mark.parametrize("kind", _families_with_a_tiny_config())
def test_the_forward_chosen_for_a_tiny_target_is_the_one_the_table_plans(kind: str) -> None:
    """On the CPU: the family's packed path, or HF where that path needs CUDA (hybrids)."""
    config = _tiny(kind)
    family = family_of(config)
    assert family is FAMILIES[kind]
    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        model = random_target(config, seed=0)
    else:  # no text CausalLM class (Qwen3-VL): the wrapper is loaded whole, as loading.py does
        wrapper = tiny_config(_source(kind))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = transformers.AutoModelForImageTextToText.from_config(wrapper).eval()
    path = select_target_forward(model, LAYER_IDS, token_budget=64, max_batch_tokens=64)
    want = "hf" if family.forward.needs_cuda else family.forward.name
    assert path.name == want, path.reason


@pytest.mark.parametrize("kind", _families_with_a_tiny_config())
def test_the_decoding_rules_are_the_layers_of_the_cache_eval_builds(kind: str) -> None:
    """eval/ reads these from HF's cache for the config (eval/hybrid_state.py); the tiny configs
    of the sliding-window families set a window (arch_targets.SLIDING_WINDOW). A family that
    decodes by recomputation builds no HF cache (eval/recompute.py): it claims neither rule."""
    config = _tiny(kind)
    if FAMILIES[kind].decoding.recompute:
        decoding = FAMILIES[kind].decoding
        assert not decoding.linear_state and not decoding.sliding_window
        return
    cache = DynamicCache(config=config)
    sliding = any(type(layer) is DynamicSlidingWindowLayer for layer in cache.layers)
    assert has_linear_layers(cache) == FAMILIES[kind].decoding.linear_state
    assert sliding == FAMILIES[kind].decoding.sliding_window


def test_a_family_only_quant_method_is_refused_for_the_others() -> None:
    config = _tiny("qwen3")
    config.quantization_config = {"quant_method": "mxfp4"}
    assert quantization_problem(config) == (
        "quant_method 'mxfp4' is read for gpt_oss targets only, not 'qwen3'"
    )
