"""Tiny multimodal targets built in memory (no download): a processor (the fixtures' Qwen3-like
tokenizer with the model's image tokens, the PIL image processor, a chat template that renders
image parts) and a small random wrapper for each multimodal family tested, plus generated images
and image+text records.

`MULTIMODAL` is the one table of the families tested: model_type -> how its tiny processor and
config are built.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from fixtures.chat_tokenizer import qwen3_like_tokenizer

HIDDEN = 32
TEXT_LAYERS = 4  # the tapped layers are two of these; vision towers have 2 blocks (as many)
# the tiny language model every wrapper of the kit shares (the text config's sizes)
TINY_TEXT = dict(
    hidden_size=HIDDEN,
    num_hidden_layers=TEXT_LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=64,
)

# A chat template in the Qwen-VL manner: image parts render as the model's placeholder.
QWEN_VL_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message.role + '\n' }}"
    "{%- if message.content is string -%}{{ message.content }}"
    "{%- else -%}{%- for part in message.content -%}"
    "{%- if part.type == 'image' -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif part.type == 'text' -%}{{ part.text }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)


def _qwen_vl_tokenizer():
    tokenizer = qwen3_like_tokenizer()
    specials = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    return tokenizer


def image_only_qwen3_vl_processor(images: Any, tokenizer: Any, chat_template: str) -> Any:
    """Qwen3-VL's processor (its own class) without the video processor (it needs torchvision,
    absent here)."""
    from transformers import Qwen3VLProcessor

    class ImageOnlyProcessor(Qwen3VLProcessor):
        @classmethod
        def get_attributes(cls) -> list[str]:
            return ["image_processor", "tokenizer"]

        def __init__(self, image_processor, tokenizer, chat_template=None):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template)

    return ImageOnlyProcessor(images, tokenizer, chat_template=chat_template)


def folder_qwen3_vl_processor(folder: Path) -> Any:
    """The image-only Qwen3-VL processor of a target folder's own files: its image processor
    config (the PIL image processor without torchvision), tokenizer and chat template."""
    from transformers import AutoImageProcessor, AutoTokenizer

    images = AutoImageProcessor.from_pretrained(folder, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    template = (Path(folder) / "chat_template.jinja").read_text()
    return image_only_qwen3_vl_processor(images, tokenizer, template)


def qwen3_vl_processor() -> Any:
    """Qwen3-VL's processor (its own class) over the tiny tokenizer; 16-pixel patches merged
    2x2, images resized to at most 64x64 pixels (<= 16 image tokens)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    images = Qwen2VLImageProcessorPil(
        patch_size=16,
        merge_size=2,
        temporal_patch_size=2,
        min_pixels=32 * 32,
        max_pixels=64 * 64,
    )
    return image_only_qwen3_vl_processor(images, _qwen_vl_tokenizer(), QWEN_VL_TEMPLATE)


def qwen3_vl_config(processor: Any) -> Any:
    from transformers import Qwen3VLConfig

    tok = processor.tokenizer
    return Qwen3VLConfig(
        text_config=dict(
            vocab_size=len(tok),
            **TINY_TEXT,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 100.0,  # fast h/w frequencies: positions matter at tiny size
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
            },
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            num_heads=2,
            intermediate_size=64,
            out_hidden_size=HIDDEN,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            deepstack_visual_indexes=[0],
            num_position_embeddings=16,
        ),
        image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"),
        tie_word_embeddings=False,
    )


def qwen3_vl_moe_config(processor: Any) -> Any:
    """Qwen3-VL-MoE's wrapper: Qwen3-VL's tower, image tokens and processor over a
    mixture-of-experts language model (4 experts, 2 per token)."""
    from transformers import Qwen3VLMoeConfig

    base = qwen3_vl_config(processor)
    text = base.text_config.to_dict()
    text_fields = dict(
        vocab_size=text["vocab_size"],
        **TINY_TEXT,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        rope_parameters=text["rope_parameters"],
    )
    return Qwen3VLMoeConfig(
        text_config=text_fields,
        vision_config=base.vision_config.to_dict(),
        image_token_id=base.image_token_id,
        video_token_id=base.video_token_id,
        vision_start_token_id=base.vision_start_token_id,
        vision_end_token_id=base.vision_end_token_id,
        tie_word_embeddings=False,
    )


