"""The slot ring of preallocated hidden-state packs, and the set of them of one node (one per
drafter) with the rule that keeps them balanced.

SlotRing: N preallocated slots a target fills and a drafter copies out of, bounded (a producer
that runs ahead waits: the backpressure that keeps target and drafter workers balanced); closing
is the end signal. RingSet: one SlotRing per drafter, sharing one Notifier.

Co-located, ring i lives on GPU i with target i and drafter i: the target writes features into
the slot in place and the drafter reads them in place. Each ring holds `num_slots` packs, so a
target runs at most that many packs ahead of its drafter (the backpressure per device). Split,
each drafter's ring lives on its GPU and targets (no home ring) write into it over NVLink.

Balancing, so that no drafter waits on a dry ring while another ring has packs:
- a producer takes a free slot of its home ring first, else of the ring with the most free slots
  (its pack goes to the device whose ring has room; the features cross GPUs once);
- a step takes the M oldest published slots (M drafters), wherever they sit, the j-th oldest to
  drafter j. It waits only while fewer full slots than drafters exist.
Why oldest-first rather than each drafter's own ring first: which packs make a step, and which
drafter (with its own anchor generator) trains on which, then follow the publish order alone.
With one target that order is the plan's, so a run, and a resumed run, repeat bit for bit; with
own-ring-first it depended on thread timing (seen: a flaky equality test under load). The price
is locality: a drafter may read its pack from another GPU's ring (one peer copy, ~5 ms per 2 GB
over NVLink, docs/GPU.md). With several targets the publish order itself follows their timing.
Event-loop objects (call them from tasks, not from worker threads); ties go to the lowest ring
index.
"""

from __future__ import annotations

import collections
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
import torch

from dflash_async.data.packing import PackedBatch

# ---------------------------------------------------------------------------------------------
# One ring.


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
            Slot(
                i,
                PackedBatch.empty(
                    token_budget,
                    feature_dim,
                    device=device,
                    feature_dtype=feature_dtype,
                    pin_memory=pin_memory,
                ),
            )
            for i in range(num_slots)
        )
        self.device = device
        self.pinned = pin_memory
        self._poll_interval_s = poll_interval_s
        self._free = collections.deque(self.slots)
        self._full: collections.deque[Slot] = collections.deque()
        self._releasing: list[tuple[Slot, Completion]] = []
        self._closed = False
        self.changed = changed or Notifier()  # shared by the rings of one RingSet
        self.name = name
        self.published = 0  # slots published since the start (the step line's supply)

    async def acquire_free(self) -> Slot:
        """A free slot (its `meta` cleared). Waits while none is free; raises
        anyio.ClosedResourceError once the ring is closed."""
        while True:
            if self._closed:
                raise anyio.ClosedResourceError(f"slot ring {self.name} is closed")
            self._reclaim_completed()
            if self._free:
                return self.take_free_nowait()
            await self._wait_for_change(poll=bool(self._releasing))

    def publish(self, slot: Slot, event: Completion | None = None) -> None:
        """Hand a filled slot to the consumers. `event`: completes when the producer's writes
        have (a torch.cuda.Event recorded on the producer's stream); None when they are done."""
        if self._closed:
            raise anyio.ClosedResourceError(f"slot ring {self.name} is closed")
        slot.ready, slot.published_ns = event, time.perf_counter_ns()
        self._full.append(slot)
        self.published += 1
        self._notify()

    async def receive_full(self) -> Slot:
        """The oldest published slot. Waits while none is; once the ring is closed and drained,
        raises anyio.EndOfStream."""
        while not self._full:
            if self._closed:
                raise anyio.EndOfStream
            await self._wait_for_change(poll=False)
        return self.take_full_nowait()

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

    # For RingSet (below): the same state, read and taken without waiting.
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


# ---------------------------------------------------------------------------------------------
# The rings of one node.


@dataclass
class RingSetStatistics:
    """What the `step` line reads: full slots over every ring and per ring, slots published."""

    depth: int  # full slots waiting for a drafter, over every ring (slot_queue)
    published: int  # slots published since the start (supply_tokens_per_s)
    depths: list[int]  # full slots per ring (slot_queues)


class RingSet:
    """N rings sharing one change notifier; ring i belongs to drafter i."""

    def __init__(self, rings: Sequence[SlotRing], *, poll_interval_s: float = 0.0005) -> None:
        if not rings:
            raise ValueError("a ring set needs at least one ring")
        notifiers = {id(r.changed) for r in rings}
        if len(notifiers) != 1:
            raise ValueError("the rings of a set must share one Notifier (SlotRing changed=...)")
        self.rings = tuple(rings)
        self._changed = rings[0].changed
        self._ring_of = {slot: i for i, r in enumerate(rings) for slot in r.slots}
        self._poll_interval_s = poll_interval_s

    def producer(self, home: int | None) -> RingProducer:
        """What a target stage fills: `acquire_free()` and `publish(slot, event)`."""
        if home is not None and not 0 <= home < len(self.rings):
            raise ValueError(f"home ring {home} is not one of {len(self.rings)} rings")
        return RingProducer(self, home)

    async def acquire_free(self, home: int | None) -> Slot:
        """A free slot: the home ring's, else the roomiest ring's. Waits while none is free;
        raises anyio.ClosedResourceError once closed."""
        while True:
            if any(r.closed for r in self.rings):
                raise anyio.ClosedResourceError("slot rings are closed")
            chosen = self._roomiest(home)
            if chosen is not None:
                return self.rings[chosen].take_free_nowait()
            polling = any(r.polling for r in self.rings)  # released slots not yet reusable
            await self._changed.wait(self._poll_interval_s if polling else None)

    def publish(self, slot: Slot, event: Completion | None = None) -> None:
        self.rings[self._ring_of[slot]].publish(slot, event)

    async def receive_step(self) -> list[Slot]:
        """The M oldest full slots, the j-th oldest for drafter j. Waits while fewer than M
        are full; once closed with fewer left, raises anyio.EndOfStream."""
        while sum(r.num_full for r in self.rings) < len(self.rings):
            if any(r.closed for r in self.rings):
                raise anyio.EndOfStream
            await self._changed.wait()
        return self._assign()

    def release(self, slot: Slot, event: Completion | None = None) -> None:
        self.rings[self._ring_of[slot]].release(slot, event)

    def close(self) -> None:
        for ring in self.rings:
            ring.close()

    def statistics(self) -> RingSetStatistics:
        depths = [r.num_full for r in self.rings]
        published = sum(r.published for r in self.rings)
        return RingSetStatistics(depth=sum(depths), published=published, depths=depths)

    def _roomiest(self, home: int | None) -> int | None:
        free = [r.num_free for r in self.rings]
        if home is not None and free[home]:
            return home
        best = max(range(len(free)), key=lambda i: (free[i], -i))
        return best if free[best] else None

    def _assign(self) -> list[Slot]:
        taken = []
        for _drafter in range(len(self.rings)):  # the j-th oldest for drafter j
            heads = [
                (r.oldest_full().published_ns, i) for i, r in enumerate(self.rings) if r.num_full
            ]
            _, ring = min(heads)  # each ring is FIFO: the oldest overall heads some ring
            taken.append(self.rings[ring].take_full_nowait())
        return taken


class RingProducer:
    """A target's view of the ring set: the SlotRing producer API with a home ring."""

    def __init__(self, rings: RingSet, home: int | None) -> None:
        self._rings = rings
        self.home = home

    async def acquire_free(self) -> Slot:
        return await self._rings.acquire_free(self.home)

    def publish(self, slot: Slot, event: Completion | None = None) -> None:
        self._rings.publish(slot, event)
