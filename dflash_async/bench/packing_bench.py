"""`python -m dflash_async bench packing`: how well the pack planner fills the budget, on CPU.

Synthetic chat-like lengths: log-normal with median ~700 tokens, cut at max_len (truncation piles
the longest conversations up at max_len, as data.too_long="truncate" does). Reports the drafter
fill (real tokens / token_budget per pack), the target-side padding of the right-padded 2-D
batches (padding / padded tokens, with `max_batch_tokens` per target batch) and planner speed.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np

from dflash_async.data.packing import plan_epoch, target_batches
from dflash_async.usage import ArgumentParser

MEDIAN_TOKENS = 700
SIGMA = 0.8  # spread of log(length); ~5% of samples are cut at 3072


def synthetic_lengths(num_samples: int, max_len: int, seed: int) -> np.ndarray:
    """[n] int64 log-normal lengths, median MEDIAN_TOKENS, clipped to [32, max_len]."""
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(mean=np.log(MEDIAN_TOKENS), sigma=SIGMA, size=num_samples)
    return np.clip(np.rint(lengths), 32, max_len).astype(np.int64)


def target_padding(lengths: np.ndarray, packs: list[np.ndarray], max_batch_tokens: int) -> dict:
    """Padding of every pack's target batches: padded tokens = rows x longest row per batch."""
    real = padded = batches = 0
    for pack in packs:
        pack_lengths = lengths[pack]
        for batch in target_batches(pack_lengths, max_batch_tokens):
            rows = pack_lengths[batch]
            real += int(rows.sum())
            padded += len(rows) * int(rows.max())
            batches += 1
    return {"target_padding_frac": 1 - real / padded, "target_batches": batches}


def bench_packing(
    num_samples: int = 100_000,
    token_budget: int = 49152,
    max_len: int = 3072,
    seed: int = 0,
    *,
    max_batch_tokens: int = 16384,
    repeats: int = 5,
) -> dict[str, Any]:
    """Plan one epoch of synthetic lengths; print a table of the figures and return them."""
    lengths = synthetic_lengths(num_samples, max_len, seed)
    times = []
    for _ in range(repeats):  # best of `repeats`: the planner's speed, not the machine's noise
        started = time.perf_counter()
        packs = plan_epoch(lengths, token_budget, seed, epoch=0)
        times.append(time.perf_counter() - started)
    fills = np.array([lengths[p].sum() for p in packs]) / token_budget
    started = time.perf_counter()
    padding = target_padding(lengths, packs, max_batch_tokens)
    split_s = time.perf_counter() - started
    figures = {
        "samples": num_samples,
        "median_len": float(np.median(lengths)),
        "mean_len": float(lengths.mean()),
        "cut_at_max_len_frac": float((lengths == max_len).mean()),
        "token_budget": token_budget,
        "packs": len(packs),
        "drafter_fill": float(fills.mean()),
        "drafter_fill_min_full_packs": float(np.sort(fills)[1]) if len(fills) > 1 else 0.0,
        "max_batch_tokens": max_batch_tokens,
        **padding,
        "plan_s": min(times),
        "samples_per_s": num_samples / min(times),
        "target_split_s": split_s,
    }
    print(format_table(figures), file=sys.stderr)  # stdout: the JSON line of `main`
    return figures


def format_table(figures: dict[str, Any]) -> str:
    """A two-column markdown table, ready for BENCHMARKS.md."""
    rows = ["| figure | value |", "|---|---|"]
    for name, value in figures.items():
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        rows.append(f"| {name} | {shown} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    """bench packing [--samples N] [--token-budget T] [--max-len L]: the figures as one JSON line
    on stdout (and as a markdown table on stderr)."""
    parser = ArgumentParser(prog="python -m dflash_async bench packing")
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--token-budget", type=int, default=49152)
    parser.add_argument("--max-len", type=int, default=3072)
    options = parser.parse_args(argv)
    if min(options.samples, options.token_budget, options.max_len) < 1:
        parser.error("--samples, --token-budget and --max-len must be >= 1")
    if options.max_len > options.token_budget:
        parser.error(f"--max-len {options.max_len} exceeds --token-budget {options.token_budget}")
    result = bench_packing(options.samples, options.token_budget, options.max_len)
    print(json.dumps(result), flush=True)
