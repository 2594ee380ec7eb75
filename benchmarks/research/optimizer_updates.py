"""Phase B of the drafter step (normalise, clip, AdamW, lr advance, zero) as today's sequence and
as candidate sequences that compute the same update with fewer passes over memory.

`PhaseState` holds what phase B touches, laid out as DrafterStep lays it out: one fp32 tensor per
drafter parameter (its own allocation, as the drafter's), their gradients as views of the flat
gradient buffer (`flat_grad_buffer`), the global weight sum in `stats[1]`, the lr schedule and
AdamW (`build_optimizer`). Its attribute names are DrafterStep's, so `today` IS
`DrafterStep._update`, run on it. The flat candidates use ONE flat parameter `flat_param` (same
offsets as the gradient buffer, so element i of one is element i of the other; its grad is
`flat_grad`) with a second fused AdamW; both start from the same values. Padding elements of the
flat buffers stay zero, so they do not change a norm and AdamW leaves them zero.

Bytes each sequence must move per parameter (fp32; the `bytes_per_param` of SEQUENCES):
  today: div_ 8 (read+write g) + foreach norm 4 + foreach scale 8 + fused AdamW 28 (read p g m v,
         write p m v) + zero_ 4 = 52;
  fold:  one norm of the flat buffer 4 (||g||/W is ||g/W||), the division folded into the clip
         coefficient, one scale 8, AdamW 28, zero 4 = 44;
  gradscale: norm 4, AdamW reading g through its AMP `grad_scale` (= W / clip coefficient; the
         fused kernel divides g by it and writes the scaled g back: 32), zero 4 = 40;
  compiled: norm 4, then compiled pointwise kernels reading p g m v and writing p m v 28, and
         the zeroing 4 (in the same kernel where g is one flat tensor); total 36. Over the flat
         buffers (`compiled`), or per parameter on torch AdamW's own state tensors
         (`compiled_views`: checkpoints unchanged); both in optimizer_compiled.py.
All are the same math as today's up to fp32 rounding order; benchmarks/research/tests/test_optimizer_updates.py checks
each against `today` and against mutants, the bench (optimizer_bench.py) times them on a GPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from dflash_async.model.optim import LrSchedule, build_optimizer, flat_grad_buffer
from dflash_async.model.step import NUM_STATS, DrafterStep
from dflash_async.model.update import (
    CLIP_EPS,
    WEIGHT_SUM_FLOOR,
    flat_norm,
    folded_clip_coefficient,
)

__all__ = ["CLIP_EPS", "REL_TOL", "SEQUENCES", "PhaseState", "flat_norm"]

# Tolerance of a candidate against today's sequence, relative to each tensor's largest magnitude
# (per parameter tensor: params, exp_avg, exp_avg_sq; and the reported grad norm), after a few
# steps. Derivation (u = 2^-24, fp32 unit roundoff): the folded arithmetic rounds differently
# from today's by a few u per value (g/W*c vs g*(c/W) or g/(W/c): <= 3u; m and v a few u more;
# a parameter moves by <= 3.2*lr per step, whose rounding is far below one ulp of p at these
# sizes). The one larger term is the grad norm's summation order: the sum of N positive squares
# has relative error <= (L + depth) u for a reduction whose longest sequential run is L terms and
# whose tree has `depth` levels. Today's (multi_tensor_apply's LpNorm: runs of 32 per thread,
# then <= 1280 chunk partials per tensor over 512 threads) and flat_norm's (rows of <= 4096,
# then 1/4096..1/16 of the buffer as partials; ATen's reduce kernels split both over threads)
# stay under ~1000u together: <= ~1050u on the coefficient when clipping is on, x2 on v (it
# holds g^2): ~2100u < 2^-12 = 4096u.
# Bias corrections: CUDA's fused kernel computes 1 - beta2^t in fp32 (cancellation: ~800u on the
# step size at t = 1), and so does `update.adamw_math`; CPU's fused kernel is more exact, so on CPU
# the compiled sequence's p is up to ~800u * |step| / max|p| apart (~100u in the tests).
# Any slip in the math (a factor W, a missing clamp, a parameter left out) moves some tensor by
# O(1) relative: 1000x above this. On CPU the bound holds for N <= ~2000 elements (2(N+46)u);
# CPU's fp32 norm of one long buffer is far off beyond that (30 M elements: 1.8e-3 below the fp64
# value, today's per-tensor norms 6e-5), hence `flat_norm`'s two levels; the bench prints each
# norm's error against fp64 on the GPU's own numbers.
REL_TOL = 2.0**-12


def aligned_offsets(shapes: Sequence[torch.Size]) -> tuple[list[int], int]:
    """Offsets of each tensor in a flat buffer laid out as `flat_grad_buffer` lays out grads
    (each start a multiple of 16 elements), and the buffer's length."""
    offsets, end = [], 0
    for shape in shapes:
        offsets.append(end)
        end += -(-math.prod(shape) // 16) * 16
    return offsets, end


class PhaseState:
    """Phase B's tensors for parameters of `shapes` on `device` (see the module docstring)."""

    def __init__(
        self,
        shapes: Sequence[torch.Size],
        *,
        device: torch.device,
        grad_clip: float = 1.0,
        peak_lr: float = 6e-4,
        warmup_steps: int = 10,
        total_steps: int = 10_000,
        weight_decay: float = 0.0,
    ) -> None:
        self.shapes = [torch.Size(s) for s in shapes]
        self.offsets, length = aligned_offsets(self.shapes)
        self.flat_param = torch.zeros(length, dtype=torch.float32, device=device)
        self.params = [nn.Parameter(torch.zeros(s, device=device)) for s in self.shapes]
        self.flat_grad, self.grads = flat_grad_buffer(self.params)
        for o, p in zip(self.offsets, self.params, strict=True):  # same layout, element for element
            assert p.grad.data_ptr() - self.flat_grad.data_ptr() == o * 4
        self.grad_clip = grad_clip
        self.adamw = None  # `today`: DrafterStep._update's reference path (clip_grad_norm_, fused)
        self.stats = torch.zeros(NUM_STATS, dtype=torch.float32, device=device)  # [1]: sum(w)
        self.grad_norm = torch.zeros((), dtype=torch.float32, device=device)
        self.grad_scale = torch.ones((), dtype=torch.float32, device=device)  # gradscale's
        self.schedule = LrSchedule(
            peak_lr=peak_lr, warmup_steps=warmup_steps, total_steps=total_steps, device=device
        )
        self.optimizer = build_optimizer(
            self.params, lr_tensor=self.schedule.lr, weight_decay=weight_decay
        )
        self.flat = nn.Parameter(self.flat_param)  # the flat candidates' one parameter
        self.flat.grad = self.flat_grad
        self.flat_optimizer = build_optimizer(
            [self.flat], lr_tensor=self.schedule.lr, weight_decay=weight_decay
        )
        self.weight_decay = weight_decay
        # the compiled sequence's own AdamW state (flat), and its step counter
        self.exp_avg = torch.zeros_like(self.flat_param)
        self.exp_avg_sq = torch.zeros_like(self.flat_param)
        self.step = torch.zeros((), dtype=torch.float32, device=device)

    @property
    def device(self) -> torch.device:
        return self.flat_param.device

    @torch.no_grad()
    def reset(self, *, seed: int, weight_sum: float) -> None:
        """Parameters ~ 0.02 N(0,1), AdamW state and schedule at step 0, grads zero, sum(w) set."""
        gen = torch.Generator(self.device).manual_seed(seed)
        self.flat_param.normal_(0.0, 0.02, generator=gen)
        self._zero_padding(self.flat_param)
        for p, view in zip(self.params, self._views(self.flat_param), strict=True):
            p.copy_(view)
        self.flat_grad.zero_()
        for optimizer in (self.optimizer, self.flat_optimizer):
            for state in optimizer.state.values():
                for value in state.values():
                    value.zero_()
        for t in (self.exp_avg, self.exp_avg_sq, self.step, self.grad_norm):
            t.zero_()
        self.schedule.set_step_(0)
        self.stats.zero_()
        self.stats[1] = weight_sum

    @torch.no_grad()
    def fill_grads(self, *, seed: int, norm: float) -> None:
        """Gradients as backward leaves them: N(0,1) in the views scaled so that ||g / W|| is
        `norm` (W = stats[1]), padding zero. Outside any graph; device ops only (no sync)."""
        gen = torch.Generator(self.device).manual_seed(seed)
        self.flat_grad.normal_(generator=gen)
        self._zero_padding(self.flat_grad)
        scale = norm * self.stats[1] / torch.linalg.vector_norm(self.flat_grad)
        self.flat_grad.mul_(scale)

    def _zero_padding(self, flat: torch.Tensor) -> None:
        ends = [o + math.prod(s) for o, s in zip(self.offsets, self.shapes, strict=True)]
        for end, start in zip(ends, [*self.offsets[1:], flat.numel()], strict=True):
            flat[end:start].zero_()

    def tensors(self, source: str) -> tuple[list[torch.Tensor], ...]:
        """(params, exp_avg, exp_avg_sq) per parameter, from `source` (MOMENTS): the parameters
        and the per-parameter AdamW ("params"), or sliced out of the flat parameter and the flat
        AdamW's moments ("flat") or the compiled sequence's pair ("compiled")."""
        if source == "params":
            states = [self.optimizer.state[p] for p in self.params]
            m, v = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
            return list(self.params), m, v
        if source == "flat":
            state = self.flat_optimizer.state[self.flat]
            m, v = state["exp_avg"], state["exp_avg_sq"]
        elif source == "compiled":
            m, v = self.exp_avg, self.exp_avg_sq
        else:
            raise ValueError(f"unknown moments source {source!r} (known: {', '.join(MOMENTS)})")
        return self._views(self.flat_param), self._views(m), self._views(v)

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [
            flat[o : o + math.prod(s)].view(s)
            for o, s in zip(self.offsets, self.shapes, strict=True)
        ]


# ---- today's sequence, and its pieces -------------------------------------------------------
# What each launches on CUDA (read in torch 2.13's sources; the bench's --kernels lists 2.11's).
# Qwen3-8B drafter: 58 tensors, 1.049 B elements, 16,022 chunks of 64 Ki; M = multi_tensor_apply
# launches per op: 51 (320 blocks per launch, 4 KB kernel arguments) or 8 (2240, the 32 KB
# arguments of CUDA >= 13 builds). One block per chunk, 512 threads, 16 B per tensor in flight.
#   div:   clamp_min (tiny) + div_ by a 0-d device tensor: a stride-0 operand, so TensorIterator's
#          non-vectorised kernel (4-byte accesses), 2 launches (> 2^31 bytes: 32-bit split). 8 B.
#   clip:  _foreach_norm (zeros of the chunk partials, M launches, 1 cleanup), stack, norm of 58,
#          + 1e-6, max_norm / x, clamp (tiny); _foreach_mul_ by the 0-d tensor: M launches. 12 B.
#   adamw: _foreach_add_ of the 58 fp32 step tensors (1 launch); _fused_adamw_: M launches, fp32
#          math, bias corrections per block from the step tensor, lr read from its tensor. 28 B.
#   advance: ~10 tiny fp64 kernels.   zero: a vectorised fill, 2 launches. 4 B.


def today(s: PhaseState) -> None:
    """DrafterStep._update as it is (the state has the step's attribute names)."""
    DrafterStep._update(s)  # type: ignore[arg-type]


def div(s: PhaseState) -> None:
    s.flat_grad.div_(s.stats[1].clamp_min(WEIGHT_SUM_FLOOR))


def clip(s: PhaseState) -> None:
    s.grad_norm.copy_(nn.utils.clip_grad_norm_(s.params, s.grad_clip, foreach=True))


def clip_norm(s: PhaseState) -> None:
    """clip_grad_norm_'s first half: _foreach_norm over the views, stack, norm of norms."""
    s.grad_norm.copy_(nn.utils.get_total_norm(s.grads, foreach=True))


def clip_scale(s: PhaseState) -> None:
    """clip_grad_norm_'s second half: coefficient, clamp, _foreach_mul_ over the views."""
    nn.utils.clip_grads_with_norm_(s.params, s.grad_clip, s.grad_norm, foreach=True)


def adamw(s: PhaseState) -> None:
    s.optimizer.step()


def advance(s: PhaseState) -> None:
    s.schedule.advance_()


def zero(s: PhaseState) -> None:
    s.flat_grad.zero_()


# ---- memory-speed references and the flat pieces ----------------------------------------------


def copy(s: PhaseState) -> None:
    """A plain vectorised read + write of the flat buffer: what a stream can reach here."""
    s.flat_grad.copy_(s.flat_param)


def norm_flat(s: PhaseState) -> None:
    """One reduction over the whole flat buffer (ATen's reduce kernel)."""
    s.grad_norm.copy_(torch.linalg.vector_norm(s.flat_grad))


def norm_flat_rows(s: PhaseState) -> None:
    s.grad_norm.copy_(flat_norm(s.flat_grad))


def norm_flat_foreach(s: PhaseState) -> None:
    """The flat norm through multi_tensor_apply (per-chunk partials, then a cleanup kernel)."""
    s.grad_norm.copy_(torch._foreach_norm([s.flat_grad])[0])


def scale_flat(s: PhaseState) -> None:
    """One elementwise kernel by a 0-d device tensor (a broadcast operand: the non-vectorised
    TensorIterator path, as div_ today)."""
    s.flat_grad.mul_(s.grad_scale)


def scale_flat_foreach(s: PhaseState) -> None:
    """The same scale through multi_tensor_apply on one tensor (vectorised, reads the scalar)."""
    torch._foreach_mul_([s.flat_grad], s.grad_scale)


# ---- candidates: the same update, fewer passes -----------------------------------------------


def folded_coefficient(s: PhaseState) -> torch.Tensor:
    """min(1, clip / (||g/W|| + 1e-6)) / W, with ||g/W|| = ||g|| / W from one two-level norm of
    the flat buffer (padding is zero); the reported grad norm is ||g/W|| as today."""
    return folded_clip_coefficient(
        s.flat_grad, s.stats[1], grad_clip=s.grad_clip, norm_out=s.grad_norm
    )


def fold(s: PhaseState) -> None:
    """Division folded into the clip coefficient: one norm, one scale (flat), AdamW, zero."""
    s.flat_grad.mul_(folded_coefficient(s))
    s.optimizer.step()
    s.schedule.advance_()
    s.flat_grad.zero_()


def fold_foreach(s: PhaseState) -> None:
    """`fold` with the scale through multi_tensor_apply (vectorised) instead of mul_."""
    torch._foreach_mul_([s.flat_grad], folded_coefficient(s))
    s.optimizer.step()
    s.schedule.advance_()
    s.flat_grad.zero_()


def fold_flat_adamw(s: PhaseState) -> None:
    """`fold_foreach` with fused AdamW over ONE flat parameter instead of one per tensor."""
    torch._foreach_mul_([s.flat_grad], folded_coefficient(s))
    s.flat_optimizer.step()
    s.schedule.advance_()
    s.flat_grad.zero_()


def gradscale(s: PhaseState) -> None:
    """No scaling pass: fused AdamW divides g by its AMP `grad_scale` (= W / clip coefficient)
    inside the update (and writes g back scaled), over the flat parameter."""
    s.grad_scale.copy_(folded_coefficient(s).reciprocal())
    s.flat_optimizer.grad_scale = s.grad_scale  # read by Adam.step -> _fused_adamw_(grad_scale=)
    try:
        s.flat_optimizer.step()
    finally:
        del s.flat_optimizer.grad_scale
    s.schedule.advance_()
    s.flat_grad.zero_()


MOMENTS = ("params", "flat", "compiled")
# name -> (function, bytes per parameter it must move, where its AdamW moments live: one of
# MOMENTS for a full sequence, None for a piece or a reference)
SEQUENCES: dict[str, tuple[Callable[[PhaseState], None] | None, int, str | None]] = {
    "today": (today, 52, "params"),
    "div": (div, 8, None),
    "clip": (clip, 12, None),
    "clip_norm": (clip_norm, 4, None),
    "clip_scale": (clip_scale, 8, None),
    "adamw": (adamw, 28, None),
    "advance": (advance, 0, None),
    "zero": (zero, 4, None),
    "copy": (copy, 8, None),
    "norm_flat": (norm_flat, 4, None),
    "norm_flat_foreach": (norm_flat_foreach, 4, None),
    "norm_flat_rows": (norm_flat_rows, 4, None),
    "scale_flat": (scale_flat, 8, None),
    "scale_flat_foreach": (scale_flat_foreach, 8, None),
    "fold": (fold, 44, "params"),
    "fold_foreach": (fold_foreach, 44, "params"),
    "fold_flat_adamw": (fold_flat_adamw, 44, "flat"),
    "gradscale": (gradscale, 40, "flat"),
    # built by optimizer_compiled.py (they compile; its `sequence` resolves every name):
    "compiled": (None, 36, "compiled"),
    "compiled_views": (None, 36, "params"),
}
CANDIDATES = tuple(n for n, (_, _, src) in SEQUENCES.items() if src and n != "today")
