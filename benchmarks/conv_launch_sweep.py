"""Launch shapes of kernels/conv_kernel.py's DFlash2 convolution on one GPU, against the torch
reference compiled as the step compiled it before (kinds/dflash2/drafter.block_causal_conv under torch.compile,
forward and backward): each checked against the fp32 reference (tests/kernels/test_conv_kernel_gpu.py's
bf16 tolerance) and timed at the Qwen3-8B drafter's shape (1024 blocks x 16, d = 4096, 2 taps,
groups of 16, bf16; one of a step's 20 convolutions), CUDA events over 20 calls after 3 warm-up
ones, each captured as a CUDA graph. Prints one JSON line per launch, fastest last. Usage:
  python benchmarks/conv_launch_sweep.py [--blocks 1024] [--block 16] [--hidden 4096]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json

import torch

from dflash_async.kernels.conv_kernel import ConvLaunch, triton_block_conv
from dflash_async.model.kinds.dflash2.drafter import block_causal_conv

BF16_RTOL = 2.0**-8  # tests/kernels/test_conv_kernel_gpu.py derives it


def _timed_ms(fn, reps: int) -> float:
    """GPU ms per call of fn, captured once as a CUDA graph and replayed: eager, the backward's
    autograd call and its small ops are launch-bound at these sizes (~0.1 ms of host work)."""
    for _ in range(3):  # compile and warm up outside the capture
        fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()  # sync point: timing only
    return start.elapsed_time(end) / reps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=1024)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--taps", type=int, default=2)
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    device = torch.device("cuda")
    g = torch.Generator(device).manual_seed(0)
    A, B, d, K, G = args.blocks, args.block, args.hidden, args.taps, args.hidden // args.group
    h = torch.randn(A, B, d, generator=g, device=device).bfloat16().requires_grad_()
    dyn = torch.randn(A, B, 2, K, G, generator=g, device=device).bfloat16().requires_grad_()
    base = torch.randn(K, d, generator=g, device=device).requires_grad_()
    grad = torch.randn(A, B, d, generator=g, device=device).bfloat16()
    leaves = (h, dyn, base)

    def both(conv):
        out = conv(h, dyn[:, :, 1], base)
        return (out, *torch.autograd.grad(out, leaves, grad))

    exact = [x.detach().float().requires_grad_() for x in leaves]
    out = block_causal_conv(exact[0], exact[1][:, :, 1], exact[2])
    want = (out, *torch.autograd.grad(out, exact, grad.float()))

    def equal(got) -> bool:
        return all(
            float((x.detach().float() - y.detach().float()).norm() / y.detach().float().norm())
            <= BF16_RTOL
            for x, y in zip(got, want, strict=True)
        )

    # bytes of one convolution if each tensor is read or written once: forward h, dyn, out;
    # backward grad, h, dyn, grad_h, grad_dyn
    size = h.numel() * h.element_size()
    dyn_size = A * B * K * G * dyn.element_size()
    moved = {"forward": 2 * size + dyn_size, "backward": 3 * size + 2 * dyn_size}
    compiled = torch.compile(block_causal_conv, dynamic=False)
    rows = []
    candidates = [("torch, compiled", None)] + [
        (f"triton {c}ch {w}w {b}blocks", ConvLaunch(c, w, b))
        for c, w, b in itertools.product((64, 128, 256), (2, 4, 8), (4, 8, 16))
    ]
    for name, launch in candidates:
        conv = compiled if launch is None else triton_block_conv(launch)
        try:
            ok = equal([x.detach() for x in both(conv)])
            forward = _timed_ms(lambda conv=conv: conv(h, dyn[:, :, 1], base), args.reps)
            whole = _timed_ms(lambda conv=conv: both(conv), args.reps)
        except Exception as error:  # a launch may not compile here: say so, go on
            print(json.dumps({"conv": name, "error": str(error)[:300]}), flush=True)
            continue
        backward = whole - forward
        rows.append(
            {
                "conv": name,
                **(dataclasses.asdict(launch) if launch else {}),
                "equal_to_reference": ok,
                "forward_ms": round(forward, 4),
                "backward_ms": round(backward, 4),
                "both_ms": round(whole, 4),
                "forward_tb_s": round(moved["forward"] / forward / 1e9, 2),
                "backward_tb_s": round(moved["backward"] / backward / 1e9, 2),
            }
        )
    for row in sorted(rows, key=lambda r: -r["both_ms"]):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
