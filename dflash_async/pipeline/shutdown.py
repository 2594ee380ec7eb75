"""Safe stops on SIGINT/SIGTERM, from the first line of `run` to its last.

First signal: `requested` is set and the run stops at its next safe point. Between steps that is
the step boundary (the training loop checks `stopping`); start-up (loading, compile, capture)
and evaluations are abandoned at once, inside `interruptible()` scopes: their thread finishes its
job on its own, nobody waits for it. The run then saves what exists (nothing when no step ran),
logs `train_interrupted` and ends through `finish`: exit 130 (SIGINT) or 143 (SIGTERM).

Several nodes: the ranks vote on the stop with its signal inside the step's all-reduce
(reducer.NodeReducer), and each rank then `adopt`s the agreed signal: every rank stops after
the same step and ends as the signalled one does (rank 0 saves).

Second SIGINT: exit 130 at once. Every write is atomic (atomic.py), so the previous checkpoint is
intact. A second SIGTERM is ignored (the stop is already under way).

Exits after a signal use os._exit, after `before_exit` (the CLI closes the run record there: its
`run_summary` line) and flushing stdout/stderr and the log handlers: a normal
interpreter exit would join worker threads still inside a compile or a decode (minutes), and
exiting while a thread is in torch's C++ code can abort the process (exit 134).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress

import anyio

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


class Shutdown:
    """The stop request of one run. `hard_exit=False` (tests, embedding): `finish` returns the
    code instead of ending the process."""

    def __init__(self, *, hard_exit: bool = True) -> None:
        self.hard_exit = hard_exit
        self.before_exit: Callable[[int], None] | None = None  # e.g. close the run record
        self.signum: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: anyio.Event | None = None
        self._scopes: set[anyio.CancelScope] = set()

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.signum, 130) if self.signum is not None else 0

    @property
    def reason(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    @contextmanager
    def installed(self) -> Iterator[Shutdown]:
        """Handle SIGINT and SIGTERM (main thread only) until the block ends; the previous
        handlers come back afterwards. Outside the main thread nothing is installed."""
        if sys.platform == "win32" or not _in_main_thread():
            yield self
            return
        previous = {s: signal.signal(s, self._handle) for s in EXIT_CODES}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _handle(self, signum: int, frame: object) -> None:
        self.request(signum)

    def request(self, signum: int) -> None:
        """A stop request (what the signal handler calls; tests call it directly)."""
        if self.signum is None:
            self.signum = signum
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._on_loop)  # safe from a signal handler
        elif signum == signal.SIGINT:
            _write_stderr("second SIGINT: exiting at once (the last checkpoint is intact)\n")
            _exit_now(130)

    def adopt(self, signum: int) -> None:
        """The stop that the nodes agreed on (reducer.NodeReducer): from now on this rank
        ends as if it had got `signum` itself (train_interrupted, 130/143), whichever rank did,
        so that every rank reports and exits alike. The agreed signal replaces a different one
        of this rank's own. Call on the event loop."""
        first = self.signum is None
        self.signum = signum
        if first and self._stopping is not None:
            self._on_loop()

    async def attach(self) -> None:
        """Bind to the running event loop (call first in `run`); a signal that came before
        is delivered now."""
        self._loop = asyncio.get_running_loop()
        self._stopping = anyio.Event()
        if self.requested:
            self._on_loop()

    @property
    def stopping(self) -> anyio.Event:
        assert self._stopping is not None, "call attach() first"
        return self._stopping

    def _on_loop(self) -> None:
        assert self._stopping is not None
        self._stopping.set()
        for scope in self._scopes:
            scope.cancel()

    @contextmanager
    def interruptible(self) -> Iterator[anyio.CancelScope]:
        """A block that the first signal abandons at once (its awaited thread jobs are left to
        finish on their own); code after the block checks `requested`."""
        with anyio.CancelScope() as scope:
            if self.requested:
                scope.cancel()
            self._scopes.add(scope)
            try:
                yield scope
            finally:
                self._scopes.discard(scope)

    def finish(self, code: int) -> int:
        """End the process with `code` after a signal (see the module doc), after `before_exit`;
        or return it (hard_exit False, or no signal)."""
        if self.hard_exit and self.requested:
            try:
                if self.before_exit is not None:
                    self.before_exit(code)
            finally:
                _exit_now(code)
        return code


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _write_stderr(text: str) -> None:
    with suppress(OSError):
        os.write(2, text.encode())


def _exit_now(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        with suppress(OSError, RuntimeError, ValueError):  # RuntimeError: a reentrant flush
            stream.flush()
    with suppress(OSError, RuntimeError, ValueError):
        logging.shutdown()
    os._exit(code)
