"""Report stage: one canonical `step` log line per optimizer step.

The step's numbers come from a host vector that the drafter copied asynchronously; this stage
polls its event (never blocking the loop or a worker), so the host reads them a step late and the
training step itself never waits for the host.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch

from dflash_async.model.flops import mfu
from dflash_async.model.step import STATS
from dflash_async.pipeline.channels import ReceiveChannel
from dflash_async.pipeline.devices import DeviceWorker
from dflash_async.pipeline.meters import BusyMeter, RateWindow
from dflash_async.pipeline.rings import RingSet
from dflash_async.pipeline.stages.train import StepRecord

Workers = list[tuple[DeviceWorker, BusyMeter]]


def learning_fields(values: list[float]) -> dict[str, float]:
    """loss, acc, tau_hat, lr, grad_norm from a step's report vector (STATS, lr, grad_norm)."""
    stats = dict(zip(STATS, values[: len(STATS)], strict=True))
    return {
        "loss": stats["ce_sum"] / max(stats["weight_sum"], 1e-12),
        "acc": stats["correct"] / max(stats["supervised"], 1.0),
        "tau_hat": 1 + stats["accepted"] / max(stats["blocks"], 1.0),
        "lr": values[len(STATS)],
        "grad_norm": values[len(STATS) + 1],
    }


@dataclass
class Throughput:
    """Where time and tokens go: rates, busy fractions, queue depth, MFU, memory, loop lag."""

    ring: RingSet
    target_workers: Workers
    drafter_workers: Workers
    token_budget: int
    step_flops: Callable[[float], float]  # visible (query, key) pairs -> one drafter's FLOPs
    loop_lag_ms: Callable[[], float]  # max loop lateness since the last call
    target_flops: Callable[[int, int], float] = lambda tokens, documents: 0.0  # one pack's
    gpus: GpuBusy = field(default_factory=lambda: GpuBusy([]))
    started: float = field(default_factory=time.perf_counter)
    tokens: RateWindow = field(default_factory=RateWindow)
    _busy: dict[str, float] = field(default_factory=dict)
    _last: float = field(default_factory=time.perf_counter)

    def busy_fraction(self, workers: Workers, span: float) -> float:
        """Share of `span` seconds that the workers' devices spent in their jobs (GPU: CUDA
        event timings of each job; CPU: host time inside jobs)."""
        total = 0.0
        for worker, meter in workers:
            busy = meter.collect() if worker.device.type == "cuda" else worker.busy_seconds
            total += busy - self._busy.get(worker.name, 0.0)
            self._busy[worker.name] = busy
        return min(1.0, total / (span * max(len(workers), 1)))

    def fields(self, record: StepRecord, visible_pairs: float, now: float) -> dict[str, Any]:
        """The throughput half of the step line; call once per step, in order."""
        span, self._last = max(now - self._last, 1e-9), now
        packs = len(record.slots_meta)
        tokens = sum(m["tokens"] for m in record.slots_meta)
        self.tokens.add(tokens, now)
        ring = self.ring.statistics()
        return {
            "tokens": tokens,
            "tokens_per_s": self.tokens.rate(now),
            "padding_frac": 1 - tokens / (packs * self.token_budget),
            # every drafter GPU's FLOPs (mean pairs per drafter) over the wall time of the step
            "mfu": mfu(packs * self.step_flops(visible_pairs / packs), span * packs),
            "target_busy": self.busy_fraction(self.target_workers, span),
            "drafter_busy": self.busy_fraction(self.drafter_workers, span),
            "slot_queue": ring.depth,
            "slot_queues": ring.depths,  # per drafter ring
            "gpu_busy": self.gpus.fractions(span),
            "node_mfu": self.node_mfu(record, visible_pairs, span),
            # supply: packs the targets published since the start, at this step's tokens/pack
            "supply_tokens_per_s": ring.published / (now - self.started) * tokens / packs,
            "demand_tokens_per_s": tokens / span,
            "step_ms": span * 1e3,
            "mem_gib": _peak_memory_gib(self.drafter_workers),
            "loop_lag_ms": self.loop_lag_ms(),
        }

    def node_mfu(self, record: StepRecord, visible_pairs: float, span: float) -> float:
        """Target and drafter FLOPs of the step over its wall time and every device of the node."""
        packs = len(record.slots_meta)
        flops = packs * self.step_flops(visible_pairs / packs) + sum(
            self.target_flops(m["tokens"], m.get("documents", 1)) for m in record.slots_meta
        )
        return mfu(flops, span * max(len(self.gpus.devices), 1))


class GpuBusy:
    """Busy fraction of each device: the union of its workers' job intervals.

    GPU: intervals from the CUDA event pairs of every job (BusyMeter), placed on one time line by
    their offset from a reference event of that device (event timing: no host sync). CPU: the
    workers' summed host job time over the span, at most 1 (threads share the cores)."""

    def __init__(self, workers: Workers) -> None:
        self.devices = sorted({w.device for w, _ in workers}, key=str)
        self._workers = workers
        self._reference = {}
        for device in self.devices:
            if device.type == "cuda":  # recorded on the device's default stream, never waited on
                self._reference[device] = torch.cuda.Event(enable_timing=True)
                self._reference[device].record(torch.cuda.default_stream(device))
        self._host = {w.name: w.busy_seconds for w, _ in workers}
        for _, meter in workers:  # start-up jobs (calibration) predate the reference events
            meter.collect()
            meter.completed.clear()

    def fractions(self, span: float) -> dict[str, float]:
        return {str(d): round(min(1.0, self._busy_s(d) / span), 6) for d in self.devices}

    def _busy_s(self, device: torch.device) -> float:
        workers = [(w, m) for w, m in self._workers if w.device == device]
        if device.type != "cuda":
            busy = 0.0
            for w, _ in workers:
                busy, self._host[w.name] = (
                    busy + w.busy_seconds - self._host[w.name],
                    w.busy_seconds,
                )
            return busy
        ref, intervals = self._reference[device], []
        if not ref.query():  # not yet on the device's time line (never blocks): next step
            return 0.0
        for _, meter in workers:
            meter.collect()
            intervals += [(ref.elapsed_time(s), ref.elapsed_time(e)) for s, e in meter.completed]
            meter.completed.clear()
        return _union_ms(intervals) / 1e3


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end] intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        total += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return total


def _peak_memory_gib(workers: Workers) -> float:
    """Peak reserved memory of the drafter GPUs (0 on CPU)."""
    devices = {w.device for w, _ in workers if w.device.type == "cuda"}
    return max((torch.cuda.max_memory_reserved(d) / 2**30 for d in devices), default=0.0)


async def _wait(event: Any) -> None:
    """Poll a CUDA event from the loop; CPU steps have none."""
    while event is not None and not event.query():
        await anyio.sleep(0.0005)


def _rounded(fields: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 6) if isinstance(v, float) else v for k, v in fields.items()}


async def report_stage(records: ReceiveChannel[StepRecord], tp: Throughput, log) -> dict:
    """Log every step; return the last step's fields (for the run summary)."""
    last: dict = {}
    try:
        async for record in records:
            await _wait(record.ready)
            values = record.report.tolist()  # the event completed: reading it does not sync
            last = {
                "step": record.step + 1,
                "epoch": record.slots_meta[0]["cursor"].epoch,
                **learning_fields(values),
                **tp.fields(record, values[STATS.index("visible_pairs")], time.perf_counter()),
            }
            log.info("step", **_rounded(last))
    finally:
        records.close()
    return last
