"""Bounded channels (channels.py) and one slot ring (rings.py): order, end signal, backpressure,
release events, loop lag."""

from __future__ import annotations

import time
from dataclasses import dataclass

import anyio
import pytest
import torch
from anyio import wait_all_tasks_blocked

from dflash_async.data.packing import PackedBatch
from dflash_async.runtime.channels import open_channel
from dflash_async.runtime.devices import open_device_worker
from dflash_async.runtime.rings import Slot, SlotRing

pytestmark = pytest.mark.timeout(30)
CPU = torch.device("cpu")


@dataclass
class FakeEvent:
    """Stands in for a torch.cuda.Event: `query()` is true once `done` is set."""

    done: bool = False
    queries: int = 0

    def query(self) -> bool:
        self.queries += 1
        return self.done


def _ring(num_slots: int = 2) -> SlotRing:
    return SlotRing(num_slots, token_budget=32, feature_dim=6, device=CPU, name="hidden")


def _fill(batch: PackedBatch, value: int) -> None:
    batch.input_ids.fill_(value)
    batch.features.fill_(value)


def _matmuls_for(seconds: float) -> int:
    """CPU work in the worker thread: matmuls until `seconds` passed; returns how many."""
    # Large matmuls: the GIL is released for most of the time, as in real GPU/CPU kernels.
    a, b, out = torch.randn(512, 512), torch.randn(512, 512), torch.empty(512, 512)
    count, deadline = 0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        torch.mm(a, b, out=out)
        count += 1
    return count


async def _measure_lag(stop: anyio.Event, lags: list[float]) -> None:
    """A 1 ms ticker: records how late each wake-up was (the event loop's lag)."""
    while not stop.is_set():
        started = time.perf_counter()
        await anyio.sleep(0.001)
        lags.append(time.perf_counter() - started - 0.001)


@pytest.mark.anyio
async def test_channel_delivers_in_order_and_closing_ends_the_receiver() -> None:
    send, receive = open_channel(4, "packs")
    async with send:
        for i in range(4):
            await send.send(i)
    async with receive:
        assert [item async for item in receive] == [0, 1, 2, 3]


@pytest.mark.anyio
async def test_channel_ends_only_when_every_sender_clone_is_closed() -> None:
    send, receive = open_channel(4, "packs")
    other = send.clone()
    send.close()
    await other.send("last")
    other.close()
    async with receive:
        assert [item async for item in receive] == ["last"]


@pytest.mark.anyio
async def test_full_channel_blocks_the_sender_until_an_item_is_received() -> None:
    send, receive = open_channel(1, "packs")
    sent: list[int] = []

    async def send_second() -> None:
        await send.send(2)
        sent.append(2)

    async with send, receive, anyio.create_task_group() as tg:
        await send.send(1)
        tg.start_soon(send_second)
        await wait_all_tasks_blocked()
        assert sent == []  # the channel holds one item: the second send waits
        assert await receive.receive() == 1
        await wait_all_tasks_blocked()
        assert sent == [2]
        assert await receive.receive() == 2


@pytest.mark.anyio
async def test_slot_ring_preallocates_fixed_layout_slots_and_reuses_their_memory() -> None:
    ring = _ring(2)
    pointers = {slot.batch.features.data_ptr() for slot in ring.slots}
    for slot in ring.slots:  # a fresh slot is all padding: no document, nothing supervised
        assert bool((slot.batch.doc_ids == -1).all()) and not bool(slot.batch.loss_mask.any())
        assert bool((slot.batch.features == 0).all())  # finite padding features
    for step in range(5):
        slot = await ring.acquire_free()
        assert slot.meta == {}  # the previous pack's facts never leak into the next one
        assert slot.batch.features.shape == (32, 6)
        assert slot.batch.features.dtype == torch.bfloat16
        assert slot.batch.features.data_ptr() in pointers  # a preallocated slot, not a new one
        _fill(slot.batch, step + 1)
        slot.meta["step"] = step
        ring.publish(slot)
        received = await ring.receive_full()
        assert received is slot and received.meta == {"step": step}
        assert bool((received.batch.features == step + 1).all())  # what the producer wrote
        ring.release(received)
    assert {slot.batch.features.data_ptr() for slot in ring.slots} == pointers
    assert not ring.pinned  # no CUDA here: plain host memory


@pytest.mark.anyio
async def test_full_ring_blocks_producers_while_the_loop_stays_responsive() -> None:
    ring, stop, lags = _ring(2), anyio.Event(), []
    acquired: list[Slot] = []

    async def produce_one() -> None:
        acquired.append(await ring.acquire_free())

    async with open_device_worker(CPU, "target0") as worker, anyio.create_task_group() as tg:
        for i in range(2):  # fill the ring: nobody consumes yet
            slot = await ring.acquire_free()
            await worker.run(_fill, slot.batch, i)
            ring.publish(slot)
        tg.start_soon(produce_one)
        await wait_all_tasks_blocked()
        tg.start_soon(_measure_lag, stop, lags)
        matmuls = await worker.run(_matmuls_for, 0.5)  # the worker computes; the loop ticks
        assert acquired == [] and ring.num_full == 2  # backpressure held
        slot = await ring.receive_full()
        assert int(slot.batch.input_ids[0]) == 0
        ring.release(slot)
        with anyio.fail_after(5):
            while not acquired:
                await anyio.sleep(0.001)
        stop.set()
    # 0.5 s of 1 ms ticks: ~400 when the loop is free; a blocked loop would tick once.
    assert matmuls > 0 and len(lags) > 20, (matmuls, len(lags))
    assert max(lags) < 0.050, f"loop lag {max(lags) * 1e3:.1f} ms over {len(lags)} ticks"


@pytest.mark.anyio
async def test_released_slot_is_reused_only_after_its_event_completes() -> None:
    ring, event = _ring(1), FakeEvent()
    acquired: list[Slot] = []

    async def produce_one() -> None:
        acquired.append(await ring.acquire_free())

    ring.publish(await ring.acquire_free())
    ring.release(await ring.receive_full(), event)
    async with anyio.create_task_group() as tg:
        tg.start_soon(produce_one)
        with anyio.fail_after(5):
            while event.queries < 3:  # the waiting producer polls the event
                await anyio.sleep(0.001)
        assert acquired == [] and ring.polling  # the slot waits for its event
        event.done = True
    assert len(acquired) == 1 and not ring.polling


@pytest.mark.anyio
async def test_closed_ring_drains_full_slots_then_ends_consumers_and_refuses_producers() -> None:
    ring = _ring(2)
    slot = await ring.acquire_free()
    slot.meta["real_tokens"] = 17
    ring.publish(slot)
    ring.close()
    received = [s async for s in ring]
    assert [s.meta for s in received] == [{"real_tokens": 17}]
    with pytest.raises(anyio.ClosedResourceError):
        await ring.acquire_free()


@pytest.mark.anyio
async def test_closing_the_ring_wakes_a_waiting_consumer_with_end_of_stream() -> None:
    ring, ended = _ring(1), []

    async def consume() -> None:
        async for _ in ring:
            pass
        ended.append(True)

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        await wait_all_tasks_blocked()
        ring.close()
    assert ended == [True]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.anyio
async def test_cpu_ring_uses_pinned_memory_when_cuda_is_available() -> None:
    ring = _ring(2)
    assert ring.pinned and all(slot.batch.features.is_pinned() for slot in ring.slots)
