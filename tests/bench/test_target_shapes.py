"""The public target shapes (bench/target_shapes.py): each builds (on the meta device, no memory)
through the auto class a checkpoint of it loads with, within one 140 GB GPU in bf16, captures
distinct layers it has, and belongs to a family with a packed forward; a shape whose config
class the installed transformers lacks is left out with the reason, never a crash.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import transformers

from dflash_async.bench import target_shapes
from dflash_async.targets.config_readers import text_config_of
from dflash_async.targets.families import FAMILIES
from dflash_async.targets.generic_config import causal_lm_auto_class

GPU_BYTES = 140e9  # one H200, as the shapes' comments size them


@pytest.mark.parametrize("name", sorted(target_shapes.shape_configs()))
def test_every_shape_builds_fits_one_gpu_and_has_a_packed_family(name: str) -> None:
    config, layer_ids = target_shapes.shape_configs()[name]
    text = text_config_of(config)
    assert len(set(layer_ids)) == len(layer_ids) and max(layer_ids) < text.num_hidden_layers
    assert text.model_type in FAMILIES and FAMILIES[text.model_type].forward.name != "hf"
    with torch.device("meta"):
        model = causal_lm_auto_class(config).from_config(config, dtype=torch.bfloat16)
    assert 2 * sum(p.numel() for p in model.parameters()) < GPU_BYTES * 0.8, name


class _Without(types.ModuleType):
    """transformers as an older version is: without the config class `missing`."""

    def __init__(self, missing: str) -> None:
        super().__init__("transformers")
        self.missing = missing

    def __getattr__(self, name: str):
        if name == self.missing:
            raise AttributeError(name)
        return getattr(transformers, name)


@pytest.mark.parametrize("missing", sorted(target_shapes.NEWER_SHAPES.values()))
def test_a_shape_of_a_missing_config_class_is_left_out_with_its_reason(
    missing: str, monkeypatch
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", _Without(missing))
    (name,) = [n for n, cls in target_shapes.NEWER_SHAPES.items() if cls == missing]
    assert missing in target_shapes.unavailable_shapes()[name]
    assert name not in target_shapes.shape_configs()
