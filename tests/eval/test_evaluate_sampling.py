"""Sampled speculative decoding (T > 0, eval/sampling.py): the rejection rule, its distribution, T = 0.

(1) On hand-computed cases (vocab 4, given p, q and uniform draws) the accept/reject decisions
and the residual distribution are the formula's, step by step; three mutants of the rule (accept
when u < q/p; residual not clamped at 0; residual not renormalised) each break them. (2) Over
200k draws the output of the rule (draft ~ q, accept or resample) and over 3k block verdicts the
first committed token are distributed as p: a chi-square test at a false-alarm rate of 1e-3;
the inverted-ratio mutant fails it. (3) T = 0 through the sampling options is today's greedy
decode bit for bit; T > 0 decodes are reproducible per seed.
"""

from __future__ import annotations

import pytest
import torch
from test_evaluate import drafter_for, prompts
from tiny_decoding import CharTokenizer, tiny_qwen3_target

from dflash_async.eval import sampling
from dflash_async.eval.harness import evaluate
from dflash_async.eval.sampling import (
    Sampler,
    SamplingOptions,
    accept_or_resample,
    filtered_probs,
)
from dflash_async.eval.speculative import greedy_generate, speculative_generate
from dflash_async.targets.loading import frozen_embeddings

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

P = torch.tensor([0.1, 0.2, 0.3, 0.4])
Q = torch.tensor([0.4, 0.3, 0.2, 0.1])
# (draft, u, accepted?) by the formula u < p(d)/q(d): ratios 4, 0.25, 2/3, 2/3
STEPS = [(3, 0.9, True), (0, 0.3, False), (1, 0.6, True), (1, 0.7, False)]
RESIDUAL = torch.tensor([0.0, 0.0, 0.25, 0.75])  # norm(max(P - Q, 0)) = [0, 0, .1, .3] / .4
# A case whose residual is one token: max(P1 - Q1, 0) = [0, .4, 0, 0] -> always token 1.
P1, Q1 = torch.tensor([0.5, 0.5, 0.0, 0.0]), torch.tensor([0.7, 0.1, 0.1, 0.1])

# chi-square quantile at 1 - 1e-3 for 3 degrees of freedom (4 categories): 16.266 (NIST/SEMATECH
# e-Handbook of Statistical Methods, table 1.3.6.7.4; scipy.stats.chi2.ppf(0.999, 3) = 16.2662).
ALPHA, CHI2_999_DF3 = 1e-3, 16.266


def chi2_threshold(df: int) -> float:
    try:
        from scipy.stats import chi2
    except ImportError:
        assert df == 3, "the hard-coded quantile is for 3 degrees of freedom"
        return CHI2_999_DF3
    return float(chi2.ppf(1 - ALPHA, df))


def check_hand_case() -> None:
    """The rule's decisions and residuals on the hand-computed cases, step by step."""
    gen = torch.Generator().manual_seed(0)
    for draft, u, expected in STEPS:
        accepted, resampled = accept_or_resample(
            P[None], Q[None], torch.tensor([draft]), torch.tensor([u]), gen
        )
        assert bool(accepted) is expected, (draft, u)
        assert int(resampled) in (2, 3)  # only where p > q
    torch.testing.assert_close(sampling.residual_distribution(P[None], Q[None])[0], RESIDUAL)
    torch.testing.assert_close(
        sampling.residual_distribution(P1[None], Q1[None])[0], torch.eye(4)[1]
    )
    rows = 8  # P1 vs Q1, draft 0: ratio 5/7; u = .8 rejects, and the residual is token 1
    accepted, resampled = accept_or_resample(
        P1.expand(rows, 4),
        Q1.expand(rows, 4),
        torch.zeros(rows, dtype=torch.long),
        torch.full((rows,), 0.8),
        gen,
    )
    assert not accepted.any() and resampled.tolist() == [1] * rows


def test_accept_or_resample_decides_and_resamples_by_the_formula_on_a_hand_computed_case():
    check_hand_case()


def _inverted_ratio(p_draft, q_draft):
    return q_draft / p_draft


def _unclamped_residual(p, q):
    residual = p - q
    return residual / residual.sum(-1, keepdim=True)


def _unnormalised_residual(p, q):
    return (p - q).clamp_min(0.0)


MUTANTS = {
    "acceptance_ratio": _inverted_ratio,
    "residual_unclamped": _unclamped_residual,
    "residual_unnormalised": _unnormalised_residual,
}


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_each_rejection_rule_mutant_breaks_the_hand_computed_case(mutant, monkeypatch):
    name = "acceptance_ratio" if mutant == "acceptance_ratio" else "residual_distribution"
    monkeypatch.setattr(sampling, name, MUTANTS[mutant])
    with pytest.raises((AssertionError, RuntimeError)):
        check_hand_case()


def chi_square(tokens: torch.Tensor, p: torch.Tensor) -> float:
    observed = torch.bincount(tokens, minlength=p.numel()).double()
    expected = p.double() * tokens.numel()
    return float(((observed - expected) ** 2 / expected).sum())


