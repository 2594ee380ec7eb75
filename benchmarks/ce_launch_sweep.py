"""Launch shapes of kernels/ce_kernel.py's CE pass on one GPU: each against the reference
(objective.ce_and_grad_from_logits, the tolerances of tests/kernels/test_ce_kernel_gpu.py) and timed on
one chunk of the step (2048 x 151936 bf16 logits), CUDA events over 20 launches after 3 warm-up
ones. Prints one JSON line per launch shape, fastest last. Usage:
  python benchmarks/ce_launch_sweep.py [--rows 2048] [--vocab 151936] [--launches block|grid]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json

import torch

from dflash_async.kernels.ce_kernel import CeLaunch, ce_and_grad_triton
from dflash_async.model.objective import ce_and_grad_from_logits


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--launches", choices=("grid", "block"), default="block")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator(device).manual_seed(0)
    logits = (torch.randn(args.rows, args.vocab, generator=g, device=device) * 4).bfloat16()
    labels = torch.randint(0, args.vocab, (args.rows,), generator=g, device=device)
    weights = torch.rand(args.rows, generator=g, device=device, dtype=torch.float64)
    weights[::7] = 0.0
    ce_ref, hit_ref, grad_ref = ce_and_grad_from_logits(logits, labels, weights)
    launch_sets = {
        # the first sweeps' grid: programs per SM, warps, pass 2 reversed
        "grid": [
            CeLaunch(p, w, r) for p, w, r in itertools.product((0, 1, 2, 4), (8, 16), (False, True))
        ],
        # one program per row, reversed: warps, columns per warp per loop step, pipelining
        "block": [
            CeLaunch(0, w, True, e, st)
            for w, e, st in itertools.product((4, 8, 16), (256, 512, 1024), (None, 1, 3))
        ],
    }
    launches = launch_sets[args.launches]
    rows = []
    for launch in launches:
        ce, hit, grad = ce_and_grad_triton(logits, labels, weights, launch)
        ok = (
            abs(float(ce) - float(ce_ref)) <= 1e-4 * abs(float(ce_ref))
            and torch.equal(hit, hit_ref)
            and bool(
                (
                    (grad.float() - grad_ref.float()).abs()
                    <= 2.0**-7 * grad_ref.float().abs() + 1e-12
                ).all()
            )
        )
        ms = float("nan")
        if device.type == "cuda":
            for _ in range(3):
                ce_and_grad_triton(logits, labels, weights, launch)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.reps):
                ce_and_grad_triton(logits, labels, weights, launch)
            end.record()
            torch.cuda.synchronize()  # sync point: timing only
            ms = start.elapsed_time(end) / args.reps
        moved = 3 * logits.numel() * logits.element_size()  # read twice, write once
        rows.append(
            {
                **dataclasses.asdict(launch),
                "equal_to_reference": ok,
                "ms": round(ms, 4),
                "tb_per_s_if_read_twice": round(moved / ms / 1e9, 2),
            }
        )
    for row in sorted(rows, key=lambda r: -r["ms"] if r["ms"] == r["ms"] else 0):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
