"""Which target forward runs on a packed layout, and why: `select_target_forward`.

Every path has one call shape, `forward(input_ids, position_ids, doc_ids, features, lengths)`:
the pack's fixed layout on the target device in, its features [T, k*d] written in place (padding
rows zero). `lengths` (host numpy) is read only by the HF fallback, which needs the documents'
extents on the host; the packed paths never look at it.

- `packed_dense`: Qwen3, Qwen2/2.5, Llama 3.x (`targets/packed_dense.py`); flex + compile on CUDA,
  the SDPA dense-mask reference on the CPU.
- `packed_moe`: Qwen3-MoE, the same packed forward with the HF MoE block (its grouped experts) run
  eagerly between compiled attention blocks; GLM-4.5 (`glm4_moe`) through `targets/packed_mla.py`
  (partial-rotary attention, grouped top-k router with shared experts).
- `packed_mla`: DeepSeek-V3 / Kimi-K2.x / Moonlight (`deepseek_v3`), multi-head latent attention
  and the grouped-router MoE (`targets/packed_mla.py`).
- `packed_window`: Mistral, Gemma 3 and Gemma 4 text, sliding windows in the document-causal mask
  (`targets/packed_window.py`).
- `packed_hybrid`: Qwen3.5, Qwen3.5-MoE and Qwen3-Next on CUDA with flash-linear-attention
  (`targets/packed_hybrid.py`, its MoE block `targets/packed_hybrid_moe.py`), unless turned off
  (`packed_hybrid=False`).
- `packed_moe_window`: gpt-oss (sliding windows, sinks), MiniMax-M2 (`targets/packed_moe_window.py`).
- MoE experts: on CUDA the packed paths run every fused HF experts module as
  `targets/grouped_experts.py`'s CompiledExperts (HF's math, its sort/gate/combine compiled):
  1.36-1.55x the MoE shapes' packed tokens/s with HF's experts (BENCHMARKS.md, 2026-12-03);
  `experts="hf"` keeps HF's call (bench target's reference row).
- `hf`: anything else (hybrids on the CPU or without fla too): the HF forward on
  right-padded 2-D batches of whole documents, each document alone in its row, so it is exact for
  every architecture (no recurrent or convolution state crosses a document).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import nn

from dflash_async.data.packing import pack_row_offsets, target_batches
from dflash_async.errors import SettingsError
from dflash_async.targets import packed_moe_window as pmw
from dflash_async.targets.grouped_experts import swap_compiled_experts
from dflash_async.targets.loading import TargetFeatures, is_hybrid, text_config, text_model
from dflash_async.targets.packed_dense import FLEX_TILE, PackedDenseForward
from dflash_async.targets.packed_mla import GLM_MOE_TYPES, MLA_TYPES, PackedMLAForward
from dflash_async.targets.packed_window import (
    WINDOW_TYPES,
    PackedWindowForward,
    window_layout_problem,
)

DENSE_TYPES = frozenset({"llama", "qwen2", "qwen3"})
MOE_TYPES = frozenset({"qwen3_moe"}) | GLM_MOE_TYPES
QWEN35_TYPES = frozenset({"qwen3_5_text", "qwen3_5"})
QWEN35_MOE_TYPES = frozenset({"qwen3_5_moe_text", "qwen3_5_moe"})
HYBRID_MOE_TYPES = QWEN35_MOE_TYPES | {"qwen3_next"}
PACKED_HYBRID_TYPES = QWEN35_TYPES | HYBRID_MOE_TYPES  # targets/packed_hybrid.py runs their layers
HYBRID_TYPES = PACKED_HYBRID_TYPES
_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})  # no length-dependent update
_LAYER_PARTS = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}


class FeatureForward(Protocol):
    def __call__(self, input_ids, position_ids, doc_ids, features, lengths) -> torch.Tensor: ...


@dataclass
class TargetPath:
    """The chosen forward, its name (`packed_dense`, `packed_moe`, `packed_mla`, `packed_window`,
    `packed_moe_window`, `packed_hybrid`, `hf`) and why."""

    forward: FeatureForward
    name: str
    reason: str
    # A stage's call: (hidden [1,T,d] or None, input_ids, position_ids, doc_ids, features,
    # lengths) -> its range's output hidden (targets/split.py); None: cannot be split (HF)
    stage: Callable | None = None


class HFPaddedForward:
    """The HF reference on the packed layout: documents as right-padded rows of 2-D batches.

    Sync point (fallback only): each document's extent comes from the host (`lengths`); the
    device work is many small copies, one HF forward per batch of at most max_batch_tokens.
    """

    def __init__(self, model: nn.Module, layer_ids: Sequence[int], max_batch_tokens: int) -> None:
        self.features = TargetFeatures(model, layer_ids)
        self.max_batch_tokens = max_batch_tokens

    @torch.no_grad()
    def __call__(self, input_ids, position_ids, doc_ids, features, lengths) -> torch.Tensor:
        offsets = pack_row_offsets(np.asarray(lengths, dtype=np.int64))
        for rows in target_batches(np.diff(offsets), self.max_batch_tokens):
            width = int(max(lengths[r] for r in rows))
            ids = input_ids.new_zeros(len(rows), width)  # [b, S]
            mask = torch.zeros_like(ids)
            for i, r in enumerate(rows):
                lo, n = int(offsets[r]), int(lengths[r])
                ids[i, :n] = input_ids[lo : lo + n]
                mask[i, :n] = 1
            out = self.features(ids, mask)  # [b, S, k*d]
            for i, r in enumerate(rows):
                lo, n = int(offsets[r]), int(lengths[r])
                features[lo : lo + n] = out[i, :n]
        features[int(offsets[-1]) :] = 0  # padding rows (finite: masked keys still multiply V)
        return features


class _Packed:
    """Adapts a packed forward (no host lengths) to the FeatureForward call shape."""

    def __init__(self, packed) -> None:
        self.packed = packed

    def __call__(self, input_ids, position_ids, doc_ids, features, lengths) -> torch.Tensor:
        return self.packed(input_ids, position_ids, doc_ids, features)

    def stage(self, hidden, input_ids, position_ids, doc_ids, features, lengths) -> torch.Tensor:
        return self.packed.stage(hidden, input_ids, position_ids, doc_ids, features)


def _dense_layout_problem(model: nn.Module) -> str | None:
    """None when every decoder layer has the plain pre-norm attention + MLP structure we run."""
    inner, config = text_model(model), text_config(model)
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
        return "layer_types other than full_attention (sliding windows)"
    rope = getattr(getattr(inner, "rotary_emb", None), "rope_type", None)
    if rope not in _ROPE_TYPES:
        return f"rope_type {rope!r} (only {sorted(_ROPE_TYPES)})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r}"
    for layer in inner.layers:
        parts = {name for name, _ in layer.named_children()}
        if parts != _LAYER_PARTS or getattr(layer.self_attn, "sliding_window", None):
            return f"decoder layer {type(layer).__name__} with parts {sorted(parts)}"
    return None


def _hybrid_problem(model: nn.Module, device: torch.device) -> str | None:
    """None when the packed hybrid forward can run: its layers, CUDA, fla installed."""
    if text_config(model).model_type not in PACKED_HYBRID_TYPES:
        return "only Qwen3.5, Qwen3.5-MoE and Qwen3-Next layers have a packed varlen forward here"
    if device.type != "cuda":
        return f"flash-linear-attention kernels need CUDA (device is {device.type})"
    if importlib.util.find_spec("fla") is None:
        return "flash-linear-attention is not installed (pip install '.[hybrid]')"
    from dflash_async.targets.packed_hybrid import hybrid_layout_problem

    return hybrid_layout_problem(text_model(model))


def planned_path(model_type: str) -> str:
    """The forward `select_target_forward` takes for a model_type whose layers have the usual
    shape, in words (the README's table; the run logs the real choice as target_path_chosen)."""
    if model_type in HYBRID_MOE_TYPES:
        return (
            "packed hybrid MoE (flash-linear-attention varlen, grouped experts) on CUDA; "
            "HF padded batches elsewhere"
        )
    if model_type in QWEN35_TYPES:
        return "packed hybrid (flash-linear-attention varlen) on CUDA; HF padded batches elsewhere"
    if model_type in MLA_TYPES:
        return "packed MLA MoE (document-causal attention)"
    if model_type in MOE_TYPES:
        return "packed MoE (document-causal attention)"
    if model_type in pmw.PACKED_TYPES:
        return pmw.planned(model_type)
    if model_type in DENSE_TYPES:
        return "packed dense (document-causal attention)"
    if model_type == "gemma4_text":
        return "packed window (document-causal sliding window; HF padded batches with per-layer inputs, KV sharing or MoE blocks)"
    if model_type in WINDOW_TYPES | {"gemma3"}:  # the wrapper runs its gemma3_text layers
        return "packed window (document-causal sliding window)"
    return "HF padded batches of whole documents (exact; no packed forward yet)"


def architecture_table() -> str:
    """The README's table of supported targets (SUPPORTED), one row per model_type."""
    from dflash_async.model.architectures import SUPPORTED

    rows = [f"| `{kind}` | {family} | {planned_path(kind)} |" for kind, family in SUPPORTED.items()]
    return "\n".join(["| model_type | family | target forward |", "|---|---|---|", *rows])


def select_target_forward(
    model: nn.Module,
    layer_ids: Sequence[int],
    *,
    token_budget: int,
    max_batch_tokens: int,
    compile: bool | None = None,
    packed_hybrid: bool = True,
    layers: range | None = None,
    experts: str = "compiled",
    cuda_graph: bool = False,
) -> TargetPath:
    """The fastest exact forward this model, device and token budget allow (see module doc).

    compile None means: compile on CUDA, not on the CPU. packed_hybrid: allow the packed fla
    forward for Qwen3.5 (DFLASH_TARGET__PACKED_HYBRID, on by default). `layers`: one stage of a
    split target (targets/split.py) runs only this range; SettingsError (exit 2) when the chosen
    forward is the HF fallback, which runs the model's own forward from the embedding on and so
    cannot start at a middle layer. experts: "compiled" (on CUDA, a packed path's fused experts
    swapped in place into CompiledExperts, said in the reason) or "hf". cuda_graph: replay the
    forward from one CUDA graph after its first call (targets/graphed.py;
    DFLASH_TARGET__CUDA_GRAPH) where it is a whole packed dense or MoE forward
    (`PackedDenseForward`) on CUDA; the reason says whether it is.
    """
    path = _select(
        model,
        layer_ids,
        token_budget=token_budget,
        max_batch_tokens=max_batch_tokens,
        compile=compile,
        packed_hybrid=packed_hybrid,
        layers=layers,
    )
    if experts == "compiled" and path.name != "hf" and _device(model, layers).type == "cuda":
        # before the first call, which is when torch.compile traces the layers
        swapped = swap_compiled_experts(_layer_range(model, layers), compile=compile)["swapped"]
        if swapped:
            path = dataclasses.replace(
                path, reason=f"{path.reason}; {swapped} experts modules as CompiledExperts"
            )
    if cuda_graph:
        path = _graphed(path, _device(model, layers), split=layers is not None)
    if layers is not None and path.stage is None:
        raise SettingsError(
            f"DFLASH_TARGET__STAGES > 1: the target's forward is the HF fallback ({path.reason}), "
            "which runs the whole model's own forward and cannot be split by layers; use "
            "DFLASH_TARGET__STAGES=1"
        )
    return path


def _graphed(path: TargetPath, device: torch.device, *, split: bool) -> TargetPath:
    """`path` replayed from one CUDA graph (targets/graphed.py) where that was measured to hold
    (a whole PackedDenseForward on CUDA: the packed dense and Qwen3-MoE paths), else as it is;
    either way the reason says so."""
    packed = getattr(path.forward, "packed", None)
    if device.type == "cuda" and not split and isinstance(packed, PackedDenseForward):
        from dflash_async.targets.graphed import GraphedForward

        graphed = GraphedForward(path.forward, device=device)
        return dataclasses.replace(path, forward=graphed, reason=f"{path.reason}; one CUDA graph")
    why = "a split stage" if split else f"{device.type}, {path.name}"
    return dataclasses.replace(path, reason=f"{path.reason}; not graphed ({why})")


def _device(model: nn.Module, layers: range | None) -> torch.device:
    """The device the forward runs on: a stage's is that of its first layer."""
    first = text_model(model).layers[layers.start] if layers is not None else model
    return next(first.parameters()).device


def _layer_range(model: nn.Module, layers: range | None) -> nn.ModuleList:
    """The decoder layers this forward runs (a stage's range, or all)."""
    every = text_model(model).layers
    return every if layers is None else nn.ModuleList(every[i] for i in layers)


def _select(model, layer_ids, *, token_budget, max_batch_tokens, compile, packed_hybrid, layers):
    """select_target_forward's choice (see there)."""
    device = _device(model, layers)
    cuda = device.type == "cuda"
    compile = cuda if compile is None else compile
    attention = "flex" if cuda and token_budget % FLEX_TILE == 0 else "sdpa"
    model_type = text_config(model).model_type
    hf = lambda why: TargetPath(HFPaddedForward(model, layer_ids, max_batch_tokens), "hf", why)  # noqa: E731
    if is_hybrid(model) or model_type in HYBRID_TYPES:
        off = "the packed varlen forward is turned off (DFLASH_TARGET__PACKED_HYBRID=false)"
        problem = _hybrid_problem(model, device) if packed_hybrid else off
        if problem:
            return hf(f"hybrid {model_type}: {problem}")
        from dflash_async.targets.packed_hybrid import PackedHybridForward, fla_kernels

        kernels = fla_kernels()
        forward = PackedHybridForward(
            text_model(model),
            layer_ids,
            kernels=kernels,
            attention=attention,
            compile=compile,
            layers=layers,
        )
        how = f"{model_type}: {kernels.name} varlen, {attention} document-causal attention"
        return TargetPath(forward, "packed_hybrid", how, forward.stage)
    if model_type in pmw.PACKED_TYPES:  # gpt-oss, MiniMax-M2 (targets/packed_moe_window.py)
        if problem := pmw.layout_problem(text_model(model)):
            return hf(f"{model_type}: {problem}")
        packed = _Packed(
            pmw.PackedWindowMoeForward(
                text_model(model), layer_ids, attention=attention, compile=compile, layers=layers
            )
        )
        how = f"{model_type}: {attention} document-causal attention (windows, sinks as the layers have)"
        return TargetPath(packed, "packed_moe_window", how, packed.stage)
    if model_type in WINDOW_TYPES:
        return _select_window(
            model, layer_ids, hf, attention=attention, compile=compile, layers=layers
        )
    if model_type not in DENSE_TYPES | MOE_TYPES | MLA_TYPES:
        return hf(f"model_type {model_type!r} has no packed forward here")
    problem = _dense_layout_problem(model)
    if problem:
        return hf(f"{model_type}: {problem}")
    moe = model_type in MOE_TYPES
    how = f"{model_type}: {attention} document-causal attention, compile={compile}"
    if model_type in MLA_TYPES | GLM_MOE_TYPES:
        packed = _Packed(
            PackedMLAForward(
                text_model(model), layer_ids, attention=attention, compile=compile, layers=layers
            )
        )
        name = "packed_mla" if model_type in MLA_TYPES else "packed_moe"
        return TargetPath(packed, name, how, packed.stage)
    forward = PackedDenseForward(
        text_model(model),
        layer_ids,
        attention=attention,
        compile=compile,
        moe_eager=moe,
        layers=layers,
    )
    packed = _Packed(forward)
    return TargetPath(packed, "packed_moe" if moe else "packed_dense", how, packed.stage)


def _select_window(model, layer_ids, hf, *, attention, compile, layers) -> TargetPath:
    """Mistral, Gemma 3/4 text: the packed sliding-window forward, or HF saying why not."""
    inner, model_type = text_model(model), text_config(model).model_type
    problem = window_layout_problem(inner)
    if problem:
        return hf(f"{model_type}: {problem}")
    forward = PackedWindowForward(
        inner, layer_ids, attention=attention, compile=compile, layers=layers
    )
    how = f"{model_type}: {attention} document-causal sliding-window attention, compile={compile}"
    packed = _Packed(forward)
    return TargetPath(packed, "packed_window", how, packed.stage)
