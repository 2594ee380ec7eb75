"""Quantized targets on the CPU: FP8 and MXFP4 checkpoints as published, QUANTIZE=fp8,
the reference FP8 linear, and the exit 2 of a format we cannot read.

The checkpoints are tiny random targets quantized by tests/quant_kit.py (written apart from the
product's code), each beside a plain fp32 folder of the same weights dequantized by the kit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from arch_targets import save_tiny_target
from quant_kit import block_skewed, fp8_blocks, fp8_checkpoint, mxfp4_checkpoint
from target_kit import capture_features

from dflash_async.targets.loading import TargetError, load_target

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")
LAYERS = [0, 1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quantized")
    kinds = ("qwen3", "qwen3_moe", "gpt_oss", "mistral4")
    return {kind: save_tiny_target(root / kind, kind) for kind in kinds}


def _features(folder: Path, **options: str) -> torch.Tensor:
    """Captured layers 0 and 1 of a fixed right-padded batch (rows of 12 and 7 tokens)."""
    ids = torch.arange(24).reshape(2, 12) * 37 % 500 + 10
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    return capture_features(load_target(folder, device="cpu", **options), ids, mask, LAYERS)


# Tolerance 0 for a checkpoint against its reference: each weight of both is one e4m3 value times
# one fp32 scale, a single rounded product (mxfp4: an exact power-of-two product), so the two
# models hold bit-equal fp32 weights and run the same kernels in the same order.
@pytest.mark.parametrize(
    "method", ["fp8", "compressed-tensors-channel", "compressed-tensors-block"]
)
def test_an_fp8_checkpoint_loads_with_exactly_the_features_of_its_dequantized_reference(
    method: str, tiny: dict[str, Path], tmp_path: Path
) -> None:
    folder, reference = fp8_checkpoint(tiny["qwen3"], tmp_path, method=method)
    torch.testing.assert_close(_features(folder), _features(reference), rtol=0, atol=0)


def test_an_fp8_mistral4_checkpoint_loads_as_its_text_model_with_its_references_features(
    tiny: dict[str, Path], tmp_path: Path
) -> None:
    """Mistral 4's text model is registered as image-text-to-text only (as released, its FP8
    checkpoint): the dequantized weights still load into Mistral4ForCausalLM."""
    folder, reference = fp8_checkpoint(tiny["mistral4"], tmp_path)
    assert type(load_target(folder, device="cpu")).__name__ == "Mistral4ForCausalLM"
    torch.testing.assert_close(_features(folder), _features(reference), rtol=0, atol=0)


def test_a_gpt_oss_mxfp4_checkpoint_loads_with_exactly_the_features_of_its_reference(
    tiny: dict[str, Path], tmp_path: Path
) -> None:
    folder, reference = mxfp4_checkpoint(tiny["gpt_oss"], tmp_path)
    torch.testing.assert_close(_features(folder), _features(reference), rtol=0, atol=0)


def _mutated(kind: str):
    """expand_block_scales reading the grid transposed (column-major: same shape, wrong
    blocks) or shifted by one block along the columns."""
    from dflash_async.targets import quantized

    original = quantized.expand_block_scales

    def mutant(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int]):
        if kind == "transposed":
            scale = scale.transpose(-1, -2).reshape(scale.shape)
        else:
            scale = scale.roll(1, dims=-1)
        return original(scale, shape, block)

    return mutant


@pytest.mark.parametrize("kind", ["transposed", "shifted"])
def test_a_transposed_or_shifted_block_scale_fails_the_feature_check(
    kind: str, tiny: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kit skews neighbouring blocks by >= 2x (block_skewed), so a scale taken from another
    block is >= 50% off for that block, and the features move by far more than the 0 allowed."""
    from dflash_async.targets import quantized

    folder, reference = fp8_checkpoint(tiny["qwen3"], tmp_path)
    expected = _features(reference)
    monkeypatch.setattr(quantized, "expand_block_scales", _mutated(kind))
    moved = (_features(folder) - expected).abs().max()
    assert moved > 1e-2 * expected.abs().max()


