"""targets/paths.py owns the packed target forwards as choices: one kind of path per packed forward
(dense, MoE, MLA, sparse MLA, shortcut MoE, sliding window, MoE with windows and sinks, hybrid,
Kimi Delta Attention, short convolutions, Mamba-2, DeepSeek-V4's hyper-connections and compressed
attention, Inkling 2's block residuals and biased attention, none), each with the condition it
runs under (`refusal`: None, or the HF fallback's reason) and its factory (`build`), given the
pieces of one family. targets/families.py gives every family one of these; targets/forward.py
(`select_target_forward`) asks it, so no path names a model_type.

A path works on the decoder stack (`inner`, the module owning `layers`; its `config` is the text
config), never on a multimodal wrapper around it. The reasons and the `how` strings are the ones
the run logs as target_path_chosen.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from dflash_async.targets.packed.deepseek_v4 import (
    PackedDeepseekV4Forward,
    deepseek_v4_layout_problem,
)
from dflash_async.targets.packed.dense import PackedDenseForward
from dflash_async.targets.packed.dsa import PackedDSAForward, dsa_layout_problem
from dflash_async.targets.packed.inkling import (
    PackedInklingForward,
    inkling_layout_problem,
)
from dflash_async.targets.packed.mamba import PackedMambaForward, mamba_layout_problem
from dflash_async.targets.packed.mla import PackedMLAForward, grouped_topk
from dflash_async.targets.packed.moe_window import (
    MoeWindowLayers,
    PackedWindowMoeForward,
    layout_problem,
)
from dflash_async.targets.packed.short_conv import (
    PackedShortConvForward,
    short_conv_layout_problem,
)
from dflash_async.targets.packed.shortcut_moe import (
    PackedShortcutMoeForward,
    shortcut_parts_problem,
)
from dflash_async.targets.packed.window import (
    PackedWindowForward,
    WindowLayers,
    window_layout_problem,
)
from dflash_async.targets.stream_taps import stream_tap

_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})  # no length-dependent update
_LAYER_PARTS = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}


class FeatureForward(Protocol):
    def __call__(self, input_ids, position_ids, doc_ids, features, lengths) -> torch.Tensor: ...


@dataclass
class TargetPath:
    """The chosen forward, its name (`packed_dense`, `packed_moe`, `packed_mla`, `packed_dsa`,
    `packed_shortcut_moe`, `packed_window`, `packed_moe_window`, `packed_hybrid`, `packed_kda`,
    `packed_short_conv`, `packed_mamba`, `packed_deepseek_v4`, `packed_inkling`, `hf`) and why."""

    forward: FeatureForward
    name: str
    reason: str
    # A stage's call: (hidden [1,T,d] or None, input_ids, position_ids, doc_ids, features,
    # lengths) -> its range's output hidden (targets/split.py); None: cannot be split (HF)
    stage: Callable | None = None


class PackedCall:
    """Adapts a packed forward (no host lengths) to the FeatureForward call shape."""

    def __init__(self, packed) -> None:
        self.packed = packed

    def __call__(self, input_ids, position_ids, doc_ids, features, lengths) -> torch.Tensor:
        return self.packed(input_ids, position_ids, doc_ids, features)

    def stage(self, hidden, input_ids, position_ids, doc_ids, features, lengths) -> torch.Tensor:
        return self.packed.stage(hidden, input_ids, position_ids, doc_ids, features)


class PackedPath(Protocol):
    """One kind of packed forward with a family's pieces (see the module doc).

    name: the TargetPath name `build` gives; needs_cuda: it never runs on another device.
    """

    name: str
    needs_cuda: bool

    def refusal(
        self, inner: nn.Module, device: torch.device, *, model_type: str, packed_hybrid: bool
    ) -> str | None: ...

    def build(
        self,
        inner: nn.Module,
        layer_ids: Sequence[int],
        *,
        model_type: str,
        attention: str,
        compile: bool,
        layers: range | None,
    ) -> TargetPath: ...


def rope_and_act_problem(inner: nn.Module) -> str | None:
    """None when the rotary has no length-dependent update and the MLPs are SiLU ones."""
    rope = getattr(getattr(inner, "rotary_emb", None), "rope_type", None)
    if rope not in _ROPE_TYPES:
        return f"rope_type {rope!r} (only {sorted(_ROPE_TYPES)})"
    if getattr(inner.config, "hidden_act", "silu") != "silu":
        return f"hidden_act {inner.config.hidden_act!r}"
    return None


def dense_layout_problem(inner: nn.Module) -> str | None:
    """None when every decoder layer has the plain pre-norm attention + MLP structure we run."""
    config = inner.config
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
        return "layer_types other than full_attention (sliding windows)"
    problem = rope_and_act_problem(inner)
    if problem:
        return problem
    for layer in inner.layers:
        parts = {name for name, _ in layer.named_children()}
        if parts != _LAYER_PARTS or getattr(layer.self_attn, "sliding_window", None):
            return f"decoder layer {type(layer).__name__} with parts {sorted(parts)}"
    return None


def _packed(forward, name: str, how: str) -> TargetPath:
    call = PackedCall(forward)
    return TargetPath(call, name, how, call.stage)


@dataclass(frozen=True)
class DensePath:
    """packed_dense (Qwen3, Qwen2/2.5, Llama) or, with `moe_eager`, packed_moe (Qwen3-MoE: the HF
    MoE block run eagerly between compiled attention blocks): targets/packed/dense.py. `mrope`:
    the family's rotary takes one position row per grid axis (Qwen3-VL's language model)."""

    moe_eager: bool = False
    mrope: bool = False
    needs_cuda = False

    @property
    def name(self) -> str:
        return "packed_moe" if self.moe_eager else "packed_dense"

    def refusal(self, inner, device, *, model_type, packed_hybrid) -> str | None:
        problem = dense_layout_problem(inner)
        return f"{model_type}: {problem}" if problem else None

    def build(self, inner, layer_ids, *, model_type, attention, compile, layers) -> TargetPath:
        forward = PackedDenseForward(
            inner,
            layer_ids,
            attention=attention,
            compile=compile,
            moe_eager=self.moe_eager,
            mrope=self.mrope,
            layers=layers,
        )
        how = f"{model_type}: {attention} document-causal attention, compile={compile}"
        return _packed(forward, self.name, how)


@dataclass(frozen=True)
class MLAPath:
    """targets/packed/mla.py with the family's attention block (DeepSeek-V3's MLA, named
    packed_mla; GLM-4.5's partial-rotary GQA, named packed_moe), its grouped router (sigmoid
    `grouped_topk` by default) and its per-position query scale (Mistral 4's; None: none)."""

    attention_block: Callable
    name: str
    router: Callable = grouped_topk
    query_scale: Callable | None = None
    needs_cuda = False

    def refusal(self, inner, device, *, model_type, packed_hybrid) -> str | None:
        problem = dense_layout_problem(inner)
        return f"{model_type}: {problem}" if problem else None

    def build(self, inner, layer_ids, *, model_type, attention, compile, layers) -> TargetPath:
        forward = PackedMLAForward(
            inner,
            layer_ids,
            attention_block=self.attention_block,
            attention=attention,
            compile=compile,
            router=self.router,
            query_scale=self.query_scale,
            layers=layers,
        )
        how = f"{model_type}: {attention} document-causal attention, compile={compile}"
        return _packed(forward, self.name, how)


@dataclass(frozen=True)
class ShortcutMoePath:
    """targets/packed/shortcut_moe.py: two MLA attention + MLP sublayers and a shortcut MoE with
    zero experts per decoder layer (LongCat-Flash)."""

    name = "packed_shortcut_moe"
    needs_cuda = False

    def refusal(self, inner, device, *, model_type, packed_hybrid) -> str | None:
        problem = rope_and_act_problem(inner) or shortcut_parts_problem(inner)
        return f"{model_type}: {problem}" if problem else None

    def build(self, inner, layer_ids, *, model_type, attention, compile, layers) -> TargetPath:
        forward = PackedShortcutMoeForward(
            inner, layer_ids, attention=attention, compile=compile, layers=layers
        )
        how = f"{model_type}: {attention} document-causal attention, compile={compile}"
        return _packed(forward, self.name, how)


@dataclass(frozen=True)
class DSAPath:
    """targets/packed/dsa.py (DeepSeek-V3.2, GLM-5): MLA under the lightning indexer's top-k
    selection, with the family's indexer RoPE (rotate_half or interleaved pairs)."""

    indexer_rope: Callable
    name = "packed_dsa"
    needs_cuda = False

    def refusal(self, inner, device, *, model_type, packed_hybrid) -> str | None:
        problem = dsa_layout_problem(inner)
        return f"{model_type}: {problem}" if problem else None

    def build(self, inner, layer_ids, *, model_type, attention, compile, layers) -> TargetPath:
        forward = PackedDSAForward(
            inner,
            layer_ids,
            indexer_rope=self.indexer_rope,
            attention=attention,
            compile=compile,
            layers=layers,
        )
        how = (
            f"{model_type}: {attention} document-causal attention under the indexer's top-k, "
            f"compile={compile}"
        )
        return _packed(forward, self.name, how)


@dataclass(frozen=True)
class WindowPath:
    """targets/packed/window.py with the family's `WindowLayers` (Mistral, Gemma 3/4 text, Muse
    Glimmer and Spark text)."""

    layers: WindowLayers
    name = "packed_window"
    needs_cuda = False

    def refusal(self, inner, device, *, model_type, packed_hybrid) -> str | None:
        problem = window_layout_problem(inner, family=self.layers)
        return f"{model_type}: {problem}" if problem else None

    def build(self, inner, layer_ids, *, model_type, attention, compile, layers) -> TargetPath:
        forward = PackedWindowForward(
            inner,
            layer_ids,
            family=self.layers,
            attention=attention,
            compile=compile,
            layers=layers,
        )
        how = (
            f"{model_type}: {attention} document-causal sliding-window attention, compile={compile}"
        )
        return _packed(forward, self.name, how)


@dataclass(frozen=True)
class MoeWindowPath:
    """targets/packed/moe_window.py with the family's qkv and router (gpt-oss, MiniMax-M2)."""

    layers: MoeWindowLayers
    name = "packed_moe_window"
    needs_cuda = False

    def refusal(self, inner, device, *, model_type, packed_hybrid) -> str | None:
        problem = layout_problem(inner, family=self.layers)
        return f"{model_type}: {problem}" if problem else None

    def build(self, inner, layer_ids, *, model_type, attention, compile, layers) -> TargetPath:
        forward = PackedWindowMoeForward(
            inner,
            layer_ids,
            family=self.layers,
            attention=attention,
            compile=compile,
            layers=layers,
        )
        how = f"{model_type}: {attention} document-causal attention (windows, sinks as the layers have)"
        return _packed(forward, self.name, how)


@dataclass(frozen=True)
class ShortConvPath:
    """targets/packed/short_conv.py (LFM2, LFM2-MoE): short convolutions per document in plain
    torch and document-causal attention, on any device."""

    name = "packed_short_conv"
    needs_cuda = False

    def refusal(self, inner, device, *, model_type, packed_hybrid) -> str | None:
        rotary = getattr(inner, "rotary_emb", None) or getattr(inner, "pos_emb", None)
        rope = getattr(rotary, "rope_type", None)
        problem = short_conv_layout_problem(inner)
        if problem is None and rope not in _ROPE_TYPES:
            problem = f"rope_type {rope!r} (only {sorted(_ROPE_TYPES)})"
        return f"{model_type}: {problem}" if problem else None

    def build(self, inner, layer_ids, *, model_type, attention, compile, layers) -> TargetPath:
        forward = PackedShortConvForward(
            inner, layer_ids, attention=attention, compile=compile, layers=layers
        )
        how = (
            f"{model_type}: short convolutions per document, {attention} document-causal "
            f"attention, compile={compile}"
        )
        return _packed(forward, self.name, how)


@dataclass(frozen=True)
class MambaPath:
    """targets/packed/mamba.py (Nemotron-H): Mamba-2 mixers by a chunked SSD per document in plain
    torch and document-causal attention, on any device."""

    name = "packed_mamba"
    needs_cuda = False

    def refusal(self, inner, device, *, model_type, packed_hybrid) -> str | None:
        problem = mamba_layout_problem(inner)
        return f"{model_type}: {problem}" if problem else None

    def build(self, inner, layer_ids, *, model_type, attention, compile, layers) -> TargetPath:
        forward = PackedMambaForward(
            inner, layer_ids, attention=attention, compile=compile, layers=layers
        )
        how = (
            f"{model_type}: Mamba-2 chunked SSD per document, {attention} document-causal "
            f"attention, compile={compile}"
        )
        return _packed(forward, self.name, how)


@dataclass(frozen=True)
class DeepseekV4Path:
    """targets/packed/deepseek_v4.py (DeepSeek-V4): hyper-connection streams, sliding windows,
    compressed blocks per document with the indexer's selection, sinks, hash and top-k routers;
    the same torch code on any device. A split target's stages are not run (`stage` None: the
    streams are not the [1, T, d] hidden a stage hands on)."""

    name = "packed_deepseek_v4"
    needs_cuda = False

    def refusal(self, inner, device, *, model_type, packed_hybrid) -> str | None:
        problem = deepseek_v4_layout_problem(inner)
        if problem is None and stream_tap(inner.config) is None:
            problem = "no STREAM_TAPS entry to collapse its streams by"
        return f"{model_type}: {problem}" if problem else None

    def build(self, inner, layer_ids, *, model_type, attention, compile, layers) -> TargetPath:
        forward = PackedDeepseekV4Forward(inner, layer_ids, tap=stream_tap(inner.config))
        how = (
            f"{model_type}: document-causal sliding windows and compressed blocks per document "
            "(torch, chunks of query rows)"
        )
        return TargetPath(PackedCall(forward), self.name, how, None)


@dataclass(frozen=True)
class InklingPath:
    """targets/packed/inkling.py (Inkling 2's language model): short and dynamic convolutions per
    document, document-causal attention with the relative position bias and per-token sinks, the
    block residuals; the same torch code on any device. Not split into stages (`stage` None: the
    block states are more than the [1, T, d] hidden a stage hands on)."""

    name = "packed_inkling"
    needs_cuda = False

    def refusal(self, inner, device, *, model_type, packed_hybrid) -> str | None:
        problem = inkling_layout_problem(inner)
        return f"{model_type}: {problem}" if problem else None

    def build(self, inner, layer_ids, *, model_type, attention, compile, layers) -> TargetPath:
        forward = PackedInklingForward(inner, layer_ids)
        how = (
            f"{model_type}: convolutions per document, document-causal attention with the "
            "relative position bias and sinks (torch, chunks of query rows)"
        )
        return TargetPath(PackedCall(forward), self.name, how, None)


_HYBRID_OFF = "the packed varlen forward is turned off (DFLASH_TARGET__PACKED_HYBRID=false)"


@dataclass(frozen=True)
class HybridPath:
    """targets/packed/hybrid.py (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) on CUDA with
    flash-linear-attention; `mrope`: the family's rotary takes one position row per grid axis."""

    mrope: bool
    name = "packed_hybrid"
    needs_cuda = True

    def refusal(self, inner, device, *, model_type, packed_hybrid) -> str | None:
        problem = _HYBRID_OFF if not packed_hybrid else self._problem(inner, device)
        return f"hybrid {model_type}: {problem}" if problem else None

    @staticmethod
    def _problem(inner: nn.Module, device: torch.device) -> str | None:
        if device.type != "cuda":
            return f"flash-linear-attention kernels need CUDA (device is {device.type})"
        if importlib.util.find_spec("fla") is None:
            return "flash-linear-attention is not installed (pip install '.[hybrid]')"
        from dflash_async.targets.packed.hybrid import hybrid_layout_problem

        return hybrid_layout_problem(inner)

    def build(self, inner, layer_ids, *, model_type, attention, compile, layers) -> TargetPath:
        from dflash_async.targets.packed.hybrid import PackedHybridForward, fla_kernels

        kernels = fla_kernels()
        forward = PackedHybridForward(
            inner,
            layer_ids,
            kernels=kernels,
            mrope=self.mrope,
            attention=attention,
            compile=compile,
            layers=layers,
        )
        how = f"{model_type}: {kernels.name} varlen, {attention} document-causal attention"
        return TargetPath(forward, self.name, how, forward.stage)


@dataclass(frozen=True)
class KDAPath:
    """targets/packed/kda.py (Kimi-Linear): KDA layers per document (flash-linear-attention's
    varlen chunk_kda on CUDA, HF's torch chunks per document elsewhere or without fla), NoPE
    MLA document-causal, grouped-router MoE; turned off with the packed hybrid forward."""

    name = "packed_kda"
    needs_cuda = False

    def refusal(self, inner, device, *, model_type, packed_hybrid) -> str | None:
        from dflash_async.targets.packed.kda import kda_layout_problem

        problem = _HYBRID_OFF if not packed_hybrid else kda_layout_problem(inner)
        return f"hybrid {model_type}: {problem}" if problem else None

    def build(self, inner, layer_ids, *, model_type, attention, compile, layers) -> TargetPath:
        from dflash_async.targets.packed.kda import PackedKDAForward, fla_kda, torch_kda

        device = next(inner.parameters()).device
        fla = device.type == "cuda" and importlib.util.find_spec("fla") is not None
        kernel = fla_kda() if fla else torch_kda()
        forward = PackedKDAForward(
            inner, layer_ids, kernel=kernel, attention=attention, compile=compile, layers=layers
        )
        how = (
            f"{model_type}: KDA by {kernel.name}, convolutions per document, {attention} "
            f"document-causal attention, compile={compile}"
        )
        return TargetPath(forward, self.name, how, forward.stage)


@dataclass(frozen=True)
class NoPackedPath:
    """No packed forward: the HF fallback runs the family (`hybrid`: its layers are linear-
    attention ones no family here has a packed forward for)."""

    hybrid: bool = False
    name = "hf"
    needs_cuda = False

    def refusal(self, inner, device, *, model_type, packed_hybrid) -> str | None:
        if not self.hybrid:
            return f"model_type {model_type!r} has no packed forward here"
        problem = (
            "only Qwen3.5, Qwen3.5-MoE, Qwen3-Next and Kimi-Linear layers have a packed varlen "
            "forward here"
            if packed_hybrid
            else _HYBRID_OFF
        )
        return f"hybrid {model_type}: {problem}"

    def build(self, inner, layer_ids, *, model_type, attention, compile, layers) -> TargetPath:
        raise AssertionError(f"{model_type}: no packed forward to build (refusal says why)")
