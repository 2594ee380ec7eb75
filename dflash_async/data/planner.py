"""Epoch plans made in a separate process, handed over as memory-mapped files.

`plan_epoch` at 5 M samples is seconds of numpy and Python (a sort, then one split per pack). In a
thread of the training process it holds the GIL in stretches long enough to delay the event loop
by tens of milliseconds; in a spawned process it delays nothing. The lengths go to the process
once, as a file it memory-maps; each plan comes back as one file of int64 (`[n]` sample indices
in plan order, then `[packs + 1]` pack bounds) that this process memory-maps: no pickling of
millions of indices, and a pack is a slice `order[bounds[i]:bounds[i+1]]` taken when it is sent.
Small data sets (below PROCESS_MIN_SAMPLES) are planned in the calling thread, which is as fast.
"""

from __future__ import annotations

import multiprocessing
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

PROCESS_MIN_SAMPLES = 50_000  # below this an epoch plans in ~20 ms: not worth a process


class EpochPlan:
    """One epoch's packs: pack i is order[bounds[i]:bounds[i+1]] (sample indices)."""

    def __init__(self, order: np.ndarray, bounds: np.ndarray) -> None:
        self.order = order  # [n] int64: this rank's samples in plan order
        self.bounds = bounds  # [packs + 1] int64

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.order[self.bounds[i] : self.bounds[i + 1]]


def flatten_plan(packs: list[np.ndarray]) -> EpochPlan:
    bounds = np.zeros(len(packs) + 1, dtype=np.int64)
    np.cumsum([len(p) for p in packs], out=bounds[1:])
    order = np.concatenate(packs) if packs else np.zeros(0, np.int64)
    return EpochPlan(order.astype(np.int64, copy=False), bounds)


def _plan_to_file(lengths_path: str, out_path: str, args: tuple, kwargs: dict) -> int:
    """In the planner process: plan one epoch, write order then bounds to `out_path`."""
    from dflash_async.data.packing import plan_epoch

    lengths = np.load(lengths_path, mmap_mode="r")
    plan = flatten_plan(plan_epoch(np.asarray(lengths), *args, **kwargs))
    np.save(out_path, np.concatenate([plan.order, plan.bounds]))
    return len(plan.order)  # this rank's samples: all of them only with one rank


class EpochPlanner:
    """`plan(epoch)` -> EpochPlan of `plan_epoch(lengths, token_budget, seed, epoch, **kwargs)`.

    Blocking: call it from a worker thread. Close it (or use `with`) to stop the process.
    """

    def __init__(
        self,
        lengths: np.ndarray,
        *,
        token_budget: int,
        seed: int,
        in_process: bool | None = None,
        plan_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.lengths = lengths
        self.token_budget, self.seed = token_budget, seed
        self.plan_kwargs = plan_kwargs or {}
        use_process = len(lengths) >= PROCESS_MIN_SAMPLES if in_process is None else in_process
        self._folder = tempfile.TemporaryDirectory(prefix="dflash-plans-")
        self._pool = None
        if use_process:
            np.save(Path(self._folder.name) / "lengths.npy", np.asarray(lengths))
            # spawn, not fork: this process runs an event loop and device threads
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))

    def plan(self, epoch: int) -> EpochPlan:
        if self._pool is None:
            from dflash_async.data.packing import plan_epoch

            args = (self.token_budget, self.seed, epoch)
            return flatten_plan(plan_epoch(self.lengths, *args, **self.plan_kwargs))
        folder = Path(self._folder.name)
        out = folder / f"plan-{epoch}.npy"
        job = (str(folder / "lengths.npy"), str(out), (self.token_budget, self.seed, epoch))
        planned = self._pool.submit(_plan_to_file, *job, self.plan_kwargs).result()
        flat = np.load(out, mmap_mode="r")  # [planned samples + packs + 1]
        out.unlink()  # the mapping stays valid; the file goes once it is unmapped
        return EpochPlan(flat[:planned], flat[planned:])

    def close(self) -> None:
        if self._pool is not None:  # a plan still running finishes in the background
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._folder.cleanup()

    def __enter__(self) -> EpochPlanner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
