"""The frozen target: loading it, capturing the layers the drafter needs, and nothing more.

A target worker only needs the outputs of the `k` decoder layers in `target_layer_ids` (the output of
layer i is HF `hidden_states[i+1]`). `TargetFeatures` registers a forward hook on each of those
layers that copies its output into one preallocated `[B, S, k*d]` buffer, and the hook of the last
needed layer raises a private `_EarlyExit`: the layers after it, the final norm and the lm_head never
run (for Qwen3-8B with ids up to 33 of 36 layers that saves 3 layers and a 152k-wide lm_head).

Why an exception and not a truncated layer list: raising leaves the model untouched (nothing to
restore if anything fails half-way, no shared state to race on) and works for every architecture
that calls its layers in order, whatever its forward does with `layer_types` or layer slicing;
transformers resets its own per-call state in `finally` blocks, so unwinding through it is safe.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import warnings
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForImageTextToText,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
)

from dflash_async.targets.config_readers import is_wrapper, text_config_of
from dflash_async.targets.embeddings import padded_unembedding
from dflash_async.targets.families import family_of, quantization_problem
from dflash_async.targets.fp8.fp8_linear import matmul_kernel, swap_fp8_matmuls
from dflash_async.targets.generic import find_decoder_layers, layer_output
from dflash_async.targets.generic_config import causal_lm_auto_class, text_causal_lm_class
from dflash_async.targets.hf_load import offline_torch_modules
from dflash_async.targets.quantized import (
    WeightFormat,
    fp8_sources,
    load_dequantized,
    quantize_at_load,
    weight_format_of,
)
from dflash_async.targets.resolve import TargetError, resolve_target

_WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json")


class _EarlyExit(Exception):
    """Raised by the hook of the last needed layer to stop the target forward right there."""


def _checked_folder(path: str | os.PathLike[str]) -> Path:
    """The target folder (a folder, or a model id cached locally: resolve.py), or TargetError
    when it is missing or has no config.json."""
    folder = resolve_target(path)
    if not (folder / "config.json").is_file():
        raise TargetError(f"target folder {str(folder)!r} has no config.json")
    return folder


def default_target_dtype(device: torch.device) -> torch.dtype:
    """bf16 on accelerators, fp32 on the CPU (CPU bf16 matmuls are slow and only used in tests)."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def resolve_target_dtype(name: str, device: torch.device) -> torch.dtype:
    """DFLASH_TARGET__DTYPE: "auto" (bf16 on accelerators, fp32 on the CPU), "bfloat16", "float32"."""
    if name == "auto":
        return default_target_dtype(device)
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def load_target(
    path: str | os.PathLike[str],
    *,
    device: torch.device | str,
    dtype: torch.dtype | None = None,
    quantize: str = "none",
) -> PreTrainedModel:
    """Load a local HF causal LM (never downloads), in eval mode with requires_grad False.

    dtype None means bf16 on GPU and fp32 on CPU. A multimodal wrapper loads as its language
    model alone (`_load_language_model`). Raises TargetError for a missing folder, a folder
    without config.json or weights, a quant_method we cannot read, or a config transformers
    cannot build a model from. quantize: see `load_served_target`.
    """
    return load_served_target(path, device=device, dtype=dtype, quantize=quantize)[0]


