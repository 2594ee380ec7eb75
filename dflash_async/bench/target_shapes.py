"""The public model shapes `bench target` and the other target benchmarks build with random
weights: `shape_configs()`, name -> (config as published, or truncated where it says, and the
captured layer ids); `unavailable_shapes()`, name -> why the installed transformers cannot build
it (skipped, with that reason, by `bench target`). A shape is a text config, or a multimodal
wrapper's config where its language model has no causal-LM class of its own (Qwen3-VL-MoE: the
wrapper is what loads); `causal_lm_auto_class` (targets/generic_config.py) builds either."""

from __future__ import annotations

from transformers import PretrainedConfig

from dflash_async.model.drafter_config import default_target_layer_ids
from dflash_async.targets.config_readers import text_config_of


def shape_configs() -> dict[str, tuple[PretrainedConfig, tuple[int, ...]]]:
    """Public model shapes (config values as published) and the captured layer ids (the
    published drafters' for the first three, docs/DFLASH.md s.1's default rule for the rest)."""
    import transformers
    from transformers import (
        DeepseekV3Config,
        Gemma3TextConfig,
        Glm4MoeConfig,
        GptOssConfig,
        MiniMaxM2Config,
        MistralConfig,
        Qwen3_5MoeTextConfig,
        Qwen3_5TextConfig,
        Qwen3Config,
        Qwen3MoeConfig,
        Qwen3NextConfig,
    )

    qwen = dict(
        vocab_size=151936,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        max_position_embeddings=40960,
    )
    shapes = {
        "qwen3-8b": (
            Qwen3Config(
                hidden_size=4096,
                intermediate_size=12288,
                num_hidden_layers=36,
                num_attention_heads=32,
                num_key_value_heads=8,
                head_dim=128,
                **qwen,
            ),
            (1, 9, 17, 25, 33),
        ),
        "qwen3.5-9b": (
            Qwen3_5TextConfig(
                hidden_size=4096,
                intermediate_size=12288,
                num_hidden_layers=32,
                num_attention_heads=16,
                num_key_value_heads=4,
                head_dim=256,
                linear_num_key_heads=16,
                linear_num_value_heads=32,
                linear_key_head_dim=128,
                linear_value_head_dim=128,
                vocab_size=248320,
                tie_word_embeddings=False,
            ),
            (1, 8, 15, 22, 29),
        ),
        "qwen3-30b-a3b": (
            Qwen3MoeConfig(
                hidden_size=2048,
                intermediate_size=6144,
                num_hidden_layers=48,
                num_attention_heads=32,
                num_key_value_heads=4,
                head_dim=128,
                num_experts=128,
                num_experts_per_tok=8,
                moe_intermediate_size=768,
                **qwen,
            ),
            (1, 12, 23, 34, 44),
        ),
        # transformers' defaults are Qwen3.5-35B-A3B's published text config (40 layers, 3 Gated
        # DeltaNet : 1 gated attention, 256 experts, 8 routed + 1 shared of width 512)
        "qwen3.5-35b-a3b": Qwen3_5MoeTextConfig(tie_word_embeddings=False),
        # gpt-oss-20b: 24 layers alternating a 128-token window with full attention, sinks,
        # 32 experts (top 4) of width 2880, yarn RoPE (transformers' defaults otherwise = 120b)
        "gpt-oss-20b": GptOssConfig(
            num_hidden_layers=24,
            num_local_experts=32,
            layer_types=["sliding_attention", "full_attention"] * 12,
        ),
        # the DeepSeek-V3 / Kimi-K2 architecture (MLA, shared + routed experts) at the shape of
        # Moonlight-16B-A3B, the published deepseek_v3 model that fits one GPU in bf16
        "moonlight-16b-a3b": DeepseekV3Config(
            hidden_size=2048,
            intermediate_size=11264,
            moe_intermediate_size=1408,
            num_hidden_layers=27,
            num_attention_heads=16,
            num_key_value_heads=16,
            n_routed_experts=64,
            n_shared_experts=2,
            num_experts_per_tok=6,
            first_k_dense_replace=1,
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.446,
            norm_topk_prob=True,
            vocab_size=163840,
            rope_theta=50000.0,
            tie_word_embeddings=False,
        ),
        # Gemma-3-12B's text model: 5 sliding (1024) : 1 full layers, head_dim 256
        "gemma3-12b": Gemma3TextConfig(
            hidden_size=3840,
            intermediate_size=15360,
            num_hidden_layers=48,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=256,
            sliding_window=1024,
            query_pre_attn_scalar=256,
            vocab_size=262208,
            tie_word_embeddings=False,
        ),
        # Gemma-3-27B's text model (62 layers, 5 sliding : 1 full, head_dim 128)
        "gemma3-27b": Gemma3TextConfig(
            hidden_size=5376,
            intermediate_size=21504,
            num_hidden_layers=62,
            num_attention_heads=32,
            num_key_value_heads=16,
            head_dim=128,
            sliding_window=1024,
            query_pre_attn_scalar=168,
            vocab_size=262208,
            tie_word_embeddings=False,
        ),
        # GLM-4.5-Air (transformers' defaults: 128 experts, top 8 + 1 shared, partial RoPE)
        # TRUNCATED to its first 16 of 46 layers, ~37B of its 106B parameters: 212 GB in bf16
        # does not fit one H200; per-layer speed is the same
        "glm-4.5-air-16l": Glm4MoeConfig(num_hidden_layers=16, tie_word_embeddings=False),
        # Mistral-7B-v0.1 (transformers' defaults: 32 layers, 4096-token sliding windows)
        "mistral-7b": MistralConfig(tie_word_embeddings=False),
        # MiniMax-M2 (transformers' defaults: 256 experts of width 1536, top 8, partial RoPE)
        # TRUNCATED to its first 8 of 62 layers: 230B parameters do not fit one H200
        "minimax-m2-8l": MiniMaxM2Config(num_hidden_layers=8, tie_word_embeddings=False),
        # Qwen3-Next-80B-A3B (transformers' defaults: 3 Gated DeltaNet : 1 gated attention,
        # 512 experts top 10 + shared) TRUNCATED to its first 16 of 48 layers (160 GB in bf16)
        "qwen3-next-80b-a3b-16l": Qwen3NextConfig(num_hidden_layers=16, tie_word_embeddings=False),
        # Kimi K2.5's language model (its text config, model_type deepseek_v3, is what loads:
        # targets/loading.py): Kimi K2's published shape, 61 layers (1 dense, then MoE of 384
        # experts, top 8 + 1 shared, width 2048), MLA (q rank 1536, kv rank 512), yarn x64 over
        # 4096 positions. TRUNCATED to its first 4 layers: each MoE layer holds 16.9B parameters
        # (34 GB in bf16), so 1 dense + 3 MoE layers and the embeddings (~105 GB) are what one
        # 140 GB GPU holds with a pack's activations; all 4 captured (5 distinct layers there
        # are not)
        "kimi-k2.5-4l": (
            DeepseekV3Config(
                hidden_size=7168,
                intermediate_size=18432,
                moe_intermediate_size=2048,
                num_hidden_layers=4,
                num_attention_heads=64,
                num_key_value_heads=64,
                n_routed_experts=384,
                n_shared_experts=1,
                num_experts_per_tok=8,
                first_k_dense_replace=1,
                kv_lora_rank=512,
                q_lora_rank=1536,
                qk_nope_head_dim=128,
                qk_rope_head_dim=64,
                v_head_dim=128,
                n_group=1,
                topk_group=1,
                routed_scaling_factor=2.827,
                norm_topk_prob=True,
                vocab_size=163840,
                max_position_embeddings=262144,
                rope_parameters=dict(
                    rope_type="yarn",
                    rope_theta=50000.0,
                    factor=64.0,
                    original_max_position_embeddings=4096,
                    beta_fast=1.0,
                    beta_slow=1.0,
                    mscale=1.0,
                    mscale_all_dim=1.0,
                ),
                tie_word_embeddings=False,
            ),
            (0, 1, 2, 3),
        ),
    }
    if hasattr(transformers, "Qwen3VLMoeConfig"):  # see unavailable_shapes
        # Qwen3-VL-30B-A3B: the wrapper (its language model has no causal-LM class; the
        # vision tower, transformers' default of 27 blocks, never runs on text), its language
        # model as published: Qwen3-30B-A3B's layers (48, 128 experts top 8 of width 768, GQA
        # 32/4 heads of 128) with interleaved M-RoPE [24, 20, 20] at theta 5e6; 61 GB in bf16
        text = transformers.Qwen3VLMoeTextConfig(
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
            vocab_size=151936,
            max_position_embeddings=262144,
            rms_norm_eps=1e-6,
            rope_parameters=dict(
                rope_type="default",
                rope_theta=5_000_000.0,
                mrope_section=[24, 20, 20],
                mrope_interleaved=True,
            ),
            tie_word_embeddings=False,
        )
        shapes["qwen3-vl-30b-a3b"] = transformers.Qwen3VLMoeConfig(
            text_config=text.to_dict(),
            vision_config=dict(out_hidden_size=2048),
            tie_word_embeddings=False,
        )
    if hasattr(transformers, "Mistral4Config"):  # see unavailable_shapes
        # Mistral-Small-4-119B-2603's text model (transformers' Mistral4Config defaults, made
        # from that checkpoint: 36 layers of MLA (q rank 1024, kv rank 256) and 128 experts top
        # 4 + 1 shared of width 2048, yarn x128 over 8192 positions, Llama 4's query scale with
        # beta 0.1; its config.json itself not read here, so n_group is transformers' 1)
        # TRUNCATED to its first 16 of 36 layers: 119B parameters are 238 GB in bf16; 16 layers
        # are ~53B (107 GB)
        shapes["mistral-small-4-16l"] = transformers.Mistral4Config(
            num_hidden_layers=16, tie_word_embeddings=False
        )
    if hasattr(transformers, "Gemma4TextConfig"):  # not in every transformers we run
        # Gemma 4's text layer at the 31B dense shape (60 layers, 5 sliding (1024) : 1 full;
        # 256-wide sliding heads, 512-wide full ones whose values are their raw keys
        # (attention_k_eq_v); 31.0B parameters): Gemma-4-31B's dimensions as recalled, its
        # config.json not readable from this machine, hence "-like"
        shapes["gemma4-31b-like"] = transformers.Gemma4TextConfig(
            hidden_size=5376,
            intermediate_size=21504,
            num_hidden_layers=60,
            num_attention_heads=32,
            num_key_value_heads=16,
            head_dim=256,
            global_head_dim=512,
            sliding_window=1024,
            layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 10,
            hidden_size_per_layer_input=0,
            attention_k_eq_v=True,
            vocab_size=262144,
            tie_word_embeddings=True,
        )
    # LFM2 and LFM2-MoE (values from their published config.json): a transformers older than
    # their config classes has neither, and leaves these shapes out of the table
    conv, attention = "conv", "full_attention"
    lfm2 = dict(
        max_position_embeddings=128000,
        norm_eps=1e-5,
        conv_L_cache=3,
        conv_bias=False,
        rope_theta=1_000_000.0,
        vocab_size=65536,
        tie_word_embeddings=True,
    )
    if hasattr(transformers, "Lfm2Config"):
        # LFM2-2.6B, the largest dense model of the LFM2 release: 30 layers (22 short convolutions, 8 attention),
        # its FFN width taken as given (block_auto_adjust_ff_dim off); 2,569,272,320 parameters
        shapes["lfm2-2.6b"] = transformers.Lfm2Config(
            hidden_size=2048,
            intermediate_size=10752,
            block_auto_adjust_ff_dim=False,
            num_hidden_layers=30,
            num_attention_heads=32,
            num_key_value_heads=8,
            layer_types=[conv, conv, attention, conv, conv, attention]
            + ([conv, conv, conv, attention] * 4)
            + [conv, conv, attention, conv, conv, attention, conv, conv],
            **lfm2,
        )
    if hasattr(transformers, "Lfm2MoeConfig"):
        # LFM2-8B-A1B: 24 layers (18 short convolutions, 6 attention), the first 2 dense, then
        # 32 experts of width 1792 (top 4, sigmoid router with expert bias); 8.34B parameters
        shapes["lfm2-8b-a1b"] = transformers.Lfm2MoeConfig(
            hidden_size=2048,
            intermediate_size=7168,
            moe_intermediate_size=1792,
            num_hidden_layers=24,
            num_attention_heads=32,
            num_key_value_heads=8,
            num_dense_layers=2,
            num_experts=32,
            num_experts_per_tok=4,
            norm_topk_prob=True,
            use_expert_bias=True,
            routed_scaling_factor=1.0,
            layer_types=[conv, conv, attention]
            + ([conv, conv, conv, attention] * 4)
            + [conv, conv, attention, conv, conv],
            **lfm2,
        )
    if hasattr(transformers, "LongcatFlashConfig"):  # see unavailable_shapes
        # LongCat-Flash (transformers' defaults are LongCat-Flash-Chat's published config: hidden
        # 6144, 28 layers of 2 MLA + dense MLP sublayers and a shortcut MoE of 512 experts of
        # width 2048 plus 256 zero experts, top 12) TRUNCATED to its first 3 of 28 layers: a
        # layer is ~20.0B parameters (40 GB in bf16), so 3 layers and the embedding and lm_head
        # (1.6B) are 123 GB, what fits a 140 GB GPU with room for a pack's activations (4 would
        # be 163 GB). The taps are its 3 listed layers (num_hidden_layers counts 6 sublayers).
        shapes["longcat-flash-3l"] = (transformers.LongcatFlashConfig(num_layers=3), (0, 1, 2))
    if hasattr(transformers, "NemotronHConfig"):  # see unavailable_shapes
        # Nemotron-H-8B-Base-8K (values from its published config.json): 52 blocks, 24 Mamba-2
        # mixers (128 heads x 64, state 128, 8 groups, chunk 128, conv 4), 4 attention blocks (32
        # heads, 8 KV heads of 128, no positions) and 24 squared-ReLU MLPs of width 21504;
        # ~8.1B parameters
        shapes["nemotron-h-8b"] = transformers.NemotronHConfig(
            hybrid_override_pattern="M-M-M-M*-" + "M-M-M-M-M*-" * 3 + "M-M-M-M-M-",
            hidden_size=4096,
            intermediate_size=21504,
            mlp_hidden_act="relu2",
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            mamba_num_heads=128,
            mamba_head_dim=64,
            ssm_state_size=128,
            n_groups=8,
            conv_kernel=4,
            chunk_size=128,
            expand=2,
            use_conv_bias=True,
            use_bias=False,
            mlp_bias=False,
            attention_bias=False,
            layer_norm_epsilon=1e-5,
            vocab_size=131072,
            max_position_embeddings=8192,
            tie_word_embeddings=False,
        )
    if hasattr(transformers, "KimiLinearConfig"):  # see unavailable_shapes
        # Kimi-Linear-48B-A3B (transformers' defaults are its published config.json: hidden 2304,
        # 27 layers, NoPE MLA of 32 heads with 512-wide latents, 256 experts of width 1024 top 8
        # + 1 shared past one dense layer; KDA of 32 heads x 128, convolutions 4 wide), its 7 MLA
        # layers where the checkpoint's linear_attn_config lists them (1-indexed), the other 20
        # KDA. Whole: 49.1B parameters, 98 GB in bf16, which one 140 GB GPU holds
        full_attention = [4, 8, 12, 16, 20, 24, 27]
        shapes["kimi-linear-48b-a3b"] = transformers.KimiLinearConfig(
            linear_attn_config=dict(
                full_attn_layers=full_attention,
                kda_layers=[i for i in range(1, 28) if i not in full_attention],
                num_heads=32,
                head_dim=128,
                short_conv_kernel_size=4,
            ),
            tie_word_embeddings=False,
        )
    shapes.update(_sparse_attention_shapes(transformers))
    shapes.update(_muse_shapes(transformers))
    if hasattr(transformers, "Inkling2TextConfig"):
        # Inkling 2's language model. No published config.json was read: transformers' defaults,
        # documented as thinkingmachines/Inkling-2-Small-MXFP8's (48 layers, hidden 4608, 48
        # heads of 128 with 8 KV heads in both kinds, 5 sliding (1024) : 1 full layer, 384
        # experts of width 2304, top 8; a 201024-token embedding, 200058 unembedded; 593.7B
        # parameters). TRUNCATED to 4 layers, three sliding then one full, so both kinds run:
        # a layer is ~12.3B parameters (24.6 GB in bf16), 4 layers with the embedding and
        # lm_head 51.2B, 102 GB, what fits a 140 GB GPU with room for a pack's activations (5
        # would be 127 GB); per-layer speed is the same
        config = transformers.Inkling2TextConfig(
            num_hidden_layers=4, layer_types=["hybrid_sliding"] * 3 + ["hybrid"]
        )
        shapes["inkling-2-small-4l"] = (config, (0, 1, 2, 3))
    return {
        name: shape
        if isinstance(shape, tuple)
        else (shape, default_target_layer_ids(text_config_of(shape).num_hidden_layers, 5))
        for name, shape in shapes.items()
    }


