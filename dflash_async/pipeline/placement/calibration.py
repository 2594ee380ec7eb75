"""Calibration: the placement's measured stage rates, each stage alone and both together.

`auto` placement first estimates the target's and the drafter's tokens/s from FLOPs at assumed
MFUs; on a GPU (or several CPU devices) it then times a few real packs on the first device,
through the target alone, a throw-away drafter alone, and both at once on their threads, and
decides again from the measured rates (placing.place).
"""

from __future__ import annotations

import time

import anyio
import numpy as np
import torch

from dflash_async.data.packing import PackCursor, PackedBatch
from dflash_async.data.samples import TokenizedSamples
from dflash_async.model.build import StepSpec
from dflash_async.model.drafter_config import DrafterConfig
from dflash_async.pipeline import placement
from dflash_async.runtime.devices import DeviceWorker
from dflash_async.runtime.meters import BusyMeter
from dflash_async.stages import produce
from dflash_async.stages.read import PlannedPack
from dflash_async.stages.train import drafter_step_on


async def calibrate(
    step_spec: StepSpec,
    config: DrafterConfig,
    samples: TokenizedSamples,
    first_epoch: list[np.ndarray],
    *,
    packs: int,
    target_path: str,
    target: DeviceWorker,
    runner: produce.TargetRunner,
    drafter: DeviceWorker,
    flops: tuple[float, float],
) -> placement.StageRates | None:
    """Measured StageRates: `packs` packs of epoch 0 through the target alone, through a throw-away
    drafter (built here, freed after; the run's drafters start fresh) alone, then through both
    at once on their threads. One warm-up pack first (compiling). None when the data holds
    fewer than two packs."""
    budget, plan = step_spec.token_budget, first_epoch  # this node's epoch 0 (stages/read.py)
    k = min(packs, len(plan) - 1)
    if k < 1:
        return None
    planned = [PlannedPack(PackCursor(0, i), np.asarray(ix)) for i, ix in enumerate(plan[: k + 1])]
    tokens = float(np.mean([samples.lengths[p.indices].sum() for p in planned[1:]]))
    width = config.feature_width
    slot = PackedBatch.empty(
        budget, width, device=target.device, feature_dtype=runner.inputs.features.dtype
    )
    step = await drafter.run(
        drafter_step_on,
        drafter.device,
        step_spec,
        config,
        target_path=target_path,
        rank=0,
        total_steps=1,
        random_seed=runner.random_seed,
    )
    fill = (_fill, runner, samples, planned[1:], slot)
    train_on = (_train_on, step, slot, k)
    await target.run(_fill, runner, samples, planned[:1], slot)  # warm-up: first calls compile
    await drafter.run(_train_on, step, slot, 1)
    target_s = await target.run(*fill)
    drafter_s = await drafter.run(*train_on)
    started = time.perf_counter()
    async with anyio.create_task_group() as both:
        both.start_soon(target.run, *fill)
        both.start_soon(drafter.run, *train_on)
    together_s = time.perf_counter() - started
    del fill, train_on, step  # the throw-away drafter's memory goes back before the run's start
    runner.meter = BusyMeter()  # the run's busy fractions start at its first step
    if drafter.device.type == "cuda":
        await drafter.run(torch.cuda.empty_cache)
    t, d = k * tokens / target_s, k * tokens / drafter_s
    return placement.StageRates(
        t,
        d,
        overlap=placement.overlap_from(k * tokens / together_s, t, d),
        source="measured",
        target_flops_per_token=flops[0],
        drafter_flops_per_token=flops[1],
    )


def _fill(runner, samples, packs: list[PlannedPack], slot: PackedBatch) -> float:
    """Seconds of the target on `packs` (run in its worker)."""
    started = time.perf_counter()
    for pack in packs:
        produce.fill_slot(runner, produce.stage_inputs(runner, samples, pack), slot)
    return _finished(started)


def _train_on(step, slot: PackedBatch, n: int) -> float:
    """Seconds of `n` drafter steps on `slot` (run in its worker)."""
    started = time.perf_counter()
    for _ in range(n):
        step.batch.copy_(slot)
        step.phase_a()
        step.phase_b()
    return _finished(started)


def _finished(started: float) -> float:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # sync point: start-up calibration only (this thread's GPU)
    return time.perf_counter() - started
