"""The sparse-attention benchmark shapes (bench/target_shapes.py): each either builds, fits one
140 GB GPU in bf16 with room for a pack's activations and takes its family's packed forward (the
sparse-MLA one, DeepSeek-V4's), or is named by `unavailable_shapes` with the reason (an older transformers without its config class)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_async.bench.target_shapes import shape_configs, unavailable_shapes
from dflash_async.targets.families import family_of

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
