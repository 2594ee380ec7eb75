"""Where the FP8 MoE experts' time goes at the Qwen3-30B-A3B shape (issue 31), one H200.

One HF Qwen3-MoE experts module (128 experts of width 768, d = 2048, top 8) on T = 16384 tokens
routed by its own router: the bf16 HF experts (grouped_mm), `Fp8Experts` with its parts eager
and compiled (the gate compiled torch, or the Triton kernel), and the two grouped FP8 products
alone; median ms of 10 calls after 3, and the relative difference of each FP8 output from the
bf16 one. Then the gate and its quantization alone: compiled torch and the Triton kernel's
launches (how many of its e4m3 values differ from the compiled function's). Then one
Fp8Linear at the Qwen3-8B MLP shape (16384 x 4096 -> 12288), `use_fast_accum` off (the
product's choice) and on.

    python benchmarks/fp8_experts_gpu.py
"""

from __future__ import annotations

import itertools
import json

import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from dflash_async.target import fp8_linear
from dflash_async.target.fp8_gate_kernel import silu_gate_quantize


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
def experts() -> None:
    config = Qwen3MoeConfig(hidden_size=2048, intermediate_size=6144, num_hidden_layers=1,
                            num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                            num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                            vocab_size=1024)  # fmt: skip
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
        "parts eager": {"compile": False},
        "parts compiled, the gate compiled torch": {"compile": True, "gate_kernel": False},
        "parts compiled, the gate a Triton kernel (the default)": {"compile": True},
    }
    for name, options in variants.items():
        fp8 = fp8_linear.Fp8Experts(mlp.experts, out_dtype=torch.bfloat16, **options)
        out = fp8(x, index, weights)
        rel = float((out.float() - ref.float()).norm() / ref.float().norm())
        rows[f"Fp8Experts, {name}"] = (lambda fp8=fp8: fp8(x, index, weights), rel)
    x_q, x_scale, _, offsets = fp8_linear._sorted_rows(x, index, 128)
    h = fp8.grouped(x_q, x_scale, fp8.gate_up_proj, fp8.gate_up_scale, offsets, out_dtype=x.dtype)
    h_q, h_scale = silu_gate_quantize(h)
    rows["the two grouped FP8 products alone"] = (
        lambda: (
            fp8.grouped(
                x_q, x_scale, fp8.gate_up_proj, fp8.gate_up_scale, offsets, out_dtype=x.dtype
            ),
            fp8.grouped(h_q, h_scale, fp8.down_proj, fp8.down_scale, offsets, out_dtype=x.dtype),
        ),
        None,
    )
    for label, (fn, rel) in rows.items():
        print(json.dumps({"case": label, "ms": round(_ms(fn), 3), "rel_diff_vs_bf16": rel}))
    # the gate and its quantization alone, [131072, 2 x 768] bf16 -> e4m3 and scales; TB/s if
    # each byte moves once
    moved = h.numel() * h.element_size() + h.numel() // 2 + 4 * h.shape[0]
    compiled_gate = torch.compile(fp8_linear._gated_rows, dynamic=False)
    gates = {"compiled torch": lambda: compiled_gate(h, fp8.act_fn)}
    for rows_, warps in itertools.product((1, 2, 4), (4, 8)):
        gates[f"Triton, {rows_} rows, {warps} warps"] = lambda r=rows_, w=warps: silu_gate_quantize(
            h, rows_per_program=r, num_warps=w
        )
    want_q, want_scale = compiled_gate(h, fp8.act_fn)
    for label, fn in gates.items():
        ms = _ms(fn)
        q, scale = fn()
        print(json.dumps({"case": f"the gate and its quantization alone, {label}",
                          "ms": round(ms, 4), "tb_s": round(moved / ms / 1e9, 2),
                          "e4m3_differing_from_compiled": int((q.view(torch.uint8) != want_q.view(
                              torch.uint8)).sum()),
                          "scales_equal": bool(torch.equal(scale, want_scale))}))  # fmt: skip


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
    experts()
    linear()
