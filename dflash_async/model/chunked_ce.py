"""The chunked, weighted block cross-entropy of the DFlash objectives (moved out of objective.py).

sum_i w_i * CE(transform(hidden_i @ W^T), y_i) over the trained slots, chunk by chunk: the
[N, V] logits never exist at once, and each chunk's gradient with respect to `hidden` is made in
the forward pass. `transform` is the drafter's logit transform (logit_transforms.py), applied
inside the chunk exactly as at inference. No op here reads device data on the host.
"""

from __future__ import annotations

import torch

from dflash_async.model.logit_transforms import LogitTransform, transformed_ce_and_grad


def ce_and_grad_from_logits(
    logits: torch.Tensor,  # [c, V]
    labels: torch.Tensor,  # [c]
    weights: torch.Tensor,  # [c]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """sum(w*CE) (in >= fp32), argmax==label [c], and d sum(w*CE) / d logits [c, V].

    Pure elementwise + row reductions: compiled on GPU it reads the logits twice and writes the
    gradient once (eager: ~8 passes over [c, V] fp32).
    """
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    lse = x.logsumexp(-1)  # [c]
    ce = lse - x.gather(1, labels[:, None]).squeeze(1)
    trained = weights > 0
    # select, never multiply by 0: a non-finite CE at an untrained slot must not leak in
    w = torch.where(trained, weights, 0.0).to(x.dtype)
    ce_sum = torch.where(trained, w * ce, 0.0).sum()
    hit = x.argmax(-1) == labels
    vocab = torch.arange(x.shape[1], device=x.device)
    grad = ((x - lse[:, None]).exp() - (vocab[None, :] == labels[:, None]).to(x.dtype)) * w[:, None]
    return ce_sum, hit, grad.to(logits.dtype)


def _chunk_ce_and_grad(
    hidden: torch.Tensor,  # [c, d]
    lm_head_weight: torch.Tensor,  # [V, d]
    labels: torch.Tensor,  # [c]
    weights: torch.Tensor,  # [c]
    need_grad: bool,
    elementwise,
    transform: LogitTransform,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """sum(w*CE), argmax==label [c] and d sum(w*CE) / d hidden [c, d] for one chunk, the CE on
    the transformed logits."""
    weight = lm_head_weight.to(hidden.dtype)
    logits = hidden @ weight.T  # [c, V]
    ce_sum, hit, grad_logits, _ = transformed_ce_and_grad(
        transform, elementwise, logits, labels, weights
    )
    grad_hidden = grad_logits @ weight if need_grad else None  # [c, d]
    return ce_sum, hit, grad_hidden


class _LinearWeightedCE(torch.autograd.Function):
    """sum_i w_i * CE(hidden_i @ W^T, y_i), computed chunk by chunk; gradient made in forward.

    The [N, V] logits never exist at once: each chunk's logits give its loss AND its gradient
    with respect to `hidden` right away, so backward is one scale of a stored [N, d] tensor and
    the lm_head matmul is not recomputed (what activation checkpointing would cost).
    """

    @staticmethod
    def forward(
        ctx, hidden, lm_head_weight, labels, weights, chunk_size: int, elementwise, transform
    ):
        need_grad = hidden.requires_grad
        sums, hits, grads = [], [], []
        for start in range(0, hidden.shape[0], chunk_size):
            end = start + chunk_size
            ce_sum, hit, grad = _chunk_ce_and_grad(
                hidden[start:end],
                lm_head_weight,
                labels[start:end],
                weights[start:end],
                need_grad,
                elementwise,
                transform,
            )
            sums.append(ce_sum)
            hits.append(hit)
            grads.append(grad)
        if need_grad:
            ctx.save_for_backward(torch.cat(grads))
        hit = torch.cat(hits)
        ctx.mark_non_differentiable(hit)
        return torch.stack(sums).sum(), hit

    @staticmethod
    def backward(ctx, grad_sum, _grad_hit):
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_sum.to(grad_hidden.dtype), None, None, None, None, None, None


def linear_weighted_cross_entropy(
    hidden: torch.Tensor,  # [N, d]
    lm_head_weight: torch.Tensor,  # [V, d], frozen
    labels: torch.Tensor,  # [N]
    weights: torch.Tensor,  # [N], >= 0; positions with w == 0 are excluded by selection
    chunk_size: int,
    elementwise=ce_and_grad_from_logits,
    transform: LogitTransform = LogitTransform(),  # noqa: B008  frozen: a shared default is safe
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of w * CE, argmax == label [N]) with at most [chunk_size, V] logits alive at a time;
    the CE is on transform(logits) (the drafter's output multiplier and softcap).

    The chunk count is static (N and chunk_size are fixed per built objective). `lm_head_weight`
    gets no gradient (the target is frozen).
    """
    return _LinearWeightedCE.apply(
        hidden, lm_head_weight.detach(), labels, weights, chunk_size, elementwise, transform
    )
