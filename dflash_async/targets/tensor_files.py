"""Where each tensor of a safetensors checkpoint lives, for sharded and single-file checkpoints
alike: the lookup of the readers that open tensors one at a time (the frozen embeddings,
targets/embeddings.py; an FP8 checkpoint's weights and scales, targets/quantized.py)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open


def tensor_files(folder: Path) -> dict[str, Path]:
    """tensor name -> safetensors file holding it (sharded or single-file checkpoints)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    names = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            names.update(dict.fromkeys(f.keys(), file))
    return names
