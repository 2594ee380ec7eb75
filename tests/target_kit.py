"""Test-side helpers around the target: one-shot layer capture (the per-sequence reference the
packed and hybrid paths are compared with) and a random target written as an HF folder (what
`load_target` reads). The product captures through `TargetFeatures` and builds its random tiny
target in targets/tiny.py; neither needs these.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import PretrainedConfig, PreTrainedModel

from dflash_async.atomic import atomic_directory
from dflash_async.targets.loading import TargetFeatures, random_target


def capture_features(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    layer_ids: Sequence[int],
) -> torch.Tensor:
    """One-shot `TargetFeatures`: [B, S, k*d], layer outputs concatenated in `layer_ids` order.

    Equals `model(..., output_hidden_states=True).hidden_states[i + 1]` for each id i, except for
    the last layer (i = L-1), where HF reports the output after the final norm and we the raw one.
    """
    with TargetFeatures(model, layer_ids) as features:
        return features(input_ids, attention_mask)


def save_random_target(
    path: str | os.PathLike[str],
    config: PretrainedConfig,
    seed: int,
    *,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write `random_target(config, seed)` as an HF folder at `path` (atomic); returns the path."""
    model = random_target(config, seed, dtype=dtype)
    with atomic_directory(path) as tmp:
        model.save_pretrained(tmp)
    return Path(path)


def seeded_experts(config: PretrainedConfig, *, device: str = "cuda") -> torch.nn.Module:
    """Layer 0's MoE experts module of the HF model `config` describes, built in bf16 on
    `device` right after torch.manual_seed(0) (transformers' own initialization): the experts
    the FP8 experts' GPU tests quantize."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.model.layers[0].mlp.experts
