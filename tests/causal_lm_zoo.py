"""Tiny configs of every causal-LM model_type the installed transformers has.

The list is transformers' own (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`), read when called, never
written here. Each config is built from its class with the common tiny shape (`COMMON`: hidden 32,
2 layers, a 512-token vocabulary) where the class takes those fields, then the type's own fix-ups
from `FIXUPS`, the one table of per-type exceptions: extra fields a type needs at tiny size, or
`Excluded(reason)` for a type that cannot train here. A type whose causal-LM class is its text
model alone, saved as a text config no causal-LM class loads back (Emu3, Mllama), is saved as its
multimodal wrapper, as its released checkpoints are.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, AutoModelForImageTextToText
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

VOCAB = 512
MAX_PARAMETERS = 20_000_000  # the largest tiny config here has ~14 M (a 30k-row tower vocab)
# The tiny shape, passed where a config class takes the field (under its own name or an
# attribute_map alias): dense, MoE (4 experts, 2 per token), latent attention, the decoder
# half of an encoder-decoder config, short convolutions and state-space sizes.
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=64,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    kv_lora_rank=16,
    q_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    decoder_layers=2,
    encoder_layers=2,
    decoder_attention_heads=4,
    encoder_attention_heads=4,
    decoder_ffn_dim=64,
    encoder_ffn_dim=64,
    rotary_dim=4,
    is_decoder=True,  # encoder families' LM heads (BERT, RoBERTa...) run causal only so
)


@dataclass(frozen=True)
class Excluded:
    """A model_type the test does not train, and why (the README lists it)."""

    reason: str


# A multimodal wrapper's towers (one small block each: the product never builds them onto the
# device or runs them), passed where the sub-config class takes the field.
TOWER: dict[str, Any] = dict(
    hidden_size=32,
    num_hidden_layers=1,
    depth=1,
    num_attention_heads=2,
    num_heads=2,
    intermediate_size=64,
    out_hidden_size=32,
    image_size=28,
    patch_size=14,
)

_ASSISTANT = "a draft model: its forward reads the main model's shared KV states"
_ATTENTION = ("full_attention", "sliding_attention")
_MLA = dict(num_key_value_heads=4)  # latent attention: as many KV heads as query heads
# sparse latent attention: a small indexer keeping 4 keys per query, fewer than a record has
_DSA = _MLA | dict(index_topk=4, index_n_heads=4, index_head_dim=16)
_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16)

_SLOW = "{what} run torch's fallback on the CPU: 3 steps take ~{s} s here (their kernels need CUDA)"
# the unembedding's rows (unpadded_vocab_size) must not exceed the embedding's, which a checkpoint
# stores it padded to (the default 200058 exceeds the tiny 512): 128 padded rows (966 released)
_INKLING = dict(vocab_size=VOCAB + 128, unpadded_vocab_size=VOCAB)
# model_type -> its fix-ups at tiny size, or why it is not trained here.
FIXUPS: dict[str, dict[str, Any] | Excluded] = {
    "axk1": _MLA,
    "axk2": _MLA,
    "bamba": _MAMBA2,
    "blt": Excluded(
        "a byte-level model: its patcher and local encoder/decoder have their own "
        "hash-embedding configs, not a tiny text config"
    ),
    "cohere_compass_text": dict(
        rope_parameters={t: dict(rope_type="default", rope_theta=1e4) for t in _ATTENTION}
    ),
    "cpmant": Excluded(
        "its forward prepends learned prompt positions to every input: its layers see more rows than tokens"
    ),
    "dbrx": Excluded(
        "its tiny checkpoint does not load back (transformers reports mismatched expert shapes)"
    ),
    "deepseek_v2": _MLA,
    "deepseek_v3": _MLA,
    "deepseek_v32": _DSA,
    # its packed forward's windows, compressed blocks (CSA 2 rows, HCA 4) and indexer (keeping
    # 2) within a record's length (the defaults: windows of 128, HCA blocks of 128)
    "deepseek_v4": dict(
        sliding_window=4,
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
        layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
        index_topk=2,
        index_n_heads=4,
        index_head_dim=16,
    ),
    # its vision tower's default MoE schedule (per-layer settings) names 42 layers: one dense
    # layer here; both towers' adapters must match the tiny widths
    "dots3_note": dict(
        vision_config=dict(pyramid_num_routed=[-1], adapter_in_dim=32, adapter_out_dim=32),
        audio_config=dict(adapter_input_size=32, adapter_out_dim=32),
        text_config=dict(num_key_value_heads=4),
    ),
    "dots3_note_text": dict(num_key_value_heads=4),
    "electra": dict(embedding_size=32),  # the drafter shares embeddings of hidden width
    "emu3": dict(vocabulary_map={}),  # its wrapper maps image tokens to text ids: none here
    "falcon_h1": Excluded(_SLOW.format(what="its Mamba2 layers", s=50)),
    "gemma3n": Excluded("its vision tower needs timm, which is not installed"),
    # its default shares the KV of the last 15 layers: the last of 2 here (the layer it reads
    # from must be of its type)
    "gemma3n_text": dict(
        vocab_size_per_layer_input=VOCAB,
        hidden_size_per_layer_input=8,
        num_kv_shared_layers=1,
        layer_types=["sliding_attention"] * 2,
    ),
    "gemma4": dict(
        text_config=dict(vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8)
    ),
    "gemma4_assistant": Excluded(_ASSISTANT),
    "gemma4_text": dict(vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8),
    "gemma4_unified_assistant": Excluded(_ASSISTANT),
    "glm4_moe_lite": _MLA,
    "glm_moe_dsa": _DSA,
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),
    "granitemoehybrid": _MAMBA2,
    "hrm_text": Excluded(
        "a hierarchical recurrent model: two layer stacks run in loops, no list of num_hidden_layers layers"
    ),
    "inkling2_loop_text": _INKLING,
    "inkling2_text": _INKLING,
    # its packed forward's KDA at a small size (2 heads of 8: the default 32 of 128 took ~70 s
    # for 3 steps), then an MLA layer, each head its own keys (as HF's MLA needs)
    "kimi_linear": dict(
        num_key_value_heads=4,
        linear_num_heads=2,
        linear_head_dim=8,
        layer_types=["linear_attention", "full_attention"],
    ),
    "kolibri1_1": dict(head_dim=16, index_num_heads=1),
    # a short convolution then attention (the default makes every layer attention)
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    "longcat_flash": _MLA | dict(num_layers=2, zero_expert_num=2),  # num_hidden_layers: 4
    "mamba2": dict(num_heads=4, head_dim=16, n_groups=1, state_size=16),
    "minicpm3": _MLA,
    # its packed forward's Mamba-2 mixers at a small size, chunks of 4 rows (several per record)
    "nemotron_h": dict(
        mamba_num_heads=4, mamba_head_dim=16, n_groups=1, ssm_state_size=16, chunk_size=4
    ),
    "musicgen": Excluded("a text-to-audio model: its decoder reads several codebooks per step"),
    "musicgen_melody": Excluded(
        "a text-to-audio model: its decoder reads several codebooks per step"
    ),
    "reformer": Excluded(
        "LSH and axial-position attention: inputs must be padded to its chunk length, so a layer sees the padding"
    ),
    "rembert": dict(input_embedding_size=32, output_embedding_size=32),  # as electra
    "sarvam_mla": _MLA,
    "xlm": dict(causal=True),
    "xlnet": Excluded(
        "a permutation LM: its layers run sequence-first and attend both ways (refused at load)"
    ),
    "xmod": Excluded("its forward needs a language adapter chosen first (set_default_language)"),
    "youtu": _MLA,
    "zamba": dict(layers_block_type=["mamba", "hybrid"]),
    "zamba2": dict(layers_block_type=["mamba", "hybrid"]),
    "zaya": dict(num_experts_per_tok=1),
}


def causal_lm_types() -> list[str]:
    """Every model_type transformers maps to a causal-LM class, sorted."""
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _accepted(cls: type) -> set[str]:
    names = set(inspect.signature(cls.__init__).parameters)
    return names | set(getattr(cls, "attribute_map", {}))


def _shaped(cls: type, shape: dict[str, Any], fix: dict[str, Any]) -> Any:
    accepted = _accepted(cls)
    return {k: v for k, v in shape.items() if k in accepted} | fix


def tiny_config(model_type: str) -> Any:
    """The tiny config of `model_type` (see the module doc); ValueError for an excluded type.
    A config with sub-configs (a multimodal wrapper, a captioner) gets a tiny text config and
    one-block towers; a fix-up's `<name>_config` entries apply to that sub-config."""
    fix = dict(FIXUPS.get(model_type, {}))
    if isinstance(FIXUPS.get(model_type), Excluded):
        raise ValueError(f"{model_type} is excluded: {FIXUPS[model_type].reason}")
    cls = CONFIG_MAPPING[model_type]
    subs = getattr(cls, "sub_configs", None) or {}
    if not subs:
        return cls(**_shaped(cls, COMMON, fix))
    default = cls()
    kwargs = {}
    for name in subs:
        sub = getattr(default, name, None)
        if sub is None or not hasattr(sub, "to_dict"):
            continue
        shape = COMMON if name == "text_config" else TOWER
        own = fix.pop(name, {})
        kwargs[name] = _shaped(type(sub), shape, own) | {"model_type": sub.model_type}
    top = COMMON if "text_config" not in subs else {"tie_word_embeddings": False}
    return cls(**(_shaped(cls, top, fix) | kwargs))


