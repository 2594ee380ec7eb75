"""A random-weight target from its config alone (DFLASH_TARGET__WEIGHTS=random), for throughput
runs and benchmarks only: the features of random weights mean nothing to a real drafter.

The target folder needs config.json and the tokenizer files, no weights (weight files, if any,
are ignored: logged). The model is built on the meta device (no memory), then materialized one
unit at a time straight onto the device that runs it: `to_empty` allocates the unit's tensors
there, uninitialised, and the model's own `_init_weights` fills them, parameters AND buffers
(transformers 5 recomputes each rotary embedding's `inv_freq` / `original_inv_freq` from its
`rope_init_fn` there; `to_empty` leaves buffers, persistent or not, as garbage, so nothing is
trusted from the meta build). A unit is one decoder layer, the input embedding, the lm_head, or
a module outside those with tensors of its own (the rotary embedding, the final norm, Gemma 4's
per-layer projections).

Memory: after each decoder layer is drawn, `per_layer` runs on it (the FP8 swap of
targets/fp8/fp8_linear.py on a CUDA GPU, or the CPU's quantize-and-dequantize) before the next layer
exists, so the unquantized copy of the whole target never exists, on the host or the device: the
peak is the final size plus about one unquantized layer. Layers after the last captured one are
left on meta (they never run: every packed forward and the HF fallback's early exit stop at the
last captured layer), and so is an untied lm_head, unless the run decodes (the in-run
evaluation: `decode=True` materializes everything).

Seeds: each unit draws from generators seeded by sha256(seed, its qualified name), so a unit's
values depend on the seed and its name alone: not on the order units are drawn, on which stage
of a split target holds it, or on which rank or replica draws it. A wrapper's language-model
units are named as its text CausalLM names them (`model.language_model.layers.3` is drawn as
`model.layers.3`: loading.py's wrapper key map), so the wrapper drawn whole for image data and
its language model drawn alone for text data hold the same language model. Decoder units are
drawn on their own device (CUDA's Philox: the same values on every GPU); the input embedding and
the lm_head are drawn on the host in fp32 and cast, so a drafter on any device redraws exactly
the target's (`random_embeddings`, the frozen embedding and lm_head it shares with the target).

Multimodal wrappers (`meta_model`): for image data (`images=True`) the whole wrapper is built
and drawn, vision tower and merger included (each of their modules with tensors of its own, on
the target device), every decoder layer and the lm_head too; for text data the text CausalLM
where transformers has one (Gemma 3, Qwen3.5), else the wrapper without its vision tower
(Qwen3-VL: as loading.py loads its checkpoint for text data).
"""

from __future__ import annotations

import copy
import hashlib
import re
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel
from transformers import initialization as hf_init
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

from dflash_async.targets.config_readers import is_wrapper, text_config_of
from dflash_async.targets.generic_config import text_causal_lm_class
from dflash_async.targets.loading import NON_TEXT_PARTS, WRAPPER_KEYS, text_model
from dflash_async.targets.resolve import TargetError

HOST = torch.device("cpu")
WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json")


def weight_files(folder: Path) -> list[str]:
    """The weight files of a folder (ignored by a random target; logged)."""
    return sorted(p.name for pattern in WEIGHT_PATTERNS for p in folder.glob(pattern))


def folder_config(folder: Path) -> PretrainedConfig:
    """The folder's config as a random target is drawn from: without any
    `quantization_config` (a random target is drawn unquantized; DFLASH_TARGET__QUANTIZE decides
    what its matmuls run in), in the text config too."""
    try:
        config = copy.deepcopy(AutoConfig.from_pretrained(folder, local_files_only=True))
    except (OSError, ValueError, KeyError) as e:
        raise TargetError(f"cannot read the config of target {str(folder)!r}: {e}") from e
    for part in {id(c): c for c in (config, text_config_of(config))}.values():
        if getattr(part, "quantization_config", None) is not None:
            del part.quantization_config
    return config


def random_config(folder: Path) -> PretrainedConfig:
    """The text config of the folder's random target (a multimodal wrapper's text config)."""
    return text_config_of(folder_config(folder))


def meta_target(config: PretrainedConfig, *, dtype: torch.dtype) -> PreTrainedModel:
    """The text CausalLM of `config` on the meta device (no memory, no init): transformers'
    causal-LM class, or for a text model registered only as image-text-to-text (Mistral 4's
    Mistral4ForCausalLM) that one."""
    causal_lm = text_causal_lm_class(config)
    if causal_lm is None:
        raise TargetError(
            f"DFLASH_TARGET__WEIGHTS=random: model_type {config.model_type!r} has no text "
            "CausalLM class in transformers to draw a random target from"
        )
    with torch.device("meta"):
        return causal_lm._from_config(config, dtype=dtype)


