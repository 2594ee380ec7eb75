"""Which target forward runs on a packed layout, and why: `select_target_forward`, which takes the
packed path of the target's family from targets/families.py (the paths: targets/paths.py).

Every path has one call shape, `forward(input_ids, position_ids, doc_ids, features, lengths)`:
the pack's fixed layout on the target device in, its features [T, k*d] written in place (padding
rows zero). `lengths` (host numpy) is read only by the HF fallback, which needs the documents'
extents on the host; the packed paths never look at it.

- `packed_dense`: Qwen3, Qwen2/2.5, Llama 3.x and Qwen3-VL's language model on text data (its
  M-RoPE given three equal position rows) (`targets/packed/dense.py`); flex + compile on CUDA,
  SDPA in chunks of query rows on the CPU (no [T, T] mask) and on CUDA where flex's kernels do
  not take the pack or the heads (`packed_attention`: T not a multiple of 128, heads of fewer
  than 16 dimensions, as tiny targets have).
- `packed_moe`: Qwen3-MoE and Qwen3-VL-MoE's language model (its M-RoPE as Qwen3-VL's), the same
  packed forward with the HF MoE block (its grouped experts) run eagerly between compiled
  attention blocks; GLM-4.5 (`glm4_moe`) through `targets/packed/mla.py`
  (partial-rotary attention, grouped top-k router with shared experts).
- `packed_mla`: DeepSeek-V3 / Kimi-K2.x / Moonlight (`deepseek_v3`, Kimi K2.5's language model),
  multi-head latent attention and the grouped-router MoE (`targets/packed/mla.py`); Mistral 4
  the same with a softmax router and Llama 4's per-position query scale.
- `packed_window`: Mistral, Gemma 3 and Gemma 4 text, Muse Glimmer and Muse Spark's language
  models, sliding windows in the document-causal mask (`targets/packed/window.py`; Muse's layers
  `targets/packed/muse.py`).
- `packed_hybrid`: Qwen3.5, Qwen3.5-MoE and Qwen3-Next on CUDA with flash-linear-attention
  (`targets/packed/hybrid.py`, its MoE block `targets/packed/hybrid_moe.py`), unless turned off
  (`packed_hybrid=False`).
- `packed_moe_window`: gpt-oss (sliding windows, sinks), MiniMax-M2 (`targets/packed/moe_window.py`).
- `packed_short_conv`: LFM2 and LFM2-MoE, their short convolutions per document in plain torch
  and document-causal attention, on any device (`targets/packed/short_conv.py`).
- `packed_kda`: Kimi-Linear, its KDA layers per document (flash-linear-attention's varlen
  `chunk_kda` on CUDA, HF's torch chunks one document at a time elsewhere), NoPE MLA document-
  causal and the grouped-router MoE (`targets/packed/kda.py`), unless turned off
  (`packed_hybrid=False`).
- `packed_mamba`: Nemotron-H, its Mamba-2 mixers by a chunked SSD per document in plain torch
  and document-causal attention, on any device (`targets/packed/mamba.py`).
- `packed_deepseek_v4`: DeepSeek-V4, its hyper-connection streams, sliding windows and
  compressed blocks per document under the indexer's selection, in plain torch on any device
  (`targets/packed/deepseek_v4.py`); where it refuses, the generic forward (each document
  alone), whose taps collapse the streams; not split into stages.
- `packed_inkling`: Inkling 2's language model (`inkling2_text`, the `inkling2` wrapper's), its
  short and dynamic convolutions per document, document-causal attention with the relative
  position bias and per-token sinks, block residuals, in plain torch on any device
  (`targets/packed/inkling.py`); where it refuses, the generic forward (each document alone);
  not split into stages.
- MoE experts: on CUDA the packed paths run every fused HF experts module as
  `targets/grouped_experts.py`'s CompiledExperts (HF's math, its sort/gate/combine compiled):
  1.36-1.55x the MoE shapes' packed tokens/s with HF's experts (BENCHMARKS.md, 2026-12-03);
  `experts="hf"` keeps HF's call (bench target's reference row).
- `hf` for the generic family (any model_type outside the table, targets/generic.py): the
  model's own HF forward on each document alone, unpadded, hooks on its decoder layers.
- `hf`: anything else (hybrids on the CPU or without fla too): the HF forward on
  right-padded 2-D batches of whole documents, each document alone in its row, so it is exact for
  every architecture (no recurrent or convolution state crosses a document).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from dflash_async.data.packing import pack_row_offsets, target_batches
from dflash_async.errors import SettingsError
from dflash_async.targets.config_readers import latent_head_dims
from dflash_async.targets.families import (
    FAMILIES,
    GENERIC,
    GENERIC_ROW,
    attention_head_dim,
    family_of,
)
from dflash_async.targets.generic import GenericForward
from dflash_async.targets.grouped_experts import CompiledExperts, swap_compiled_experts
from dflash_async.targets.loading import TargetFeatures, is_hybrid, text_config, text_model
from dflash_async.targets.packed.dense import FLEX_MIN_HEAD_DIM, FLEX_TILE, PackedDenseForward
from dflash_async.targets.paths import NoPackedPath, TargetPath


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


GENERIC_HOW = "no family here; the generic HF forward, each document alone and unpadded"
ALONE_HOW = "the generic HF forward, each document alone and unpadded"


def architecture_table() -> str:
    """The README's table of supported targets (targets/families.py), one row per model_type
    and the generic family's last."""
    rows = [
        f"| `{kind}` | {family.label} | {family.planned} |" for kind, family in FAMILIES.items()
    ]
    rows.append(f"| `{GENERIC_ROW}` | {GENERIC.label} | {GENERIC.planned} |")
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
        which = (
            "the HF fallback ({}), which runs the whole model's own forward"
            if path.name == "hf"
            else f"{path.name} ({{}}), which hands on no [1, T, d] hidden states"
        ).format(path.reason)
        raise SettingsError(
            f"DFLASH_TARGET__STAGES > 1: the target's forward is {which} and cannot be split "
            "by layers; use DFLASH_TARGET__STAGES=1"
        )
    return path


