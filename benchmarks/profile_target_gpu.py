"""Where a packed target forward's GPU time goes, bf16 (CompiledExperts) against FP8 (fast
accumulation), on one shape of `bench target` (random weights, T = 16384, one pack).

    python benchmarks/profile_target_gpu.py --shape qwen3-30b-a3b [--top 25] [--graph]

Prints, per path, the forward's median ms over 3 calls and the CUDA kernels of one profiled
call grouped by name (total ms, calls, share), widest first, and the share of the matmul
kernels (names with gemm / scaled_mm / grouped / sm90 / cutlass / nvjet). `--graph` also
times the forward replayed from one CUDA graph (`select_target_forward(cuda_graph=True)`,
targets/graphed.py: the launch gaps between kernels are what it removes), checking the replayed
features equal the eager ones bit for bit. GPU only.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from dflash_async.bench.target_bench import _timed, document_lengths
from dflash_async.bench.target_shapes import shape_configs
from dflash_async.data.packing import layout_pack
from dflash_async.targets.forward import select_target_forward
from dflash_async.targets.fp8.fp8_linear import swap_fp8_matmuls
from dflash_async.targets.loading import text_config, text_model

MATMUL_WORDS = ("gemm", "scaled_mm", "grouped", "sm90", "cutlass", "nvjet", "xmma")


def kernel_table(fn, top: int) -> None:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()  # sync point: profiling only
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals[event.name[:90]]
            entry[0] += event.device_time_total / 1e3
            entry[1] += 1
    whole = sum(ms for ms, _ in totals.values())
    matmul = sum(ms for name, (ms, _) in totals.items() if any(w in name for w in MATMUL_WORDS))
    print(f"  kernels {whole:.1f} ms busy; matmul kernels {matmul:.1f} ms ({matmul / whole:.2f})")
    for name, (ms, calls) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {ms:8.2f} ms {calls:5d}x {ms / whole:5.3f}  {name}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--token-budget", type=int, default=16384)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--graph", action="store_true")
    options = parser.parse_args()
    config, layer_ids = shape_configs()[options.shape]
    with torch.device("cuda"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.eval().requires_grad_(False)
    T, d = options.token_budget, text_config(model).hidden_size
    lengths = document_lengths(T, 0)
    rng = np.random.default_rng(0)
    docs = [(rng.integers(0, 32000, n), np.ones(n, dtype=bool)) for n in lengths]
    layout = layout_pack(docs, T).to("cuda")
    out = torch.empty(T, len(layer_ids) * d, dtype=torch.bfloat16, device="cuda")
    for label in ("bf16 + CompiledExperts", "fp8 fast accumulation"):
        if label.startswith("fp8"):
            torch._dynamo.reset()
            swap_fp8_matmuls(text_model(model).layers, device=torch.device("cuda"))

        def forward(graph: bool):
            return select_target_forward(
                model,
                layer_ids,
                token_budget=T,
                max_batch_tokens=T,
                packed_hybrid=True,
                experts="compiled",
                cuda_graph=graph,
            )

        path = forward(graph=False)

        def call(path=path):
            return path.forward(layout.input_ids, layout.position_ids, layout.doc_ids, out, lengths)

        first, seconds = _timed(call, 3)
        print(
            f"== {options.shape} {label}: {path.name}, median {seconds * 1e3:.1f} ms "
            f"({lengths.sum() / seconds:,.0f} tokens/s), first call {first:.1f} s"
        )
        kernel_table(call, options.top)
        if options.graph:  # the product's graphed forward (targets/graphed.py)
            eager = call().clone()
            graphed = forward(graph=True)
            _, seconds = _timed(lambda g=graphed: call(g), 5)
            print(
                f"   one CUDA graph: median {seconds * 1e3:.1f} ms "
                f"({lengths.sum() / seconds:,.0f} tokens/s), features equal to eager: "
                f"{torch.equal(out, eager)}"
            )


if __name__ == "__main__":
    main()