# Shapes whose config class only newer transformers have: name -> the class it needs.
_NEWER_SHAPES = {
    "lfm2-2.6b": "Lfm2Config",
    "lfm2-8b-a1b": "Lfm2MoeConfig",
    "longcat-flash-3l": "LongcatFlashConfig",
    "deepseek-v3.2-7l": "DeepseekV32Config",
    "glm-5-8l": "GlmMoeDsaConfig",
    "qwen3-vl-30b-a3b": "Qwen3VLMoeConfig",
    "mistral-small-4-16l": "Mistral4Config",
    "muse-glimmer-30b": "MuseGlimmerTextConfig",
    "muse-spark-4l": "MuseSparkTextConfig",
    "nemotron-h-8b": "NemotronHConfig",
    "kimi-linear-48b-a3b": "KimiLinearConfig",
    "deepseek-v4-flash-8l": "DeepseekV4Config",
    "inkling-2-small-4l": "Inkling2TextConfig",
}


def unavailable_shapes() -> dict[str, str]:
    """The shapes this transformers cannot build, name -> why (their config class is newer)."""
    import transformers

    return {
        name: f"transformers {transformers.__version__} has no {cls}"
        for name, cls in _NEWER_SHAPES.items()
        if not hasattr(transformers, cls)
    }


