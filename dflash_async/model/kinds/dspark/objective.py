"""The DSpark training objective: CE + L1 between the draft's and the target's next-token
distributions + the confidence head's BCE, on anchor-first blocks.

For a batch in the fixed layout (packing.PackedBatch) and A anchors, block j is DFlash's
`[x[a_j], MASK, ...]` at positions pos[a_j] + k, and (anchor-first) slot k = 0..B-1 predicts
y = x[a_j + k + 1]:
- draft logits z = lm_head(h) + W2 @ u (the Markov head, u from the GOLD previous token
  x[a_j + k]: teacher forcing; drafter.py);
- target distribution q = softmax(lm_head(final_norm(target layer L-1 at row a_j + k))), the
  target's own next-token distribution after the same prefix (the features' last d columns);
- p = softmax(z); L1 = ||p - q||_1 over the full vocabulary; a = clamp(1 - L1/2, 0, 1);
- c = the confidence head's logit; BCE(c, a) with a DETACHED (the head learns to predict the
  acceptance, it does not move the drafts towards its guess);
- w[j,k] = exp(-k / gamma) while slots 0..k are all supervised (block valid, label inside the
  document, loss_mask on): a contiguous prefix from the anchor, k = 0 included;
- loss = sum(w * (ce_alpha * CE(z, y) + l1_alpha * L1 + confidence_alpha * BCE)) / sum(w), the
  three terms over one normaliser, summed over the whole optimizer step like DFlash's
  (the returned StepSums' ce_sum holds the weighted sum of the three).

Neither [A*B, V] logits nor the [A*B, V] target distribution ever exist at once: both are made
chunk by chunk (ce_chunk_size label rows), and each chunk's gradients (w.r.t. h, the Markov
latent u, W2 and c) are made in the forward pass, as in chunked_ce.py, in closed form: per row
dL/dz = w (ce_alpha (p - onehot(y)) + l1_alpha p (s - <s, p>)) with s = sign(p - q), and
dL/dc = w confidence_alpha (sigmoid(c) - a); the vocabulary-wide part is one elementwise pass
over each chunk's draft and target logits (ce_l1_and_grad_from_logits, or kernels/ce_l1_kernel.py's
Triton kernel as ce_kernel chooses), the rest matmuls. Fixed-shape and sync-free: gathers,
selections and a static chunk loop.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from dflash_async.data.packing import PackedBatch
from dflash_async.model.objective import Anchors, DFlashObjective, ObjectiveConfig, StepSums
from dflash_async.model.step_ranges import step_range


def position_decay(block_size: int, gamma: float, *, device) -> torch.Tensor:
    """[B] weights exp(-k / gamma) of the anchor-first slots k = 0..B-1."""
    decay = [math.exp(-k / gamma) for k in range(block_size)]
    return torch.tensor(decay, dtype=torch.float64, device=device)


def slot_rows(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[A, B] rows a + k: the row whose token precedes slot k's label (the Markov head's gold
    previous token) and whose target state predicts it; the label is at row a + k + 1."""
    return anchors[:, None] + torch.arange(block_size, device=anchors.device)


