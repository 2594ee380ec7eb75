"""Report stage: one canonical `step` log line per optimizer step, and its TensorBoard scalars.

The step's numbers come from a host vector that the drafter copied asynchronously; this stage
polls its event (never blocking the loop or a worker), so the host reads them a step late and the
training step itself never waits for the host. Each line carries the run's total steps and an ETA
from the step rate of the last 30 s. With a TensorBoard folder the same numbers also go to a
`torch.utils.tensorboard.SummaryWriter`, whose own writer thread serializes and flushes the event
file (the drafter threads never touch it).
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
from dflash_async.runtime.channels import ReceiveChannel
from dflash_async.runtime.devices import DeviceWorker
from dflash_async.runtime.meters import BusyMeter, RateWindow
from dflash_async.runtime.rings import RingSet
from dflash_async.stages.train import StepRecord

Workers = list[tuple[DeviceWorker, BusyMeter]]


def learning_fields(values: list[float]) -> dict[str, float]:
    """loss, acc, tau_hat, lr, grad_norm from a step's report vector (STATS, lr, grad_norm)."""
    stats = dict(zip(STATS, values[: len(STATS)], strict=True))
    fields = {
        "loss": stats["ce_sum"] / max(stats["weight_sum"], 1e-12),
        "acc": stats["correct"] / max(stats["supervised"], 1.0),
        "tau_hat": 1 + stats["accepted"] / max(stats["blocks"], 1.0),
        "lr": values[len(STATS)],
        "grad_norm": values[len(STATS) + 1],
    }
    if stats["topk_hits"] > 0:  # a DFlash2 step (a DFlash step counts none): its selector
        fields["topk_recall"] = stats["topk_hits"] / max(stats["supervised"], 1.0)
        fields["selector_acc"] = stats["selector_correct"] / max(stats["supervised"], 1.0)
    return fields


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
    _last_ready: Any = None  # the previous step's completion event (GPU)

    def busy_fractions(self, workers: Workers, span: float) -> dict[str, float]:
        """Per worker, the share of `span` seconds its device spent in its jobs (GPU: CUDA
        event timings of each job; CPU: host time inside jobs)."""
        fractions = {}
        for worker, meter in workers:
            busy = meter.collect() if worker.device.type == "cuda" else worker.busy_seconds
            fractions[worker.name] = min(1.0, (busy - self._busy.get(worker.name, 0.0)) / span)
            self._busy[worker.name] = busy
        return fractions

    def fields(self, record: StepRecord, visible_pairs: float, now: float) -> dict[str, Any]:
        """The throughput half of the step line; call once per step, in order."""
        span, self._last = max(now - self._last, 1e-9), now
        if hasattr(record.ready, "elapsed_time") and self._last_ready is not None:
            # Device time between the two steps' ends (both events completed: no host sync).
            # Host arrival times bunch up after a pause (a save's host copy): records queued
            # behind it arrive microseconds apart, which once gave an MFU of 12 (1200%).
            span = max(self._last_ready.elapsed_time(record.ready) / 1e3, 1e-9)
        self._last_ready = record.ready
        packs = len(record.slots_meta)
        tokens = sum(m["tokens"] for m in record.slots_meta)
        self.tokens.add(tokens, now)
        ring = self.ring.statistics()
        target_busy = self.busy_fractions(self.target_workers, span)
        drafter_busy = self.busy_fractions(self.drafter_workers, span)
        fields = {
            "tokens": tokens,
            "tokens_per_s": self.tokens.rate(now),
            "padding_frac": 1 - tokens / (packs * self.token_budget),
            # every drafter GPU's FLOPs (mean pairs per drafter) over the wall time of the step
            "mfu": mfu(packs * self.step_flops(visible_pairs / packs), span * packs),
            "target_busy": _mean(target_busy.values()),
            "drafter_busy": _mean(drafter_busy.values()),
            "worker_busy": _rounded(target_busy | drafter_busy),
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
        if record.ready is None:  # a CPU step (no completion event): MFU against a GPU's peak
            del fields["mfu"], fields["node_mfu"]  # would be a meaningless 1e-05
        return fields

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


def _mean(values) -> float:
    values = list(values)
    return sum(values) / max(len(values), 1)


def _peak_memory_gib(workers: Workers) -> float:
    """Peak reserved memory of the drafter GPUs (0 on CPU)."""
    devices = {w.device for w, _ in workers if w.device.type == "cuda"}
    return max((torch.cuda.max_memory_reserved(d) / 2**30 for d in devices), default=0.0)


async def _wait(event: Any) -> None:
    """Poll a CUDA event from the loop; CPU steps have none."""
    while event is not None and not event.query():
        await anyio.sleep(0.0005)


def _rounded(fields: dict[str, Any]) -> dict[str, Any]:
    """Floats to 6 significant digits (a CPU run's MFU of 1.7e-05 keeps its digits)."""
    return {k: float(f"{v:.6g}") if isinstance(v, float) else v for k, v in fields.items()}


@dataclass
class Eta:
    """Seconds left to `total_steps`, from the step rate of the last 30 s (None until known)."""

    total_steps: int
    steps: RateWindow = field(default_factory=RateWindow)

    def fields(self, step: int, now: float) -> dict[str, Any]:
        self.steps.add(1, now)
        rate = self.steps.rate(now)
        eta = (self.total_steps - step) / rate if rate > 0 else None
        return {"total_steps": self.total_steps, "eta_s": None if eta is None else round(eta, 1)}


# TensorBoard tag group of each step field; the rest go under "pipeline/".
_TB_GROUPS = {k: "train" for k in ("loss", "acc", "tau_hat", "lr", "grad_norm", "epoch")} | {
    k: "throughput" for k in ("tokens", "tokens_per_s", "padding_frac", "mfu", "step_ms")
}


def open_tensorboard(folder: str):
    """A SummaryWriter on `folder`. Imported here: tensorboard is an optional extra (its
    presence is checked when the settings load)."""
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=folder)


