"""kernels/ce_kernel.py's Triton CE pass equals the reference (objective.ce_and_grad_from_logits)
on a GPU: the loss sum, the argmax hits (ties to the lowest index) and the bf16 gradient, with
untrained rows exactly 0; and the comparison fails on purpose-made mutants of the reference.
Skipped without CUDA (triton is never installed on the CPU machines); run on an H200."""

from __future__ import annotations

import pytest
import torch

from dflash_async.model.objective import ce_and_grad_from_logits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
ROWS, VOCAB = 64, 151936  # Qwen3's vocabulary: 37 loop blocks of 4096 and a partial one
# Tolerances. Both compute in fp32 from the same bf16 logits; they differ only in summation
# order (the logsumexp: relative error <= ~V u with u = 2^-24 in the worst case, ~sqrt(V) u
# typically, <= 1e-4 relative on lse) and in exp's implementation (a few ulp). Each gradient
# element is then rounded to bf16 (8 significant bits) once by each: at most 1 bf16 ulp apart,
# <= 2^-7 relative to its magnitude; 1e-12 absolute covers values below fp32's normal range,
# which one exp may flush to 0. The loss sum adds ROWS terms each within 1e-4 relative.
LOSS_RTOL = 1e-4
GRAD_RTOL = 2.0**-7


def _inputs(seed: int = 0):
    g = torch.Generator("cuda").manual_seed(seed)
    logits = (torch.randn(ROWS, VOCAB, generator=g, device="cuda") * 4).to(torch.bfloat16)
    labels = torch.randint(0, VOCAB, (ROWS,), generator=g, device="cuda")
    labels[0], labels[1] = 0, VOCAB - 1  # the first and the last column
    labels[2] = logits[2].float().argmax()  # a hit
    logits[3, 17] = logits[3, VOCAB - 5] = 60.0  # a tie: the first index is the argmax
    labels[3] = 17
    logits[4, 100] = logits[4, 9000] = 60.0  # the same tie, labelled at the second
    labels[4] = 9000
    weights = torch.rand(ROWS, generator=g, device="cuda", dtype=torch.float64)
    weights[5:9] = 0.0  # untrained rows
    return logits, labels, weights


def _mismatches(out, ref) -> list[str]:
    """What differs beyond the derived tolerances (empty: equal)."""
    (ce, hit, grad), (ce_ref, hit_ref, grad_ref) = out, ref
    problems = []
    if abs(float(ce) - float(ce_ref)) > LOSS_RTOL * abs(float(ce_ref)):
        problems.append(f"loss {float(ce)} vs {float(ce_ref)}")
    if not torch.equal(hit, hit_ref):
        problems.append(f"hits differ at rows {torch.nonzero(hit != hit_ref).flatten().tolist()}")
    if grad.dtype != grad_ref.dtype or grad.shape != grad_ref.shape:
        problems.append(f"grad {grad.dtype} {tuple(grad.shape)}")
    else:
        diff = (grad.float() - grad_ref.float()).abs()
        bound = GRAD_RTOL * grad_ref.float().abs() + 1e-12
        if (diff > bound).any():
            problems.append(f"grad off by up to {float(diff.max()):.3g}")
    return problems


def test_triton_ce_pass_equals_the_reference() -> None:
    from dflash_async.kernels.ce_kernel import ce_and_grad_triton

    logits, labels, weights = _inputs()
    out = ce_and_grad_triton(logits, labels, weights)
    ref = ce_and_grad_from_logits(logits, labels, weights)
    assert _mismatches(out, ref) == []
    assert out[1][2] and out[1][3] and not out[1][4]  # hit, tie at the label, tie past it
    assert (out[2][5:9] == 0).all()


def test_triton_ce_pass_keeps_non_finite_logits_of_untrained_rows_out() -> None:
    """An inf logit in a row of weight 0: its loss and gradient are exactly 0 (selected)."""
    from dflash_async.kernels.ce_kernel import ce_and_grad_triton

    logits, labels, weights = _inputs(seed=1)
    logits[6, 33] = float("inf")
    ce, _, grad = ce_and_grad_triton(logits, labels, weights)
    assert torch.isfinite(ce) and (grad[6] == 0).all()
    clean = weights > 0
    ref = ce_and_grad_from_logits(logits[clean], labels[clean], weights[clean])
    assert abs(float(ce) - float(ref[0])) <= LOSS_RTOL * abs(float(ref[0]))


def _labels_shifted(logits, labels, weights):
    return ce_and_grad_from_logits(logits, (labels + 1) % VOCAB, weights)


def _unweighted(logits, labels, weights):
    return ce_and_grad_from_logits(logits, labels, (weights > 0).to(weights.dtype))


def _ties_to_the_last(logits, labels, weights):
    ce, _, grad = ce_and_grad_from_logits(logits, labels, weights)
    last = VOCAB - 1 - logits.float().flip(-1).argmax(-1)
    return ce, last == labels, grad


def _lse_off(logits, labels, weights):
    ce, hit, grad = ce_and_grad_from_logits(logits.float() + 1e-2, labels, weights)
    return ce * 1.001, hit, grad.to(torch.bfloat16)


@pytest.mark.parametrize("mutant", [_labels_shifted, _unweighted, _ties_to_the_last, _lse_off])
def test_ce_pass_comparison_catches_mutant(mutant) -> None:
    logits, labels, weights = _inputs()
    ref = ce_and_grad_from_logits(logits, labels, weights)
    assert _mismatches(mutant(logits, labels, weights), ref) != []


@pytest.mark.parametrize(("vocab", "width"), [(VOCAB, 128), (248320, 256)])
def test_triton_ce_pass_with_group_maxima_equals_the_reference_pass(vocab, width) -> None:
    """DFlash2's launch (ce_grad_and_group_max_triton): the CE outputs within the tolerances
    above and the group maxima exactly (a maximum of bf16 values is one of them), on Qwen3's
    vocabulary (1187 groups of 128; its last loop block is partial) and a 248k one (970 of 256);
    maxima one group off, or of groups starting half a group off, would not be equal."""
    from dflash_async.kernels.ce_kernel import ce_grad_and_group_max_triton
    from dflash_async.model.kinds.dflash2.grouped_topk import group_maxima
    from dflash_async.model.kinds.dflash2.objective import ce_grad_and_group_max

    g = torch.Generator("cuda").manual_seed(2)
    logits = (torch.randn(ROWS, vocab, generator=g, device="cuda") * 4).to(torch.bfloat16)
    logits[0, vocab - 1] = 50.0  # the last column: the last group's maximum, in the partial block
    labels = torch.randint(0, vocab, (ROWS,), generator=g, device="cuda")
    weights = torch.rand(ROWS, generator=g, device="cuda", dtype=torch.float64)
    weights[5:9] = 0.0  # untrained rows still get their maxima
    *ce, maxima = ce_grad_and_group_max_triton(logits, labels, weights, group_width=width)
    *ce_ref, maxima_ref = ce_grad_and_group_max(logits, labels, weights, group_width=width)
    assert _mismatches(tuple(ce), tuple(ce_ref)) == []
    assert maxima.dtype == logits.dtype and torch.equal(maxima, maxima_ref)
    assert not torch.equal(maxima, maxima_ref.roll(1, dims=-1))
    half_off = group_maxima(logits.roll(width // 2, dims=-1), width)  # groups half a group off
    assert not torch.equal(maxima, half_off)
    with pytest.raises(ValueError, match="must divide"):
        ce_grad_and_group_max_triton(logits, labels, weights, group_width=width + 1)
