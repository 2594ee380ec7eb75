"""Read stage: plan packs of whole documents and hand them to the target workers, in order.

Planning an epoch is seconds of numpy at millions of samples (a sort, a cumsum, one split per
pack), so it never runs on the event loop: a planner task has each epoch planned (in a separate
process for large data sets, data/planner.py) from a worker thread, one epoch ahead of the packs
being sent (a one-slot channel between them). The loop only slices each pack out of the finished
plan. Everything per pack that the target needs from the host (the samples' lengths, the token
count) is read from arrays computed once, not per pack.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import anyio
import numpy as np

from dflash_async.data.packing import PackCursor, plan_epoch
from dflash_async.data.planner import EpochPlanner
from dflash_async.runtime.channels import SendChannel, open_channel


@dataclass(frozen=True)
class PlanSpec:
    """Which packs a run trains on, in which order (settings/sections.py: DFLASH_TRAIN__*)."""

    token_budget: int  # T: rows of every pack
    seed: int  # the pack order of each epoch
    epochs: int  # passes over the data, when max_steps is 0
    max_steps: int  # 0: run the epochs


@dataclass(frozen=True)
class Plan:
    """The run's length: optimizer steps, epochs (None: loop over the data until then), and
    epoch 0's packs of this node (planned once at start-up, read by calibration and the read
    stage)."""

    total_steps: int
    epochs: int | None
    first_epoch: list[np.ndarray]


def first_epoch(
    spec: PlanSpec, lengths: np.ndarray, *, rank: int, world_size: int
) -> list[np.ndarray]:
    """This node's packs of epoch 0 (plan_epoch), planned once at start-up for the run's length,
    the placement's calibration and the read stage. Seconds of numpy at millions of samples:
    call off the event loop."""
    return plan_epoch(lengths, spec.token_budget, spec.seed, 0, rank=rank, world_size=world_size)


def plan_run(spec: PlanSpec, first: list[np.ndarray], *, num_drafters: int) -> Plan:
    """How many optimizer steps the run makes (each consumes one pack per drafter); with several
    nodes, every node's share of an epoch has the same number of packs (plan_epoch)."""
    if spec.max_steps:
        return Plan(spec.max_steps, None, first)
    return Plan(max(1, spec.epochs * len(first) // num_drafters), spec.epochs, first)


@dataclass(frozen=True)
class PlannedPack:
    """One pack: sample indices (whole documents) and where it sits in the run."""

    cursor: PackCursor
    indices: np.ndarray  # [n] sample indices, total length <= token_budget


async def read_stage(
    lengths: np.ndarray,
    *,
    token_budget: int,
    seed: int,
    start: PackCursor,
    epochs: int | None,
    send: SendChannel[PlannedPack],
    rank: int = 0,
    world_size: int = 1,
    plan_in_process: bool | None = None,
    first_plan: Sequence[np.ndarray] | None = None,
) -> None:
    """Send every pack from `start` on (forever when epochs is None); closing is the end signal.
    With several nodes, only this rank's share of each epoch (packing.plan_epoch).
    `first_plan`: epoch 0's packs when the caller has planned them already (start-up does).

    The bounded `send` channel is the backpressure: this stage waits while targets are busy, and
    the planner waits (one plan ahead) while this stage does. `plan_in_process`: None = by size.
    """
    send_plans, receive_plans = open_channel(1, "plans")  # (epoch, packs): one epoch ahead

    async def plan_epochs(planner: EpochPlanner) -> None:
        async with send_plans:
            epoch = start.epoch
            while epochs is None or epoch < epochs:
                if epoch == 0 and first_plan is not None:
                    plan = first_plan
                else:
                    plan = await anyio.to_thread.run_sync(
                        planner.plan, epoch, abandon_on_cancel=True
                    )
                await send_plans.send((epoch, plan))
                epoch += 1

    planner = await anyio.to_thread.run_sync(  # writes the lengths for a planner process
        partial(
            EpochPlanner,
            lengths,
            token_budget=token_budget,
            seed=seed,
            in_process=plan_in_process,
            plan_kwargs={"rank": rank, "world_size": world_size},
        )
    )
    try:
        async with anyio.create_task_group() as group, receive_plans:
            group.start_soon(plan_epochs, planner)
            async for epoch, plan in receive_plans:
                index = start.index if epoch == start.epoch else 0
                if index > len(plan):
                    raise ValueError(f"{start} is past the {len(plan)} packs of epoch {epoch}")
                for i in range(index, len(plan)):
                    await send.send(PlannedPack(PackCursor(epoch, i), plan[i]))
    finally:
        send.close()
        planner.close()
