"""`python -m dflash_async bench target`: HF reference vs the selected fast path, per target shape.

For each shape (random weights built in memory on the GPU, bf16), one pack of T tokens of
documents with chat-like lengths (lognormal, mean ~700) in the fixed drafter layout goes through
1. a reference (`--reference`, REFERENCES): HF's forward on right-padded 2-D batches of whole
   documents (`hf`, HFPaddedForward), or the generic path a family without a packed forward
   takes (`generic`, GenericForward: each group of equal-length documents alone), and
2. the path `select_target_forward` picks (packed, compiled, document-causal),
each writing the captured layers' features [T, k*d]. Printed per path: tokens/s, MFU against the
measured H200 bf16 peak (780 TFLOP/s, docs/GPU.md), the first-call (compile) seconds, the max
abs difference of the fast features from the reference, the reference's largest feature and the
relative (Frobenius) difference, and the weights' GPU bytes. `--quantize none,fp8` adds an FP8
row per shape (targets/fp8/fp8_linear.py: the same model's decoder matmuls in e4m3, row-wise), its
difference taken against the bf16 fast path and shown next to bf16's own (fast vs HF). Whether such a bf16 difference is noise is settled by the GPU
tests (tests/targets/test_target_gpu.py, test_target_hybrid.py): the fast path is no farther from the
fp32 model than the HF path is.
"""

from __future__ import annotations

import itertools
import json
import sys
import time

import numpy as np
import torch
from transformers import AutoModel
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
)

