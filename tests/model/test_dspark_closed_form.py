"""DSpark's chunk pass in closed form (kinds/dspark/objective.py: ce_l1_and_grad_from_logits and
confidence_terms, composed by chunk_terms_and_grads) equals autograd of the loss it stands for,
in fp64: the weighted CE, L1 and BCE sums, the hits, the acceptance, d/dz and d/dc; untrained
rows give exactly 0 even with non-finite logits; and the comparison fails on purpose-made wrong
closed forms. The objective takes the closed form on the CPU (ce_kernel auto) and refuses the
Triton pass there; tests/kernels/test_ce_l1_kernel_gpu.py compares that pass with this form."""

from __future__ import annotations

import dataclasses
import functools
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_config, tiny_target_weights
from test_dspark import SPEC

from dflash_async.model.kinds.dspark import objective as dspark_objective
from dflash_async.model.kinds.dspark.drafter import DSparkDrafter
from dflash_async.model.kinds.dspark.objective import (
    DSparkObjective,
    ce_l1_and_grad_from_logits,
    chunk_terms_and_grads,
)
from dflash_async.model.objective import ObjectiveConfig

ROWS, VOCAB = 8, 50
ALPHAS = (0.1, 0.9, 1.0)
# fp64 on both sides, the same math in another order: sums of <= 50 terms of O(1) agree to
# ~1e-14; 1e-10 leaves room and sits far below every mutant's change (>= 1e-3 measured)
RTOL, ATOL = 1e-10, 1e-12


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(ROWS, VOCAB, generator=g, dtype=torch.float64) * 2
    t = torch.randn(ROWS, VOCAB, generator=g, dtype=torch.float64) * 2
    t[1] = z[1]  # p == q: s = 0 everywhere, L1 = 0, a = 1
    t[2] = z[2] + 0.3 * torch.randn(VOCAB, generator=g, dtype=torch.float64)  # close: a near 1
    z[3, 7] = z[3, 30] = 20.0  # a tie: the first index is the argmax
    labels = torch.randint(0, VOCAB, (ROWS,), generator=g)
    labels[3] = 7
    labels[4] = z[4].argmax()  # a hit
    weights = torch.rand(ROWS, generator=g, dtype=torch.float64) + 0.1
    weights[5] = 0.0  # untrained
    confidence = torch.randn(ROWS, generator=g, dtype=torch.float64)
    return z, t, labels, weights, confidence


def autograd_terms(z, t, labels, weights, confidence):
    """The loss as written (module doc of the objective), differentiated by autograd: (sums
    [3], hit, accept, dz, dc)."""
    z = z.detach().requires_grad_(True)
    c = confidence.detach().requires_grad_(True)
    trained = weights > 0
    w = torch.where(trained, weights, 0.0)
    ce = -z.log_softmax(-1).gather(1, labels[:, None]).squeeze(1)
    l1 = (z.softmax(-1) - t.softmax(-1)).abs().sum(-1)
    accept = (1.0 - 0.5 * l1).clamp(0.0, 1.0)
    bce = F.binary_cross_entropy_with_logits(c, accept.detach(), reduction="none")
    terms = [torch.where(trained, w * x, 0.0).sum() for x in (ce, l1, bce)]
    total = sum(alpha * x for alpha, x in zip(ALPHAS, terms, strict=True))
    dz, dc = torch.autograd.grad(total, (z, c))
    hit = z.argmax(-1) == labels
    return torch.stack(terms).detach(), hit, accept.detach(), dz, dc


def closed_form(z, t, labels, weights, confidence, rows=None):
    rows = rows or functools.partial(
        dspark_objective.ce_l1_and_grad_from_logits, ce_alpha=ALPHAS[0], l1_alpha=ALPHAS[1]
    )
    return chunk_terms_and_grads(rows, z, t, labels, weights, confidence, ALPHAS[2])


