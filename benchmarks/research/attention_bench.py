"""`python benchmarks/research/attention_bench.py`: one drafter layer's flex_attention, forward and
backward, under the step's real block mask, for a list of kernel tile configurations.

The step's attention runs at a fraction of the MFU of its matmuls (BENCHMARKS.md), and
flex_attention's tiles (BLOCK_M/N, BLOCK_M1/N1/M2/N2, stages, warps) are chosen by a heuristic
for plain causal masks. This times each configuration on the exact mask a step sees (documents,
sampled anchors, the own-block keys), compiled as the step compiles it, and checks each against
torch's default configuration (output and the three gradients). Cheaper than `bench drafter
--variants`: one compile of the attention per configuration instead of the whole step.
"""

from __future__ import annotations

import json
import traceback

import research_entry
import torch

from dflash_async.bench.drafter_bench import SHAPES, synthetic_pack
from dflash_async.model.attention_rule import flex_attend, flex_block_mask
from dflash_async.model.flops import mfu
from dflash_async.model.objective import sample_anchors
from dflash_async.model.step import visible_pairs
from dflash_async.runtime.devices import parse_device
from dflash_async.usage import ArgumentParser, require_cuda

# Named tile configurations (flex kernel_options; fwd_/bwd_ prefixes apply to one pass only).
# torch 2.11's Hopper defaults for bf16, head_dim 128: forward (BLOCK_M 128, BLOCK_N 64, 3
# stages, 8 warps), backward (BLOCK_M1 64, BLOCK_N1 128, BLOCK_M2 128, BLOCK_N2 64, 3 stages, 8
# warps). The step's BlockMask tile is 128: every block size here divides it.
CONFIGS: dict[str, dict[str, int | bool | str]] = {
    "default": {},
    "f128x128_s2w8": {
        "fwd_BLOCK_M": 128,
        "fwd_BLOCK_N": 128,
        "fwd_num_stages": 2,
        "fwd_num_warps": 8,
    },
    "f128x64_s3w4": {
        "fwd_BLOCK_M": 128,
        "fwd_BLOCK_N": 64,
        "fwd_num_stages": 3,
        "fwd_num_warps": 4,
    },
    "f128x64_s4w8": {
        "fwd_BLOCK_M": 128,
        "fwd_BLOCK_N": 64,
        "fwd_num_stages": 4,
        "fwd_num_warps": 8,
    },
    "f64x128_s3w4": {
        "fwd_BLOCK_M": 64,
        "fwd_BLOCK_N": 128,
        "fwd_num_stages": 3,
        "fwd_num_warps": 4,
    },
    "b64x64_s3w4": {
        "bwd_BLOCK_M1": 64,
        "bwd_BLOCK_N1": 64,
        "bwd_BLOCK_M2": 64,
        "bwd_BLOCK_N2": 64,
        "bwd_num_stages": 3,
        "bwd_num_warps": 4,
    },
    "b64x64_s3w8": {
        "bwd_BLOCK_M1": 64,
        "bwd_BLOCK_N1": 64,
        "bwd_BLOCK_M2": 64,
        "bwd_BLOCK_N2": 64,
        "bwd_num_stages": 3,
        "bwd_num_warps": 8,
    },
    "b32x128_s3w4": {
        "bwd_BLOCK_M1": 32,
        "bwd_BLOCK_N1": 128,
        "bwd_BLOCK_M2": 128,
        "bwd_BLOCK_N2": 32,
        "bwd_num_stages": 3,
        "bwd_num_warps": 4,
    },
    "b64x128_s2w8": {
        "bwd_BLOCK_M1": 64,
        "bwd_BLOCK_N1": 128,
        "bwd_BLOCK_M2": 128,
        "bwd_BLOCK_N2": 64,
        "bwd_num_stages": 2,
        "bwd_num_warps": 8,
    },
    "b64x128_s4w8": {
        "bwd_BLOCK_M1": 64,
        "bwd_BLOCK_N1": 128,
        "bwd_BLOCK_M2": 128,
        "bwd_BLOCK_N2": 64,
        "bwd_num_stages": 4,
        "bwd_num_warps": 8,
    },
    "b128x128_s2w8": {
        "bwd_BLOCK_M1": 128,
        "bwd_BLOCK_N1": 128,
        "bwd_BLOCK_M2": 128,
        "bwd_BLOCK_N2": 128,
        "bwd_num_stages": 2,
        "bwd_num_warps": 8,
    },
    "no_dq_write": {"WRITE_DQ": False},
    # flash-attn-4 (CuTe DSL) through flex_attention: needs flash_attn.cute importable
    # (`pip install -e ".[flash]"`); not in the default list of `--configs`
    "flash_backend": {"BACKEND": "FLASH"},
}
DEFAULT_CONFIGS = [name for name in CONFIGS if name != "flash_backend"]