def meta_wrapper(config: PretrainedConfig, *, dtype: torch.dtype, tower: bool) -> PreTrainedModel:
    """The multimodal wrapper of `config` (its image-text-to-text class) on the meta device;
    without `tower`, its vision parts are removed (text data: they never run)."""
    wrapper = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING.get(type(config), None)
    if wrapper is None:
        raise TargetError(
            f"DFLASH_TARGET__WEIGHTS=random: model_type {config.model_type!r} has no "
            "image-text-to-text class in transformers to draw a random wrapper from"
        )
    with torch.device("meta"):
        model = wrapper._from_config(config, dtype=dtype)
    if not tower:
        inner = getattr(model, "model", model)
        for name in NON_TEXT_PARTS:
            if getattr(inner, name, None) is not None:
                setattr(inner, name, None)  # the forward checks for images before touching it
    return model


def meta_model(folder: Path, *, dtype: torch.dtype, images: bool = False) -> PreTrainedModel:
    """The model a random target of `folder` is drawn into, on meta (see the module doc): the
    whole wrapper for image data; for text data the text CausalLM where transformers has one,
    else the wrapper without its tower."""
    config = folder_config(folder)
    text = text_config_of(config)
    if is_wrapper(config) and (images or text_causal_lm_class(text) is None):
        return meta_wrapper(config, dtype=dtype, tower=images)
    return meta_target(text, dtype=dtype)


def unit_seed(seed: int, name: str) -> int:
    """The seed of one unit: sha256 of (seed, qualified name), 63 bits."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _init_tree(model: PreTrainedModel, module: nn.Module, *, recurse: bool) -> None:
    """The model's own init on `module` (its children first when recurse, as transformers'
    `initialize_weights` walks them)."""
    if recurse:
        for child in module.children():
            _init_tree(model, child, recurse=True)
    model._init_weights(module)


@torch.no_grad()
def materialize(
    model: PreTrainedModel,
    module: nn.Module,
    name: str,
    *,
    device: torch.device,
    seed: int,
    recurse: bool = True,
) -> None:
    """Allocate `module`'s tensors on `device` (its subtree, or its own tensors alone) and draw
    them with the model's init under `unit_seed(seed, name)`; the global RNGs are restored."""
    module.to_empty(device=device, recurse=recurse)
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else []):
        torch.random.default_generator.manual_seed(unit_seed(seed, name))
        if cuda:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(unit_seed(seed, name))
        with hf_init.guard_torch_init_functions():
            _init_tree(model, module, recurse=recurse)


def _on_host(model, module: nn.Module, name: str, *, device, dtype, seed: int) -> None:
    """Draw on the host in fp32, then move to `device` in `dtype` (embedding and lm_head: the
    same values wherever the target and the drafter live)."""
    module.to(dtype=torch.float32)  # on meta: no memory
    materialize(model, module, name, device=HOST, seed=seed)
    module.to(device=device, dtype=dtype)


def seed_name(name: str) -> str:
    """The name a unit is seeded by: a wrapper's language-model names as its text CausalLM's."""
    for pattern, text in WRAPPER_KEYS.items():
        name, hit = re.subn(pattern, text, name)
        if hit:
            return name
    return name


def _names(model: nn.Module) -> dict[int, str]:
    return {id(m): seed_name(name) for name, m in model.named_modules()}


def is_meta(module: nn.Module, *, recurse: bool = True) -> bool:
    tensors = [*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)]
    return any(t.is_meta for t in tensors)


def held_bytes(module: nn.Module) -> int:
    """Bytes of the tensors a module holds in memory: meta ones are not counted, a tensor
    shared by two modules (tied embeddings) once."""
    tensors = {id(t): t for t in [*module.parameters(), *module.buffers()] if not t.is_meta}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _tied(model: PreTrainedModel) -> bool:
    head = model.get_output_embeddings()
    return head is not None and head.weight is model.get_input_embeddings().weight


@torch.no_grad()
def materialize_target(
    model: PreTrainedModel,
    *,
    device: torch.device,
    seed: int,
    layers: range,
    decoder: nn.Module,
    decode: bool,
    per_layer: Callable[[nn.Module, torch.device], None] | None = None,
    layer_device: Callable[[int], torch.device] | None = None,
    tail_device: torch.device | None = None,
) -> dict:
    """Draw the meta-built `model` (see the module doc): the input embedding and every module
    outside the layers with tensors of its own (rotary, norms) on `device`, the decoder layers in
    `layers` one at a time (each on `layer_device(i)`, default `device`, then `per_layer(layer,
    its device)`), and with `decode` the other layers and the lm_head too (on `tail_device`,
    default `device`). Returns what was done, for the log."""
    layer_device = layer_device or (lambda i: device)
    tail_device = tail_device or device
    names, stack = _names(model), decoder.layers
    dtype = next(stack[0].parameters()).dtype
    tied = _tied(model)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    _on_host(model, embed, names[id(embed)], device=device, dtype=dtype, seed=seed)
    run = list(layers) + ([i for i in range(len(stack)) if i not in layers] if decode else [])
    for i in run:
        where = layer_device(i) if i in layers else tail_device
        materialize(model, stack[i], names[id(stack[i])], device=where, seed=seed)
        if per_layer is not None:
            per_layer(stack[i], where)
    if tied:
        head.weight = embed.weight
    elif decode and head is not None:
        _on_host(model, head, names[id(head)], device=tail_device, dtype=dtype, seed=seed)
    skip = {id(m) for i, layer in enumerate(stack) if i not in run for m in layer.modules()}
    skip |= {id(m) for m in (head.modules() if head is not None and not decode else ())}
    for module in model.modules():  # rotary, norms, ...: their own tensors, where still meta
        if id(module) not in skip and is_meta(module, recurse=False):
            materialize(model, module, names[id(module)], device=device, seed=seed, recurse=False)
    return {
        "layers_drawn": len(run),
        "layers_on_meta": len(stack) - len(run),
        "lm_head_on_meta": not (tied or decode),
    }


