"""Every target load hands transformers Hub kernels off: transformers 5.2x kernelizes a model at
`from_pretrained` when the `kernels` package is installed, which needs the network and swaps
layer forwards (RMSNorm, rotary) for other kernels' numerics."""

from __future__ import annotations

import pytest
import torch
from image_text_kit import tiny_multimodal
from tiny_decoding import tiny_qwen3_target
from transformers import PreTrainedModel

from dflash_async.targets.loading import load_target
from dflash_async.targets.multimodal import load_multimodal_target


@pytest.fixture
def kernelized(monkeypatch) -> list[bool]:
    """The use_kernels value of every `set_use_kernels` call, recorded instead of run (which
    would reach for the Hub)."""
    calls: list[bool] = []

    def record(self, use_kernels, *args, **kwargs) -> None:
        calls.append(bool(use_kernels))

    monkeypatch.setattr(PreTrainedModel, "set_use_kernels", record, raising=False)
    return calls


def test_a_causal_lm_target_loads_without_hub_kernels(tmp_path, kernelized) -> None:
    tiny_qwen3_target().save_pretrained(tmp_path)
    load_target(tmp_path, device="cpu")
    assert True not in kernelized


@pytest.mark.parametrize("model_type", ["gemma3", "qwen3_vl"])
def test_a_multimodal_wrapper_loads_without_hub_kernels_text_only_and_whole(
    tmp_path, kernelized, model_type
) -> None:
    """Gemma 3's language model loads through its text CausalLM class, Qwen3-VL's through the
    wrapper (targets/loading.py); the whole wrapper through targets/multimodal.py."""
    _, model = tiny_multimodal(model_type)
    model.save_pretrained(tmp_path)
    load_target(tmp_path, device="cpu")
    load_multimodal_target(str(tmp_path), device=torch.device("cpu"), dtype=torch.float32)
    assert True not in kernelized
