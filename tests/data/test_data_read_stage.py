"""The read stage sends exactly the packs iter_packs plans, planning in a worker thread."""

from __future__ import annotations

import threading

import anyio
import numpy as np
import pytest

from dflash_async.data import packing
from dflash_async.data.packing import PackCursor, iter_packs
from dflash_async.runtime.channels import open_channel
from dflash_async.stages import read

LENGTHS = np.random.default_rng(0).integers(1, 100, 500)
BUDGET = 256


async def sent_packs(
    start: PackCursor, epochs: int, in_process: bool = False, rank: int = 0, world_size: int = 1
) -> list[tuple[PackCursor, list[int]]]:
    send, receive = open_channel(2, "packs")
    got = []
    with anyio.fail_after(30):
        async with anyio.create_task_group() as group:
            group.start_soon(
                lambda: read.read_stage(
                    LENGTHS,
                    token_budget=BUDGET,
                    seed=3,
                    start=start,
                    epochs=epochs,
                    send=send,
                    plan_in_process=in_process,
                    rank=rank,
                    world_size=world_size,
                )
            )
            async for pack in receive:
                got.append((pack.cursor, pack.indices.tolist()))
    return got


@pytest.mark.anyio
@pytest.mark.parametrize("start", [PackCursor(), PackCursor(0, 5), PackCursor(1, 2)])
async def test_the_read_stage_sends_the_packs_iter_packs_plans(start):
    want = [(c, p.tolist()) for c, p in iter_packs(LENGTHS, BUDGET, 3, start=start, epochs=3)]
    assert await sent_packs(start, 3) == want


@pytest.mark.anyio
async def test_epochs_are_planned_off_the_event_loop_thread(monkeypatch):
    threads = []

    def plan_epoch(*args, **kwargs):
        threads.append(threading.current_thread())
        return original(*args, **kwargs)

    original = packing.plan_epoch
    monkeypatch.setattr(packing, "plan_epoch", plan_epoch)
    loop_thread = threading.current_thread()
    await sent_packs(PackCursor(), 2)
    assert len(threads) == 2 and loop_thread not in threads


@pytest.mark.anyio
async def test_a_planner_process_gives_the_same_packs_of_each_rank():
    start = PackCursor(1, 2)
    for rank in (0, 1):
        packs = iter_packs(LENGTHS, BUDGET, 3, start=start, epochs=3, rank=rank, world_size=2)
        want = [(c, p.tolist()) for c, p in packs]
        assert await sent_packs(start, 3, in_process=True, rank=rank, world_size=2) == want


@pytest.mark.anyio
async def test_a_start_past_the_epoch_is_an_error():
    with pytest.raises(ExceptionGroup) as raised:  # task groups wrap it
        await sent_packs(PackCursor(0, 10_000), 1)
    assert raised.group_contains(ValueError, match="past the 122 packs of epoch 0", depth=None)