def markov_previous(input_ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[A, B] previous tokens of the slots: x[a + k] (the anchor for k = 0, then the gold
    label of slot k - 1)."""
    return input_ids[rows]


def distribution_l1(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """[c] ||p - q||_1 over the vocabulary (= 2 x the total variation distance)."""
    return (p - q).abs().sum(-1)


def l1_logit_grad(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """[c, V] d ||p - q||_1 / dz for p = softmax(z) and q fixed: p * (s - <s, p>) with
    s = sign(p - q) (sign(0) = 0, the subgradient torch's abs takes at 0)."""
    s = torch.sign(p - q)
    return p * (s - (s * p).sum(-1, keepdim=True))


def ce_l1_and_grad_from_logits(
    z: torch.Tensor,  # [c, V] draft logits
    t: torch.Tensor,  # [c, V] target logits (no gradient)
    labels: torch.Tensor,  # [c]
    weights: torch.Tensor,  # [c]
    *,
    ce_alpha: float,
    l1_alpha: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chunk's elementwise pass in closed form: (w * CE [c], w * L1 [c] (in >= fp32, exactly
    0 on untrained rows), argmax(z) == label [c], the acceptance a = clamp(1 - L1/2, 0, 1) [c] of
    every row, and dz = d sum(w * (ce_alpha CE + l1_alpha L1)) / dz [c, V] in z's dtype):
    dz = w * (ce_alpha (p - onehot(label)) + l1_alpha p (s - <s, p>)), p = softmax(z),
    q = softmax(t), s = sign(p - q). Untrained rows (w == 0) are selected out, never multiplied
    by 0: a non-finite logit there must not leak in. Ties in the argmax go to the lowest index.

    What torch.compile fuses where the step compiles (ce_kernel 'compiled');
    kernels/ce_l1_kernel.py's ce_l1_and_grad_triton is the same contract in one Triton launch. p
    and q come from one formula, so that p == q exactly (s = 0) where z == t."""
    acc = torch.promote_types(z.dtype, torch.float32)  # fp64 stays fp64 (tests)
    x, y = z.to(acc), t.to(acc)
    lse = x.logsumexp(-1)
    p = (x - lse[:, None]).exp()
    q = (y - y.logsumexp(-1, keepdim=True)).exp()
    ce = lse - x.gather(1, labels[:, None]).squeeze(1)
    l1 = distribution_l1(p, q)
    accept = (1.0 - 0.5 * l1).clamp(0.0, 1.0)
    trained = weights > 0
    w = torch.where(trained, weights, 0.0).to(acc)
    onehot = torch.arange(x.shape[1], device=x.device)[None, :] == labels[:, None]
    grad = ce_alpha * (p - onehot.to(acc)) + l1_alpha * l1_logit_grad(p, q)
    grad = torch.where(trained[:, None], w[:, None] * grad, 0.0)
    hit = x.argmax(-1) == labels
    ce = torch.where(trained, w * ce, 0.0)
    l1 = torch.where(trained, w * l1, 0.0)
    return ce, l1, hit, accept, grad.to(z.dtype)


def confidence_terms(
    confidence: torch.Tensor,  # [c] acceptance logits
    accept: torch.Tensor,  # [c] the acceptance a of the chunk's rows
    weights: torch.Tensor,  # [c]
    alpha: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(w * BCE(c, a) [c], d alpha * sum(w * BCE) / dc [c] in c's dtype), a the target as a
    constant: the head learns to predict the acceptance, no gradient moves the drafts towards
    its guess (dz has no term through a). Untrained rows selected out, as above."""
    acc = torch.promote_types(confidence.dtype, accept.dtype)
    c, a = confidence.to(acc), accept.to(acc)
    trained = weights > 0
    w = torch.where(trained, weights, 0.0).to(acc)
    bce = F.binary_cross_entropy_with_logits(c, a, reduction="none")
    grad = torch.where(trained, w * alpha * (torch.sigmoid(c) - a), 0.0)
    return torch.where(trained, w * bce, 0.0), grad.to(confidence.dtype)


def chunk_terms_and_grads(
    rows: Callable,  # ce_l1_and_grad_from_logits or the Triton pass, its alphas bound
    z: torch.Tensor,  # [c, V] draft logits
    t: torch.Tensor,  # [c, V] target logits
    labels: torch.Tensor,  # [c]
    weights: torch.Tensor,  # [c]
    confidence: torch.Tensor | None,  # [c] acceptance logits
    confidence_alpha: float,
):
    """One chunk's (ce, l1, bce) weighted sums [3], argmax == label [c], the acceptance [c],
    dz [c, V] and dc [c] (None without a confidence head): the terms and their gradients."""
    ce, l1, hit, accept, dz = rows(z, t, labels, weights)
    bce, dc = torch.zeros_like(ce), None
    if confidence is not None:
        bce, dc = confidence_terms(confidence, accept, weights, confidence_alpha)
    return torch.stack([ce.sum(), l1.sum(), bce.sum()]), hit, accept, dz, dc


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The target's final RMSNorm (Qwen3's: fp32 normalise, scale)."""
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))  # fp64 stays fp64 (tests)
    return weight.to(x32.dtype) * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


class _DSparkChunkedLoss(torch.autograd.Function):
    """sum over rows of w * (CE + L1 + BCE) made chunk by chunk; gradients made in forward, in
    closed form (chunk_terms_and_grads): dh = dz W, du = dz W2, dW2 = sum over chunks of dz^T u
    (in >= fp32), dc from the confidence terms."""

    @staticmethod
    def forward(
        ctx,
        hidden,  # [N, d]
        latent,  # [N, r] or None: the Markov head's u
        markov_w2,  # [V, r] or None
        confidence,  # [N] or None
        lm_head_weight,  # [V, d] frozen
        target_state,  # [N, d] the target's final-normed state (no gradient)
        labels,  # [N]
        weights,  # [N]
        chunk_size: int,
        rows,
        alphas: tuple[float, float, float],  # ce, l1, confidence (rows has the first two)
    ):
        ce_alpha, l1_alpha, confidence_alpha = alphas
        weight = lm_head_weight.to(hidden.dtype)
        w2 = markov_w2.to(latent.dtype) if latent is not None else None
        inputs = (hidden, latent, markov_w2, confidence)
        needs = [t is not None and t.requires_grad for t in inputs]
        grads = [[] for _ in inputs]
        w2_grad = None
        sums, hits, accepts = [], [], []
        for start in range(0, hidden.shape[0], chunk_size):
            end = start + chunk_size
            target_logits = target_state[start:end].to(weight.dtype) @ weight.T
            z = hidden[start:end] @ weight.T
            u = None
            if latent is not None:
                u = latent[start:end]
                z = torch.addmm(z, u, w2.T)  # the Markov bias added in the matmul
            c = confidence[start:end] if confidence is not None else None
            chunk_sums, hit, accept, dz, dc = chunk_terms_and_grads(
                rows, z, target_logits, labels[start:end], weights[start:end], c, confidence_alpha
            )
            del z, target_logits
            if needs[0]:
                grads[0].append((dz @ weight).to(hidden.dtype))
            if needs[1]:
                grads[1].append((dz @ w2).to(latent.dtype))
            if needs[2]:  # W2's gradient: a sum over every chunk, in >= fp32
                g = dz.T @ u
                g = g.to(torch.promote_types(markov_w2.dtype, torch.float32))
                w2_grad = g if w2_grad is None else w2_grad + g
            if needs[3]:
                grads[3].append(dc)
            sums.append(chunk_sums)
            hits.append(hit)
            accepts.append(accept)
        saved = [torch.cat(g) if g else None for g in grads]
        saved[2] = w2_grad
        ctx.has = [g is not None for g in saved]
        ctx.save_for_backward(*[g for g in saved if g is not None])
        hit, accept = torch.cat(hits), torch.cat(accepts)
        stats = torch.stack(sums).sum(0)  # [3]: the weighted ce, l1 and bce sums
        total = ce_alpha * stats[0] + l1_alpha * stats[1] + confidence_alpha * stats[2]
        ctx.mark_non_differentiable(hit, accept, stats)
        return total, hit, accept, stats

    @staticmethod
    def backward(ctx, grad_total, _hit, _accept, _stats):
        saved = iter(ctx.saved_tensors)
        out = [next(saved) if has else None for has in ctx.has]
        scaled = [None if g is None else g * grad_total.to(g.dtype) for g in out]
        return (*scaled, None, None, None, None, None, None, None)


class DSparkObjective(DFlashObjective):
    """DSpark's loss on a DSpark drafter (see the module doc); returns StepSums whose ce_sum is
    the weighted sum of the three terms."""

    def __init__(
        self,
        config: ObjectiveConfig,
        drafter,
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor,
        *,
        target_norm: torch.Tensor,  # [d] the target's final norm weight (frozen)
        alphas: tuple[float, float, float] = (0.1, 0.9, 1.0),
        flex_fn=None,
    ) -> None:
        super().__init__(config, drafter, embed_weight, lm_head_weight, flex_fn=flex_fn)
        self.target_norm = target_norm.detach()
        self.alphas = tuple(float(a) for a in alphas)
        self.decay = position_decay(
            config.block_size, config.gamma, device=self.lm_head_weight.device
        )
        # the chunk pass as the ce_kernel setting chose it: kernels/ce_l1_kernel.py's Triton
        # kernel on a GPU (`auto` or `triton`: equal to the closed form in its GPU test and, at
        # SpecForge's geometry, 104.8 against 108.8 ms a step, 20.1 against 32.2 GiB peak,
        # BENCHMARKS.md), else the closed form (compiled where the step is); the
        # drafter_kernels_chosen line logs which
        self.rows = self.ce_pass(
            reference=ce_l1_and_grad_from_logits,
            triton="ce_l1_and_grad_triton",
            kernel_module="ce_l1_kernel",
            ce_alpha=self.alphas[0],
            l1_alpha=self.alphas[1],
        )

    def _dspark_blocks(self, batch: PackedBatch, anchors: Anchors):
        """Block tokens, positions, labels, weights, previous tokens and target rows, [A, B]."""
        B, T = self.config.block_size, batch.num_tokens
        a, valid = anchors.positions, anchors.valid
        rows = slot_rows(a, B).clamp(max=T - 1)
        label_rows = slot_rows(a, B) + 1
        inside = label_rows < T
        label_rows = label_rows.clamp(max=T - 1)
        same_doc = inside & (batch.doc_ids[label_rows] == batch.doc_ids[a][:, None])
        supervised = valid[:, None] & same_doc & batch.loss_mask[label_rows]
        prefix = supervised.long().cumprod(dim=1).bool()  # contiguous from the anchor
        weights = prefix * self.decay
        slot = torch.arange(B, device=a.device)
        tokens = torch.where(slot == 0, batch.input_ids[a][:, None], self.config.mask_token_id)
        positions = batch.position_ids[a][:, None] + slot
        previous = markov_previous(batch.input_ids, rows)
        return tokens, positions, batch.input_ids[label_rows], weights, previous, rows

    def target_states(self, batch: PackedBatch, rows: torch.Tensor) -> torch.Tensor:
        """[N, d] final-normed target states at `rows` (the features' last d columns)."""
        cfg = self.drafter.config
        d = cfg.hidden_size
        last = batch.features[rows.flatten(), cfg.num_features * d : (cfg.num_features + 1) * d]
        return rms_norm(last, self.target_norm, cfg.rms_norm_eps).to(last.dtype)

    def forward(self, batch: PackedBatch, anchors: Anchors) -> StepSums:
        tokens, positions, labels, weights, previous, rows = self._dspark_blocks(batch, anchors)
        hidden = self._hidden(batch, anchors, tokens, positions)  # [A, B, d]
        h = hidden.flatten(0, 1)  # [N, d], N = A*B
        w = weights.flatten()
        prev = previous.flatten()
        markov = self.drafter.markov_head
        with step_range("lm_head_ce"):
            latent = markov.latent(h, prev) if markov is not None else None
            confidence = self.drafter.confidence_logits(h, prev)
            with torch.no_grad():
                target = self.target_states(batch, rows)
            total, correct_pred, _accept, _stats = _DSparkChunkedLoss.apply(
                h,
                latent,
                markov.markov_w2.weight if markov is not None else None,
                confidence,
                self.lm_head_weight.detach(),
                target,
                labels.flatten(),
                w,
                self.config.ce_chunk_size,
                self.rows,
                self.alphas,
            )
        trained = w > 0
        hit = (correct_pred & trained).view(-1, self.config.block_size)  # [A, B]
        none = torch.zeros((), dtype=torch.long, device=w.device)  # no selector in DSpark
        return StepSums(
            ce_sum=total,
            weight_sum=w.sum(),
            correct=hit.sum(),
            supervised=trained.sum(),
            accepted=hit.long().cumprod(dim=1).sum(),
            blocks=anchors.valid.sum(),
            topk_hits=none,
            selector_correct=none,
        )

    @torch.no_grad()
    def block_logits(self, batch: PackedBatch, anchors: Anchors) -> torch.Tensor:
        """Full draft logits [A, B, V] with the gold previous tokens (tests, small shapes)."""
        tokens, positions, _, _, previous, _ = self._dspark_blocks(batch, anchors)
        hidden = self._hidden(batch, anchors, tokens, positions)
        h = hidden.flatten(0, 1)
        logits = self.drafter.draft_logits(h, previous.flatten(), self.lm_head_weight)
        return logits.view(*tokens.shape, -1)
