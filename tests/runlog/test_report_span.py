"""The step line's timing on a GPU comes from the steps' own completion events, not from when
the report stage happens to read them (records queued behind a pause arrive microseconds apart)."""

from __future__ import annotations

from dflash_async.stages.report import Throughput
from dflash_async.stages.train import StepRecord


class FakeRing:
    def statistics(self):
        from dflash_async.runtime.rings import RingSetStatistics

        return RingSetStatistics(0, 0, [0])


class DoneEvent:
    """A completed CUDA event stand-in: its time on the device's clock, in ms."""

    def __init__(self, ms: float) -> None:
        self.ms = ms

    def elapsed_time(self, end: DoneEvent) -> float:
        return end.ms - self.ms


def record(step: int, ready) -> StepRecord:
    meta = [{"tokens": 1000, "documents": 2, "cursor": None}]
    return StepRecord(step, None, ready, meta, 0.0)


def test_step_ms_is_the_device_time_between_step_ends_not_the_host_arrival_gap() -> None:
    tp = Throughput(FakeRing(), [], [], 1024, step_flops=lambda pairs: 1e12, loop_lag_ms=lambda: 0)
    tp.fields(record(0, DoneEvent(0.0)), 10.0, now=100.0)
    # The host reads the next record 1 us later (it queued behind a pause); the device says the
    # step took 500 ms. Mutant caught: spans from host arrival times (step_ms 0.001, MFU 1280).
    fields = tp.fields(record(1, DoneEvent(500.0)), 10.0, now=100.000001)
    assert abs(fields["step_ms"] - 500.0) < 1e-9
    assert abs(fields["mfu"] - 1e12 / 0.5 / 780e12) < 1e-12


def test_a_cpu_step_has_no_mfu() -> None:
    """A CPU step has no completion event: its FLOPs against a GPU's peak would be a meaningless
    1e-05 on every line."""
    tp = Throughput(FakeRing(), [], [], 1024, step_flops=lambda pairs: 1e12, loop_lag_ms=lambda: 0)
    fields = tp.fields(record(0, None), 10.0, now=100.0)
    assert "mfu" not in fields and "node_mfu" not in fields and fields["step_ms"] > 0
