"""GPU: the drafter's FP8 training matmuls (model/fp8_training.py) with the `_scaled_mm` kernel.

1. The kernel path against the reference path on CUDA, for y, grad_x and grad_w. Both quantize
   with the same code on the same device, so their e4m3 operands are identical; they differ in
   how the product is accumulated and rounded. No element bound is claimed for the kernel: even
   without fast accumulation Hopper's FP8 tensor cores add a few products at their own precision
   (~14 bits, DeepSeek-V3's report) before each promotion to fp32. The check is the relative
   Frobenius distance: each bf16 output alone is ~2^-9 (rms relative rounding 2^-8 / sqrt(3)),
   the accumulation at ~2^-14 per addition over K = 1024 random-signed terms adds ~2^-9, so
   2^-7 without fast accumulation and 2^-6 with it leave margin, while a scale on the wrong axis
   or a wrong operand layout is off by O(1). grad_w is the same bf16 matmul on both paths.
2. The whole compiled drafter step with DFLASH_TRAIN__FP8_MATMULS on, captured as CUDA graphs
   in the strictest capture mode (any host sync fails), replayed: finite, every aligned linear on
   the kernel, its first gradient near the bf16 step's from the same weights, pack and anchors,
   and its losses near the bf16 step's (a smoke check: at this init the loss is ~log V and
   hardly moves in 3 steps; convergence is benchmarks/fp8_drafter_curve.py's).

Skipped without CUDA (conftest.py) and without FP8 tensor cores; run on an H200:
    python -m pytest -q -s tests/model/test_fp8_training_gpu.py
"""

from __future__ import annotations

import json

import pytest
import torch

from dflash_async.bench.drafter_bench import SHAPES, build_step, synthetic_pack
from dflash_async.kernels.fp8_format import rowwise_kernel_problem
from dflash_async.model import fp8_training
from dflash_async.model.fp8_training import Fp8TrainingLinear, fp8_matmul

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(
        torch.cuda.is_available() and rowwise_kernel_problem(torch.device("cuda", 0)) is not None,
        reason="needs FP8 tensor cores (compute capability >= 8.9)",
    ),
]

M, K, N = 4000, 1024, 768  # M not a multiple of 16: only K and N must be


def _skewed(rows: int, cols: int, seed: int) -> torch.Tensor:
    """bf16 Gaussian values times log-normal row and column magnitudes, on the GPU."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, cols, generator=g)
    values *= torch.exp(1.5 * torch.randn(rows, 1, generator=g))
    values *= torch.exp(1.5 * torch.randn(1, cols, generator=g))
    return values.to("cuda", torch.bfloat16)


def _run(x, w, dy, *, kernel: bool):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_matmul(x, w, kernel=kernel)
    y.backward(dy)
    return {"y": y.detach(), "grad_x": x.grad, "grad_w": w.grad}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(scope="module")
def operands():
    return _skewed(M, K, 0), _skewed(N, K, 1) * 0.05, _skewed(M, N, 2)


@pytest.mark.parametrize(
    "fast_accum, limit",
    [(False, 2.0**-7), (True, 2.0**-6)],
    ids=["fp32_accumulation", "fast_accumulation"],
)
def test_the_kernel_is_near_the_reference(operands, monkeypatch, fast_accum, limit) -> None:
    """fast_accum: the forward's (FORWARD_FAST_ACCUM, on in the product); grad_x always
    accumulates in fp32 (GRADIENT_FAST_ACCUM)."""
    assert fp8_training.FORWARD_FAST_ACCUM and not fp8_training.GRADIENT_FAST_ACCUM
    monkeypatch.setattr(fp8_training, "FORWARD_FAST_ACCUM", fast_accum)
    x, w, dy = operands
    kernel, reference = _run(x, w, dy, kernel=True), _run(x, w, dy, kernel=False)
    relative = {k: _relative(kernel[k], reference[k]) for k in ("y", "grad_x")}
    print(
        json.dumps(
            {"check": "fp8_training_kernel_vs_reference", "fast_accum": fast_accum, **relative}
        )
    )
    assert relative["y"] < limit, relative
    assert relative["grad_x"] < 2.0**-7, relative
    torch.testing.assert_close(kernel["grad_w"], reference["grad_w"], rtol=0, atol=0)


def _losses(step, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        step.phase_a()
        step.phase_b()
        losses.append(float(step.stats[0] / step.stats[1]))  # sync point: test only
    return losses


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_the_compiled_captured_step_with_fp8_matmuls_replays_near_the_bf16_step(kind) -> None:
    """The product's GPU step (compiled layers, compiled update, bf16 working copies, flex
    attention) with FP8 linears, captured with capture_error_mode="global", against the bf16
    step from the same weights, pack and anchors (build_step seeds both alike; the capture's
    warm-up draws no anchors). Gradient: cosine above 0.9, an estimate with margin, not a bound:
    a relative gradient error r gives a cosine of about 1 - r^2 / 2, and r is expected near the
    e4m3 rounding of the few FP8 matmuls a weight's gradient passes through (2^-4 per operand,
    r of a few tenths at the very worst, so a cosine ~0.99 or above is expected); a wrong
    transpose, scale or sign in the backward gives a cosine near 0. Losses: within 2% and not
    equal (FP8 ran)."""
    import dataclasses

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    config = SHAPES["small"]()
    if kind == "dflash2":
        config = dataclasses.replace(config, kind="dflash2")
    flex_fn = torch.compile(torch.nn.attention.flex_attention.flex_attention, dynamic=False)
    pack = synthetic_pack(config, token_budget=4096, num_docs=4, device=device)
    losses, grads = {}, {}
    for fp8 in (False, True):
        torch._dynamo.reset()
        step = build_step(
            config,
            token_budget=4096,
            num_anchors=256,
            device=device,
            attention="flex",
            flex_fn=flex_fn,
            compile=True,
            fp8_matmuls=fp8,
        )
        linears = [m for m in step.objective.drafter.modules() if isinstance(m, torch.nn.Linear)]
        if fp8:
            assert all(type(m) is Fp8TrainingLinear and m.fp8_kernel for m in linears)
        assert any(w is not None for w in step.working)  # the working copies are on
        step.batch.copy_(pack)
        step.capture(warmup_steps=2, error_mode="global")
        step.phase_a()
        grads[fp8] = step.flat_grad.float().clone()
        step.phase_b()
        losses[fp8] = [float(step.stats[0] / step.stats[1])]  # sync point: test only
        losses[fp8] += _losses(step, 2)
        assert torch.isfinite(step.stats).all() and step.schedule.step.item() == 3
        del step
        torch.cuda.empty_cache()
    cosine = torch.nn.functional.cosine_similarity(grads[False], grads[True], dim=0).item()
    print(
        json.dumps(
            {
                "check": "fp8_training_captured_step",
                "kind": kind,
                "grad_cosine": cosine,
                "bf16": losses[False],
                "fp8": losses[True],
            }
        )
    )
    assert cosine > 0.9, cosine
    assert losses[True] != losses[False]
    for a, b in zip(losses[False], losses[True], strict=True):
        assert abs(a - b) / a < 0.02, losses
