"""Is the packed sliding-window forward's GPU difference from HF noise or a bug?

Part 1, tiny fp32 models (tests/targets/test_target_packed_sliding.py's configs and documents, T = 256):
for Mistral, Gemma 3 and Gemma 4 text, the max |error| against an fp64 CPU run of HF, each
document alone, of (a) HF fp32 on the GPU, each document alone, and (b) the packed flex forward on
the GPU, eager and compiled. The packed path is as exact as HF when (b) is within a small factor
of (a); a bug (a window off by one, a wrong RoPE base) shows as an error orders above (a).

Part 2, Gemma-3-12B's text shape in bf16 at T = 16384 (bench target's `gemma3-12b`): HF's padded
batches against the packed window forward, tokens/s, MFU (against the measured 780 TFLOP/s H200
bf16 peak) and the feature difference, as `bench target` prints them. The product selects HF on
a GPU for these families until part 1 shows the packed path exact there; this script builds the
packed forward directly to measure it.

    PYTHONPATH=.:tests python benchmarks/window_parity_gpu.py [--part 1|2|both]
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch


def part1(device: str = "cuda") -> None:
    from target_kit import capture_features
    from test_target_packed_sliding import CASES, LAYER_IDS, _model

    from dflash_async.data.packing import layout_pack, pack_row_offsets
    from dflash_async.targets.families import family_of
    from dflash_async.targets.loading import text_model
    from dflash_async.targets.packed.window import PackedWindowForward
    from dflash_async.targets.paths import PackedCall

    for case, (kind, overrides) in CASES.items():
        model = _model(kind, **overrides)
        rng = np.random.default_rng(5)
        lengths = (70, 100, 3, 50)
        docs = [
            (rng.integers(0, model.config.vocab_size, n), np.ones(n, dtype=bool)) for n in lengths
        ]
        offsets = pack_row_offsets(np.array(lengths))
        ref = [
            capture_features(
                model.double(),
                torch.as_tensor(ids)[None],
                torch.ones(1, len(ids), dtype=torch.long),
                LAYER_IDS,
            )[0]
            for ids, _ in docs
        ]
        gpu = model.float().to(device)
        hf = [
            capture_features(
                gpu,
                torch.as_tensor(ids, device=device)[None],
                torch.ones(1, len(ids), dtype=torch.long, device=device),
                LAYER_IDS,
            )[0]
            .cpu()
            .double()
            for ids, _ in docs
        ]
        row = {
            "case": case,
            "max_abs_ref": max(float(r.abs().max()) for r in ref),
            "hf_gpu_err": max(float((h - r).abs().max()) for h, r in zip(hf, ref, strict=True)),
        }
        for compile in (False, True) if device == "cuda" else (False,):
            inner = text_model(gpu)
            forward = PackedWindowForward(
                inner,
                LAYER_IDS,
                family=family_of(inner.config).forward.layers,
                attention="flex",
                compile=compile,
            )
            layout = layout_pack(docs, 256).to(device)
            out = torch.full((256, len(LAYER_IDS) * 64), float("nan"), device=device)
            PackedCall(forward)(layout.input_ids, layout.position_ids, layout.doc_ids, out, lengths)
            out = out.cpu().double()
            errs = [
                float((out[offsets[j] : offsets[j + 1]] - ref[j]).abs().max())
                for j in range(len(docs))
            ]
            by_layer = [
                max(
                    float(
                        (
                            out[offsets[j] : offsets[j + 1], i * 64 : (i + 1) * 64]
                            - ref[j][:, i * 64 : (i + 1) * 64]
                        )
                        .abs()
                        .max()
                    )
                    for j in range(len(docs))
                )
                for i in range(len(LAYER_IDS))
            ]
            row[f"packed_err_compile_{compile}"] = max(errs)
            row[f"packed_err_by_doc_compile_{compile}"] = errs
            row[f"packed_err_by_layer_compile_{compile}"] = by_layer
            row[f"padding_zero_compile_{compile}"] = bool((out[offsets[-1] :] == 0).all())
        print(json.dumps(row), flush=True)


def part2() -> None:
    from transformers import AutoModelForCausalLM

    from dflash_async.bench.target_bench import _timed, document_lengths, forward_flops
    from dflash_async.bench.target_shapes import shape_configs
    from dflash_async.data.packing import layout_pack
    from dflash_async.model.flops import mfu
    from dflash_async.targets.families import family_of
    from dflash_async.targets.forward import HFPaddedForward
    from dflash_async.targets.loading import text_model
    from dflash_async.targets.packed.window import PackedWindowForward
    from dflash_async.targets.paths import PackedCall

    config, layer_ids = shape_configs()["gemma3-12b"]
    T = 16384
    with torch.device("cuda"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.eval().requires_grad_(False)
    lengths = document_lengths(T, 0)
    rng = np.random.default_rng(0)
    docs = [(rng.integers(0, 32000, n), np.ones(n, dtype=bool)) for n in lengths]
    layout = layout_pack(docs, T).to("cuda")
    args = (layout.input_ids, layout.position_ids, layout.doc_ids)
    flops = forward_flops(model, layer_ids, lengths)
    row, outs = {"shape": "gemma3-12b", "T": T, "documents": len(lengths)}, {}
    width = len(layer_ids) * config.hidden_size
    paths = {
        "hf": HFPaddedForward(model, layer_ids, max_batch_tokens=T),
        "packed_window": PackedCall(
            PackedWindowForward(
                text_model(model),
                layer_ids,
                family=family_of(text_model(model).config).forward.layers,
                attention="flex",
                compile=True,
            )
        ),
    }
    for label, forward in paths.items():
        out = torch.empty(T, width, dtype=torch.bfloat16, device="cuda")
        first, seconds = _timed(lambda f=forward, o=out: f(*args, o, lengths), 5)
        row[label] = {
            "tokens_per_s": round(lengths.sum() / seconds),
            "ms": round(seconds * 1e3, 1),
            "mfu": round(mfu(flops, seconds), 3),
            "first_call_s": round(first, 1),
        }
        outs[label] = out.float()
    diff = outs["packed_window"] - outs["hf"]
    row["max_abs_diff"] = float(diff.abs().max())
    row["hf_max_abs"] = float(outs["hf"].abs().max())
    row["rel_diff"] = float(diff.norm() / outs["hf"].norm())
    row["speedup"] = round(row["packed_window"]["tokens_per_s"] / row["hf"]["tokens_per_s"], 2)
    print(json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", choices=("1", "2", "both"), default="both")
    parser.add_argument("--cpu-dry-run", action="store_true", help="part 1 on the CPU, eager")
    options = parser.parse_args()
    if options.cpu_dry_run:
        return part1("cpu")
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    part = options.part
    if part in ("1", "both"):
        part1()
    if part in ("2", "both"):
        part2()


if __name__ == "__main__":
    main()
