"""GPU: the packed target forwards with FP8 matmuls (targets/fp8/fp8_linear.py) on Hopper.

Tolerance, against the same model in fp32 (the bf16 weights upcast), per document: the bf16 HF
path's own distance from it (`hf`) is the bf16 noise, from rounding activations at unit roundoff
2^-8 (the weights are the same values in both). The FP8 path rounds each matmul's activations at
e4m3's 2^-4 (16x bf16's) and its weights too (a second, independent rounding of the same size:
x sqrt(2)), so its distance may be up to 16 * sqrt(2) ~= 23x the bf16 noise; 32x leaves margin
for the non-matmul ops bf16 also rounds. It must also exceed the bf16 noise: else FP8 did not run.
(The same check on the CPU, SDPA, torch 2.13, d 512 dense and d 256 MoE: ratios 11-13.)
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from structlog.testing import capture_logs
from target_kit import capture_features, save_random_target
from transformers import Qwen3Config, Qwen3MoeConfig

from dflash_async.data.packing import layout_pack, pack_row_offsets
from dflash_async.stages.produce import TargetSpec, load_runner
from dflash_async.targets.forward import select_target_forward
from dflash_async.targets.fp8 import fp8_experts, fp8_linear
from dflash_async.targets.loading import random_target, text_model

pytestmark = pytest.mark.gpu

LAYERS = (1, 3)
FP8_OVER_BF16 = 32  # see the module doc


def _docs(lengths, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, vocab, n), np.ones(n, dtype=bool)) for n in lengths]


def _packed(model, docs, token_budget: int) -> torch.Tensor:
    path = select_target_forward(
        model, LAYERS, token_budget=token_budget, max_batch_tokens=token_budget
    )
    assert path.name in ("packed_dense", "packed_moe"), path.reason
    layout = layout_pack(docs, token_budget).to("cuda")
    width = len(LAYERS) * model.config.hidden_size
    out = torch.full((token_budget, width), float("nan"), device="cuda", dtype=torch.bfloat16)
    lengths = np.array([len(d[0]) for d in docs])
    return path.forward(layout.input_ids, layout.position_ids, layout.doc_ids, out, lengths)


def _alone(model, ids) -> torch.Tensor:
    ids = torch.as_tensor(ids, device="cuda")[None]
    return capture_features(model, ids, torch.ones_like(ids), LAYERS)[0].float()


def _relative(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref).norm() / ref.norm())


def _check_fp8_against_bf16_noise(config, docs, token_budget: int) -> None:
    with torch.device("cuda"):
        model = random_target(config, seed=0, dtype=torch.bfloat16)
    exact = copy.deepcopy(model).float()
    fp8 = copy.deepcopy(model)
    counts = fp8_linear.swap_fp8_matmuls(text_model(fp8).layers, device=torch.device("cuda"))
    assert counts["linear"] > 0
    packed = _packed(fp8, docs, token_budget)
    offsets = pack_row_offsets(np.array([len(d[0]) for d in docs]))
    for j, (ids, _) in enumerate(docs):
        reference = _alone(exact, ids)
        hf_error = _relative(_alone(model, ids), reference)
        fp8_error = _relative(packed[offsets[j] : offsets[j + 1]], reference)
        print(f"doc {j}: bf16 HF {hf_error:.2e}, FP8 packed {fp8_error:.2e}")
        assert hf_error < fp8_error <= FP8_OVER_BF16 * hf_error, (j, fp8_error, hf_error)
    assert not packed[offsets[-1] :].any()


def test_fp8_dense_packed_rows_at_the_qwen3_8b_width_are_within_the_fp8_bound() -> None:
    config = Qwen3Config(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=4,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    _check_fp8_against_bf16_noise(config, _docs((300, 1000, 57, 640), 151936), 2048)


def test_fp8_moe_packed_rows_run_the_grouped_kernel_within_the_fp8_bound() -> None:
    config = Qwen3MoeConfig(
        hidden_size=1024,
        intermediate_size=2048,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=2000,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=256,
    )
    assert fp8_experts.grouped_kernel(torch.device("cuda"))[1] == fp8_experts.GROUPED_KERNEL
    _check_fp8_against_bf16_noise(config, _docs((200, 500, 31, 260), 2000, seed=2), 1024)


def test_quantize_fp8_on_cuda_logs_the_fp8_kernel_and_keeps_no_bf16_decoder_matmul(
    tmp_path,
) -> None:
    config = Qwen3Config(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=1000,
        tie_word_embeddings=False,
    )
    folder = tmp_path / "qwen3"
    save_random_target(folder, config, 0)
    with capture_logs() as events:
        runner = load_runner(
            str(folder),
            spec=TargetSpec(
                cuda_dtype=torch.bfloat16,
                cpu_dtype=torch.float32,
                token_budget=256,
                max_batch_tokens=256,
                packed_hybrid=True,
                quantize="fp8",
            ),
            device=torch.device("cuda"),
            layer_ids=LAYERS,
        )
    chosen = next(e for e in events if e["event"] == "target_path_chosen")
    assert chosen["kernel"] == fp8_linear.KERNEL, chosen
    assert chosen["weight_format"] == "quantized-at-load", chosen
    assert chosen["target_path"] == "packed_dense", chosen
    matmuls = [
        p
        for n, p in text_model(runner.model).layers.named_parameters()
        if p.ndim == 2 and not n.endswith("scale")
    ]
    assert matmuls and all(p.dtype == torch.float8_e4m3fn for p in matmuls)
