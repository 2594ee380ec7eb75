"""Batched decoding equals one-at-a-time decoding: same tokens, same accepted lengths, same tau.

The reference is speculative.py's batch-1 decoder (HF DynamicCache, cropped after every
rejection). Prompts have different lengths, drafters accept a different number of drafts per row
and step, and an eos stops some rows in the middle of a batch while the others go on. The target
is a tiny random fp32 Qwen3 (batched and single forwards agree to ~1e-6, its top-2 logit margins
are ~1e-2 or more, so argmaxes cannot differ: exact equality is the right assertion).
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import randomize_
from tiny_decoding import VOCAB, CharTokenizer, tiny_qwen3_target
from transformers import Qwen3Config

from dflash_async.eval.batched_decoding import BatchedDecode, RowsBlockDrafter
from dflash_async.eval.harness import evaluate
from dflash_async.eval.lossless import GreedyResult, LosslessError, SpecResult, check_lossless
from dflash_async.eval.speculative import (
    DFlashBlockDrafter,
    greedy_generate,
    speculative_decode,
)
from dflash_async.model.drafter import DFlashDrafter
from dflash_async.model.drafter_config import drafter_config_from_target
from dflash_async.targets.loading import frozen_embeddings, random_target

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

MAX_NEW = 40
LENGTHS = (3, 11, 24, 7, 17)
LAYERS = (1, 3)


@pytest.fixture(scope="module")
def target():
    return tiny_qwen3_target()


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB - 1, (n,), generator=gen).tolist() for n in LENGTHS]


def correct_drafts(prompt_index: int, position: int, block_size: int) -> int:
    """How many leading drafts the oracle gets right: varies by prompt and by step."""
    return (7 * position + 3 * prompt_index) % block_size


class OneOracle:
    """Single-sequence oracle (speculative.BlockDrafter): right for correct_drafts() slots."""

    def __init__(self, index: int, sequence: list[int], block_size: int) -> None:
        self.index, self.sequence, self.block_size = index, sequence, block_size

    def extend_context(self, features: torch.Tensor, positions: torch.Tensor) -> None:
        pass

    def draft(self, anchor_token: int, anchor_position: int) -> torch.Tensor:
        truth = self.sequence[anchor_position + 1 : anchor_position + self.block_size]
        truth += [0] * (self.block_size - 1 - len(truth))
        right = correct_drafts(self.index, anchor_position, self.block_size)
        return torch.tensor([t if k < right else (t + 1) % VOCAB for k, t in enumerate(truth)])


class RowsOracle:
    """The same oracle for a batch: row b is prompt indices[b]."""

    def __init__(self, oracles: list[OneOracle]) -> None:
        self.oracles = oracles
        block = oracles[0].block_size  # B-1 drafts per block, as a DFlash drafter's
        self.config = type("Config", (), {"block_size": block, "drafts_per_block": block - 1})()

    def extend_context(self, features, positions, rows=slice(None)) -> None:
        pass

    def draft(self, anchors: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        rows = zip(self.oracles, anchors.tolist(), positions.tolist(), strict=True)
        return torch.stack([o.draft(a, p) for o, a, p in rows])


def batched(target, prompt_list, size, *, make_draft, eos=frozenset()):
    """Decode prompt_list in batches of `size` with BatchedDecode; results in prompt order."""
    results = []
    for start in range(0, len(prompt_list), size):
        rows = list(range(start, min(start + size, len(prompt_list))))
        decode = BatchedDecode(
            target,
            [prompt_list[i] for i in rows],
            draft=make_draft(rows),
            layer_ids=LAYERS,
            max_new_tokens=MAX_NEW,
            eos=eos,
            suppress=(),
        )
        while not decode.advance():
            pass
        results += decode.results()
    return results


@pytest.mark.parametrize("block_size", [4, 8])
def test_batched_oracle_decoding_equals_one_at_a_time_for_every_batch_size(target, block_size):
    """Rows accept 0..B-1 drafts, differently per row and step: identical tokens and accepted
    lengths to the reference decoder, whatever the batch size."""
    plist = prompts()
    truth = [p + greedy_generate(target, p, MAX_NEW + block_size, None).tokens for p in plist]
    oracles = [OneOracle(i, truth[i], block_size) for i in range(len(plist))]
    reference = [
        speculative_decode(
            target, o, p, layer_ids=LAYERS, max_new_tokens=MAX_NEW, eos_token_id=None
        )
        for o, p in zip(oracles, plist, strict=True)
    ]
    assert len({n for r in reference for n in r.accepted_lengths}) >= 4  # rows really differ
    for size in (1, 2, 3, 5):
        rows = batched(
            target, plist, size, make_draft=lambda r: RowsOracle([oracles[i] for i in r])
        )
        assert [r.tokens for r in rows] == [r.tokens for r in reference], size
        assert [r.accepted_lengths for r in rows] == [r.accepted_lengths for r in reference], size


def test_eos_in_the_middle_of_a_batch_stops_only_its_rows(target):
    """An eos that some rows emit early: those rows stop there, the others decode on, and every
    row equals the reference (greedy and speculative)."""
    plist, block_size = prompts(), 6
    free = [greedy_generate(target, p, MAX_NEW, None).tokens for p in plist]
    # The target's favourite token: some rows emit it early, the others never, and it is often
    # the target's choice in a rejected slot, which must not stop a row (only committed ones do).
    eos = frozenset({max(range(VOCAB), key=lambda t: sum(f.count(t) for f in free))})
    stops = [next((i for i, t in enumerate(f) if t in eos), None) for f in free]
    assert any(s is None for s in stops) and any(s is not None and s < 20 for s in stops)
    greedy = [greedy_generate(target, p, MAX_NEW, eos) for p in plist]
    truth = [p + f for p, f in zip(plist, free, strict=True)]
    oracles = [OneOracle(i, truth[i] + [0] * 8, block_size) for i in range(len(plist))]
    reference = [
        speculative_decode(target, o, p, layer_ids=LAYERS, max_new_tokens=MAX_NEW, eos_token_id=eos)
        for o, p in zip(oracles, plist, strict=True)
    ]
    for size in (2, 5):
        plain = batched(target, plist, size, make_draft=lambda r: None, eos=eos)
        assert [g.tokens for g in plain] == [g.tokens for g in greedy]
        assert [g.runner_up for g in plain] == [g.runner_up for g in greedy]
        spec = batched(
            target, plist, size, eos=eos, make_draft=lambda r: RowsOracle([oracles[i] for i in r])
        )
        assert [s.tokens for s in spec] == [g.tokens for g in greedy]
        assert [s.accepted_lengths for s in spec] == [r.accepted_lengths for r in reference]


def drafter_for(target, block_size: int, seed: int = 0):
    config = drafter_config_from_target(
        target.config,
        num_hidden_layers=2,
        num_features=2,
        block_size=block_size,
        mask_token_id=VOCAB - 1,
    )
    drafter = DFlashDrafter(config).eval().requires_grad_(False)
    randomize_(drafter, seed)
    return drafter, config


def test_rows_drafter_logits_equal_the_single_sequence_drafter(target):
    """Each row's context grows by its own steps; its block logits equal DFlashBlockDrafter's
    fed the same features (fp32: equal within 1e-5 of O(1) logits, summation order only)."""
    drafter, cfg = drafter_for(target, 5)
    embed, lm_head = frozen_embeddings(target)
    gen = torch.Generator().manual_seed(3)
    features = torch.randn(3, 30, 2 * 64, generator=gen)  # [b, S, k*d]
    rows = RowsBlockDrafter(drafter, cfg, embed, lm_head, batch=3, capacity=40)
    singles = [DFlashBlockDrafter(drafter, cfg, embed, lm_head, max_context=40) for _ in range(3)]
    length = torch.tensor([4, 9, 1])
    rows.extend_context(features[:, :9], torch.arange(9).expand(3, -1))  # rows past length unused
    for b, single in enumerate(singles):
        single.extend_context(features[b, : length[b]], torch.arange(int(length[b])))
    for step in (torch.tensor([3, 0, 4]), torch.tensor([1, 4, 2])):  # accepted drafts, < B
        slot = torch.arange(5)
        stale = features[:, 29 - 5 : 29]  # rows past each length are overwritten later
        gather = (length[:, None] + slot).clamp(max=29)
        block_features = torch.stack([features[b, gather[b]] for b in range(3)])
        rows.extend_context(
            torch.where((slot < step[:, None] + 1)[..., None], block_features, stale),
            length[:, None] + slot,
        )
        for b, single in enumerate(singles):
            n = int(step[b]) + 1
            single.extend_context(block_features[b, :n], int(length[b]) + torch.arange(n))
        length = length + step + 1
        anchors = torch.tensor([5, 17, 33])
        batched_logits = rows.block_logits(anchors, length)
        for b, single in enumerate(singles):
            expected = single.block_logits(int(anchors[b]), int(length[b]))
            torch.testing.assert_close(batched_logits[b], expected, atol=1e-5, rtol=1e-5)


def test_evaluate_reports_the_same_tau_and_tokens_for_every_batch_size(target, tmp_path):
    """evaluate() end to end with a real DFlash drafter: batch 1, 2, 4 give the same samples;
    the greedy baseline is decoded once and then read from the output folder."""
    drafter, cfg = drafter_for(target, 4, seed=2)
    records = [{"prompt": "x" * n} for n in (2, 9, 5, 14)]
    reports = {}
    for size in (1, 2, 4):
        reports[size] = evaluate(
            target,
            CharTokenizer(),
            drafter,
            cfg,
            records,
            max_new_tokens=24,
            batch_size=size,
            warmup=False,
            baseline_dir=tmp_path / str(size),
            target_id="tiny",
        )
    samples = {
        k: [(s["tokens"], s["accepted_lengths"]) for s in r["samples"]] for k, r in reports.items()
    }
    assert samples[1] == samples[2] == samples[4]
    assert reports[1]["tau"] == reports[4]["tau"] and reports[4]["batch_size"] == 4
    assert reports[4]["decoder"] == "batched" and not reports[4]["baseline_cached"]
    again = evaluate(
        target,
        CharTokenizer(),
        drafter,
        cfg,
        records,
        max_new_tokens=24,
        batch_size=4,
        warmup=False,
        baseline_dir=tmp_path / "4",
        target_id="tiny",
    )
    assert again["baseline_cached"] and again["plain_s"] == reports[4]["plain_s"]
    assert again["samples"] == reports[4]["samples"]
    (baseline,) = (tmp_path / "4").glob("baseline-*.jsonl")
    assert json.loads(baseline.read_text().splitlines()[0])["num_prompts"] == 4
    hist, by_position = again["accepted_length_histogram"], again["acceptance_by_position"]
    steps = sum(hist.values())
    assert by_position == [sum(hist[n] for n in hist if n > k) / steps for k in (1, 2, 3)]


def test_eager_attention_gets_an_additive_mask():
    """HF eager attention ADDS the mask (DFLASH.md known bug 6): a boolean mask there would mask
    nothing. Batched greedy on an eager target equals the reference."""
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=False,
        initializer_range=0.1,
        attn_implementation="eager",
    )
    eager = random_target(config, seed=1)
    assert eager.config._attn_implementation == "eager"
    plist = prompts()[:3]
    reference = [greedy_generate(eager, p, 12, None).tokens for p in plist]
    decode = BatchedDecode(
        eager, plist, draft=None, layer_ids=(), max_new_tokens=12, eos=frozenset(), suppress=()
    )
    while not decode.advance():
        pass
    assert [r.tokens for r in decode.results()] == reference


def test_a_difference_to_one_of_greedys_next_choices_within_tolerance_is_a_tie():
    """bf16 verify and decode passes may reorder near-equal logits: the speculative token is
    then one of greedy's next choices, its logit within the tolerance (here the third)."""
    greedy = GreedyResult(
        [5, 6, 7],
        [1, 2, 3],
        [0.5, 0.01, 0.2],
        [[1, 8, 9], [2, 4, 9], [3, 8, 1]],
        [[0.5, 0.6, 0.7], [0.01, 0.02, 0.3], [0.2, 0.3, 0.4]],
    )
    assert check_lossless(0, greedy, SpecResult([5, 4, 0], [1, 2]), tolerance=0.05) == 1
    with pytest.raises(LosslessError, match="new token 1"):  # third choice, gap 0.3 > 0.05
        check_lossless(0, greedy, SpecResult([5, 9, 0], [1, 2]), tolerance=0.05)
    with pytest.raises(LosslessError, match="new token 0"):  # not among the next choices
        check_lossless(0, greedy, SpecResult([7, 6, 7], [1, 2]), tolerance=1.0)


