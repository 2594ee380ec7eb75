"""Test-side quantized checkpoints: a tiny target's weights quantized here, by code written apart
from targets/quantized.py (explicit loops over blocks and groups), into the files a served FP8 or
MXFP4 checkpoint has, and the same weights dequantized into a plain fp32 reference folder.

- `fp8`: `X.weight` float8_e4m3fn + `X.weight_scale_inv` [ceil(R/b0), ceil(C/b1)] fp32,
  quantization_config {quant_method: fp8, weight_block_size: block}.
- `compressed-tensors`: `X.weight` fp8 + `X.weight_scale` per output channel [R, 1] (strategy
  channel) or per block (strategy block), format float-quantized.
- `mxfp4` (gpt-oss experts): `X_blocks` [E, out, G, 16] uint8 and `X_scales` [E, out, G] uint8.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

E4M3_MAX = 448.0
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes of codes 0..7; bit 3 is the sign
LINEAR = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.weight$")
EXPERTS = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)$")


def block_skewed(weight: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """`weight` with block (i, j) scaled by 2^((3i + j) % 5 - 2): neighbouring blocks differ by
    at least 2x, so a scale read from the wrong block (transposed, shifted) is off by >= 50%."""
    out = weight.clone()
    for i in range(math.ceil(weight.shape[0] / block[0])):
        for j in range(math.ceil(weight.shape[1] / block[1])):
            rows, cols = (
                slice(i * block[0], (i + 1) * block[0]),
                slice(j * block[1], (j + 1) * block[1]),
            )
            out[rows, cols] *= 2.0 ** ((3 * i + j) % 5 - 2)
    return out


def fp8_blocks(weight: torch.Tensor, block: tuple[int, int]):
    """(fp8, scale [gr, gc], dequantized fp32), one block at a time: scale = amax / 448."""
    rows, cols = weight.shape
    grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    fp8 = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scale = torch.ones(grid)
    deq = torch.empty(rows, cols)
    for i in range(grid[0]):
        for j in range(grid[1]):
            r, c = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            amax = float(weight[r, c].abs().max())
            scale[i, j] = amax / E4M3_MAX if amax > 0 else 1.0
            fp8[r, c] = (weight[r, c].float() / scale[i, j]).to(torch.float8_e4m3fn)
            deq[r, c] = fp8[r, c].float() * scale[i, j]
    return fp8, scale, deq


def mxfp4_rows(rows: torch.Tensor):
    """[R, K] -> (blocks [R, K/32, 16] uint8, scales [R, K/32] uint8, dequantized [R, K]): per 32
    values the OCP MX exponent floor(log2 amax) - 2 (e2m1's largest exponent), each value the
    nearest e2m1 code of x / 2^e (clamped to +-6)."""
    n_rows, k = rows.shape
    magnitudes = torch.tensor(E2M1)
    blocks = torch.zeros(n_rows, k // 32, 16, dtype=torch.uint8)
    scales = torch.zeros(n_rows, k // 32, dtype=torch.uint8)
    deq = torch.zeros(n_rows, k)
    for r in range(n_rows):
        for g in range(k // 32):
            values = rows[r, g * 32 : (g + 1) * 32].float()
            amax = float(values.abs().max())
            e = (math.floor(math.log2(amax)) - 2) if amax > 0 else 0
            scaled = (values / 2.0**e).clamp(-6, 6)
            codes = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(-1)
            codes = codes + 8 * (scaled < 0).long()
            blocks[r, g] = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8)
            scales[r, g] = e + 127
            signs = torch.where(codes >= 8, -1.0, 1.0)
            deq[r, g * 32 : (g + 1) * 32] = signs * magnitudes[codes % 8] * 2.0**e
    return blocks, scales, deq


def _write(folder: Path, source: Path, state: dict, quantization: dict | None) -> Path:
    shutil.copytree(source, folder, ignore=shutil.ignore_patterns("*.safetensors*"))
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config", None)
    if quantization is not None:
        config["quantization_config"] = quantization
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def fp8_checkpoint(
    source: Path, root: Path, *, method: str = "fp8", block: tuple[int, int] = (32, 32)
) -> tuple[Path, Path]:
    """(the quantized folder, its dequantized fp32 reference) of the unquantized `source`.
    method: fp8 | compressed-tensors-channel | compressed-tensors-block."""
    state = load_file(str(source / "model.safetensors"))
    quantized, reference = {}, {}
    channel = method == "compressed-tensors-channel"
    for name, tensor in state.items():
        if not LINEAR.match(name):
            quantized[name] = reference[name] = tensor
            continue
        grid = (1, tensor.shape[1]) if channel else block
        fp8, scale, deq = fp8_blocks(block_skewed(tensor, grid), grid)
        suffix = "weight_scale_inv" if method == "fp8" else "weight_scale"
        quantized[name], quantized[name.removesuffix("weight") + suffix] = fp8, scale
        reference[name] = deq
    if method == "fp8":
        config = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(block),
        }
    else:
        weights = {
            "num_bits": 8,
            "type": "float",
            "symmetric": True,
            "strategy": "channel" if channel else "block",
        }
        if not channel:
            weights["block_structure"] = list(block)
        config = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
            "ignore": ["lm_head"],
        }
    return (
        _write(root / method, source, quantized, config),
        _write(root / f"{method}-reference", source, reference, None),
    )


def mxfp4_checkpoint(source: Path, root: Path) -> tuple[Path, Path]:
    """(a gpt-oss MXFP4 folder, its dequantized fp32 reference): the experts' [E, in, out]
    weights as gpt-oss publishes them, [E, out, in/32, 16] blocks and [E, out, in/32] scales."""
    state = load_file(str(source / "model.safetensors"))
    quantized, reference = {}, {}
    for name, tensor in state.items():
        if not EXPERTS.match(name):
            quantized[name] = reference[name] = tensor
            continue
        parts = [mxfp4_rows(expert.T) for expert in tensor]  # rows: out, groups along in
        quantized[name + "_blocks"] = torch.stack([p[0] for p in parts])
        quantized[name + "_scales"] = torch.stack([p[1] for p in parts])
        reference[name] = torch.stack([p[2].T for p in parts])
    config = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    return (
        _write(root / "mxfp4", source, quantized, config),
        _write(root / "mxfp4-reference", source, reference, None),
    )
