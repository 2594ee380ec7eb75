"""Tiny random targets of every architecture the drafter supports, written as HF folders with the
built-in tiny tokenizer (its vocabulary sizes every config), for the per-architecture tests.

Each config is as small as the architecture allows (2 decoder layers, hidden 64, a few experts),
so a whole `run` with its evaluation takes seconds on the CPU. Multimodal wrappers get a one-block
vision tower: the product must never build it onto the device or run it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from target_kit import save_random_target

from dflash_async.atomic import atomic_directory
from dflash_async.targets.tiny import tiny_tokenizer

SLIDING_WINDOW = 6  # shorter than a prompt: decoding runs past the window


def _common(vocab: int, eos: int) -> dict[str, Any]:
    return dict(
        vocab_size=vocab,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=eos,
        bos_token_id=None,
        pad_token_id=None,
    )


def _text(model_type: str, vocab: int, eos: int) -> dict[str, Any]:
    """The text config's keyword arguments of each architecture (hidden 64, 2 layers)."""
    c = _common(vocab, eos)
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    linear = dict(
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"],
    )
    mla_moe = dict(
        intermediate_size=128,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        num_key_value_heads=4,
    )
    # sparse attention: the indexer keeps 4 keys per query, fewer than a prompt has. 16 heads:
    # with 4, a key whose every head is clipped by the relu scores exactly 0, such keys tie at
    # a row's top-k edge, and HF's own choice among them then varies with the sequence's length
    # (a prefix decoded alone and within its continuation disagreed)
    dsa = dict(index_topk=4, index_n_heads=16, index_head_dim=16)
    table: dict[str, dict[str, Any]] = {
        "llama": dict(intermediate_size=128, head_dim=16),
        "qwen3": dict(intermediate_size=128, head_dim=16),
        "mistral": dict(intermediate_size=128, head_dim=16, sliding_window=SLIDING_WINDOW),
        "qwen3_moe": dict(intermediate_size=128, head_dim=16, **moe),
        "qwen3_5_text": dict(intermediate_size=128, head_dim=16, **linear),
        "qwen3_5_moe_text": dict(head_dim=16, shared_expert_intermediate_size=32, **moe, **linear),
        "qwen3_next": dict(
            intermediate_size=128, head_dim=16, shared_expert_intermediate_size=32, **moe, **linear
        ),
        "glm4_moe": dict(
            intermediate_size=128,
            head_dim=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
        ),
        "gemma3_text": dict(
            intermediate_size=128,
            head_dim=16,
            sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention", "full_attention"],
        ),
        "gpt_oss": dict(
            intermediate_size=32,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention", "full_attention"],
        ),
        "minimax_m2": dict(
            intermediate_size=32, head_dim=16, num_local_experts=4, num_experts_per_tok=2
        ),
        "gemma4_text": dict(
            intermediate_size=128,
            head_dim=16,
            global_head_dim=32,
            sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            hidden_size_per_layer_input=0,
        ),
        "deepseek_v3": mla_moe,
        "deepseek_v32": mla_moe | dsa,
        "glm_moe_dsa": mla_moe | dsa,
        "qwen3_vl_text": dict(intermediate_size=128, head_dim=16),
        "lfm2": dict(intermediate_size=128, layer_types=["conv", "full_attention"]),
        "lfm2_moe": dict(
            intermediate_size=128,
            **moe,
            num_dense_layers=1,
            layer_types=["conv", "full_attention"],
        ),
        # one block of each kind (Mamba-2, attention, MoE, MLP); chunks of 4 rows, shorter than
        # a prompt, so a prompt's scan passes state between chunks
        "nemotron_h": dict(
            layers_block_type=["linear_attention", "full_attention", "moe", "mlp"],
            head_dim=16,
            intermediate_size=128,
            mamba_num_heads=4,
            mamba_head_dim=16,
            n_groups=2,
            ssm_state_size=16,
            chunk_size=4,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=32,
        ),
        # windows of SLIDING_WINDOW, CSA blocks of 2 rows (the indexer keeping 2, 16 heads as
        # dsa's), HCA blocks of 4: a prompt holds several of each; hash then top-k routing
        "deepseek_v4": dict(
            num_key_value_heads=1,
            head_dim=16,
            partial_rotary_factor=0.5,
            q_lora_rank=32,
            o_groups=2,
            o_lora_rank=16,
            moe_intermediate_size=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            sliding_window=SLIDING_WINDOW,
            compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
            layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
            mlp_layer_types=["hash_moe", "moe"],
            index_topk=2,
            index_n_heads=16,
            index_head_dim=16,
        ),
        # KDA then NoPE MLA (each head its own keys), a dense MLP then an MoE block
        "kimi_linear": dict(
            intermediate_size=128,
            num_key_value_heads=4,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_token=2,
            num_shared_experts=1,
            num_expert_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            linear_head_dim=16,
            linear_num_heads=2,
            linear_conv_kernel_dim=4,
            layer_types=["linear_attention", "full_attention"],
        ),
        "longcat_flash": dict(
            num_hidden_layers=4,  # num_layers 2: each listed layer holds two sublayers
            ffn_hidden_size=128,
            expert_ffn_hidden_size=32,
            n_routed_experts=4,
            zero_expert_num=2,
            moe_topk=2,
            kv_lora_rank=16,
            q_lora_rank=32,
            qk_rope_head_dim=8,
            head_dim=8,  # the rotary's width: the rope dims
            qk_nope_head_dim=16,
            v_head_dim=16,
            num_key_value_heads=4,
        ),
        "qwen3_vl_moe_text": dict(intermediate_size=128, head_dim=16, **moe),
        "mistral4": dict(
            **mla_moe,
            # the published rope but for the Llama 4 query scale's period (8192): 4, so that
            # prompts and documents cross its steps
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=128.0,
                original_max_position_embeddings=4,
                beta_fast=32.0,
                beta_slow=1.0,
                mscale=1.0,
                mscale_all_dim=1.0,
                llama_4_scaling_beta=0.1,
            ),
        ),
        # Muse: local then full (NoPE) layers, the defaults' pattern at 2 layers
        "muse_glimmer_text": dict(
            intermediate_size=128, head_dim=16, sliding_window=SLIDING_WINDOW
        ),
        "muse_spark_text": dict(
            intermediate_size=128,
            head_dim=16,
            sliding_window=SLIDING_WINDOW,
            moe_intermediate_size=32,
            moe_hidden_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            mlp_layer_types=["dense", "sparse"],
        ),
        # Inkling 2: a sliding then a full-attention layer, one block residual each; the
        # unembedding as wide as the tiny vocabulary
        "inkling2_text": dict(
            unpadded_vocab_size=vocab,
            head_dim=16,
            swa_num_attention_heads=4,
            swa_num_key_value_heads=2,
            swa_head_dim=16,
            sliding_window_size=SLIDING_WINDOW,
            d_rel=8,
            rel_extent=8,
            moe_intermediate_size=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_layers_per_attn_res_block=1,
            layer_types=["hybrid_sliding", "hybrid"],
        ),
    }
    return c | table[model_type]