def qwen3_5_config(processor: Any) -> Any:
    """Qwen3.5's wrapper: a hybrid language model (Gated DeltaNet and attention layers, the
    multimodal rotary) over the Qwen3-VL-style tower, image tokens and processor."""
    from transformers import Qwen3_5Config

    return _qwen3_5_wrapper(Qwen3_5Config, processor)


def qwen3_5_moe_config(processor: Any) -> Any:
    """Qwen3.5-MoE's wrapper: Qwen3.5's, its language model's MLPs mixtures of experts (4
    experts, 2 per token, a gated shared expert)."""
    from transformers import Qwen3_5MoeConfig

    experts = dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    )
    return _qwen3_5_wrapper(Qwen3_5MoeConfig, processor, **experts)


def _qwen3_5_wrapper(config_class: type, processor: Any, **text_extra: Any) -> Any:
    base = qwen3_vl_config(processor)
    text = base.text_config.to_dict()
    text_fields = dict(
        vocab_size=text["vocab_size"],
        **TINY_TEXT,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"] * (TEXT_LAYERS // 2),
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 100.0,  # as Qwen3-VL's above
            "partial_rotary_factor": 1.0,  # all 8 dims: 4 frequencies over t, h, w
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
        **text_extra,
    )
    vision = base.vision_config.to_dict()
    return config_class(
        text_config=text_fields,
        vision_config={
            k: vision[k]
            for k in (
                "depth",
                "hidden_size",
                "num_heads",
                "intermediate_size",
                "out_hidden_size",
                "patch_size",
                "spatial_merge_size",
                "temporal_patch_size",
                "num_position_embeddings",
            )
        },
        image_token_id=base.image_token_id,
        video_token_id=base.video_token_id,
        vision_start_token_id=base.vision_start_token_id,
        vision_end_token_id=base.vision_end_token_id,
        tie_word_embeddings=False,
    )


# Gemma's turn markers; image parts render as the image's start token, which the processor
# expands to "\n\n<start_of_image>" + the image's soft tokens + "<end_of_image>\n\n".
GEMMA_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<start_of_turn>' + ('model' if message.role == 'assistant' else message.role) + '\n' }}"
    "{%- if message.content is string -%}{{ message.content }}"
    "{%- else -%}{%- for part in message.content -%}"
    "{%- if part.type == 'image' -%}<start_of_image>"
    "{%- elif part.type == 'text' -%}{{ part.text }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
GEMMA_IMAGE = 32  # pixels a side (SigLIP's image_size): 4x4 patches of 8, pooled to 2x2 tokens
GEMMA_IMAGE_TOKENS = 4


def gemma3_processor() -> Any:
    """Gemma 3's processor over the tiny tokenizer with Gemma's image and turn tokens; images
    resized to 32x32, 4 soft tokens each."""
    from transformers import Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = qwen3_like_tokenizer()
    named = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"}
    named["image_token"] = "<image_soft_token>"
    specials = ["<start_of_turn>", "<end_of_turn>", *named.values()]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.eos_token = "<end_of_turn>"
    for name, token in named.items():  # what Gemma's tokenizer_config names
        setattr(tokenizer, name, token)
        setattr(tokenizer, f"{name}_id", tokenizer.convert_tokens_to_ids(token))
    images = Gemma3ImageProcessorPil(size={"height": GEMMA_IMAGE, "width": GEMMA_IMAGE})
    return Gemma3Processor(
        images, tokenizer, chat_template=GEMMA_TEMPLATE, image_seq_length=GEMMA_IMAGE_TOKENS
    )