def load_served_target(
    path: str | os.PathLike[str],
    *,
    device: torch.device | str,
    dtype: torch.dtype | None = None,
    quantize: str = "none",
    fp8_matmuls: bool = True,
) -> tuple[PreTrainedModel, WeightFormat]:
    """`load_target` and the format its weights came in (targets/quantized.py).

    On a CUDA device with FP8 tensor cores (and `fp8_matmuls`), an fp8 or compressed-tensors
    FP8 checkpoint, or quantize="fp8", keeps its decoder matmuls in e4m3 (targets/fp8/fp8_linear.py:
    row-wise scales; the model is built on the host, each weight quantized on the device as it
    moves there, so the device never holds the bf16 copy). Elsewhere, and for gpt-oss mxfp4, a
    quantized checkpoint is dequantized to `dtype` at load, and quantize="fp8" quantizes the
    decoder weights to e4m3 with 128x128 block scales and back (DFLASH_TARGET__QUANTIZE).
    """
    folder = _checked_folder(path)
    device = torch.device(device)
    if not any(next(folder.glob(p), None) for p in _WEIGHT_PATTERNS):
        raise TargetError(f"target folder {str(folder)!r} has no weights (*.safetensors or *.bin)")
    dtype = dtype or default_target_dtype(device)
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise TargetError(f"cannot load target {str(folder)!r}: {_first_line(e)}") from e
    problem = quantization_problem(config)
    if problem:  # never load a format we cannot read as if it were bf16
        raise TargetError(f"{problem}; target {str(folder)!r}")
    weights = weight_format_of(config, quantize=quantize)
    weights = matmul_kernel(weights, device, enabled=fp8_matmuls)
    fp8 = weights.kernel != "bf16"
    try:
        model = _load_model(
            folder,
            config,
            weights=weights,
            dtype=dtype,
            device=torch.device("cpu") if fp8 else device,
        )
    except (OSError, ValueError, KeyError) as e:
        raise TargetError(f"cannot load target {str(folder)!r}: {_first_line(e)}") from e
    if fp8:  # each decoder weight quantized on the device as it moves there, before the rest
        sources = fp8_sources(folder, config) if weights.quant_method == "fp8" else {}
        swap_fp8_matmuls(text_model(model).layers, device=device, out_dtype=dtype, sources=sources)
    model.to(device)  # a no-op when loaded there directly
    if weights.name == "quantized-at-load" and not fp8:
        quantize_at_load(text_model(model).layers)  # on the device: no host round trip
    model.eval()
    model.requires_grad_(False)
    return model, weights


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _load_model(
    folder: Path,
    config: PretrainedConfig,
    *,
    weights: WeightFormat,
    device: torch.device,
    dtype: torch.dtype,
) -> PreTrainedModel:
    if weights.quant_method is not None:  # dequantized on the host (targets/quantized.py)
        return load_dequantized(folder, config, dtype=dtype, wrapper_keys=WRAPPER_KEYS)
    if is_wrapper(config):
        return _load_language_model(folder, config, device=device, dtype=dtype)
    return causal_lm_auto_class(config).from_pretrained(
        folder, dtype=dtype, **offline_torch_modules(), **_device_map(device)
    )


def _device_map(device: torch.device) -> dict[str, Any]:
    """Load straight onto an accelerator; transformers needs `accelerate` for that, and without
    it we load on the CPU and copy."""
    direct = device.type != "cpu" and importlib.util.find_spec("accelerate") is not None
    return {"device_map": {"": device}} if direct else {}


# A wrapper checkpoint's language-model tensors, renamed to a text CausalLM's (`model.*`,
# `lm_head`): `model.language_model.*` (Qwen3.5, Qwen3-VL) and `language_model.model.*` (Gemma 3,
# Kimi K2.5 as released). Kimi K2.5 as transformers saves it names its language model's layers
# `blocks` (the save reverses its conversion's `blocks` -> `layers`, meant for the vision tower,
# everywhere): renamed first, before the general rule takes the prefix.
WRAPPER_KEYS = {
    r"^language_model\.model\.blocks\.": "model.layers.",
    r"^model\.language_model\.": "model.",
    r"^language_model\.model\.": "model.",
    r"^language_model\.lm_head\.": "lm_head.",
}
# The wrapper's parts that are not its language model (dropped before the move to the device).
NON_TEXT_PARTS = ("visual", "vision_tower", "multi_modal_projector", "audio_tower", "embed_vision")


def _load_language_model(
    folder: Path, config: PretrainedConfig, *, device: torch.device, dtype: torch.dtype
) -> PreTrainedModel:
    """A multimodal wrapper's language model, without its vision tower.

    When transformers has a CausalLM class for the text config (Gemma 3, Qwen3.5, Qwen3.5-MoE,
    Kimi K2.5's DeepSeek-V3, Mistral 4 in a Mistral 3 wrapper: `text_causal_lm_class`), that class loads the language model's tensors alone
    (`WRAPPER_KEYS`; the tower's tensors are left in the files, never read into memory as
    modules). Qwen3-VL's and Qwen3-VL-MoE's text models have no such class: the wrapper loads on
    the CPU and its tower is deleted before the model moves to the device, so the tower never
    reaches the device and never runs (text-only inputs).
    """
    text = text_config_of(config)
    causal_lm = text_causal_lm_class(text)
    if causal_lm is not None:
        return causal_lm.from_pretrained(
            folder,
            config=text,
            dtype=dtype,
            key_mapping=WRAPPER_KEYS,
            **offline_torch_modules(),
            **_device_map(device),
        )
    model = AutoModelForImageTextToText.from_pretrained(
        folder, dtype=dtype, **offline_torch_modules()
    )
    inner = getattr(model, "model", model)
    for name in NON_TEXT_PARTS:
        if getattr(inner, name, None) is not None:
            setattr(inner, name, None)  # the forward checks for images before touching it
    return model


