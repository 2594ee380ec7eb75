"""The compiled phase-B candidates: one flat gradient norm, then AdamW's update written as torch
ops and torch.compile'd into one pointwise kernel per tensor (read p, g, m, v; write p, m, v),
and the gradient zeroing: 36 B/param in all, against today's 52.

`compiled`: over the flat buffers, g = 0 in the same kernel (needs the parameters as one flat
buffer and flat AdamW moments: a different checkpoint layout). `compiled_views`: per parameter,
on the very tensors torch's AdamW keeps (`optimizer.state[p]`: step, exp_avg, exp_avg_sq,
created as Adam._init_group creates them for fused=True), so optimizer.state_dict() and
checkpoints stay as they are; the gradients are only read there (they are views of one buffer:
mutating aliased inputs would make AOTAutograd merge them into a synthetic base) and zeroed by
one fill of the flat buffer after it, the same 4 B/param. Same math as torch's fused CUDA kernel
up to fp32 rounding order (checked against `today` in benchmarks/research/tests/test_optimizer_updates.py, uncompiled
there: CPU, and compiled on the GPU bench).

`sequence` resolves any name of optimizer_updates.SEQUENCES, these two included.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from optimizer_updates import SEQUENCES, PhaseState, folded_coefficient

from dflash_async.model.update import adamw_math, folded_adamw


def adamw_flat_math(p, g, m, v, step, lr, coef, **hyper) -> None:
    """update.adamw_math over the flat buffers, then g = 0 in the same kernel."""
    adamw_math(p, g, m, v, step, lr, coef, **hyper)
    g.zero_()


def compiled_sequence(s: PhaseState, *, flat: bool, compile: bool) -> Callable[[PhaseState], None]:
    """Phase B as folded_coefficient (one flat norm) + the compiled AdamW, then the lr advance:
    per view, the product's own update (model/update.py's folded_adamw); flat, over the flat
    buffers with the zeroing fused in. `compile=False` runs the same functions eagerly (CPU)."""
    if not flat:
        update = folded_adamw(s.optimizer, s.params, compile=compile)

        def run_views(state: PhaseState) -> None:
            update(folded_coefficient(state))
            state.flat_grad.zero_()
            state.schedule.advance_()

        return run_views
    math_fn = (
        torch.compile(adamw_flat_math, dynamic=False, fullgraph=True)
        if compile
        else adamw_flat_math
    )
    group = s.optimizer.param_groups[0]
    beta1, beta2 = group["betas"]
    hyper = dict(beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=s.weight_decay)

    def run_flat(state: PhaseState) -> None:
        math_fn(
            state.flat_param,
            state.flat_grad,
            state.exp_avg,
            state.exp_avg_sq,
            state.step,
            state.schedule.lr,
            folded_coefficient(state),
            **hyper,
        )
        state.schedule.advance_()

    return run_flat


def sequence(name: str, s: PhaseState, *, compile: bool) -> Callable[[PhaseState], None]:
    """The function of SEQUENCES[name] for `s` (the compiled ones compile only when `compile`)."""
    if name in ("compiled", "compiled_views"):
        return compiled_sequence(s, flat=name == "compiled", compile=compile)
    return SEQUENCES[name][0]
