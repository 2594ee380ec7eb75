"""What a decoder returns and the check that speculative output is plain greedy output.

Every committed token of speculative decoding is the target's own argmax given the committed
prefix, so the output equals plain greedy decoding up to floating point: a verify pass over B
tokens and a one-token step (or a batch of 64 rows and a batch of 1) run different kernels, and
where the target's top two logits are within rounding of each other the two runs may pick
different tokens. `check_lossless` raises LosslessError on a difference unless the first
difference is such a tie (one of greedy's next choices, its logit within tie_tolerance_for(dtype)
of greedy's token; the batched baseline keeps the next 3 choices, the reference one); the caller
counts ties (`numerical_ties`), since the rest of that sample legitimately differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

# Largest |logit(greedy) - logit(runner-up)| at which a divergence counts as a numerical tie.
_TIE_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4, torch.bfloat16: 0.5, torch.float16: 0.1}


class LosslessError(RuntimeError):
    """Speculative decoding produced a token that plain greedy decoding of the target did not."""


@dataclass(frozen=True)
class SpecResult:
    tokens: list[int]  # new tokens (prompt excluded), cut after eos / max_new_tokens
    accepted_lengths: list[int]  # accepted drafts + 1 per verify step, each in 1..B
    # per verify step, the predicted acceptance of each draft (a confidence head's); [] for none
    confidence: list[list[float]] = field(default_factory=list)

    @property
    def tau(self) -> float | None:
        """Mean committed tokens per verify step; None when no step ran (max_new_tokens=1)."""
        steps = len(self.accepted_lengths)
        return sum(self.accepted_lengths) / steps if steps else None


@dataclass(frozen=True)
class GreedyResult:
    tokens: list[int]  # new tokens, cut after eos / max_new_tokens
    runner_up: list[int]  # the target's second choice at each new token
    margins: list[float]  # logit(token) - logit(runner_up), >= 0
    alternatives: list[list[int]] | None = None  # its next choices (runner-up first), if kept
    gaps: list[list[float]] | None = None  # logit(token) - logit(each alternative), >= 0

    def tie_gap(self, position: int, token: int) -> float | None:
        """logit(greedy token) - logit(`token`) at `position` when `token` is one of the
        target's next choices there; None when it is not."""
        if self.alternatives is not None and self.gaps is not None:
            choices = dict(zip(self.alternatives[position], self.gaps[position], strict=True))
            return choices.get(token)
        return self.margins[position] if token == self.runner_up[position] else None


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where a and b differ (the shorter one's length if one is a prefix of the
    other); None if they are equal."""
    differ = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if differ is None and len(a) != len(b):
        return min(len(a), len(b))
    return differ


def cut_at_stop(tokens: list[int], max_new_tokens: int, eos: frozenset[int]) -> list[int]:
    """The generated tokens as plain greedy would return them: up to and including an eos."""
    tokens = tokens[:max_new_tokens]
    stop = next((i for i, t in enumerate(tokens) if t in eos), None)
    return tokens if stop is None else tokens[: stop + 1]


def eos_set(eos_token_id: int | Sequence[int] | None) -> frozenset[int]:
    """The stop tokens as a set: a generation config's eos_token_id may be None, an id or a list."""
    if eos_token_id is None:
        return frozenset()
    return frozenset([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)


def tie_tolerance_for(dtype: torch.dtype) -> float:
    """The numerical-tie margin for a target computing in `dtype` (0.5 for unknown dtypes)."""
    return _TIE_TOLERANCE.get(dtype, 0.5)


def check_lossless(
    index: int, greedy: GreedyResult, spec: SpecResult, tolerance: float
) -> int | None:
    """None if the outputs agree; the first differing position if it is a numerical tie; else
    LosslessError naming the sample and the position."""
    differ = first_difference(greedy.tokens, spec.tokens)
    if differ is None:
        return None
    if differ < min(len(greedy.tokens), len(spec.tokens)):
        gap = greedy.tie_gap(differ, spec.tokens[differ])
        if gap is not None and gap <= tolerance:
            return differ
        margin = f"greedy margin {greedy.margins[differ]:.3g}"
    else:
        margin = f"lengths {len(greedy.tokens)} vs {len(spec.tokens)}"
    raise LosslessError(
        f"sample {index}: speculative output differs from greedy at new token {differ} "
        f"({spec.tokens[differ : differ + 4]} vs {greedy.tokens[differ : differ + 4]}, {margin})"
    )
