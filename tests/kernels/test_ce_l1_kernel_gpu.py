"""kernels/ce_l1_kernel.py's Triton DSpark pass equals the closed-form reference
(kinds/dspark/objective.ce_l1_and_grad_from_logits) on a GPU: the per-row weighted CE and L1, the
argmax hits (ties to the lowest index), the acceptance and the bf16 gradient, with untrained rows
exactly 0 even where their logits are not finite; the comparison fails on purpose-made mutants
of the reference; and a DSpark step with the Triton pass equals one with the torch pass in loss,
gradients and trajectory. Skipped without CUDA (triton is never installed on the CPU machines)."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from dflash_async.model.kinds.dspark import objective as dspark_objective

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
ROWS, VOCAB = 64, 151936  # Qwen3's vocabulary: 74 loop blocks of 2048 and a partial one of 384
ALPHAS = (0.1, 0.9)  # ce, l1: the paper's
# Tolerances. Both compute in fp32 from the same bf16 logits and differ in summation order and
# exp's implementation only:
# - each logsumexp (of z and of t): a sum of V exps, relative error ~sqrt(V) u = 2.3e-5 with
#   u = 2^-24 (the typical bound, as tests/kernels/test_ce_kernel_gpu.py), the max exact, the
#   log and the add one ulp each (<= 4e-6 at |lse| < 32): LSE_ATOL = 1e-4 absolute, 4x margin;
# - so each p = exp(z - lse) and q within LSE_ATOL + a few ulp of exp relative: P_RTOL = 2e-4;
# - L1 = sum |p - q| within P_RTOL * sum (p + q) = 2 P_RTOL, plus its own sum of V terms
#   (SUM_RTOL = 1e-4 relative, 4x sqrt(V) u, of L1 <= 2): L1_ATOL = 2 P_RTOL + 2 SUM_RTOL;
# - s = sign(p - q) can differ only where the exact |p - q| <= 2 P_RTOL max(p, q) and p != q
#   (p == q exactly where z == t on both sides: one formula for p and q): there dz may differ by
#   2 w l1_alpha p; <s, p> by P_RTOL + SUM_RTOL + 2 (the p mass of those columns);
# - dz in fp32 then within E = w p (ce_alpha P_RTOL + l1_alpha (P_RTOL (1 + |<s,p>|) + the
#   <s, p> error)) (+ the flips), and each side rounds to bf16 once (<= 2^-8 relative): at most
#   2^-7 |ref| + 1.01 E apart; 1e-12 absolute covers values below fp32's normal range, which one
#   exp may flush to 0.
LSE_ATOL = 1e-4
P_RTOL = 2e-4
SUM_RTOL = 1e-4
L1_ATOL = 2 * P_RTOL + 2 * SUM_RTOL
GRAD_RTOL = 2.0**-7


def reference(z, t, labels, weights, alphas=ALPHAS):
    return dspark_objective.ce_l1_and_grad_from_logits(
        z, t, labels, weights, ce_alpha=alphas[0], l1_alpha=alphas[1]
    )


def triton_pass(z, t, labels, weights, **launch):
    from dflash_async.kernels.ce_l1_kernel import CE_L1_LAUNCH, ce_l1_and_grad_triton

    chosen = CE_L1_LAUNCH.__class__(**{**CE_L1_LAUNCH.__dict__, **launch})
    return ce_l1_and_grad_triton(
        z, t, labels, weights, ce_alpha=ALPHAS[0], l1_alpha=ALPHAS[1], launch=chosen
    )


def _inputs(seed: int = 0, rows: int = ROWS, vocab: int = VOCAB, dtype=torch.bfloat16):
    g = torch.Generator("cuda").manual_seed(seed)
    z = torch.randn(rows, vocab, generator=g, device="cuda") * 4
    t = torch.randn(rows, vocab, generator=g, device="cuda") * 4
    half = rows // 2  # the second half: a target close to the draft (many |p - q| near 0)
    t[half:] = z[half:] + 0.5 * torch.randn(rows - half, vocab, generator=g, device="cuda")
    z, t = z.to(dtype), t.to(dtype)
    labels = torch.randint(0, vocab, (rows,), generator=g, device="cuda")
    labels[0], labels[1] = 0, vocab - 1  # the first and the last column
    t[1] = z[1]  # p == q: L1 = 0, a = 1, s = 0
    labels[2] = z[2].float().argmax()  # a hit
    z[3, 17] = z[3, vocab - 5] = 60.0  # a tie: the first index is the argmax
    labels[3] = 17
    z[4, 100 % vocab] = z[4, vocab - 100] = 60.0  # the same tie, labelled at the second
    labels[4] = vocab - 100
    z[9, 5] = 80.0  # p nearly one-hot: every other exp underflows
    weights = torch.rand(rows, generator=g, device="cuda", dtype=torch.float64)
    weights[5:9] = 0.0  # untrained rows; 6 and 7 with non-finite logits
    z[6, 33], t[6, 40] = float("inf"), float("nan")
    z[7, 0], t[7, vocab - 1] = float("nan"), float("-inf")
    return z, t, labels, weights


def _exact(z, t):
    """fp64 p, q and <s, p> of the same bf16 logits (for the tolerances)."""
    x, y = z.double(), t.double()
    p = (x - x.logsumexp(-1, keepdim=True)).exp()
    q = (y - y.logsumexp(-1, keepdim=True)).exp()
    return p, q, (torch.sign(p - q) * p).sum(-1)


def _mismatches(out, ref, z, t, labels, weights) -> list[str]:
    """What differs beyond the derived tolerances (empty: equal). Non-finite rows (untrained):
    loss and gradient exactly 0 on both sides; their hit and acceptance are not compared."""
    ce, l1, hit, accept, grad = out
    ce_ref, l1_ref, hit_ref, accept_ref, grad_ref = ref
    finite = torch.isfinite(z.float()).all(-1) & torch.isfinite(t.float()).all(-1)
    x = torch.where(finite[:, None], z, 0).to(z.dtype)
    y = torch.where(finite[:, None], t, 0).to(t.dtype)
    p, q, sp = _exact(x, y)
    w = torch.where(weights > 0, weights, 0.0)
    problems = []
    ce_bound = w * LSE_ATOL + 1e-6 * ce_ref.double().abs()  # + the fp32 product's rounding
    if ((ce.double() - ce_ref.double()).abs() > ce_bound).any():
        problems.append(f"ce off by {float((ce - ce_ref).abs().max()):.3g}")
    if ((l1.double() - l1_ref.double()).abs() > w * L1_ATOL).any():
        problems.append(f"l1 off by {float((l1 - l1_ref).abs().max()):.3g}")
    if not torch.equal(hit[finite], hit_ref[finite]):
        wrong = torch.nonzero(finite & (hit != hit_ref)).flatten().tolist()
        problems.append(f"hits differ at rows {wrong}")
    if ((accept - accept_ref).abs()[finite] > L1_ATOL / 2).any():
        problems.append(f"accept off by {float((accept - accept_ref)[finite].abs().max()):.3g}")
    if grad.dtype != grad_ref.dtype or grad.shape != grad_ref.shape:
        problems.append(f"grad {grad.dtype} {tuple(grad.shape)}")
        return problems
    ce_alpha, l1_alpha = ALPHAS
    flips = (p - q).abs() <= 2 * P_RTOL * torch.maximum(p, q)
    flips &= p != q
    sp_err = P_RTOL + SUM_RTOL + 2 * (p * flips).sum(-1)
    e = (
        w[:, None]
        * p
        * (ce_alpha * P_RTOL + l1_alpha * (P_RTOL * (1 + sp.abs()) + sp_err)[:, None])
    )
    e = e + flips * 2 * w[:, None] * l1_alpha * p
    bound = GRAD_RTOL * grad_ref.double().abs() + 1.01 * e + 1e-12
    diff = (grad.double() - grad_ref.double()).abs()
    bad = diff > bound
    bad |= ~finite[:, None] & ((grad != 0) | (grad_ref != 0))  # untrained: exactly 0
    if bad.any():
        problems.append(f"grad off at {int(bad.sum())} elements, by up to {float(diff.max()):.3g}")
    return problems


def test_triton_dspark_pass_equals_the_reference() -> None:
    z, t, labels, weights = _inputs()
    out = triton_pass(z, t, labels, weights)
    ref = reference(z, t, labels, weights)
    assert _mismatches(out, ref, z, t, labels, weights) == []
    ce, l1, hit, accept, grad = out
    assert hit[2] and hit[3] and not hit[4]  # hit, tie at the label, tie past it
    assert float(l1[1]) == 0.0 and float(accept[1]) == 1.0  # z == t: exactly p == q
    assert (grad[5:9] == 0).all() and (ce[5:9] == 0).all() and (l1[5:9] == 0).all()
    assert torch.isfinite(ce).all() and torch.isfinite(l1).all() and torch.isfinite(grad).all()


@pytest.mark.parametrize("vocab", [1000, 2048, 4097])
def test_triton_dspark_pass_equals_the_reference_on_other_vocabularies(vocab) -> None:
    """One partial block only, exactly one block, and two full blocks and one column."""
    z, t, labels, weights = _inputs(seed=1, rows=16, vocab=vocab)
    out = triton_pass(z, t, labels, weights)
    assert _mismatches(out, reference(z, t, labels, weights), z, t, labels, weights) == []


def test_triton_dspark_pass_takes_fp32_logits_and_either_pass_2_direction() -> None:
    z, t, labels, weights = _inputs(seed=2, rows=16, dtype=torch.float32)
    ref = reference(z, t, labels, weights)
    for reverse in (True, False):
        out = triton_pass(z, t, labels, weights, reverse=reverse)
        assert out[4].dtype == torch.float32
        assert _mismatches(out, ref, z, t, labels, weights) == [], reverse


def test_triton_dspark_pass_refuses_fp64_and_non_contiguous_rows() -> None:
    z, t, labels, weights = _inputs(seed=3, rows=16, vocab=1000)
    with pytest.raises(ValueError, match="bf16/fp16/fp32"):
        triton_pass(z.double(), t.double(), labels, weights)
    with pytest.raises(ValueError, match="contiguous"):
        triton_pass(z.T, t.T, labels, weights)


def _sign_of_q_minus_p(p, q):
    s = torch.sign(q - p)
    return p * (s - (s * p).sum(-1, keepdim=True))


def _inner_product_dropped(p, q):
    return p * torch.sign(p - q)


def _labels_shifted(z, t, labels, weights):
    return reference(z, t, (labels + 1) % z.shape[1], weights)


def _unweighted(z, t, labels, weights):
    return reference(z, t, labels, (weights > 0).to(weights.dtype))


def _alphas_swapped(z, t, labels, weights):
    return reference(z, t, labels, weights, alphas=ALPHAS[::-1])


def _no_l1_gradient(z, t, labels, weights):
    ce, l1, hit, accept, _ = reference(z, t, labels, weights)
    return ce, l1, hit, accept, reference(z, t, labels, weights, alphas=(ALPHAS[0], 0.0))[4]


def _ties_to_the_last(z, t, labels, weights):
    ce, l1, _, accept, grad = reference(z, t, labels, weights)
    last = z.shape[1] - 1 - z.float().flip(-1).argmax(-1)
    return ce, l1, last == labels, accept, grad


def _lse_off(z, t, labels, weights):
    ce, l1, hit, accept, grad = reference(z.float() + 1e-2, t, labels, weights)
    return ce * 1.001, l1, hit, accept, grad.to(z.dtype)


def _target_temperature(z, t, labels, weights):
    return reference(z, t.float() * 1.01, labels, weights)


def _with_patched(name, fn):
    def mutant(z, t, labels, weights):
        original = getattr(dspark_objective, name)
        setattr(dspark_objective, name, fn)
        try:
            return reference(z, t, labels, weights)
        finally:
            setattr(dspark_objective, name, original)

    return mutant


@pytest.mark.parametrize(
    "mutant",
    [
        _with_patched("l1_logit_grad", _sign_of_q_minus_p),
        _with_patched("l1_logit_grad", _inner_product_dropped),
        _labels_shifted,
        _unweighted,
        _alphas_swapped,
        _no_l1_gradient,
        _ties_to_the_last,
        _lse_off,
        _target_temperature,
    ],
    ids=[
        "sign_of_q_minus_p",
        "inner_product_dropped",
        "labels_shifted",
        "unweighted",
        "alphas_swapped",
        "no_l1_gradient",
        "ties_to_the_last",
        "lse_off",
        "target_temperature",
    ],
)
def test_dspark_pass_comparison_catches_mutant(mutant) -> None:
    z, t, labels, weights = _inputs()
    ref = reference(z, t, labels, weights)
    assert _mismatches(mutant(z, t, labels, weights), ref, z, t, labels, weights) != []


def test_a_dspark_objective_on_the_gpu_takes_the_triton_pass_unless_told_compiled() -> None:
    """ce_kernel auto and triton on a GPU resolve to this kernel (what drafter_kernels_chosen
    logs); compiled keeps the closed form."""
    import dataclasses

    from conftest import TinySpec, tiny_config, tiny_target_weights

    from dflash_async.kernels.ce_l1_kernel import ce_l1_and_grad_triton
    from dflash_async.model.kinds.dspark.drafter import DSparkDrafter
    from dflash_async.model.kinds.dspark.objective import DSparkObjective
    from dflash_async.model.objective import ObjectiveConfig

    spec = TinySpec(block_size=5)
    config = dataclasses.replace(tiny_config(spec), kind="dspark", markov_rank=8)
    embed, lm_head = tiny_target_weights(config, seed=0, dtype=torch.float32, device="cuda")
    norm = torch.ones(config.hidden_size, device="cuda")
    chosen = {}
    for ce_kernel in ("auto", "triton", "compiled"):
        objective_config = ObjectiveConfig(
            block_size=spec.block_size,
            num_anchors=4,
            mask_token_id=config.mask_token_id,
            gamma=4.0,
            ce_kernel=ce_kernel,
        )
        drafter = DSparkDrafter(config).cuda()
        objective = DSparkObjective(objective_config, drafter, embed, lm_head, target_norm=norm)
        chosen[ce_kernel] = (objective.ce_kernel, objective.rows.func)
    assert chosen["auto"] == chosen["triton"] == ("triton", ce_l1_and_grad_triton)
    assert chosen["compiled"] == ("compiled", dspark_objective.ce_l1_and_grad_from_logits)


# The step: kind dspark on the small shape (V = 32000, block 16), ce_kernel triton against
# compiled, both with the layers eager and both compiled (the GPU default), through
# tests/model/test_drafter_kernels_gpu.py's one-step-then-trajectory comparison.
# Tolerance: the two passes give each dz element within 2^-7 relative (above; the sign flips
# touch columns of p within 2 P_RTOL of q, of negligible mass), and the rest of the step runs the
# same kernels on them: the kernel variants' per-element bound r = 8u holds with margin. The
# loss bound there divides r by sqrt(A N_eff) with DFlash's N_eff = 11 per anchor; DSpark's
# weights exp(-k/4), k = 0..15, give N_eff = (sum w)^2 / sum w^2 = 4.44^2 / 2.54 = 7.75, so r is
# scaled by sqrt(11 / 7.75) to give the same bound per anchor.
@pytest.mark.timeout(900)  # two steps built, compiled and captured (with compile: minutes)
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_a_dspark_step_with_the_triton_pass_equals_the_torch_pass(compile) -> None:
    from test_drafter_kernels_gpu import U, _assert_equal_within_bf16, _in_worker, _run

    run = functools.partial(_run, compile=compile, kind="dspark")
    triton = _in_worker(lambda: run("ce_triton"))
    torch_ops = _in_worker(lambda: run("ce_compiled"))
    _assert_equal_within_bf16(
        triton, torch_ops, f"dspark_ce_triton_{compile}", r=8 * U * math.sqrt(11 / 7.75)
    )