def test_batched_greedy_keeps_the_targets_next_choices_and_their_gaps(target):
    prompt = prompts()[2]
    decode = BatchedDecode(
        target, [prompt], draft=None, layer_ids=(), max_new_tokens=3, eos=frozenset(), suppress=()
    )
    while not decode.advance():
        pass
    (result,) = decode.results()
    logits = target(torch.tensor([prompt])).logits[0, -1]
    top = logits.topk(4)
    assert [result.tokens[0], *result.alternatives[0]] == top.indices.tolist()
    expected = (top.values[0] - top.values[1:]).tolist()
    assert result.gaps[0] == pytest.approx(expected, abs=1e-5)  # fp32, O(1) logits


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_batched_decoding_equals_one_at_a_time(target, dtype):
    """On CUDA (sdpa with a per-row mask, scatter writes): fp32 identical to the reference;
    bf16 lossless against the batched baseline up to counted numerical ties."""
    gpu = random_target(target.config, seed=0, dtype=dtype).to("cuda")
    plist, block_size = prompts(), 8
    plain = batched(gpu, plist, 5, make_draft=lambda r: None)
    truth = [p + g.tokens + [0] * block_size for p, g in zip(plist, plain, strict=True)]
    oracles = [OneOracle(i, truth[i], block_size) for i in range(len(plist))]
    spec = batched(gpu, plist, 5, make_draft=lambda r: RowsOracle([oracles[i] for i in r]))
    for i, (g, s) in enumerate(zip(plain, spec, strict=True)):
        check_lossless(i, g, s, tolerance=1e-4 if dtype == torch.float32 else 0.5)
    if dtype == torch.float32:
        reference = [
            speculative_decode(
                gpu, o, p, layer_ids=LAYERS, max_new_tokens=MAX_NEW, eos_token_id=None
            )
            for o, p in zip(oracles, plist, strict=True)
        ]
        assert [s.accepted_lengths for s in spec] == [r.accepted_lengths for r in reference]
