"""AdamW, the learning-rate schedule kept in a device tensor, the flat gradient buffer, and the
gradient all-reduce.

Everything a training step calls here is sync-free and CUDA-graph capturable: no `.item()`, no
data-dependent Python branches, and no Python scalar that changes from step to step. The learning
rate lives in a device tensor that the step itself advances (`LrSchedule.advance_`), so a captured
graph follows warmup and cosine decay without ever being recaptured.

Recipe (docs/DFLASH.md s.5): AdamW (0.9, 0.999, eps 1e-8, weight decay 0), peak lr 6e-4, linear
warmup over 4% of the steps, then cosine to 0, gradients clipped to norm 1.0. Clipping is
torch.nn.utils.clip_grad_norm_ with foreach=True (step.py): sync-free with its default
error_if_nonfinite=False (always multiplies by min(1, max_norm / (norm + 1e-6)), no `if`), and
capturable; its math is what a hand-written version here used to do, op for op.

With several drafter devices (data parallel, one process), each drafter keeps its gradients in one
flat buffer (`flat_grad_buffer`, fp32; with step.py's working weights `flat_buffer`, bf16) so that
a single `all_reduce_sum` over those buffers moves every gradient between backward and the
optimizer (docs/GPU.md: graph A, all-reduce, graph B).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import nn

# Each gradient view starts on a multiple of 16 elements (64 bytes in fp32, 32 in bf16) of the
# flat buffer, so vectorised kernels (fused AdamW, foreach norm) see aligned views. Padding
# elements stay zero.
_GRAD_ALIGN_ELEMS = 16


def warmup_steps_for(total_steps: int, warmup_frac: float = 0.04) -> int:
    """The recipe's warmup length: `warmup_frac` of the run, rounded, at least 1 step."""
    if total_steps < 1:
        raise ValueError(f"total_steps={total_steps} must be at least 1")
    if not 0.0 <= warmup_frac <= 1.0:
        raise ValueError(f"warmup_frac={warmup_frac} must be within [0, 1]")
    return max(1, round(warmup_frac * total_steps))


def _check_schedule(peak_lr: float, warmup_steps: int, total_steps: int) -> None:
    if not peak_lr >= 0.0:
        raise ValueError(f"peak_lr={peak_lr} must be >= 0")
    if total_steps < 1:
        raise ValueError(f"total_steps={total_steps} must be at least 1")
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(
            f"warmup_steps={warmup_steps} must be within [0, total_steps={total_steps}]"
        )


def lr_at(step: int, *, peak_lr: float, warmup_steps: int, total_steps: int) -> float:
    """The learning rate of optimizer step `step` (0-based): the reference schedule, plain Python.

    Warmup: `peak * (step + 1) / warmup_steps` (starts near 0, reaches peak on the last warmup
    step; step 0 is not wasted at lr 0). Then cosine from peak at `warmup_steps` towards 0 at
    `total_steps`; steps at or past `total_steps` get 0.
    """
    _check_schedule(peak_lr, warmup_steps, total_steps)
    if step < 0:
        raise ValueError(f"step={step} must be >= 0")
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return peak_lr * 0.5 * (1.0 + math.cos(math.pi * progress))


class LrSchedule:
    """The schedule of `lr_at`, kept on the device: `lr` (fp32, 0-d) is what AdamW reads.

    `lr` always holds the rate of the NEXT optimizer step, `step` (int64, 0-d) its index. Call
    `advance_()` right after `optimizer.step()`, inside the captured graph: it increments `step`
    and recomputes `lr` in place with torch ops (float64 on the device), so replays follow the
    schedule. The tensors are never reallocated: a graph keeps pointing at them.
    """

    def __init__(
        self,
        *,
        peak_lr: float,
        warmup_steps: int,
        total_steps: int,
        device: torch.device | str,
        start_step: int = 0,
    ) -> None:
        _check_schedule(peak_lr, warmup_steps, total_steps)
        self.peak_lr = float(peak_lr)
        self.warmup_steps = int(warmup_steps)
        self.total_steps = int(total_steps)
        self.step = torch.zeros((), dtype=torch.int64, device=device)
        self.lr = torch.zeros((), dtype=torch.float32, device=device)
        self.set_step_(start_step)

    def set_step_(self, step: int) -> None:
        """Jump to `step` (resume). In place, but with a Python value: call it outside capture."""
        if step < 0:
            raise ValueError(f"step={step} must be >= 0")
        self.step.fill_(step)
        self.lr.copy_(self._lr_of(self.step))

    def advance_(self) -> None:
        """step += 1 and lr = schedule(step), on the device: sync-free and capturable."""
        self.step.add_(1)
        self.lr.copy_(self._lr_of(self.step))

    def _lr_of(self, step: torch.Tensor) -> torch.Tensor:
        # Same formula as lr_at, branch-free: torch.where picks warmup or cosine per value.
        s = step.to(torch.float64)
        warm = s.add(1.0).mul(self.peak_lr / max(1, self.warmup_steps))
        progress = s.sub(self.warmup_steps).div(max(1, self.total_steps - self.warmup_steps))
        cosine = progress.clamp(0.0, 1.0).mul(math.pi).cos().add(1.0).mul(0.5 * self.peak_lr)
        return torch.where(s < self.warmup_steps, warm, cosine)


