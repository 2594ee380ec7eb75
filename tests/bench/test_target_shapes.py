"""The benchmark shapes (bench/target_shapes.py): each builds (on the meta device, no memory)
through the auto class its checkpoints load with, within one 140 GB GPU in bf16, captures
distinct layers it has, and belongs to a family with a packed forward; the sparse-attention ones
(the sparse-MLA forward's, DeepSeek-V4's) leave room for a pack's activations; a shape whose
config class the installed transformers lacks is named by `unavailable_shapes` with the reason
(an older transformers), never a crash."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from dflash_async.bench.target_shapes import shape_configs, unavailable_shapes
from dflash_async.targets.config_readers import text_config_of
from dflash_async.targets.families import FAMILIES, family_of
from dflash_async.targets.generic_config import causal_lm_auto_class

GPU_BYTES = 140e9
WEIGHT_BYTES = 120e9  # leaves 20 GB for a pack's activations (packed_dsa's masks: 0.5 GB at 16384)


@pytest.mark.parametrize(
    ("name", "path"),
    [
        ("deepseek-v3.2-7l", "packed_dsa"),
        ("glm-5-8l", "packed_dsa"),
        ("deepseek-v4-flash-8l", "packed_deepseek_v4"),
    ],
)
def test_a_sparse_attention_shape_fits_one_gpu_or_is_skipped_with_a_reason(
    name: str, path: str
) -> None:
    if name in unavailable_shapes():
        assert name not in shape_configs() and "has no" in unavailable_shapes()[name]
        pytest.skip(unavailable_shapes()[name])
    config, layer_ids = shape_configs()[name]
    assert len(set(layer_ids)) == len(layer_ids) and max(layer_ids) < config.num_hidden_layers
    assert family_of(config).forward.name == path
    with torch.device("meta"):  # sized without memory
        model = AutoModelForCausalLM.from_config(config)
    weights = 2 * sum(p.numel() for p in model.parameters())  # bf16
    assert weights < WEIGHT_BYTES < GPU_BYTES, weights


@pytest.mark.parametrize("name", sorted(shape_configs()))
def test_every_shape_builds_fits_one_gpu_and_has_a_packed_family(name: str) -> None:
    config, layer_ids = shape_configs()[name]
    text = text_config_of(config)
    assert len(set(layer_ids)) == len(layer_ids) and max(layer_ids) < text.num_hidden_layers
    assert text.model_type in FAMILIES and FAMILIES[text.model_type].forward.name != "hf"
    with torch.device("meta"):
        model = causal_lm_auto_class(config).from_config(config, dtype=torch.bfloat16)
    assert 2 * sum(p.numel() for p in model.parameters()) < GPU_BYTES, name


class _Without(types.ModuleType):
    """transformers as an older version is: without the config class `missing`."""

    def __init__(self, missing: str) -> None:
        super().__init__("transformers")
        self.missing = missing

    def __getattr__(self, name: str):
        if name == self.missing:
            raise AttributeError(name)
        return getattr(transformers, name)


@pytest.mark.parametrize(
    ("name", "missing"),
    [
        ("qwen3-vl-30b-a3b", "Qwen3VLMoeConfig"),
        ("mistral-small-4-16l", "Mistral4Config"),
        ("deepseek-v4-flash-8l", "DeepseekV4Config"),
    ],
)
def test_a_shape_of_a_missing_config_class_is_skipped_with_its_reason(
    name: str, missing: str, monkeypatch
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", _Without(missing))
    assert missing in unavailable_shapes()[name]
    assert name not in shape_configs() and shape_configs()  # the others still build
