"""torch's CPU intra-op threads: the one setting a run starts from (`pin_cpu_threads`), and a
temporary count for CPU decoding (`cpu_threads`).

Setting the count changes the CPU's numerics, not only its speed: until the first
`torch.set_num_threads`, MKL chooses its thread count per call (its dynamic mode), and ATen's
`set_num_threads` turns that mode off for good. Measured on the CPU demo: a run whose start-up
regenerated its corpus under `cpu_threads(1)` trained to an export up to 1.2e-4 away from the same
run reading that corpus from the cache, and `torch.set_num_threads(torch.get_num_threads())` alone
made the second run equal the first. A run therefore pins the count first, so its bits do not
depend on what start-up did or, on resume, skipped.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def pin_cpu_threads() -> None:
    """Set torch's CPU intra-op threads to the count it uses now (MKL's per-call choice off
    from here on, as after any later `cpu_threads`)."""
    torch.set_num_threads(torch.get_num_threads())


@contextmanager
def cpu_threads(n: int | None) -> Iterator[None]:
    """Temporarily set torch's CPU intra-op threads (process-wide; restored on exit; None: as is).

    Decoding a tiny model on the CPU runs [1..64, 128]-row matmuls: with 2 threads on 2 busy cores
    each waits on the other, 10-20x slower than 1 thread (measured in regenerate and evaluate).
    """
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
