"""FLOP accounting, MFU and throughput windows for the drafter step and the target forward.

FLOPs count the useful matmul work once (2 per multiply-add): activation recomputation (the CE
chunks' checkpointing) is not counted, and attention counts only visible (query, key) pairs.
Training a layer costs 3x its forward (forward, input grad, weight grad); the frozen lm_head and
the fc over frozen features cost 2x (one of the two backward matmuls is not needed).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from dflash_async.drafter_config import DrafterConfig

H200_BF16_PEAK_FLOPS = 780e12  # measured dense bf16 matmul peak (docs/GPU.md)


def drafter_step_flops(
    config: DrafterConfig, *, token_budget: int, num_anchors: int, visible_pairs: float
) -> float:
    """Train FLOPs of one drafter step: T context rows, Q = A*B block slots.

    visible_pairs: attended (query, key) pairs summed over all queries (context + own block).
    """
    d, hd = config.hidden_size, config.head_dim
    H, Hkv, f = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    T, Q = token_budget, num_anchors * config.block_size
    per_layer = (
        2
        * (
            Q * d * H * hd  # q_proj
            + 2 * (T + Q) * d * Hkv * hd  # k_proj, v_proj over context and block
            + Q * H * hd * d  # o_proj
            + 3 * Q * d * f  # gate, up, down
        )
        + 2 * 2 * H * hd * visible_pairs
    )  # QK^T and PV
    layers = 3 * config.num_hidden_layers * per_layer
    fc = 2 * 2 * T * config.num_features * d * d
    lm_head = 2 * 2 * num_anchors * (config.block_size - 1) * d * config.vocab_size
    return float(layers + fc + lm_head)


def mfu(flops: float, seconds: float, peak: float = H200_BF16_PEAK_FLOPS) -> float:
    return flops / max(seconds, 1e-12) / peak


@dataclass
class RateWindow:
    """Sliding-window rate of a counter (tokens/s, steps/s) over the last `seconds`."""

    seconds: float = 30.0

    def __post_init__(self) -> None:
        self._events: deque[tuple[float, float]] = deque()

    def add(self, amount: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._events.append((now, amount))
        while self._events and now - self._events[0][0] > self.seconds:
            self._events.popleft()

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        if len(self._events) < 2:
            return 0.0
        span = now - self._events[0][0]
        return sum(a for _, a in list(self._events)[1:]) / max(span, 1e-9)


def timing_event(device) -> torch.cuda.Event | None:
    """A CUDA event recorded now on the calling thread's stream, able to time (None on CPU,
    where jobs run synchronously). Recording never blocks the host."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class BusyMeter:
    """Device-busy seconds of one worker, from (start, end) CUDA event pairs of its jobs.

    `collect()` adds the pairs whose end event completed (event.query(): no host sync) and
    returns the running total. CPU workers use their host job time instead (add_seconds).
    """

    def __init__(self) -> None:
        self._pending: deque = deque()
        self._seconds = 0.0

    def add(self, start, end) -> None:
        self._pending.append((start, end))

    def add_seconds(self, seconds: float) -> None:
        self._seconds += seconds

    def collect(self) -> float:
        while self._pending and self._pending[0][1].query():
            start, end = self._pending.popleft()
            self._seconds += start.elapsed_time(end) / 1e3
        return self._seconds
