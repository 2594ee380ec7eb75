"""GPU parity of the drafter step's kernel variants (bench/drafter_bench.py VARIANTS) with today's
path: one step's loss and gradients, then a 20-step trajectory replayed as CUDA graphs, all in a
worker thread (as the pipeline runs it). Skipped without CUDA; run on an H200."""

from __future__ import annotations

import dataclasses
import json
import threading

import pytest
import torch

from dflash_async.bench.drafter_bench import SHAPES, VARIANTS, build_step, synthetic_pack
from dflash_async.model.objective import sample_anchors
from dflash_async.model.step import STATS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
T, A, STEPS = 4096, 256, 20
# Tolerances. A variant changes how a kernel tiles or orders its work, never its math: each bf16
# result it produces (attention output, dq/dk/dv, logits) is rounded once in a different order,
# unit roundoff u = 2^-8 per element, from each of the 2 paths, in each of the 2 layers -> a
# per-element relative gradient difference r <= 8u; cosine >= 1 - r^2/2. The loss is a weighted
# mean of A x 15 CE terms with independent rounding signs, N_eff = 11 per anchor for
# w = exp(-(k-1)/7): relative loss difference <= 8u / sqrt(A * 11) (as tests/model/test_drafter_gpu.py).
# Over a trajectory each step adds at most one step's disagreement (earlier steps' weight
# differences are of that order too, and the loss moves smoothly with the weights at lr 6e-5 to
# 6e-4), so step k (from 0) is allowed (k + 1) times the one-step bound.
U = 2.0**-8


def _in_worker(fn):
    """fn() in a fresh thread on its own stream (the pipeline's device workers); re-raises."""
    out, errors = [], []

    def run() -> None:
        try:
            torch.cuda.set_device(0)
            with torch.cuda.stream(torch.cuda.Stream(0)):
                out.append(fn())
        except BaseException as error:  # re-raised in the test's thread below
            errors.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return out[0]


def _run(variant: str, *, compile: bool = False, kind: str = "dflash") -> dict:
    """One step's loss and gradients at fixed anchors, then 20 graph-replayed steps' losses.
    compile: the drafter's layers compiled as the GPU default runs them (compile_layers);
    kind: the drafter's (dflash2: the small shape with its convolutions and selector)."""
    # each variant compiles the same functions anew: past dynamo's recompile limit (8) they
    # would silently run eagerly, and eager flex_attention cannot be captured
    torch._dynamo.reset()
    device = torch.device("cuda", 0)
    config = dataclasses.replace(SHAPES["small"](), kind=kind)
    options = {"ce_chunk_size": 2048, **VARIANTS[variant]}
    step = build_step(
        config,
        token_budget=T,
        num_anchors=A,
        device=device,
        attention="flex",
        seed=0,
        compile=compile,
        **options,
    )
    pack = synthetic_pack(config, token_budget=T, num_docs=4, device=device)
    pack.loss_mask[100:300] = False  # some unsupervised spans
    step.batch.copy_(pack)
    anchors = sample_anchors(
        pack.loss_mask, pack.doc_ids, A, torch.Generator(device).manual_seed(0)
    )
    # one eager step of the step's own forward and backward (its flat buffer: d sum(w*CE) /
    # d params, in the step's gradient dtype) at fixed anchors
    step.anchor_sampler = lambda _batch: anchors
    step.phase_a()
    first = dict(zip(STATS, step.stats.tolist(), strict=True))  # sync point: test only
    loss, grads = first["ce_sum"] / first["weight_sum"], step.flat_grad.float().clone()
    step.anchor_sampler = None
    step.generator = torch.Generator(device).manual_seed(1234)
    step.capture(warmup_steps=2)  # restores weights, AdamW state and the schedule
    losses = []
    for _ in range(STEPS):
        step.phase_a()
        step.phase_b()
        stats = dict(zip(STATS, step.stats.tolist(), strict=True))  # sync point: test only
        losses.append(stats["ce_sum"] / stats["weight_sum"])
    return {"loss": loss, "grads": grads, "losses": losses}


@pytest.fixture(scope="module")
def today() -> dict:
    return _in_worker(lambda: _run("today"))


# conv_*: DFlash2's convolutions, which a DFlash step does not have (their own test below)
@pytest.mark.parametrize(
    "variant", [v for v in VARIANTS if v != "today" and not v.startswith("conv_")]
)
def test_variant_equals_todays_step_in_loss_gradients_and_trajectory(variant, today) -> None:
    if variant == "flex_flash":  # flash-attn-4 is optional (the device has it only when carried)
        pytest.importorskip("flash_attn.cute")
    _assert_equal_within_bf16(_in_worker(lambda: _run(variant)), today, variant)


