"""One evaluation as device jobs: baseline (cached), speculative decoding, lossless check, report.

Shared by `python -m dflash_async eval` (harness.py drives the jobs in a plain loop) and the
in-run evaluation (stages/evaluate.py drives them on the target's device worker, where
they interleave with the target's training work). A job is a short call: build one batch's
decoder, run one prefill chunk or verify step (`advance`), or collect the batch's results. Dense
targets decode `batch_size` prompts per batch (batched.py); targets the batched decoder cannot
serve (hybrids: see batched_unsupported_reason) decode one prompt per job with the reference
decoder (speculative.py), whose hybrid state rollback keeps them exact.

Every greedy speculative output is checked against the greedy one (lossless.py); the report is
tau, the accepted-length histogram, the per-position acceptance rate, tokens/s of both decoders and
the speedup, plus the settings it ran with (max_new_tokens, batch_size, temperature, top_p, top_k).
At T > 0 (setup.sampling) the speculative decode samples (sampling.py) with the reference decoder,
one seeded generator per prompt; its output is distributed as plain sampling, not equal to the
greedy one, so it is not checked against the baseline (the baseline still gives tokens/s).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers import PreTrainedModel

from dflash_async.eval.batched_decoding import (
    BatchedDecode,
    RowsBlockDrafter,
    batched_unsupported_reason,
    cache_capacity,
)
from dflash_async.eval.lossless import GreedyResult, SpecResult, check_lossless
from dflash_async.eval.recompute import decodes_by_recompute
from dflash_async.eval.sampling import Sampler, SamplingOptions
from dflash_async.eval.speculative import greedy_generate, speculative_generate
from dflash_async.log import get_logger
from dflash_async.model.drafter import DFlashDrafter
from dflash_async.model.drafter_config import DrafterConfig
from dflash_async.targets.loading import frozen_embeddings

# Layer kinds a decoder here can verify exactly: attention (KV cropped or masked per row),
# Gated DeltaNet linear attention, LFM2's short convolutions and Nemotron-H's Mamba-2 mixers
# (state rolled back, hybrid_state.py), and Nemotron-H's MLP and MoE blocks (row-wise: no cache).
_LAYER_TYPES = {"full_attention", "sliding_attention", "linear_attention", "conv", "mlp", "moe"}


def evaluation_unsupported_reason(target: PreTrainedModel) -> str | None:
    """Why speculative decoding cannot verify `target` exactly; None when it can."""
    if decodes_by_recompute(target):  # any causal architecture (eval/recompute.py)
        return None
    config = getattr(target.config, "text_config", None) or target.config
    unknown = set(getattr(config, "layer_types", None) or ()) - _LAYER_TYPES
    return f"layer types {sorted(unknown)} have no exact verification" if unknown else None


class Decoder(Protocol):
    def advance(self) -> bool: ...

    def results(self) -> list[Any]: ...


@dataclass
class DecodeSetup:
    """What every decode job of one evaluation needs (all on the target's device)."""

    target: PreTrainedModel
    prompts: list[list[int]]
    max_new_tokens: int
    eos: frozenset[int]
    suppress: tuple[int, ...]
    batch_size: int
    sampling: SamplingOptions | None = None  # None: greedy; else T > 0 (sampled_or_none)
    # image prompts: each prompt's vision inputs on the target's device (an empty mapping for
    # a text prompt), decoded one at a time by recomputation (eval/recompute.py); None: text
    vision: Sequence[Mapping[str, torch.Tensor]] | None = None

    @property
    def batched(self) -> bool:
        return self.vision is None and batched_unsupported_reason(self.target) is None

    def vision_of(self, index: int) -> Mapping[str, torch.Tensor] | None:
        """Prompt `index`'s vision inputs (None for text prompts)."""
        return self.vision[index] if self.vision is not None else None

    @property
    def device(self) -> torch.device:
        return frozen_embeddings(self.target)[0].device


class _OnePrompt:
    """The reference decoder as a Decoder: one prompt, decoded whole in one advance()."""

    def __init__(self, decode: Callable[[], Any]) -> None:
        self._decode = decode
        self._result: Any = None

    def advance(self) -> bool:
        self._result = self._decode()
        return True

    def results(self) -> list[Any]:
        return [self._result]


def _batches(setup: DecodeSetup) -> list[tuple[int, list[list[int]]]]:
    """(index of the first prompt, the prompts) of each batch."""
    size = setup.batch_size if setup.batched else 1
    return [(i, setup.prompts[i : i + size]) for i in range(0, len(setup.prompts), size)]


def greedy_decoders(setup: DecodeSetup) -> list[Callable[[], Decoder]]:
    """Factories (call them on the target's device thread) of the baseline's decoders."""
    s = setup

    def make(first: int, batch: list[list[int]]) -> Decoder:
        if s.batched:
            return BatchedDecode(
                s.target,
                batch,
                draft=None,
                layer_ids=(),
                max_new_tokens=s.max_new_tokens,
                eos=s.eos,
                suppress=s.suppress,
            )
        return _OnePrompt(
            lambda: greedy_generate(
                s.target,
                batch[0],
                s.max_new_tokens,
                s.eos,
                suppress_token_ids=s.suppress,
                vision=s.vision_of(first),
            )
        )

    return [lambda first=first, batch=batch: make(first, batch) for first, batch in _batches(s)]


def speculative_decoders(
    setup: DecodeSetup, drafter: DFlashDrafter, config: DrafterConfig
) -> list[Callable[[], Decoder]]:
    """Factories of the speculative decoders of `drafter` (on the target's device)."""
    s = setup
    if s.sampling is not None:
        return _sampled_decoders(s, drafter, config)
    embed, lm_head = frozen_embeddings(s.target)

    def make(first: int, batch: list[list[int]]) -> Decoder:
        if s.batched:
            capacity = cache_capacity(batch, s.max_new_tokens, config.drafts_per_block + 1)
            rows = RowsBlockDrafter(
                drafter, config, embed, lm_head, batch=len(batch), capacity=capacity
            )
            return BatchedDecode(
                s.target,
                batch,
                draft=rows,
                layer_ids=config.target_layer_ids,
                max_new_tokens=s.max_new_tokens,
                eos=s.eos,
                suppress=s.suppress,
            )
        return _OnePrompt(
            lambda: speculative_generate(
                s.target,
                drafter,
                config,
                embed,
                lm_head,
                batch[0],
                max_new_tokens=s.max_new_tokens,
                eos_token_id=s.eos,
                suppress_token_ids=s.suppress,
                vision=s.vision_of(first),
            )
        )

    return [lambda first=first, batch=batch: make(first, batch) for first, batch in _batches(s)]


def _sampled_decoders(
    setup: DecodeSetup, drafter: DFlashDrafter, config: DrafterConfig
) -> list[Callable[[], Decoder]]:
    """One reference decoder per prompt at T > 0, prompt i sampling with its own generator."""
    s, options = setup, setup.sampling
    assert options is not None
    if s.batched:  # the batched decoder is greedy only: T > 0 falls back to the reference
        get_logger(__name__).info(
            "eval_sampled_reference",
            temperature=options.temperature,
            reason="the batched decoder is greedy only; T > 0 decodes one prompt at a time",
        )
    embed, lm_head = frozen_embeddings(s.target)

    def make(index: int, prompt: list[int]) -> Decoder:
        sampler = Sampler.for_prompt(options, index, s.device)
        return _OnePrompt(
            lambda: speculative_generate(
                s.target,
                drafter,
                config,
                embed,
                lm_head,
                prompt,
                max_new_tokens=s.max_new_tokens,
                eos_token_id=s.eos,
                suppress_token_ids=s.suppress,
                sampler=sampler,
                vision=s.vision_of(index),
            )
        )

    return [lambda i=i, p=p: make(i, p) for i, p in enumerate(s.prompts)]


def timed_job(fn: Callable[[], Any], device: torch.device, seconds: list[float]) -> Any:
    """Run fn, add its duration (queued GPU work included) to seconds[0]."""
    start = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        # Sync point: the job's time includes its GPU work (this thread's stream only: a
        # drafter sharing the GPU runs on its own stream and is not waited for).
        torch.cuda.current_stream(device).synchronize()
    seconds[0] += time.perf_counter() - start
    return result


def advance_for(decoder: Decoder, seconds: float) -> bool:
    """Advance until done or until `seconds` have passed (each advance ends with a sync)."""
    end = time.perf_counter() + seconds
    while not (done := decoder.advance()) and time.perf_counter() < end:
        pass
    return done


def run_decoders(factories: Iterable[Callable[[], Decoder]], device: torch.device):
    """Drive decoders in this thread; returns (results in prompt order, device seconds)."""
    seconds, results = [0.0], []
    for make in factories:
        decoder = timed_job(make, device, seconds)
        while not timed_job(decoder.advance, device, seconds):
            pass
        results += decoder.results()
    return results, seconds[0]


def sample_report(
    index: int,
    prompt: list[int],
    plain: GreedyResult,
    spec: SpecResult,
    tie_tolerance: float,
    *,
    check: bool = True,
) -> dict[str, Any]:
    """One prompt's JSON-ready result; with `check` (greedy), LosslessError if spec is not plain
    (ties aside). A drafter with a confidence head adds its calibration sums
    (confidence_sums)."""
    report = {
        "index": index,
        "prompt_tokens": len(prompt),
        "new_tokens": len(spec.tokens),
        "plain_new_tokens": len(plain.tokens),  # differs only after a numerical tie
        "steps": len(spec.accepted_lengths),
        "tau": spec.tau,
        "accepted_lengths": spec.accepted_lengths,
        "numerical_tie_at": check_lossless(index, plain, spec, tie_tolerance) if check else None,
        "tokens": spec.tokens,
    }
    if spec.confidence:
        report["confidence_sums"] = confidence_sums(spec.confidence, spec.accepted_lengths)
    return report


def confidence_sums(confidence: list[list[float]], accepted_lengths: list[int]) -> list[list]:
    """Per draft slot k: [steps that reached it (drafts before it all accepted), the sum of
    its predicted acceptance over those steps, how many of them accepted it]."""
    slots = len(confidence[0])
    sums = [[0, 0.0, 0] for _ in range(slots)]
    for predicted, length in zip(confidence, accepted_lengths, strict=True):
        accepted = length - 1
        for k in range(min(accepted + 1, slots)):  # slot k reached: drafts 0..k-1 accepted
            sums[k][0] += 1
            sums[k][1] += predicted[k]
            sums[k][2] += int(accepted > k)
    return sums


def confidence_by_slot(samples: Sequence[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The confidence head's calibration per draft slot over every sample: its mean predicted
    acceptance and the measured acceptance rate over the steps that reached the slot (None
    without a confidence head)."""
    every = [s["confidence_sums"] for s in samples if s.get("confidence_sums")]
    if not every:
        return None
    rows = []
    for k, per_sample in enumerate(zip(*every, strict=True)):
        steps = sum(p[0] for p in per_sample)
        predicted = sum(p[1] for p in per_sample)
        accepted = sum(p[2] for p in per_sample)
        rows.append(
            {
                "slot": k + 1,
                "steps": steps,
                "predicted": predicted / steps if steps else None,
                "measured": accepted / steps if steps else None,
            }
        )
    return rows


def summarize(
    samples: Sequence[dict[str, Any]], block_size: int, *, plain_s: float, speculative_s: float
) -> dict[str, Any]:
    """tau (mean accepted+1 per step, averaged over samples), the histogram of accepted+1 (every
    length 1..B present), acceptance_by_position[k-1] = share of steps whose draft k was
    accepted (k = 1..B-1), and tokens/s of plain and speculative decoding."""
    taus = [s["tau"] for s in samples if s["tau"] is not None]
    histogram = dict.fromkeys(range(1, block_size + 1), 0)
    for sample in samples:
        for length in sample["accepted_lengths"]:
            histogram[length] += 1
    steps = sum(histogram.values())
    by_position = [
        sum(n for length, n in histogram.items() if length > k) / steps if steps else None
        for k in range(1, block_size)
    ]
    new_tokens = sum(s["new_tokens"] for s in samples)
    plain_tokens = sum(s["plain_new_tokens"] for s in samples)
    plain_rate = plain_tokens / plain_s if plain_s else None
    spec_rate = new_tokens / speculative_s if speculative_s else None
    return {
        "num_samples": len(samples),
        "block_size": block_size,
        "tau": sum(taus) / len(taus) if taus else None,
        "accepted_length_histogram": histogram,
        "acceptance_by_position": by_position,
        "new_tokens": new_tokens,
        "plain_s": plain_s,
        "speculative_s": speculative_s,
        "plain_tokens_per_s": plain_rate,
        "speculative_tokens_per_s": spec_rate,
        "speedup": spec_rate / plain_rate if spec_rate and plain_rate else None,
        "numerical_ties": sum(s["numerical_tie_at"] is not None for s in samples),
    }


def report(
    setup: DecodeSetup,
    plain: Sequence[GreedyResult],
    spec: Sequence[SpecResult],
    *,
    block_size: int,
    plain_s: float,
    speculative_s: float,
    tie_tolerance: float,
) -> dict[str, Any]:
    """summarize() of the checked samples, the decode settings, and "samples"."""
    check = setup.sampling is None  # T > 0: the guarantee is distributional (sampling.py)
    samples = [
        sample_report(i, p, g, s, tie_tolerance, check=check)
        for i, (p, g, s) in enumerate(zip(setup.prompts, plain, spec, strict=True))
    ]
    summary = summarize(samples, block_size, plain_s=plain_s, speculative_s=speculative_s)
    calibration = confidence_by_slot(samples)
    if calibration is not None:  # a drafter with a confidence head (DSpark)
        summary["confidence_by_slot"] = calibration
    batched = setup.batched and setup.sampling is None
    options = setup.sampling or SamplingOptions()
    decoding = {
        "max_new_tokens": setup.max_new_tokens,
        "batch_size": setup.batch_size if batched else 1,
        "decoder": "batched" if batched else "reference",
        "temperature": options.temperature,
        "top_p": options.top_p,
        "top_k": options.top_k,
        "lossless_checked": check,
    }
    return summary | decoding | {"samples": samples}
