"""The FP8 experts' routed way (targets/fp8/fp8_routed.py) on the CPU: the block table the GPU kernel
walks cuts the sorted rows as a loop by hand does, and the routed data flow (the token rows
gathered in the gate_up product, the down product's rows weighted and written at their routed
pairs, a contiguous sum over k) computes what the sorted way computes; the comparison catches a
routing that forgets the division by k, a scatter that keeps expert order, and lost weights.
The Triton kernel itself is compared with `routed_reference` on a GPU
(tests/kernels/test_fp8_moe_kernel_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3MoeConfig

from dflash_async.kernels import fp8_moe_launch
from dflash_async.targets.fp8 import fp8_experts, fp8_routed
from dflash_async.targets.fp8.fp8_experts import Fp8Experts
from dflash_async.targets.grouped_experts import blocks_bound, expert_blocks
from dflash_async.targets.loading import random_target


def _blocks_by_hand(counts: list[int], block_rows: int) -> list[tuple[int, int]]:
    table, start = [], 0
    for expert, count in enumerate(counts):
        table += [(expert, start + j) for j in range(0, count, block_rows)]
        start += count
    return table


COUNTS = {  # rows per expert
    "empty experts, partial and whole blocks": [0, 5, 16, 0, 17, 3, 0, 32],
    "one expert takes every row": [0, 0, 40, 0],
    "every expert one row": [1] * 9,
}


@pytest.mark.parametrize("counts", COUNTS, ids=COUNTS)
def test_the_block_table_cuts_each_experts_rows_into_blocks_in_order(counts: str) -> None:
    rows, block_rows = COUNTS[counts], 8
    offsets = torch.tensor(rows).cumsum(0).to(torch.int32)
    bound = blocks_bound(sum(rows), len(rows), block_rows)
    expert, start = expert_blocks(offsets, block_rows=block_rows, num_blocks=bound)
    want = _blocks_by_hand(rows, block_rows)
    assert len(want) <= bound
    got = list(zip(expert.tolist(), start.tolist(), strict=True))
    assert got[: len(want)] == want
    assert all(e == len(rows) for e, _ in got[len(want) :])  # the blocks past the last


def _moe_config() -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=300,
    )


def _routing(tokens: int = 37, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, 64, generator=g)
    index = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(tokens)])
    return hidden, index, torch.rand(tokens, 2, generator=g)


def _both_ways(way: str = "routed"):
    experts = random_target(_moe_config(), seed=0).model.layers[0].mlp.experts
    routed = Fp8Experts(experts, out_dtype=torch.float32, compile=False, way=way)
    assert routed._routed_mm is fp8_routed.routed_reference
    return routed, Fp8Experts(experts, out_dtype=torch.float32, compile=False)


# fp32 out: the same e4m3 values and scales in both ways, the same weights and k-sum in fp32;
# only the matmuls' summation order differs (K <= 64 terms: ~64 * 2^-24 relative), hence 1e-5
@pytest.mark.parametrize("way", ["routed", "split"])
def test_the_routed_way_computes_what_the_sorted_way_computes(way: str) -> None:
    routed, sorted_ = _both_ways(way)
    assert sorted_.way == "sorted"  # the CPU's default
    hidden, index, weights = _routing()
    torch.testing.assert_close(
        routed(hidden, index, weights), sorted_(hidden, index, weights), rtol=1e-5, atol=1e-6
    )


def _no_division(index, weights, **routing):
    """Mutant: the sorted rows' tokens taken as their pair indices (perm, not perm // k)."""
    _, perm, *rest = fp8_routed.routed_rows(index, weights, **routing)
    return perm % index.shape[0], perm, *rest


def _expert_order(index, weights, **routing):
    """Mutant: the down product's rows left in expert order (no scatter to the pairs)."""
    token, perm, *rest = fp8_routed.routed_rows(index, weights, **routing)
    return token, torch.arange(perm.numel(), dtype=perm.dtype), *rest


def _unweighted(index, weights, **routing):
    """Mutant: the routing weights lost."""
    *rest, pair_weights = fp8_routed.routed_rows(index, weights, **routing)
    return *rest, torch.ones_like(pair_weights)


MUTANTS = {f.__name__.strip("_"): f for f in (_no_division, _expert_order, _unweighted)}


# the split way reads the routing's tokens and permutation, not its pair weights (`combine` weighs)
SPLIT_MUTANTS = ("no_division", "expert_order")


@pytest.mark.parametrize(
    ("mutant", "way"),
    [(m, "routed") for m in MUTANTS] + [(m, "split") for m in SPLIT_MUTANTS],
)
def test_the_routed_comparison_catches_mutant(mutant: str, way: str, monkeypatch) -> None:
    monkeypatch.setattr(fp8_experts, "routed_rows", MUTANTS[mutant])
    routed, sorted_ = _both_ways(way)
    hidden, index, weights = _routing()
    got, want = routed(hidden, index, weights), sorted_(hidden, index, weights)
    assert not torch.allclose(got, want, rtol=1e-3, atol=1e-4)


def test_both_products_read_one_routing_table() -> None:
    assert fp8_moe_launch.GATE_UP_LAUNCH.block_rows == fp8_moe_launch.DOWN_LAUNCH.block_rows


def test_the_routed_way_is_refused_for_experts_the_kernel_cannot_tile() -> None:
    """On a GPU the kernel needs whole 128-wide tiles: d = 64 is not; on the CPU the reference
    runs any shape (the test above)."""
    experts = random_target(_moe_config(), seed=0).model.layers[0].mlp.experts
    weight = experts.gate_up_proj.detach()
    assert "not whole 128x128 tiles" in fp8_moe_launch.launch_problem(weight, fp8_moe_launch.LAUNCH)
    assert (
        fp8_moe_launch.launch_problem(weight, fp8_moe_launch.Launch(block_n=16, block_k=16)) is None
    )


@pytest.mark.parametrize("way", fp8_experts.WAYS)
def test_every_way_adds_the_residual_to_its_output(way: str) -> None:
    """The packed forwards pass the decoder layer's residual stream (`takes_residual`): added to
    the output in the last compiled pass, the same values as adding it after."""
    experts = random_target(_moe_config(), seed=0).model.layers[0].mlp.experts
    fp8 = Fp8Experts(experts, out_dtype=torch.float32, compile=False, way=way)
    hidden, index, weights = _routing()
    residual = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(3))
    got = fp8(hidden, index, weights, residual=residual)
    assert torch.equal(got, residual + fp8(hidden, index, weights))


@pytest.mark.parametrize("way", ["routed", "split"])
def test_tokens_quantized_by_the_caller_give_what_the_experts_compute_themselves(way) -> None:
    """`quantized_tokens` (what the packed MoE forward's compiled graph computes with the norm)
    passed back as `tokens`: the same output bit for bit; the sorted way takes none. Tokens
    quantized from other rows (one row off) are caught."""
    experts = random_target(_moe_config(), seed=0).model.layers[0].mlp.experts
    fp8 = Fp8Experts(experts, out_dtype=torch.float32, compile=False, way=way)
    hidden, index, weights = _routing()
    tokens = fp8.quantized_tokens(hidden)
    assert torch.equal(fp8(hidden, index, weights, tokens=tokens), fp8(hidden, index, weights))
    shifted = fp8.quantized_tokens(hidden.roll(1, dims=0))
    assert not torch.allclose(
        fp8(hidden, index, weights, tokens=shifted),
        fp8(hidden, index, weights),
        rtol=1e-3,
        atol=1e-4,
    )
    fp8.set_way("sorted")
    assert fp8.quantized_tokens(hidden) is None
