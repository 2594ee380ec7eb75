"""Train stage: M drafter workers take one slot each per optimizer step (data parallel).

Per step: every drafter copies its slot into its static inputs and runs phase A (forward +
backward of sum(w*CE)); the gradient buffers and step sums are summed across drafters; every
drafter runs phase B (divide by the global weight sum, clip, AdamW). See step.py for why this
equals one drafter seeing all M packs, and keeps the M copies identical.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import anyio
import torch

from dflash_async.data.packing import PackCursor
from dflash_async.model.optim import all_reduce_sum
from dflash_async.model.step import NUM_STATS, DrafterStep
from dflash_async.pipeline.channels import SendChannel, SlotRing
from dflash_async.pipeline.devices import DeviceWorker
from dflash_async.pipeline.meters import BusyMeter, timing_event

# Host copy of one step's report vector: STATS, then lr (of this step), then grad_norm.
REPORT_FIELDS = NUM_STATS + 2


@dataclass
class DrafterRunner:
    """One drafter: its worker thread and its step."""

    worker: DeviceWorker
    step: DrafterStep
    meter: BusyMeter = field(default_factory=BusyMeter)  # device time of the steps
    _started: Any = None

    def load_and_forward(self, slot_batch, ready) -> Any:
        """Phase A on a slot; returns the event after which the slot may be overwritten."""
        if isinstance(ready, torch.cuda.Event):
            torch.cuda.current_stream().wait_event(ready)  # GPU-side wait, no host sync
        self._started = timing_event(self.step.device)
        self.step.batch.copy_(slot_batch)
        copied = timing_event(self.step.device)
        self.step.phase_a()
        return copied

    def update(self) -> tuple[torch.Tensor, Any]:
        """Phase B. Returns a fresh host report vector [REPORT_FIELDS] and the event after which
        it holds the values (copied asynchronously: no host sync in the step)."""
        lr = self.step.schedule.lr.clone()  # the rate this step uses (phase B advances it)
        self.step.phase_b()
        values = torch.cat([self.step.stats, lr.view(1), self.step.grad_norm.view(1)])
        report = torch.empty(REPORT_FIELDS, pin_memory=self.step.device.type == "cuda")
        report.copy_(values, non_blocking=True)
        done = timing_event(self.step.device)
        if done is not None:
            self.meter.add(self._started, done)
        return report, done


def reduce_across(runners: list[DrafterRunner]) -> None:
    """Sum grads and step sums over drafters, in place on each (no-op for one drafter).

    Sync points (M > 1 GPUs only): each device finishes phase A before the single-process NCCL
    all-reduce, and the all-reduce finishes before phase B. Events between the drafter streams
    would remove both; with one drafter there is nothing to do.
    """
    if len(runners) == 1:
        return
    cuda = runners[0].step.device.type == "cuda"
    if cuda:
        for r in runners:
            torch.cuda.synchronize(r.step.device)
    all_reduce_sum([r.step.flat_grad for r in runners])
    all_reduce_sum([r.step.stats for r in runners])
    if cuda:
        for r in runners:
            torch.cuda.synchronize(r.step.device)


@dataclass
class StepRecord:
    """What the report stage needs about one finished optimizer step."""

    step: int
    report: torch.Tensor  # host vector, valid once `ready` completed
    ready: Any  # torch.cuda.Event or None
    slots_meta: list[dict]
    finished_at: float


@dataclass
class Progress:
    """The data cursor of the training loop: the next pack after the last one trained on.

    With one target worker packs reach the drafters in plan order, so resuming from `cursor`
    replays exactly the packs an uninterrupted run would have trained on next. With several
    target workers packs can overtake each other (by at most the ring's slots); the cursor is
    then the furthest pack trained on, and resuming skips the few overtaken ones.
    """

    cursor: PackCursor = field(default_factory=PackCursor)

    def consumed(self, metas: list[dict]) -> None:
        cursors = [m["cursor"] for m in metas if "cursor" in m]
        if cursors:
            self.cursor = max(self.cursor, max(cursors).next())


async def _each(runners: list[DrafterRunner], fn_name: str, *args_per_runner) -> list[Any]:
    """Run one method on every drafter's worker concurrently; results in drafter order."""
    results: list[Any] = [None] * len(runners)

    async def one(i: int) -> None:
        results[i] = await runners[i].worker.run(
            getattr(runners[i], fn_name), *(a[i] for a in args_per_runner)
        )

    async with anyio.create_task_group() as tg:
        for i in range(len(runners)):
            tg.start_soon(one, i)
    return results


async def train_steps(
    runners: list[DrafterRunner],
    ring: SlotRing,
    reports: SendChannel[StepRecord],
    *,
    first_step: int,
    last_step: int,
    stop: anyio.Event,
    on_step_end=None,
    progress: Progress | None = None,
) -> int:
    """Optimizer steps first_step..last_step-1; returns the next step index.

    Ends early when the ring is drained (the data is exhausted) or `stop` is set (a signal).
    `on_step_end(step)` (async) runs between steps: periodic checkpoints; `progress.cursor`
    is then the data cursor after that step.
    """
    step = first_step
    try:
        while step < last_step and not stop.is_set():
            try:
                slots = [await ring.receive_full() for _ in runners]
            except anyio.EndOfStream:
                break
            meta = [dict(s.meta) for s in slots]  # read before release: a producer reuses slots
            batches = [s.batch for s in slots]
            copied = await _each(runners, "load_and_forward", batches, [s.ready for s in slots])
            for slot, event in zip(slots, copied, strict=True):
                ring.release(slot, event)
            await runners[0].worker.run(reduce_across, runners)
            done = await _each(runners, "update")
            report, ready = done[0]  # drafters are identical: drafter 0 reports the step
            await reports.send(StepRecord(step, report, ready, meta, anyio.current_time()))
            step += 1
            if progress is not None:
                progress.consumed(meta)
            if on_step_end is not None:
                await on_step_end(step)
    finally:
        reports.close()
    return step
