"""`python benchmarks/research/linear_bench.py`: what the drafter's fp32 master weights cost
around each bf16 matmul, for every linear shape of a drafter layer.

Today (`autocast`): under autocast each F.linear casts its fp32 weight to bf16 (read 4 + write 2
bytes per weight, at every use: k_proj and v_proj run twice, on the context and on the block);
backward makes the weight gradient in bf16, casts it to fp32 and adds it into the flat gradient
buffer (AccumulateGrad: 2 + 4 + 4 + 4 more). The candidate (`master`) keeps a bf16 copy of each
weight, written once per step where the optimizer writes the weight (2 bytes), and has the
weight-gradient GEMM accumulate in fp32 straight into the flat buffer (`torch.addmm` with
`out_dtype=torch.float32`), so none of those passes run. The graph-replayed step spends ~6-8 ms of
its ~275 ms in them at the Qwen3-8B shape (BENCHMARKS.md).

Per shape: forward + backward ms of each path (CUDA events, eager, after warm-up) and the
candidate's weight and input gradients against today's (relative Frobenius difference; tolerance
2^-7: today rounds each weight gradient to bf16 once, 2^-8 relative per element, before
accumulating, the candidate does not). A path that does not run on this torch prints its error.
"""

from __future__ import annotations

import json

import research_entry
import torch
from attention_bench import rel_diff, time_path

from dflash_async.bench.drafter_bench import SHAPES
from dflash_async.runtime.devices import parse_device
from dflash_async.usage import ArgumentParser, require_cuda

REL_TOL = 2.0**-7


class MasterLinear(torch.autograd.Function):
    """y = x @ w16^T with w16 the bf16 copy of the fp32 weight w; backward writes dw into
    w.grad (fp32, accumulated by the GEMM) and returns no gradient for w through autograd."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, w16: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w16)
        ctx.weight = w
        return x @ w16.T

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w16 = ctx.saved_tensors
        grad = ctx.weight.grad
        torch.addmm(grad, dy.T, x, out_dtype=torch.float32, out=grad)
        return dy @ w16, None, None


def layer_linears(
    shape: str, *, context: int, queries: int
) -> list[tuple[str, tuple[int, ...], int, int]]:
    """(name, rows of each use, in, out) of each distinct matmul of one drafter layer at T
    context rows and Q block rows: k_proj (v_proj alike) runs on the context and on the block."""
    c = SHAPES[shape]()
    d, hd, f = c.hidden_size, c.head_dim, c.intermediate_size
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    return [
        ("q_proj", (queries,), d, q),
        ("k_proj", (context, queries), d, kv),
        ("o_proj", (queries,), q, d),
        ("gate_proj", (queries,), d, f),
        ("down_proj", (queries,), f, d),
    ]


def bench_shape(uses: tuple[int, ...], fan_in: int, fan_out: int, *, device, reps: int) -> dict:
    """Both paths for one weight used on `uses` row counts (one input and output gradient each)."""
    g = torch.Generator(device).manual_seed(0)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=g, device=device, dtype=torch.bfloat16)

    xs = [rand(rows, fan_in).requires_grad_() for rows in uses]
    dys = [rand(rows, fan_out) for rows in uses]
    w = torch.nn.Parameter(torch.randn(fan_out, fan_in, generator=g, device=device) * 0.02)
    w.grad = torch.zeros_like(w)  # stands for its view of the flat gradient buffer
    w16 = w.detach().to(torch.bfloat16)

    def autocast() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            ys = [torch.nn.functional.linear(x, w) for x in xs]
        torch.autograd.backward(ys, dys)

    def master() -> None:
        torch.autograd.backward([MasterLinear.apply(x, w, w16) for x in xs], dys)

    results: dict = {"rows": list(uses), "in": fan_in, "out": fan_out}
    grads = {}
    for name, run in (("autocast", autocast), ("master", master)):
        try:
            results[f"{name}_ms"] = round(time_path(run, reps), 3)
            w.grad.zero_()
            for x in xs:
                x.grad = None
            run()
            grads[name] = [w.grad.clone(), *(x.grad.clone() for x in xs)]
        except Exception as error:  # the candidate's op may not exist on this torch: say so
            results[f"{name}_error"] = str(error)[:300]
    if len(grads) == 2:
        diffs = [rel_diff(a, b) for a, b in zip(grads["master"], grads["autocast"], strict=True)]
        results["rel_diff_dw_dxs"] = [f"{d:.1e}" for d in diffs]
        results["ok"] = max(diffs) <= REL_TOL
    return results


def main(argv: list[str] | None = None) -> None:
    """One JSON line per linear shape of a drafter layer."""
    parser = ArgumentParser(prog="python benchmarks/research/linear_bench.py")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    parser.add_argument("--token-budget", type=int, default=16384)
    parser.add_argument("--num-anchors", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--device", default="cuda:0", help="a CUDA device")
    args = parser.parse_args(argv)
    require_cuda("linear_bench.py", args.device)
    device = parse_device(args.device, setting="--device")
    torch.cuda.set_device(device)
    block = SHAPES[args.shape]().block_size
    for name, uses, fan_in, fan_out in layer_linears(
        args.shape, context=args.token_budget, queries=args.num_anchors * block
    ):
        row = bench_shape(uses, fan_in, fan_out, device=device, reps=args.reps)
        print(json.dumps({"linear": name, **row}), flush=True)


if __name__ == "__main__":
    research_entry.run(main)
