"""The DFlash2 training objective: DFlash's loss on the unary logits plus alpha x the selector's CE.

This module owns the objective choice for DFlash2 (docs/DFLASH.md s.10; the authors published
none) and its convolutions' kernel choice (`resolve_conv_kernel`). For a trained slot n (block j, slot k >= 1, weight w_n > 0 as in s.4):
- unary logits u_n = lm_head(h_n), after the drafter's logit transforms (output multiplier,
  softcap: logit_transforms.py), as at inference; the DFlash loss term is w_n * CE(u_n, gold_n), exactly as
  DFlashObjective computes it (same chunks, same elementwise pass);
- candidates S_n = the strict top-k of u_n (k = selector_top_k; grouped_topk.py, on the device);
- predecessor = the GOLD token of the previous slot (the anchor token for k = 1: teacher forcing);
- score_n(c) = u_n(c) + <pred[prev] * hidden_projection(h_n), succ[c]> for c in S_n;
- selector term w_n * CE(score_n over S_n, gold_n) when gold_n is in S_n; nothing otherwise.
The step's loss is sum(w * (CE_unary + alpha * [gold in S] * CE_selector)) / sum(w): the selector
shares the DFlash weights and normaliser, so the step's sums and their all-reduce are DFlash's.
Both terms train the backbone (the selector CE also reaches u_n(c) at the candidates).

Fixed-shape and sync-free like DFlashObjective: topk, gathers and selections only. The top-k's
first step, the group maxima of the unary logits, is an output of the CE chunk's pass
(`ce_grad_and_group_max`; on the GPU the Triton kernel's), which reads those logits anyway.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Literal

import torch

from dflash_async.data.packing import PackedBatch
from dflash_async.model.chunked_ce import ce_and_grad_from_logits
from dflash_async.model.kinds.dflash2.drafter import CandidateSelector, DFlash2Drafter
from dflash_async.model.kinds.dflash2.grouped_topk import group_maxima, group_width, grouped_topk
from dflash_async.model.logit_transforms import transformed_ce_and_grad
from dflash_async.model.objective import (
    Anchors,
    DFlashObjective,
    ObjectiveConfig,
    StepSums,
)
from dflash_async.model.step_ranges import step_range

if TYPE_CHECKING:  # the config is built from every kind's fields (model/kinds/)
    from dflash_async.model.drafter_config import DrafterConfig


def selector_predecessors(labels: torch.Tensor) -> torch.Tensor:
    """[A, B] gold tokens per slot (slot 0 = the anchor) -> [A, B-1] predecessors of slots 1..B-1:
    the previous slot's gold token (teacher forcing)."""
    return labels[:, :-1]


