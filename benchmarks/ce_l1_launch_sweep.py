"""Launch shapes of kernels/ce_l1_kernel.py's CE + L1 pass (DSpark's chunk pass) on one GPU, timed
on one chunk of the step (2048 x 151936 bf16 draft and target logits) with CUDA events over 20
launches after 3 warm-up ones, beside the closed-form reference torch.compile'd (ce_kernel
'compiled' with compile on) and DFlash's CE kernel on the same draft logits (what a DFlash chunk
pays). Each kernel launch is compared with the reference: the largest differences of the
per-row CE and L1 and the count of gradient elements more than one bf16 rounding apart (a few
where p and q are within fp32 rounding of each other: sign(p - q) may differ there;
tests/kernels/test_ce_l1_kernel_gpu.py bounds them). Prints one JSON line per row, fastest last.
Usage:
  python benchmarks/ce_l1_launch_sweep.py [--rows 2048] [--vocab 151936]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json

import torch

from dflash_async.kernels.ce_kernel import ce_and_grad_triton
from dflash_async.kernels.ce_l1_kernel import CeL1Launch, ce_l1_and_grad_triton
from dflash_async.model.kinds.dspark.objective import ce_l1_and_grad_from_logits

ALPHAS = {"ce_alpha": 0.1, "l1_alpha": 0.9}


def _time_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()  # sync point: timing only
    return start.elapsed_time(end) / reps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    device = torch.device("cuda")
    g = torch.Generator(device).manual_seed(0)
    z = torch.randn(args.rows, args.vocab, generator=g, device=device) * 4
    t = (z + torch.randn(args.rows, args.vocab, generator=g, device=device)).bfloat16()
    z = z.bfloat16()
    labels = torch.randint(0, args.vocab, (args.rows,), generator=g, device=device)
    weights = torch.rand(args.rows, generator=g, device=device, dtype=torch.float64)
    weights[::7] = 0.0
    ce_ref, l1_ref, hit_ref, _, grad_ref = ce_l1_and_grad_from_logits(
        z, t, labels, weights, **ALPHAS
    )
    moved = 14 * z.numel()  # bytes: z and t read 3 times, dz written once, bf16
    rows = []
    compiled = torch.compile(functools.partial(ce_l1_and_grad_from_logits, **ALPHAS), dynamic=False)
    for name, fn in (
        ("reference_compiled", lambda: compiled(z, t, labels, weights)),
        ("dflash_ce_kernel", lambda: ce_and_grad_triton(z, labels, weights)),
    ):
        rows.append({"pass": name, "ms": round(_time_ms(fn, args.reps), 4)})
    launches = [
        CeL1Launch(w, e, r)
        for w, e, r in itertools.product((4, 8, 16), (128, 256, 512), (True, False))
    ]
    for launch in launches:
        ce, l1, hit, _, grad = ce_l1_and_grad_triton(z, t, labels, weights, **ALPHAS, launch=launch)
        diff = (grad.float() - grad_ref.float()).abs()
        beyond = int((diff > 2.0**-7 * grad_ref.float().abs() + 1e-12).sum())
        ms = _time_ms(
            lambda launch=launch: ce_l1_and_grad_triton(
                z, t, labels, weights, **ALPHAS, launch=launch
            ),
            args.reps,
        )
        rows.append(
            {
                "pass": "triton",
                **dataclasses.asdict(launch),
                "ce_max_diff": float((ce - ce_ref).abs().max()),
                "l1_max_diff": float((l1 - l1_ref).abs().max()),
                "hits_equal": torch.equal(hit, hit_ref),
                "grad_elements_beyond_one_bf16_rounding": beyond,
                "ms": round(ms, 4),
                "tb_per_s_if_14_bytes_per_element": round(moved / ms / 1e9, 2),
            }
        )
    for row in sorted(rows, key=lambda r: -r["ms"]):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
