"""Bounded async channels between stages: `open_channel` and its SendChannel/ReceiveChannel ends.

Event-loop objects (call them from tasks, not from worker threads), bounded: a producer that runs
ahead waits, which is the backpressure that keeps stages balanced. Closing is the end signal:
receivers drain what is left, then get `anyio.EndOfStream` (or their `async for` ends). The slot
ring of hidden-state packs is in rings.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Generic, TypeVar

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

T = TypeVar("T")


class SendChannel(Generic[T]):
    """The sending end: `await send(item)` waits while the channel is full. Close when done."""

    def __init__(self, stream: MemoryObjectSendStream[T]) -> None:
        self._stream = stream

    async def send(self, item: T) -> None:
        await self._stream.send(item)

    def clone(self) -> SendChannel[T]:
        """Another sending end; the channel ends when every sending end is closed."""
        return SendChannel(self._stream.clone())

    def close(self) -> None:
        self._stream.close()

    async def __aenter__(self) -> SendChannel[T]:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()


class ReceiveChannel(Generic[T]):
    """The receiving end: `await receive()` or `async for item in channel` until it is closed."""

    def __init__(self, stream: MemoryObjectReceiveStream[T]) -> None:
        self._stream = stream

    async def receive(self) -> T:
        """The next item; raises anyio.EndOfStream once every sender closed and it is drained."""
        return await self._stream.receive()

    def clone(self) -> ReceiveChannel[T]:
        return ReceiveChannel(self._stream.clone())

    def close(self) -> None:
        self._stream.close()

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
    return SendChannel(send), ReceiveChannel(receive)