def assert_same(ours, ref) -> None:
    for name, a, b in zip(("sums", "hit", "accept", "dz", "dc"), ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")


def test_the_closed_form_equals_autograd_of_the_loss() -> None:
    z, t, labels, weights, confidence = _inputs()
    ours = closed_form(z, t, labels, weights, confidence)
    assert_same(ours, autograd_terms(z, t, labels, weights, confidence))
    _, hit, accept, dz, dc = ours
    assert hit[3] and hit[4] and float(accept[1]) == 1.0
    assert (dz[5] == 0).all() and dc[5] == 0
    assert dz.dtype == z.dtype and dc.dtype == confidence.dtype


def test_without_a_confidence_head_the_bce_is_zero_and_dc_none() -> None:
    z, t, labels, weights, confidence = _inputs(seed=1)
    sums, _, _, dz, dc = closed_form(z, t, labels, weights, None)
    ref = autograd_terms(z, t, labels, weights, confidence)
    assert dc is None and float(sums[2]) == 0.0
    torch.testing.assert_close(sums[:2], ref[0][:2], rtol=RTOL, atol=ATOL)
    # without the BCE the gradient w.r.t. z is unchanged: a is a constant of the BCE
    torch.testing.assert_close(dz, ref[3], rtol=RTOL, atol=ATOL)


def test_untrained_rows_with_non_finite_logits_give_exactly_zero() -> None:
    """inf and nan logits (draft and target) in rows of weight 0: their terms and gradients
    are exactly 0 and nothing non-finite reaches the sums (selected, never multiplied by 0)."""
    z, t, labels, weights, confidence = _inputs(seed=2)
    weights[5:7] = 0.0
    z[5, 3], t[5, 9] = float("inf"), float("nan")
    z[6, 0], t[6, 1] = float("nan"), float("-inf")
    sums, _, _, dz, dc = closed_form(z, t, labels, weights, confidence)
    assert torch.isfinite(sums).all() and torch.isfinite(dz).all() and torch.isfinite(dc).all()
    assert (dz[5:7] == 0).all() and (dc[5:7] == 0).all()
    clean = weights > 0
    ref = autograd_terms(z[clean], t[clean], labels[clean], weights[clean], confidence[clean])
    torch.testing.assert_close(sums, ref[0], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(dz[clean], ref[3], rtol=RTOL, atol=ATOL)


def _sign_of_q_minus_p(p, q):
    s = torch.sign(q - p)
    return p * (s - (s * p).sum(-1, keepdim=True))


def _inner_product_dropped(p, q):
    return p * torch.sign(p - q)


@pytest.mark.parametrize("mutant", [_sign_of_q_minus_p, _inner_product_dropped])
def test_the_comparison_catches_a_wrong_l1_gradient(monkeypatch, mutant) -> None:
    z, t, labels, weights, confidence = _inputs()
    ref = autograd_terms(z, t, labels, weights, confidence)
    monkeypatch.setattr(dspark_objective, "l1_logit_grad", mutant)
    with pytest.raises(AssertionError):
        assert_same(closed_form(z, t, labels, weights, confidence), ref)


def test_the_comparison_catches_a_confidence_target_that_is_not_detached() -> None:
    """The closed form of a BCE whose target a = 1 - L1/2 carries a gradient: d BCE / d a = -c,
    so dz gains w confidence_alpha (c / 2) dL1/dz where 0 < a < 1. The loss does not have it."""
    z, t, labels, weights, confidence = _inputs()
    ref = autograd_terms(z, t, labels, weights, confidence)

    def not_detached(z, t, labels, weights):
        ce, l1, hit, accept, dz = ce_l1_and_grad_from_logits(
            z, t, labels, weights, ce_alpha=ALPHAS[0], l1_alpha=ALPHAS[1]
        )
        p, q = z.softmax(-1), t.softmax(-1)
        inside = (accept > 0) & (accept < 1) & (weights > 0)
        scale = torch.where(inside, weights * ALPHAS[2] * confidence / 2, 0.0)
        return ce, l1, hit, accept, dz + scale[:, None] * dspark_objective.l1_logit_grad(p, q)

    with pytest.raises(AssertionError):
        assert_same(closed_form(z, t, labels, weights, confidence, rows=not_detached), ref)


def test_the_comparison_catches_unselected_untrained_rows_and_ties_to_the_last() -> None:
    z, t, labels, weights, confidence = _inputs()
    ref = autograd_terms(z, t, labels, weights, confidence)

    def weighted_not_selected(z, t, labels, weights):
        # an untrained row's CE, L1 and gradient kept, as multiplying by w = 0 would keep a NaN
        trained_everywhere = torch.where(weights > 0, weights, 1.0)
        return ce_l1_and_grad_from_logits(
            z, t, labels, trained_everywhere, ce_alpha=ALPHAS[0], l1_alpha=ALPHAS[1]
        )

    def ties_to_the_last(z, t, labels, weights):
        ce, l1, _, accept, dz = ce_l1_and_grad_from_logits(
            z, t, labels, weights, ce_alpha=ALPHAS[0], l1_alpha=ALPHAS[1]
        )
        last = z.shape[1] - 1 - z.flip(-1).argmax(-1)
        return ce, l1, last == labels, accept, dz

    for mutant in (weighted_not_selected, ties_to_the_last):
        with pytest.raises(AssertionError):
            assert_same(closed_form(z, t, labels, weights, confidence, rows=mutant), ref)


def test_the_objective_takes_the_closed_form_on_the_cpu_and_refuses_triton_there() -> None:
    """ce_kernel auto resolves to the closed form off the GPU (what drafter_kernels_chosen
    logs); asking for the Triton pass there fails at build."""
    config = dataclasses.replace(tiny_config(SPEC), kind="dspark", markov_rank=8)
    embed, lm_head = tiny_target_weights(config, seed=0, dtype=torch.float32)
    objective_config = ObjectiveConfig(
        block_size=SPEC.block_size, num_anchors=4, mask_token_id=config.mask_token_id, gamma=4.0
    )
    norm = torch.ones(config.hidden_size)
    objective = DSparkObjective(
        objective_config, DSparkDrafter(config), embed, lm_head, target_norm=norm
    )
    assert objective.ce_kernel == "compiled"
    assert objective.rows.func is ce_l1_and_grad_from_logits
    assert "dflash_async.kernels.ce_l1_kernel" not in sys.modules  # it needs triton
    with pytest.raises(ValueError, match="CUDA"):
        DSparkObjective(
            dataclasses.replace(objective_config, ce_kernel="triton"),
            DSparkDrafter(config),
            embed,
            lm_head,
            target_norm=norm,
        )