def rule_output(n: int, seed: int) -> torch.Tensor:
    """n tokens of one speculative slot: d ~ Q, accept by the rule, else the residual draw."""
    gen = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(Q, n, replacement=True, generator=gen)
    u = torch.rand(n, generator=gen)
    accepted, resampled = accept_or_resample(P.expand(n, 4), Q.expand(n, 4), drafts, u, gen)
    return torch.where(accepted, drafts, resampled)


def verdict_first_tokens(n: int, seed: int) -> torch.Tensor:
    """The first committed token of n block verdicts (2 drafts ~ Q, target p = P at every slot)."""
    sampler = Sampler.for_prompt(
        SamplingOptions(temperature=1.0, seed=seed), 0, torch.device("cpu")
    )
    logits, q = P.log().expand(3, 4), Q.expand(2, 4)
    firsts = []
    for _ in range(n):
        drafts = sampler.draw(q)
        firsts.append(sampler.verdict(logits, drafts, q)[1][0])
    return torch.tensor(firsts)


def test_speculative_sampling_is_distributed_as_plain_sampling_from_p_by_chi_square():
    threshold = chi2_threshold(df=3)  # false alarm rate ALPHA = 1e-3 per statistic
    assert chi_square(rule_output(200_000, seed=1), P) < threshold
    assert chi_square(verdict_first_tokens(3_000, seed=2), P) < threshold


def test_the_inverted_acceptance_ratio_fails_the_chi_square_test(monkeypatch):
    monkeypatch.setattr(sampling, "acceptance_ratio", _inverted_ratio)
    assert chi_square(rule_output(200_000, seed=1), P) > chi2_threshold(df=3)


def test_filter_order_is_temperature_then_top_k_then_top_p():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0]).log()  # p = [.4, .3, .2, .1, 0]
    torch.testing.assert_close(
        filtered_probs(logits, SamplingOptions(1.0)), torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0])
    )
    # T = 0.5 squares the odds: [16, 9, 4, 1]/30; top-k 3 keeps [16, 9, 4]/29; top-p .8 keeps the
    # prefix whose mass reaches .8: 16/29 = .55, then 25/29 = .86 -> [16, 9]/25.
    options = SamplingOptions(0.5, top_p=0.8, top_k=3)
    torch.testing.assert_close(
        filtered_probs(logits, options), torch.tensor([16 / 25, 9 / 25, 0.0, 0.0, 0.0])
    )


@pytest.fixture(scope="module")
def target():
    return tiny_qwen3_target()


def decode(target, drafter, config, prompt, sampler):
    embed, lm_head = frozen_embeddings(target)
    return speculative_generate(
        target,
        drafter,
        config,
        embed,
        lm_head,
        prompt,
        max_new_tokens=24,
        eos_token_id=None,
        sampler=sampler,
    )


def test_temperature_zero_through_the_sampling_options_is_todays_greedy_bit_for_bit(target):
    drafter, config = drafter_for(target, 4)
    records = [{"prompt": "abcab"}, {"prompt": "hello there"}]
    kwargs = dict(max_new_tokens=16, batch_size=2, warmup=False)
    today = evaluate(target, CharTokenizer(), drafter, config, records, **kwargs)
    greedy = evaluate(
        target,
        CharTokenizer(),
        drafter,
        config,
        records,
        **kwargs,
        sampling=(SamplingOptions(0.0, top_p=0.5, top_k=2),),
    )
    assert [s["tokens"] for s in greedy["samples"]] == [s["tokens"] for s in today["samples"]]
    assert greedy["tau"] == today["tau"] and greedy["lossless_checked"]
    prompt = prompts()[1]
    plain = greedy_generate(target, prompt, 24, None).tokens
    assert decode(target, drafter, config, prompt, None).tokens == plain


def test_sampled_decoding_is_reproducible_per_seed_and_reported_per_temperature(target):
    drafter, config = drafter_for(target, 4)
    prompt, cpu = prompts()[1], torch.device("cpu")
    options = SamplingOptions(1.0, top_k=8)
    runs = [
        decode(target, drafter, config, prompt, Sampler.for_prompt(options, i, cpu))
        for i in (0, 0, 1)
    ]
    assert runs[0] == runs[1] and runs[0].tokens != runs[2].tokens
    assert all(1 <= a <= config.block_size for a in runs[0].accepted_lengths)
    records = [{"prompt": "abcab"}, {"prompt": "hello there"}]
    report = evaluate(
        target,
        CharTokenizer(),
        drafter,
        config,
        records,
        max_new_tokens=12,
        batch_size=2,
        warmup=False,
        sampling=(SamplingOptions(0.0), SamplingOptions(0.7, top_p=0.9)),
    )
    by_t = report["by_temperature"]
    assert [r["temperature"] for r in by_t] == [0.0, 0.7] and by_t[1]["decoder"] == "reference"
    assert not by_t[1]["lossless_checked"] and all(r["tau"] >= 1 for r in by_t)