def load_target_tokenizer(path: str | os.PathLike[str]) -> Any:
    """The tokenizer stored in the target folder (local files only); TargetError if it is missing."""
    folder = _checked_folder(path)
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as e:
        raise TargetError(f"cannot load the tokenizer of {str(folder)!r}: {e}") from e


def text_model(model: nn.Module) -> nn.Module:
    """The decoder stack that owns `layers` (Qwen3/Llama `model.model`, Qwen3.5 `language_model`)."""
    candidates: list[nn.Module] = []
    if isinstance(model, PreTrainedModel):
        candidates.append(model.get_decoder())
    inner = getattr(model, "model", None)
    candidates += [model, inner, getattr(inner, "language_model", None)]
    for module in candidates:
        if isinstance(getattr(module, "layers", None), nn.ModuleList):
            return module
    raise TargetError(f"cannot find the decoder layers of {type(model).__name__}")


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The target's decoder layers, in order (Qwen3, Qwen3-MoE, Llama, Qwen3-Next, Qwen3.5); for
    the generic family the ones its forward hooks (targets/generic.py), whatever their name."""
    if family_of(text_config(model)).documents_alone:
        layers = find_decoder_layers(model)
        if layers is None:
            raise TargetError(f"cannot find the decoder layers of {type(model).__name__}")
        return layers
    return text_model(model).layers


def text_config(model: PreTrainedModel) -> PretrainedConfig:
    """The language model's config (multimodal wrappers keep it in `text_config`)."""
    return text_config_of(model.config)


def frozen_embeddings(model: PreTrainedModel) -> tuple[torch.Tensor, torch.Tensor]:
    """(embed_tokens weight [V, d], lm_head weight [V, d]); tied embeddings give the same tensor.
    An unembedding of fewer rows (`unpadded_vocab_size`) is given padded with zero rows, as
    training reads it (targets/embeddings.py); made once per model."""
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    rows = getattr(text_config(model), "unpadded_vocab_size", None)
    if rows is not None and head.shape[0] == rows < embed.shape[0]:
        padded = getattr(model, "_padded_unembedding", None)
        if padded is None or padded.device != head.device or padded.dtype != head.dtype:
            padded = padded_unembedding(head.detach(), output_rows=rows, vocab=embed.shape[0])
            model._padded_unembedding = padded
        head = padded
    if embed.shape != head.shape:
        raise TargetError(
            f"embed_tokens {tuple(embed.shape)} and lm_head {tuple(head.shape)} differ"
        )
    return embed, head