def selector_targets(
    candidates: torch.Tensor,  # [N, k]
    gold: torch.Tensor,  # [N]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(in_set [N, k]: candidate == gold, has_gold [N]): a gold token outside the strict top-k
    has no target and gives no selector loss."""
    in_set = candidates == gold[:, None]
    return in_set, in_set.any(-1)


def ce_grad_and_group_max(
    logits: torch.Tensor,  # [c, V]
    labels: torch.Tensor,  # [c]
    weights: torch.Tensor,  # [c]
    *,
    group_width: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The DFlash2 chunk's elementwise pass, reference form: ce_and_grad_from_logits's three
    outputs and group_maxima(logits, group_width) [c, V / group_width]. Compiled (GPU,
    ce_kernel='compiled'), the maxima fuse into the CE's reads; ce_kernel.py's
    ce_grad_and_group_max_triton is the same contract in one Triton launch."""
    return (*ce_and_grad_from_logits(logits, labels, weights), group_maxima(logits, group_width))


def candidate_rows_grad(
    grad: torch.Tensor,  # [c, k] d loss / d logit at the candidates
    index: torch.Tensor,  # [c, k] the candidates
    weight: torch.Tensor,  # [V, d] the lm_head
) -> torch.Tensor:
    """sum_j grad[n, j] * weight[index[n, j]]: [c, d] in >= fp32, the candidates' unary values'
    gradient with respect to the slots' hidden states, added over j = 0..k-1 in order. Written
    as k terms (as grouped_experts.combine) so that, compiled, it is one pointwise kernel whose k
    loads read whole lm_head rows, and the [c, k, d] rows are never written out; eager (the
    CPU) it is k gathers of [c, d]."""
    g = grad.to(weight.dtype)
    acc = torch.promote_types(weight.dtype, torch.float32)  # fp32 for bf16 (fp64 tests: fp64)
    total = (g[:, :1] * weight[index[:, 0]]).to(acc)
    for j in range(1, index.shape[1]):  # k is static (selector_top_k)
        total = total + (g[:, j : j + 1] * weight[index[:, j]]).to(acc)
    return total


class _UnaryCEAndTopK(torch.autograd.Function):
    """DFlash's chunked weighted CE (objective._LinearWeightedCE) that also returns each row's
    unary top-k values and indices. The values are differentiable: their gradient reaches
    `hidden` through the k lm_head rows of the candidates, chunk by chunk in backward."""

    @staticmethod
    def forward(
        ctx,
        hidden,
        lm_head_weight,
        labels,
        weights,
        chunk_size: int,
        elementwise,
        k: int,
        transform,
        rows_grad,
    ):
        weight = lm_head_weight.to(hidden.dtype)  # [V, d]
        sums, hits, grads, values, indices = [], [], [], [], []
        for start in range(0, hidden.shape[0], chunk_size):
            end = start + chunk_size
            logits = hidden[start:end] @ weight.T  # [c, V]
            ce_sum, hit, grad_logits, z, *group_max = transformed_ce_and_grad(
                transform, elementwise, logits, labels[start:end], weights[start:end]
            )  # z: the transformed (unary) logits, what the selector adds to; group_max: its
            # group maxima where `elementwise` is a ce_grad_and_group_max (else none)
            top_values, top_index = grouped_topk(  # on the device: no host sync
                z, k, group_max=group_max[0] if group_max else None
            )
            sums.append(ce_sum)
            hits.append(hit)
            grads.append(grad_logits @ weight)  # [c, d]
            values.append(top_values)
            indices.append(top_index)
        index = torch.cat(indices)  # [N, k]
        top_values = torch.cat(values)  # [N, k] transformed: the chain rule reads them back
        ctx.save_for_backward(torch.cat(grads), index, weight, top_values)
        ctx.chunk_size, ctx.transform, ctx.rows_grad = chunk_size, transform, rows_grad
        hit = torch.cat(hits)
        ctx.mark_non_differentiable(hit, index)
        return torch.stack(sums).sum(), hit, top_values, index

    @staticmethod
    def backward(ctx, grad_sum, _grad_hit, grad_values, _grad_index):
        grad_ce, index, weight, top_values = ctx.saved_tensors
        grad_hidden = grad_ce * grad_sum.to(grad_ce.dtype)
        if grad_values is not None:  # d/d hidden of sum_c g[n, c] * <hidden_n, W[c]>
            parts = []
            for start in range(0, index.shape[0], ctx.chunk_size):
                end = start + ctx.chunk_size
                g = grad_values[start:end]  # [c, k] d/dz at the candidates, chained to logits
                if not ctx.transform.is_identity:
                    g = ctx.transform.chain(g, top_values[start:end])
                parts.append(ctx.rows_grad(g, index[start:end], weight))  # [c, d]
            grad_hidden = grad_hidden + torch.cat(parts).to(grad_hidden.dtype)
        return grad_hidden, None, None, None, None, None, None, None, None


def selector_cross_entropy(
    scores: torch.Tensor,  # [N, k] unary + pair scores
    in_set: torch.Tensor,  # [N, k] bool
    counted: torch.Tensor,  # [N] bool: w > 0 and gold in the set
    weights: torch.Tensor,  # [N]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of w * CE over the counted rows, argmax == gold [N]); rows are excluded by
    selection, never by multiplying by 0."""
    x = scores.to(torch.promote_types(scores.dtype, torch.float32))
    gold_score = torch.where(in_set, x, 0.0).sum(-1)  # one True per counted row
    ce = x.logsumexp(-1) - gold_score
    w = torch.where(counted, weights, 0.0).to(x.dtype)
    hit = in_set.gather(1, x.argmax(-1, keepdim=True)).squeeze(1)
    return torch.where(counted, w * ce, 0.0).sum(), hit


def selector_loss(
    selector: CandidateSelector,
    slots: torch.Tensor,  # [N, d]
    previous: torch.Tensor,  # [N] predecessors
    candidates: torch.Tensor,  # [N, k]
    unary: torch.Tensor,  # [N, k] the candidates' unary logits (differentiable)
    gold: torch.Tensor,  # [N]
    weights: torch.Tensor,  # [N]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The selector's term: (sum of w * CE over the trained rows whose gold is in the set,
    argmax == gold [N], gold in the set [N]). One function, so that DFlash2Objective can compile
    it as one graph: eager it is ~20 small kernels (gathers, the [N, k, r] successor rows, casts,
    the rank-r products, the CE) each way."""
    pair = selector.pair_scores(slots, previous, candidates)
    in_set, has_gold = selector_targets(candidates, gold)
    counted = (weights > 0) & has_gold
    selector_sum, hit = selector_cross_entropy(unary + pair, in_set, counted, weights)
    return selector_sum, hit, has_gold


def resolve_conv_kernel(
    choice: str, config: DrafterConfig, *, device: torch.device
) -> Literal["triton", "compiled"]:
    """DFLASH_TRAIN__CONV_KERNEL (StepSpec.conv_kernel) resolved for this drafter on `device`: auto takes the Triton
    kernels on a GPU where conv_kernel_problem finds none (the reference elsewhere); triton
    where they cannot run is a ValueError that says why."""
    if choice == "compiled":
        return "compiled"
    if device.type != "cuda":
        if choice == "triton":
            raise ValueError("conv_kernel='triton' needs the drafter on a CUDA device")
        return "compiled"
    from dflash_async.kernels.conv_kernel import conv_kernel_problem  # a GPU: triton is there

    problem = conv_kernel_problem(
        hidden_size=config.hidden_size,
        group_size=config.conv_group_size,
        taps=config.conv_kernel_size,
    )
    if problem and choice == "triton":
        raise ValueError(f"conv_kernel='triton': {problem}")
    return "compiled" if problem else "triton"


class DFlash2Objective(DFlashObjective):
    """DFlash's objective on a DFlash2 drafter, plus the selector's teacher-forced CE."""

    def __init__(
        self,
        config: ObjectiveConfig,
        drafter: DFlash2Drafter,
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor,
        *,
        selector_alpha: float = 1.0,
        conv_kernel: Literal["auto", "compiled", "triton"] = "auto",
        flex_fn=None,
    ) -> None:
        """`conv_kernel`: the convolutions' kernels, kernels/conv_kernel.py's Triton ones (GPU
        only) or the torch ops of drafter.block_causal_conv (compiled with the layers when
        `compile`); auto: Triton on a GPU where the drafter's shape allows (resolve_conv_kernel)."""
        super().__init__(config, drafter, embed_weight, lm_head_weight, flex_fn=flex_fn)
        self.selector_alpha = float(selector_alpha)
        self.top_k = drafter.config.selector_top_k
        self.selector_loss, self.candidate_rows_grad = selector_loss, candidate_rows_grad
        if config.compile:  # one graph each (GPU), as the layers
            compiled = functools.partial(torch.compile, dynamic=False, fullgraph=True)
            self.selector_loss = compiled(selector_loss)
            self.candidate_rows_grad = compiled(candidate_rows_grad)
        self.conv_kernel = resolve_conv_kernel(
            conv_kernel, drafter.config, device=self.lm_head_weight.device
        )  # "triton" or "compiled"
        drafter.conv = None  # the reference; evaluation builds its own drafters, with it too
        if self.conv_kernel == "triton":
            from dflash_async.kernels.conv_kernel import triton_block_conv  # needs triton

            drafter.conv = triton_block_conv()  # registers its ops: here, not while compiling
        width = group_width(drafter.config.vocab_size, self.top_k)
        if width is not None:  # the CE pass also returns the top-k's group maxima
            self.ce_elementwise = self.ce_pass(
                reference=ce_grad_and_group_max,
                triton="ce_grad_and_group_max_triton",
                group_width=width,
            )

    def forward(self, batch: PackedBatch, anchors: Anchors) -> StepSums:
        tokens, positions, labels, weights = self._blocks(batch, anchors)
        hidden = self._hidden(batch, anchors, tokens, positions)  # [A, B, d]
        slots = hidden[:, 1:].flatten(0, 1)  # [N, d], N = A*(B-1)
        w = weights[:, 1:].flatten()  # [N]
        gold = labels[:, 1:].flatten()  # [N]
        with step_range("lm_head_ce"):
            ce_sum, correct_pred, unary, candidates = _UnaryCEAndTopK.apply(
                slots,
                self.lm_head_weight.detach(),
                gold,
                w,
                self.config.ce_chunk_size,
                self.ce_elementwise,
                self.top_k,
                self.logit_transform,
                self.candidate_rows_grad,
            )
        with step_range("lm_head_ce"):  # the selector: part of the head's range
            previous = selector_predecessors(labels).flatten()  # [N]
            selector_sum, selector_hit, has_gold = self.selector_loss(
                self.drafter.candidate_selector, slots, previous, candidates, unary, gold, w
            )
        trained = w > 0
        hit = (correct_pred & trained).view(-1, self.config.block_size - 1)  # [A, B-1]
        return StepSums(
            # alpha = 0: + 0.0 * a finite sum leaves the DFlash sum bit for bit, and the
            # selector's parameters still get (zero) gradients, as the step requires
            ce_sum=ce_sum + self.selector_alpha * selector_sum,
            weight_sum=w.sum(),
            correct=hit.sum(),
            supervised=trained.sum(),
            accepted=hit.long().cumprod(dim=1).sum(),
            blocks=anchors.valid.sum(),
            topk_hits=(trained & has_gold).sum(),
            selector_correct=(trained & has_gold & selector_hit).sum(),
        )