def build_optimizer(
    params: Iterable[nn.Parameter],
    *,
    lr_tensor: torch.Tensor,
    weight_decay: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> torch.optim.AdamW:
    """AdamW reading its learning rate from `lr_tensor` (1 element, fp32, on the params' device).

    CUDA: fused=True, capturable=True (step counters on the device; the whole update can be
    captured; initialise its state with >= 1 eager step before capture).
    CPU: fused=True as well. Checked on torch 2.13 (2.11 not checked on CPU): a tensor lr with
    foreach=True is refused unless capturable=True ("lr as a Tensor is not supported for
    capturable=False and foreach=True"), and capturable is CUDA/XPU/HPU only; the fused kernel
    (CPU support since torch 2.4) and the single-tensor loop both accept a tensor lr and follow
    in-place updates to it. Fused is the faster of the two and matches the CUDA path.
    """
    params = list(params)
    if not params:
        raise ValueError("build_optimizer got no parameters")
    devices = {p.device for p in params}
    if len(devices) != 1:
        raise ValueError(
            f"params span several devices {sorted(map(str, devices))}: one per drafter"
        )
    (device,) = devices
    if lr_tensor.numel() != 1 or lr_tensor.dtype != torch.float32 or lr_tensor.device != device:
        raise ValueError(
            f"lr_tensor must be 1 fp32 element on {device}, got shape {tuple(lr_tensor.shape)} "
            f"{lr_tensor.dtype} on {lr_tensor.device}"
        )
    return torch.optim.AdamW(
        params,
        lr=lr_tensor,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        fused=True,
        capturable=device.type == "cuda",
    )


def flat_grad_buffer(params: Sequence[nn.Parameter]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One contiguous fp32 buffer holding every param's `.grad` as a view; returns (flat, views).

    Backward accumulates into an existing `.grad` in place, so after this call gradients land in
    `flat` and one all-reduce over it moves them all. Zero with `flat.zero_()`, never with
    `optimizer.zero_grad()` (its default set_to_none=True would drop the views). All params must
    be fp32 and on one device (one drafter).
    """
    params = list(params)
    if not params:
        raise ValueError("flat_grad_buffer got no parameters")
    device = params[0].device
    for i, p in enumerate(params):
        if p.dtype != torch.float32 or p.device != device:
            raise ValueError(
                f"params must be fp32 on {device}: param {i} is {p.dtype} on {p.device}"
            )
    flat, views = flat_buffer([p.shape for p in params], dtype=torch.float32, device=device)
    for p, view in zip(params, views, strict=True):
        p.grad = view
    return flat, views


def flat_buffer(
    shapes: Sequence[torch.Size], *, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A zeroed contiguous buffer and one view of each shape in it, each view starting on a
    multiple of 16 elements (the padding between them stays zero)."""
    offsets, end = [], 0
    for shape in shapes:
        offsets.append(end)
        end += -(-math.prod(shape) // _GRAD_ALIGN_ELEMS) * _GRAD_ALIGN_ELEMS
    flat = torch.zeros(end, dtype=dtype, device=device)
    views = [
        flat[start : start + math.prod(shape)].view(shape)
        for shape, start in zip(shapes, offsets, strict=True)
    ]
    return flat, views


@torch.no_grad()
def all_reduce_sum(tensors: list[torch.Tensor]) -> None:
    """Replace each tensor by the sum of all of them, in place (one tensor per drafter).

    CUDA: one single-process `torch.cuda.nccl.all_reduce`; the tensors must sit on distinct GPUs.
    It is enqueued on each device's current stream of the calling thread and does not wait: the
    caller orders it against each drafter's backward and optimizer with events (docs/GPU.md).
    NCCL communicators are created on the first call for a device set and cached by torch.
    CPU (tests, the CPU demo with several drafters): a plain sum copied back into each tensor.
    """
    if not tensors:
        raise ValueError("all_reduce_sum got no tensors")
    first = tensors[0]
    for t in tensors[1:]:
        if t.shape != first.shape or t.dtype != first.dtype:
            raise ValueError(
                f"all_reduce_sum needs one shape and dtype, got {tuple(first.shape)} {first.dtype} "
                f"and {tuple(t.shape)} {t.dtype}"
            )
    kinds = {t.device.type for t in tensors}
    if kinds == {"cuda"}:
        _nccl_all_reduce_sum(tensors)
    elif kinds == {"cpu"}:
        _cpu_all_reduce_sum(tensors)
    else:
        raise ValueError(f"all_reduce_sum needs all-CUDA or all-CPU tensors, got {sorted(kinds)}")


def _nccl_all_reduce_sum(tensors: list[torch.Tensor]) -> None:
    devices = [t.device.index for t in tensors]
    if len(set(devices)) != len(devices):
        raise ValueError(f"all_reduce_sum needs one tensor per GPU, got devices {devices}")
    if len(tensors) == 1:
        return
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("all_reduce_sum: NCCL needs contiguous tensors")
    torch.cuda.nccl.all_reduce(tensors)


def _cpu_all_reduce_sum(tensors: list[torch.Tensor]) -> None:
    if len(tensors) == 1:
        return
    total = tensors[0].clone()
    for t in tensors[1:]:
        total.add_(t)
    for t in tensors:
        t.copy_(total)
