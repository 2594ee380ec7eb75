"""Meters of the running pipeline: rate windows, device-busy time per worker, event-loop lag."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import anyio
import torch


@dataclass
class RateWindow:
    """Sliding-window rate of a counter (tokens/s, steps/s) over the last `seconds`."""

    seconds: float = 30.0

    def __post_init__(self) -> None:
        self._events: deque[tuple[float, float]] = deque()

    def add(self, amount: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._events.append((now, amount))
        while self._events and now - self._events[0][0] > self.seconds:
            self._events.popleft()

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        if len(self._events) < 2:
            return 0.0
        span = now - self._events[0][0]
        return sum(a for _, a in list(self._events)[1:]) / max(span, 1e-9)


def timing_event(device) -> torch.cuda.Event | None:
    """A CUDA event recorded now on the calling thread's stream, able to time (None on CPU,
    where jobs run synchronously). Recording never blocks the host."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class BusyMeter:
    """Device-busy seconds of one worker, from (start, end) CUDA event pairs of its jobs.

    `collect()` adds the pairs whose end event completed (event.query(): no host sync) and
    returns the running total. CPU workers report their host job time (DeviceWorker.busy_seconds).
    """

    def __init__(self) -> None:
        self._pending: deque = deque()
        self._seconds = 0.0
        # (start, end) pairs collected since a reader (report.GpuBusy) took them; bounded when
        # nobody reads them
        self.completed: deque = deque(maxlen=4096)

    def add(self, start, end) -> None:
        self._pending.append((start, end))

    def collect(self) -> float:
        while self._pending and self._pending[0][1].query():
            start, end = self._pending.popleft()
            self._seconds += start.elapsed_time(end) / 1e3
            self.completed.append((start, end))
        return self._seconds


class LoopLag:
    """Measures how late the event loop wakes a 1 ms sleeper: its responsiveness."""

    def __init__(self) -> None:
        self._max_s = 0.0

    async def run(self) -> None:
        while True:
            start = time.perf_counter()
            await anyio.sleep(0.001)
            self._max_s = max(self._max_s, time.perf_counter() - start - 0.001)

    def read_max_ms(self) -> float:
        value, self._max_s = self._max_s * 1e3, 0.0
        return value
