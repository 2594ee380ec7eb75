"""`python -m dflash_async bench target`: HF reference vs the selected fast path, per target shape.

For each shape (random weights built in memory on the GPU, bf16), one pack of T tokens of
documents with chat-like lengths (lognormal, mean ~700) in the fixed drafter layout goes through
1. the HF reference: right-padded 2-D batches of whole documents (`HFPaddedForward`), and
2. the path `select_target_forward` picks (packed, compiled, document-causal),
each writing the captured layers' features [T, k*d]. Printed per path: tokens/s, MFU against the
measured H200 bf16 peak (780 TFLOP/s, docs/GPU.md), the first-call (compile) seconds, the max
abs difference of the fast features from the reference, the reference's largest feature and the
relative (Frobenius) difference, and the weights' GPU bytes. `--quantize none,fp8` adds an FP8
row per shape (target/fp8_linear.py: the same model's decoder matmuls in e4m3, row-wise), its
difference taken against the bf16 fast path and shown next to bf16's own (fast vs HF). Whether such a bf16 difference is noise is settled by the GPU
tests (tests/test_target_gpu.py, test_target_hybrid.py): the fast path is no farther from the
fp32 model than the HF path is.
"""

from __future__ import annotations

import gc
import json
import sys
import time

import numpy as np
import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from dflash_async.data.packing import layout_pack
from dflash_async.model.flops import H200_BF16_PEAK_FLOPS, mfu
from dflash_async.target.forward import HFPaddedForward, select_target_forward
from dflash_async.target.fp8_linear import swap_fp8_matmuls
from dflash_async.target.loading import decoder_layers, text_config, text_model
from dflash_async.usage import ArgumentParser, positive_int, require_cuda


def shape_configs() -> dict[str, tuple[PretrainedConfig, tuple[int, ...]]]:
    """Public model shapes (config values as published) and the captured layer ids."""
    from transformers import Qwen3_5TextConfig, Qwen3Config, Qwen3MoeConfig

    qwen = dict(vocab_size=151936, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                tie_word_embeddings=False, max_position_embeddings=40960)  # fmt: skip
    return {
        "qwen3-8b": (
            Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=128, **qwen),
            (1, 9, 17, 25, 33),
        ),
        "qwen3.5-9b": (
            Qwen3_5TextConfig(hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                              num_attention_heads=16, num_key_value_heads=4, head_dim=256,
                              linear_num_key_heads=16, linear_num_value_heads=32,
                              linear_key_head_dim=128, linear_value_head_dim=128,
                              vocab_size=248320, tie_word_embeddings=False),
            (1, 8, 15, 22, 29),
        ),
        "qwen3-30b-a3b": (
            Qwen3MoeConfig(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                           num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                           num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                           **qwen),
            (1, 12, 23, 34, 44),
        ),
    }  # fmt: skip


def document_lengths(token_budget: int, seed: int) -> np.ndarray:
    """Chat-like lengths (lognormal around 700, 64..3072) filling the budget, last one cut."""
    rng = np.random.default_rng(seed)
    lengths, total = [], 0
    while total < token_budget - 64:
        n = int(np.clip(rng.lognormal(np.log(700), 0.6), 64, 3072))
        n = min(n, token_budget - total)
        lengths.append(n)
        total += n
    return np.array(lengths)


