"""Write a random-weight target of a public model's shape (bf16, initialised on the GPU) and a
synthetic pre-tokenized data set with realistic lengths, for the H200 pipeline runs in BENCHMARKS.md.

    python benchmarks/make_random_target.py OUT_DIR [--samples 4000] [--shape SHAPE] [--config-only]

The target lands in OUT_DIR/<shape>-random (qwen3-8b-random, qwen3.5-9b-random: the Qwen3.5-9B
text decoder, 24 Gated DeltaNet + 8 gated attention layers), with the config of
`python -m dflash_async bench target` (dflash_async/bench/target_bench.py).

--config-only writes OUT_DIR/<shape>-config instead: config.json and the tokenizer, no weights
(no GPU, no disk), for a run with DFLASH_TARGET__WEIGHTS=random, which draws the weights layer by
layer on the GPU (dflash_async/targets/random_weights.py). The shapes too big to write
(qwen3.5-35b-a3b: 70 GB in bf16; qwen3-next-80b-a3b: 160 GB in bf16, ~80 GB as FP8) are
config-only.

The folder carries the built-in tiny tokenizer (token ids are drawn below its size): a random
target's throughput does not depend on which ids it reads.
"""

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from dflash_async.bench.target_shapes import shape_configs
from dflash_async.targets.tiny import tiny_tokenizer

SHAPES = ("qwen3-8b", "qwen3.5-9b")
CONFIG_ONLY = ("qwen3.5-35b-a3b", "qwen3-next-80b-a3b")


def qwen3_next_80b_a3b_config():
    """Qwen3-Next-80B-A3B's published text config (transformers' Qwen3NextConfig defaults are
    the same; spelled out here): 48 layers, full attention every 4th (3 Gated DeltaNet : 1 gated
    attention), 16 heads / 2 KV heads of 256, linear attention 16 key heads and 32 value heads of
    128, 512 experts top 10 of width 512 and one shared expert of 512, vocabulary 151936. ~80B
    parameters (~77B in experts): 160 GB in bf16, ~80 GB with QUANTIZE=fp8."""
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        hidden_size=2048,
        num_hidden_layers=48,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=512,
        num_experts_per_tok=10,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        intermediate_size=5120,
        decoder_sparse_step=1,
        vocab_size=151936,
        tie_word_embeddings=False,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 12,
    )


def shape_config(shape: str):
    if shape == "qwen3-next-80b-a3b":
        return qwen3_next_80b_a3b_config()
    return shape_configs()[shape][0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--samples", type=int, default=4000)
    parser.add_argument("--shape", choices=SHAPES + CONFIG_ONLY, default="qwen3-8b")
    parser.add_argument("--config-only", action="store_true")
    args = parser.parse_args()
    config_only = args.config_only or args.shape in CONFIG_ONLY
    target = args.out / f"{args.shape}-{'config' if config_only else 'random'}"
    config = shape_config(args.shape)
    if config_only:  # DFLASH_TARGET__WEIGHTS=random draws the weights in the run
        config.save_pretrained(target)
    else:
        with torch.device("cuda"):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(target)
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(target)
    if (args.out / "synthetic.jsonl").is_file():
        print(json.dumps({"target": str(target), "data": "exists"}))
        return
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