def test_block_dequantization_is_within_e4m3_rounding_and_catches_wrong_blocks() -> None:
    """Round trip bound: e4m3 has 3 mantissa bits, so a normal value rounds within 2^-4 of
    itself; below e4m3's smallest normal (2^-6, in scaled units) the spacing is 2^-9, so within
    2^-10 * scale. A non-square grid (96x64 in 32x32 blocks: 3x2) also pins the orientation."""
    from dflash_async.targets.quantized import dequantize_fp8, expand_block_scales, quantize_fp8

    weight = block_skewed(torch.randn(96, 64, generator=torch.Generator().manual_seed(0)), (32, 32))
    fp8, scale = quantize_fp8(weight, block=(32, 32))
    _, kit_scale, kit_deq = fp8_blocks(weight, (32, 32))
    assert scale.shape == (3, 2) and torch.equal(scale, kit_scale)
    deq = dequantize_fp8(fp8, scale, block=(32, 32), dtype=torch.float32)
    assert torch.equal(deq, kit_deq)
    bound = 2.0**-4 * weight.abs() + 2.0**-10 * expand_block_scales(scale, weight.shape, (32, 32))
    assert ((deq - weight).abs() <= bound).all()
    shifted = dequantize_fp8(fp8, scale.roll(1, dims=0), block=(32, 32), dtype=torch.float32)
    assert not ((shifted - weight).abs() <= bound).all()
    with pytest.raises(TargetError, match="scale grid"):  # a transposed grid [2, 3]
        dequantize_fp8(fp8, scale.T, block=(32, 32), dtype=torch.float32)


def test_quantize_fp8_puts_every_decoder_matmul_weight_on_its_e4m3_grid_and_leaves_the_rest(
    tiny: dict[str, Path],
) -> None:
    """Qwen3-MoE: attention linears and the fused experts quantized (128x128 blocks: one block
    per matrix or expert at these sizes), bit-equal to the kit's quantization; the router, the
    norms, the embedding and the lm_head untouched (served FP8 checkpoints keep them bf16)."""
    plain = load_target(tiny["qwen3_moe"], device="cpu").state_dict()
    quantized = load_target(tiny["qwen3_moe"], device="cpu", quantize="fp8").state_dict()
    changed = set()
    for name, before in plain.items():
        after = quantized[name]
        if name.endswith(("_proj.weight", "experts.gate_up_proj", "experts.down_proj")):
            matrices = before if before.ndim == 3 else before[None]
            expected = torch.stack([fp8_blocks(m, (128, 128))[2] for m in matrices])
            assert torch.equal(after, expected.reshape(before.shape)), name
            changed.add(name.split(".", 3)[-1])  # the name inside a layer
        else:
            assert torch.equal(after, before), name
    parts = {"self_attn.q_proj.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    assert parts <= changed
    assert not torch.equal(
        quantized["model.layers.0.self_attn.q_proj.weight"],
        plain["model.layers.0.self_attn.q_proj.weight"],
    )


def test_activation_scales_are_per_token_so_no_document_changes_another() -> None:
    """Two documents in one pack; the second scaled 1000x. Per-token (1x128) scales leave the
    first document's rows bit-equal; one scale per pack (the mutant) does not."""
    from dflash_async.targets.fp8 import fp8_reference as ref
    from dflash_async.targets.quantized import quantize_fp8

    gen = torch.Generator().manual_seed(1)
    weight, x = torch.randn(48, 256, generator=gen), torch.randn(20, 256, generator=gen)
    fp8, scale = quantize_fp8(weight, block=(128, 128))
    loud = x.clone()
    loud[10:] *= 1000.0  # document B: rows 10..19

    def first_document_kept(linear) -> bool:
        return torch.equal(
            linear(x, fp8, scale, block=(128, 128))[:10],
            linear(loud, fp8, scale, block=(128, 128))[:10],
        )

    def one_scale_per_pack(x, weight, scale_inv, *, block):
        s = x.abs().amax() / ref.FP8_MAX
        return ref.linear_dequantized(
            (x / s).to(ref.FP8_DTYPE).float() * s, weight, scale_inv, block=block
        )

    assert first_document_kept(ref.linear_fp8_activations)
    assert not first_document_kept(one_scale_per_pack)


def test_the_fp8_activation_linear_is_within_its_rounding_bound_of_the_dequantized_one() -> None:
    """|y_fp8act - y_deq| <= |W| @ |dx| + fp32 slack, with |dx| <= 2^-4 |x| + 2^-10 s_x (e4m3
    rounding, as for weights) and the slack 2 * K * 2^-24 * |W| @ |x| (two fp32 sums of K
    products, each within K * 2^-24 relative)."""
    from dflash_async.targets.fp8 import fp8_reference as ref
    from dflash_async.targets.quantized import dequantize_fp8, quantize_fp8

    gen = torch.Generator().manual_seed(2)
    weight, x = torch.randn(40, 320, generator=gen), torch.randn(9, 320, generator=gen) * 3
    fp8, scale = quantize_fp8(weight, block=(128, 128))
    w = dequantize_fp8(fp8, scale, block=(128, 128), dtype=torch.float32).abs()
    _, x_scale = ref.quantize_activations(x)
    s_x = x_scale.repeat_interleave(128, dim=-1)[:, :320]
    dx = 2.0**-4 * x.abs() + 2.0**-10 * s_x
    bound = dx @ w.T + 2 * 320 * 2.0**-24 * (x.abs() @ w.T)
    y_deq = ref.linear_dequantized(x, fp8, scale, block=(128, 128))
    y_act = ref.linear_fp8_activations(x, fp8, scale, block=(128, 128))
    assert ((y_act - y_deq).abs() <= bound).all()
    assert not torch.equal(y_act, y_deq)  # the activations really were quantized


def test_an_unsupported_quant_method_exits_2_at_start_up_naming_it(
    tiny: dict[str, Path], tmp_path: Path
) -> None:
    from dflash_async.__main__ import _is_user_error
    from dflash_async.errors import SettingsError
    from dflash_async.model.drafter_config import DrafterSpec
    from dflash_async.pipeline.startup import drafter_config_for

    spec = DrafterSpec(
        num_layers=1, num_features=2, block_size=8, target_layer_ids=(0, 1), mask_token_id=None
    )
    int4 = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}},
    }
    for name, quant in [("awq", {"quant_method": "awq", "bits": 4}), ("int4", int4)]:
        folder, _ = fp8_checkpoint(tiny["qwen3"], tmp_path / name)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(config | {"quantization_config": quant}))
        with pytest.raises(SettingsError, match=r"quant_method '(awq|compressed-tensors)'") as info:
            drafter_config_for(spec, str(folder), False)
        assert "supported: " in str(info.value) and _is_user_error(info.value)
        with pytest.raises(TargetError, match="quant_method") as info:
            load_target(folder, device="cpu")
        assert _is_user_error(info.value)


