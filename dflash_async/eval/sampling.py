"""Sampled speculative decoding (T > 0): the filtered distributions, the rejection rule, the draws.

Owns SamplingOptions (temperature, top-k, top-p, seed; `eval --temperature`'s parsing),
`filtered_probs` (the one filter both
the drafter's q and the target's p go through), the rejection rule as small pure functions
(`acceptance_ratio`, `residual_distribution`, `accept_or_resample`) and Sampler (one prompt's
seeded torch.Generator: its draws, the first token and a block's verdict). speculative.py and
selector.py (through the drafter kind's draws, model/kinds/) call it; batched.py stays greedy (T > 0 decodes with the reference decoder).

The rule (docs/DFLASH.md, acceptance at T > 0): draft d_i ~ q_i; the target's p_i verifies it:
accept with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection commit a token drawn
from norm(max(p_i - q_i, 0)) and stop; if every draft is accepted, commit a bonus token ~ p_B.
Each committed token is then distributed exactly as plain sampling from the (filtered) target.

Filter order, the same on both sides: logits / T, then top-k (k highest; 0 = off), then top-p
(the smallest prefix of the top-k-renormalised distribution, sorted high to low, whose mass is
>= P; 1 = off), then renormalise. T = 0 is greedy and never reaches this module.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dflash_async.usage import UsageError


@dataclass(frozen=True)
class SamplingOptions:
    """How a speculative decode samples; temperature 0 = greedy (the lossless path)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(f"need temperature >= 0, 0 < top_p <= 1, top_k >= 0: got {self}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sampled_or_none(options: SamplingOptions | None) -> SamplingOptions | None:
    """The options if they sample, None for greedy (decoders then run today's greedy code)."""
    return None if options is None or options.greedy else options


def temperatures(text: str) -> tuple[float, ...]:
    """The argparse type of `eval --temperature 0,0.7`: the temperatures, each >= 0."""
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected numbers such as 0,0.7") from None
    if any(value < 0 for value in values):
        raise argparse.ArgumentTypeError(f"{text!r}: temperatures must be >= 0")
    return values


def sampling_options(
    temperatures: Sequence[float], *, top_p: float, top_k: int, seed: int
) -> tuple[SamplingOptions, ...]:
    """One SamplingOptions per temperature; UsageError (exit 2) for a bad top_p / top_k."""
    try:
        return tuple(SamplingOptions(t, top_p=top_p, top_k=top_k, seed=seed) for t in temperatures)
    except ValueError as e:
        raise UsageError(f"--top-p / --top-k: {e}") from e


def filtered_probs(logits: torch.Tensor, options: SamplingOptions) -> torch.Tensor:
    """Probabilities [..., V] (fp32) of logits [..., V] after temperature, top-k, top-p."""
    scaled = logits.float() / options.temperature
    if 0 < options.top_k < scaled.shape[-1]:
        kth = scaled.topk(options.top_k, dim=-1).values[..., -1:]  # ties at the k-th stay in
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = scaled.softmax(-1)
    if options.top_p < 1:
        ordered, order = probs.sort(-1, descending=True)
        mass_before = ordered.cumsum(-1) - ordered  # the first token always stays (mass 0)
        drop = torch.zeros_like(probs, dtype=torch.bool).scatter(
            -1, order, mass_before >= options.top_p
        )
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def acceptance_ratio(p_draft: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
    """p(d) / q(d) per row: accept when u < it (u ~ U[0, 1), so min(1, .) is implicit). q(d) > 0
    for a draft sampled from q."""
    return p_draft / q_draft


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)) per row [n, V]. A row with p <= q everywhere (p == q) cannot reject;
    it falls back to p so that the draw below stays well defined."""
    residual = (p - q).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(p.dtype).tiny), p)


def accept_or_resample(
    p: torch.Tensor,  # [n, V] the target's filtered distribution at each draft's slot
    q: torch.Tensor,  # [n, V] the drafter's, each draft was sampled from
    drafts: torch.Tensor,  # [n] int64
    u: torch.Tensor,  # [n] uniform draws in [0, 1)
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted [n] bool, resampled [n] int64): row i accepts d_i iff u_i < p_i(d_i)/q_i(d_i);
    resampled_i ~ norm(max(p_i - q_i, 0)), the token committed if row i is the first rejection.
    Every row is resolved at once (device ops only: no host sync)."""
    index = drafts[:, None]
    accepted = u < acceptance_ratio(p.gather(-1, index)[:, 0], q.gather(-1, index)[:, 0])
    resampled = torch.multinomial(residual_distribution(p, q), 1, generator=generator)[:, 0]
    return accepted, resampled


@dataclass
class Sampler:
    """One prompt's sampled decoding: the options and its own seeded generator (on the device
    the draws are made on), so a prompt's output does not depend on the others'."""

    options: SamplingOptions
    generator: torch.Generator

    @classmethod
    def for_prompt(cls, options: SamplingOptions, index: int, device: torch.device) -> Sampler:
        generator = torch.Generator(device=device)
        generator.manual_seed(options.seed * 1_000_003 + index)  # distinct per (seed, prompt)
        return cls(options, generator)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return filtered_probs(logits, self.options)

    def draw(self, probs: torch.Tensor) -> torch.Tensor:
        """One token per row of probs [..., V] -> [...] (device op, no host sync)."""
        flat = probs.reshape(-1, probs.shape[-1])
        return torch.multinomial(flat, 1, generator=self.generator).reshape(probs.shape[:-1])

    def first_token(self, logits: torch.Tensor) -> int:
        """The token after the prompt, ~ p of logits [V]."""
        # Sync point: the first anchor is needed on the host (once per prompt).
        return int(self.draw(self.probs(logits)))

    def verdict(
        self, logits: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor
    ) -> tuple[int, list[int]]:
        """(accepted drafts, committed tokens) of a block: logits [B, V] (the target's after each
        block token, suppressed ids at -inf), drafts [B-1] sampled from q [B-1, V]."""
        p, n = self.probs(logits), drafts.shape[0]
        u = torch.rand(n, generator=self.generator, device=p.device)
        accepted, resampled = accept_or_resample(p[:n], q.to(p.device), drafts, u, self.generator)
        bonus = self.draw(p[n:])  # [1]
        # Sync point: the accept flags and candidate tokens come to the host, once per step.
        both = torch.cat([accepted.long(), drafts, resampled, bonus]).tolist()
        flags, draft_ids, resampled_ids = both[:n], both[n : 2 * n], both[2 * n : 3 * n]
        count = flags.index(0) if 0 in flags else n
        last = resampled_ids[count] if count < n else both[-1]
        return count, [*draft_ids[:count], last]
