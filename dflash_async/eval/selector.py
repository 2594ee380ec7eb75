"""The drafts of one block pass: the slots' unary logits, then the drafter kind's drafts from them.

Both decoders (speculative.py, batched_decoding.py) run the drafter once per block and hand its
slot hidden states here. The unary logits are lm_head(h) with the drafter's logit transforms; the
drafts are the kind's (model/kinds/): a DFlash drafter drafts their argmax per slot, a DFlash2
drafter its candidate selector's walk over their top-k (docs/DFLASH.md, DFlash2 decoding). At
T > 0 (sampled_draft_tokens) each slot's draft is drawn from q, the distribution the kind makes
from the same logits (eval/sampling.py's filter), which the target's rejection test divides by.
Device ops only: no host sync; the drafts stay on the device until the target verifies them.
"""

from __future__ import annotations

import torch

from dflash_async.eval.sampling import Sampler
from dflash_async.model.kinds import kind_of
from dflash_async.model.logit_transforms import logit_transform_of


def unary_logits(
    drafter: torch.nn.Module,
    hidden: torch.Tensor,  # [b, n, d]
    lm_head_weight: torch.Tensor,  # [V, d]
) -> torch.Tensor:
    """The slots' unary logits [b, n, V] as trained: lm_head(h), then the drafter's logit
    transforms (output multiplier, softcap; logit_transforms.py). The selector adds its pair
    scores to these and a sampled draft's q is their softmax, so both need the transformed
    logits (only the argmax is unchanged by them)."""
    unary = hidden.to(lm_head_weight.device, lm_head_weight.dtype) @ lm_head_weight.T
    transform = logit_transform_of(drafter.config)
    return unary if transform.is_identity else transform(unary)


def draft_tokens(
    drafter: torch.nn.Module,
    hidden: torch.Tensor,  # [b, n, d] drafter slots 1..B-1 after the final norm
    lm_head_weight: torch.Tensor,  # [V, d] the target's
    anchors: torch.Tensor,  # [b]
) -> torch.Tensor:
    """The drafts [b, n] of one block pass, the drafter kind's: the unary argmax per slot
    (DFlash), or the selector's walk (DFlash2)."""
    unary = unary_logits(drafter, hidden, lm_head_weight)  # [b, n, V]
    return kind_of(drafter.config.kind).draft_tokens(drafter, hidden, unary, anchors)


def draft_confidence(
    drafter: torch.nn.Module,
    hidden: torch.Tensor,  # [b, n, d]
    drafts: torch.Tensor,  # [b, n]
    anchors: torch.Tensor,  # [b]
) -> torch.Tensor | None:
    """The predicted acceptance probability [b, n] of each draft (the kind's confidence head),
    None for a kind without one."""
    return kind_of(drafter.config.kind).draft_confidence(drafter, hidden, drafts, anchors)


def sampled_draft_tokens(
    drafter: torch.nn.Module,
    hidden: torch.Tensor,  # [b, n, d]
    lm_head_weight: torch.Tensor,  # [V, d]
    anchors: torch.Tensor,  # [b]
    *,
    sampler: Sampler,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(drafts [b, n], q [b, n, V]) of one block pass at T > 0, the drafter kind's: each slot
    drawn from the filtered unary distribution (DFlash), or along the selector's sampled walk
    (DFlash2)."""
    unary = unary_logits(drafter, hidden, lm_head_weight)  # [b, n, V]
    kind = kind_of(drafter.config.kind)
    return kind.sampled_draft_tokens(drafter, hidden, unary, anchors, sampler=sampler)