def forward_flops(model, layer_ids, lengths: np.ndarray) -> float:
    """Forward FLOPs over the real tokens: 2 per multiply-add of every weight matrix of the layers
    that run (MoE experts at top_k / num_experts), plus QK^T and PV over the visible pairs of the
    full-attention layers. Norms, rotary and the linear-attention recurrence are not counted."""
    config, tokens = text_config(model), float(lengths.sum())
    pairs = float((lengths * (lengths + 1) // 2).sum())  # document-causal (query, key) pairs
    flops = 0.0
    for layer in list(decoder_layers(model))[: max(layer_ids) + 1]:
        for name, p in layer.named_parameters():
            if p.ndim < 2 or name.endswith("scale"):  # FP8 rows' scales are no matmul
                continue
            share = 1.0
            if ".experts." in f".{name}" and getattr(config, "num_experts", None):
                share = config.num_experts_per_tok / config.num_experts
            flops += 2 * tokens * p.numel() * share
        attn = getattr(layer, "self_attn", None)
        if attn is not None:
            heads = config.num_attention_heads
            flops += 2 * 2 * heads * attn.head_dim * pairs
    return flops


def _timed(fn, repeats: int) -> tuple[float, float]:
    """(first call s, median s of `repeats` later calls), CUDA events around each call."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()  # sync point: benchmark timing only
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / 1e3)
    return first, float(np.median(times))


def _weight_bytes(before: int) -> int:
    """Bytes allocated on the GPU since `before` (the target's weights, after a cache flush)."""
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated() - before


def bench_shape(
    name: str,
    *,
    token_budget: int,
    repeats: int,
    seed: int = 0,
    quantize: tuple[str, ...] = ("none",),
) -> list[dict]:
    """One row per `quantize` entry for this shape: `none` (bf16: HF reference and the fast
    path) and `fp8` (the same model's decoder matmuls swapped into target/fp8_linear.py's
    e4m3 row-wise linears and experts, the fast path again). The bf16 row always runs: FP8's
    feature error is measured against its fast path's features, next to bf16's own noise (its
    fast path against HF)."""
    config, layer_ids = shape_configs()[name]
    before = torch.cuda.memory_allocated()
    with torch.device("cuda"):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.eval().requires_grad_(False)
    bf16_bytes = _weight_bytes(before)
    d = text_config(model).hidden_size
    lengths = document_lengths(token_budget, seed)
    rng = np.random.default_rng(seed)
    docs = [(rng.integers(0, 32000, n), np.ones(n, dtype=bool)) for n in lengths]
    layout = layout_pack(docs, token_budget).to("cuda")
    args = (layout.input_ids, layout.position_ids, layout.doc_ids)
    flops = forward_flops(model, layer_ids, lengths)  # the bf16 model's matmuls; FP8's the same
    row = {
        "shape": name,
        "quantize": "none",
        "T": token_budget,
        "documents": len(lengths),
        "layers": max(layer_ids) + 1,
        "weight_bytes": bf16_bytes,
    }

    def measure(target: dict, label: str, forward) -> torch.Tensor:
        out = torch.empty(token_budget, len(layer_ids) * d, dtype=torch.bfloat16, device="cuda")
        first, seconds = _timed(lambda: forward(*args, out, lengths), repeats)
        target[label] = {"tokens_per_s": round(lengths.sum() / seconds), "mfu": round(mfu(flops, seconds), 3),
                         "ms": round(seconds * 1e3, 1), "first_call_s": round(first, 1)}  # fmt: skip
        return out

    def fast_path(target):
        return select_target_forward(
            target, layer_ids, token_budget=token_budget, max_batch_tokens=token_budget,
            packed_hybrid=True,
        )  # fmt: skip

    reference = measure(row, "hf", HFPaddedForward(model, layer_ids, max_batch_tokens=token_budget))
    path = fast_path(model)
    row["fast_path"], row["fast_reason"] = path.name, path.reason
    fast = measure(row, "fast", path.forward)
    _differences(row, fast, reference)
    rows = [row]
    if "fp8" in quantize:
        del path, reference
        torch._dynamo.reset()  # drop the bf16 graphs (and anything they hold) before the swap
        counts = swap_fp8_matmuls(text_model(model).layers, device=torch.device("cuda"))
        fp8 = {k: row[k] for k in ("shape", "T", "documents", "layers")}
        fp8.update(quantize="fp8", weight_bytes=_weight_bytes(before), swapped=counts)
        path = fast_path(model)
        fp8["fast_path"], fp8["fast_reason"] = path.name, path.reason
        _differences(fp8, measure(fp8, "fast", path.forward), fast)  # against bf16's fast path
        fp8["bf16_rel_diff"] = row["rel_diff"]  # bf16's own noise, for comparison
        rows.append(fp8)
    del model
    torch.cuda.empty_cache()
    return rows


def _differences(row: dict, features: torch.Tensor, reference: torch.Tensor) -> None:
    diff, ref = features.float() - reference.float(), reference.float()
    row["max_abs_diff"] = float(diff.abs().max())
    row["ref_max_abs"] = float(ref.abs().max())
    row["rel_diff"] = float(diff.norm() / ref.norm())


def main(argv: list[str] | None = None) -> None:
    """bench target [--shapes a,b] [--token-budget T] [--repeats N] [--quantize none,fp8]: one
    JSON line per shape and quantization on stdout, the side-by-side table on stderr; GPU only
    (without CUDA a UsageError, exit 2)."""
    parser = ArgumentParser(prog="python -m dflash_async bench target")
    parser.add_argument("--shapes", default="qwen3-8b,qwen3.5-9b,qwen3-30b-a3b")
    parser.add_argument("--token-budget", type=positive_int, default=16384)
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--quantize", default="none", help="none,fp8: bf16 and FP8 rows")
    options = parser.parse_args(argv)
    quantize = tuple(options.quantize.split(","))
    if not set(quantize) <= {"none", "fp8"}:
        parser.error(f"--quantize {options.quantize!r}: a list of none and fp8")
    require_cuda("bench target", "cuda:0")
    rows = []
    for name in options.shapes.split(","):
        for row in bench_shape(name, token_budget=options.token_budget, repeats=options.repeats,
                               quantize=quantize):  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    peak = H200_BF16_PEAK_FLOPS / 1e12
    table = [
        f"MFU against {peak:.0f} TFLOP/s, the measured H200 bf16 matmul peak (docs/GPU.md), for "
        "FP8 rows too; fp8 rows: diff against the bf16 fast path, bf16 noise = bf16 fast vs HF",
        f"{'shape':<15}{'quant':<6}{'path':<14}{'HF tok/s':>10}{'MFU':>6}{'fast tok/s':>11}"
        f"{'MFU':>6}{'compile s':>10}{'weights GB':>11}{'max|diff|':>10}{'max|ref|':>9}"
        f"{'rel diff':>9}{'bf16 noise':>11}",
    ]
    for r in rows:
        hf = r.get("hf", {"tokens_per_s": "-", "mfu": "-"})
        noise = f"{r['bf16_rel_diff']:.2g}" if "bf16_rel_diff" in r else "-"
        table.append(
            f"{r['shape']:<15}{r['quantize']:<6}{r['fast_path']:<14}{hf['tokens_per_s']:>10}"
            f"{hf['mfu']:>6}{r['fast']['tokens_per_s']:>11}{r['fast']['mfu']:>6}"
            f"{r['fast']['first_call_s']:>10}{r['weight_bytes'] / 1e9:>11.2f}"
            f"{r['max_abs_diff']:>10.3g}{r['ref_max_abs']:>9.3g}{r['rel_diff']:>9.2g}{noise:>11}"
        )
    print("\n".join(table), file=sys.stderr)  # stdout holds only the JSON lines