LAYOUTS = {
    "contiguous": "both [1, H, Q, hd] contiguous",
    "strided": "both the [Q, H, hd] transpose (the step's layout)",
    "contiguous_q": "q contiguous, its output gradient the transpose (q made contiguous)",
}

# Largest relative Frobenius difference from the default configuration allowed for the output
# and each gradient. Both runs accumulate in fp32 (order differences ~1e-6 relative) and round to
# bf16 once (each element within 2^-9 relative of its fp32 value), so two of them differ by at
# most 2^-8 per element; 2^-7 leaves a factor of 2 for dq's atomic accumulation order.
REL_TOL = 2.0**-7


def attention_inputs(
    shape: str, *, token_budget: int, num_anchors: int, num_docs: int, device, strided_q: bool
):
    """Random q, k, v of one layer (bf16, requiring grad), the step's BlockMask for a synthetic
    pack with sampled anchors, and that layer's visible (query, key) pairs. strided_q: q laid out
    as the step lays it out ([rows, heads, hd] transposed: rows heads*hd apart), else contiguous."""
    config = SHAPES[shape]()
    batch = synthetic_pack(config, token_budget=token_budget, num_docs=num_docs, device=device)
    noise = torch.rand(
        token_budget + 1,
        generator=torch.Generator(device).manual_seed(0),
        device=device,
        dtype=torch.float64,
    )
    anchors = sample_anchors(batch.loss_mask, batch.doc_ids, num_anchors, noise=noise)
    B = config.block_size
    mask = flex_block_mask(batch.doc_ids, anchors.positions, anchors.valid, B)
    pairs = float(visible_pairs(batch.doc_ids, anchors.positions, anchors.valid, B))
    Q, S, hd = num_anchors * B, token_budget + num_anchors * B, config.head_dim
    g = torch.Generator(device).manual_seed(1)

    def rand(heads: int, rows: int, strided: bool = False) -> torch.Tensor:
        if strided:
            x = torch.randn(rows, heads, hd, generator=g, device=device, dtype=torch.bfloat16)
            return x.transpose(0, 1).unsqueeze(0).detach().requires_grad_()
        x = torch.randn(1, heads, rows, hd, generator=g, device=device, dtype=torch.bfloat16)
        return x.requires_grad_()

    q = rand(config.num_attention_heads, Q, strided_q)
    k, v = rand(config.num_key_value_heads, S), rand(config.num_key_value_heads, S)
    return q, k, v, mask, pairs, config


def time_config(attend, q, k, v, dout, reps: int) -> tuple[float, float, list[torch.Tensor]]:
    """(forward ms, backward ms) means over `reps`, and copies of [out, dq, dk, dv] of the last
    run (copies: a later backward accumulates into the .grad tensors in place)."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(3 * reps)]
    for _ in range(2):  # warm-up: compile, autotune, allocator
        q.grad = k.grad = v.grad = None
        out = attend(q, k, v)
        out.backward(dout)
    for i in range(reps):
        q.grad = k.grad = v.grad = None
        events[3 * i].record()
        out = attend(q, k, v)
        events[3 * i + 1].record()
        out.backward(dout)
        events[3 * i + 2].record()
    torch.cuda.synchronize()  # sync point: benchmark timing only
    fwd = sum(events[3 * i].elapsed_time(events[3 * i + 1]) for i in range(reps)) / reps
    bwd = sum(events[3 * i + 1].elapsed_time(events[3 * i + 2]) for i in range(reps)) / reps
    return fwd, bwd, [t.detach().clone() for t in (out, q.grad, k.grad, v.grad)]


def forward_only_ms(mask, flex, options, q, k, v, reps: int = 10) -> float | str:
    """A failed configuration's forward alone (no autograd), to tell which pass failed: its mean
    ms, or the forward's own error."""
    attend = flex_attend(mask, flex, options)
    q, k, v = (x.detach() for x in (q, k, v))
    try:
        with torch.no_grad():
            return round(time_path(lambda: attend(q, k, v), reps), 3)
    except Exception as error:
        return f"forward fails too: {str(error)[:200]}"