def _graphed(path: TargetPath, device: torch.device, *, split: bool) -> TargetPath:
    """`path` replayed from one CUDA graph (targets/graphed.py) where that was measured to hold
    (a whole PackedDenseForward on CUDA: the packed dense and Qwen3-MoE paths, bf16 experts),
    else as it is; either way the reason says so."""
    packed = getattr(path.forward, "packed", None)
    if split:
        why = "a split stage"
    elif device.type != "cuda" or not isinstance(packed, PackedDenseForward):
        why = f"{device.type}, {path.name}"
    else:
        why = _grouped_experts_sync(packed)
    if why is None:
        from dflash_async.targets.graphed import GraphedForward

        graphed = GraphedForward(path.forward, device=device)
        return dataclasses.replace(path, forward=graphed, reason=f"{path.reason}; one CUDA graph")
    return dataclasses.replace(path, reason=f"{path.reason}; not graphed ({why})")


def _grouped_experts_sync(packed: PackedDenseForward) -> str | None:
    """Why `packed`'s CompiledExperts would read the host inside a graph, or None: on Hopper
    torch._grouped_mm runs its kernel, which takes the group offsets on the device, for bf16
    operands only; any other dtype takes its per-group fallback, which copies the offsets to the
    host (a sync, which a CUDA graph capture refuses)."""
    for module in (m for layer in packed.layer_modules() for m in layer.modules()):
        if isinstance(module, CompiledExperts) and module.gate_up_proj.dtype != torch.bfloat16:
            return f"{module.gate_up_proj.dtype} experts: torch._grouped_mm's fallback syncs"
    return None


def _device(model: nn.Module, layers: range | None) -> torch.device:
    """The device the forward runs on: a stage's is that of its first layer."""
    first = text_model(model).layers[layers.start] if layers is not None else model
    return next(first.parameters()).device


def _layer_range(model: nn.Module, layers: range | None) -> nn.ModuleList:
    """The decoder layers this forward runs (a stage's range, or all)."""
    every = text_model(model).layers
    return every if layers is None else nn.ModuleList(every[i] for i in layers)


def packed_attention(config, *, cuda: bool, token_budget: int) -> str:
    """The packed forwards' attention: flex on CUDA where its kernels take the pack (T a multiple
    of its tile) and the heads (FLEX_MIN_HEAD_DIM dimensions or more: MLA's own query-key and
    value widths, else the one head dimension), else the SDPA path."""
    heads = latent_head_dims(config) or (attention_head_dim(config),)
    fits = token_budget % FLEX_TILE == 0 and min(heads) >= FLEX_MIN_HEAD_DIM
    return "flex" if cuda and fits else "sdpa"


def _select(model, layer_ids, *, token_budget, max_batch_tokens, compile, packed_hybrid, layers):
    """select_target_forward's choice (see there): the packed path of the text config's family
    (targets/families.py), or the HF fallback with the reason that path refuses."""
    device = _device(model, layers)
    cuda = device.type == "cuda"
    compile = cuda if compile is None else compile
    config = text_config(model)
    attention = packed_attention(config, cuda=cuda, token_budget=token_budget)
    model_type = config.model_type
    family = family_of(config)
    path = family.forward
    if is_hybrid(model) and not family.decoding.linear_state:
        path = NoPackedPath(hybrid=True)  # linear-attention layers of a family without them
    if family.documents_alone and isinstance(path, NoPackedPath):  # the generic family
        forward = GenericForward(model, layer_ids, max_batch_tokens)
        return TargetPath(forward, "hf", f"model_type {model_type!r}: {GENERIC_HOW}")
    inner = text_model(model)
    refusal = path.refusal(inner, device, model_type=model_type, packed_hybrid=packed_hybrid)
    if refusal and family.documents_alone:  # its fallback: HF on each document alone
        forward = GenericForward(model, layer_ids, max_batch_tokens)
        return TargetPath(forward, "hf", f"{refusal}; {ALONE_HOW}")
    if refusal:
        return TargetPath(HFPaddedForward(model, layer_ids, max_batch_tokens), "hf", refusal)
    return path.build(
        inner, layer_ids, model_type=model_type, attention=attention, compile=compile, layers=layers
    )
