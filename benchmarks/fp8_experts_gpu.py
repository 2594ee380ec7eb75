"""Where the FP8 MoE experts' time goes at the Qwen3-30B-A3B shape, one GPU.

One HF Qwen3-MoE experts module (128 experts of width 768, d = 2048, top 8) on T = 16384 tokens
routed by its own router: the bf16 HF experts (grouped_mm), `Fp8Experts` the sorted way with
its parts eager and compiled (the gate compiled torch, or the Triton kernel), the routed way
(both products fp8_moe_kernel's) and the split way (the default: its gate_up product, down
through `torch._scaled_grouped_mm`), and the grouped FP8 products alone (the sorted way's
`torch._scaled_grouped_mm` with fast accumulation, fbgemm-gpu-genai's where installed, the
routed kernel's launches: gather and SiLU gate for gate_up, weights and scatter for down);
median ms of 10 calls after 3, TFLOP/s of the products, and the relative difference of each FP8
output from the bf16 one. Then the routed way's row quantization under its launches. Then the gate and
its quantization alone: compiled torch and the Triton kernel's launches (how many of its e4m3
values differ from the compiled function's). Then one Fp8Linear at the Qwen3-8B MLP shape
(16384 x 4096 -> 12288), `use_fast_accum` off (the product's choice) and on.

    python benchmarks/fp8_experts_gpu.py [--launches-only] [--sweep] [--profile]

--launches-only: the experts rows and the products alone; --sweep: the products under more
launches than the tests run (to pick the defaults); --profile: the kernels of one call of the
sorted and the routed experts module (profile_target_gpu.kernel_table).
"""

from __future__ import annotations

import functools
import itertools
import json
import sys

import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from dflash_async.kernels import fp8_moe_launch
from dflash_async.kernels.fp8_gate_kernel import silu_gate_quantize
from dflash_async.kernels.fp8_moe_kernel import routed_mm
from dflash_async.targets.fp8 import fp8_experts, fp8_linear, fp8_routed
from dflash_async.targets.grouped_experts import gated as gate_values

# the routed kernel's launches timed (tests/kernels/test_fp8_moe_kernel_gpu.py runs each of them)
LAUNCHES = {  # (gate_up's, down's)
    "the defaults": (fp8_moe_launch.GATE_UP_LAUNCH, fp8_moe_launch.DOWN_LAUNCH),
    **{
        label: (launch, launch)
        for label, launch in {
            "128 columns, 4 stages": fp8_moe_launch.LAUNCH,
            "64 rows, 4 warps": fp8_moe_launch.Launch(block_rows=64, num_warps=4),
            "256 columns, 3 stages": fp8_moe_launch.Launch(block_n=256, num_stages=3),
            "64-wide reduction": fp8_moe_launch.Launch(block_k=64, num_stages=5),
        }.items()
    },
}
SWEEP = [  # (gate_up's, down's): (block_rows, block_n, block_k, num_warps, num_stages)
    ((128, 128, 128, 8, 3), (128, 256, 128, 8, 4)),
    ((128, 64, 128, 4, 4), (128, 128, 128, 4, 3)),
    ((128, 64, 128, 8, 4), (128, 256, 64, 8, 4)),
    ((64, 128, 128, 4, 4), (64, 128, 128, 4, 3)),
    ((128, 128, 64, 8, 5), (128, 128, 64, 8, 5)),
    ((64, 64, 128, 4, 4), (64, 256, 128, 4, 4)),
]


def _ms(fn, repeats: int = 10) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