def _sparse_attention_shapes(transformers) -> dict[str, PretrainedConfig | tuple]:
    """The sparse-attention shapes (DeepSeek Sparse Attention: MLA + lightning indexer; DeepSeek-V4:
    compressed blocks under an indexer) the installed transformers has a config class for
    (`unavailable_shapes` names the others)."""
    shapes: dict[str, PretrainedConfig | tuple] = {}
    if hasattr(transformers, "DeepseekV32Config"):
        # DeepSeek-V3.2 (transformers' defaults: 61 layers, hidden 7168, MLA 128 heads, 256
        # experts top 8 + 1 shared, the first 3 layers dense, an indexer of 64 heads x 128 keeping
        # 2048 keys; its published yarn RoPE, factor 40 over 4096). TRUNCATED to its first 7
        # layers (3 dense + 4 MoE, ~50B of its 671B parameters, ~99 GB in bf16): one MoE layer
        # is ~11.5B, so the whole model (1.3 TB) is far from one 140 GB GPU; per-layer speed is
        # the same. Layers 1-5 captured: the default rule picks layer 2 twice out of 7
        config = transformers.DeepseekV32Config(
            num_hidden_layers=7,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=40.0,
                original_max_position_embeddings=4096,
                beta_fast=32,
                beta_slow=1,
                mscale=1.0,
                mscale_all_dim=1.0,
            ),
            tie_word_embeddings=False,
        )
        shapes["deepseek-v3.2-7l"] = (config, (1, 2, 3, 4, 5))
    if hasattr(transformers, "GlmMoeDsaConfig"):
        # GLM-5 (transformers' defaults: 78 layers, hidden 6144, MLA 64 heads with 256-wide
        # values, 256 experts top 8 + 1 shared, the first 3 layers dense, an indexer of 32 heads
        # x 128 keeping 2048 keys, every layer its own indexer). TRUNCATED to its first 8 layers
        # (3 dense + 5 MoE, ~52B of the ~742B its config counts, ~105 GB in bf16): one MoE layer is
        # ~9.9B; per-layer speed is the same
        shapes["glm-5-8l"] = transformers.GlmMoeDsaConfig(
            num_hidden_layers=8, tie_word_embeddings=False
        )
    if hasattr(transformers, "DeepseekV4Config"):
        # DeepSeek-V4-Flash (transformers' defaults are its shape: 43 layers, hidden 4096, 64
        # heads of 512 sharing one K=V head, 4 hyper-connection streams, windows of 128, 256
        # experts top 6 + 1 shared, the first 3 hash-routed, an indexer of 64 heads x 128 keeping
        # 512 blocks; its layers: 2 sliding-window ones, then CSA (blocks of 4) and HCA (blocks
        # of 128) alternating). TRUNCATED to its first 8 layers (2 sliding, 3 CSA, 3 HCA; 53.8B of
        # its 284B parameters, 108 GB in bf16): one layer is ~6.6B (13.2 GB), so 8 layers and the
        # embedding and lm_head fit a 140 GB GPU with room for a pack's activations (9 would be
        # 121 GB); per-layer speed is the same. Its compressed branches' yarn RoPE scaling is
        # left at the default rope (the speed is the same)
        layer_types = ["sliding_attention"] * 2
        layer_types += ["compressed_sparse_attention", "heavily_compressed_attention"] * 3
        shapes["deepseek-v4-flash-8l"] = transformers.DeepseekV4Config(
            num_hidden_layers=8, layer_types=layer_types, tie_word_embeddings=False
        )
    return shapes


