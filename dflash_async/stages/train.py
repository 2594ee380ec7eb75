"""Train stage: M drafter workers take one slot each per optimizer step (data parallel).

Per step: every drafter copies its slot into its static inputs and runs phase A (forward +
backward of sum(w*CE)); the gradient buffers and step sums are summed across drafters on the
devices (`combine_gradients`, ordered by CUDA events: no host sync); every drafter runs phase B
(divide by the global weight sum, clip, AdamW). See step.py for why this equals one drafter
seeing all M packs, and keeps the M copies identical.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch

from dflash_async.data.packing import PackCursor
from dflash_async.model.build import StepSpec, build_drafter_step
from dflash_async.model.drafter_config import DrafterConfig
from dflash_async.model.kinds import kind_of
from dflash_async.model.optim import all_reduce_sum
from dflash_async.model.step import NUM_STATS, DrafterStep
from dflash_async.runtime.channels import SendChannel
from dflash_async.runtime.devices import DeviceWorker
from dflash_async.runtime.meters import BusyMeter, timing_event
from dflash_async.runtime.rings import RingSet
from dflash_async.targets.embeddings import load_final_norm, load_frozen_embeddings
from dflash_async.targets.random_weights import random_embeddings, random_final_norm

# Host copy of one step's report vector: STATS, then lr (of this step), then grad_norm.
REPORT_FIELDS = NUM_STATS + 2


@dataclass
class DrafterRunner:
    """One drafter: its worker thread and its step."""

    worker: DeviceWorker
    step: DrafterStep
    meter: BusyMeter = field(default_factory=BusyMeter)  # device time of the steps
    seed: int | None = None  # the run's seed: anchors seeded per pack (None: the step's stream)
    node: tuple[int, int] = (0, 1)  # (rank, world size): which share of each plan this node has
    _started: Any = None

    def load_and_forward(
        self, slot_batch, ready, cursor: PackCursor | None = None
    ) -> tuple[Any, Any]:
        """Phase A on a slot (on this or another device: a peer copy), its anchors seeded by
        the pack's `cursor`. Returns the event after which the slot may be overwritten and the
        event after which phase A is done."""
        _wait(ready)
        if self.seed is not None and cursor is not None:
            rank, world_size = self.node
            self.step.seed_anchors(cursor.anchor_seed(self.seed, rank=rank, world_size=world_size))
        self._started = timing_event(self.step.device)
        self.step.batch.copy_(slot_batch)
        copied = timing_event(self.step.device)
        self.step.phase_a()
        return copied, _record(self.step.device)

    def update(self, combined: Any = None) -> tuple[torch.Tensor, Any]:
        """Phase B, after `combined` (the gradient combine's event). Returns a fresh host report
        vector [REPORT_FIELDS] and the event after which it holds the values (copied
        asynchronously: no host sync in the step)."""
        _wait(combined)
        lr = self.step.schedule.lr.clone()  # the rate this step uses (phase B advances it)
        self.step.phase_b()
        values = torch.cat([self.step.stats, lr.view(1), self.step.grad_norm.view(1)])
        report = torch.empty(REPORT_FIELDS, pin_memory=self.step.device.type == "cuda")
        report.copy_(values, non_blocking=True)
        done = timing_event(self.step.device)
        if done is not None:
            self.meter.add(self._started, done)
        return report, done


def drafter_step_on(
    device: torch.device,
    spec: StepSpec,
    config: DrafterConfig,
    *,
    target_path: str,
    rank: int,
    total_steps: int,
    random_seed: int | None = None,
) -> DrafterStep:
    """A drafter's step on `device` around the target's frozen embedding and lm_head, read from
    its files in the compute dtype (bf16 on a GPU), or redrawn exactly as a random target drew
    them (`random_seed`: targets/random_weights.py). Run in the device's worker."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    norm = None
    if random_seed is None:
        embed, lm_head = load_frozen_embeddings(target_path, device=device, dtype=dtype)
        if kind_of(config.kind).captures_final_hidden:
            norm = load_final_norm(target_path, device=device, dtype=dtype)
    else:
        embed, lm_head = random_embeddings(
            target_path, seed=random_seed, device=device, dtype=dtype
        )
        if kind_of(config.kind).captures_final_hidden:
            norm = random_final_norm(target_path, seed=random_seed, device=device, dtype=dtype)
    return build_drafter_step(
        spec,
        config,
        embed=embed,
        lm_head=lm_head,
        device=device,
        rank=rank,
        total_steps=total_steps,
        target_norm=norm,
    )


def _wait(event: Any) -> None:
    """Make this thread's current stream wait for `event` (GPU-side, no host sync)."""
    if isinstance(event, torch.cuda.Event):
        torch.cuda.current_stream().wait_event(event)


def _record(device: torch.device) -> torch.cuda.Event | None:
    """An event on this thread's current stream now (None on CPU: jobs there are synchronous)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def combine_gradients(runners: list[DrafterRunner], phase_a_done: list[Any]) -> list[Any]:
    """Sum every drafter's flat gradients and step sums, in place on each, on the devices.

    Returns, per drafter, the event its phase B must wait for (None on CPU and for one drafter).
    Three stages, each enqueued on the worker stream of the first drafter of each device (its
    leader), ordered by events: no host sync anywhere (call from any thread; CPU jobs are
    synchronous, so there the order is the call order).
      1. within a device: the leader waits for its members' phase A and adds their sums;
      2. across devices: one single-process NCCL all-reduce of the leaders' sums;
         (across nodes, a process-group all-reduce of the leaders' sums belongs right here)
      3. within a device: the leader copies the total into its members; one event per device.
    Every drafter then holds the same bits (copies of one total), so their weights stay equal.
    """
    if len(runners) == 1:
        return [None]
    groups: dict[torch.device, list[DrafterRunner]] = {}
    waits: dict[torch.device, list[Any]] = {}
    for r, event in zip(runners, phase_a_done, strict=True):
        groups.setdefault(r.step.device, []).append(r)
        waits.setdefault(r.step.device, []).append(event)
    leaders = [members[0] for members in groups.values()]
    with contextlib.ExitStack() as current:  # ops on each device's tensors use its leader's stream
        for leader in leaders:
            if leader.worker.stream is not None:
                current.enter_context(torch.cuda.stream(leader.worker.stream))
        for device, members in groups.items():
            _sum_into_leader(members, waits[device])
        all_reduce_sum([leader.step.flat_grad for leader in leaders])
        all_reduce_sum([leader.step.stats for leader in leaders])
        done = {device: _copy_from_leader(members) for device, members in groups.items()}
    return [done[r.step.device] for r in runners]


def _sum_into_leader(members: list[DrafterRunner], phase_a_done: list[Any]) -> None:
    """Wait for each member's phase A, add into the leader's buffers ((g0 + g1) + g2 ...)."""
    leader, stream = members[0].step, members[0].worker.stream
    for event in phase_a_done:
        if isinstance(event, torch.cuda.Event):
            stream.wait_event(event)  # GPU-side wait, no host sync
    for other in members[1:]:
        leader.flat_grad.add_(other.step.flat_grad)
        leader.stats.add_(other.step.stats)


def _copy_from_leader(members: list[DrafterRunner]) -> torch.cuda.Event | None:
    """The total into every member; the event after which they hold it (None on CPU)."""
    leader, stream = members[0].step, members[0].worker.stream
    for other in members[1:]:
        other.step.flat_grad.copy_(leader.flat_grad)
        other.step.stats.copy_(leader.stats)
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


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

    With one target worker packs are published, and trained (a step takes the oldest), in plan
    order, so resuming from `cursor` replays exactly the packs an uninterrupted run would have
    trained on next. Several target workers can finish packs out of order, by at most the slots
    in flight; the cursor is then the furthest pack trained on, and resuming skips the few
    overtaken ones.
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
    rings: RingSet,
    reports: SendChannel[StepRecord],
    *,
    first_step: int,
    last_step: int,
    stop: anyio.Event,
    on_step_end=None,
    across_nodes: Callable[[list[DrafterRunner], bool], bool] | None = None,
    progress: Progress | None = None,
) -> int:
    """Optimizer steps first_step..last_step-1; returns the next step index.

    Ends early when the ring is drained (the data is exhausted) or `stop` is set (a signal).
    `on_step_end(step)` (async) runs between steps: periodic checkpoints; `progress.cursor` is
    then the data cursor after that step. `across_nodes`, on several nodes, sums the node's
    combined gradients with the other nodes' and says when all ranks stop (a rank's own `stop`
    then only votes: reducer.NodeReducer).
    """
    step, agreed_stop = first_step, False
    try:
        while step < last_step and not (agreed_stop if across_nodes else stop.is_set()):
            try:
                slots = await rings.receive_step()  # the oldest packs, the j-th for drafter j
            except anyio.EndOfStream:
                break
            meta = [dict(s.meta) for s in slots]  # read before release: a producer reuses slots
            batches = [s.batch for s in slots]
            cursors = [m.get("cursor") for m in meta]
            loaded = await _each(
                runners, "load_and_forward", batches, [s.ready for s in slots], cursors
            )
            for slot, (copied, _) in zip(slots, loaded, strict=True):
                rings.release(slot, copied)
            phase_a_done = [a_done for _, a_done in loaded]
            combined = await runners[0].worker.run(combine_gradients, runners, phase_a_done)
            if across_nodes is not None:  # after the node's combine: one collective a step
                agreed_stop = await runners[0].worker.run(across_nodes, runners, stop.is_set())
            done = await _each(runners, "update", combined)
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
