"""update.py: the step's fast phase B (one flat norm, the weight-sum division folded into the clip
coefficient, AdamW as torch ops for torch.compile) gives the reference phase B's update
(clip_grad_norm_ + torch's fused AdamW), keeps torch's optimizer state layout, and a wrong
coefficient, a parameter left out or other betas are caught.

On the CPU the ops run eagerly (compile=False): the same functions the GPU compiles, whose
compiled kernels benchmarks/research/optimizer_bench.py and tests/model/test_drafter_kernels_gpu.py
check on an H200."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from conftest import (
    TinySpec,
    make_anchors,
    make_objective,
    tiny_batch,
    tiny_config,
    tiny_drafter,
    tiny_target_weights,
)

from dflash_async.model.optim import build_optimizer
from dflash_async.model.step import DrafterStep
from dflash_async.model.update import flat_norm, folded_adamw

STEPS = 3
NUM_ANCHORS = 8
# Largest difference from the reference, relative to each tensor's largest magnitude (params,
# exp_avg, exp_avg_sq per parameter; the grad norm). The two paths round differently in fp32
# (u = 2^-24): g/W*c against g*(c/W) and two norm summation orders, a few u on each gradient and
# up to ~2(N+46)u on a norm of N <= ~2000 squares per level; CPU's fused AdamW takes 1 - beta2^t
# in higher precision than the CUDA formula adamw_math follows (~800u on the step size at t = 1).
# Each later step's forward sees parameters a few ulp apart, which moves the next gradients by as
# little. 2^-12 = 4096u is above all of it; every mutant below is off by O(1).
REL_TOL = 2.0**-12


def _step(*, grad_clip: float, betas=(0.9, 0.999), working_weights: bool = False) -> DrafterStep:
    """A tiny fp32 drafter step on the CPU, reference phase B (working_weights: with the
    working copies, fp32 here, and the eager folded update), fixed anchors (same for every
    build: the same seeds)."""
    spec = TinySpec()
    config = tiny_config(spec)
    drafter = tiny_drafter(config, seed=0, dtype=torch.float32)
    embed, lm_head = tiny_target_weights(config, seed=0, dtype=torch.float32)
    objective = make_objective(config, drafter, embed, lm_head, num_anchors=NUM_ANCHORS)
    step = DrafterStep.build(
        objective,
        token_budget=spec.num_tokens,
        peak_lr=1e-2,
        warmup_steps=1,
        total_steps=10,
        grad_clip=grad_clip,
        compiled_update=False,
        working_weights=working_weights,
    )
    if betas != (0.9, 0.999):
        step.optimizer = build_optimizer(
            step.params, lr_tensor=step.schedule.lr, weight_decay=0.0, betas=betas
        )
    step.batch.copy_(tiny_batch(spec, config, dtype=torch.float32))
    anchors = make_anchors([2, 7, 12, 21, 30, 38, 47, 52], NUM_ANCHORS)
    step.anchor_sampler = lambda _batch: anchors
    return step


def _run(step: DrafterStep) -> None:
    for _ in range(STEPS):
        step.phase_a()
        step.phase_b()


def _max_rel_diff(step: DrafterStep, reference: DrafterStep) -> float:
    pairs = [(step.grad_norm, reference.grad_norm)]
    for p, q in zip(step.params, reference.params, strict=True):
        mine, theirs = step.optimizer.state[p], reference.optimizer.state[q]
        none = torch.zeros_like(p)  # a parameter never updated has no state
        pairs += [(p, q), (mine.get("exp_avg", none), theirs["exp_avg"])]
        pairs += [(mine.get("exp_avg_sq", none), theirs["exp_avg_sq"])]
    return max(
        float((a.detach() - b.detach()).abs().max() / b.detach().abs().max().clamp_min(1e-30))
        for a, b in pairs
    )


def _folded(step: DrafterStep) -> Callable[[torch.Tensor], None]:
    return folded_adamw(step.optimizer, step.params, compile=False)


@pytest.mark.parametrize("grad_clip", [1e-3, 1e3], ids=["clipping", "not_clipping"])
def test_folded_update_equals_the_reference_phase_b(grad_clip: float) -> None:
    reference, step = _step(grad_clip=grad_clip), _step(grad_clip=grad_clip)
    step.adamw = _folded(step)
    _run(reference)
    _run(step)
    assert reference.grad_norm > 0
    clipped = bool(reference.grad_norm > grad_clip)
    assert clipped == (grad_clip < 1)  # both regimes are exercised
    assert _max_rel_diff(step, reference) <= REL_TOL
    assert int(step.schedule.step) == int(reference.schedule.step) == STEPS


def test_each_backward_writes_the_gradients_into_the_flat_buffer_without_adding() -> None:
    """Phase A overwrites every gradient view (no zeroing between steps): two phase As on the
    same weights and anchors leave the same buffer, equal to plain autograd's gradients."""
    step = _step(grad_clip=1.0)
    step.phase_a()
    first = step.flat_grad.clone()
    step.phase_a()  # no phase B: a leftover sum would double the buffer
    assert torch.equal(step.flat_grad, first)
    assert all(
        p.grad.data_ptr() == v.data_ptr() for p, v in zip(step.params, step.grad_views, strict=True)
    )
    plain = _step(grad_clip=1.0)
    sums = plain.objective(plain.batch, plain.anchor_sampler(plain.batch))
    grads = torch.autograd.grad(sums.ce_sum, plain.params)  # no .grad, no hooks involved
    for view, grad in zip(step.grad_views, grads, strict=True):
        torch.testing.assert_close(view, grad, rtol=0, atol=0)  # same ops, same order


