"""target.py: loading, layer capture with early exit, embeddings, preflight, random targets."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from target_kit import capture_features, save_random_target
from transformers import (
    LlamaConfig,
    PretrainedConfig,
    Qwen3_5Config,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3NextConfig,
)

from dflash_async.targets.loading import (
    TargetError,
    TargetFeatures,
    decoder_layers,
    fast_kernel_preflight,
    frozen_embeddings,
    load_target,
    preflight_lines,
    random_target,
    text_model,
)

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

D = 64
_COMMON = dict(
    hidden_size=D,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=300,
)
_LINEAR = dict(
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def _config(kind: str, **overrides: object) -> PretrainedConfig:
    common = {**_COMMON, **overrides}
    if kind == "qwen3":
        return Qwen3Config(**common)
    if kind == "llama":
        return LlamaConfig(**common)
    if kind == "qwen3_moe":
        return Qwen3MoeConfig(**common, **_MOE)
    if kind == "qwen3_next":
        return Qwen3NextConfig(**common, **_LINEAR, **_MOE, shared_expert_intermediate_size=32)
    assert kind == "qwen3_5", kind
    vision = dict(depth=1, hidden_size=32, num_heads=2, out_hidden_size=D, intermediate_size=64)
    return Qwen3_5Config(text_config={**common, **_LINEAR}, vision_config=vision)


KINDS = ["qwen3", "llama", "qwen3_moe", "qwen3_next", "qwen3_5"]


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded [3, 10] batch: full row, row of 6 real tokens, row of 3."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 300, (3, 10), generator=gen)
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, 6:] = 0
    mask[2, 3:] = 0
    return input_ids, mask


@pytest.mark.parametrize("kind", KINDS)
def test_captured_features_equal_hf_hidden_states(kind: str) -> None:
    model = random_target(_config(kind), seed=0)
    input_ids, mask = _batch()
    features = capture_features(model, input_ids, mask, [0, 2])  # [B, S, 2*D]
    hidden = model(
        input_ids=input_ids, attention_mask=mask, output_hidden_states=True
    ).hidden_states
    real = mask.bool().unsqueeze(-1)
    assert features.shape == (3, 10, 2 * D)
    for slot, layer in enumerate([0, 2]):
        expected = hidden[layer + 1].masked_fill(~real, 0)
        torch.testing.assert_close(features[..., slot * D : (slot + 1) * D], expected)


def test_features_follow_the_order_of_layer_ids() -> None:
    model = random_target(_config("qwen3"), seed=0)
    input_ids, mask = _batch()
    ascending = capture_features(model, input_ids, mask, [1, 2])
    descending = capture_features(model, input_ids, mask, [2, 1])
    torch.testing.assert_close(descending, torch.cat([ascending[..., D:], ascending[..., :D]], -1))


def test_layers_after_the_last_needed_one_the_norm_and_lm_head_never_run() -> None:
    model = random_target(_config("qwen3", num_hidden_layers=6), seed=0)
    calls: dict[str, int] = {}

    def count(name: str):
        return lambda *_: calls.__setitem__(name, calls.get(name, 0) + 1)

    for i, layer in enumerate(decoder_layers(model)):
        layer.register_forward_hook(count(f"layer{i}"))
    text_model(model).norm.register_forward_hook(count("norm"))
    model.lm_head.register_forward_hook(count("lm_head"))
    capture_features(model, *_batch(), layer_ids=[1, 3])
    assert calls == {"layer0": 1, "layer1": 1, "layer2": 1, "layer3": 1}


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_next"])
def test_right_padded_rows_get_the_features_they_get_alone(kind: str) -> None:
    model = random_target(_config(kind), seed=0)
    input_ids, mask = _batch()
    batched = capture_features(model, input_ids, mask, [1, 2])
    for row, length in enumerate(mask.sum(1).tolist()):
        alone = capture_features(
            model, input_ids[row : row + 1, :length], mask[row : row + 1, :length], [1, 2]
        )
        torch.testing.assert_close(batched[row : row + 1, :length], alone, atol=1e-5, rtol=1e-5)
        assert not batched[row, length:].any()  # padding rows are zero


def test_target_features_is_reusable_and_close_removes_its_hooks() -> None:
    model = random_target(_config("qwen3"), seed=0)
    input_ids, mask = _batch()
    logits = model(input_ids=input_ids, attention_mask=mask).logits
    with TargetFeatures(model, [0, 1]) as features:
        first = features(input_ids, mask)
        torch.testing.assert_close(features(input_ids, mask), first)
        # While the hooks are installed, a plain forward still runs to the logits.
        torch.testing.assert_close(model(input_ids=input_ids, attention_mask=mask).logits, logits)
    assert all(not layer._forward_hooks for layer in decoder_layers(model))


@pytest.mark.parametrize("layer_ids", [[], [0, 0], [4], [-1]])
def test_bad_layer_ids_are_rejected_with_the_value(layer_ids: list[int]) -> None:
    model = random_target(_config("qwen3"), seed=0)
    with pytest.raises(ValueError, match=r"layer_ids=\["):
        TargetFeatures(model, layer_ids)


def test_tied_embeddings_are_one_tensor_and_untied_are_two() -> None:
    tied = random_target(_config("qwen3", tie_word_embeddings=True), seed=0)
    embed, head = frozen_embeddings(tied)
    assert embed is head and embed.shape == (300, D)
    untied = random_target(_config("qwen3", tie_word_embeddings=False), seed=0)
    embed, head = frozen_embeddings(untied)
    assert embed.data_ptr() != head.data_ptr() and head.shape == (300, D)


def test_decoder_layers_are_found_inside_the_qwen35_multimodal_wrapper() -> None:
    from transformers import AutoModelForImageTextToText

    wrapper = AutoModelForImageTextToText.from_config(_config("qwen3_5"))
    assert len(decoder_layers(wrapper)) == 4
    input_ids, mask = _batch()
    assert capture_features(wrapper, input_ids, mask, [1]).shape == (3, 10, D)


def test_missing_folder_is_a_one_line_target_error(tmp_path: Path) -> None:
    with pytest.raises(TargetError, match="does not exist") as info:
        load_target(tmp_path / "nope", device=torch.device("cpu"))
    assert str(tmp_path / "nope") in str(info.value) and "\n" not in str(info.value)


def test_folder_without_config_or_weights_is_a_target_error(tmp_path: Path) -> None:
    with pytest.raises(TargetError, match=r"no config\.json"):
        load_target(tmp_path, device=torch.device("cpu"))
    _config("qwen3").save_pretrained(tmp_path)
    with pytest.raises(TargetError, match="no weights"):
        load_target(tmp_path, device=torch.device("cpu"))


def test_config_transformers_cannot_build_is_a_target_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "no_such_model"}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(TargetError, match="cannot load target") as info:
        load_target(tmp_path, device="cpu")
    assert "\n" not in str(info.value)


def test_saved_random_target_loads_frozen_in_fp32_on_cpu(tmp_path: Path) -> None:
    rng_before = torch.get_rng_state()
    folder = save_random_target(tmp_path / "t", _config("qwen3"), seed=3)
    assert torch.equal(torch.get_rng_state(), rng_before)  # the seed does not leak
    model = load_target(folder, device=torch.device("cpu"))
    assert model.dtype == torch.float32 and not model.training
    assert not any(p.requires_grad for p in model.parameters())
    reference = random_target(_config("qwen3"), seed=3)
    for (name, p), q in zip(
        model.state_dict().items(), reference.state_dict().values(), strict=True
    ):
        assert torch.equal(p, q), name


def test_preflight_is_empty_for_a_target_without_linear_attention() -> None:
    assert fast_kernel_preflight(random_target(_config("qwen3"), seed=0)) == []


def test_preflight_on_cpu_reports_the_torch_fallback_without_importing_kernels() -> None:
    before = set(sys.modules)
    lines = fast_kernel_preflight(random_target(_config("qwen3_next"), seed=0))
    assert len(lines) == 2 and all("torch fallback" in line for line in lines)
    assert not {m for m in set(sys.modules) - before if m.split(".")[0] in ("fla", "triton")}


def test_preflight_on_cuda_warns_for_each_missing_kernel() -> None:
    cuda = torch.device("cuda", 0)

    def importable(module: str) -> str | None:
        return None if module == "fla" else "not installed"

    with pytest.warns(RuntimeWarning, match="causal-conv1d: not installed"):
        lines = preflight_lines(hybrid=True, device=cuda, importable=importable)
    assert lines[0].startswith("flash-linear-attention: available")
    assert "slow torch fallback" in lines[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_next"])
def test_gpu_bf16_capture_equals_hidden_states_and_stops_early(tmp_path: Path, kind: str) -> None:
    folder = save_random_target(tmp_path / kind, _config(kind), seed=0)
    model = load_target(folder, device=torch.device("cuda", 0))
    assert model.dtype == torch.bfloat16
    assert len(fast_kernel_preflight(model)) == (2 if kind == "qwen3_next" else 0)
    input_ids, mask = (t.cuda() for t in _batch())
    features = capture_features(model, input_ids, mask, [1, 2])
    hidden = model(
        input_ids=input_ids, attention_mask=mask, output_hidden_states=True
    ).hidden_states
    real = mask.bool().unsqueeze(-1)
    torch.testing.assert_close(features[..., :D], hidden[2].masked_fill(~real, 0))
    torch.testing.assert_close(features[..., D:], hidden[3].masked_fill(~real, 0))
