"""The pack planner, resumable cursors, target batches and the fixed drafter layout."""

from __future__ import annotations

import itertools

import anyio
import numpy as np
import pytest
import torch

from dflash_async.bench.packing_bench import bench_packing, synthetic_lengths
from dflash_async.data.packing import (
    PackCursor,
    iter_packs,
    layout_pack,
    pack_row_offsets,
    plan_epoch,
    target_batches,
)

BUDGET = 8192


@pytest.fixture(scope="module")
def lengths() -> np.ndarray:
    return synthetic_lengths(3000, max_len=1024, seed=1)


def test_every_sample_is_in_exactly_one_pack_within_the_budget(lengths):
    packs = plan_epoch(lengths, BUDGET, seed=0, epoch=0)
    everything = np.concatenate(packs)
    assert sorted(everything.tolist()) == list(range(len(lengths)))
    assert max(lengths[p].sum() for p in packs) <= BUDGET


def test_the_same_seed_and_epoch_give_the_same_packs(lengths):
    first = plan_epoch(lengths, BUDGET, seed=3, epoch=2)
    again = plan_epoch(lengths.copy(), BUDGET, seed=3, epoch=2)
    assert len(first) == len(again)
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))


def test_another_epoch_or_seed_orders_the_packs_differently(lengths):
    base = plan_epoch(lengths, BUDGET, seed=0, epoch=0)
    for other in (plan_epoch(lengths, BUDGET, 0, 1), plan_epoch(lengths, BUDGET, 1, 0)):
        assert not all(np.array_equal(a, b) for a, b in zip(base, other, strict=False))


def test_packs_fill_the_budget_and_hold_similar_lengths(lengths):
    packs = plan_epoch(lengths, BUDGET, seed=0, epoch=0)
    fills = np.array([lengths[p].sum() for p in packs]) / BUDGET
    assert fills.mean() >= 0.97
    assert np.sort(fills)[1] >= 0.85  # every pack but the last partial one
    spreads = [lengths[p].max() / lengths[p].min() for p in packs]
    assert np.median(spreads) < 1.1


def test_a_sample_longer_than_the_budget_is_rejected_by_index():
    with pytest.raises(ValueError, match="sample 1 has 9000 tokens"):
        plan_epoch(np.array([10, 9000, 20]), BUDGET, seed=0, epoch=0)


def test_a_data_set_smaller_than_one_pack_gives_one_pack():
    packs = plan_epoch(np.array([5, 3, 4]), BUDGET, seed=0, epoch=0)
    assert [sorted(p.tolist()) for p in packs] == [[0, 1, 2]]


def test_a_resumed_cursor_continues_exactly_where_it_stopped(lengths):
    uninterrupted = list(iter_packs(lengths, BUDGET, seed=5, epochs=3))
    for stop in (0, 1, len(uninterrupted) // 3 - 1, len(uninterrupted) // 3, 200):
        cursor = uninterrupted[stop][0].next()  # what a checkpoint saves after pack `stop`
        resumed = list(iter_packs(lengths, BUDGET, seed=5, start=cursor, epochs=3))
        expected = uninterrupted[stop + 1 :]
        assert [c for c, _ in resumed] == [c for c, _ in expected]
        assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(resumed, expected, strict=True))


def test_the_cursor_rolls_over_into_the_next_epoch(lengths):
    num_packs = len(plan_epoch(lengths, BUDGET, seed=0, epoch=0))
    stream = iter_packs(lengths, BUDGET, seed=0, start=PackCursor(0, num_packs - 1))
    cursors = [c for c, _ in itertools.islice(stream, 3)]
    assert cursors == [PackCursor(0, num_packs - 1), PackCursor(1, 0), PackCursor(1, 1)]
    with pytest.raises(ValueError, match="past the"):
        next(iter_packs(lengths, BUDGET, seed=0, start=PackCursor(0, num_packs + 1)))


def test_round_robin_workers_never_receive_the_same_sample(lengths):
    packs = plan_epoch(lengths, BUDGET, seed=0, epoch=0)
    shares = [np.concatenate(packs[w::3]) for w in range(3)]
    seen = np.concatenate(shares)
    assert len(seen) == len(np.unique(seen)) == len(lengths)


def test_workers_sharing_one_channel_never_receive_the_same_sample(lengths):
    packs = plan_epoch(lengths, BUDGET, seed=0, epoch=0)
    received: dict[int, list[np.ndarray]] = {0: [], 1: []}

    async def worker(number: int, receive) -> None:
        async with receive:
            async for pack in receive:
                received[number].append(pack)
                await anyio.lowlevel.checkpoint()  # let the other worker take the next one

    async def main() -> None:
        send, receive = anyio.create_memory_object_stream(max_buffer_size=2)
        async with anyio.create_task_group() as group:
            group.start_soon(worker, 0, receive.clone())
            group.start_soon(worker, 1, receive.clone())
            receive.close()
            async with send:
                for pack in packs:
                    await send.send(pack)

    anyio.run(main)
    assert received[0] and received[1]
    seen = np.concatenate(received[0] + received[1])
    assert len(seen) == len(np.unique(seen)) == len(lengths)


