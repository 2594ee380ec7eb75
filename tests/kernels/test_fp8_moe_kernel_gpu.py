"""kernels/fp8_moe_kernel.py's routed grouped FP8 product equals fp8_routed.routed_reference (the
same contract in fp32 from the dequantized values) on a GPU, for the gate_up product (the token
rows gathered, the SiLU gate applied) and the down product (rows weighted and scattered to their routed pairs), at the
Qwen3-30B-A3B experts' shape and at a skewed routing with empty experts and partial blocks; every
launch the benchmarks time computes the same (the products' defaults among them); the comparison fails on purpose-made mutants; and
the FP8 experts' routed and split ways give what their sorted way (`torch._scaled_grouped_mm`)
gives.
Skipped without CUDA (triton is never installed on the CPU machines); run on an H200."""

from __future__ import annotations

import pytest
import torch
from target_kit import seeded_experts

from dflash_async.kernels import fp8_moe_launch
from dflash_async.kernels.fp8_format import quantize_rows
from dflash_async.targets.fp8 import fp8_routed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# Tolerance, per output row, relative norm. Both sum the same e4m3 products and apply the same
# fp32 scales, and round to bf16 once; the reference sums in exact fp32, the kernel the fast
# way (Hopper's FP8 MMA keeps fewer accumulator bits within a run of MMAs). Its error is the
# fast accumulation's: the kernel's ungated products equal `torch._scaled_grouped_mm`'s with
# fast accumulation bit for bit (benchmarks/fp8_experts_gpu.py), and both sit up to 2.4e-3
# (worst row, H200) from the fp32 reference at these shapes: 2^-8 (3.9e-3) for a product. The
# gated output silu(g) * u carries u's error and g's times silu's log-derivative (1 + g(1 -
# sigmoid(g)), within [-1.3, 1.3] for |g| <= 2.5 where these values weigh in a row's norm):
# <= ~2.3x a product's, 5.5e-3 before its bf16 rounding (measured 4.4e-3): 2^-7 (7.8e-3).
# A row the kernel did not write (garbage, or the reference's NaN) or wrote from a wrong
# expert, scale, half or weight is off by 0.05 or more (every mutant below).
ROW_RTOL = {False: 2.0**-8, True: 2.0**-7}  # by `gated`


def _experts(num_experts: int, n: int, k: int, seed: int):
    g = torch.Generator("cuda").manual_seed(seed)
    return quantize_rows(torch.randn(num_experts, n, k, generator=g, device="cuda") * 0.02)


