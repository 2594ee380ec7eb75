"""optim.py: the schedule in a tensor equals the reference, AdamW follows it, gradients gather in
one flat buffer (where the step's foreach clipping sees what it would see on separate gradients),
and the all-reduce makes data parallel equal one big batch."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dflash_async.model.optim import (
    LrSchedule,
    all_reduce_sum,
    build_optimizer,
    flat_grad_buffer,
    lr_at,
    warmup_steps_for,
)

PEAK, WARMUP, TOTAL = 6e-4, 4, 100


def clip_grad_norm_(params, max_norm: float) -> torch.Tensor:
    """The step's clipping (step.py): torch's, foreach, sync-free (error_if_nonfinite=False)."""
    return nn.utils.clip_grad_norm_(params, max_norm, foreach=True)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5))


def _batch(seed: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 7, generator=g), torch.randn(n, 5, generator=g)


def test_lr_at_warms_up_linearly_then_decays_by_cosine_to_zero() -> None:
    lr = [lr_at(s, peak_lr=PEAK, warmup_steps=WARMUP, total_steps=TOTAL) for s in range(TOTAL + 3)]
    assert lr[0] == pytest.approx(PEAK / WARMUP)  # starts near 0, not at 0 (no wasted step)
    assert lr[WARMUP - 1] == pytest.approx(PEAK)
    assert lr[WARMUP] == pytest.approx(PEAK)
    assert lr[WARMUP + (TOTAL - WARMUP) // 2] == pytest.approx(PEAK / 2)
    assert 0 < lr[TOTAL - 1] < 1e-3 * PEAK
    assert lr[TOTAL] == lr[TOTAL + 2] == 0.0
    assert all(a >= b for a, b in zip(lr[WARMUP:], lr[WARMUP + 1 :], strict=False))


def test_lr_at_without_warmup_starts_at_peak() -> None:
    assert lr_at(0, peak_lr=PEAK, warmup_steps=0, total_steps=10) == pytest.approx(PEAK)


@pytest.mark.parametrize(
    ("step", "warmup", "total", "bad"),
    [(-1, 4, 100, "step=-1"), (0, 101, 100, "warmup_steps=101"), (0, 0, 0, "total_steps=0")],
)
def test_lr_at_names_the_bad_argument(step: int, warmup: int, total: int, bad: str) -> None:
    with pytest.raises(ValueError, match=bad):
        lr_at(step, peak_lr=PEAK, warmup_steps=warmup, total_steps=total)


def test_warmup_is_four_percent_of_the_run_and_at_least_one_step() -> None:
    assert warmup_steps_for(1000) == 40
    assert warmup_steps_for(10) == 1


def test_lr_tensor_equals_lr_at_at_every_step() -> None:
    schedule = LrSchedule(peak_lr=PEAK, warmup_steps=WARMUP, total_steps=TOTAL, device="cpu")
    lr_ptr, step_ptr = schedule.lr.data_ptr(), schedule.step.data_ptr()
    for step in range(TOTAL + 3):  # 0, warmup end, middle, last, past the end
        expected = lr_at(step, peak_lr=PEAK, warmup_steps=WARMUP, total_steps=TOTAL)
        assert int(schedule.step) == step
        torch.testing.assert_close(schedule.lr, torch.tensor(expected), rtol=1e-6, atol=0.0)
        schedule.advance_()
    # Updated in place: a captured graph keeps reading the same memory.
    assert (schedule.lr.data_ptr(), schedule.step.data_ptr()) == (lr_ptr, step_ptr)


def test_lr_schedule_resumes_at_the_saved_step() -> None:
    schedule = LrSchedule(
        peak_lr=PEAK, warmup_steps=WARMUP, total_steps=TOTAL, device="cpu", start_step=37
    )
    expected = lr_at(37, peak_lr=PEAK, warmup_steps=WARMUP, total_steps=TOTAL)
    torch.testing.assert_close(schedule.lr, torch.tensor(expected), rtol=1e-6, atol=0.0)
    schedule.set_step_(2)
    assert float(schedule.lr) == pytest.approx(PEAK * 3 / WARMUP)


def test_optimizer_follows_the_lr_tensor_like_adamw_with_a_float_lr() -> None:
    model, reference = _model(), _model()
    schedule = LrSchedule(peak_lr=0.05, warmup_steps=3, total_steps=12, device="cpu")
    opt = build_optimizer(model.parameters(), lr_tensor=schedule.lr, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.0, weight_decay=0.1, foreach=False)
    for step in range(12):
        x, y = _batch(step)
        for m in (model, reference):
            nn.functional.mse_loss(m(x), y).backward()
        ref_opt.param_groups[0]["lr"] = lr_at(step, peak_lr=0.05, warmup_steps=3, total_steps=12)
        opt.step()
        schedule.advance_()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_build_optimizer_rejects_an_lr_tensor_of_the_wrong_dtype() -> None:
    with pytest.raises(ValueError, match="float64"):
        build_optimizer(
            _model().parameters(), lr_tensor=torch.tensor(1e-3, dtype=torch.float64), weight_decay=0
        )


@pytest.mark.parametrize("max_norm", [1e-3, 1.0, 1e3, float("inf")])
def test_clipping_the_flat_buffer_views_equals_clipping_separate_gradients(max_norm: float) -> None:
    """The step clips views into the padded flat buffer; the padding must stay out of the norm
    and untouched, and the result equal the per-tensor (non-foreach) reference."""
    model = _model()
    flat, views = flat_grad_buffer(list(model.parameters()))
    x, y = _batch(0)
    nn.functional.mse_loss(model(x), y).backward()
    padding = torch.ones_like(flat, dtype=torch.bool)
    for view in views:
        start = (view.data_ptr() - flat.data_ptr()) // flat.element_size()
        padding[start : start + view.numel()] = False
    assert bool(padding.any())  # 7x13 and 13x5 weights are not multiples of the alignment
    flat[padding] = 7.0  # a norm that counted the padding would be off
    reference = copy.deepcopy(model)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        q.grad = p.grad.clone()  # deepcopy does not copy .grad
    norm = clip_grad_norm_(model.parameters(), max_norm)
    ref_norm = nn.utils.clip_grad_norm_(reference.parameters(), max_norm, foreach=False)
    assert norm.dim() == 0
    torch.testing.assert_close(norm, ref_norm)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
        assert p.grad.data_ptr() != q.grad.data_ptr()
    assert bool((flat[padding] == 7.0).all())  # clipping scaled the views, not the buffer
    assert all(
        v.data_ptr() == p.grad.data_ptr() for v, p in zip(views, model.parameters(), strict=True)
    )


def test_backward_accumulates_into_the_flat_buffer() -> None:
    model, reference = _model(), _model()
    params = list(model.parameters())
    flat, views = flat_grad_buffer(params)
    x, y = _batch(0)
    for _ in range(2):  # a second backward accumulates, as micro-batches do
        nn.functional.mse_loss(model(x), y).backward()
        nn.functional.mse_loss(reference(x), y).backward()
    storage = flat.untyped_storage().data_ptr()
    for p, view, q in zip(params, views, reference.parameters(), strict=True):
        assert p.grad is view and p.grad.untyped_storage().data_ptr() == storage
        assert (p.grad.data_ptr() - flat.data_ptr()) % (16 * 4) == 0  # 64-byte aligned views
        torch.testing.assert_close(p.grad, q.grad)
    total = sum(p.numel() for p in params)
    assert flat.abs().sum() > 0 and flat.numel() >= total
    flat.zero_()
    assert all(p.grad.abs().sum() == 0 for p in params)


def test_flat_grad_buffer_names_a_param_that_is_not_fp32() -> None:
    params = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))]
    with pytest.raises(ValueError, match=r"param 1 is torch.bfloat16"):
        flat_grad_buffer(params)


def test_cpu_all_reduce_puts_the_sum_into_every_tensor() -> None:
    tensors = [torch.full((5,), float(i)) for i in range(1, 4)]
    all_reduce_sum(tensors)
    for t in tensors:
        assert torch.equal(t, torch.full((5,), 6.0))


def test_all_reduce_rejects_tensors_of_different_shapes() -> None:
    with pytest.raises(ValueError, match=r"\(5,\).*\(4,\)"):
        all_reduce_sum([torch.zeros(5), torch.zeros(4)])


def test_two_drafters_with_all_reduce_equal_one_drafter_on_both_batches() -> None:
    """Data parallel: sum-reduced gradients, clip, AdamW == one model seeing all the data."""
    drafters, single = [_model(), _model()], _model()
    flats, opts = [], []
    for m in drafters:
        flat, _ = flat_grad_buffer(list(m.parameters()))
        schedule = LrSchedule(peak_lr=0.05, warmup_steps=1, total_steps=4, device="cpu")
        flats.append(flat)
        opts.append(
            (build_optimizer(m.parameters(), lr_tensor=schedule.lr, weight_decay=0), schedule)
        )
    one_schedule = LrSchedule(peak_lr=0.05, warmup_steps=1, total_steps=4, device="cpu")
    one_opt = build_optimizer(single.parameters(), lr_tensor=one_schedule.lr, weight_decay=0)
    for step in range(3):
        batches = [_batch(10 * step + i) for i in range(2)]
        for m, (x, y) in zip(drafters, batches, strict=True):
            nn.functional.mse_loss(m(x), y, reduction="sum").backward()
        all_reduce_sum(flats)
        for m, flat, (opt, schedule) in zip(drafters, flats, opts, strict=True):
            clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            schedule.advance_()
            flat.zero_()
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        nn.functional.mse_loss(single(x), y, reduction="sum").backward()
        clip_grad_norm_(single.parameters(), 1.0)
        one_opt.step()
        one_schedule.advance_()
        one_opt.zero_grad()
    for p, q, r in zip(*(m.parameters() for m in (*drafters, single)), strict=True):
        assert torch.equal(p, q)  # replicas stay bit-identical
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs >= 2 GPUs")
def test_nccl_all_reduce_sums_gradients_across_gpus() -> None:
    n = torch.cuda.device_count()
    tensors = [torch.full((1 << 20,), float(i + 1), device=f"cuda:{i}") for i in range(n)]
    all_reduce_sum(tensors)
    for i in range(n):
        torch.cuda.synchronize(i)
    expected = float(n * (n + 1) // 2)
    for t in tensors:
        assert torch.equal(t.cpu(), torch.full((1 << 20,), expected))


@pytest.mark.gpu
@needs_cuda
def test_captured_clip_and_adamw_step_follow_the_schedule_without_recapture() -> None:
    """Graph B (clip + fused capturable AdamW + schedule advance) replayed == eager steps."""
    torch.cuda.set_device(0)
    model, reference = _model().cuda(), _model().cuda()
    flat, _ = flat_grad_buffer(list(model.parameters()))
    ref_flat, _ = flat_grad_buffer(list(reference.parameters()))
    sched = LrSchedule(peak_lr=0.05, warmup_steps=3, total_steps=10, device="cuda:0")
    ref_sched = LrSchedule(peak_lr=0.05, warmup_steps=3, total_steps=10, device="cuda:0")
    opt = build_optimizer(model.parameters(), lr_tensor=sched.lr, weight_decay=0.1)
    ref_opt = build_optimizer(reference.parameters(), lr_tensor=ref_sched.lr, weight_decay=0.1)

    def update(m: nn.Module, o: torch.optim.Optimizer, s: LrSchedule) -> None:
        clip_grad_norm_(m.parameters(), 1.0)
        o.step()
        s.advance_()

    grads = [torch.randn_like(flat) for _ in range(10)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for g in grads[:2]:  # warm-up: creates the optimizer state before capture
            flat.copy_(g)
            update(model, opt, sched)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        update(model, opt, sched)
    for g in grads[:2]:
        ref_flat.copy_(g)
        update(reference, ref_opt, ref_sched)
    for step, g in enumerate(grads[2:], start=2):
        flat.copy_(g)
        ref_flat.copy_(g)
        graph.replay()
        update(reference, ref_opt, ref_sched)
        expected = lr_at(step + 1, peak_lr=0.05, warmup_steps=3, total_steps=10)
        assert float(sched.lr) == pytest.approx(expected, rel=1e-6)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q)
