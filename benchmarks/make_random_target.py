"""Write a random-weight target of a public model's shape (bf16, initialised on the GPU) and a
synthetic pre-tokenized data set with realistic lengths, for the H200 pipeline runs in BENCHMARKS.md.

    python benchmarks/make_random_target.py OUT_DIR [--samples 4000] [--shape qwen3-8b|qwen3.5-9b]

The target lands in OUT_DIR/<shape>-random (qwen3-8b-random, qwen3.5-9b-random: the Qwen3.5-9B
text decoder, 24 Gated DeltaNet + 8 gated attention layers), with the config of
`python -m dflash_async bench target` (dflash_async/bench/target_bench.py).

The folder carries the built-in tiny tokenizer (token ids are drawn below its size): a random
target's throughput does not depend on which ids it reads.
"""

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from dflash_async.bench.target_bench import shape_configs
from dflash_async.target.tiny import tiny_tokenizer

SHAPES = ("qwen3-8b", "qwen3.5-9b")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--samples", type=int, default=4000)
    parser.add_argument("--shape", choices=SHAPES, default="qwen3-8b")
    args = parser.parse_args()
    target = args.out / f"{args.shape}-random"
    config, _ = shape_configs()[args.shape]
    with torch.device("cuda"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(target)
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(target)
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(700), 0.6, args.samples).astype(int), 64, 3072)
    with open(args.out / "synthetic.jsonl", "w") as f:
        for n in lengths:
            ids = rng.integers(0, len(tokenizer), n).tolist()
            prompt = int(n * 0.3)
            f.write(
                json.dumps({"input_ids": ids, "loss_mask": [0] * prompt + [1] * (n - prompt)})
                + "\n"
            )
    print(
        json.dumps(
            {"target": str(target), "samples": int(args.samples), "tokens": int(lengths.sum())}
        )
    )


if __name__ == "__main__":
    main()
