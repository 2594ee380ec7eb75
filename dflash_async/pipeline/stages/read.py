"""Read stage: plan packs of whole documents and hand them to the target workers, in order."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflash_async.data.packing import PackCursor, iter_packs
from dflash_async.pipeline.channels import SendChannel


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
) -> None:
    """Send every pack from `start` on (forever when epochs is None); closing is the end signal.
    With several nodes, only this rank's share of each epoch (packing.plan_epoch).

    Planning one epoch is numpy on the loop thread (~10 ms per 100k samples, under the loop-lag
    budget). The bounded channel is the backpressure: this stage waits while targets are busy.
    """
    try:
        packs = iter_packs(lengths, token_budget, seed, start=start, epochs=epochs, rank=rank,
                           world_size=world_size)  # fmt: skip
        for cursor, indices in packs:
            await send.send(PlannedPack(cursor, indices))
    finally:
        send.close()