def _routing(tokens: int, num_experts: int, k: int, *, skewed: bool, seed: int):
    """Distinct experts per token; `skewed`: most tokens go to the first experts and the last
    two get none (empty experts, partial blocks)."""
    g = torch.Generator("cuda").manual_seed(seed)
    logits = torch.randn(tokens, num_experts, generator=g, device="cuda")
    if skewed:
        logits[:, : num_experts // 4] += 3.0
        logits[:, -2:] = -1e4
    weights, index = torch.softmax(logits, -1).topk(k, dim=-1)
    return index, (weights / weights.sum(-1, keepdim=True)).to(torch.bfloat16)


SHAPES = {  # tokens, experts, k, d, I
    "Qwen3-30B-A3B experts": (2048, 128, 8, 2048, 768),
    "skewed, empty experts": (300, 16, 4, 256, 128),
}


def _problem(shape: str, launch=fp8_moe_launch.LAUNCH):
    tokens, num_experts, k, d, width = SHAPES[shape]
    index, weights = _routing(tokens, num_experts, k, skewed="skewed" in shape, seed=1)
    token, perm, offsets, blocks, pair_weights = fp8_routed.routed_rows(
        index,
        weights,
        num_experts=num_experts,
        block_rows=launch.block_rows,
        weight_dtype=torch.bfloat16,
    )
    g = torch.Generator("cuda").manual_seed(2)
    x_q, x_scale = quantize_rows(torch.randn(tokens, d, generator=g, device="cuda"))
    h_q, h_scale = quantize_rows(torch.randn(tokens * k, width, generator=g, device="cuda"))
    gate_up = (x_q, x_scale, *_experts(num_experts, 2 * width, d, 3), offsets, blocks)
    down = (h_q, h_scale, *_experts(num_experts, d, width, 4), offsets, blocks)
    return {
        "gate_up": (gate_up, {"a_rows": token, "gated": True}),
        "down": (down, {"out_rows": perm, "row_weights": pair_weights}),
    }


def _row_errors(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    want = want.float()
    return (got.float() - want).norm(dim=-1) / want.norm(dim=-1)


def _mismatches(got, want, *, gated: bool) -> str | None:
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{got.dtype} {tuple(got.shape)} vs {want.dtype} {tuple(want.shape)}"
    errors = _row_errors(got, want)
    worst = float(errors.nan_to_num(float("inf")).max())
    return None if worst <= ROW_RTOL[gated] else f"worst row off by {worst:.3g} (relative norm)"


@pytest.mark.parametrize("product", ["gate_up", "down"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPES)
def test_the_routed_kernel_equals_the_reference(shape: str, product: str) -> None:
    from dflash_async.kernels.fp8_moe_kernel import routed_mm

    launch = {"gate_up": fp8_moe_launch.GATE_UP_LAUNCH, "down": fp8_moe_launch.DOWN_LAUNCH}[product]
    args, routing = _problem(shape, launch)[product]
    got = routed_mm(*args, **routing, launch=launch)
    want = fp8_routed.routed_reference(*args, **routing, launch=launch)
    print(f"{shape} {product}: worst row {float(_row_errors(got, want).max()):.3g}")
    assert _mismatches(got, want, gated=product == "gate_up") is None


LAUNCHES = {  # the benchmark's other launches (benchmarks/fp8_experts_gpu.py)
    "128 columns, 4 stages": fp8_moe_launch.LAUNCH,
    "64 rows, 4 warps": fp8_moe_launch.Launch(block_rows=64, num_warps=4),
    "256 columns, 3 stages": fp8_moe_launch.Launch(block_n=256, num_stages=3),
    "64-wide reduction": fp8_moe_launch.Launch(block_k=64, num_stages=5),
}


@pytest.mark.parametrize("launch", LAUNCHES, ids=LAUNCHES)
def test_every_launch_of_the_routed_kernel_computes_the_same(launch: str) -> None:
    from dflash_async.kernels.fp8_moe_kernel import routed_mm

    ran = 0
    for product, (args, routing) in _problem("Qwen3-30B-A3B experts", LAUNCHES[launch]).items():
        gated = routing.get("gated", False)
        if fp8_moe_launch.launch_problem(args[2], LAUNCHES[launch], gated=gated):
            continue  # e.g. over a program's shared memory, gated: refused (the next test)
        got = routed_mm(*args, **routing, launch=LAUNCHES[launch])
        want = fp8_routed.routed_reference(*args, **routing, launch=LAUNCHES[launch])
        assert _mismatches(got, want, gated=gated) is None, product
        ran += 1
    assert ran >= 1


def test_a_launch_over_the_shared_memory_is_refused_before_triton_runs_it() -> None:
    from dflash_async.kernels.fp8_moe_kernel import routed_mm

    launch = fp8_moe_launch.Launch(block_n=256, num_stages=3)  # gated: 3 x 80 KiB
    args, routing = _problem("Qwen3-30B-A3B experts", launch)["gate_up"]
    with pytest.raises(ValueError, match="shared memory"):
        routed_mm(*args, **routing, launch=launch)


def _next_expert(args, routing):
    """Mutant: every block computed with the next expert's weights."""
    *head, (expert, start) = args
    num_experts = head[2].shape[0]
    expert = torch.where(expert < num_experts, (expert + 1) % num_experts, expert)
    return fp8_routed.routed_reference(*head, (expert, start), **routing)


def _late_blocks(args, routing):
    """Mutant: each block starting one row late (an expert's first row never written)."""
    *head, (expert, start) = args
    return fp8_routed.routed_reference(*head, (expert, start + 1), **routing)


def _neighbour_scale(args, routing):
    """Mutant: each row scaled by the previous token's (gate_up) or row's (down) scale."""
    a_q, a_scale, *rest = args
    return fp8_routed.routed_reference(a_q, a_scale.roll(1), *rest, **routing)


def _neighbour_rows(args, routing):
    """Mutant: each row gathered from (gate_up) or written to (down) its neighbour's row."""
    name = "a_rows" if "a_rows" in routing else "out_rows"
    return fp8_routed.routed_reference(*args, **{**routing, name: routing[name].roll(1)})


def _swapped_halves(args, routing):
    """Mutant: the gate_up product's halves swapped (silu(up) * gate)."""
    a_q, a_scale, w_q, w_scale, *rest = args
    half = w_q.shape[1] // 2
    swapped = w_q.view(torch.uint8).roll(half, dims=1).view(w_q.dtype)  # no e4m3 roll on CUDA
    return fp8_routed.routed_reference(
        a_q, a_scale, swapped, w_scale.roll(half, dims=1), *rest, **routing
    )


def _unweighted(args, routing):
    """Mutant: the down product's routing weights lost."""
    weights = routing.get("row_weights")
    ones = None if weights is None else torch.ones_like(weights)
    return fp8_routed.routed_reference(*args, **{**routing, "row_weights": ones})


MUTANTS = {
    f.__name__.strip("_"): f
    for f in (
        _next_expert,
        _late_blocks,
        _neighbour_scale,
        _neighbour_rows,
        _swapped_halves,
        _unweighted,
    )
}
ONLY = {"swapped_halves": ["gate_up"], "unweighted": ["down"]}


@pytest.mark.parametrize("mutant", MUTANTS)
def test_the_routed_comparison_catches_mutant(mutant: str) -> None:
    from dflash_async.kernels.fp8_moe_kernel import routed_mm

    for product in ONLY.get(mutant, ["gate_up", "down"]):
        args, routing = _problem("skewed, empty experts")[product]
        gated = routing.get("gated", False)
        got, want = routed_mm(*args, **routing), MUTANTS[mutant](args, routing)
        assert _mismatches(got, want, gated=gated), product


@torch.no_grad()
@pytest.mark.parametrize("way", ["routed", "split"])
def test_fp8_experts_give_the_same_output_every_way(way: str) -> None:
    """The whole experts call at the Qwen3-30B-A3B width on 1024 tokens, top 8: the routed and
    the split way (the default on a GPU; both start with the routed kernel's gate_up product)
    against the sorted way (`torch._scaled_grouped_mm`). The gate's values differ by a bf16
    rounding (2^-9 relative; the sorted way rounds gate and up, the routed kernel
    silu(gate) * up) before both quantize them to e4m3, whose steps are 2^-3..2^-4 of a value:
    a value within 2^-9 of a midpoint rounds the other way, a fraction of about
    2 * 2^-9 / 2^-3.5 ~ 4% of them, each by one step, ~0.09 of it: sqrt(0.04) * 0.09 ~ 0.018 on
    the gate's norm, and so on the output (measured 0.0177; the FP8 output's own distance from
    bf16 is 0.065). Within 2^-5; a wrong expert, row or weight moves it by ~1."""
    from transformers import Qwen3MoeConfig

    from dflash_async.targets.fp8.fp8_experts import Fp8Experts

    config = Qwen3MoeConfig(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=1,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        vocab_size=256,
    )
    experts = seeded_experts(config)
    x = torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16)
    index, weights = _routing(1024, 128, 8, skewed=False, seed=5)
    fp8 = Fp8Experts(experts, out_dtype=torch.bfloat16, way=way)
    sorted_ = Fp8Experts(experts, out_dtype=torch.bfloat16, way="sorted")
    got, want = fp8(x, index, weights).float(), sorted_(x, index, weights).float()
    error = float((got - want).norm() / want.norm())
    print(f"{way} against sorted: {error:.3g}")
    assert error <= 2.0**-5


def test_the_split_way_is_the_default_on_a_gpu() -> None:
    from transformers import Qwen3MoeConfig

    from dflash_async.kernels.fp8_moe_kernel import routed_mm
    from dflash_async.targets.fp8.fp8_experts import Fp8Experts

    config = Qwen3MoeConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
        vocab_size=256,
    )
    fp8 = Fp8Experts(seeded_experts(config), out_dtype=torch.bfloat16)
    assert (fp8.way, fp8._routed_mm) == ("split", routed_mm)
