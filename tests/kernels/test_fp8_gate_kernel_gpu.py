"""kernels/fp8_gate_kernel.py's SiLU gate with its row-wise e4m3 quantization equals the torch
reference (`quantize_rows(silu(gate) * up)` in fp32, what the compiled `_gated_rows` computes) on
a GPU: the e4m3 rows and their scales, at shapes with padded columns and a partial program, with
an all-zero row and saturating rows; the comparison fails on purpose-made mutants; and the FP8
experts give the same output with the kernel as with the compiled torch gate; the kernel
without its gate (`quantize_rows_kernel`) equals `quantize_rows`. Skipped without
CUDA (triton is never installed on the CPU machines); run on an H200. Not under Triton's CPU
interpreter: its e4m3 cast is not the GPU's round-to-nearest (triton 3.6 rounded 7.97 to 4.0),
though the values before the cast and the scales equal the reference's there."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from target_kit import seeded_experts

from dflash_async.kernels.fp8_format import quantize_rows
from dflash_async.targets.fp8.fp8_experts import _gated_rows
from dflash_async.targets.grouped_experts import gated

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# Tolerance, on the dequantized rows (q * scale), relative Frobenius norm. Both compute
# silu(g) * u and the scale in fp32 with the same operations; the kernel's exp is within
# ~|x| * 2^-23 relative (|x| <= ~16 here: <= 2^-19), its division within 2 ulp and its product
# by 448 / amax within 1.5 ulp of torch's quotient: a scaled value moves by <= ~2^-19 relative,
# and its e4m3 rounding (steps of 2^-3 relative) flips only within that distance of a midpoint:
# a fraction <= ~2^-19 / 2^-4 = 2^-15 of the values, each off by one step: <= sqrt(2^-15) *
# 2^-3 ~ 7e-4 on the norm. 2e-3 leaves room; every mutant below is off by more than 0.1.
DEQUANT_RTOL = 2e-3
SCALE_RTOL = 2.0**-18  # a row's amax: the same value up to that 2^-19, then torch's division


def _h(rows: int, width: int, seed: int = 0) -> torch.Tensor:
    """A grouped gate_up output [rows, 2 * width] in bf16: random rows at scale 3, row 1 all
    zero (scale 1), row 2 with one value far above the rest (the others round to e4m3's
    subnormals)."""
    g = torch.Generator("cuda").manual_seed(seed)
    h = torch.randn(rows, 2 * width, generator=g, device="cuda") * 3
    h[1] = 0.0
    h[2, :width] = 1e-3
    h[2, 0] = 40.0
    return h.to(torch.bfloat16)


def reference(h: torch.Tensor):
    """The function the kernel replaces, on the rows in fp32."""
    return _gated_rows(h.float(), F.silu)


def _dequantized(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.unsqueeze(-1)


def _mismatches(got, want) -> list[str]:
    (q, scale), (want_q, want_scale) = got, want
    if q.shape != want_q.shape or q.dtype != want_q.dtype or scale.shape != want_scale.shape:
        return [
            f"{q.dtype} {tuple(q.shape)}, {tuple(scale.shape)} vs "
            f"{want_q.dtype} {tuple(want_q.shape)}, {tuple(want_scale.shape)}"
        ]
    problems = []
    scale_error = float(((scale - want_scale).abs() / want_scale).max())
    if scale_error > SCALE_RTOL:
        problems.append(f"scales off by {scale_error:.3g} (relative)")
    deq, want_deq = _dequantized(q, scale), _dequantized(want_q, want_scale)
    error = float((deq - want_deq).norm() / want_deq.norm())
    if error > DEQUANT_RTOL:
        problems.append(f"dequantized rows off by {error:.3g} (relative norm)")
    return problems


SHAPES = {  # (rows, I)
    "Qwen3-30B-A3B width, partial program": (1027, 768),  # I padded to 1024 columns
    "narrow": (64, 96),
    "one row per expert group": (5, 16),
}


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPES)
def test_the_gate_kernel_equals_the_torch_reference(shape: str) -> None:
    from dflash_async.kernels.fp8_gate_kernel import silu_gate_quantize

    h = _h(*SHAPES[shape])
    got, want = silu_gate_quantize(h), reference(h)
    assert _mismatches(got, want) == []
    assert float(got[1][1]) == 1.0  # the all-zero row
    assert float(got[0][2].float().abs().max()) == 448.0  # a row's amax lands on e4m3's max


@pytest.mark.parametrize("launch", [(1, 2), (16, 8)], ids=["1 row 2 warps", "16 rows 8 warps"])
def test_every_launch_of_the_gate_kernel_computes_the_same(launch) -> None:
    from dflash_async.kernels.fp8_gate_kernel import silu_gate_quantize

    h = _h(*SHAPES["Qwen3-30B-A3B width, partial program"])
    rows, warps = launch
    got = silu_gate_quantize(h, rows_per_program=rows, num_warps=warps)
    assert _mismatches(got, reference(h)) == []


def _tie_flips(got, want, x: torch.Tensor) -> list[str]:
    """Where the kernel's e4m3 values differ from quantize_rows' (`want`, of the rows x), the
    exact scaled value x / scale must sit at a rounding midpoint of the two (within the
    kernel's product by 448 / amax, 1.5 fp32 ulp: 2^-22 relative; say 2^-20), the two e4m3
    values neighbours of one sign. bf16 rows hit e4m3 midpoints often (a bf16 value has 8
    mantissa bits, a midpoint 4), so unlike the gate's fp32 values they flip in a few percent
    of places: ties the two roundings break differently, each within half a step."""
    (q, scale), (want_q, want_scale) = got, want
    # the kernel's scale is amax / 448 rounded once; torch's eager CUDA division by a scalar
    # multiplies by its rounded reciprocal (two roundings): within one ulp, 2^-23 relative
    if not torch.allclose(scale, want_scale, rtol=2.0**-23, atol=0):
        return ["scales differ by more than an ulp"]
    differ = q.view(torch.uint8) != want_q.view(torch.uint8)
    bits, want_bits = q.view(torch.uint8)[differ].int(), want_q.view(torch.uint8)[differ].int()
    scaled = (x.double() / scale.double().unsqueeze(-1))[differ]
    midpoint = (q.double()[differ] + want_q.double()[differ]) / 2
    problems = []
    if ((bits - want_bits).abs() != 1).any():  # e4m3 codes of one sign are ordered by value
        problems.append("a value differs by more than one e4m3 step")
    if ((scaled - midpoint).abs() > 2.0**-20 * scaled.abs()).any():
        problems.append("a value off where torch's rounding was not a tie")
    return problems


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPES)
def test_the_row_quantization_kernel_equals_quantize_rows_but_at_ties(shape: str) -> None:
    """The kernel without its gate: quantize_rows of the bf16 rows, the same scales (within an
    ulp), the same e4m3 values but at rounding ties (`_tie_flips`)."""
    from dflash_async.kernels.fp8_gate_kernel import quantize_rows_kernel

    h = _h(*SHAPES[shape])
    got = quantize_rows_kernel(h)
    assert _tie_flips(got, quantize_rows(h.float()), h.float()) == []
    assert _tie_flips(got, _one_scale_rows(h), h.float()) != []  # a mutant


def _swapped_halves(h):
    """Mutant: silu(up) * gate."""
    return reference(h.roll(h.shape[1] // 2, dims=1))


def _no_silu(h):
    """Mutant: gate * up."""
    return _gated_rows(h.float(), lambda gate: gate)


def _neighbour_scale(h):
    """Mutant: each row quantized with the previous row's scale (a scale applied to the wrong
    row)."""
    values = gated(h.float(), F.silu)
    _, scale = quantize_rows(values)
    scale = scale.roll(1)
    q = (values / scale.unsqueeze(-1)).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scale


def _one_scale(h):
    """Mutant: one scale for all rows (the largest), as if scales were shared across tokens."""
    values = gated(h.float(), F.silu)
    q, scale = quantize_rows(values.flatten().unsqueeze(0))
    return q.view(values.shape), scale.expand(values.shape[0]).contiguous()


def _one_scale_rows(x):
    """Mutant of the plain quantization: one scale for all rows."""
    q, scale = quantize_rows(x.float().flatten().unsqueeze(0))
    return q.view(x.shape), scale.expand(x.shape[0]).contiguous()


MUTANTS = {
    f.__name__.strip("_"): f for f in (_swapped_halves, _no_silu, _neighbour_scale, _one_scale)
}


@pytest.mark.parametrize("mutant", MUTANTS)
def test_the_gate_comparison_catches_mutant(mutant: str) -> None:
    from dflash_async.kernels.fp8_gate_kernel import silu_gate_quantize

    h = _h(*SHAPES["narrow"])
    assert _mismatches(silu_gate_quantize(h), MUTANTS[mutant](h)) != []


@torch.no_grad()
def test_fp8_experts_give_the_same_output_with_the_gate_kernel_as_with_the_torch_gate() -> None:
    """The whole experts call (the sorted way), 16 experts of width 256 on 512 tokens, top 4:
    the two gates quantize the same values, so the outputs may differ only where an e4m3 value
    flipped (the tolerance above): within 2^-8 relative (one bf16 rounding of the output, with
    room)."""
    from transformers import Qwen3MoeConfig

    from dflash_async.targets.fp8.fp8_experts import Fp8Experts

    config = Qwen3MoeConfig(
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=1,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=256,
        vocab_size=256,
    )
    experts = seeded_experts(config)
    x = torch.randn(512, 512, device="cuda", dtype=torch.bfloat16)
    index = torch.randn(512, 16, device="cuda").topk(4).indices  # 4 distinct experts a token
    weights = torch.softmax(torch.randn(512, 4, device="cuda"), -1).to(torch.bfloat16)
    with_kernel = Fp8Experts(experts, out_dtype=torch.bfloat16, compile=True, way="sorted")
    with_torch = Fp8Experts(experts, out_dtype=torch.bfloat16, compile=True, gate_kernel=False)
    assert with_kernel._gated_rows is not with_torch._gated_rows
    got, want = with_kernel(x, index, weights).float(), with_torch(x, index, weights).float()
    assert float((got - want).norm() / want.norm()) <= 2.0**-8
