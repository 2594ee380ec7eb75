"""Save stage: training checkpoints (resumable) and the servable export, off the training thread.

OUTPUT_DIR/checkpoints/step-NNNNNNNN   the training state (checkpoint/state.py), newest K kept
OUTPUT_DIR/drafter                     the servable export of the newest checkpoint

A save blocks training only for the device-to-host copy (into page-locked buffers reused from
save to save), on drafter 0's thread between two steps; serialising, fsync and renames run in a
worker thread, at most one save in flight (the next save, and the end of the run, wait for it).
Nothing a previous run wrote is replaced unless this run resumes it (`resume_source`).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import anyio

from dflash_async.atomic import stale_siblings
from dflash_async.checkpoint.export import export_drafter
from dflash_async.checkpoint.state import (
    CHECKPOINTS,
    STATE_NAME,
    HostStaging,
    list_checkpoints,
    snapshot,
    write_checkpoint,
)
from dflash_async.data.packing import PackCursor
from dflash_async.settings import SettingsError
from dflash_async.stages.train import DrafterRunner


def export_path(output_dir: Path) -> Path:
    return output_dir / "drafter"


def resume_source(mode: str, output_dir: Path) -> Path | None:
    """The checkpoint to resume from for DFLASH_TRAIN__RESUME=`mode`, or None to start afresh.

    auto: the newest checkpoint in `output_dir`. never: none, and an `output_dir` holding a
    previous run is refused (it would be overwritten). A path: that checkpoint folder; refused
    when `output_dir` holds another run's checkpoints. SettingsError (exit 2) for each refusal.
    """
    existing = list_checkpoints(output_dir)
    previous = bool(existing) or export_path(output_dir).exists()
    if mode != "never" or not previous:  # this run owns the folder: a killed writer's leftovers go
        _remove_leftovers(output_dir)
    if mode == "never":
        if previous:
            raise SettingsError(
                f"DFLASH_TRAIN__RESUME=never: {output_dir} holds a previous run, which this run "
                "would overwrite; choose another DFLASH_OUTPUT_DIR or resume it (auto)"
            )
        return None
    if mode == "auto":
        if existing:
            return existing[-1][1]
        if previous:
            raise SettingsError(
                f"DFLASH_OUTPUT_DIR={output_dir} holds a drafter export but no training "
                "checkpoint to resume; choose another DFLASH_OUTPUT_DIR"
            )
        return None
    path = Path(mode)
    if not (path / STATE_NAME).is_file():
        raise SettingsError(f"DFLASH_TRAIN__RESUME={mode}: no {STATE_NAME} in that folder")
    if existing and path.resolve().parent != existing[0][1].resolve().parent:
        raise SettingsError(
            f"DFLASH_TRAIN__RESUME={mode}: {output_dir} holds another run's checkpoints; "
            "choose another DFLASH_OUTPUT_DIR"
        )
    return path


def _remove_leftovers(output_dir: Path) -> None:
    """Temporaries of a checkpoint or export write that was killed (never a complete copy)."""
    root = output_dir / CHECKPOINTS
    hidden = [p for p in root.iterdir() if p.name.startswith(".step-")] if root.is_dir() else []
    for path in [*hidden, *stale_siblings(export_path(output_dir))]:
        shutil.rmtree(path, ignore_errors=True)


class Saver:
    """Writes checkpoints from between steps; at most one in flight. Start writes in `tasks`
    (the run's task group: a failed write fails the run)."""

    def __init__(
        self, runners: list[DrafterRunner], output_dir: Path, *, keep: int, seed: int,
        run: dict, tasks: anyio.abc.TaskGroup, log,
    ) -> None:  # fmt: skip
        self.runners, self.output_dir, self.keep = runners, output_dir, keep
        self.seed, self.run, self.tasks, self.log = seed, run, tasks, log
        self.last_step: int | None = None  # the newest checkpoint's step (written or resumed)
        self.staging = HostStaging()  # reused by every snapshot: one save in flight at most
        self._idle = anyio.Event()
        self._idle.set()

    async def save(self, step: int, cursor: PackCursor) -> None:
        """Copy the state after `step` steps to the host (drafter 0's thread), then write it in
        the background. Waits first for the previous write."""
        if step == self.last_step:
            return  # that checkpoint exists already
        asked = time.perf_counter()
        await self.wait()  # saves closer together than a write takes wait here (logged)
        started = time.perf_counter()
        first = self.runners[0]
        state = await first.worker.run(
            snapshot, [r.step for r in self.runners], step=step, cursor=cursor, seed=self.seed,
            run=self.run, staging=self.staging,
        )  # fmt: skip
        self.last_step, self._idle = step, anyio.Event()
        copy_s, waited_s = time.perf_counter() - started, started - asked
        self.tasks.start_soon(self._write, state, copy_s, waited_s)

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
            started = time.perf_counter()
            folder, size = await anyio.to_thread.run_sync(
                lambda: write_checkpoint(self.output_dir, state, keep=self.keep)
            )
            written = time.perf_counter()
            self.log.info("checkpoint_written", step=state["step"], path=str(folder),
                          bytes=size, copy_s=round(copy_s, 3), waited_s=round(waited_s, 3),
                          write_s=round(written - started, 3))  # fmt: skip
            config = self.runners[0].step.objective.drafter.config
            export = export_path(self.output_dir)
            await anyio.to_thread.run_sync(lambda: export_drafter(state["drafter"], config, export))
            self.log.info("export_written", step=state["step"], path=str(export),
                          write_s=round(time.perf_counter() - written, 3))  # fmt: skip
        finally:
            self._idle.set()