def test_target_batches_cover_the_pack_once_within_max_batch_tokens():
    pack_lengths = np.array([700, 30, 2900, 710, 705, 1500, 40, 3000])
    batches = target_batches(pack_lengths, max_batch_tokens=4096)
    assert sorted(np.concatenate(batches).tolist()) == list(range(len(pack_lengths)))
    for batch in batches:
        rows = pack_lengths[batch]
        assert len(rows) * rows.max() <= 4096
        assert rows[0] == rows.max()  # longest first: the padded width is its length


def test_target_batches_of_similar_lengths_waste_little_padding():
    pack_lengths = np.array([700, 702, 705, 699, 710, 701, 703, 704])
    rows = [pack_lengths[b] for b in target_batches(pack_lengths, max_batch_tokens=2200)]
    padded = sum(len(r) * r.max() for r in rows)
    assert 1 - pack_lengths.sum() / padded < 0.01


def test_a_sample_wider_than_a_target_batch_is_rejected():
    with pytest.raises(ValueError, match="exceeds max_batch_tokens=100"):
        target_batches(np.array([50, 101]), max_batch_tokens=100)


def test_layout_puts_documents_contiguously_then_padding():
    samples = [
        (np.array([11, 12, 13]), np.array([False, True, True])),
        (torch.tensor([21, 22]), torch.tensor([True, False])),
    ]
    batch = layout_pack(samples, token_budget=8, pad_id=99)
    assert batch.input_ids.tolist() == [11, 12, 13, 21, 22, 99, 99, 99]
    assert batch.loss_mask.tolist() == [False, True, True, True, False, False, False, False]
    assert batch.doc_ids.tolist() == [0, 0, 0, 1, 1, -1, -1, -1]
    assert batch.position_ids.tolist() == [0, 1, 2, 0, 1, 0, 0, 0]
    assert batch.features.shape == (8, 0)
    assert batch.input_ids.dtype == batch.doc_ids.dtype == batch.position_ids.dtype == torch.int64
    assert batch.loss_mask.dtype == torch.bool


def test_row_offsets_say_where_each_samples_features_go():
    lengths = np.array([3, 2, 4])
    offsets = pack_row_offsets(lengths)
    features = torch.zeros(12, 1)
    for j in range(len(lengths)):
        features[offsets[j] : offsets[j + 1]] = j + 1
    samples = [(np.zeros(n, dtype=np.int64), np.ones(n, dtype=bool)) for n in lengths]
    batch = layout_pack(samples, token_budget=12, features=features)
    real = batch.doc_ids >= 0
    assert torch.equal(batch.features[real, 0], batch.doc_ids[real].float() + 1)
    assert offsets.tolist() == [0, 3, 5, 9]


def test_layout_rejects_an_overfull_pack_and_misshapen_features():
    sample = (np.zeros(5, dtype=np.int64), np.zeros(5, dtype=bool))
    with pytest.raises(ValueError, match="holds 10 tokens, more than token_budget=8"):
        layout_pack([sample, sample], token_budget=8)
    with pytest.raises(ValueError, match="features has 4 rows, expected 8"):
        layout_pack([sample], token_budget=8, features=torch.zeros(4, 2))


def test_bench_packing_meets_the_issue_targets_on_a_small_run(capsys):
    figures = bench_packing(num_samples=20_000, repeats=1)
    assert figures["drafter_fill"] >= 0.97
    assert figures["target_padding_frac"] <= 0.10
    assert figures["samples_per_s"] > 50_000
    assert "| drafter_fill |" in capsys.readouterr().err  # stdout: JSON only


def test_long_documents_get_a_pack_each_topped_up_with_the_shortest_documents():
    """Four 900-token documents and twenty of 20 tokens, budget 1000: each long document's pack
    carries five short ones (100 tokens of room), so four packs and no padding-only room left;
    cut in ascending order the short ones would fill a fifth pack and leave 100 rows of padding
    beside each long document."""
    lengths = np.array([20] * 10 + [900] * 4 + [20] * 10)
    packs = plan_epoch(lengths, 1000, seed=0, epoch=0)
    assert len(packs) == 4
    assert sorted(np.concatenate(packs).tolist()) == list(range(24))
    assert all(lengths[p].sum() == 1000 and lengths[p[-1]] == 900 for p in packs)
    assert all(np.all(np.diff(lengths[p]) >= 0) for p in packs)  # ascending inside a pack


def test_the_longest_document_is_topped_up_first_and_the_rest_cut_as_before():
    """700 (room 300) takes 100 and 120, 130 would overflow; 600 (room 400) takes 130 and 250;
    the 300 left is cut in ascending order like any short document."""
    lengths = np.array([300, 600, 250, 700, 100, 120, 130])
    packs = plan_epoch(lengths, 1000, seed=0, epoch=0)
    assert sorted(np.concatenate(packs).tolist()) == list(range(7))
    assert {tuple(lengths[p]) for p in packs} == {(100, 120, 700), (130, 250, 600), (300,)}
