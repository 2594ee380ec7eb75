"""Save stage: training checkpoints (resumable) and the servable export, off the training thread.

OUTPUT_DIR/checkpoints/step-NNNNNNNN   the training state (checkpoint/state.py), newest K kept
OUTPUT_DIR/drafter                     the servable export of the newest checkpoint

A save blocks training only for the device-to-host copy (into page-locked buffers reused from
save to save), on drafter 0's thread between two steps; serialising, fsync and renames run in a
worker thread, at most one save in flight (the next save, and the end of the run, wait for it).
Nothing a previous run wrote is replaced unless this run resumes it (checkpoint/resume.py).
A write that finds the disk full ends the run with NoSpaceError (checkpoint/space.py, exit 2).
Several ranks: every rank calls `save` at the same steps; rank 0 writes the one checkpoint, the
others only hand it their own cursor and generators (checkpoint/ranks.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio

from dflash_async.checkpoint.export import export_bytes, export_drafter
from dflash_async.checkpoint.ranks import RankView, gather_parts, publish_part, rank_part
from dflash_async.checkpoint.resume import export_path
from dflash_async.checkpoint.space import NoSpaceError, free_bytes, is_no_space
from dflash_async.checkpoint.state import (
    HostStaging,
    checkpoint_dir,
    snapshot,
    state_bytes,
    write_checkpoint,
)
from dflash_async.data.packing import PackCursor
from dflash_async.stages.train import DrafterRunner


@dataclass(frozen=True)
class SaveSpec:
    """When and what the run saves (settings/sections.py: DFLASH_TRAIN__SAVE_EVERY, KEEP_CHECKPOINTS,
    RESUME)."""

    output_dir: Path
    every: int  # a checkpoint every N steps; 0: only at the end (and on a signal)
    keep: int  # newest training checkpoints kept
    resume: str  # auto | never | a checkpoint folder (checkpoint/resume.py)


class Saver:
    """Writes checkpoints from between steps; at most one in flight. Start writes in `tasks`
    (the run's task group: a failed write fails the run). `node`: this rank of several (None:
    one process); `timeout_s`: rank 0's longest wait for the other ranks' parts."""

    def __init__(
        self,
        runners: list[DrafterRunner],
        output_dir: Path,
        *,
        keep: int,
        seed: int,
        run: dict,
        tasks: anyio.abc.TaskGroup,
        log,
        node: RankView | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        self.runners, self.output_dir, self.keep = runners, output_dir, keep
        self.seed, self.run, self.tasks, self.log = seed, run, tasks, log
        self.node, self.timeout_s = node, timeout_s
        self.last_step: int | None = None  # the newest checkpoint's step (written or resumed)
        self.staging = HostStaging()  # reused by every snapshot: one save in flight at most
        self._idle = anyio.Event()
        self._idle.set()

    async def save(self, step: int, cursor: PackCursor) -> None:
        """Copy the state after `step` steps to the host (drafter 0's thread), then write it in
        the background. Waits first for the previous write."""
        if step == self.last_step:
            return  # that checkpoint exists already
        if self.node is not None and self.node.rank != 0:  # rank 0 writes; this rank's part
            await self._publish(step, cursor)
            return
        asked = time.perf_counter()
        await self.wait()  # saves closer together than a write takes wait here (logged)
        started = time.perf_counter()
        first = self.runners[0]
        state = await first.worker.run(
            snapshot,
            [r.step for r in self.runners],
            step=step,
            cursor=cursor,
            seed=self.seed,
            run=self.run,
            staging=self.staging,
        )
        self.last_step, self._idle = step, anyio.Event()
        copy_s, waited_s = time.perf_counter() - started, started - asked
        self.tasks.start_soon(self._write, state, copy_s, waited_s)

    async def _publish(self, step: int, cursor: PackCursor) -> None:
        """Another rank than 0: its cursor and generators of `step`, to rank 0 (the store)."""
        generators = [r.step.generator for r in self.runners]
        part = await self.runners[0].worker.run(rank_part, generators, cursor)  # after the step
        await anyio.to_thread.run_sync(publish_part, self.node, step, part)
        self.last_step = step

    async def wait(self) -> None:
        """Until the save in flight (if any) is on disk."""
        await self._idle.wait()

    async def close(self) -> None:
        """After the last save: wait for it, then release the page-locked staging buffers. (A
        run that fails leaves them locked until the process exits, which frees them.)"""
        await self.wait()
        self.staging.close()

    async def _write(self, state: dict, copy_s: float, waited_s: float) -> None:
        try:
            if self.node is not None:  # every rank's part; sync point: a host wait on the peers
                own = {"cursor": state["cursor"], "rng": state["rng"]}
                state["ranks"] = await anyio.to_thread.run_sync(
                    lambda: gather_parts(self.node, state["step"], own, timeout_s=self.timeout_s)
                )
            started = time.perf_counter()
            target, needed = checkpoint_dir(self.output_dir, state["step"]), state_bytes(state)
            with self._out_of_space(state["step"], target, needed=needed):
                folder, size = await anyio.to_thread.run_sync(
                    lambda: write_checkpoint(self.output_dir, state, keep=self.keep)
                )
            written = time.perf_counter()
            self.log.info(
                "checkpoint_written",
                step=state["step"],
                path=str(folder),
                bytes=size,
                copy_s=round(copy_s, 3),
                waited_s=round(waited_s, 3),
                write_s=round(written - started, 3),
            )
            config = self.runners[0].step.objective.drafter.config
            export = export_path(self.output_dir)
            with self._out_of_space(state["step"], export, needed=export_bytes(config)):
                await anyio.to_thread.run_sync(
                    lambda: export_drafter(state["drafter"], config, export)
                )
            self.log.info(
                "export_written",
                step=state["step"],
                path=str(export),
                write_s=round(time.perf_counter() - written, 3),
            )
        finally:
            self._idle.set()

    @contextmanager
    def _out_of_space(self, step: int, path: Path, *, needed: int) -> Iterator[None]:
        """A write that runs out of disk space (checkpoint/space.py) becomes NoSpaceError (the
        CLI's one line, exit 2) after a `checkpoint_failed` event; the write itself (atomic.py)
        has removed its partial copy, and the previous checkpoint and export are untouched.
        Any other failure propagates as it is (an internal error, exit 1)."""
        try:
            yield
        except (OSError, RuntimeError) as error:
            free = free_bytes(self.output_dir)  # after the partial copy was removed
            if not is_no_space(error, needed=needed, free=free):
                raise
            self.log.error(
                "checkpoint_failed",
                step=step,
                path=str(path),
                needed_bytes=needed,
                free_bytes=free,
                error=str(error),
            )
            raise NoSpaceError(path, needed=needed, free=free) from error
