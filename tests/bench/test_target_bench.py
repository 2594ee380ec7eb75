"""bench target's weight accounting: counted from the model's tensors, not the allocator."""

from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_async.bench.target_bench import weight_bytes


def _model(*, tied: bool) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config)


def _nbytes(module: torch.nn.Module) -> int:
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def test_weight_bytes_counts_every_tensor_once_and_the_held_part_is_embedding_plus_layers():
    for tied in (False, True):
        model = _model(tied=tied)
        decoder = model.model
        whole, held = weight_bytes(model, [0, 2])
        # parameters() already yields a tied tensor once, so the plain sum is the reference
        assert whole == _nbytes(model)
        assert held == _nbytes(decoder.embed_tokens) + sum(
            _nbytes(decoder.layers[i]) for i in range(3)
        )


def test_weight_bytes_ignores_activations_alive_at_the_time():
    model = _model(tied=False)
    before = weight_bytes(model, [1])
    features = torch.empty(1024, 1024)  # an earlier row's output, alive while weights are counted
    assert weight_bytes(model, [1]) == before and features.numel() > 0
