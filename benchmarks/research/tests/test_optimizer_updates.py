"""The candidate phase-B sequences (optimizer_updates.py) make today's update, and the
comparison catches sequences that do not (purpose-made mutants). CPU, small tensors, 3 steps."""

from __future__ import annotations

import optimizer_bench
import torch
from optimizer_bench import max_rel_diffs, snapshot
from optimizer_compiled import adamw_flat_math, sequence
from optimizer_updates import (
    CANDIDATES,
    CLIP_EPS,
    REL_TOL,
    SEQUENCES,
    PhaseState,
    fold,
)

# Shapes with sizes off the 16-element alignment, so the flat buffers hold padding.
SHAPES = [(33,), (8, 5), (7,), (16, 16), (3, 4, 5)]
WEIGHT_SUM = 37.0  # sum(w) the grads are divided by
# lr 1e-2 and params ~ 0.02: a step moves a parameter by a visible fraction of its size, so a
# parameter left without its update shows in p as well as in its moments.
PEAK_LR = 1e-2


def _state() -> PhaseState:
    return PhaseState(SHAPES, device=torch.device("cpu"), peak_lr=PEAK_LR, warmup_steps=2)


def _run(fn, state: PhaseState, *, norm: float, steps: int = 3) -> None:
    state.reset(seed=0, weight_sum=WEIGHT_SUM)
    for k in range(steps):
        state.fill_grads(seed=10 + k, norm=norm)
        fn(state)


def _diff(fn, source: str, *, norm: float) -> float:
    """Largest relative difference (p, m, v, grad norm) of `fn` from today's after 3 steps."""
    state = _state()
    # REL_TOL's CPU derivation holds for flat buffers up to ~2000 elements
    assert state.flat_param.numel() <= 2000
    _run(SEQUENCES["today"][0], state, norm=norm)
    reference = snapshot(state, source="params")
    _run(fn, state, norm=norm)
    return max(max_rel_diffs(state, reference, source=source).values())


def test_each_candidate_makes_todays_update_within_fp32_tolerance_clipped_or_not():
    for name in CANDIDATES:
        for norm in (0.5, 3.0):  # ||g/W|| below and above grad_clip = 1
            state = _state()
            fn = sequence(name, state, compile=False)
            _run(SEQUENCES["today"][0], state, norm=norm)
            reference = snapshot(state, source="params")
            _run(fn, state, norm=norm)
            diffs = max_rel_diffs(state, reference, source=SEQUENCES[name][2])
            assert max(diffs.values()) <= REL_TOL, (name, norm, diffs)


def test_steps_move_the_parameters_and_padding_stays_zero():
    state = _state()
    before = state.flat_param.clone()
    _run(SEQUENCES["fold_flat_adamw"][0], state, norm=3.0)
    moved = (state.flat_param - before).abs()
    for o, p in zip(state.offsets, state.params, strict=True):
        assert moved[o : o + p.numel()].min() > 0
    padding = torch.ones_like(before, dtype=torch.bool)
    for o, p in zip(state.offsets, state.params, strict=True):
        padding[o : o + p.numel()] = False
    assert padding.any() and not state.flat_param[padding].any()
    assert not state.flat_grad.any()  # zeroed at the end of the step


def test_compiled_views_keeps_torch_adamw_state_so_torch_can_take_over():
    # two steps of the compiled per-view update, then one of torch's fused AdamW (via `fold`) on
    # the same optimizer state: today's three steps (the state is what a checkpoint saves)
    state = _state()
    _run(SEQUENCES["today"][0], state, norm=3.0)
    reference = snapshot(state, source="params")
    compiled_views = sequence("compiled_views", state, compile=False)
    state.reset(seed=0, weight_sum=WEIGHT_SUM)
    for k, fn in enumerate((compiled_views, compiled_views, fold)):
        state.fill_grads(seed=10 + k, norm=3.0)
        fn(state)
    steps = {float(state.optimizer.state[p]["step"]) for p in state.params}
    assert steps == {3.0}
    assert max(max_rel_diffs(state, reference, source="params").values()) <= REL_TOL


