"""targets/generic.py owns the generic target forward: any decoder LM transformers builds, run by its
own HF forward on one document at a time, for the model_types without a family of their own
(targets/families.py's `GENERIC`).

Exact for every architecture by construction: each document runs alone and unpadded (documents
of equal length share one forward, so no row is ever padded or masked), so no attention mask,
padding rule, recurrent or convolution state or router sees anything but the document itself.
The features are the raw outputs of the tapped decoder layers (forward hooks, as TargetFeatures
takes them; never HF's `hidden_states`, whose last entry is final-norm'd in many families), and
the forward stops at the last tapped layer where every layer runs once per forward. A type whose
layers return several residual streams per token (hyper-connections) has each tapped output
collapsed by its STREAM_TAPS entry (targets/stream_taps.py), as the decoding hooks do.

The decoder layers are found without knowing the family (`find_decoder_layers`: the outermost
`nn.ModuleList` of `num_hidden_layers` modules of one class, or as many as the families table's
`decoder_layer_count` says where that field counts sublayers: `model.layers`, GPT-2's
`transformer.h`, OPT's `decoder.layers`, MPT's `blocks`...). A probe forward at build checks what
the hooks rely on (`GenericForward.probe`): each tapped output is [b, n, hidden_size], and the
model is causal (changing later tokens leaves earlier features alone); a failure is a
TargetError (exit 2) naming it. Layers called more than once per forward (looped or shared
blocks) are taken at their last call and the forward runs whole.

Imports neither targets/loading.py nor targets/forward.py (both import this module's table).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from dflash_async.data.packing import pack_row_offsets
from dflash_async.targets.families import decoder_layer_count
from dflash_async.targets.hf_load import offline_torch_modules
from dflash_async.targets.resolve import TargetError
from dflash_async.targets.stream_taps import stream_tap

PROBE_TOKENS = 12  # probe length: past any short convolution or local window at tiny size
PROBE_CHANGED = 4  # the probe's trailing tokens replaced to test causality


class _EarlyExit(Exception):
    """Raised by the hook of the last tapped layer to stop the forward there."""


def _text_config(model: nn.Module) -> Any:
    config = model.config
    return getattr(config, "text_config", None) or config


def find_decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The decoder layers of `model` (see the module doc), None when no ModuleList fits."""
    config = _text_config(model)
    want = decoder_layer_count(config) if hasattr(config, "num_hidden_layers") else None
    for _, module in model.named_modules():  # outermost first
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if want is not None and len(module) != want:
            continue
        if len({type(layer) for layer in module}) <= 2:  # hybrids alternate two layer classes
            return module
    return None


def layer_output(output: Any) -> Any:
    """A layer's hidden states: the output, or the first item of a tuple, list or ModelOutput."""
    if isinstance(output, tuple | list):
        return output[0]
    if isinstance(output, dict):
        return next(iter(output.values()))
    return output


def layer_input(args: tuple, kwargs: dict) -> Any:
    """The hidden states a layer is called with (a forward pre-hook's args and kwargs)."""
    return args[0] if args else kwargs.get("hidden_states")


def _forward_kwargs(model: nn.Module) -> dict[str, Any]:
    """use_cache=False where the forward takes it (no cache is built for a feature forward)."""
    import inspect

    params = inspect.signature(model.forward).parameters
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
    return {"use_cache": False} if "use_cache" in params or takes_all else {}