def test_compiled_layers_equal_the_eager_step_in_loss_gradients_and_trajectory(today) -> None:
    """compile_layers() (each layer one graph with its attention, the compiled norms) against
    the same step with eager layers: the kernels differ, the math does not."""
    compiled = _in_worker(lambda: _run("today", compile=True))
    # Tolerance: besides the attention's 8u (above), inductor rounds a fused elementwise chain to
    # bf16 once where eager rounds after each op: RoPE (mul, mul, add) and SwiGLU (silu, mul) give
    # up to 4 more roundings per element per layer and direction, r <= 8u + 2 * 2 * 4u = 24u;
    # 32u leaves a margin. Norms compute in fp32 and round once either way.
    _assert_equal_within_bf16(compiled, today, "compiled_layers", r=32 * U)


def test_dflash2_triton_convolutions_equal_the_compiled_torch_ones_in_the_step() -> None:
    """A compiled DFlash2 step with conv_kernel.py's kernels (the GPU default) against the same
    step with the torch convolutions compiled into the layers."""
    triton = _in_worker(lambda: _run("conv_triton", compile=True, kind="dflash2"))
    torch_ops = _in_worker(lambda: _run("conv_compiled", compile=True, kind="dflash2"))
    # Tolerance: both compute each convolution in fp32 and round its output to bf16 once, but
    # inductor fuses the torch one with the norm before it or the residual after it, where the
    # kernel's output is rounded at its own boundary: up to 2 more roundings per element for
    # each of a layer's 4 convolutions, each direction, 2 * 4 * 2u = 16u, plus the attention's
    # 8u above: r <= 24u; 32u leaves a margin (as for the compiled layers).
    _assert_equal_within_bf16(triton, torch_ops, "dflash2_conv_triton", r=32 * U)


def _assert_equal_within_bf16(new: dict, today: dict, variant: str, r: float = 8 * U) -> None:
    """Loss, gradients and trajectory within the bounds derived at the top of this file for a
    per-element relative gradient difference r (8u for a kernel variant)."""
    loss_rtol, grad_cosine = r / (A * 11) ** 0.5, 1 - r**2 / 2
    rel = abs(new["loss"] - today["loss"]) / abs(today["loss"])
    cosine = torch.nn.functional.cosine_similarity(new["grads"], today["grads"], dim=0).item()
    trajectory = [abs(a - b) / abs(b) for a, b in zip(new["losses"], today["losses"], strict=True)]
    print(
        json.dumps(
            {
                "check": "kernel_variant_parity",
                "variant": variant,
                "loss_rel_diff": rel,
                "grad_cosine": cosine,
                "max_trajectory_rel_diff": max(trajectory),
                "loss_first": new["losses"][0],
                "loss_last": new["losses"][-1],
            }
        )
    )
    assert rel < loss_rtol, rel
    assert cosine > grad_cosine, cosine
    for k, diff in enumerate(trajectory):
        assert diff < (k + 1) * loss_rtol, (k, diff)


def test_auto_picks_flash_here_only_when_untuned_and_for_half_precision() -> None:
    """On this GPU with flash-attn-4 installed, auto resolves to flash for the step's bf16
    attention, and to Triton when Triton tuning is set or the attention runs in fp32."""
    pytest.importorskip("flash_attn.cute")
    from dflash_async.model.attention_rule import FLASH_AUTO_MIN_TORCH, resolve_flex_backend

    if torch.torch_version.TorchVersion(torch.__version__) < FLASH_AUTO_MIN_TORCH:
        pytest.skip(f"auto takes flash from torch {FLASH_AUTO_MIN_TORCH}")
    cuda = torch.device("cuda", torch.cuda.current_device())
    assert resolve_flex_backend("auto", device=cuda) == "flash"
    assert resolve_flex_backend("auto", device=cuda, tunes_triton=True) == "triton"
    step = build_step(
        SHAPES["small"](), token_budget=1024, num_anchors=32, device=cuda, attention="flex"
    )
    assert step.objective.flex_backend == "flash"
    with torch.autocast("cuda", dtype=torch.bfloat16):  # as the step runs it
        assert step.objective._flex_options_for_this_call() == {"BACKEND": "FLASH"}
    assert step.objective._flex_options_for_this_call() == {}  # fp32 attention: Triton's