def _vision(model_type: str) -> dict[str, Any]:
    """A one-block vision tower per wrapper (its size is irrelevant: it never runs)."""
    qwen = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    muse = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        pos_emb_height=4,
        pos_emb_width=4,
    )
    return {
        "qwen3_5": qwen,
        "qwen3_5_moe": qwen,
        "qwen3_vl": qwen | {"deepstack_visual_indexes": []},
        "qwen3_vl_moe": qwen | {"deepstack_visual_indexes": []},
        "kimi_k25": dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            pos_emb_height=4,
            pos_emb_width=4,
        ),
        "gemma3": dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        ),
        "muse_glimmer": muse,
        "muse_spark": muse,
        "inkling2": dict(
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            text_hidden_size=64,
            projection_hidden_dim=32,
        ),
    }[model_type]


# model_type -> (config class name, text model_type when a wrapper else None)
ARCHITECTURES: dict[str, tuple[str, str | None]] = {
    "llama": ("LlamaConfig", None),
    "qwen3": ("Qwen3Config", None),
    "mistral": ("MistralConfig", None),
    "qwen3_moe": ("Qwen3MoeConfig", None),
    "qwen3_5_text": ("Qwen3_5TextConfig", None),
    "qwen3_5": ("Qwen3_5Config", "qwen3_5_text"),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", None),
    "qwen3_5_moe": ("Qwen3_5MoeConfig", "qwen3_5_moe_text"),
    "qwen3_next": ("Qwen3NextConfig", None),
    "glm4_moe": ("Glm4MoeConfig", None),
    "gemma3_text": ("Gemma3TextConfig", None),
    "gemma3": ("Gemma3Config", "gemma3_text"),
    "gpt_oss": ("GptOssConfig", None),
    "minimax_m2": ("MiniMaxM2Config", None),
    "gemma4_text": ("Gemma4TextConfig", None),
    "deepseek_v3": ("DeepseekV3Config", None),
    "deepseek_v32": ("DeepseekV32Config", None),
    "glm_moe_dsa": ("GlmMoeDsaConfig", None),
    "qwen3_vl": ("Qwen3VLConfig", "qwen3_vl_text"),
    "qwen3_vl_moe": ("Qwen3VLMoeConfig", "qwen3_vl_moe_text"),
    "kimi_k25": ("Kimi_K25Config", "deepseek_v3"),
    "mistral4": ("Mistral4Config", None),
    "lfm2": ("Lfm2Config", None),
    "lfm2_moe": ("Lfm2MoeConfig", None),
    "longcat_flash": ("LongcatFlashConfig", None),
    "muse_glimmer": ("MuseGlimmerConfig", "muse_glimmer_text"),
    "muse_spark": ("MuseSparkConfig", "muse_spark_text"),
    "nemotron_h": ("NemotronHConfig", None),
    "kimi_linear": ("KimiLinearConfig", None),
    "deepseek_v4": ("DeepseekV4Config", None),
    "inkling2_text": ("Inkling2TextConfig", None),
    "inkling2": ("Inkling2Config", "inkling2_text"),
}


