"""The co-located pipeline on image+text data beside text-only data of the same token lengths
(benchmarks/gpu.sh part `images`: a random Qwen3-VL-8B-shaped target drawn in the run): the
data sets, and one JSON line per run.

    python benchmarks/multimodal_pipeline.py data OUT_DIR --target FOLDER [--records 256]
        [--image-side 448]
    python benchmarks/multimodal_pipeline.py summary RUN_DIR --case NAME

`data` writes, offline, OUT_DIR/vl_images/<i>.png (image-side x image-side PNGs: a random 14x14
colour grid scaled up, small files that decode as fast as any), OUT_DIR/vl_images.jsonl (one
OpenAI record per image: a user turn with the image and a question, then the answer; words of
the target folder's tokenizer, one token each, lognormal lengths around 700 tokens, as
`bench target`) and OUT_DIR/vl_text.jsonl (pre-tokenized text records of exactly the token
lengths the image records take once the processor expands each image, supervised over the same
answer lengths), each written once. The lengths are counted with the folder's tokenizer and chat
template: an image is one placeholder there, (image-side / 32)^2 tokens after the processor's
expansion (16-pixel patches merged 2x2).

`summary` reads a run folder (runlog/summary.py's medians, the first 10% of the steps left out)
and prints its median tokens/s, images/s (tokens/s times the data's images per token, from
`data_loaded`), MFU, step time, the target path and peak GPU memory.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from dflash_async.runlog.parse import read_run
from dflash_async.runlog.summary import steady_median

PATCHES_PER_TOKEN_SIDE = 32  # 16-pixel patches merged 2x2
ANSWER_FRACTION = 0.7  # of a record's text tokens


def _image(path: Path, side: int, rng: np.random.Generator) -> None:
    from PIL import Image

    grid = rng.integers(0, 256, (14, 14, 3), dtype=np.uint8)
    Image.fromarray(grid).resize((side, side), Image.NEAREST).save(path)


def write_data(out: Path, *, target: Path, records: int, side: int) -> dict:
    from transformers import AutoTokenizer

    images_path, text_path = out / "vl_images.jsonl", out / "vl_text.jsonl"
    summary = {"images": str(images_path), "text": str(text_path), "records": records}
    if images_path.is_file() and text_path.is_file():
        return summary | {"exists": True}
    tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=True)
    words = sorted(w for w in tokenizer.get_vocab() if w.isalpha() and w.islower())
    image_tokens = (side // PATCHES_PER_TOKEN_SIDE) ** 2
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(700), 0.6, records).astype(int), 320, 3000)
    (out / "vl_images").mkdir(parents=True, exist_ok=True)
    vocab = min(tokenizer.convert_tokens_to_ids(["<|vision_start|>", tokenizer.mask_token]))
    tokens = 0
    with open(images_path, "w") as fi, open(text_path, "w") as ft:
        for i, n in enumerate(lengths.tolist()):
            _image(out / "vl_images" / f"{i}.png", side, rng)
            text = max(8, n - image_tokens)
            answer = max(4, int(text * ANSWER_FRACTION))
            question = " ".join(rng.choice(words, text - answer))
            reply = " ".join(rng.choice(words, answer))
            messages = [
                {
                    "role": "user",
                    "content": [{"type": "image"}, {"type": "text", "text": question}],
                },
                {"role": "assistant", "content": reply},
            ]
            rendered = tokenizer.apply_chat_template(messages, tokenize=False)
            ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
            length = len(ids) - 1 + image_tokens  # the placeholder becomes image_tokens
            parts = [{"type": "image_url", "image_url": {"url": f"vl_images/{i}.png"}}]
            parts.append({"type": "text", "text": question})
            record = {"messages": [{"role": "user", "content": parts}, messages[1]]}
            fi.write(json.dumps(record) + "\n")
            ids = rng.integers(0, vocab, length).tolist()
            supervised = answer + 1  # the answer and its end-of-turn token
            mask = [0] * (length - supervised) + [1] * supervised
            ft.write(json.dumps({"input_ids": ids, "loss_mask": mask}) + "\n")
            tokens += length
    return summary | {"tokens": tokens, "image_tokens": image_tokens}


def summary(run_dir: Path, case: str) -> dict:
    run = read_run(run_dir)
    memory = [e["mem_gib"] for e in run.steps if isinstance(e.get("mem_gib"), int | float)]
    (loaded,) = run.named("data_loaded")[:1] or [{}]
    chosen = [e.get("target_path") for e in run.named("target_path_chosen")]
    tokens_per_s = steady_median(run, "tokens_per_s")
    images_per_token = (loaded.get("images") or 0) / max(loaded.get("tokens") or 1, 1)
    return {
        "case": case,
        "target_path": chosen[0] if chosen else None,
        "steps": len(run.steps),
        "data_images": loaded.get("images", 0),
        "data_tokens": loaded.get("tokens"),
        "median_tokens_per_s": tokens_per_s,
        "images_per_s": round(tokens_per_s * images_per_token, 1) if tokens_per_s else None,
        "median_mfu": steady_median(run, "mfu"),
        "median_target_busy": steady_median(run, "target_busy"),
        "median_step_ms": steady_median(run, "step_ms"),
        "peak_gib": max(memory, default=None),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers(dest="command", required=True)
    data = commands.add_parser("data")
    data.add_argument("out", type=Path)
    data.add_argument("--target", type=Path, required=True)
    data.add_argument("--records", type=int, default=256)
    data.add_argument("--image-side", type=int, default=448)
    report = commands.add_parser("summary")
    report.add_argument("run_dir", type=Path)
    report.add_argument("--case", required=True)
    args = parser.parse_args()
    if args.command == "data":
        made = write_data(args.out, target=args.target, records=args.records, side=args.image_side)
        print(json.dumps(made))
    else:
        print(json.dumps(summary(args.run_dir, args.case)))


if __name__ == "__main__":
    main()
