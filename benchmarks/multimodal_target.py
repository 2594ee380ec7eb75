"""Target throughput on image+text packs: a Qwen3-VL-shaped wrapper (random weights, built in
memory) run by each image+text forward (targets/multimodal.py's `multimodal_path`: `packed`,
the whole pack in one pass, targets/packed/image_text.py, as `run` chooses it; `per_document`,
the wrapper's HF forward per document with its vision inputs), beside the same forward on
text-only packs of the same document lengths.

    python benchmarks/multimodal_target.py [--shape qwen3-vl-8b] [--token-budget 16384]
        [--image-side 448] [--repeats 3] [--device cuda] [--paths packed,per_document]

Documents are chat-like (lognormal lengths around 700 tokens, as `bench target`), each with one
image of image-side x image-side pixels (448: a 28x28 grid of 16-pixel patches, 196 tokens after
the 2x2 merge) after its first tokens. Inputs are made without a processor: random text ids
below the special tokens, the image's placeholder tokens, random pixel values of the patch
width the tower takes, the grid and the per-token types, which is all the forward reads.
Prints one JSON line per path and case: tokens/s, images/s, the median seconds of a pack and the first
call's, on a GPU the peak allocated memory so far; the image row adds `pixel_inputs_s`, the host seconds of computing the pack's pixel
inputs from PNG files (what `run` does per pack when it stages it). `--shape tiny --device cpu` is the smoke test's (seconds on a CPU).
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial

import numpy as np
import torch

from dflash_async.bench.target_bench import document_lengths
from dflash_async.data.packing import layout_pack
from dflash_async.model.drafter_config import default_target_layer_ids
from dflash_async.targets.multimodal import multimodal_path

PATCH, MERGE, TEMPORAL = 16, 2, 2


# Qwen3-VL's own ids of its vision special tokens
QWEN3_VL_SPECIALS = dict(
    image_token_id=151655,
    video_token_id=151656,
    vision_start_token_id=151652,
    vision_end_token_id=151653,
)


def shape_config(name: str, specials: dict[str, int] | None = None, vocab: int = 151936):
    """Qwen3-VL-8B's published shape, or a tiny one for CPU smoke runs; `specials` and `vocab`:
    the vision special tokens' ids and the vocabulary of another tokenizer
    (benchmarks/make_random_target.py's random folders)."""
    from transformers import Qwen3VLConfig

    specials = specials or QWEN3_VL_SPECIALS
    rope = {"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [24, 20, 20]}
    rope["mrope_interleaved"] = True
    if name == "qwen3-vl-8b":
        text = dict(
            vocab_size=vocab,
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            rope_parameters=rope,
        )
        vision = dict(
            depth=27,
            hidden_size=1152,
            intermediate_size=4304,
            num_heads=16,
            out_hidden_size=4096,
            deepstack_visual_indexes=[8, 16, 24],
            num_position_embeddings=2304,
        )
    elif name == "tiny":
        text = dict(
            vocab_size=vocab,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=8,  # room for 5 distinct captured layers
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            rope_parameters={**rope, "mrope_section": [2, 1, 1]},
        )
        vision = dict(
            depth=1,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=32,
            deepstack_visual_indexes=[0],
            num_position_embeddings=16,
        )
    else:
        raise SystemExit(f"unknown shape {name!r}: qwen3-vl-8b or tiny")
    vision.update(patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL)
    return Qwen3VLConfig(text_config=text, vision_config=vision, **specials)


def documents(config, lengths: np.ndarray, side: int, *, images: bool, seed: int):
    """(input_ids [n] int64, vision inputs) per document; each image placed after 8 tokens."""
    rng = np.random.default_rng(seed)
    grid = side // PATCH
    tokens = grid * grid // MERGE**2
    pixels = 3 * TEMPORAL * PATCH * PATCH
    out = []
    for n in lengths.tolist():
        ids = rng.integers(0, config.vision_start_token_id - 1, n)
        if not images or n < tokens + 10:
            out.append((torch.from_numpy(ids), {}))
            continue
        ids[8] = config.vision_start_token_id
        ids[9 : 9 + tokens] = config.image_token_id
        ids[9 + tokens] = config.vision_end_token_id
        types = np.zeros(n, dtype=np.int64)
        types[9 : 9 + tokens] = 1
        vision = {
            "pixel_values": torch.from_numpy(rng.standard_normal((grid * grid, pixels))).float(),
            "image_grid_thw": torch.tensor([[1, grid, grid]]),
            "mm_token_type_ids": torch.from_numpy(types)[None],
        }
        out.append((torch.from_numpy(ids), vision))
    return out


def timed(fn, repeats: int, device: torch.device) -> tuple[float, float]:
    """(first call s, median s of `repeats` later calls)."""
    times = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # sync point: benchmark timing only
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return times[0], float(np.median(times[1:]))


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-vl-8b")
    parser.add_argument("--token-budget", type=int, default=16384)
    parser.add_argument("--image-side", type=int, default=448)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--features", type=int, default=5, help="captured layers")
    parser.add_argument("--paths", default="packed,per_document")
    args = parser.parse_args(argv)
    paths = [p for p in args.paths.split(",") if p]
    if not paths or set(paths) - {"packed", "per_document"}:
        raise SystemExit(f"--paths {args.paths!r}: some of packed, per_document")
    from transformers import AutoModelForImageTextToText

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = shape_config(args.shape)
    torch.manual_seed(0)
    with device:
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype).eval()
    layers = default_target_layer_ids(config.text_config.num_hidden_layers, args.features)
    lengths = document_lengths(args.token_budget, seed=0)
    rows = []
    for which in paths:
        chosen = multimodal_path(
            model, layers, token_budget=args.token_budget, packed=which == "packed"
        )
        try:
            rows += measure(args, model, chosen, layers, lengths, device=device, dtype=dtype)
        finally:
            chosen.forward.close()
    return rows


def measure(args, model, chosen, layers, lengths, *, device, dtype) -> list[dict]:
    """One JSON line per case (image+text, text-only packs) of the chosen path's forward."""
    config = model.config
    forward = chosen.forward
    width = len(layers) * config.text_config.hidden_size
    rows = []
    for case, images in (("image+text", True), ("text-only", False)):
        docs = documents(config, lengths, args.image_side, images=images, seed=1)
        pack = layout_pack([(ids, np.zeros(len(ids), bool)) for ids, _ in docs], args.token_budget)
        input_ids = pack.input_ids.to(device)
        features = torch.zeros(args.token_budget, width, dtype=dtype, device=device)
        vision = [
            {
                k: v.to(device, dtype) if v.is_floating_point() else v.to(device)
                for k, v in x.items()
            }
            for _, x in docs
        ]
        count = sum(1 for v in vision if v)

        run = partial(
            forward,
            input_ids,
            pack.position_ids.to(device),
            pack.doc_ids.to(device),
            features,
            lengths,
            vision,
        )
        first, median = timed(run, args.repeats, device)
        tokens = int(lengths.sum())
        row = dict(
            case=case,
            path=chosen.name,
            shape=args.shape,
            device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            documents=len(lengths),
            tokens=tokens,
            images=count,
            image_tokens=int(sum(int(v["mm_token_type_ids"].sum()) for v in vision if v)),
            first_call_s=round(first, 3),
            pack_s=round(median, 4),
            tokens_per_s=round(tokens / median),
            images_per_s=round(count / median, 1),
        )
        if device.type == "cuda":  # the model, the features and the forward's activations
            row["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        if count:  # what `run` adds per pack on the host: the images' pixel inputs, again
            row["pixel_inputs_s"] = round(pixel_inputs_s(count, args.image_side, args.repeats), 4)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def pixel_inputs_s(count: int, side: int, repeats: int) -> float:
    """Median seconds of the PIL image processor (Qwen3-VL's: 16-pixel patches, 2x2 merge) on
    `count` PNG files of side x side pixels, decoded from disk: the host work `run` does for a
    pack when it stages it (data/images.py computes the vision inputs again per pack)."""
    import tempfile

    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    processor = Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE)
    rng = np.random.default_rng(2)
    with tempfile.TemporaryDirectory() as folder:
        paths = []
        for i in range(count):
            pixels = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
            paths.append(f"{folder}/{i}.png")
            Image.fromarray(pixels).save(paths[-1])

        def run() -> None:
            images = []
            for path in paths:
                with Image.open(path) as image:
                    images.append(image.convert("RGB"))
            processor(images)

        return timed(run, repeats, torch.device("cpu"))[1]


if __name__ == "__main__":
    main()