def test_a_parameter_without_a_gradient_stops_the_step() -> None:
    """A view nobody writes would carry the last step's gradient into this one's update."""
    step = _step(grad_clip=1.0)
    unused = step.objective.drafter.norm.weight
    step.objective.drafter._final_norm = lambda drafter, x: x  # the final norm drops out
    (index,) = [i for i, p in enumerate(step.params) if p is unused]
    with pytest.raises(RuntimeError, match=f"parameters \\[{index}\\] got no gradient"):
        step.phase_a()


def test_folded_update_keeps_torchs_adamw_state_layout() -> None:
    reference, step = _step(grad_clip=1.0), _step(grad_clip=1.0)
    step.adamw = _folded(step)
    _run(reference)
    _run(step)
    for p, q in zip(step.params, reference.params, strict=True):
        mine, theirs = step.optimizer.state[p], reference.optimizer.state[q]
        assert mine.keys() == theirs.keys()
        for key in theirs:
            assert (mine[key].shape, mine[key].dtype) == (theirs[key].shape, theirs[key].dtype)
        assert float(mine["step"]) == float(theirs["step"]) == STEPS
    saved = step.optimizer.state_dict()["state"]
    assert len(saved) == len(step.params)


def _no_weight_sum_division(step: DrafterStep) -> Callable[[torch.Tensor], None]:
    update = _folded(step)
    return lambda coef: update(coef * step.stats[1])


def _no_clamp_at_one(step: DrafterStep) -> Callable[[torch.Tensor], None]:
    update = _folded(step)
    w = lambda: step.stats[1]  # noqa: E731
    return lambda coef: update(step.grad_clip / (flat_norm(step.flat_grad) / w() + 1e-6) / w())


def _last_parameter_left_out(step: DrafterStep) -> Callable[[torch.Tensor], None]:
    return folded_adamw(step.optimizer, step.params[:-1], compile=False)


MUTANTS = {
    "no division by the weight sum": (_no_weight_sum_division, {}),
    "coefficient not clamped at 1": (_no_clamp_at_one, {}),
    "a parameter left out": (_last_parameter_left_out, {}),
    "betas (0.9, 0.99)": (_folded, {"betas": (0.9, 0.99)}),
}


@pytest.mark.parametrize("name", MUTANTS)
def test_folded_update_comparison_catches_mutant(name: str) -> None:
    """The comparison above fails on each purpose-made slip (clipping off: grad_clip 1e3, so a
    missing clamp shows)."""
    make, kwargs = MUTANTS[name]
    reference, step = _step(grad_clip=1e3), _step(grad_clip=1e3, **kwargs)
    step.adamw = make(step)
    _run(reference)
    _run(step)
    assert _max_rel_diff(step, reference) > 1e3 * REL_TOL


def test_working_copies_give_the_masters_trajectory_bitwise() -> None:
    """The forward on working copies (fp32 on the CPU: the same values as the masters), their
    gradients in the buffer and AdamW writing them: the same ops as the plain step on the same
    values, so three steps agree bit for bit, and the copies equal the masters after each."""
    plain = _step(grad_clip=1.0)
    plain.adamw = _folded(plain)
    working = _step(grad_clip=1.0, working_weights=True)
    copies = [w for w in working.working if w is not None]
    assert len(copies) == sum(p.ndim == 2 for p in working.params) > 0
    for _ in range(STEPS):
        for step in (plain, working):
            step.phase_a()
            step.phase_b()
        assert torch.equal(working.flat_grad, plain.flat_grad)
        for p, w in zip(working.params, working.working, strict=True):
            assert w is None or torch.equal(w, p)
    assert _max_rel_diff(working, plain) == 0.0
    pairs = zip(working.params, working.working, strict=True)
    assert all(p.grad is None for p, w in pairs if w is not None)  # the copies take them


def test_working_copies_stale_after_the_update_are_caught() -> None:
    """Mutant: an update that does not write the copies leaves the forward on step 0's weights
    (the trajectory comparison above fails by far more than rounding)."""
    plain = _step(grad_clip=1e3)
    plain.adamw = _folded(plain)
    stale = _step(grad_clip=1e3, working_weights=True)
    stale.adamw = folded_adamw(stale.optimizer, stale.params, compile=False, grads=stale.grad_views)
    for step in (plain, stale):
        _run(step)
    assert _max_rel_diff(stale, plain) > 1e3 * REL_TOL


def test_working_copies_refuse_the_reference_update() -> None:
    """The masters hold no .grad with working copies: the reference AdamW would skip them."""
    step = _step(grad_clip=1.0, working_weights=True)
    step.adamw = None
    step.phase_a()
    with pytest.raises(RuntimeError, match="working weights need the folded update"):
        step.phase_b()


def test_compiled_layers_read_the_working_copies_and_compile_once() -> None:
    """compile_layers() (CPU inductor) under the step's functional_call swap: the same three
    steps as the compiled layers on the masters, bit for bit (fp32 copies, the same kernels),
    and the graphs compiled for the first step serve the later ones (a recompile per step would
    be slow, and past dynamo's limit the layers would run eagerly)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    plain, working = _step(grad_clip=1.0), _step(grad_clip=1.0, working_weights=True)
    plain.adamw = _folded(plain)
    for step in (plain, working):
        step.objective.drafter.compile_layers()
        step.phase_a()
        step.phase_b()
    graphs = counters["stats"]["unique_graphs"]
    for _ in range(STEPS - 1):
        for step in (plain, working):
            step.phase_a()
            step.phase_b()
    assert counters["stats"]["unique_graphs"] == graphs
    assert _max_rel_diff(working, plain) == 0.0
