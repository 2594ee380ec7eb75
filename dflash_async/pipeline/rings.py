"""The set of slot rings of one node, one per drafter, and the rule that keeps them balanced.

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
Event-loop objects, like SlotRing; ties go to the lowest ring index.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import anyio

from dflash_async.pipeline.channels import Completion, Slot, SlotRing, SlotRingStatistics


@dataclass
class RingSetStatistics:
    """Counters over every ring (summed) plus each ring's depth, for the `step` line."""

    depth: int
    published: int
    depths: list[int]
    spilled: int  # slots a producer filled in a ring other than its home ring
    stolen: int  # slots a drafter took from a ring other than its own
    acquire_wait_s: float
    receive_wait_s: float


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
        self._spilled = self._stolen = 0
        self._acquire_wait_s = self._receive_wait_s = 0.0

    def producer(self, home: int | None) -> RingProducer:
        """What a target stage fills: `acquire_free()` and `publish(slot, event)`."""
        if home is not None and not 0 <= home < len(self.rings):
            raise ValueError(f"home ring {home} is not one of {len(self.rings)} rings")
        return RingProducer(self, home)

    def ring_of(self, slot: Slot) -> int:
        return self._ring_of[slot]

    async def acquire_free(self, home: int | None) -> Slot:
        """A free slot: the home ring's, else the roomiest ring's. Waits while none is free;
        raises anyio.ClosedResourceError once closed."""
        started = time.perf_counter()
        try:
            while True:
                if any(r.closed for r in self.rings):
                    raise anyio.ClosedResourceError("slot rings are closed")
                chosen = self._roomiest(home)
                if chosen is not None:
                    self._spilled += chosen != home and home is not None
                    return self.rings[chosen].take_free_nowait()
                polling = any(r.polling for r in self.rings)  # released slots not yet reusable
                await self._changed.wait(self._poll_interval_s if polling else None)
        finally:
            self._acquire_wait_s += time.perf_counter() - started

    def publish(self, slot: Slot, event: Completion | None = None) -> None:
        self.rings[self._ring_of[slot]].publish(slot, event)

    async def receive_step(self) -> list[Slot]:
        """The M oldest full slots, the j-th oldest for drafter j. Waits while fewer than M
        are full; once closed with fewer left, raises anyio.EndOfStream."""
        started = time.perf_counter()
        try:
            while sum(r.num_full for r in self.rings) < len(self.rings):
                if any(r.closed for r in self.rings):
                    raise anyio.EndOfStream
                await self._changed.wait()
            return self._assign()
        finally:
            self._receive_wait_s += time.perf_counter() - started

    def release(self, slot: Slot, event: Completion | None = None) -> None:
        self.rings[self._ring_of[slot]].release(slot, event)

    def close(self) -> None:
        for ring in self.rings:
            ring.close()

    def statistics(self) -> RingSetStatistics:
        stats: list[SlotRingStatistics] = [r.statistics() for r in self.rings]
        return RingSetStatistics(
            depth=sum(s.depth for s in stats),
            published=sum(s.published for s in stats),
            depths=[s.depth for s in stats],
            spilled=self._spilled,
            stolen=self._stolen,
            acquire_wait_s=self._acquire_wait_s,
            receive_wait_s=self._receive_wait_s,
        )

    def _roomiest(self, home: int | None) -> int | None:
        free = [r.num_free for r in self.rings]
        if home is not None and free[home]:
            return home
        best = max(range(len(free)), key=lambda i: (free[i], -i))
        return best if free[best] else None

    def _assign(self) -> list[Slot]:
        taken = []
        for drafter in range(len(self.rings)):
            heads = [
                (r.oldest_full().published_ns, i) for i, r in enumerate(self.rings) if r.num_full
            ]
            _, ring = min(heads)  # each ring is FIFO: the oldest overall heads some ring
            self._stolen += ring != drafter
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