def random_embeddings(
    folder: str | Path, *, seed: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The input embedding and lm_head weights [V, d] of the random target of `folder` under
    `seed`, exactly the target's (drawn on the host in fp32 under the same names): the drafter's
    frozen tensors. Tied embeddings give one tensor."""
    model = meta_model(Path(folder), dtype=dtype)
    names, tied = _names(model), _tied(model)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    _on_host(model, embed, names[id(embed)], device=device, dtype=dtype, seed=seed)
    if tied or head is None:
        return embed.weight, embed.weight
    _on_host(model, head, names[id(head)], device=device, dtype=dtype, seed=seed)
    return embed.weight, head.weight


def random_final_norm(
    folder: str | Path, *, seed: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """The final norm weight [d] of the random target of `folder` under `seed`, exactly the
    target's (drawn on the host under its name, as random_embeddings draws its tensors)."""
    model = meta_model(Path(folder), dtype=dtype)
    norm = text_model(model).norm
    _on_host(model, norm, _names(model)[id(norm)], device=device, dtype=dtype, seed=seed)
    return norm.weight


def random_format(quantize: str, device: torch.device, *, fp8_matmuls: bool = True):
    """The WeightFormat of a random target (name `random`): with QUANTIZE=fp8 the FP8 kernel
    where the device has one (targets/fp8/fp8_linear.py), else quantized and dequantized per layer."""
    from dflash_async.targets.fp8.fp8_linear import matmul_kernel
    from dflash_async.targets.quantized import WeightFormat

    if quantize != "fp8":
        return WeightFormat("random", None, False, kernel_reason="random weights, QUANTIZE=none")
    return matmul_kernel(WeightFormat("random", None, True), device, enabled=fp8_matmuls)


def per_layer_quantizer(weights, *, dtype: torch.dtype) -> Callable | None:
    """What runs on each decoder layer right after it is drawn: the FP8 swap (the layer's bf16
    weights replaced by e4m3 ones on its device), the CPU's quantize-and-dequantize, or nothing."""
    from dflash_async.targets.fp8.fp8_linear import swap_fp8_matmuls
    from dflash_async.targets.quantized import quantize_at_load

    if weights.kernel != "bf16":
        return lambda layer, device: swap_fp8_matmuls(layer, device=device, out_dtype=dtype)
    if weights.dequantized:
        return lambda layer, device: quantize_at_load(layer)
    return None


def load_random_target(
    path: str | Path,
    *,
    device: torch.device | str,
    dtype: torch.dtype | None = None,
    seed: int,
    last_layer: int | None = None,
    decode: bool = True,
    quantize: str = "none",
    layer_device: Callable[[int], torch.device] | None = None,
    tail_device: torch.device | None = None,
    fp8_matmuls: bool = True,
    images: bool = False,
):
    """(model, WeightFormat, facts for the log) of the random target of `path` (module doc):
    layers 0..last_layer drawn (all of them when last_layer is None or `decode`), in eval mode
    with requires_grad False; `images`: a multimodal wrapper drawn whole, tower, every layer
    and the lm_head included (the per-document HF forward, targets/multimodal.py, probes the
    whole wrapper once at load). TargetError (exit 2) for a folder without config.json."""
    from dflash_async.targets.loading import _checked_folder, default_target_dtype, text_model

    folder, device = _checked_folder(path), torch.device(device)
    dtype = dtype or default_target_dtype(device)
    model = meta_model(folder, dtype=dtype, images=images)
    decode = decode or images
    decoder = text_model(model)
    count = len(decoder.layers) if last_layer is None else last_layer + 1
    weights = random_format(
        quantize, layer_device(0) if layer_device else device, fp8_matmuls=fp8_matmuls
    )
    facts = materialize_target(
        model,
        device=device,
        seed=seed,
        layers=range(count),
        decoder=decoder,
        decode=decode,
        per_layer=per_layer_quantizer(weights, dtype=dtype),
        layer_device=layer_device,
        tail_device=tail_device,
    )
    model.eval()
    model.requires_grad_(False)
    facts |= {"seed": seed, "ignored_weight_files": weight_files(folder)[:4]}
    return model, weights, facts