def tensorboard_scalars(fields: dict[str, Any]) -> dict[str, float]:
    """The step line's numbers as TensorBoard tags: "train/loss", "throughput/mfu",
    "pipeline/slot_queue", and one per entry of a dict field ("worker_busy/drafter0")."""
    scalars = {}
    for key, value in fields.items():
        if isinstance(value, dict):
            scalars |= {f"{key}/{k}": float(v) for k, v in value.items() if _number(v)}
        elif _number(value) and key not in ("step", "total_steps"):
            scalars[f"{_TB_GROUPS.get(key, 'pipeline')}/{key}"] = float(value)
    return scalars


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


async def report_stage(
    records: ReceiveChannel[StepRecord],
    tp: Throughput,
    log,
    *,
    total_steps: int,
    tensorboard_dir: str = "",
) -> dict:
    """Log every step (and feed TensorBoard); return the last step's fields (for the summary)."""
    last: dict = {}
    eta = Eta(total_steps)
    writer = open_tensorboard(tensorboard_dir) if tensorboard_dir else None
    try:
        async for record in records:
            await _wait(record.ready)
            values = record.report.tolist()  # the event completed: reading it does not sync
            now = time.perf_counter()
            last = _rounded(
                {
                    "step": record.step + 1,
                    **eta.fields(record.step + 1, now),
                    "epoch": record.slots_meta[0]["cursor"].epoch,
                    **learning_fields(values),
                    **tp.fields(record, values[STATS.index("visible_pairs")], now),
                }
            )
            log.info("step", **last)
            if writer is not None:
                for tag, value in tensorboard_scalars(last).items():
                    writer.add_scalar(tag, value, global_step=last["step"])
    finally:
        records.close()
        if writer is not None:  # flushes what the writer thread still holds
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(writer.close)
    return last
