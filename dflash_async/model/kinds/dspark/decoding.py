"""DSpark's drafts of one block pass: chain drafting through the Markov head, slot by slot.

eval/selector.py computes the slots' unary logits lm_head(h) (slots 0..B-1: anchor-first, every
slot drafts) and hands them here through the kind. Walking the slots from the anchor, slot i's
logits are unary_i + W2 @ u(h_i, prev) with `prev` the token chosen for slot i-1 (the anchor for
slot 0): the argmax at T = 0; at T > 0 the token is drawn from q = the filtered softmax of those
logits (eval/sampling.py), the distribution the target's rejection test divides by. A static
loop of device ops: no host sync inside.
"""

from __future__ import annotations

import torch


def chain_logits(drafter, hidden: torch.Tensor, unary: torch.Tensor, previous: torch.Tensor):
    """Slot logits [b, V] = unary [b, V] + the Markov bias of (h [b, d], previous [b])."""
    markov = drafter.markov_head
    if markov is None:
        return unary.float()
    h = hidden.to(markov.markov_w2.weight.dtype)
    bias = markov.bias(h, previous.to(h.device))
    return unary.float() + bias.to(unary.device).float()


def draft_tokens(drafter, hidden: torch.Tensor, unary: torch.Tensor, anchors: torch.Tensor):
    """The greedy chain [b, n]: each slot's argmax given the chain's previous token."""
    path = [anchors.to(unary.device)]
    for i in range(hidden.shape[1]):  # n = B: static
        path.append(chain_logits(drafter, hidden[:, i], unary[:, i], path[-1]).argmax(-1))
    return torch.stack(path[1:], dim=1)


def sampled_draft_tokens(drafter, hidden, unary, anchors, *, sampler):
    """(drafts [b, n], q [b, n, V]): the chain, each slot drawn from its filtered softmax."""
    path, qs = [anchors.to(unary.device)], []
    for i in range(hidden.shape[1]):
        qs.append(sampler.probs(chain_logits(drafter, hidden[:, i], unary[:, i], path[-1])))
        path.append(sampler.draw(qs[-1]))
    return torch.stack(path[1:], dim=1), torch.stack(qs, dim=1)


def confidence(drafter, hidden: torch.Tensor, drafts: torch.Tensor, anchors: torch.Tensor):
    """Predicted acceptance probabilities [b, n] of a chain's slots (None without the head):
    sigmoid of the confidence head on (h_i, the chain's token before slot i)."""
    if drafter.confidence_head is None:
        return None
    previous = torch.cat([anchors[:, None].to(drafts.device), drafts[:, :-1]], dim=1)
    dtype = drafter.confidence_head.proj.weight.dtype
    h = hidden.to(dtype).flatten(0, 1)
    logits = drafter.confidence_logits(h, previous.flatten().to(h.device))
    return torch.sigmoid(logits.float()).view(drafts.shape)