class GenericForward:
    """The FeatureForward of the generic path (see the module doc).

    Sync point: each document's extent comes from the host (`lengths`), as in the HF padded
    fallback; one model forward per group of equal-length documents of at most max_batch_tokens.
    One instance per model; calls are not reentrant (one thread per device).
    """

    def __init__(
        self,
        model: nn.Module,
        layer_ids: Sequence[int],
        max_batch_tokens: int,
        *,
        layers: nn.ModuleList | None = None,
    ) -> None:
        layers = layers if layers is not None else find_decoder_layers(model)
        if layers is None:
            raise TargetError(
                f"{type(model).__name__}: no list of {decoder_layer_count(_text_config(model))} "
                "decoder layers to take hidden states from"
            )
        ids = [int(i) for i in layer_ids]
        if not ids or len(set(ids)) != len(ids) or not all(0 <= i < len(layers) for i in ids):
            raise TargetError(
                f"layer_ids={list(layer_ids)} must be distinct and within [0, {len(layers)})"
            )
        self.model, self.layer_ids = model, tuple(ids)
        self.hidden_size = int(_text_config(model).hidden_size)
        self.max_batch_tokens = max_batch_tokens
        self.early_exit = True  # until the probe finds a layer called twice
        self._kwargs = _forward_kwargs(model)
        self._out: torch.Tensor | None = None
        self._calls = [0] * len(layers)
        tap = stream_tap(_text_config(model))
        self._taps = {i: tap(model, layers, i) for i in ids} if tap is not None else {}
        self._handles = [
            layer.register_forward_hook(self._hook(index)) for index, layer in enumerate(layers)
        ]
        self.probe()

    def _hook(self, index: int):
        slot = self.layer_ids.index(index) if index in self.layer_ids else None
        last = max(self.layer_ids)

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self._out is None:  # the model used for something else (decoding)
                return
            self._calls[index] += 1
            if slot is not None:
                hidden = layer_output(output)
                if index in self._taps:  # several residual streams: the family's collapse
                    hidden = self._taps[index](hidden)
                d = self.hidden_size
                if not isinstance(hidden, torch.Tensor) or hidden.shape != (
                    *self._out.shape[:2],
                    d,
                ):
                    shape = getattr(hidden, "shape", type(hidden).__name__)
                    raise TargetError(
                        f"{type(self.model).__name__}: decoder layer {index} returns {shape}, "
                        f"not the [batch, tokens, {d}] hidden states the drafter reads"
                    )
                self._out[..., slot * d : (slot + 1) * d].copy_(hidden)
            if index == last and self.early_exit:
                raise _EarlyExit

        return hook

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor, **inputs: Any) -> torch.Tensor:
        """Features [b, n, k*d] of the unpadded documents input_ids [b, n]; `inputs`: more
        inputs of the model's forward (a multimodal wrapper's vision inputs)."""
        param = next(self.model.parameters())
        width = len(self.layer_ids) * self.hidden_size
        out = input_ids.new_zeros(*input_ids.shape, width, dtype=param.dtype)
        self._out = out
        self._calls = [0] * len(self._calls)
        try:
            self.model(input_ids=input_ids, **inputs, **self._kwargs)
        except _EarlyExit:
            pass
        finally:
            self._out = None
        return out

    @torch.no_grad()
    def probe(self) -> None:
        """Check the hooks' assumptions on a short random document (see the module doc)."""
        device = next(self.model.parameters()).device
        vocab = int(getattr(_text_config(self.model), "vocab_size", 0) or 2)
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (1, PROBE_TOKENS), generator=generator).to(device)
        self.early_exit = False
        first = self.features(ids)
        calls = list(self._calls)
        if any(calls[i] == 0 for i in self.layer_ids):
            raise TargetError(f"{type(self.model).__name__}: a tapped decoder layer never ran")
        self.early_exit = all(c == 1 for c in calls)
        changed = ids.clone()
        changed[0, -PROBE_CHANGED:] = (changed[0, -PROBE_CHANGED:] + 1) % vocab
        second = self.features(changed)
        kept = PROBE_TOKENS - PROBE_CHANGED
        # A causal model computes the first positions from the same inputs whatever follows; only
        # the grouping of rows may differ (MoE experts see other tokens): fp32 rounding, ~1e-6 of
        # the largest feature, bf16 ~1e-2. A bidirectional one (an encoder LM head without
        # is_decoder) moves them by a sizeable part of that scale (4 of 12 tokens changed).
        scale = first.abs().max().clamp_min(1e-30)
        tolerance = (3e-2 if first.dtype in (torch.bfloat16, torch.float16) else 1e-4) * scale
        if (first[:, :kept] - second[:, :kept]).abs().max() > tolerance:
            raise TargetError(
                f"{type(self.model).__name__}: not causal (its hidden states at a position "
                "depend on later tokens: an encoder or prefix-LM, e.g. without is_decoder=true)"
            )

    @torch.no_grad()
    def __call__(self, input_ids, position_ids, doc_ids, features, lengths) -> torch.Tensor:
        lengths = np.asarray(lengths, dtype=np.int64)
        offsets = pack_row_offsets(lengths)
        for rows in _equal_length_groups(lengths, self.max_batch_tokens):
            n = int(lengths[rows[0]])
            ids = torch.stack([input_ids[offsets[r] : offsets[r] + n] for r in rows])  # [b, n]
            out = self.features(ids)  # [b, n, k*d]
            for i, r in enumerate(rows):
                features[offsets[r] : offsets[r] + n] = out[i]
        features[int(offsets[-1]) :] = 0  # padding rows (finite: masked keys still multiply V)
        return features

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _equal_length_groups(lengths: np.ndarray, max_batch_tokens: int) -> list[list[int]]:
    """Documents (indices) grouped by length, each group at most max_batch_tokens (one document
    at least), in order of first appearance."""
    groups: dict[int, list[list[int]]] = {}
    for r, n in enumerate(lengths.tolist()):
        if n == 0:
            continue
        runs = groups.setdefault(n, [[]])
        if runs[-1] and (len(runs[-1]) + 1) * n > max_batch_tokens:
            runs.append([])
        runs[-1].append(r)
    return [run for runs in groups.values() for run in runs]


def embedding_weights(
    folder: str, files: Any, *, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """A generic target's input embedding and lm_head weights [V, d] (one tensor when tied).

    Read by the names its model gives them (the model built on the meta device) where the
    checkpoint holds those names; a checkpoint saved under other names (transformers converts
    some families' names on save) loads the model on the host and takes them from it.
    """
    from safetensors import safe_open
    from transformers import AutoConfig

    from dflash_async.targets.generic_config import causal_lm_auto_class

    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    auto = causal_lm_auto_class(config)
    with torch.device("meta"):
        meta = auto.from_config(config)
    names: dict[int, list[str]] = {}
    for name, param in meta.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    head = meta.get_output_embeddings()
    embed_names = names[id(meta.get_input_embeddings().weight)]
    head_names = names[id(head.weight)] if head is not None else []

    def read(wanted: list[str]) -> torch.Tensor | None:
        name = next((n for n in wanted if n in files), None)
        if name is None:
            return None
        with safe_open(files[name], framework="pt") as f:
            return f.get_tensor(name).to(device=device, dtype=dtype)

    embed = read(embed_names)
    if embed is not None:
        lm_head = read(head_names)
        return embed, embed if lm_head is None else lm_head
    model = auto.from_pretrained(folder, dtype=dtype, **offline_torch_modules())
    weights = [model.get_input_embeddings().weight, model.get_output_embeddings().weight]
    return tuple(w.detach().to(device) for w in weights)  # type: ignore[return-value]
