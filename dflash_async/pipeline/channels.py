"""Bounded channels between stages, and the ring of preallocated hidden-state slots.

Both are event-loop objects (call them from tasks, not from worker threads) and both are bounded:
a producer that runs ahead waits, which is the backpressure that keeps target and drafter
workers balanced. Closing is the end signal: receivers drain what is left, then get
`anyio.EndOfStream` (or their `async for` ends). Every channel counts depth, items, bytes and the
seconds its senders and receivers spent waiting, for the `step` log line.
"""

from __future__ import annotations

import collections
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import anyio
import torch
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from dflash_async.data.packing import PackedBatch

T = TypeVar("T")


@dataclass
class ChannelStatistics:
    """Counters of one channel (shared by all clones of its two ends)."""

    name: str
    capacity: int
    depth: int = 0  # items buffered now
    sends: int = 0
    receives: int = 0
    bytes_sent: int = 0  # sum of items' `nbytes`, for items that have it
    send_wait_s: float = 0.0  # time senders spent in send (waiting for room)
    receive_wait_s: float = 0.0  # time receivers spent in receive (waiting for an item)


class SendChannel(Generic[T]):
    """The sending end: `await send(item)` waits while the channel is full. Close when done."""

    def __init__(self, stream: MemoryObjectSendStream[T], stats: ChannelStatistics) -> None:
        self._stream = stream
        self._stats = stats

    async def send(self, item: T) -> None:
        started = time.perf_counter()
        try:
            await self._stream.send(item)
        finally:
            self._stats.send_wait_s += time.perf_counter() - started
        self._stats.sends += 1
        self._stats.bytes_sent += _nbytes(item)

    def clone(self) -> SendChannel[T]:
        """Another sending end; the channel ends when every sending end is closed."""
        return SendChannel(self._stream.clone(), self._stats)

    def close(self) -> None:
        self._stream.close()

    def statistics(self) -> ChannelStatistics:
        self._stats.depth = self._stream.statistics().current_buffer_used
        return self._stats

    async def __aenter__(self) -> SendChannel[T]:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()


class ReceiveChannel(Generic[T]):
    """The receiving end: `await receive()` or `async for item in channel` until it is closed."""

    def __init__(self, stream: MemoryObjectReceiveStream[T], stats: ChannelStatistics) -> None:
        self._stream = stream
        self._stats = stats

    async def receive(self) -> T:
        """The next item; raises anyio.EndOfStream once every sender closed and it is drained."""
        started = time.perf_counter()
        try:
            item = await self._stream.receive()
        finally:
            self._stats.receive_wait_s += time.perf_counter() - started
        self._stats.receives += 1
        return item

    def clone(self) -> ReceiveChannel[T]:
        return ReceiveChannel(self._stream.clone(), self._stats)

    def close(self) -> None:
        self._stream.close()

    def statistics(self) -> ChannelStatistics:
        self._stats.depth = self._stream.statistics().current_buffer_used
        return self._stats

    def __aiter__(self) -> AsyncIterator[T]:
        return self

    async def __anext__(self) -> T:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    async def __aenter__(self) -> ReceiveChannel[T]:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()


def open_channel(max_buffer_size: int, name: str) -> tuple[SendChannel[Any], ReceiveChannel[Any]]:
    """A bounded channel of `max_buffer_size` items (>= 1; 0 would make every send a rendezvous)."""
    if max_buffer_size < 1:
        raise ValueError(f"channel {name}: max_buffer_size={max_buffer_size} must be at least 1")
    send, receive = anyio.create_memory_object_stream[Any](max_buffer_size)
    stats = ChannelStatistics(name=name, capacity=max_buffer_size)
    return SendChannel(send, stats), ReceiveChannel(receive, stats)


def _nbytes(item: object) -> int:
    nbytes = getattr(item, "nbytes", 0)
    return nbytes if isinstance(nbytes, int) else 0


# ---------------------------------------------------------------------------------------------
# The hidden-state slot ring.


class Completion(Protocol):
    """What `SlotRing.release` waits for: a torch.cuda.Event, or anything with `query()`."""

    def query(self) -> bool: ...


@dataclass(eq=False)
class Slot:
    """One preallocated PackedBatch. `meta` carries host-side facts about the pack (e.g. real
    token count, epoch) so that nobody has to read them back from the device."""

    index: int
    batch: PackedBatch
    meta: dict[str, Any] = field(default_factory=dict)
    ready: Completion | None = None  # the producer's "written" event, set by publish
    published_ns: int = 0  # when publish ran (perf_counter_ns): the publish order across rings


@dataclass
class SlotRingStatistics:
    name: str
    num_slots: int
    slot_bytes: int
    depth: int = 0  # full slots waiting for a consumer
    free: int = 0  # slots a producer can take now
    releasing: int = 0  # released slots whose completion event has not fired yet
    published: int = 0
    received: int = 0
    bytes_published: int = 0
    acquire_wait_s: float = 0.0  # producers waiting for a free slot: backpressure
    receive_wait_s: float = 0.0  # consumers waiting for a full slot: starvation


