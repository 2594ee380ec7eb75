"""Report stage: one canonical `step` log line per optimizer step, one `train_completed` at the end.

The step's numbers come from a host vector that the drafter copied asynchronously; this stage
polls its event (never blocking the loop or a worker), so the host reads them a step late and the
training step itself never waits for the host.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch

from dflash_async.channels import ReceiveChannel, SlotRing
from dflash_async.devices import DeviceWorker
from dflash_async.metrics import BusyMeter, RateWindow, mfu
from dflash_async.stages.train import StepRecord
from dflash_async.step import STATS


@dataclass
class Throughput:
    """Everything the step line needs beyond the step's own numbers."""

    ring: SlotRing
    target_workers: list[tuple[DeviceWorker, BusyMeter]]
    drafter_workers: list[tuple[DeviceWorker, BusyMeter]]
    token_budget: int
    flops_of_pairs: Any  # visible_pairs -> drafter FLOPs of one drafter's step
    loop_lag: Any  # LoopLag: max loop lateness since the last read
    started: float = field(default_factory=time.perf_counter)
    tokens: RateWindow = field(default_factory=RateWindow)
    packs_published: RateWindow = field(default_factory=RateWindow)
    _busy: dict[str, float] = field(default_factory=dict)
    _last: float = field(default_factory=time.perf_counter)

    def busy_fraction(self, workers: list[tuple[DeviceWorker, BusyMeter]], now: float) -> float:
        """Share of the wall time since the last step that the workers' devices were busy with
        their jobs (GPU: CUDA event timings of each job; CPU: host time inside jobs)."""
        span, total = max(now - self._last, 1e-9), 0.0
        for worker, meter in workers:
            busy = meter.collect() if worker.device.type == "cuda" else worker.busy_seconds
            total += busy - self._busy.get(worker.name, 0.0)
            self._busy[worker.name] = busy
        return min(1.0, total / (span * max(len(workers), 1)))


async def _wait(event: Any) -> None:
    """Poll a CUDA event from the loop; CPU steps have none."""
    while event is not None and not event.query():
        await anyio.sleep(0.0005)


def step_fields(record: StepRecord, values: list[float], tp: Throughput, now: float) -> dict:
    stats = dict(zip(STATS, values[: len(STATS)], strict=True))
    lr, grad_norm = values[len(STATS)], values[len(STATS) + 1]
    tokens = sum(m["tokens"] for m in record.slots_meta)
    step_s = max(now - tp._last, 1e-9)
    tp.tokens.add(tokens, now)
    ring = tp.ring.statistics()
    n = len(record.slots_meta)
    tokens_per_pack = tokens / max(n, 1)
    tp.packs_published.add(ring.published, now)
    fields = {
        "step": record.step + 1,
        "epoch": record.slots_meta[0]["cursor"].epoch,
        "loss": stats["ce_sum"] / max(stats["weight_sum"], 1e-12),
        "acc": stats["correct"] / max(stats["supervised"], 1.0),
        "tau_hat": 1 + stats["accepted"] / max(stats["blocks"], 1.0),
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens": tokens,
        "tokens_per_s": tp.tokens.rate(now),
        "padding_frac": 1 - tokens / (n * tp.token_budget),
        # sums over drafters: per-drafter FLOPs from the mean pairs, over all drafter GPUs
        "mfu": mfu(n * tp.flops_of_pairs(stats["visible_pairs"] / n), step_s * n),
        "target_busy": tp.busy_fraction(tp.target_workers, now),
        "drafter_busy": tp.busy_fraction(tp.drafter_workers, now),
        "slot_queue": ring.depth,
        "supply_tokens_per_s": ring.published / max(now - tp.started, 1e-9) * tokens_per_pack,
        "demand_tokens_per_s": tokens / step_s,
        "step_ms": step_s * 1e3,
        "mem_gib": _memory_gib(tp.drafter_workers),
        "loop_lag_ms": tp.loop_lag.read_max_ms(),
    }
    tp._last = now
    return fields


def _memory_gib(workers: list[tuple[DeviceWorker, BusyMeter]]) -> float:
    """Peak reserved memory of the drafter GPUs (0 on CPU)."""
    devices = {w.device for w, _ in workers if w.device.type == "cuda"}
    return max((torch.cuda.max_memory_reserved(d) / 2**30 for d in devices), default=0.0)


async def report_stage(records: ReceiveChannel[StepRecord], tp: Throughput, log) -> dict:
    """Log every step; return the last step's fields (for the run summary)."""
    last: dict = {}
    try:
        async for record in records:
            await _wait(record.ready)
            values = record.report.tolist()  # the event completed: reading it does not sync
            last = step_fields(record, values, tp, time.perf_counter())
            log.info(
                "step", **{k: round(v, 6) if isinstance(v, float) else v for k, v in last.items()}
            )
    finally:
        records.close()
    return last
