"""`bench drafter --shape`: every shape has its drafter and its pack, and the peers' published
geometries are the ones their step times were measured at."""

from __future__ import annotations

from dflash_async.bench.drafter_bench import GEOMETRIES, SHAPES


def test_every_drafter_shape_has_a_default_pack() -> None:
    assert set(SHAPES) == set(GEOMETRIES)
    for name, geometry in GEOMETRIES.items():
        assert geometry.token_budget % geometry.num_docs == 0, name  # equal documents


def test_qwen3_4b_shape_is_specforges_torchtitan_geometry() -> None:
    """5 layers, hidden 2560, ffn 9728, vocab 151936, block 16; per rank 2 x 4096 tokens and
    2 x 512 anchors."""
    config = SHAPES["qwen3-4b"]()
    shape = (config.num_hidden_layers, config.hidden_size, config.intermediate_size)
    assert shape == (5, 2560, 9728)
    assert (config.vocab_size, config.block_size) == (151936, 16)
    geometry = GEOMETRIES["qwen3-4b"]
    assert (geometry.token_budget, geometry.num_anchors, geometry.num_docs) == (8192, 1024, 2)


def test_qwen3_8b_specforge_shape_is_their_recipe() -> None:
    """SpecForge's Qwen3-8B DFlash recipe: 4 samples of 3072 tokens, 512 anchors each."""
    geometry = GEOMETRIES["qwen3-8b-specforge"]
    assert (geometry.token_budget, geometry.num_anchors, geometry.num_docs) == (12288, 2048, 4)
    assert SHAPES["qwen3-8b-specforge"]().hidden_size == 4096