from dflash_async.bench.target_shapes import shape_configs, unavailable_shapes
from dflash_async.data.packing import layout_pack
from dflash_async.model.flops import H200_BF16_PEAK_FLOPS, mfu
from dflash_async.targets.config_readers import experts_per_token, latent_head_dims
from dflash_async.targets.forward import HFPaddedForward, select_target_forward
from dflash_async.targets.fp8.fp8_experts import WAYS, set_experts_way
from dflash_async.targets.fp8.fp8_linear import set_fast_accum, swap_fp8_matmuls
from dflash_async.targets.generic import GenericForward
from dflash_async.targets.generic_config import causal_lm_auto_class
from dflash_async.targets.grouped_experts import CompiledExperts
from dflash_async.targets.loading import decoder_layers, text_config, text_model
from dflash_async.usage import ArgumentParser, positive_int, require_cuda


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
    that run (a routed expert at top_k / num_experts of the tokens), plus QK^T and PV over the
    visible pairs of each attention layer (document-causal, within the window of a sliding
    layer; MLA: the query-key width nope + rope, the value width v_head_dim; sparse attention:
    the indexer's scores and the top-k keys attended, beside DeepSeek-V4's window and compressed
    entries). Norms, rotary, the routers' top-k and the linear-attention recurrence are not
    counted. LongCat-Flash's
    zero-expert choices count as routed ones: its packed forward runs them as stand-in expert
    rows of weight 0."""
    config, tokens = text_config(model), float(lengths.sum())
    top_k = experts_per_token(config)
    flops = 0.0
    for index, layer in enumerate(list(decoder_layers(model))[: max(layer_ids) + 1]):
        for name, p in layer.named_parameters():
            if p.ndim < 2 or name.endswith("scale"):  # biases, norms, sinks; FP8 scales
                continue
            flops += 2 * tokens * p.numel() * _expert_share(name, p, config, top_k)
        attns = getattr(layer, "self_attn", None)
        if attns is not None and not isinstance(attns, torch.nn.ModuleList):
            attns = [attns]  # one attention; LongCat-Flash's layers hold a ModuleList of two
        for attn in attns or ():
            flops += _attention_flops(config, index, lengths, getattr(attn, "head_dim", None))
    return flops


def _expert_share(name: str, p: torch.Tensor, config, top_k: int) -> float:
    """The fraction of tokens a weight sees: top_k / experts for routed experts, else 1."""
    if not top_k or ".experts." not in f".{name}.":
        return 1.0
    if p.ndim == 3:  # fused experts [E, ...]
        return top_k / p.shape[0]
    experts = next(
        getattr(config, n)
        for n in ("num_experts", "num_local_experts", "n_routed_experts")
        if getattr(config, n, None)
    )
    return top_k / experts


# Attention kinds that see a window of their own document (DeepSeek-V4's compressed kinds also
# see one entry per `compress_rates[kind]` tokens before the query)
_WINDOWED_KINDS = frozenset(
    {"sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"}
)
# Sparse kinds: a lightning indexer scores every key (DeepSeek-V3.2, GLM-5) or compressed entry
# (DeepSeek-V4) a query sees, and the query attends to the `index_topk` best of them
_INDEXED_KINDS = frozenset({"indexed_attention", "compressed_sparse_attention"})


def _attention_flops(config, index: int, lengths: np.ndarray, layer_head_dim=None) -> float:
    """QK^T and PV over the (query, key) pairs a layer computes. `layer_head_dim`: the layer's
    own head width where it has one (Gemma 4's full layers are twice as wide as its sliding
    ones; DeepSeek-V4's 512-wide heads, one K=V head read as both)."""
    layer_types = getattr(config, "layer_types", None) or ()
    kind = layer_types[index] if index < len(layer_types) else "full_attention"
    if kind == "linear_attention":
        return 0.0
    # query i (1-based in its document) sees its document's i keys; within a window, the W - 1
    # before it and itself (HF's rule)
    i = np.concatenate([np.arange(1, m + 1) for m in lengths]).astype(np.float64)
    window = getattr(config, "sliding_window", None)
    windowed = kind in _WINDOWED_KINDS and window
    keys = np.minimum(i, window) if windowed else i
    rate = (getattr(config, "compress_rates", None) or {}).get(kind)
    scored = 0.0
    if rate or kind in _INDEXED_KINDS:
        entries = np.floor(i / (rate or 1))  # compressed entries; no rate: the keys themselves
        if kind in _INDEXED_KINDS:
            shared = getattr(config, "indexer_types", None) or ()  # GLM-5: reuses the top-k
            if index >= len(shared) or shared[index] != "shared":
                scored = 2.0 * config.index_n_heads * config.index_head_dim * entries.sum()
            entries = np.minimum(entries, config.index_topk)
        keys = (keys if windowed else 0.0) + entries
    heads = config.num_attention_heads
    widths = latent_head_dims(config)
    if widths:  # MLA: query-key width nope + rope, value width v_head_dim
        per_pair = 2 * heads * sum(widths)
    else:
        head_dim = (
            layer_head_dim or getattr(config, "head_dim", None) or config.hidden_size // heads
        )
        per_pair = 2 * 2 * heads * head_dim
    return float(per_pair * keys.sum() + scored)


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


def bench_model(config, *, dtype: torch.dtype) -> torch.nn.Module:
    """The shape's model with random weights on the current device: its causal LM through the
    auto class its checkpoints load with, or for a text config no such class takes (a
    multimodal wrapper's language model: Muse) the decoder stack alone, what a wrapper's target
    worker runs."""
    registered = (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
    if any(config.model_type in names for names in registered):
        return causal_lm_auto_class(config).from_config(config, dtype=dtype)
    return AutoModel.from_config(config, dtype=dtype)


def weight_bytes(model: torch.nn.Module, layer_ids: list[int]) -> tuple[int, int]:
    """(bytes of all the model's parameters and buffers, bytes of those a run's target worker
    holds: the input embedding and the decoder layers up to the last captured one, as
    targets/loading.py loads them; no final norm, no lm_head, no later layers). Each tensor once
    (tied weights share storage). Counted from the tensors, not from the allocator, so the
    activations alive at that moment (a previous row's output features, 0.67 GB at the Qwen3-8B
    shape) are not counted as weights."""

    def total(modules) -> int:
        seen: dict[int, int] = {}
        for module in modules:
            for t in [*module.parameters(), *module.buffers()]:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(seen.values())

    decoder = text_model(model)
    held = [decoder.embed_tokens, *decoder_layers(model)[: max(layer_ids) + 1]]
    return total([model]), total(held)


# --reference name -> the reference forward (model, layer_ids, max_batch_tokens) it times
REFERENCES = {
    "hf": lambda model, ids, tokens: HFPaddedForward(model, ids, max_batch_tokens=tokens),
    "generic": lambda model, ids, tokens: GenericForward(model, ids, tokens),
}


def bench_shape(
    name: str,
    *,
    token_budget: int,
    repeats: int,
    seed: int = 0,
    quantize: tuple[str, ...] = ("none",),
    experts: tuple[str, ...] = ("hf",),
    experts_ways: tuple[str, ...] = ("default",),
    cuda_graph: bool = False,
    reference: str = "hf",
) -> list[dict]:
    """One row per `quantize` entry for this shape: `none` (bf16: the reference and the fast
    path) and `fp8` (the same model's decoder matmuls swapped into targets/fp8/fp8_linear.py's
    e4m3 row-wise linears and experts, the fast path again). The bf16 row always runs: FP8's
    feature error is measured against its fast path's features, next to bf16's own noise (its
    fast path against HF). `experts` "compiled" adds a bf16 row with the fused experts swapped
    into grouped_experts.CompiledExperts (the fast path again, its features against the HF
    experts' fast path); the FP8 row then quantizes those same experts. `experts_ways`: one FP8
    row per entry, the FP8 experts run that way ("default": as constructed; else
    one of fp8_experts.WAYS). `cuda_graph`: every fast path timed again replayed from one CUDA
    graph (targets/graphed.py, DFLASH_TARGET__CUDA_GRAPH), as "graph" in the same row, with the
    memory its graph holds. `reference`: the REFERENCES entry timed first, its row under that
    key (`row["reference"]` names it)."""
    config, layer_ids = shape_configs()[name]
    with torch.device("cuda"):
        torch.manual_seed(seed)
        model = bench_model(config, dtype=torch.bfloat16)
    model.eval().requires_grad_(False)
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
    }
    row["weight_bytes"], row["held_bytes"] = weight_bytes(model, layer_ids)

    def measure(target: dict, label: str, forward) -> torch.Tensor:
        out = torch.empty(token_budget, len(layer_ids) * d, dtype=torch.bfloat16, device="cuda")
        first, seconds = _timed(lambda: forward(*args, out, lengths), repeats)
        target[label] = {
            "tokens_per_s": round(lengths.sum() / seconds),
            "mfu": round(mfu(flops, seconds), 3),
            "ms": round(seconds * 1e3, 1),
            "first_call_s": round(first, 1),
        }
        return out

    def fast_path(target, experts: str, graph: bool = False):
        return select_target_forward(
            target,
            layer_ids,
            token_budget=token_budget,
            max_batch_tokens=token_budget,
            packed_hybrid=True,
            experts=experts,
            cuda_graph=graph,
        )

    def measure_fast(target: dict, model, experts: str) -> torch.Tensor:
        """The fast path's row ("fast"), and with `cuda_graph` replayed ("graph"; the memory
        the graph holds, GB: its pool, its buffers and one features tensor; whether it wrote
        the same features)."""
        path = fast_path(model, experts)
        target["fast_path"], target["fast_reason"] = path.name, path.reason
        out = measure(target, "fast", path.forward)
        if cuda_graph:
            torch.cuda.empty_cache()  # only blocks in use stay reserved: the graph's pool does
            reserved = torch.cuda.memory_reserved()
            graphed_path = fast_path(model, experts, graph=True)
            graphed = measure(target, "graph", graphed_path.forward)
            torch.cuda.empty_cache()
            held = torch.cuda.memory_reserved() - reserved  # the pool, its buffers, `graphed`
            target["graph"]["held_gb"] = round(held / 1e9, 2)
            target["graph"]["features_equal"] = bool(torch.equal(graphed, out))
        return out

    row["reference"] = reference  # the key of its measurement in the row
    reference_forward = REFERENCES[reference](model, layer_ids, token_budget)
    reference_out = measure(row, reference, reference_forward)
    fast = measure_fast(row, model, "hf")
    _differences(row, fast, reference_out)
    rows = [row]
    if "compiled" in experts:
        torch._dynamo.reset()
        compiled = {
            k: row[k]
            for k in ("shape", "quantize", "T", "documents", "layers", "weight_bytes", "held_bytes")
        }
        # the fast path swaps the experts in place (the runs' default)
        _differences(compiled, measure_fast(compiled, model, "compiled"), fast)
        swapped = sum(isinstance(m, CompiledExperts) for m in model.modules())
        compiled.update(experts="compiled", swapped={"swapped": swapped})
        compiled["bf16_rel_diff"] = row["rel_diff"]
        rows.append(compiled)
    fp8_modes = [q for q in ("fp8", "fp8-fast") if q in quantize]
    if fp8_modes:
        del reference_out
        torch._dynamo.reset()  # drop the bf16 graphs (and anything they hold) before the swap
        counts = swap_fp8_matmuls(text_model(model).layers, device=torch.device("cuda"))
        for mode, way in itertools.product(fp8_modes, experts_ways):  # fp8-fast: fast accumulation
            torch._dynamo.reset()
            set_fast_accum(text_model(model).layers, mode == "fp8-fast")
            if way != "default":
                set_experts_way(text_model(model).layers, way)
            fp8 = {k: row[k] for k in ("shape", "T", "documents", "layers")}
            fp8.update(quantize=mode, swapped=counts, experts_way=way)
            fp8["weight_bytes"], fp8["held_bytes"] = weight_bytes(model, layer_ids)
            # the experts are FP8 ones now; the difference against bf16's fast path
            _differences(fp8, measure_fast(fp8, model, "hf"), fast)
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


def _listed(parser, text: str, flag: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """A comma-separated option's entries; a usage error (exit 2) naming any not `allowed`."""
    entries = tuple(text.split(","))
    if unknown := [e for e in entries if e not in allowed]:
        parser.error(f"{flag} {','.join(unknown)}: a list of {', '.join(allowed)}")
    return entries


def main(argv: list[str] | None = None) -> None:
    """bench target [--shapes a,b] [--token-budget T] [--repeats N] [--quantize none,fp8]: one
    JSON line per shape and quantization on stdout, the side-by-side table on stderr; GPU only
    (without CUDA a UsageError, exit 2)."""
    parser = ArgumentParser(prog="python -m dflash_async bench target")
    parser.add_argument("--shapes", default="qwen3-8b,qwen3.5-9b,qwen3-30b-a3b")
    parser.add_argument("--token-budget", type=positive_int, default=16384)
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument(
        "--quantize",
        default="none",
        help="none,fp8,fp8-fast: bf16 and FP8 rows (fp8-fast: fast accumulation)",
    )
    parser.add_argument(
        "--experts",
        default="hf",
        help="hf,compiled: HF's MoE experts call, and a row with grouped_experts.CompiledExperts",
    )
    parser.add_argument(
        "--experts-way",
        default="default",
        help=f"FP8 rows, one per way of the MoE experts: default, or of {', '.join(WAYS)}",
    )
    parser.add_argument(
        "--cuda-graph",
        action="store_true",
        help="time every fast path also replayed from one CUDA graph",
    )
    parser.add_argument(
        "--reference",
        choices=sorted(REFERENCES),
        default="hf",
        help="the reference row: HF on padded batches (hf) or the generic path's documents "
        "alone (generic)",
    )
    options = parser.parse_args(argv)
    quantize = _listed(parser, options.quantize, "--quantize", ("none", "fp8", "fp8-fast"))
    experts = _listed(parser, options.experts, "--experts", ("hf", "compiled"))
    ways = _listed(parser, options.experts_way, "--experts-way", ("default", *WAYS))
    require_cuda("bench target", "cuda:0")
    rows = []
    skipped = unavailable_shapes()
    for name in options.shapes.split(","):
        if name in skipped:
            print(f"skipping shape {name}: {skipped[name]}", file=sys.stderr, flush=True)
            continue
        for row in bench_shape(
            name,
            token_budget=options.token_budget,
            repeats=options.repeats,
            quantize=quantize,
            experts=experts,
            experts_ways=ways,
            cuda_graph=options.cuda_graph,
            reference=options.reference,
        ):
            rows.append(row)
            print(json.dumps(row), flush=True)
    peak = H200_BF16_PEAK_FLOPS / 1e12
    table = [
        f"MFU against {peak:.0f} TFLOP/s, the measured H200 bf16 matmul peak (docs/GPU.md), for "
        "FP8 rows too; fp8 and +cx (compiled experts) rows: diff against the bf16 fast path, "
        f"bf16 noise = bf16 fast vs the reference ({options.reference})",
        f"{'shape':<15}{'quant':<9}{'experts':<8}{'path':<11}{'ref tok/s':>10}{'MFU':>6}"
        f"{'fast tok/s':>11}{'MFU':>6}{'compile s':>10}{'weights GB':>11}{'held GB':>8}"
        f"{'max|diff|':>10}{'max|ref|':>9}{'rel diff':>9}{'bf16 noise':>11}",
    ]
    for r in rows:
        hf = r.get(r.get("reference", "hf"), {"tokens_per_s": "-", "mfu": "-"})
        noise = f"{r['bf16_rel_diff']:.2g}" if "bf16_rel_diff" in r else "-"
        quant, way = r["quantize"] + "+cx" * (r.get("experts") == "compiled"), r.get("experts_way")
        table.append(
            f"{r['shape']:<15}{quant:<9}{way or '-':<8}{r['fast_path']:<11}{hf['tokens_per_s']:>10}"
            f"{hf['mfu']:>6}{r['fast']['tokens_per_s']:>11}{r['fast']['mfu']:>6}"
            f"{r['fast']['first_call_s']:>10}{r['weight_bytes'] / 1e9:>11.2f}"
            f"{r['held_bytes'] / 1e9:>8.2f}{r['max_abs_diff']:>10.3g}{r['ref_max_abs']:>9.3g}"
            f"{r['rel_diff']:>9.2g}{noise:>11}"
            + (f"  graph {r['graph']['tokens_per_s']} tok/s" if "graph" in r else "")
        )
    print("\n".join(table), file=sys.stderr)  # stdout holds only the JSON lines
