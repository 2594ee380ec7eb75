"""The rings of several devices: bounded per device, balanced between devices.

Several rings on the `cpu` device stand for the rings of several GPUs (the same RingSet code runs
on both). Ordering is made deterministic with semaphores and `wait_all_tasks_blocked` (every task
waits: the state is settled), never with sleeps.
"""

from __future__ import annotations

import anyio
import pytest
import torch
from anyio import wait_all_tasks_blocked

from dflash_async.runtime.rings import Notifier, RingSet, Slot, SlotRing

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]
CPU = torch.device("cpu")


def ring_set(num_rings: int, num_slots: int) -> RingSet:
    changed = Notifier()
    return RingSet(
        [
            SlotRing(
                num_slots, token_budget=8, feature_dim=2, device=CPU, name=f"r{i}", changed=changed
            )
            for i in range(num_rings)
        ]
    )


def ring_of(rings: RingSet, slot: Slot) -> int:
    """The index of the ring that holds `slot`."""
    return next(i for i, ring in enumerate(rings.rings) if slot in ring.slots)


async def test_a_producer_fills_its_home_ring_first_then_the_roomiest_then_waits() -> None:
    rings = ring_set(3, 2)
    producer = rings.producer(home=1)
    taken = [await producer.acquire_free() for _ in range(2)]
    assert [ring_of(rings, s) for s in taken] == [1, 1]  # home first: no copy across devices
    rings.rings[2].publish(await rings.rings[2].acquire_free())  # ring 2 has less room than 0
    spilled = [await producer.acquire_free() for _ in range(3)]
    assert [ring_of(rings, s) for s in spilled] == [0, 0, 2]  # then the roomiest ring
    blocked = anyio.Event()

    async def one_more() -> None:
        slot = await producer.acquire_free()
        assert ring_of(rings, slot) == 2  # the first ring to get room back
        blocked.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(one_more)
        await wait_all_tasks_blocked()
        assert not blocked.is_set()  # every ring is full: the producer waits (backpressure)
        for slot in taken:
            rings.publish(slot)
        first, *_ = await rings.receive_step()
        assert ring_of(rings, first) == 2  # the oldest published slot goes to drafter 0
        rings.release(first)  # ring 2's slot comes back
    assert blocked.is_set()


async def test_each_ring_holds_at_most_its_slots_so_a_target_stays_that_far_ahead() -> None:
    rings = ring_set(2, 3)
    producer = rings.producer(home=0)
    filled: list = []

    async def fill_seven() -> None:
        for _ in range(7):
            filled.append(await producer.acquire_free())

    async with anyio.create_task_group() as tg:
        tg.start_soon(fill_seven)
        await wait_all_tasks_blocked()
        assert len(filled) == 6  # 3 per ring, 2 x 3 in all: the 7th waits
        assert sorted(ring_of(rings, s) for s in filled) == [0, 0, 0, 1, 1, 1]
        tg.cancel_scope.cancel()


async def test_a_step_waits_only_while_fewer_packs_than_drafters_exist() -> None:
    rings = ring_set(2, 2)
    got: list = []

    async def step() -> None:
        got.extend(await rings.receive_step())

    async with anyio.create_task_group() as tg:
        tg.start_soon(step)
        slot = await rings.rings[1].acquire_free()
        rings.publish(slot)
        await wait_all_tasks_blocked()
        assert got == []  # one pack for two drafters: wait
        rings.publish(await rings.rings[1].acquire_free())
    assert [ring_of(rings, s) for s in got] == [1, 1]


async def test_closed_rings_end_the_steps_once_fewer_packs_than_drafters_remain() -> None:
    rings = ring_set(2, 2)
    for _ in range(3):
        rings.publish(await rings.producer(home=0).acquire_free())
    rings.close()
    assert len(await rings.receive_step()) == 2
    with pytest.raises(anyio.EndOfStream):
        await rings.receive_step()
    with pytest.raises(anyio.ClosedResourceError):
        await rings.producer(home=0).acquire_free()