def _division_twice(s: PhaseState) -> None:
    s.flat_grad.div_(s.stats[1])
    fold(s)


def _unclamped_coefficient(s: PhaseState) -> None:
    weight_sum = s.stats[1]
    norm = torch.linalg.vector_norm(s.flat_grad) / weight_sum
    s.grad_norm.copy_(norm)
    s.flat_grad.mul_(s.grad_clip / (norm + CLIP_EPS) / weight_sum)  # no clamp at 1
    s.optimizer.step()
    s.schedule.advance_()
    s.flat_grad.zero_()


def _last_parameter_out_of_flat_norm(s: PhaseState) -> None:
    weight_sum = s.stats[1]
    norm = torch.linalg.vector_norm(s.flat_grad[: s.offsets[-1]]) / weight_sum
    s.grad_norm.copy_(norm)
    s.flat_grad.mul_((s.grad_clip / (norm + CLIP_EPS)).clamp(max=1.0) / weight_sum)
    s.optimizer.step()
    s.schedule.advance_()
    s.flat_grad.zero_()


def _last_parameter_out_of_flat_adamw(s: PhaseState) -> None:
    end = s.offsets[-1]  # the flat view stops before the last parameter
    weight_sum = s.stats[1]
    norm = torch.linalg.vector_norm(s.flat_grad) / weight_sum
    s.grad_norm.copy_(norm)
    coef = (s.grad_clip / (norm + CLIP_EPS)).clamp(max=1.0) / weight_sum
    betas = s.optimizer.param_groups[0]["betas"]
    adamw_flat_math(
        s.flat_param[:end],
        s.flat_grad[:end],
        s.exp_avg[:end],
        s.exp_avg_sq[:end],
        s.step,
        s.schedule.lr,
        coef,
        beta1=betas[0],
        beta2=betas[1],
        eps=1e-8,
        weight_decay=0.0,
    )
    s.schedule.advance_()
    s.flat_grad.zero_()


def test_the_comparison_catches_mutants():
    # each with the gradient norm at which its slip changes the update
    mutants = {
        "division applied twice": (_division_twice, "params", 0.5),
        "division applied twice, clipped": (_division_twice, "params", 3.0),
        "clip coefficient not clamped at 1": (_unclamped_coefficient, "params", 0.5),
        "a parameter left out of the flat norm": (_last_parameter_out_of_flat_norm, "params", 3.0),
        "a parameter left out of the flat AdamW": (
            _last_parameter_out_of_flat_adamw,
            "compiled",
            0.5,
        ),
    }
    for what, (fn, source, norm) in mutants.items():
        assert _diff(fn, source, norm=norm) > 100 * REL_TOL, what


def test_the_parameter_left_out_mutant_is_otherwise_the_compiled_math():
    # the same function over the whole flat view is within tolerance: the mutant differs only
    # by the parameter it leaves out
    def whole(s: PhaseState) -> None:
        sequence("compiled", s, compile=False)(s)

    assert _diff(whole, "compiled", norm=0.5) <= REL_TOL


def test_bench_cli_runs_on_cpu_and_prints_the_table(capsys):
    optimizer_bench.main(
        [
            "--shape",
            "tiny",
            "--device",
            "cpu",
            "--replays",
            "1",
            "--kernels",
            "--variants",
            "today,div,fold,gradscale,compiled",
        ]
    )
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    assert [r.split(" | ")[0][2:] for r in rows[1:]] == [
        "today",
        "div",
        "fold",
        "gradscale",
        "compiled",
    ]
    assert all(r.endswith("| yes |") for r in rows[1:] if not r.startswith("| div"))


def test_the_8b_shape_is_the_drafter_parameter_set():
    shapes = optimizer_bench.drafter_shapes("qwen3-8b")
    assert len(shapes) == 58
    assert sum(s.numel() for s in shapes) == 1_048_626_432
