"""targets/families.py owns the target families: ONE table, model_type -> `Family`, holding all a
family differs in, and `GENERIC`, the family of every other model_type transformers builds as a
decoder LM (its own HF forward per document: targets/generic.py). Start-up accepts the table's
model_types and every other one the generic path can run (anything else exits 2 naming why,
`unsupported_reason`); the README's target table is generated from it (forward.py's
`architecture_table`); `select_target_forward` takes the family's packed path from it.

A Family carries its README label and planned forward, its options for the shared config readers
(targets/config_readers.py), its packed path with the pieces that forward needs (targets/paths.py:
the window layer function, the MoE-window qkv and router, the MLA attention block, the sparse-
attention indexer's RoPE, the M-RoPE flag of the dense and hybrid paths; LFM2's short-convolution
path, Kimi-Linear's KDA path, Nemotron-H's Mamba-2 path, DeepSeek-V4's and Inkling 2's take none),
what exact decoding must do with its cache (`Decoding`), and the quantization formats only it is
read in. Multimodal wrappers (`*ForConditionalGeneration`) train on their language model alone on
text data (targets/loading.py): their entry names that model's model_type and repeats its forward,
since the forward is chosen by the text config's model_type (on image data the wrapper runs whole,
per document: targets/multimodal.py).

`LAYER_COUNTS` names the model_types whose listed decoder layers are not `num_hidden_layers` many
(how a tap collapses several residual streams per token is targets/stream_taps.py's table).

Adding a family: one entry in `FAMILIES` (and, if its layers are new, their reader options or the
pieces of its packed forward).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from dflash_async.targets.config_readers import (
    SUPPORTED_QUANT_METHODS,
    ConfigReader,
    compressed_tensors_problem,
    quant_dict,
    quant_method_of,
)
from dflash_async.targets.generic_config import generic_problem
from dflash_async.targets.packed.dense import rope_half
from dflash_async.targets.packed.gemma4 import gemma4_layer, gemma4_layout_problem
from dflash_async.targets.packed.mla import (
    llama4_query_scale,
    mla_attention_block,
    partial_rotary_attention_block,
    rope_interleaved,
    softmax_grouped_topk,
)
from dflash_async.targets.packed.moe_window import (
    MoeWindowLayers,
    gpt_oss_layer_problem,
    gpt_oss_qkv,
    gpt_oss_route,
    minimax_layer_problem,
    minimax_qkv,
    minimax_route,
)
from dflash_async.targets.packed.muse import (
    GLIMMER_PARTS,
    SPARK_PARTS,
    muse_glimmer_layer,
    muse_spark_layer,
)
from dflash_async.targets.packed.window import (
    PRE_NORM_PARTS,
    SANDWICH_PARTS,
    WindowLayers,
    pre_norm_layer,
    sandwich_layer,
)
from dflash_async.targets.paths import (
    DeepseekV4Path,
    DensePath,
    DSAPath,
    HybridPath,
    InklingPath,
    KDAPath,
    MambaPath,
    MLAPath,
    MoeWindowPath,
    NoPackedPath,
    PackedPath,
    ShortConvPath,
    ShortcutMoePath,
    WindowPath,
)


@dataclass(frozen=True)
class Decoding:
    """What exact speculative decoding (eval/) must do with the family's KV/state cache.

    linear_state: Gated DeltaNet layers, whose conv window and recurrent state every verified
      token overwrites: snapshot before each verify, restore and re-advance by the accepted
      tokens (eval/hybrid_state.py); the batched decoder cannot write that state per row.
      LFM2's short convolutions too: HF caches each as a linear-attention layer whose one
      state is its conv window, which the same snapshot and restore make exact; and
      Nemotron-H's Mamba-2 mixers, cached as linear-attention layers of a conv window and an
      SSM state; Kimi-Linear's KDA layers, of a conv window and a recurrent state.
    sliding_window: sliding-window layers, whose HF cache drops keys a rollback would uncover:
      `decoding_cache` gives them plain growing layers (the mask still applies the window).
    recompute: no cache at all: every target forward of the decoder runs the whole sequence
      (any architecture is exact that way; quadratic in the length: eval/recompute.py). The
      generic family's, whose caches may be anything (Mamba states, RWKV states, ...), and the
      sparse-attention families' (DeepSeek-V3.2, GLM-5), whose cache also holds the indexer's
      keys, which eval/'s rollback (hybrid_state.crop_attention) does not cut.
    eval/ reads linear_state and sliding_window from the cache's layers and `layer_types` (an exact per-config answer);
    tests/targets/test_families.py checks each family's entry against that.
    """

    linear_state: bool = False
    sliding_window: bool = False
    recompute: bool = False


@dataclass(frozen=True)
class Family:
    """All that is family-specific (see the module doc).

    label: the README's family column. planned: the README's target-forward column, in words.
    reader: the family's options for the config readers. forward: its packed path (paths.py),
    refusing (HF fallback) where its layers or the device do not fit. decoding: its cache rules.
    language_model: a wrapper's text model_type (None: the config is the text config).
    quant_methods: quant_methods read for this family only (gpt-oss's MXFP4 experts).
    documents_alone: the HF fallback runs each document alone, unpadded (targets/generic.py),
      not in right-padded batches (the generic family: padding is exact only where the
      attention mask is known to hide it; DeepSeek-V4: its taps are STREAM_TAPS collapses,
      which only the generic forward's hooks take).
    """

    label: str
    planned: str
    reader: ConfigReader
    forward: PackedPath
    decoding: Decoding
    language_model: str | None = None
    quant_methods: frozenset[str] = frozenset()
    documents_alone: bool = False

    def wrapped(self, *, label: str, language_model: str) -> Family:
        """This (text) family's multimodal wrapper: its forward is this family's."""
        return dataclasses.replace(self, label=label, language_model=language_model)


_DENSE_WORDS = "packed dense (document-causal attention)"
_MOE_WORDS = "packed MoE (document-causal attention)"
_WINDOW_WORDS = "packed window (document-causal sliding window)"
_DSA_WORDS = (
    "packed sparse MLA MoE (document-causal attention under the indexer's per-document top-k)"
)
_HYBRID_WORDS = "packed hybrid (flash-linear-attention varlen) on CUDA; HF padded batches elsewhere"
_SHORT_CONV_WORDS = "packed short convolutions per document (document-causal attention)"
_HYBRID_MOE_WORDS = (
    "packed hybrid MoE (flash-linear-attention varlen, grouped experts) on CUDA; "
    "HF padded batches elsewhere"
)


def _dense(label: str) -> Family:
    """A plain pre-norm dense decoder family (Llama, Qwen2, Qwen3)."""
    return Family(
        label=label,
        planned=_DENSE_WORDS,
        reader=ConfigReader(),
        forward=DensePath(),
        decoding=Decoding(),
    )


# gpt-oss and MiniMax-M2 have no dense MLP: `intermediate_size` is one routed expert's width
_EXPERT_WIDTH_IS_INTERMEDIATE = ConfigReader(expert_width="intermediate_size")
_QWEN35 = Family(
    label="Qwen3.5 (hybrid)",
    planned=_HYBRID_WORDS,
    reader=ConfigReader(),
    forward=HybridPath(mrope=True),
    decoding=Decoding(linear_state=True),
)
_QWEN35_MOE = dataclasses.replace(_QWEN35, label="Qwen3.5-MoE (hybrid)", planned=_HYBRID_MOE_WORDS)
_QWEN3_VL_TEXT = Family(
    label="Qwen3-VL language model",
    planned=_DENSE_WORDS,
    reader=ConfigReader(),
    forward=DensePath(mrope=True),  # Qwen3's layers; its interleaved M-RoPE takes [3, 1, T]
    decoding=Decoding(),
)
_QWEN3_VL_MOE_TEXT = Family(
    label="Qwen3-VL-MoE language model",
    planned=_MOE_WORDS,
    reader=ConfigReader(),
    # Qwen3-MoE's layers (its router always renormalises the top k) with Qwen3-VL's M-RoPE
    forward=DensePath(moe_eager=True, mrope=True),
    decoding=Decoding(),
)
_MLA_WORDS = "packed MLA MoE (document-causal attention)"
_DEEPSEEK_V3 = Family(
    label="DeepSeek-V3 (MLA)",
    planned=_MLA_WORDS,
    reader=ConfigReader(latent_attention=True),
    forward=MLAPath(mla_attention_block, name="packed_mla"),
    decoding=Decoding(),
)
_GEMMA3_TEXT = Family(
    label="Gemma 3",
    planned=_WINDOW_WORDS,
    reader=ConfigReader(),
    forward=WindowPath(WindowLayers(sandwich_layer, SANDWICH_PARTS, per_layer_kinds=True)),
    decoding=Decoding(sliding_window=True),
)
_MUSE_GLIMMER_TEXT = Family(
    label="Muse Glimmer language model",
    planned=_WINDOW_WORDS,
    reader=ConfigReader(),
    forward=WindowPath(WindowLayers(muse_glimmer_layer, GLIMMER_PARTS, per_layer_kinds=True)),
    decoding=Decoding(sliding_window=True),
)
_MUSE_SPARK_TEXT = Family(
    label="Muse Spark language model",
    planned="packed MoE window (document-causal sliding window, sigmoid router)",
    reader=ConfigReader(),
    forward=WindowPath(WindowLayers(muse_spark_layer, SPARK_PARTS, per_layer_kinds=True)),
    decoding=Decoding(sliding_window=True),
)
_INKLING2_TEXT = Family(
    label="Inkling 2 language model",
    planned="packed block-residual MoE (convolutions per document, document-causal attention "
    "with relative position bias and sinks)",
    # the generic family's reader, as before this entry: the drafter's shape unchanged
    reader=ConfigReader(),
    forward=InklingPath(),
    # HF's cache pairs each layer's keys with its convolution windows, and the relative position
    # bias reads the cache's offsets: decoded by recomputation, as on the generic path
    decoding=Decoding(recompute=True),
    # where the packed path refuses: each document alone, as on the generic path
    documents_alone=True,
)

# model_type (of config.json, wrappers included) -> its Family, in the README's order.
FAMILIES: Mapping[str, Family] = MappingProxyType(
    {
        "llama": _dense("Llama 2/3"),
        "qwen2": _dense("Qwen2/2.5"),
        "qwen3": _dense("Qwen3"),
        "mistral": Family(
            label="Mistral (sliding window)",
            planned=_WINDOW_WORDS,
            reader=ConfigReader(),
            forward=WindowPath(WindowLayers(pre_norm_layer, PRE_NORM_PARTS, per_layer_kinds=False)),
            decoding=Decoding(sliding_window=True),
        ),
        "qwen3_moe": Family(
            label="Qwen3-MoE",
            planned=_MOE_WORDS,
            reader=ConfigReader(),
            forward=DensePath(moe_eager=True),
            decoding=Decoding(),
        ),
        "qwen3_next": Family(
            label="Qwen3-Next (hybrid)",
            planned=_HYBRID_MOE_WORDS,
            reader=ConfigReader(),
            forward=HybridPath(mrope=False),  # its rotary is 1-D
            decoding=Decoding(linear_state=True),
        ),
        "qwen3_5_text": _QWEN35,
        "qwen3_5": _QWEN35.wrapped(
            label="Qwen3.5 multimodal wrapper", language_model="qwen3_5_text"
        ),
        "qwen3_5_moe_text": _QWEN35_MOE,
        "qwen3_5_moe": _QWEN35_MOE.wrapped(
            label="Qwen3.5-MoE multimodal wrapper", language_model="qwen3_5_moe_text"
        ),
        "qwen3_vl": _QWEN3_VL_TEXT.wrapped(
            label="Qwen3-VL multimodal wrapper", language_model="qwen3_vl_text"
        ),
        "qwen3_vl_text": _QWEN3_VL_TEXT,
        "qwen3_vl_moe": _QWEN3_VL_MOE_TEXT.wrapped(
            label="Qwen3-VL-MoE multimodal wrapper", language_model="qwen3_vl_moe_text"
        ),
        "qwen3_vl_moe_text": _QWEN3_VL_MOE_TEXT,
        "glm4_moe": Family(
            label="GLM-4.5",
            planned=_MOE_WORDS,
            reader=ConfigReader(),
            forward=MLAPath(partial_rotary_attention_block, name="packed_moe"),
            decoding=Decoding(),
        ),
        "gemma3_text": _GEMMA3_TEXT,
        "gemma3": _GEMMA3_TEXT.wrapped(
            label="Gemma 3 multimodal wrapper", language_model="gemma3_text"
        ),
        "gemma4_text": Family(
            label="Gemma 4",
            planned="packed window (document-causal sliding window; HF padded batches with "
            "per-layer inputs, KV sharing or MoE blocks)",
            reader=ConfigReader(),
            forward=WindowPath(
                WindowLayers(
                    gemma4_layer,
                    SANDWICH_PARTS,
                    per_layer_kinds=True,
                    problem=gemma4_layout_problem,
                )
            ),
            decoding=Decoding(sliding_window=True),
        ),
        "gpt_oss": Family(
            label="gpt-oss",
            planned="packed MoE with sliding windows and attention sinks (document-causal attention)",
            reader=_EXPERT_WIDTH_IS_INTERMEDIATE,
            forward=MoeWindowPath(
                MoeWindowLayers(gpt_oss_qkv, gpt_oss_route, gpt_oss_layer_problem)
            ),
            decoding=Decoding(sliding_window=True),
            quant_methods=frozenset({"mxfp4"}),
        ),
        "minimax_m2": Family(
            label="MiniMax-M2",
            planned="packed MoE, sigmoid router (document-causal attention)",
            reader=_EXPERT_WIDTH_IS_INTERMEDIATE,
            forward=MoeWindowPath(
                MoeWindowLayers(minimax_qkv, minimax_route, minimax_layer_problem)
            ),
            decoding=Decoding(),
        ),
        "deepseek_v3": _DEEPSEEK_V3,
        "kimi_k25": _DEEPSEEK_V3.wrapped(
            label="Kimi K2.5 multimodal wrapper", language_model="deepseek_v3"
        ),
        "mistral4": Family(
            label="Mistral 4 (MLA)",
            planned="packed MLA MoE, Llama 4 query scale (document-causal attention)",
            reader=ConfigReader(latent_attention=True),
            # DeepSeek-V3's layers with softmax routing and queries scaled by their position
            forward=MLAPath(
                mla_attention_block,
                name="packed_mla",
                router=softmax_grouped_topk,
                query_scale=llama4_query_scale,
            ),
            decoding=Decoding(),
        ),
        # decoding: HF caches each short convolution as a linear-attention layer holding its
        # conv window, which linear_state's snapshot and restore make exact (not recompute)
        "lfm2": Family(
            label="LFM2 (short convolutions)",
            planned=_SHORT_CONV_WORDS,
            reader=ConfigReader(),
            forward=ShortConvPath(),
            decoding=Decoding(linear_state=True),
        ),
        "lfm2_moe": Family(
            label="LFM2-MoE (short convolutions)",
            planned="packed short convolutions per document, sigmoid router "
            "(document-causal attention)",
            reader=ConfigReader(),
            forward=ShortConvPath(),
            decoding=Decoding(linear_state=True),
        ),
        "longcat_flash": Family(
            label="LongCat-Flash (MLA, shortcut MoE)",
            planned="packed MLA with shortcut MoE and zero experts (document-causal attention)",
            # the generic family's reader, as before this entry: the drafter's shape unchanged
            reader=ConfigReader(),
            forward=ShortcutMoePath(),
            # its cache holds the MLA latents in plain growing layers: cropped after a rejected
            # draft like any full-attention cache (both decoders equal HF's greedy decoding:
            # tests/targets/test_architectures.py)
            decoding=Decoding(),
        ),
        "deepseek_v32": Family(
            label="DeepSeek-V3.2 (MLA, sparse attention)",
            planned=_DSA_WORDS,
            reader=ConfigReader(latent_attention=True),
            forward=DSAPath(indexer_rope=rope_half),  # the indexer's RoPE: rotate_half
            decoding=Decoding(recompute=True),
        ),
        "glm_moe_dsa": Family(
            label="GLM-5 (MLA, sparse attention)",
            planned=_DSA_WORDS,
            reader=ConfigReader(latent_attention=True),
            forward=DSAPath(indexer_rope=rope_interleaved),  # interleaved pairs
            decoding=Decoding(recompute=True),
        ),
        # no text CausalLM class: the wrappers load whole, their towers dropped (loading.py)
        "muse_glimmer": _MUSE_GLIMMER_TEXT.wrapped(
            label="Muse Glimmer multimodal wrapper", language_model="muse_glimmer_text"
        ),
        "muse_glimmer_text": _MUSE_GLIMMER_TEXT,
        "muse_spark": _MUSE_SPARK_TEXT.wrapped(
            label="Muse Spark multimodal wrapper", language_model="muse_spark_text"
        ),
        "muse_spark_text": _MUSE_SPARK_TEXT,
        # decoding: HF caches each Mamba-2 mixer as a linear-attention layer (its conv window
        # and SSM state), which linear_state's snapshot and restore make exact (not recompute)
        "nemotron_h": Family(
            label="Nemotron-H (Mamba-2 hybrid)",
            planned="packed Mamba-2 hybrid (chunked SSD per document in plain torch, "
            "document-causal attention)",
            # the generic family's reader, as before this entry: the drafter's shape unchanged
            reader=ConfigReader(),
            forward=MambaPath(),
            decoding=Decoding(linear_state=True),
        ),
        # decoding: HF caches each KDA layer as a linear-attention layer (its conv window and
        # recurrent state) and each MLA layer's latents in a plain growing layer, which
        # linear_state's snapshot, restore and crop make exact (not recompute)
        "kimi_linear": Family(
            label="Kimi-Linear (KDA hybrid, MLA)",
            planned="packed KDA hybrid (flash-linear-attention varlen chunk_kda on CUDA, HF's torch "
            "chunks per document elsewhere; NoPE MLA document-causal, grouped-router MoE)",
            # the generic family's reader, as before this entry: the drafter's shape unchanged
            reader=ConfigReader(),
            forward=KDAPath(),
            decoding=Decoding(linear_state=True),
        ),
        "deepseek_v4": Family(
            label="DeepSeek-V4 (hyper-connections, compressed sparse attention)",
            planned="packed hyper-connection MoE (document-causal sliding windows, compressed "
            "blocks per document under the indexer's top-k)",
            # the generic family's reader, as before this entry: the drafter's shape unchanged
            reader=ConfigReader(),
            forward=DeepseekV4Path(),
            # its cache holds the compressors' buffers, which eval/'s rollback does not cut
            decoding=Decoding(recompute=True),
            # where the packed path refuses: the generic forward, whose taps collapse the
            # streams as STREAM_TAPS says (the padded fallback's hooks take raw layer outputs)
            documents_alone=True,
        ),
        "inkling2_text": _INKLING2_TEXT,
        "inkling2": _INKLING2_TEXT.wrapped(
            label="Inkling 2 multimodal wrapper", language_model="inkling2_text"
        ),
    }
)


# Every other model_type transformers builds as a decoder LM: its own HF forward, one document
# at a time (targets/generic.py), decoded by recomputation; refused only where that cannot work
# (targets/generic_config.py). The README's last row.
GENERIC = Family(
    label="any other decoder LM transformers loads",
    planned="HF forward per document (exact, generic; no packed forward)",
    reader=ConfigReader(),
    forward=NoPackedPath(),
    decoding=Decoding(recompute=True),
    documents_alone=True,
)
GENERIC_ROW = "*"  # the README's model_type cell of the GENERIC row


# model_type -> the config field that counts the decoder layers the model lists, for the types
# whose `num_hidden_layers` counts something else: LongCat-Flash's layers each hold two attention
# + MLP sublayers and its num_hidden_layers is 2 x num_layers (its model_type's own hidden-state
# recorder counts num_layers too). A tap index is an index into that list; the drafter's
# num_target_layers and default taps are read from it (`decoder_layer_count`).
LAYER_COUNTS: Mapping[str, str] = MappingProxyType({"longcat_flash": "num_layers"})


def decoder_layer_count(config: Any) -> int:
    """How many decoder layers the model of the text config `config` lists (the tap indices
    0..n-1): its LAYER_COUNTS field, else num_hidden_layers."""
    field = LAYER_COUNTS.get(getattr(config, "model_type", None), "num_hidden_layers")
    return int(getattr(config, field))


def family_of(config: Any) -> Family:
    """The Family of `config`'s model_type (a wrapper's own; pass the text config for its
    language model's): its entry in FAMILIES, else GENERIC."""
    return FAMILIES.get(getattr(config, "model_type", None), GENERIC)


def planned_path(model_type: str) -> str:
    """The forward `select_target_forward` takes for a model_type whose layers have the usual
    shape, in words (the README's table; the run logs the real choice as target_path_chosen)."""
    return FAMILIES.get(model_type, GENERIC).planned


def unsupported_reason(config: Any) -> str | None:
    """None for a supported target config, else one line naming its model_type (what cannot
    work on the generic path: targets/generic_config.py), or its quantization_config's
    quant_method, and what is supported."""
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        problem = generic_problem(config)
        if problem:
            return problem
    return quantization_problem(config)


def quantization_problem(config: Any) -> str | None:
    """None for an unquantized checkpoint or a supported `quant_method`, else one line naming it
    and the supported ones (a weight format we cannot read must never load as random bf16)."""
    method = quant_method_of(config)
    if method is None:
        return None
    if method == "compressed-tensors":
        return compressed_tensors_problem(quant_dict(config))
    only = [kind for kind, family in FAMILIES.items() if method in family.quant_methods]
    if only and getattr(config, "model_type", None) not in only:
        return (
            f"quant_method {method!r} is read for {' and '.join(only)} targets only, "
            f"not {config.model_type!r}"
        )
    if method in SUPPORTED_QUANT_METHODS:
        return None
    return (
        f"target quantization_config quant_method {method!r} is not supported "
        f"(supported: {', '.join(SUPPORTED_QUANT_METHODS)}, or an unquantized checkpoint)"
    )


def _reader(cfg: Any) -> ConfigReader:
    """The family's reader options (GENERIC's, the defaults, outside FAMILIES)."""
    return family_of(cfg).reader


def attention_heads(cfg: Any) -> int:
    """The drafter's attention heads for the text config `cfg` (ConfigReader.attention_heads)."""
    return _reader(cfg).attention_heads(cfg)


def key_value_heads(cfg: Any) -> int:
    """The drafter's KV heads for the text config `cfg` (ConfigReader.key_value_heads)."""
    return _reader(cfg).key_value_heads(cfg)


def norm_eps(cfg: Any) -> float:
    """The drafter's RMSNorm epsilon for the text config `cfg` (ConfigReader.norm_eps)."""
    return _reader(cfg).norm_eps(cfg)


def attention_head_dim(cfg: Any) -> int:
    """The head dimension the drafter copies from the text config `cfg` (ConfigReader.head_dim)."""
    return _reader(cfg).head_dim(cfg)


def routed_expert_width(cfg: Any) -> int:
    """The FFN width of one routed expert of the text config `cfg` (MoE configs)."""
    return _reader(cfg).routed_expert_width(cfg)


def dense_mlp_width(cfg: Any) -> int:
    """The drafter's dense MLP width for the text config `cfg` (ConfigReader.dense_mlp_width)."""
    return _reader(cfg).dense_mlp_width(cfg)