async def test_unequal_target_speeds_never_leave_a_drafter_waiting_beside_a_full_ring() -> None:
    """Target 0 makes 3 packs per tick, target 1 one every other tick; two drafters step in
    lockstep, 2 steps per tick for 12 ticks (they outrun the targets: steps steal from ring 0),
    then 1 per tick (the targets outrun them: target 0 spills into ring 1). At every settled
    state (all tasks waiting): drafters waiting for packs see no full ring (a dry ring's drafter
    takes from the full one), a target waiting for a slot sees every ring full (a full home ring
    sends its pack to a ring with room); every pack is trained on once. Mutants caught: a
    producer that only uses its home ring, a step that only takes its own ring."""
    num_slots, ticks = 2, 36
    rings = ring_set(2, num_slots)
    budgets = [anyio.Semaphore(0), anyio.Semaphore(0)]
    step_budget = anyio.Semaphore(0)
    waiting = {"target0": False, "target1": False, "drafters": False}
    produced: list[tuple[int, int]] = []
    trained: list[tuple[int, int]] = []
    spilled = stolen = 0  # packs filled outside their target's home ring, taken by another drafter

    async def target(home: int) -> None:
        nonlocal spilled
        producer, n = rings.producer(home), 0
        while True:
            await budgets[home].acquire()
            waiting[f"target{home}"] = True
            slot = await producer.acquire_free()
            waiting[f"target{home}"] = False
            spilled += ring_of(rings, slot) != home
            slot.meta["pack"] = (home, n)
            produced.append((home, n))
            producer.publish(slot)
            n += 1

    async def drafters() -> None:
        nonlocal stolen
        while True:
            await step_budget.acquire()
            waiting["drafters"] = True
            slots = await rings.receive_step()
            waiting["drafters"] = False
            trained.extend(s.meta["pack"] for s in slots)
            stolen += sum(ring_of(rings, s) != j for j, s in enumerate(slots))
            for slot in slots:
                rings.release(slot)

    async with anyio.create_task_group() as tg:
        tg.start_soon(target, 0)
        tg.start_soon(target, 1)
        tg.start_soon(drafters)
        for tick in range(ticks):
            for _ in range(3):
                budgets[0].release()
            if tick % 2 == 0:
                budgets[1].release()
            for _ in range(2 if tick < 12 else 1):
                step_budget.release()
            await wait_all_tasks_blocked()
            depths = rings.statistics().depths
            if waiting["drafters"]:
                assert num_slots not in depths, f"tick {tick}: drafters wait, depths {depths}"
            if waiting["target0"] or waiting["target1"]:
                assert depths == [num_slots] * 2, f"tick {tick}: a target waits, depths {depths}"
        tg.cancel_scope.cancel()
    assert len(set(trained)) == len(trained) and set(trained) <= set(produced)
    assert len(produced) - len(trained) <= 2 * num_slots  # the rest sit in the rings
    assert spilled > 0 and stolen > 0  # both imbalances happened


async def test_a_step_takes_the_oldest_published_packs_the_jth_oldest_for_drafter_j() -> None:
    """Which packs make a step, and which drafter trains on which, follow the publish order alone
    (not which ring a pack sits in): with one target a run repeats bit for bit. Mutant caught:
    each drafter taking its own ring's slot first (packs 0 and 2 here instead of 0 and 1)."""
    rings = ring_set(2, 3)
    order = []
    for ring in (0, 0, 1, 0):  # publish order 0..3 over the rings
        slot = await rings.rings[ring].acquire_free()
        slot.meta["pack"] = len(order)
        rings.publish(slot)
        order.append(slot)
    first = await rings.receive_step()
    assert [s.meta["pack"] for s in first] == [0, 1]
    second = await rings.receive_step()
    assert [s.meta["pack"] for s in second] == [2, 3]