def _wrapper_options(model_type: str, vocab: int) -> dict[str, Any]:
    """A wrapper's own fields the tiny text and tower configs need (its projector's widths,
    Muse Spark's one-block audio tower, whose output width must be the text hidden size)."""
    muse = dict(out_hidden_size=128, projector_hidden_size=32)  # 32 x a 2 x 2 merge
    audio = dict(hidden_sizes=[8] * 4, depths=[1] * 4, out_hidden_size=64)
    return {
        "gemma3": {"mm_tokens_per_image": 4, "image_token_index": vocab - 1},
        "kimi_k25": {"projection_hidden_size": 32},  # its projector's norm: the tower's width
        "muse_glimmer": muse,
        "muse_spark": muse | {"audio_config": audio},
        "inkling2": {"image_token_id": vocab - 1},
    }.get(model_type, {})


def config_class(model_type: str) -> Callable[..., Any] | None:
    """The installed transformers' config class of `model_type` (None: this version lacks it)."""
    return getattr(transformers, ARCHITECTURES[model_type][0], None)


def tiny_config(model_type: str) -> Any:
    """The tiny config of `model_type`, sized to the built-in tiny tokenizer."""
    tokenizer = tiny_tokenizer()
    vocab, eos = len(tokenizer), tokenizer.convert_tokens_to_ids("<|im_end|>")
    cls, text_type = config_class(model_type), ARCHITECTURES[model_type][1]
    if text_type is None:
        return cls(**_text(model_type, vocab, eos))
    return cls(
        text_config=_text(text_type, vocab, eos),
        vision_config=_vision(model_type),
        tie_word_embeddings=False,
        **_wrapper_options(model_type, vocab),
    )


def save_tiny_target(folder: Path, model_type: str) -> Path:
    """A tiny random `model_type` target with the tiny tokenizer, as an HF folder."""
    config = tiny_config(model_type)
    if ARCHITECTURES[model_type][1]:  # a wrapper is saved whole, vision tower included
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = transformers.AutoModelForImageTextToText.from_config(config)
        with atomic_directory(folder) as tmp:
            model.save_pretrained(tmp)
    else:
        save_random_target(folder, config, 0)
    tiny_tokenizer().save_pretrained(folder)
    return folder
