"""What the tests of benchmarks/*_check.py share: the check script loaded by its file path (the
benchmarks are no package), a tiny random export of the demo target (ensure_tiny_target) and one
run of a check on it, and purpose-made mutants of an export (rewrite_export).

One place for them, so that every external check is run on exports built the same way.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
from conftest import randomize_
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

from dflash_async.checkpoint.export import export_drafter
from dflash_async.model.drafter_config import drafter_config_from_target
from dflash_async.model.kinds import kind_of
from dflash_async.targets.tiny import tiny_tokenizer

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def check_script(name: str) -> ModuleType:
    """benchmarks/`name`.py, imported from its file."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_export(
    folder: Path,
    out: Path,
    *,
    block_size: int,
    fields: dict,
    sharpen: Callable[[torch.nn.Module], None] | None = None,
) -> Path:
    """A 2-layer random drafter of the tiny target at `folder` (`fields` override its config),
    `sharpen`ed in place before it is exported to `out`."""
    config = drafter_config_from_target(
        Qwen3Config.from_pretrained(folder),
        num_hidden_layers=2,
        num_features=2,
        block_size=block_size,
        mask_token_id=tiny_tokenizer().mask_token_id,
        **fields,
    )
    drafter = kind_of(config.kind).make_drafter(config)
    randomize_(drafter, 2)
    if sharpen is not None:
        with torch.no_grad():
            sharpen(drafter)
    export_drafter(drafter, config, out)
    return out


def check_exit_code(name: str, checkout: tuple[str, str], export: Path, target: Path) -> int:
    """benchmarks/`name`.py's exit code on `export` (2 held-out prompts, 40 new tokens each);
    `checkout`: (its flag, the external checkout's folder)."""
    argv = [*checkout, "--drafter", str(export), "--target", str(target)]
    return check_script(name).main([*argv, "--num-prompts", "2", "--max-new-tokens", "40"])


def rewrite_export(folder: Path, *, config: dict | None = None, drop: str = "", swap=()) -> Path:
    """A purpose-made mutant of the export at `folder`, in place: config fields changed, tensors
    whose names start with `drop` removed, the two names of `swap` exchanged."""
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    tensors = {k: v for k, v in tensors.items() if not (drop and k.startswith(drop))}
    if swap:
        a, b = swap
        tensors[a], tensors[b] = tensors[b], tensors[a]
    save_file(tensors, str(path), metadata={"format": "pt"})
    if config:
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(cfg | config))
    return folder