def gemma3_config(processor: Any) -> Any:
    from transformers import Gemma3Config

    tok = processor.tokenizer
    return Gemma3Config(
        text_config=dict(
            vocab_size=len(tok),
            **TINY_TEXT,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * (TEXT_LAYERS // 2),
            query_pre_attn_scalar=8,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=GEMMA_IMAGE,
            patch_size=8,
        ),
        mm_tokens_per_image=GEMMA_IMAGE_TOKENS,
        boi_token_index=tok.boi_token_id,
        eoi_token_index=tok.eoi_token_id,
        image_token_index=tok.image_token_id,
        tie_word_embeddings=False,
    )


def _qwen_image_tokens(size: tuple[int, int]) -> int:
    """Sides rounded to 32 pixels (16-pixel patches merged 2x2): one token per 32x32 tile."""
    return max(1, round(size[0] / 32)) * max(1, round(size[1] / 32))


@dataclass(frozen=True)
class Multimodal:
    """How one family's tiny processor and config are built, and what its images become.

    image_tokens: an image's token count from its (height, width). mrope: 3-D rope positions
    (get_rope_index). bidirectional_images: image tokens attend to each other both ways, told
    by the per-token types (Gemma 3's token_type_ids).
    """

    processor: Callable[[], Any]
    config: Callable[[Any], Any]
    image_tokens: Callable[[tuple[int, int]], int]
    mrope: bool = False
    bidirectional_images: bool = False


MULTIMODAL: dict[str, Multimodal] = {
    "qwen3_vl": Multimodal(qwen3_vl_processor, qwen3_vl_config, _qwen_image_tokens, mrope=True),
    "qwen3_5": Multimodal(qwen3_vl_processor, qwen3_5_config, _qwen_image_tokens, mrope=True),
    "qwen3_5_moe": Multimodal(
        qwen3_vl_processor, qwen3_5_moe_config, _qwen_image_tokens, mrope=True
    ),
    "qwen3_vl_moe": Multimodal(
        qwen3_vl_processor, qwen3_vl_moe_config, _qwen_image_tokens, mrope=True
    ),
    "gemma3": Multimodal(
        gemma3_processor,
        gemma3_config,
        lambda size: GEMMA_IMAGE_TOKENS,
        bidirectional_images=True,
    ),
}
MROPE = sorted(name for name, entry in MULTIMODAL.items() if entry.mrope)
BIDIRECTIONAL = sorted(name for name, entry in MULTIMODAL.items() if entry.bidirectional_images)


def tiny_multimodal(model_type: str, seed: int = 0) -> tuple[Any, Any]:
    """(processor, random fp32 model in eval mode) of a MULTIMODAL family."""
    from transformers import AutoModelForImageTextToText

    entry = MULTIMODAL[model_type]
    processor = entry.processor()
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(entry.config(processor), dtype=torch.float32)
    projector = getattr(model.model, "multi_modal_projector", None)
    if hasattr(projector, "mm_input_projection_weight"):
        # Gemma 3 initialises its projection to zeros: every image would reach the language
        # model as zero features, so no test could tell an image from none. Drawn at the
        # config's initializer_range instead (features ~0.1, as the scaled text embeddings).
        with torch.no_grad():
            projector.mm_input_projection_weight.normal_(std=0.02)
    return processor, model.eval()


def image(seed: int, size: tuple[int, int] = (48, 64)) -> Any:
    """A random RGB image (height, width), deterministic."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def png_bytes(picture: Any) -> bytes:
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(picture: Any) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(picture)).decode()


QUESTIONS = ["What is two plus two?", "Hello there!", "How can I help you today?"]
ANSWERS = [
    "The answer is four. Let me think step by step about the question.",
    "I am fine, thank you. The sum of the numbers is 42.",
    "Hello there! How can I help you today? The answer is four.",
]


def image_record(i: int, image_ref: str, *, images: int = 1) -> dict:
    """An OpenAI image+text record: a user turn with `images` image parts and a question, then
    an assistant answer."""
    parts = [{"type": "image_url", "image_url": {"url": image_ref}} for _ in range(images)]
    parts.append({"type": "text", "text": QUESTIONS[i % len(QUESTIONS)]})
    return {
        "messages": [
            {"role": "user", "content": parts},
            {"role": "assistant", "content": ANSWERS[i % len(ANSWERS)]},
        ]
    }


def write_image_data(folder: Path, *, records: int, sizes=((48, 64), (64, 32), (32, 32))) -> Path:
    """A data folder: images/{i}.png and data.jsonl with one record per image (paths relative
    to the data file); returns the .jsonl path."""
    (folder / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(records):
        image(i, sizes[i % len(sizes)]).save(folder / "images" / f"{i}.png")
        lines.append(json.dumps(image_record(i, f"images/{i}.png")))
    path = folder / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path
