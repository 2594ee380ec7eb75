"""Named ranges around the drafter step's pieces, for the profiler's breakdown by part.

`step_range(name)` is a `torch.profiler.record_function` while a profiler is recording and a
`nullcontext` otherwise: outside profiling nothing is recorded and no op is dispatched, so the
trained step, its CUDA-graph capture and replay are unchanged. Ranges sit in eager code only, never
inside torch.compile'd functions (a range there would make dynamo guard on the profiler flag and
recompile under profiling). bench/step_profile.py maps kernels to parts by these names.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch.autograd.profiler as autograd_profiler
from torch.profiler import record_function

PREFIX = "dflash::"
# The ranges the model code opens (step_profile.py's classifier knows each of them).
RANGES = ("features", "block_mask", "attention", "layer", "final_norm", "lm_head_ce", "optimizer")


def step_range(name: str) -> AbstractContextManager:
    """A profiler range `dflash::<name>` while profiling, else a no-op."""
    if name not in RANGES:
        raise ValueError(f"unknown step range {name!r} (known: {', '.join(RANGES)})")
    # a module global of torch.autograd.profiler, set while any profiler records
    if getattr(autograd_profiler, "_is_profiler_enabled", False):
        return record_function(PREFIX + name)
    return nullcontext()
