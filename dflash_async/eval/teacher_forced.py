"""Teacher-forced acceptance on held-out sequences: the decoding walk, and the uniform-anchor mean.

A held-out sequence here is a prompt followed by the target's own greedy continuation (the
evaluation's greedy baseline). On it, greedy speculative decoding is fixed by the drafts at the
anchors it visits: the target's tokens ARE the sequence, and the drafter's context at anchor p is
the target's features of tokens < p, which one target forward of the whole sequence gives. So with
a(p) = the leading drafts of the block at anchor p that equal the sequence (one drafter pass over
every anchor at once, in the training layout: context strictly before the anchor), two numbers:

    tau_walk     the decoding walk: p = prompt length, record a(p) + 1, p += a(p) + 1, until the
                 sequence ends; the mean of the records. This is decoded tau (docs/DFLASH.md
                 s.8) without the target's verify passes: equal up to argmax ties and to the last
                 step, whose drafts run past the sequence (counted up to its end).
    tau_uniform  1 + the mean of a(p) over EVERY anchor p of the continuation: the definition of
                 the step lines' tau_hat (uniform random anchors, docs/DFLASH.md s.4), on data
                 the drafter never trained on.

They differ when acceptance clusters: decoded tau is tokens / steps, and an easy stretch (long
runs) is crossed in few steps while a hard one costs a step per token. Half a sequence at a(p) = 7
and half at 0 gives tau_uniform = 4.5 but tau_walk = 2 / (1/8 + 1) = 1.78. A self-distilled story
has exactly such stretches (formulaic repeats against new names and events), so tau_hat
overstates decoded tau even on sequences the drafter trained on; tau_walk predicts it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from dflash_async.eval.lossless import GreedyResult
from dflash_async.eval.selector import draft_tokens
from dflash_async.eval.speculative import captured_layers
from dflash_async.model.attention_rule import dense_rule_mask, sdpa_attend
from dflash_async.model.drafter import DFlashDrafter
from dflash_async.targets.loading import frozen_embeddings


@dataclass(frozen=True)
class TeacherForcedTau:
    """Means over sequences (each sequence's own mean first, as decoded tau is averaged)."""

    walk: float  # tau_walk: predicts decoded tau
    uniform: float  # tau_uniform: the step lines' tau_hat definition, held out
    sequences: int


@dataclass(frozen=True)
class AnchorBlocks:
    """One pass of anchor_blocks: the anchors [A] and the drafter's hidden states [A, B, d] of
    their blocks."""

    anchors: torch.Tensor
    hidden: torch.Tensor


@torch.no_grad()
def anchor_blocks(
    target: PreTrainedModel,
    drafter: DFlashDrafter,
    embed_weight: torch.Tensor,  # [V, d] the target's
    sequence: Sequence[int],
    first_anchor: int,
    *,
    anchors_per_pass: int = 64,
    target_logits: bool = False,
) -> tuple[torch.Tensor | None, Iterator[AnchorBlocks]]:
    """(the target's logits [L, V] of the sequence if `target_logits`, else None; the passes)
    over the blocks [x_p, MASK x (B-1)] at every anchor p in [first_anchor, len(sequence) - 1),
    `anchors_per_pass` at a time, each block seeing the target's features of x_{<p} only (the
    training layout, DFLASH.md s.2, and what decoding sees at p). One target forward."""
    cfg = drafter.config
    B, L = cfg.block_size, len(sequence)
    device = embed_weight.device
    ids = torch.as_tensor(list(sequence), dtype=torch.long, device=device)  # [L]
    keep = {} if target_logits else {"logits_to_keep": 1}
    with captured_layers(target, cfg.target_layer_ids) as outputs:
        logits = target(input_ids=ids[None], use_cache=False, **keep).logits[0]
        features = torch.cat([outputs[i][0] for i in cfg.target_layer_ids], dim=-1)  # [L, k*d]
    features = features.to(embed_weight.device)
    positions = torch.arange(L, device=device)
    doc_ids = torch.zeros(L, dtype=torch.long, device=device)  # one document
    slot = torch.arange(B, device=device)

    def passes() -> Iterator[AnchorBlocks]:
        for start in range(first_anchor, L - 1, anchors_per_pass):
            anchors = torch.arange(start, min(start + anchors_per_pass, L - 1), device=device)
            valid = torch.ones_like(anchors, dtype=torch.bool)
            attends = [
                sdpa_attend(dense_rule_mask(doc_ids, anchors, valid, B, rule=rule))
                for rule in cfg.attention_rules()
            ]
            tokens = torch.where(slot == 0, ids[anchors][:, None], cfg.mask_token_id)  # [A, B]
            block_positions = (anchors[:, None] + slot).flatten()  # [A*B]: anchor + k
            hidden = drafter(
                embed_weight[tokens.flatten()], block_positions, features, positions, attends
            )
            yield AnchorBlocks(anchors, hidden.view(anchors.shape[0], B, -1))

    return (logits if target_logits else None), passes()


@torch.no_grad()
def anchor_drafts(
    target: PreTrainedModel,
    drafter: DFlashDrafter,
    embed_weight: torch.Tensor,  # [V, d] the target's
    lm_head_weight: torch.Tensor,  # [V, d] the target's
    sequence: Sequence[int],
    first_anchor: int,
    *,
    anchors_per_pass: int = 64,
) -> torch.Tensor:
    """Drafts [n, drafts_per_block] of the blocks of anchor_blocks at every anchor p in
    [first_anchor, len(sequence) - 1): the drafter kind's drafts (the unary argmax, or
    DFlash2's selector walk), as decoding drafts them."""
    cfg = drafter.config
    ids = torch.as_tensor(list(sequence), dtype=torch.long, device=embed_weight.device)
    first = cfg.block_size - cfg.drafts_per_block  # the first slot that drafts (DSpark's: 0)
    drafts = [lm_head_weight.new_zeros(0, cfg.drafts_per_block, dtype=torch.long)]
    _, passes = anchor_blocks(
        target, drafter, embed_weight, sequence, first_anchor, anchors_per_pass=anchors_per_pass
    )
    for block in passes:
        hidden = block.hidden[:, first:]
        drafts.append(draft_tokens(drafter, hidden, lm_head_weight, ids[block.anchors]))
    return torch.cat(drafts)


def accepted_runs(drafts: torch.Tensor, sequence: Sequence[int], first_anchor: int) -> list[int]:
    """a(p): the leading drafts of the block at anchor p = first_anchor + i (drafts[i]) equal to
    x_{p+1..}; a draft past the sequence's end counts as a miss."""
    ids = torch.as_tensor(list(sequence), dtype=torch.long)
    n, width = drafts.shape
    rows = torch.arange(first_anchor, first_anchor + n)[:, None] + torch.arange(1, width + 1)
    gold = ids[rows.clamp(max=len(ids) - 1)]
    hit = (drafts.cpu() == gold) & (rows < len(ids))
    return hit.long().cumprod(dim=1).sum(dim=1).tolist()


def walk_steps(runs: Sequence[int]) -> list[int]:
    """The decoding walk over a(p) (runs[0] is the first anchor's): a + 1 per step, from the
    first anchor on, each step's next anchor a + 1 further; the decoder's accepted lengths."""
    p, steps = 0, []
    while p < len(runs):
        steps.append(runs[p] + 1)
        p += runs[p] + 1
    return steps


def walk_tau(runs: Sequence[int]) -> float:
    """tau_walk: the mean of walk_steps (decoded tau's definition, per sequence)."""
    steps = walk_steps(runs)
    return sum(steps) / max(len(steps), 1)


def uniform_tau(runs: Sequence[int]) -> float:
    """1 + the mean of a(p) over every anchor: tau_hat's uniform-anchor definition."""
    return 1.0 + sum(runs) / max(len(runs), 1)


def teacher_forced_tau(
    target: PreTrainedModel,
    drafter: DFlashDrafter,
    embed_weight: torch.Tensor,
    lm_head_weight: torch.Tensor,
    sequences: Sequence[tuple[Sequence[int], int]],  # (prompt + greedy continuation, prompt len)
) -> TeacherForcedTau:
    """tau_walk and tau_uniform over held-out sequences (see the module doc)."""
    walks, uniforms = [], []
    for sequence, prompt_len in sequences:
        drafts = anchor_drafts(target, drafter, embed_weight, lm_head_weight, sequence, prompt_len)
        runs = accepted_runs(drafts, sequence, prompt_len)
        if runs:
            walks.append(walk_tau(runs))
            uniforms.append(uniform_tau(runs))
    n = max(len(walks), 1)
    return TeacherForcedTau(walk=sum(walks) / n, uniform=sum(uniforms) / n, sequences=len(walks))


def heldout_estimate(
    target: PreTrainedModel,
    drafter: DFlashDrafter,
    prompts: Sequence[Sequence[int]],
    plain: Sequence[GreedyResult],
) -> dict[str, float]:
    """The evaluation's teacher-forced figures on its own prompts and their greedy baseline:
    `tau_teacher_forced` (tau_walk, which greedy decoded tau should equal) and `tau_hat_heldout`
    (tau_uniform: the step lines' tau_hat definition on these held-out sequences)."""
    embed, lm_head = frozen_embeddings(target)
    sequences = [
        (list(prompt) + list(result.tokens), len(prompt))
        for prompt, result in zip(prompts, plain, strict=True)
    ]
    tau = teacher_forced_tau(target, drafter, embed, lm_head, sequences)
    return {"tau_teacher_forced": round(tau.walk, 4), "tau_hat_heldout": round(tau.uniform, 4)}
