"""Device workers: one long-lived OS thread per device worker, jobs awaited from the event loop.

Why a thread per worker and not `anyio.to_thread` / an executor pool: CUDA state that the step
depends on is per thread (current device, current stream, grad mode, autocast) and a CUDA graph
must be replayed from the thread that captured it. A pool gives no thread affinity; this does.

A job is a plain callable. `await worker.run(fn, *args)` queues it; the worker thread runs it
inside a copy of the caller's contextvars (so log context reaches the thread) and hands the
result or exception back to the awaiting task with `loop.call_soon_threadsafe`. The loop never
blocks on a job. Cancelling the awaiting task does not interrupt a running job (threads cannot be
interrupted): the job finishes in the thread and its result is dropped; a job still queued is
skipped. Closing refuses queued jobs (anyio.ClosedResourceError) and joins the thread after the
running job. Works on the asyncio backend of anyio (including uvloop), not on trio.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

import anyio
import torch

from dflash_async.errors import SettingsError

# One CUDA-graph capture at a time in the whole process (docs/GPU.md: concurrent captures fail):
# the drafter step and the graphed target forward both capture under it.
CAPTURE_LOCK = threading.Lock()

T = TypeVar("T")
P = ParamSpec("P")  # a job's parameters: a type checker matches `run`'s arguments to `fn`'s


def parse_device(value: str, *, setting: str = "device") -> torch.device:
    """`"cpu"`, `"3"`, `"cuda"`, `"cuda:3"` -> a torch.device that exists on this machine.

    Raises SettingsError naming `setting` and `value` for anything else, for a CUDA device when
    CUDA is not available, or for an index >= torch.cuda.device_count().
    """
    text = value.strip().lower()
    if text == "cpu":
        return torch.device("cpu")
    index = "0" if text == "cuda" else text.removeprefix("cuda:")
    if not index.isdigit():
        raise SettingsError(f"{setting}={value!r} is not a device: use a GPU index or cpu")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise SettingsError(f"{setting}={value!r}: CUDA is not available here; use cpu")
    if int(index) >= count:
        raise SettingsError(
            f"{setting}={value!r}: no such GPU; this machine has {count} (indices 0..{count - 1})"
        )
    return torch.device("cuda", int(index))


def parse_devices(values: Sequence[str], *, setting: str) -> tuple[torch.device, ...]:
    """parse_device for each item of a device list (e.g. Settings.pipeline.drafter_devices)."""
    return tuple(parse_device(value, setting=setting) for value in values)


@dataclass
class _Job:
    """One queued call. `fn is None` is the stop request; its future resolves when the thread ends."""

    fn: Callable[..., Any] | None
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    context: contextvars.Context
    loop: asyncio.AbstractEventLoop | None  # None: a stop request from the blocking close()
    future: asyncio.Future[Any] | None = field(repr=False)


class DeviceWorker:
    """A thread bound to `device` that runs submitted jobs one at a time, in submission order.

    Thread state set once at start: `torch.cuda.set_device(index)` and a dedicated non-default
    stream made current (cuda only), grad mode, and autocast when `autocast_dtype` is given.
    Use `open_device_worker` (starts it, surfaces start-up errors, always closes it).
    """

    def __init__(
        self,
        device: torch.device,
        *,
        name: str,
        grad_enabled: bool = True,
        autocast_dtype: torch.dtype | None = None,
    ) -> None:
        if device.type == "cuda" and device.index is None:
            raise ValueError(f"device {device} needs an index (set_device takes an index)")
        self.device = device
        self.name = name
        self._grad_enabled = grad_enabled
        self._autocast_dtype = autocast_dtype
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name=f"dflash-{name}", daemon=True)
        self._stream: torch.cuda.Stream | None = None
        self._start_error: BaseException | None = None
        self._closing = False
        self._busy_seconds = 0.0
        self._jobs_done = 0

    @property
    def busy_seconds(self) -> float:
        """Host seconds spent inside jobs so far (device time when a job ends with a sync)."""
        return self._busy_seconds

    @property
    def jobs_done(self) -> int:
        return self._jobs_done

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The worker's current CUDA stream (None on CPU, or before the thread started)."""
        return self._stream

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def start(self) -> None:
        """Start the thread. Start-up errors (e.g. a bad device) are raised by every later job."""
        self._thread.start()

    async def run(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Run `fn(*args, **kwargs)` on the worker thread; return its result or raise its error."""
        if self._closing:
            raise anyio.ClosedResourceError(f"device worker {self.name} is closed")
        if not self._thread.is_alive():
            raise RuntimeError(f"device worker {self.name} is not running (call start)")
        return await self._submit(fn, args, kwargs)

    async def aclose(self) -> None:
        """Refuse queued jobs (their awaiters get anyio.ClosedResourceError), let a running job
        finish, join the thread.

        Shielded from cancellation so that the thread is always joined before this returns.
        """
        if self._closing or not self._thread.is_alive():
            self._closing = True
            return
        self._closing = True
        with anyio.CancelScope(shield=True):
            await self._submit(None, (), {})
        self._thread.join()  # the thread has left its loop: returns at once

    def close(self, timeout: float | None = None) -> None:
        """Blocking variant of aclose for code outside the event loop; do not call from the loop."""
        self._closing = True
        if self._thread.is_alive():
            self._jobs.put(_Job(None, (), {}, contextvars.Context(), None, None))
            self._thread.join(timeout)

    def _submit(self, fn: Callable[..., Any] | None, args: tuple, kwargs: dict) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._jobs.put(_Job(fn, args, kwargs, contextvars.copy_context(), loop, future))
        return future

    def _main(self) -> None:
        with contextlib.ExitStack() as thread_state:
            try:
                self._enter_thread_state(thread_state)
            except BaseException as error:  # delivered to every job: nothing is lost
                self._start_error = error
            self._serve()

    def _enter_thread_state(self, stack: contextlib.ExitStack) -> None:
        """Per-thread torch state: current device and stream, grad mode, autocast."""
        torch.set_grad_enabled(self._grad_enabled)  # grad mode is thread-local
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device.index)
            self._stream = torch.cuda.Stream(device=self.device)
            stack.enter_context(torch.cuda.stream(self._stream))  # current stream is per thread
        if self._autocast_dtype is not None:
            stack.enter_context(torch.autocast(self.device.type, dtype=self._autocast_dtype))

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job.fn is None:  # stop: refuse what is left, then tell aclose we are done
                self._refuse_queued()
                _settle(job, None, None)
                return
            # Reading a future's state from this thread is a plain attribute read (GIL-safe).
            if job.future is not None and job.future.cancelled():
                continue  # its awaiter is gone: skip the work
            if self._closing:
                _settle(job, None, self._closed_error())
                continue
            self._execute(job)

    def _execute(self, job: _Job) -> None:
        assert job.fn is not None
        started = time.perf_counter()
        try:
            if self._start_error is not None:
                raise RuntimeError(
                    f"device worker {self.name} failed to start on {self.device}"
                ) from self._start_error
            result, error = job.context.run(job.fn, *job.args, **job.kwargs), None
        except BaseException as caught:  # delivered to the awaiting task, never swallowed
            result, error = None, caught
        finally:
            self._busy_seconds += time.perf_counter() - started
            self._jobs_done += 1
        _settle(job, result, error)

    def _refuse_queued(self) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            _settle(job, None, self._closed_error())

    def _closed_error(self) -> anyio.ClosedResourceError:
        return anyio.ClosedResourceError(f"device worker {self.name} closed before the job ran")


def _settle(job: _Job, result: Any, error: BaseException | None) -> None:
    """Hand a job's outcome to its loop (thread-safe); dropped if the loop or awaiter is gone."""
    if job.loop is None or job.future is None:  # stop request of close(): nobody awaits it
        return
    try:
        job.loop.call_soon_threadsafe(_resolve, job.future, result, error)
    except RuntimeError:
        if not job.loop.is_closed():
            raise
        # The loop has exited (its run ended while this job ran): nobody can await the result.


def _resolve(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    """Runs on the loop. A cancelled awaiter already marked the future done: drop the outcome."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


@contextlib.asynccontextmanager
async def open_device_worker(
    device: torch.device,
    name: str,
    *,
    grad_enabled: bool = True,
    autocast_dtype: torch.dtype | None = None,
) -> AsyncIterator[DeviceWorker]:
    """Start a DeviceWorker, wait until its thread state is set (raising its start-up error),
    yield it, and always close it: queued jobs skipped, the running one finished, thread joined."""
    worker = DeviceWorker(
        device, name=name, grad_enabled=grad_enabled, autocast_dtype=autocast_dtype
    )
    worker.start()
    try:
        await worker.run(_started)  # raises the start-up error, if any
        yield worker
    finally:
        await worker.aclose()


def _started() -> None:
    """An empty job: it runs only after the thread state is set."""
