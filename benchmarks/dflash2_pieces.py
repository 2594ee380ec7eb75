"""Pieces of the DFlash2 step that DFlash lacks, timed alone on one GPU at the Qwen3-8B drafter's
shape (16384 slots, d = 4096, bf16): a convolution kernel projection's GEMMs (d -> 2 x K x G =
1024 outputs) with its input gradient as a plain GEMM and as one that adds into the gradient
already there (cuBLAS "beta-add", as the compiled backward runs it), GEMMs of the step's K = 4096
for scale, and the selector's codebook gradient (16384 x 16 candidate rows of rank 256 into a
151936-row fp32 codebook; token indices drawn with Zipf weights, since frequent tokens sit in most
slots' candidate sets) as F.embedding's backward, and as index_add_ (atomic, for reference).
CUDA events over 30 calls after 3 warm-up ones; one JSON line per piece. Usage:
  python benchmarks/dflash2_pieces.py
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F


def _timed_ms(fn, reps: int = 30) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()  # sync point: timing only
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()  # sync point: timing only
    return start.elapsed_time(end) / reps


def main() -> None:
    torch.manual_seed(0)
    device, bf16 = "cuda", torch.bfloat16
    M, d, P = 16384, 4096, 1024  # slots, hidden size, kernel projection outputs (2 x 2 x 256)

    def randn(*shape, dtype=bf16):
        return torch.randn(*shape, device=device, dtype=dtype)

    h, weight, grad_out, grad_h = randn(M, d), randn(P, d), randn(M, P), randn(M, d)
    square = randn(d, d)
    gemms = {
        "kernel projection forward [16384 x 4096] x [4096 x 1024]": lambda: F.linear(h, weight),
        "its input gradient, plain": lambda: grad_out @ weight,
        "its input gradient, beta-add into grad_h": lambda: torch.addmm(grad_h, grad_out, weight),
        "its input gradient, plain, then added": lambda: grad_h + grad_out @ weight,
        "its weight gradient (K = 16384)": lambda: grad_out.t() @ h,
        "scale: a K = 4096, N = 4096 GEMM, plain": lambda: F.linear(h, square),
        "scale: the same, beta-add": lambda: torch.addmm(grad_h, h, square),
    }
    for name, fn in gemms.items():
        flop = 2 * M * d * (d if name.startswith("scale") else P)
        ms = _timed_ms(fn)
        print(json.dumps({"piece": name, "ms": round(ms, 4), "tflops": round(flop / ms / 1e9, 1)}))

    v, r, k = 151936, 256, 16
    zipf = 1.0 / torch.arange(1, v + 1, device=device, dtype=torch.float32)
    index = torch.multinomial(zipf, M * k, replacement=True)
    codebook = torch.zeros(v, r, device=device, requires_grad=True)
    rows_grad = torch.randn(M * k, r, device=device)
    codebook_grads = {
        "codebook gradient, F.embedding backward (sort + segments)": lambda: torch.autograd.grad(
            F.embedding(index, codebook), codebook, rows_grad
        ),
        "codebook gradient, index_add_ (atomic)": lambda: torch.zeros(
            v, r, device=device
        ).index_add_(0, index, rows_grad),
        "the indices' sort alone": lambda: index.sort(),
    }
    for name, fn in codebook_grads.items():
        print(json.dumps({"piece": name, "ms": round(_timed_ms(fn), 4)}))


if __name__ == "__main__":
    main()