def test_quantize_accepts_none_and_fp8_only() -> None:
    from dflash_async.errors import SettingsError
    from dflash_async.pipeline.specs import run_spec
    from dflash_async.settings.env import load_settings

    base = {"DFLASH_ENV_FILE": "none"}
    assert run_spec(load_settings(base)).target.quantize == "none"
    assert (
        run_spec(load_settings(base | {"DFLASH_TARGET__QUANTIZE": "fp8"})).target.quantize == "fp8"
    )
    with pytest.raises(SettingsError, match="DFLASH_TARGET__QUANTIZE"):
        load_settings(base | {"DFLASH_TARGET__QUANTIZE": "int4"})


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.timeout(180)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize(
    ("kind", "weight_format"),
    [("fp8", "fp8-block"), ("mxfp4", "mxfp4"), ("quantize", "quantized-at-load")],
)
async def test_a_quantized_target_trains_and_logs_its_weight_format(
    kind: str, weight_format: str, tiny: dict[str, Path], tmp_path: Path
) -> None:
    from test_architectures import ARCH_STEPS, arch_env, run_logged
    from tiny_run import write_pretokenized

    from dflash_async.targets.tiny import tiny_tokenizer

    if kind == "fp8":
        target, _ = fp8_checkpoint(tiny["qwen3"], tmp_path)
    elif kind == "mxfp4":
        target, _ = mxfp4_checkpoint(tiny["gpt_oss"], tmp_path)
    else:
        target = tiny["qwen3"]
    data = write_pretokenized(tmp_path / "data.jsonl", records=24, vocab=len(tiny_tokenizer()))
    env = arch_env({"data": str(data), "prompts": ""}, target, tmp_path / "out")
    env |= {"DFLASH_EVAL__AT_END": "false", "DFLASH_EVAL__PROMPTS_PATH": ""}
    if kind == "quantize":
        env["DFLASH_TARGET__QUANTIZE"] = "fp8"
    code, events = await run_logged(env)
    assert code == 0
    assert len([e for e in events if e["event"] == "step"]) == ARCH_STEPS
    (loaded,) = [e for e in events if e["event"] == "target_weights_loaded"]
    assert loaded["weight_format"] == weight_format and loaded["dequantized"] is True