class TargetFeatures:
    """Captures the outputs of `layer_ids` and stops the forward after the last of them.

    Lifecycle: the hooks are registered on construction and removed by `close()` (or on leaving
    the `with` block); outside `__call__` they do nothing, so the model can still be used as is.
    One instance per model; calls are not reentrant (one thread per device).
    """

    def __init__(self, model: PreTrainedModel, layer_ids: Sequence[int]) -> None:
        layers = decoder_layers(model)
        ids = [int(i) for i in layer_ids]
        if not ids or len(set(ids)) != len(ids) or not all(0 <= i < len(layers) for i in ids):
            raise ValueError(
                f"layer_ids={list(layer_ids)} must be distinct and within [0, {len(layers)})"
            )
        self.layer_ids = tuple(ids)
        self.hidden_size = text_config(model).hidden_size
        self._model = text_model(model)
        self._out: torch.Tensor | None = None
        last = max(ids)
        self._handles = [
            layers[i].register_forward_hook(partial(self._capture, slot=j, stop=i == last))
            for j, i in enumerate(ids)
        ]

    def _capture(self, module: nn.Module, args: Any, output: Any, *, slot: int, stop: bool) -> None:
        if self._out is None:  # the model is used for something else (e.g. decoding): let it run
            return
        d = self.hidden_size
        self._out[..., slot * d : (slot + 1) * d].copy_(layer_output(output))
        if stop:
            raise _EarlyExit

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Features [B, S, k*d] for right-padded input_ids [B, S]; padding rows are zero."""
        if input_ids.ndim != 2 or attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and attention_mask "
                f"{tuple(attention_mask.shape)} must both be [B, S]"
            )
        param = next(self._model.parameters())
        batch, seq = input_ids.shape
        width = len(self.layer_ids) * self.hidden_size
        out = torch.empty(batch, seq, width, dtype=param.dtype, device=param.device)  # [B, S, k*d]
        self._out = out  # the hooks copy into it on the device: no CPU-GPU sync here
        try:
            self._model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        except _EarlyExit:
            pass
        else:
            raise RuntimeError(f"the forward ended without reaching layer {max(self.layer_ids)}")
        finally:
            self._out = None
        return out.masked_fill_(~attention_mask.bool().unsqueeze(-1), 0)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> TargetFeatures:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# Fast kernels of hybrid (Gated DeltaNet) targets: (import name, distribution, what it speeds up).
_FAST_KERNELS = (
    ("fla", "flash-linear-attention", "the Gated DeltaNet layers (chunk_gated_delta_rule)"),
    ("causal_conv1d", "causal-conv1d", "the short convolutions (causal_conv1d_fn)"),
)


def is_hybrid(model: nn.Module) -> bool:
    """True for targets with linear-attention (Gated DeltaNet) layers: Qwen3-Next, Qwen3.5."""
    layer_types = getattr(text_config(model), "layer_types", None) or ()
    return "linear_attention" in layer_types or any(
        type(m).__name__.endswith("GatedDeltaNet") for m in model.modules()
    )


def _kernel_importable(module: str) -> str | None:
    """None when `module` imports, else why not. Only called for CUDA targets (see preflight)."""
    if importlib.util.find_spec(module) is None:
        return "not installed"
    try:
        importlib.import_module(module)
    except (ImportError, RuntimeError, OSError) as e:  # fla raises RuntimeError without a driver
        return f"import failed: {type(e).__name__}: {e}"
    return None


def preflight_lines(
    *, hybrid: bool, device: torch.device, importable: Callable[[str], str | None]
) -> list[str]:
    """The report of `fast_kernel_preflight`, with the import check passed in (testable)."""
    if not hybrid:
        return []
    if device.type != "cuda":
        # Never import fla/causal_conv1d here: without a GPU (or with a CPU triton) they crash.
        return [
            f"{dist}: not used on {device.type}; {what} run the torch fallback"
            for _, dist, what in _FAST_KERNELS
        ]
    lines = []
    for module, dist, what in _FAST_KERNELS:
        why = importable(module)
        if why is None:
            lines.append(f"{dist}: available for {what}")
            continue
        line = f"{dist}: {why}; {what} run the slow torch fallback (pip install '.[hybrid]')"
        warnings.warn(line, RuntimeWarning, stacklevel=3)
        lines.append(line)
    return lines


def fast_kernel_preflight(model: PreTrainedModel) -> list[str]:
    """Which fast paths a hybrid target will use, one line per kernel; [] for a non-hybrid target.

    Warns (RuntimeWarning) for each kernel a CUDA hybrid target lacks. On the CPU nothing is
    imported: the torch fallback is the only path there.
    """
    device = next(model.parameters()).device
    return preflight_lines(hybrid=is_hybrid(model), device=device, importable=_kernel_importable)


def random_target(
    config: PretrainedConfig, seed: int, *, dtype: torch.dtype = torch.float32
) -> PreTrainedModel:
    """A random-weight causal LM from transformers' own initialisation under `seed` (built by
    the auto class that builds its checkpoints: `causal_lm_auto_class`, Mistral 4's included).

    The global RNG state is restored afterwards; the same config and seed give the same weights.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = causal_lm_auto_class(config).from_config(config, dtype=dtype)
    return model.eval().requires_grad_(False)
