"""What the speculative-decoding tests share: the vocabulary of their tiny random targets, the
dense one (a 6-layer fp32 Qwen3, no download) and a character tokenizer with a stand-in chat
template.

One place for them, so that test_evaluate and test_evaluate_batched decode the same target and
every evaluate() test renders prompts the same way.
"""

from __future__ import annotations

import torch
from transformers import Qwen3Config

from dflash_async.targets.loading import random_target

VOCAB = 96


def tiny_qwen3_target() -> torch.nn.Module:
    """A random 6-layer Qwen3 (hidden 64, vocab VOCAB), fp32, seeded."""
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=0.1,  # wide enough that greedy output is not one repeated token
    )
    return random_target(config, seed=0)


class CharTokenizer:
    """A chat-template stand-in: renders role/content pairs, encodes characters as ids."""

    chat_template = "fake"
    eos_token_id = None

    def apply_chat_template(self, messages, *, tokenize, add_generation_prompt, enable_thinking):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens):
        return {"input_ids": [ord(c) % (VOCAB - 1) for c in text]}
