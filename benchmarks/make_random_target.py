"""Write a Qwen3-8B-shaped random-weight target (bf16, initialised on the GPU) and a synthetic
pre-tokenized data set with realistic lengths, for the H200 pipeline runs in BENCHMARKS.md.

    python benchmarks/make_random_target.py OUT_DIR [--samples 4000]

The folder carries the built-in tiny tokenizer (token ids are drawn below its size): a random
target's throughput does not depend on which ids it reads.
"""

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from dflash_async.target.tiny import tiny_tokenizer


def qwen3_8b_config() -> Qwen3Config:
    return Qwen3Config(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1_000_000.0,
        max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--samples", type=int, default=4000)
    args = parser.parse_args()
    target = args.out / "qwen3-8b-random"
    with torch.device("cuda"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(qwen3_8b_config(), dtype=torch.bfloat16)
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
