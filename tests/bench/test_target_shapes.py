"""The sparse-attention and Nemotron-H benchmark shapes (bench/target_shapes.py): each either
builds (the sparse-attention ones fit one 140 GB GPU in bf16 with room for a pack's activations)
and takes its family's packed forward, or is named by `unavailable_shapes` with the reason (an
older transformers without its config class)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_async.bench.target_shapes import shape_configs, unavailable_shapes
from dflash_async.targets.families import family_of

GPU_BYTES = 140e9
WEIGHT_BYTES = 120e9  # leaves 20 GB for a pack's activations (packed_dsa's masks: 0.5 GB at 16384)


@pytest.mark.parametrize("name", ["deepseek-v3.2-7l", "glm-5-8l"])
def test_a_sparse_attention_shape_fits_one_gpu_or_is_skipped_with_a_reason(name: str) -> None:
    if name in unavailable_shapes():
        assert name not in shape_configs() and "has no" in unavailable_shapes()[name]
        pytest.skip(unavailable_shapes()[name])
    config, layer_ids = shape_configs()[name]
    assert len(set(layer_ids)) == len(layer_ids) and max(layer_ids) < config.num_hidden_layers
    assert family_of(config).forward.name == "packed_dsa"
    with torch.device("meta"):  # sized without memory
        model = AutoModelForCausalLM.from_config(config)
    weights = 2 * sum(p.numel() for p in model.parameters())  # bf16
    assert weights < WEIGHT_BYTES < GPU_BYTES, weights


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
