"""The benchmark shapes (bench/target_shapes.py): each builds (on the meta device, no memory) through
the class the benchmark builds it with, within one 140 GB GPU in bf16, captures distinct layers it
has, and belongs to a family with a packed forward; the sparse-attention (the sparse-MLA forward's,
DeepSeek-V4's), Muse and Inkling 2 ones leave room for a pack's activations; a shape whose config class the
installed transformers lacks is named by `unavailable_shapes` with the reason (an older
transformers), never a crash."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from dflash_async.bench.target_bench import bench_model
from dflash_async.bench.target_shapes import shape_configs, unavailable_shapes
from dflash_async.targets.config_readers import text_config_of
from dflash_async.targets.families import FAMILIES, family_of

GPU_BYTES = 140e9
WEIGHT_BYTES = (
    120e9  # leaves 20 GB for a pack's activations (packed/dsa.py's masks: 0.5 GB at 16384)
)


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
        model = bench_model(config, dtype=torch.bfloat16)
    assert 2 * sum(p.numel() for p in model.parameters()) < GPU_BYTES, name


def test_the_nemotron_h_shape_is_the_8b_model_and_takes_the_packed_mamba_forward() -> None:
    """Nemotron-H-8B-Base-8K: 24 Mamba-2, 4 attention and 24 MLP blocks, 8,100,852,736
    parameters (the published 8.1B), its taps among the 52 blocks."""
    from collections import Counter

    name = "nemotron-h-8b"
    if name in unavailable_shapes():
        assert name not in shape_configs() and "NemotronHConfig" in unavailable_shapes()[name]
        pytest.skip(unavailable_shapes()[name])
    config, layer_ids = shape_configs()[name]
    assert max(layer_ids) < config.num_hidden_layers == 52
    assert Counter(config.layers_block_type) == {
        "linear_attention": 24,
        "full_attention": 4,
        "mlp": 24,
    }
    assert family_of(config).forward.name == "packed_mamba"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == 8_100_852_736


def test_the_kimi_linear_shape_is_the_whole_48b_model_and_takes_the_packed_kda_forward() -> None:
    """Kimi-Linear-48B-A3B whole: 20 KDA and 7 MLA layers, 49,122,675,072 parameters, whose
    bf16 weights (98 GB) one GPU of GPU_BYTES holds."""
    from collections import Counter

    name = "kimi-linear-48b-a3b"
    if name in unavailable_shapes():
        assert name not in shape_configs() and "KimiLinearConfig" in unavailable_shapes()[name]
        pytest.skip(unavailable_shapes()[name])
    config, layer_ids = shape_configs()[name]
    assert max(layer_ids) < config.num_hidden_layers == 27
    assert Counter(config.layer_types) == {"linear_attention": 20, "full_attention": 7}
    assert family_of(config).forward.name == "packed_kda"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    count = sum(p.numel() for p in model.parameters())
    assert count == 49_122_675_072 and 2 * count < GPU_BYTES


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
        ("nemotron-h-8b", "NemotronHConfig"),
        ("kimi-linear-48b-a3b", "KimiLinearConfig"),
        ("deepseek-v4-flash-8l", "DeepseekV4Config"),
        ("inkling-2-small-4l", "Inkling2TextConfig"),
    ],
)
def test_a_shape_of_a_missing_config_class_is_skipped_with_its_reason(
    name: str, missing: str, monkeypatch
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", _Without(missing))
    assert missing in unavailable_shapes()[name]
    assert name not in shape_configs() and shape_configs()  # the others still build


@pytest.mark.parametrize("name", ["muse-glimmer-30b", "muse-spark-4l"])
def test_a_muse_shape_fits_one_gpu_and_takes_the_packed_window_forward(name: str) -> None:
    """Its text config (no causal-LM class takes it): the decoder stack the benchmark builds."""
    if name in unavailable_shapes():
        assert name not in shape_configs() and "has no" in unavailable_shapes()[name]
        pytest.skip(unavailable_shapes()[name])
    config, layer_ids = shape_configs()[name]
    assert len(set(layer_ids)) == len(layer_ids) and max(layer_ids) < config.num_hidden_layers
    assert family_of(config).forward.name == "packed_window"
    with torch.device("meta"):
        model = bench_model(config, dtype=torch.bfloat16)
    weights = 2 * sum(p.numel() for p in model.parameters())  # bf16
    assert weights < WEIGHT_BYTES < GPU_BYTES, weights


def test_the_inkling_shape_runs_both_layer_kinds_fits_one_gpu_and_takes_the_packed_forward() -> (
    None
):
    """Inkling 2 Small truncated to 4 layers (three sliding, one full), with room for a pack."""
    name = "inkling-2-small-4l"
    if name in unavailable_shapes():
        assert name not in shape_configs() and "has no" in unavailable_shapes()[name]
        pytest.skip(unavailable_shapes()[name])
    config, layer_ids = shape_configs()[name]
    assert layer_ids == (0, 1, 2, 3) and config.num_hidden_layers == 4
    assert config.layer_types == ["hybrid_sliding"] * 3 + ["hybrid"]
    assert family_of(config).forward.name == "packed_inkling"
    with torch.device("meta"):
        model = bench_model(config, dtype=torch.bfloat16)
    weights = 2 * sum(p.numel() for p in model.parameters())  # bf16
    assert weights < WEIGHT_BYTES < GPU_BYTES, weights
