"""kernels/conv_kernel.py's Triton convolution equals the reference (kinds/dflash2/drafter.block_causal_conv) on a
GPU: the output and the gradients of h, of the dynamic taps (through the [A, B, 2, K, G] slice the
layer passes) and of the static taps, eager and inside a compiled graph; and the comparison fails
on purpose-made mutants of the reference. Skipped without CUDA (triton is never installed on the
CPU machines); run on an H200. With triton installed and TRITON_INTERPRET=1, the eager tests
also run on a CPU under Triton's interpreter (how the kernels were first checked)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

from dflash_async.model.kinds.dflash2.drafter import block_causal_conv

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or INTERPRETED), reason="needs CUDA (or Triton's interpreter)"
)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# Tolerances, relative Frobenius norm ||kernel - reference|| / ||reference|| per tensor.
# fp32 inputs: both sum the same K products (or a group's S, or the A*B rows of the static taps)
# in fp32 in different orders: each sum is within n * 2^-24 of the exact one relative to the sum
# of its terms' magnitudes (n <= 16384 rows for the static taps: ~1e-3 worst case, ~sqrt(n) *
# 2^-24 ~ 1e-5 typical for these random terms); 1e-5 on the norm has room and catches mutants
# that change even one tap of one row per block (relative ~0.1 and above, below).
FP32_RTOL = 1e-5
# bf16 inputs (the step's dtype): the reference runs in fp32 on the same bf16 values, the kernel
# accumulates in fp32 and rounds each output once to bf16 (8 significant bits): every element
# within 2^-9 of its value relative, so the norm too; 2^-8 leaves a factor of 2.
BF16_RTOL = 2.0**-8


def _inputs(blocks: int, block: int, d: int, taps: int, group: int, dtype, seed: int = 0):
    """h [A, B, d], the layer's dynamic kernels [A, B, 2, K, G] (side 1 taken), base [K, d]
    (fp32, as the parameter), an output gradient; all but the gradient require grad."""
    g = torch.Generator(DEVICE).manual_seed(seed)

    def randn(*shape, dtype=dtype):
        return torch.randn(*shape, generator=g, device=DEVICE, dtype=dtype)

    h = randn(blocks, block, d).requires_grad_()
    dyn = randn(blocks, block, 2, taps, d // group).requires_grad_()
    base = randn(taps, d, dtype=torch.float32).requires_grad_()
    return h, dyn, base, randn(blocks, block, d)


def _run(conv, h, dyn, base, grad, *, upcast: bool = False):
    """conv's output and the gradients of h, dyn (the whole [A, B, 2, K, G]) and base; upcast:
    run it in fp32 on the same values (the reference for bf16 inputs)."""
    leaves = [x.detach().float().requires_grad_() if upcast else x for x in (h, dyn, base)]
    h_, dyn_, base_ = leaves
    out = conv(h_, dyn_[:, :, 1], base_)
    grads = torch.autograd.grad(out, leaves, grad.float() if upcast else grad)
    return (out, *grads)


def _mismatches(got, want, rtol: float) -> list[str]:
    problems = []
    for name, x, y in zip(("out", "grad_h", "grad_dyn", "grad_base"), got, want, strict=True):
        if x.shape != y.shape:
            problems.append(f"{name} {tuple(x.shape)} vs {tuple(y.shape)}")
            continue
        error = float((x.detach().float() - y.detach().float()).norm() / y.detach().float().norm())
        if not error <= rtol:
            problems.append(f"{name} off by {error:.3g} (relative norm)")
    return problems


SHAPES = {  # (A, B, d, K, group size)
    "step-like": (64, 16, 512, 2, 16),
    "block 8, three taps": (33, 8, 256, 3, 16),  # A not a multiple of the backward's 8 blocks
    "block 6, group 8": (5, 6, 64, 2, 8),  # B below a power of two: masked rows
    "groups of 128": (4, 16, 256, 2, 128),  # groups wider than the launch's 64-channel tile
}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPES)
def test_triton_conv_equals_the_reference_in_fp32(shape: str) -> None:
    from dflash_async.kernels.conv_kernel import triton_block_conv

    inputs = _inputs(*SHAPES[shape], dtype=torch.float32)
    got = _run(triton_block_conv(), *inputs)
    assert _mismatches(got, _run(block_causal_conv, *inputs), FP32_RTOL) == []


@pytest.mark.gpu
def test_triton_conv_equals_the_reference_in_bf16_with_bf16_gradients() -> None:
    from dflash_async.kernels.conv_kernel import triton_block_conv

    inputs = _inputs(128, 16, 1024, 2, 16, dtype=torch.bfloat16)
    got = _run(triton_block_conv(), *inputs)
    assert [t.dtype for t in got] == [torch.bfloat16] * 3 + [torch.float32]
    assert _mismatches(got, _run(block_causal_conv, *inputs, upcast=True), BF16_RTOL) == []


def _crossing(h, dyn, base):
    """Mutant: the shift runs over the flattened rows, so tap o of a block's first rows reads
    the previous block's last ones."""
    num_blocks, block, d = h.shape
    flat = block_causal_conv(h.reshape(1, -1, d), dyn.reshape(1, -1, *dyn.shape[2:]), base)
    return flat.view(num_blocks, block, d)


def _taps_swapped(h, dyn, base):
    """Mutant: dynamic tap o applied to the shift K-1-o."""
    return block_causal_conv(h, dyn.flip(2), base)


def _groups_shifted(h, dyn, base):
    """Mutant: each channel reads the dynamic kernel of the next group."""
    return block_causal_conv(h, dyn.roll(1, dims=3), base)


def _no_dynamic_part(h, dyn, base):
    """Mutant: the static taps alone (the dynamic kernels dropped, their gradient 0)."""
    return block_causal_conv(h, dyn * 0, base)


def _anticausal(h, dyn, base):
    """Mutant: taps read h[t+o] instead of h[t-o]."""
    return block_causal_conv(h.flip(1), dyn.flip(1), base).flip(1)


MUTANTS = {
    f.__name__.strip("_"): f
    for f in (_crossing, _taps_swapped, _groups_shifted, _no_dynamic_part, _anticausal)
}


@pytest.mark.gpu
@pytest.mark.parametrize("mutant", MUTANTS, ids=MUTANTS)
def test_the_conv_comparison_catches_mutant(mutant: str) -> None:
    from dflash_async.kernels.conv_kernel import triton_block_conv

    inputs = _inputs(*SHAPES["step-like"], dtype=torch.float32)
    got = _run(triton_block_conv(), *inputs)
    assert _mismatches(got, _run(MUTANTS[mutant], *inputs), FP32_RTOL) != []


@pytest.mark.gpu
@needs_cuda
def test_a_compiled_graph_runs_the_kernels_and_equals_the_reference() -> None:
    """fullgraph=True: the custom ops trace into the graph (no break), and the compiled
    function with a norm before and a residual after (as in the layer) equals the eager
    reference in fp32."""
    from dflash_async.kernels.conv_kernel import triton_block_conv

    def layer_like(conv, h, dyn, base):
        return h + conv(F.rms_norm(h, (h.shape[-1],)), dyn, base)

    torch._dynamo.reset()
    conv = triton_block_conv()
    compiled = torch.compile(
        lambda h, dyn, base: layer_like(conv, h, dyn, base),
        fullgraph=True,
        dynamic=False,
    )
    inputs = _inputs(*SHAPES["step-like"], dtype=torch.float32)
    reference = _run(lambda h, dyn, base: layer_like(block_causal_conv, h, dyn, base), *inputs)
    assert _mismatches(_run(compiled, *inputs), reference, FP32_RTOL) == []