class SlotRing:
    """N preallocated slots cycling free -> filled (producer) -> full -> copied (consumer) -> free.

    Producers: `slot = await acquire_free()` (waits while every slot is taken: backpressure),
    fill `slot.batch` in their DeviceWorker, `publish(slot, event)`. Consumers:
    `slot = await receive_full()` (or `async for slot in ring`), wait on `slot.ready` and copy out
    in their DeviceWorker, then `release(slot, event)` where `event` completes when the copy has.

    A released slot with an event becomes free only once `event.query()` is true. The loop polls
    it (every `poll_interval_s`, only while a producer waits), never blocking: a worker thread
    waiting on the event would hold that thread for nothing. Slots live on `device`; for a cpu
    ring, in pinned host memory when CUDA is available (fast, async copies to any GPU), else in
    plain memory. Not thread-safe: call from the event loop only.
    """

    def __init__(
        self,
        num_slots: int,
        *,
        token_budget: int,
        feature_dim: int,
        device: torch.device,
        feature_dtype: torch.dtype = torch.bfloat16,
        pin_memory: bool | None = None,
        name: str = "slots",
        poll_interval_s: float = 0.0005,
        changed: Notifier | None = None,
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"slot ring {name}: num_slots={num_slots} must be at least 1")
        if pin_memory is None:
            pin_memory = device.type == "cpu" and torch.cuda.is_available()
        self.slots = tuple(
            Slot(i, PackedBatch.empty(token_budget, feature_dim, device=device,
                                      feature_dtype=feature_dtype, pin_memory=pin_memory))
            for i in range(num_slots)
        )  # fmt: skip
        self.device = device
        self.pinned = pin_memory
        self._poll_interval_s = poll_interval_s
        self._free = collections.deque(self.slots)
        self._full: collections.deque[Slot] = collections.deque()
        self._releasing: list[tuple[Slot, Completion]] = []
        self._closed = False
        self.changed = changed or Notifier()  # shared by the rings of one RingSet
        self._stats = SlotRingStatistics(name, num_slots, self.slots[0].batch.nbytes)

    async def acquire_free(self) -> Slot:
        """A free slot (its `meta` cleared). Waits while none is free; raises
        anyio.ClosedResourceError once the ring is closed."""
        started = time.perf_counter()
        try:
            while True:
                if self._closed:
                    raise anyio.ClosedResourceError(f"slot ring {self._stats.name} is closed")
                self._reclaim_completed()
                if self._free:
                    return self.take_free_nowait()
                await self._wait_for_change(poll=bool(self._releasing))
        finally:
            self._stats.acquire_wait_s += time.perf_counter() - started

    def publish(self, slot: Slot, event: Completion | None = None) -> None:
        """Hand a filled slot to the consumers. `event`: completes when the producer's writes
        have (a torch.cuda.Event recorded on the producer's stream); None when they are done."""
        if self._closed:
            raise anyio.ClosedResourceError(f"slot ring {self._stats.name} is closed")
        slot.ready, slot.published_ns = event, time.perf_counter_ns()
        self._full.append(slot)
        self._stats.published += 1
        self._stats.bytes_published += self._stats.slot_bytes
        self._notify()

    async def receive_full(self) -> Slot:
        """The oldest published slot. Waits while none is; once the ring is closed and drained,
        raises anyio.EndOfStream."""
        started = time.perf_counter()
        try:
            while not self._full:
                if self._closed:
                    raise anyio.EndOfStream
                await self._wait_for_change(poll=False)
            return self.take_full_nowait()
        finally:
            self._stats.receive_wait_s += time.perf_counter() - started

    def release(self, slot: Slot, event: Completion | None = None) -> None:
        """Give a consumed slot back. With `event`, the slot is reused only after it completes."""
        if event is None or event.query():
            self._free.append(slot)
            self._notify()
        else:
            self._releasing.append((slot, event))
            self._notify()  # a waiting producer starts polling the event

    def close(self) -> None:
        """The end signal (producers are done, or the pipeline is stopping): waiting producers
        get ClosedResourceError, consumers drain the full slots and then get EndOfStream."""
        self._closed = True
        self._notify()

    def statistics(self) -> SlotRingStatistics:
        self._reclaim_completed()
        self._stats.depth = len(self._full)
        self._stats.free = len(self._free)
        self._stats.releasing = len(self._releasing)
        return self._stats

    def __aiter__(self) -> AsyncIterator[Slot]:
        return self

    async def __anext__(self) -> Slot:
        try:
            return await self.receive_full()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    def _reclaim_completed(self) -> None:
        still: list[tuple[Slot, Completion]] = []
        for slot, event in self._releasing:
            # event.query() asks the driver whether the event fired; it never blocks the host.
            if event.query():
                self._free.append(slot)
            else:
                still.append((slot, event))
        self._releasing = still

    async def _wait_for_change(self, *, poll: bool) -> None:
        await self.changed.wait(self._poll_interval_s if poll else None)

    def _notify(self) -> None:
        self.changed.notify()

    # For RingSet (rings.py): the same state, read and taken without waiting.
    @property
    def num_full(self) -> int:
        return len(self._full)

    def oldest_full(self) -> Slot | None:
        """The slot `take_full_nowait()` would return (None when none is full)."""
        return self._full[0] if self._full else None

    @property
    def num_free(self) -> int:
        self._reclaim_completed()
        return len(self._free)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def polling(self) -> bool:
        """Released slots wait for their completion events: a waiting producer must poll."""
        return bool(self._releasing)

    def take_free_nowait(self) -> Slot:
        slot = self._free.popleft()
        slot.meta, slot.ready = {}, None
        return slot

    def take_full_nowait(self) -> Slot:
        self._stats.received += 1
        return self._full.popleft()


class Notifier:
    """Wakes every task waiting for a change of one or several rings; each re-checks its
    condition (few waiters: one per worker)."""

    def __init__(self) -> None:
        self._event = anyio.Event()

    async def wait(self, timeout_s: float | None = None) -> None:
        event = self._event
        if timeout_s is None:
            await event.wait()
        else:
            with anyio.move_on_after(timeout_s):
                await event.wait()

    def notify(self) -> None:
        self._event.set()
        self._event = anyio.Event()