def save_tiny(folder: Path, model_type: str) -> tuple[Path, Any]:
    """A random tiny `model_type` target with the built-in tiny tokenizer (its vocabulary fits
    in VOCAB) as an HF folder, and its config."""
    from target_kit import save_random_target

    from dflash_async.targets.tiny import tiny_tokenizer

    config = tiny_config(model_type)
    with torch.device("meta"):  # sized before any memory is spent on it
        model = AutoModelForCausalLM.from_config(config)
    size = sum(p.numel() for p in model.parameters())
    if size > MAX_PARAMETERS:
        raise AssertionError(f"the tiny {model_type} has {size} parameters: add a fix-up")
    if model.config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        save_random_target(folder, config, 0)
    else:  # its causal-LM class saves its text config alone, which no causal-LM class loads back
        _save_wrapper(folder, config)
    tiny_tokenizer().save_pretrained(folder)
    return folder, config


def _save_wrapper(folder: Path, config: Any) -> None:
    """A random multimodal wrapper of `config` (transformers' image-text-to-text class), as a
    released checkpoint of a type whose causal-LM class is its text model alone (Emu3, Mllama)
    is; the product loads its language model from it."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForImageTextToText.from_config(config)
    model.save_pretrained(folder)


def zoo_table() -> dict[str, tuple[str, str]]:
    """model_type -> ("trains" | "refused" | "excluded", reason): refused is start-up's own
    answer for the tiny config (targets/families.unsupported_reason), excluded FIXUPS'."""
    from dflash_async.targets.families import unsupported_reason

    table = {}
    for model_type in causal_lm_types():
        fix = FIXUPS.get(model_type)
        if isinstance(fix, Excluded):
            table[model_type] = ("excluded", fix.reason)
            continue
        refusal = unsupported_reason(tiny_config(model_type))
        table[model_type] = ("refused", refusal) if refusal else ("trains", "")
    return table


def readme_section() -> str:
    """README's account of the zoo: how many types train, which are refused and excluded."""
    import transformers

    table = zoo_table()
    trains = [t for t, (status, _) in table.items() if status == "trains"]
    refused: dict[str, list[str]] = {}  # start-up's line without the model_type -> the types
    for t, (status, why) in table.items():
        if status == "refused":
            refused.setdefault(
                why.split(";")[0].replace(f"target model_type '{t}' ", ""), []
            ).append(t)
    excluded = [(t, why) for t, (status, why) in table.items() if status == "excluded"]
    lines = [
        f"With transformers {transformers.__version__}, {len(trains)} of its {len(table)} "
        "causal-LM `model_type`s train 3 steps on the CPU from a tiny random config "
        "(tests/targets/test_every_causal_lm.py).",
        "",
        *[
            f"Refused at start-up ({len(types)}), each {why}: "
            + ", ".join(f"`{t}`" for t in types)
            + "."
            for why, types in refused.items()
        ],
        "",
        f"Not trained by the test ({len(excluded)}):",
        "",
        *[f"- `{t}`: {why}" for t, why in excluded],
    ]
    return "\n".join(lines)
