"""Bounded async channels between stages: `open_channel` and its SendChannel/ReceiveChannel ends.

Event-loop objects (call them from tasks, not from worker threads), bounded: a producer that runs
ahead waits, which is the backpressure that keeps stages balanced. Closing is the end signal:
receivers drain what is left, then get `anyio.EndOfStream` (or their `async for` ends). Every
channel counts depth, items, bytes and the seconds its senders and receivers spent waiting. The
slot ring of hidden-state packs is in rings.py.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

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
