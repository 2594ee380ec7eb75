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

The multimodal shapes (qwen3-vl-8b: Qwen3-VL-8B's wrapper, vision tower included, as
benchmarks/multimodal_target.py builds it; qwen3-vl-tiny: a CPU-sized one) are config-only
(OUT_DIR/<shape>-config, for DFLASH_TARGET__WEIGHTS=random with image data or text data) and
write no data: the tiny tokenizer with Qwen3-VL's vision special tokens and a chat template that
renders image parts as Qwen3-VL's placeholder, and Qwen3-VL's image and video processor configs
(16-pixel patches merged 2x2; 8B: images of up to 16M pixels, as the published checkpoint;
tiny: up to 64x64 pixels), so that AutoProcessor builds Qwen3-VL's own processor from the folder
with no network. AutoProcessor needs torchvision for Qwen3-VL's video processor (then the image
processor is the torchvision one too); without torchvision, AutoImageProcessor still reads the
image processor config (the PIL image processor: the same patches).
"""

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from dflash_async.bench.target_shapes import shape_configs
from dflash_async.targets.tiny import tiny_tokenizer

SHAPES = ("qwen3-8b", "qwen3.5-9b")
CONFIG_ONLY = ("qwen3.5-35b-a3b", "qwen3-next-80b-a3b")


@dataclass(frozen=True)
class VLShape:
    """A random Qwen3-VL folder's shape: multimodal_target.py's config name, the vocabulary
    (None: the tokenizer's, rounded up to 64) and the pixels an image is resized within
    (shortest_edge: least, longest_edge: most)."""

    config: str
    vocab: int | None
    pixels: dict[str, int]


MULTIMODAL = {
    "qwen3-vl-8b": VLShape("qwen3-vl-8b", 151936, {"shortest_edge": 65536, "longest_edge": 2**24}),
    "qwen3-vl-tiny": VLShape("tiny", None, {"shortest_edge": 32 * 32, "longest_edge": 64 * 64}),
}
VISION_TOKENS = {  # Qwen3-VL's config field -> its special token
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
}
# Qwen-VL's chat turns; an image part renders as Qwen3-VL's placeholder, which the processor
# expands to one <|image_pad|> per merged patch.
VL_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string -%}{{ message.content }}"
    "{%- else -%}{%- for part in message.content -%}"
    "{%- if part.type in ('image', 'image_url') -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif part.type == 'text' -%}{{ part.text }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


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


def vl_tokenizer():
    """The tiny tokenizer with Qwen3-VL's vision special tokens and VL_CHAT_TEMPLATE."""
    from tokenizers import AddedToken

    tokenizer = tiny_tokenizer()
    added = [AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS.values()]
    tokenizer.add_tokens(added, special_tokens=True)
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    return tokenizer


def processor_configs(shape: str) -> dict[str, dict]:
    """Qwen3-VL's image and video processor configs (file name -> content), as its published
    checkpoints carry them; the types name no backend (transformers picks torchvision's where
    installed, else PIL's for images)."""
    common = dict(
        patch_size=16,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        processor_class="Qwen3VLProcessor",
    )
    image = dict(
        common, size=MULTIMODAL[shape].pixels, image_processor_type="Qwen2VLImageProcessor"
    )
    video = dict(
        common,
        size={"shortest_edge": 4096, "longest_edge": 25165824},
        video_processor_type="Qwen3VLVideoProcessor",
    )
    return {"preprocessor_config.json": image, "video_preprocessor_config.json": video}


def write_vl_target(out: Path, shape: str) -> Path:
    """OUT/<shape>-config: a random Qwen3-VL target's folder (module doc), no weights."""
    from multimodal_target import shape_config as vl_shape

    target = out / f"{shape}-config"
    tokenizer = vl_tokenizer()
    specials = {field: tokenizer.convert_tokens_to_ids(t) for field, t in VISION_TOKENS.items()}
    vocab = MULTIMODAL[shape].vocab or -(-len(tokenizer) // 64) * 64
    config = vl_shape(MULTIMODAL[shape].config, specials, vocab=vocab)
    config.text_config.eos_token_id = tokenizer.eos_token_id
    config.save_pretrained(target)
    tokenizer.save_pretrained(target)
    (target / "chat_template.jinja").write_text(VL_CHAT_TEMPLATE)
    for name, content in processor_configs(shape).items():
        (target / name).write_text(json.dumps(content, indent=2) + "\n")
    return target


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--samples", type=int, default=4000)
    parser.add_argument(
        "--shape", choices=SHAPES + CONFIG_ONLY + tuple(MULTIMODAL), default="qwen3-8b"
    )
    parser.add_argument("--config-only", action="store_true")
    args = parser.parse_args()
    if args.shape in MULTIMODAL:
        print(json.dumps({"target": str(write_vl_target(args.out, args.shape))}))
        return
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
