"""Hybrid targets (Gated DeltaNet + attention): speculative decoding stays exact.

A tiny random Qwen3-Next (transformers' class; on this CPU its torch reference kernels) with two
linear-attention and two attention layers. Verifying a block moves the recurrent and conv states
past rejected drafts; hybrid_state.py rolls them back. Lossless on every sample, an oracle
reaches tau ~ B, and a decoder that skips the rollback is caught.
"""

from __future__ import annotations

import pytest
import torch
from tiny_decoding import VOCAB, CharTokenizer
from transformers import Qwen3NextConfig

from dflash_async.eval import hybrid_state
from dflash_async.eval.harness import evaluate
from dflash_async.eval.lossless import GreedyResult, LosslessError, check_lossless
from dflash_async.eval.speculative import greedy_generate, speculative_decode
from dflash_async.model.drafter import DFlashDrafter
from dflash_async.model.drafter_config import drafter_config_from_target
from dflash_async.targets.loading import is_hybrid, random_target

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

MAX_NEW = 24
LAYERS = (0, 2)


@pytest.fixture(scope="module")
def target():
    config = Qwen3NextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        max_position_embeddings=512,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        tie_word_embeddings=False,
        initializer_range=0.1,
    )
    model = random_target(config, seed=0)
    assert is_hybrid(model)
    return model


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB - 1, (n,), generator=gen).tolist() for n in (3, 17)]


class Oracle:
    """Knows the greedy continuation; right for the first `correct` slots of every block."""

    def __init__(self, sequence: list[int], block_size: int, correct: int) -> None:
        self.sequence, self.block_size, self.correct = sequence, block_size, correct

    def extend_context(self, features: torch.Tensor, positions: torch.Tensor) -> None:
        pass

    def draft(self, anchor_token: int, anchor_position: int) -> torch.Tensor:
        truth = self.sequence[anchor_position + 1 : anchor_position + self.block_size]
        truth += [0] * (self.block_size - 1 - len(truth))
        return torch.tensor(
            [t if k < self.correct else (t + 1) % VOCAB for k, t in enumerate(truth)]
        )


@pytest.fixture(scope="module")
def greedy(target):
    """Each prompt's greedy continuation, B tokens longer than decoded (the oracle's truth)."""
    return [greedy_generate(target, p, MAX_NEW + 8, None) for p in prompts()]


def decode_all(target, greedy, block_size: int, correct: int):
    """(greedy, speculative) per prompt with an oracle right for `correct` slots per block."""
    pairs = []
    for prompt, plain in zip(prompts(), greedy, strict=True):
        oracle = Oracle(prompt + plain.tokens, block_size, correct)
        spec = speculative_decode(
            target, oracle, prompt, layer_ids=LAYERS, max_new_tokens=MAX_NEW, eos_token_id=None
        )
        cut = GreedyResult(
            plain.tokens[:MAX_NEW], plain.runner_up[:MAX_NEW], plain.margins[:MAX_NEW]
        )
        pairs.append((cut, spec))
    return pairs


@pytest.mark.parametrize("correct", [0, 3])
def test_hybrid_speculative_output_is_greedy_on_every_sample(target, greedy, correct):
    """Every step rejects after `correct` drafts, so every step rolls the states back. fp32 on
    CPU: chunked (verify) and recurrent (one-token) kernels differ by ~1e-6, far below the
    1e-4 tie tolerance; check_lossless raises on any other difference."""
    for i, (plain, spec) in enumerate(decode_all(target, greedy, 8, correct)):
        assert check_lossless(i, plain, spec, tolerance=1e-4) is None
        assert spec.accepted_lengths[:-1] == [correct + 1] * (len(spec.accepted_lengths) - 1)


def test_hybrid_oracle_reaches_tau_of_the_block_size(target, greedy):
    for _, spec in decode_all(target, greedy, 8, correct=8):
        assert spec.tau > 8 - 1  # every block accepted whole; only the last may be cut short


def test_skipping_the_state_rollback_is_caught(target, greedy, monkeypatch):
    """The mutant: states keep the rejected drafts. Some sample then leaves greedy decoding."""
    monkeypatch.setattr(hybrid_state, "restore_linear_states", lambda snapshot: None)
    with pytest.raises(LosslessError):
        for i, (plain, spec) in enumerate(decode_all(target, greedy, 8, correct=2)):
            check_lossless(i, plain, spec, tolerance=1e-4)


def test_evaluate_decodes_a_hybrid_target_with_the_reference_decoder(target):
    config = drafter_config_from_target(
        target.config, num_hidden_layers=1, num_features=1, block_size=4, mask_token_id=VOCAB - 1
    )
    drafter = DFlashDrafter(config).eval().requires_grad_(False)
    records = [{"prompt": "abc"}, {"prompt": "hello world"}]
    report = evaluate(
        target, CharTokenizer(), drafter, config, records, max_new_tokens=12, warmup=False
    )
    assert report["decoder"] == "reference" and report["batch_size"] == 1
    assert report["num_samples"] == 2 and report["tau"] >= 1.0


def test_qwen3_5_text_target_is_lossless_and_needs_the_rollback(monkeypatch):
    """The same on transformers' Qwen3.5 text model (Gated DeltaNet with a gated attention)."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"] * 2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=0.1,
    )
    qwen3_5 = random_target(config, seed=0)
    assert is_hybrid(qwen3_5)
    greedy = [greedy_generate(qwen3_5, p, MAX_NEW + 8, None) for p in prompts()]
    for i, (plain, spec) in enumerate(decode_all(qwen3_5, greedy, 8, correct=3)):
        assert check_lossless(i, plain, spec, tolerance=1e-4) is None
    monkeypatch.setattr(hybrid_state, "restore_linear_states", lambda snapshot: None)
    with pytest.raises(LosslessError):
        for i, (plain, spec) in enumerate(decode_all(qwen3_5, greedy, 8, correct=3)):
            check_lossless(i, plain, spec, tolerance=1e-4)