def _muse_shapes(transformers) -> dict[str, PretrainedConfig | tuple]:
    """The Muse language models the installed transformers has a config class for: their text
    configs, which no causal-LM class takes (the benchmark builds the decoder stack alone, as a
    wrapper's target worker runs it). No published config.json was read: transformers' defaults,
    documented as those checkpoints' (meta-models/Muse-Glimmer-30B, Muse-Spark-Open-816B-A42B)."""
    shapes: dict[str, PretrainedConfig | tuple] = {}
    if hasattr(transformers, "MuseGlimmerTextConfig"):
        # Muse-Glimmer-30B's language model (transformers' defaults: 52 layers, hidden 6656,
        # 32 heads of 128 with 2 KV heads and an output gate, MLP 19968; 3 sliding (2048) : 1
        # full NoPE layer; a 202048-token vocabulary): 27.9B parameters with the lm_head, its
        # decoder stack 26.5B (53 GB in bf16), whole
        shapes["muse-glimmer-30b"] = transformers.MuseGlimmerTextConfig()
    if hasattr(transformers, "MuseSparkTextConfig"):
        # Muse Spark's language model (transformers' defaults: 62 layers, hidden 8192, 128 heads
        # of 64 with 16 KV heads, every layer a MoE of 256 experts of width 4096, top 8, run at a
        # pooled width of 4096; 3 sliding (2048) : 1 full NoPE layer; 818B parameters)
        # TRUNCATED to its first 4 layers, their kinds as in the whole model (sliding, full
        # NoPE, sliding, sliding): a layer is 13.2B parameters (26 GB in bf16), so 4 layers and
        # the embedding (1.7B) are 54.3B, 109 GB, what fits a 140 GB GPU with room for a pack's
        # activations (5 would be 135 GB); per-layer speed is the same
        whole = transformers.MuseSparkTextConfig()
        config = transformers.MuseSparkTextConfig(
            num_hidden_layers=4,
            layer_types=whole.layer_types[:4],
            layer_rope_theta=whole.layer_rope_theta[:4],
            mlp_layer_types=whole.mlp_layer_types[:4],
        )
        shapes["muse-spark-4l"] = (config, (0, 1, 2, 3))
    return shapes
