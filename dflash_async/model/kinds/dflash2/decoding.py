"""DFlash2's drafts of one block pass: the candidate selector's walk over the unary top-k.

This module owns the walk (docs/DFLASH.md, DFlash2 decoding); eval/selector.py computes the
slots' unary logits and hands them here through the kind. The selector walks slots 1..B-1 left to
right from the anchor: for slot i the candidates are the unary top-k (k = selector_top_k), each
scored

    score(c) = unary(c) + <pred[prev] * hidden_projection(h_i), succ[c]>

with `prev` the token chosen for slot i-1 (the anchor for slot 1), and the draft is the argmax
(T = 0). At T > 0 (sampled_draft_tokens) the walk samples instead: the selector's softmax over
its candidates at temperature T (then top-k, top-p: eval/sampling.py's filter) is slot i's q, the
distribution its draft is drawn from and the target's rejection test divides by. At training
time `prev` is the gold token (teacher forcing); here it is the walk's own choice, since no gold
exists at decode time. The B-1 slots are a static Python loop of device ops: no host sync inside;
the drafts stay on the device until the target verifies them.
"""

from __future__ import annotations

import torch

from dflash_async.model.kinds.dflash2.drafter import CandidateSelector


def slot_candidates(unary: torch.Tensor, *, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, token ids) [b, k] of the strict top-k of one slot's unary logits [b, V]."""
    top = unary.topk(top_k, dim=-1)
    return top.values, top.indices


def predecessor(path: list[torch.Tensor]) -> torch.Tensor:
    """The predecessor [b] of the next slot: the latest token of the walk (anchor, choices...)."""
    return path[-1]


def selector_walk(
    selector: CandidateSelector,
    hidden: torch.Tensor,  # [b, n, d] the slots' norm(x), n = B-1
    unary: torch.Tensor,  # [b, n, V] the slots' unary logits
    anchors: torch.Tensor,  # [b] int64: the last committed token of each row
    *,
    top_k: int,
) -> torch.Tensor:
    """The greedy selector path [b, n]: slot by slot, the best scored unary top-k candidate."""
    path = [anchors.to(unary.device)]
    for i in range(hidden.shape[1]):  # n is static: B-1 slots
        scores, candidates = slot_scores(selector, hidden[:, i], unary[:, i], path, top_k=top_k)
        path.append(candidates.gather(1, scores.argmax(-1, keepdim=True))[:, 0])
    return torch.stack(path[1:], dim=1)


def slot_scores(
    selector: CandidateSelector,
    hidden: torch.Tensor,  # [b, d] one slot's norm(x)
    unary: torch.Tensor,  # [b, V] its unary logits
    path: list[torch.Tensor],
    *,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores fp32, token ids) [b, k] of one slot's candidates given the walk so far."""
    values, candidates = slot_candidates(unary, top_k=top_k)  # [b, k]
    pair = selector.pair_scores(
        hidden.to(selector.hidden_projection.weight.dtype),
        predecessor(path).to(hidden.device),
        candidates.to(hidden.device),
    )  # [b, k]
    return values.float() + pair.to(unary.device).float(), candidates


def sampled_selector_walk(
    selector: CandidateSelector,
    hidden: torch.Tensor,  # [b, n, d]
    unary: torch.Tensor,  # [b, n, V]
    anchors: torch.Tensor,  # [b]
    *,
    top_k: int,
    sampler,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(drafts [b, n], q [b, n, V]): the walk, each slot's token drawn from q = the filtered
    softmax of its candidates' scores (zero off the candidates); the next slot's predecessor is
    the drawn token. Device ops only. `sampler`: eval/sampling.py's Sampler (probs, draw)."""
    path, qs = [anchors.to(unary.device)], []
    for i in range(hidden.shape[1]):
        scores, candidates = slot_scores(selector, hidden[:, i], unary[:, i], path, top_k=top_k)
        full = unary.new_full(unary[:, i].shape, float("-inf"), dtype=torch.float32)
        qs.append(sampler.probs(full.scatter(1, candidates, scores)))  # [b, V]
        path.append(sampler.draw(qs[-1]))
    return torch.stack(path[1:], dim=1), torch.stack(qs, dim=1)


def draft_tokens(drafter, hidden: torch.Tensor, unary: torch.Tensor, anchors: torch.Tensor):
    """The drafts [b, n] of one block pass at T = 0: the selector's greedy walk."""
    top_k = drafter.config.selector_top_k
    return selector_walk(drafter.candidate_selector, hidden, unary, anchors, top_k=top_k)


def sampled_draft_tokens(drafter, hidden, unary, anchors, *, sampler):
    """(drafts [b, n], q [b, n, V]) of one block pass at T > 0: the selector's sampled walk."""
    top_k = drafter.config.selector_top_k
    selector = drafter.candidate_selector
    return sampled_selector_walk(selector, hidden, unary, anchors, top_k=top_k, sampler=sampler)
