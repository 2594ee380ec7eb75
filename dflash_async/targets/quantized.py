"""The target's weights as they are served: FP8 and MXFP4 checkpoints read, bf16 ones quantized.

Owns the weight formats a target may come in and what is done with them at load:
- `fp8` (DeepSeek-V3, Qwen3-*-FP8): `X.weight` float8_e4m3fn with `X.weight_scale_inv` fp32, one
  scale per `weight_block_size` block (128x128): W = W_fp8 * scale_inv, broadcast per block.
- `compressed-tensors` FP8 (`float-quantized`): `X.weight` fp8 with `X.weight_scale` per tensor,
  per output channel or per block (the same product); a static `X.input_scale` is dropped (it
  only matters to an FP8-activation kernel, which computes per-token scales on the device).
- `mxfp4` (gpt-oss): the experts' `*_blocks` (uint8, two e2m1 values per byte, low nibble
  first) and `*_scales` (uint8 e8m0: 2^(s-127) per 32 values along the input dimension).
- `DFLASH_TARGET__QUANTIZE=fp8` on an unquantized checkpoint: every decoder linear (and expert)
  weight is quantized to e4m3 with 128x128 block scales, the format of the served FP8
  checkpoints above, so a drafter trains on the features of an FP8-served target.

On a CPU everything is dequantized to the compute dtype (fp32) at load, which is what CI covers.
On a CUDA device with FP8 tensor cores an fp8 checkpoint, or QUANTIZE=fp8, runs its decoder
matmuls in FP8 instead (`targets/fp8/fp8_linear.py`: row-wise e4m3, block weights requantized per row
on the device from the checkpoint's own e4m3 values, `fp8_sources`); the host holds the
dequantized state dict during the load only, the GPU never holds a bf16 copy of those weights.
MXFP4 experts stay dequantized to bf16 everywhere (no MXFP4 kernel here).

MXFP4 is dequantized by transformers' own loader (`Mxfp4Config(dequantize=True)`: it needs
neither accelerate, triton nor kernels on a CPU in transformers 5.24). FP8 is dequantized here:
in transformers 5.24 `FineGrainedFP8HfQuantizer.validate_environment` raises ImportError
without `accelerate` (not a dependency of ours) even with `dequantize=True`, and
compressed-tensors needs the `compressed-tensors` package (>= 0.15); the dequantization is one
product per weight, the same for both formats.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoModelForCausalLM, Mxfp4Config, PreTrainedModel

from dflash_async.kernels.fp8_format import FP8_DTYPE, FP8_MAX  # a block's amax lands on 448
from dflash_async.targets.config_readers import quant_method_of, text_config_of
from dflash_async.targets.generic_config import text_causal_lm_class
from dflash_async.targets.hf_load import offline_torch_modules
from dflash_async.targets.resolve import TargetError
from dflash_async.targets.tensor_files import tensor_files

FP8_BLOCK = (128, 128)  # the served checkpoints' weight_block_size (DeepSeek-V3, Qwen3-FP8)
_ROUTERS = frozenset({"gate", "router"})  # MoE routers: kept in bf16 by served FP8 checkpoints


@dataclass(frozen=True)
class WeightFormat:
    """How the target's weights were stored and what loading did (logged: target_weights_loaded).

    name: `bf16` (an unquantized checkpoint, bf16 or fp32 files), `fp8-block` (fp8 or
    compressed-tensors FP8), `mxfp4` or `quantized-at-load` (DFLASH_TARGET__QUANTIZE=fp8).
    """

    name: str
    quant_method: str | None
    dequantized: bool
    kernel: str = (
        "bf16"  # the decoder matmuls' kernel (targets/fp8/fp8_linear.py: scaled_mm_rowwise)
    )
    kernel_reason: str = ""  # why that kernel (logged with target_path_chosen)


def weight_format_of(config: Any, *, quantize: str) -> WeightFormat:
    """The format a checkpoint with this config loads as (a quantized checkpoint wins over
    QUANTIZE: its weights already are the served ones)."""
    method = quant_method_of(config)
    if method is None:
        at_load = quantize == "fp8"
        return WeightFormat("quantized-at-load" if at_load else "bf16", None, at_load)
    return WeightFormat("mxfp4" if method == "mxfp4" else "fp8-block", method, True)


def expand_block_scales(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int]):
    """Scales [..., ceil(R/bm), ceil(C/bn)] repeated to [..., R, C]: block (i, j) covers rows
    i*bm.. and columns j*bn.. (the last blocks may be partial, as DeepSeek-V3's are)."""
    rows, cols = shape[-2:]
    bm, bn = block
    grid = (math.ceil(rows / bm), math.ceil(cols / bn))
    if tuple(scale.shape[-2:]) != grid:
        raise TargetError(
            f"scale grid {tuple(scale.shape)} does not match a weight {tuple(shape)} in "
            f"{bm}x{bn} blocks (expected {grid})"
        )
    full = scale.repeat_interleave(bm, dim=-2).repeat_interleave(bn, dim=-1)
    return full[..., :rows, :cols]


def dequantize_fp8(
    weight: torch.Tensor, scale: torch.Tensor, *, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """W_fp8 * scale per block, in fp32, then cast: one rounded product per value."""
    full = expand_block_scales(scale.float(), weight.shape, block)
    return (weight.float() * full).to(dtype)


def quantize_fp8(weight: torch.Tensor, *, block: tuple[int, int] = FP8_BLOCK):
    """(W_fp8 [.., R, C] e4m3, scale_inv [.., ceil(R/bm), ceil(C/bn)] fp32): each block scaled
    so its largest |value| is 448, as DeepSeek-V3's and Qwen3-FP8's quantizer do. An all-zero
    block gets scale 1 (any scale gives zeros; 1 keeps the scale finite)."""
    rows, cols = weight.shape[-2:]
    bm, bn = block
    grid = (math.ceil(rows / bm), math.ceil(cols / bn))
    padded = weight.float().new_zeros(*weight.shape[:-2], grid[0] * bm, grid[1] * bn)
    padded[..., :rows, :cols] = weight.float()
    tiles = padded.unflatten(-1, (grid[1], bn)).unflatten(-3, (grid[0], bm))  # [.., gr, bm, gc, bn]
    amax = tiles.abs().amax(dim=(-3, -1))  # [.., gr, gc]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    full = expand_block_scales(scale, weight.shape, block)
    return (weight.float() / full).to(FP8_DTYPE), scale


def _compressed_tensors_block(quant: dict[str, Any]) -> tuple[int, int] | None:
    """The block of compressed-tensors' block strategy (None: tensor or channel, read from the
    scale's shape)."""
    for group in (quant.get("config_groups") or {}).values():
        weights = group.get("weights") or {}
        if weights.get("strategy") == "block":
            return tuple(weights["block_structure"])
    return None


def _scale_block(scale: torch.Tensor, shape: torch.Size, configured) -> tuple[int, int]:
    """The block one scale covers: the whole tensor (one scale), a row (one per output
    channel), else the configured block."""
    rows, cols = shape[-2:]
    if scale.numel() == 1:
        return rows, cols
    if configured is None and tuple(scale.shape[-2:]) == (rows, 1):
        return 1, cols
    if configured is None:
        raise TargetError(
            f"weight {tuple(shape)} has scales {tuple(scale.shape)} but no block size"
        )
    return tuple(configured)


class _Tensors:
    """Every tensor name of a safetensors checkpoint, read one at a time."""

    def __init__(self, folder: Path) -> None:
        self.files = tensor_files(folder)

    def names(self) -> list[str]:
        return list(self.files)

    def get(self, name: str) -> torch.Tensor:
        with safe_open(self.files[name], framework="pt") as f:
            return f.get_tensor(name)


def _fp8_weights(tensors: _Tensors, quant: dict[str, Any], dtype: torch.dtype) -> Iterator:
    """(name, tensor) of an fp8 or compressed-tensors checkpoint, every weight dequantized."""
    fp8 = quant["quant_method"] == "fp8"
    suffix = "weight_scale_inv" if fp8 else "weight_scale"
    configured = quant.get("weight_block_size") if fp8 else _compressed_tensors_block(quant)
    names = set(tensors.names())
    for name in sorted(names):
        if name.endswith(("weight_scale_inv", "weight_scale", "input_scale")):
            continue  # read with their weight; a static input scale is for FP8 activations
        if name.endswith("weight_zero_point"):
            raise TargetError(f"{name}: asymmetric (zero-point) quantization is not supported")
        tensor = tensors.get(name)
        scale_name = name.removesuffix("weight") + suffix
        if scale_name in names and name.endswith("weight"):
            scale = tensors.get(scale_name)
            block = _scale_block(scale, tensor.shape, configured)
            scale = scale.reshape(1, 1) if scale.numel() == 1 else scale  # per tensor: one block
            tensor = dequantize_fp8(tensor, scale, block=block, dtype=dtype)
        elif tensor.dtype == FP8_DTYPE:
            raise TargetError(f"{name} is float8 but the checkpoint has no {scale_name}")
        yield name, tensor.to(dtype) if tensor.is_floating_point() else tensor


# Where a checkpoint's text decoder layers live (plain, Qwen3.5 / Qwen3-VL wrapper, Gemma 3 wrapper).
_LAYER_NAME = re.compile(
    r"^(?:model\.|model\.language_model\.|language_model\.model\.)layers\.(\d+\..+)\.weight$"
)


def fp8_sources(folder: Path, config: Any) -> dict[str, Any]:
    """An fp8 checkpoint's decoder linears with block scales: module name relative to the
    decoder's `layers` ("0.self_attn.q_proj") -> a loader of (e4m3 [N, K], scale_inv, block),
    read from the files when called (one weight at a time). Per-expert tensors are listed too but
    match no module (transformers fuses experts at load): those requantize from the loaded weight.
    compressed-tensors (other scale names and layouts) gives {}: requantized from its weights."""
    quant = config.quantization_config
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    if quant.get("quant_method") != "fp8":
        return {}
    tensors, configured = _Tensors(folder), quant.get("weight_block_size")
    names = set(tensors.names())

    def load(name: str, scale_name: str):
        weight, scale = tensors.get(name), tensors.get(scale_name).float()
        block = _scale_block(scale, weight.shape, configured)
        return weight, scale.reshape(1, 1) if scale.numel() == 1 else scale, block

    sources = {}
    for name in names:
        scale_name = name.removesuffix("weight") + "weight_scale_inv"
        if (match := _LAYER_NAME.match(name)) and scale_name in names:
            sources[match.group(1)] = lambda n=name, s=scale_name: load(n, s)
    return sources


def read_dequantized(folder: Path, config: Any, *, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The checkpoint's state dict with every quantized weight dequantized to `dtype` (host
    tensors; the model moves to its device afterwards)."""
    quant = config.quantization_config
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    return dict(_fp8_weights(_Tensors(folder), quant, dtype))


def load_dequantized(
    folder: Path, config: Any, *, dtype: torch.dtype, wrapper_keys: dict[str, str]
) -> PreTrainedModel:
    """A quantized checkpoint as a plain model: its weights dequantized on the host and handed
    to transformers as a state dict, with a config without quantization_config (so transformers
    builds plain linears). A wrapper loads as its language model, its tensors renamed by
    `wrapper_keys` (targets/loading.py) and the others (a vision tower) dropped. gpt-oss MXFP4
    goes through transformers' Mxfp4Config(dequantize=True) instead (see the module doc)."""
    if quant_method_of(config) == "mxfp4":  # transformers' own dequantization works here
        return AutoModelForCausalLM.from_pretrained(
            folder,
            dtype=dtype,
            quantization_config=Mxfp4Config(dequantize=True),
            **offline_torch_modules(),
        )
    state = read_dequantized(folder, config, dtype=dtype)
    config = copy.deepcopy(config)
    del config.quantization_config
    text = text_config_of(config)
    if text is not config:
        state = {
            re.sub(pattern, prefix, name): tensor
            for name, tensor in state.items()
            for pattern, prefix in wrapper_keys.items()
            if re.match(pattern, name)
        }
    causal_lm = text_causal_lm_class(text)
    if causal_lm is None:
        raise TargetError(f"a quantized {config.model_type} target has no text CausalLM class")
    return causal_lm.from_pretrained(
        None, config=text, state_dict=state, dtype=dtype, **offline_torch_modules()
    )


def _quantizable(layers: nn.Module) -> Iterator[torch.Tensor]:
    """The decoder's matmul weights that served FP8 checkpoints store in FP8: every linear but
    the MoE routers, and the fused experts' 3-D weights. Embeddings, norms and the lm_head are
    outside the layers (or 1-D) and stay as they are, as in Qwen3-FP8 and DeepSeek-V3."""
    for name, module in layers.named_modules():
        last = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Linear) and last not in _ROUTERS:
            yield module.weight
        elif last == "experts":
            yield from (p for p in module.parameters(recurse=False) if p.ndim == 3)


@torch.no_grad()
def quantize_at_load(layers: nn.Module, *, block: tuple[int, int] = FP8_BLOCK) -> int:
    """DFLASH_TARGET__QUANTIZE=fp8: each decoder weight replaced in place by dequant(quant(W))
    (e4m3, `block` scales), in the compute dtype. Returns how many weights were quantized.
    Runs on the weights' device; no value is read back to the host (no CPU-GPU sync)."""
    count = 0
    for weight in _quantizable(layers):
        fp8, scale = quantize_fp8(weight, block=block)
        weight.copy_(dequantize_fp8(fp8, scale, block=block, dtype=weight.dtype))
        count += 1
    return count