def time_path(run, reps: int) -> float:
    """Mean ms of run() over `reps` after 2 warm-up calls (compile, autotune; CUDA events)."""
    for _ in range(2):
        run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        run()
    end.record()
    torch.cuda.synchronize()  # sync point: benchmark timing only
    return start.elapsed_time(end) / reps


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (Frobenius, in fp32); the benches' measure of a candidate's result."""
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main(argv: list[str] | None = None) -> None:
    """One JSON line per configuration: fwd/bwd ms and MFU, and its difference from `default`."""
    parser = ArgumentParser(prog="python benchmarks/research/attention_bench.py")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    parser.add_argument("--token-budget", type=int, default=16384)
    parser.add_argument("--num-anchors", type=int, default=1024)
    parser.add_argument("--num-docs", type=int, default=4)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument(
        "--layout",
        choices=LAYOUTS,
        default="contiguous",
        help="q and the output gradient: " + "; ".join(LAYOUTS.values()),
    )
    parser.add_argument("--device", default="cuda:0", help="a CUDA device")
    parser.add_argument(
        "--configs",
        default=",".join(DEFAULT_CONFIGS),
        help=f"comma-separated, of: {', '.join(CONFIGS)}",
    )
    args = parser.parse_args(argv)
    names = args.configs.split(",")
    if unknown := [n for n in names if n not in CONFIGS]:
        parser.error(f"--configs: unknown {', '.join(unknown)} (known: {', '.join(CONFIGS)})")
    require_cuda("attention_bench.py", args.device)
    device = parse_device(args.device, setting="--device")
    torch.cuda.set_device(device)
    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    q, k, v, mask, pairs, config = attention_inputs(
        args.shape,
        token_budget=args.token_budget,
        num_anchors=args.num_anchors,
        num_docs=args.num_docs,
        device=device,
        strided_q=args.layout == "strided",
    )
    fwd_flops = 2 * 2 * config.num_attention_heads * config.head_dim * pairs
    dout = torch.randn_like(q)  # same strides as q
    if args.layout == "contiguous_q":  # the step's: q contiguous, its output gradient strided
        Q, H = q.shape[2], q.shape[1]
        dout = torch.randn(Q, H, q.shape[3], device=device, dtype=q.dtype).transpose(0, 1)[None]
    flex = torch.compile(torch.nn.attention.flex_attention.flex_attention, dynamic=False)
    reference = None
    for name in ["default", *(n for n in names if n != "default")]:
        try:
            fwd, bwd, results = time_config(
                flex_attend(mask, flex, CONFIGS[name]), q, k, v, dout, args.reps
            )
        except Exception as error:  # a configuration may not fit (shared memory): say so
            where = traceback.extract_tb(error.__traceback__)[-4:]  # the innermost frames
            row = {
                "config": name,
                "error": str(error)[:300],
                "at": [f"{f.filename}:{f.lineno} {f.name}" for f in where],
                "forward_only_ms": forward_only_ms(mask, flex, CONFIGS[name], q, k, v),
            }
            print(json.dumps(row), flush=True)
            continue
        reference = reference or results
        diffs = [rel_diff(a, b) for a, b in zip(results, reference, strict=True)]
        row = {
            "config": name,
            "fwd_ms": round(fwd, 3),
            "bwd_ms": round(bwd, 3),
            "fwd_mfu": round(mfu(fwd_flops, fwd / 1e3), 3),
            "bwd_mfu": round(mfu(2 * fwd_flops, bwd / 1e3), 3),
            "rel_diff_out_dq_dk_dv": [f"{d:.1e}" for d in diffs],
            "ok": max(diffs) <= REL_TOL,
            "options": CONFIGS[name],
            "layout": args.layout,
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    research_entry.run(main)
