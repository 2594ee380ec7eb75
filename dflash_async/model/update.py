"""Phase B's fast update: one norm of the flat gradient, the clip coefficient with the division by
the global weight sum folded in, and AdamW written as torch ops that torch.compile turns into one
pointwise kernel per parameter tensor, on the very state tensors torch's AdamW keeps.

Why not `clip_grad_norm_` + the fused `torch.optim.AdamW` (step.py's reference path): that sequence
moves 52 bytes per parameter (divide 8, foreach norm 4, foreach scale 8, fused AdamW 28, zero 4)
through multi_tensor_apply kernels at ~3.3 TB/s: 16.4 ms per step at the Qwen3-8B drafter's 1.05 B
parameters on an H200. This one moves 36 (norm 4, read p g m v and write p m v 28, zero 4) at ~4
TB/s: 9.4 ms (`bench optimizer`, BENCHMARKS.md). In the step, whose backward writes the gradients
instead of adding them, nothing is zeroed: 32 bytes; with step.py's working weights 30 (the norm
and AdamW read 2-byte gradients; AdamW writes the 2-byte copy). The math is AdamW's (fused CUDA
kernel's formula, bias corrections from the fp32 step count, decoupled weight decay) up to fp32
rounding order; tests/model/test_update.py compares it with the reference path.

`optimizer.state` keeps torch's layout (step, exp_avg, exp_avg_sq per parameter), so checkpoints,
resume and `optimizer.state_dict()` do not change. Sync-free and capturable.

Working copies (step.py, GPU): where a parameter has a bf16 copy that the forward uses, the same
kernel writes the new weight into it too (2 more bytes per parameter, instead of the forward
casting each fp32 weight at every use, 6 bytes a use, and backward casting it again).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

# DrafterStep's floor on the global weight sum (a step whose blocks all have weight 0).
WEIGHT_SUM_FLOOR = 1e-12
# clip_grad_norm_'s norm offset: coefficient = max_norm / (norm + 1e-6).
CLIP_EPS = 1e-6


def flat_norm(flat: torch.Tensor) -> torch.Tensor:
    """||flat||_2 (fp32, whatever the buffer's dtype) in two levels: the norms of rows of R
    elements, then their norm, R the largest power of two <= 4096 dividing the length (>= 16:
    flat_grad_buffer pads to multiples of 16). One long fp32 sum loses precision with its length
    where it runs sequentially (CPU, 30 M elements: 1.8e-3 off); rows keep every sum short. The
    partials are 1/R of the buffer. A bf16 buffer is summed in fp32 (dtype=), never rounded."""
    rows = flat.view(-1, math.gcd(flat.numel(), 4096))
    return torch.linalg.vector_norm(torch.linalg.vector_norm(rows, dim=1, dtype=torch.float32))


def folded_clip_coefficient(
    flat_grad: torch.Tensor, weight_sum: torch.Tensor, *, grad_clip: float, norm_out: torch.Tensor
) -> torch.Tensor:
    """min(1, clip / (||g/W|| + 1e-6)) / W: what the summed gradients g must be multiplied by to
    be divided by the weight sum W and clipped, as clip_grad_norm_ clips. Writes ||g/W|| (the
    reported grad norm) into `norm_out`. 0-d, on the device; padding of the buffer is zero."""
    w = weight_sum.clamp_min(WEIGHT_SUM_FLOOR)
    norm = flat_norm(flat_grad) / w
    norm_out.copy_(norm)
    return (grad_clip / (norm + CLIP_EPS)).clamp(max=1.0) / w


def adamw_math(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    step: torch.Tensor,
    lr: torch.Tensor,
    coef: torch.Tensor,
    *,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    working: torch.Tensor | None = None,
) -> None:
    """One AdamW step of p with gradient g * coef, in place on p, m, v and the fp32 step count;
    g is only read (any float dtype; the math is fp32). The formula of torch's fused CUDA
    kernel. `working`: p's lower-precision copy, set to the new p rounded to its dtype."""
    step.add_(1.0)
    grad = g * coef
    bias_correction1 = 1.0 - torch.pow(beta1, step)
    bias_correction2_sqrt = (1.0 - torch.pow(beta2, step)).sqrt()
    param = p * (1.0 - lr * weight_decay) if weight_decay else p
    m.copy_(m * beta1 + grad * (1.0 - beta1))
    v.copy_(v * beta2 + grad * grad * (1.0 - beta2))
    denom = v.sqrt() / bias_correction2_sqrt + eps
    new = param - (lr / bias_correction1) * m / denom
    p.copy_(new)
    if working is not None:
        working.copy_(new)  # the cast autocast made of p: round to nearest even


def adamw_all(params, grads, exp_avgs, exp_avg_sqs, steps, lr, coef, working, **hyper) -> None:
    """adamw_math over every parameter tensor: one traced graph, one kernel per tensor shape
    group. Gradients are views of one buffer and are only read (mutating aliased inputs would
    make AOTAutograd merge them into a synthetic base). `working`: each p's working copy, or
    None."""
    tensors = zip(params, grads, exp_avgs, exp_avg_sqs, steps, working, strict=True)
    for p, g, m, v, step, w in tensors:
        adamw_math(p, g, m, v, step, lr, coef, working=w, **hyper)


@torch.no_grad()
def ensure_adamw_state(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """Create each parameter's AdamW state as torch's fused AdamW does at its first step (fp32
    0-d step on the parameter's device, zero moments like the parameter) where none exists."""
    for p in params:
        state = optimizer.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def folded_adamw(
    optimizer: torch.optim.AdamW,
    params: list[torch.Tensor],
    *,
    compile: bool,
    grads: list[torch.Tensor] | None = None,
    working: list[torch.Tensor | None] | None = None,
) -> Callable[[torch.Tensor], None]:
    """`update(coef)`: one AdamW step of `params` (one param group, torch's AdamW) with their
    gradients times `coef`, lr read from the group's lr tensor. compile=True: torch.compile'd at
    the first call (GPU; compile before capture); False: the same ops eagerly (CPU, tests).
    grads: the gradient tensors, one per param (None: each param's `.grad` at call time);
    working: each param's working copy to write, or None (None: no copies)."""
    (group,) = optimizer.param_groups
    if group.get("amsgrad") or group.get("maximize"):
        raise ValueError("folded_adamw implements plain AdamW (no amsgrad, no maximize)")
    beta1, beta2 = group["betas"]
    hyper = dict(beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"])
    math_fn = torch.compile(adamw_all, dynamic=False, fullgraph=True) if compile else adamw_all
    # detached: the copies are autograd leaves that the forward reads; writing them is not math
    working = [None if w is None else w.detach() for w in working or [None] * len(params)]
    if len(working) != len(params) or (grads is not None and len(grads) != len(params)):
        raise ValueError("folded_adamw needs one gradient and one working entry per parameter")

    def update(coef: torch.Tensor) -> None:
        ensure_adamw_state(optimizer, params)
        # read each call: resume may have created the state since (checkpoint/state.restore)
        states = [optimizer.state[p] for p in params]
        math_fn(
            [p.detach() for p in params],
            grads or [p.grad for p in params],
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [s["step"] for s in states],
            group["lr"],
            coef,
            working,
            **hyper,
        )

    return update