@torch.no_grad()
def experts(*, launches_only: bool) -> None:
    config = Qwen3MoeConfig(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=1,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        vocab_size=1024,
    )
    with torch.device("cuda"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    mlp = model.model.layers[0].mlp
    x = torch.randn(16384, 2048, device="cuda", dtype=torch.bfloat16)
    logits = x @ mlp.gate.weight.t()  # the router's logits (its module's return differs by version)
    weights, index = torch.topk(torch.softmax(logits.float(), -1), 8, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
    ref = mlp.experts(x, index, weights)
    rows = {"bf16 HF experts (grouped_mm)": (lambda: mlp.experts(x, index, weights), None)}
    variants = {
        "sorted, parts eager": {"compile": False},
        "sorted, parts compiled, the gate compiled torch": {"compile": True, "gate_kernel": False},
        "sorted, parts compiled, the gate a Triton kernel": {"compile": True, "way": "sorted"},
        "routed (both products the routed kernel)": {"way": "routed"},
        "split (the default: routed gate_up, down _scaled_grouped_mm)": {},
    }
    modules = {}
    for name, options in variants.items():
        fp8 = modules[name] = fp8_experts.Fp8Experts(
            mlp.experts, out_dtype=torch.bfloat16, **options
        )
        out = fp8(x, index, weights)
        rel = float((out.float() - ref.float()).norm() / ref.float().norm())
        rows[f"Fp8Experts, {name}"] = (lambda fp8=fp8: fp8(x, index, weights), rel)
    for label, (fn, rel) in rows.items():
        print(json.dumps({"case": label, "ms": round(_ms(fn), 3), "rel_diff_vs_bf16": rel}))
    if "--profile" in sys.argv[1:]:
        from profile_target_gpu import kernel_table

        for name in (
            "sorted, parts compiled, the gate a Triton kernel",
            "routed (both products the routed kernel)",
            "split (the default: routed gate_up, down _scaled_grouped_mm)",
        ):
            module = modules[name]
            print(f"kernels of one call: {name}")
            kernel_table(lambda m=module: m(x, index, weights), top=14)
    launches = dict(LAUNCHES)
    if "--sweep" in sys.argv[1:]:
        launches.update(
            {
                f"sweep {g} {d}": (fp8_moe_launch.Launch(*g), fp8_moe_launch.Launch(*d))
                for g, d in SWEEP
            }
        )
    products(modules["routed (both products the routed kernel)"], x, index, weights, launches)
    row_kernel(
        x, index.numel(), modules["routed (both products the routed kernel)"].down_proj.shape[2]
    )
    if not launches_only:
        gate(modules["routed (both products the routed kernel)"], x, index)


def _product_row(label: str, fn, flops: int, want: torch.Tensor | None = None) -> torch.Tensor:
    ms = _ms(fn)
    out = fn()
    row = {"case": label, "ms": round(ms, 3), "tflops": round(flops / ms / 1e9)}
    if want is not None:  # the relative difference from the sorted way's product
        row["rel_diff_vs_sorted"] = float((out.float() - want.float()).norm() / want.float().norm())
    print(json.dumps(row))
    return out


def _fbgemm() -> bool:
    """Whether fbgemm-gpu-genai's grouped FP8 product is here (its wheel carried to the GPU)."""
    try:
        import fbgemm_gpu.experimental.gen_ai  # noqa: F401  (registers torch.ops.fbgemm)
    except ImportError:
        return False
    return hasattr(torch.ops.fbgemm, "f8f8bf16_rowwise_grouped_stacked")


def products(fp8, x, index, weights, launches) -> None:
    """The grouped FP8 products alone: the sorted way's, then each routed launch's."""
    s, d = index.numel(), x.shape[1]
    width = fp8.down_proj.shape[2]
    flops = {"gate_up": 2 * s * 2 * width * d, "down": 2 * s * d * width}
    x_q, x_scale, _, offsets = fp8_experts._sorted_rows(x, index, 128)
    h = fp8.grouped(
        x_q,
        x_scale,
        fp8.gate_up_proj,
        fp8.gate_up_scale,
        offsets,
        out_dtype=x.dtype,
        fast_accum=True,
    )
    h_q, h_scale = silu_gate_quantize(h)
    sorted_args = {
        "gate_up": (x_q, x_scale, fp8.gate_up_proj, fp8.gate_up_scale, offsets),
        "down": (h_q, h_scale, fp8.down_proj, fp8.down_scale, offsets),
    }
    sorted_out = {
        name: _product_row(
            f"{name} alone, sorted: _scaled_grouped_mm fast accumulation",
            lambda args=args: fp8.grouped(*args, out_dtype=x.dtype, fast_accum=True),
            flops[name],
        )
        for name, args in sorted_args.items()
    }
    if _fbgemm():  # the same sorted products through fbgemm-gpu-genai, where installed
        for name, (x_q, x_scale, w_q, w_scale, offsets) in sorted_args.items():
            counts = torch.diff(offsets, prepend=offsets.new_zeros(1)).long()
            _product_row(
                f"{name} alone, sorted: fbgemm f8f8bf16_rowwise_grouped_stacked",
                lambda a=(x_q, w_q, x_scale, w_scale, counts): (
                    torch.ops.fbgemm.f8f8bf16_rowwise_grouped_stacked(*a)
                ),
                flops[name],
                sorted_out[name],
            )
    # what each routed product should give: the sorted way's rows gated, and weighted and
    # placed at their routed pairs (the routing's order does not depend on block_rows)
    _, perm, _, _, pair_weights = fp8_routed.routed_rows(
        index,
        weights,
        num_experts=128,
        block_rows=fp8_moe_launch.LAUNCH.block_rows,
        weight_dtype=x.dtype,
    )
    placed = torch.empty_like(sorted_out["down"])
    placed[perm.long()] = (sorted_out["down"].float() * pair_weights[perm.long(), None]).to(
        placed.dtype
    )
    gated = gate_values(sorted_out["gate_up"].float(), torch.nn.functional.silu)
    wants = {"gate_up": gated.to(x.dtype), "down": placed}
    tokens_q, token_scale = fp8_linear.quantize_rows(x)
    for label, pair in launches.items():
        token, perm, offsets, blocks, pair_weights = fp8_routed.routed_rows(
            index,
            weights,
            num_experts=128,
            block_rows=pair[0].block_rows,
            weight_dtype=x.dtype,
        )
        routed_args = {
            "gate_up": (
                (tokens_q, token_scale, fp8.gate_up_proj, fp8.gate_up_scale, offsets, blocks),
                {"a_rows": token, "gated": True},
            ),
            "down": (
                (h_q, h_scale, fp8.down_proj, fp8.down_scale, offsets, blocks),
                {"out_rows": perm, "row_weights": pair_weights},
            ),
        }
        for (name, (args, routing)), launch in zip(routed_args.items(), pair, strict=True):
            problem = fp8_moe_launch.launch_problem(args[2], launch, gated="gated" in routing)
            if problem:
                print(
                    json.dumps(
                        {"case": f"{name} alone, routed kernel, {label}", "skipped": problem}
                    )
                )
                continue
            _product_row(
                f"{name} alone, routed kernel, {label} ({launch})",
                lambda a=args, r=routing, c=launch: routed_mm(*a, **r, launch=c),
                flops[name],
                wants[name],
            )


def row_kernel(x, pairs: int, width: int) -> None:
    """The routed way's two row quantizations (fp8_gate_kernel.quantize_rows_kernel) under its
    launches: the tokens [T, d] and the gate output [T * k, I] (bf16 in, e4m3 and a scale per
    row out); TB/s if each byte moves once, and the e4m3 values differing from the default's."""
    from dflash_async.kernels.fp8_gate_kernel import quantize_rows_kernel

    rows = {"tokens": x, "gate output": torch.randn(pairs, width, device=x.device, dtype=x.dtype)}
    for name, a in rows.items():
        moved = a.numel() * (a.element_size() + 1) + 4 * a.shape[0]
        want_q, _ = quantize_rows_kernel(a)
        for rows_, warps in itertools.product((1, 2, 4), (4, 8)):
            fn = functools.partial(quantize_rows_kernel, a, rows_per_program=rows_, num_warps=warps)
            ms = _ms(fn)
            q, _ = fn()
            differing = int((q.view(torch.uint8) != want_q.view(torch.uint8)).sum())
            print(
                json.dumps(
                    {
                        "case": f"quantize_rows_kernel, {name}, {rows_} rows, {warps} warps",
                        "ms": round(ms, 4),
                        "tb_s": round(moved / ms / 1e9, 2),
                        "e4m3_differing_from_default": differing,
                    }
                )
            )


def gate(fp8, x, index) -> None:
    x_q, x_scale, _, offsets = fp8_experts._sorted_rows(x, index, 128)
    h = fp8.grouped(x_q, x_scale, fp8.gate_up_proj, fp8.gate_up_scale, offsets, out_dtype=x.dtype)
    # the gate and its quantization alone, [131072, 2 x 768] bf16 -> e4m3 and scales; TB/s if
    # each byte moves once
    moved = h.numel() * h.element_size() + h.numel() // 2 + 4 * h.shape[0]
    compiled_gate = torch.compile(fp8_experts._gated_rows, dynamic=False)
    gates = {"compiled torch": lambda: compiled_gate(h, fp8.act_fn)}
    for rows_, warps in itertools.product((1, 2, 4), (4, 8)):
        gates[f"Triton, {rows_} rows, {warps} warps"] = lambda r=rows_, w=warps: silu_gate_quantize(
            h, rows_per_program=r, num_warps=w
        )
    want_q, want_scale = compiled_gate(h, fp8.act_fn)
    for label, fn in gates.items():
        ms = _ms(fn)
        q, scale = fn()
        print(
            json.dumps(
                {
                    "case": f"the gate and its quantization alone, {label}",
                    "ms": round(ms, 4),
                    "tb_s": round(moved / ms / 1e9, 2),
                    "e4m3_differing_from_compiled": int(
                        (q.view(torch.uint8) != want_q.view(torch.uint8)).sum()
                    ),
                    "scales_equal": bool(torch.equal(scale, want_scale)),
                }
            )
        )


@torch.no_grad()
def linear() -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(4096, 12288, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ lin.weight.float().t()
    fp8 = fp8_linear.Fp8Linear.from_linear(lin, out_dtype=torch.bfloat16)
    x_q, x_scale = fp8_linear.quantize_tokens(x)
    w = fp8.weight_scale.view(1, -1)
    flops = 2 * 16384 * 4096 * 12288
    cases = {"bf16 matmul": lambda: lin(x)}
    for fast in (False, True):
        cases[f"_scaled_mm rowwise, use_fast_accum={fast}"] = lambda fast=fast: torch._scaled_mm(
            x_q,
            fp8.weight.t(),
            scale_a=x_scale,
            scale_b=w,
            out_dtype=torch.bfloat16,
            use_fast_accum=fast,
        )
    for label, fn in cases.items():
        ms = _ms(fn)
        rel = float((fn().float() - ref).norm() / ref.norm())
        print(
            json.dumps(
                {
                    "case": label,
                    "ms": round(ms, 3),
                    "tflops": round(flops / ms / 1e9),
                    "rel_err_vs_fp32": rel,
                }
            )
        )


if __name__ == "__main__":
    launches_only = "--launches-only" in sys.argv[1:]
    experts(launches_only=launches_only)
    if not launches_only:
        linear()
