"""Read stage: plan packs of whole documents and hand them to the target workers, in order.

Planning an epoch is seconds of numpy at millions of samples (a sort, a cumsum, one split per
pack), so it never runs on the event loop: a planner task plans each epoch in a worker thread,
one epoch ahead of the packs being sent (a one-slot channel between them), and the loop only
moves finished plans along. Everything per pack that the target needs from the host (the samples'
lengths, the token count) is read from arrays computed once, not per pack.
"""

from __future__ import annotations

from dataclasses import dataclass

import anyio
import numpy as np

from dflash_async.data.packing import PackCursor, plan_epoch
from dflash_async.pipeline.channels import SendChannel, open_channel


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
) -> None:
    """Send every pack from `start` on (forever when epochs is None); closing is the end signal.

    The bounded `send` channel is the backpressure: this stage waits while targets are busy, and
    the planner waits (one plan ahead) while this stage does.
    """
    send_plans, receive_plans = open_channel(1, "plans")  # (epoch, packs): one epoch ahead

    async def planner() -> None:
        async with send_plans:
            epoch = start.epoch
            while epochs is None or epoch < epochs:
                plan = await anyio.to_thread.run_sync(
                    plan_epoch, lengths, token_budget, seed, epoch
                )
                await send_plans.send((epoch, plan))
                epoch += 1

    try:
        async with anyio.create_task_group() as group, receive_plans:
            group.start_soon(planner)
            async for epoch, plan in receive_plans:
                index = start.index if epoch == start.epoch else 0
                if index > len(plan):
                    raise ValueError(f"{start} is past the {len(plan)} packs of epoch {epoch}")
                for i in range(index, len(plan)):
                    await send.send(PlannedPack(PackCursor(epoch, i), plan[i]))
    finally:
        send.close()
