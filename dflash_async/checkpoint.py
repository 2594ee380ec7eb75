"""Checkpoints: the servable drafter export, and the full training state for resume.

Export (docs/DFLASH.md s.7) is what SGLang, vLLM and z-lab's code load: a folder with a Qwen3
`config.json` (architectures ["DFlashDraftModel"], a `dflash_config` with mask_token_id and
target_layer_ids) and a bf16 `model.safetensors` with flat names and no embedding or lm_head.
A wrong config is the quiet failure here (s.6 bug 5: engines refuse to load, or load and read the
wrong target layers), so the config is written field by field from the DrafterConfig and loading
one back validates every field it needs.

Both writers are atomic: they write a temporary sibling, fsync it, then rename it into place, so
no partial checkpoint is ever where a good one was. Every function here copies device tensors to
the host (a CPU-GPU sync point): call them between steps, never inside one.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from dflash_async.log import get_logger
from dflash_async.model.drafter_config import DrafterConfig

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
TRAINING_STATE_FORMAT = "dflash_async.training_state"
TRAINING_STATE_VERSION = 1
_TRAINING_STATE_KEYS = (
    "drafter_state",
    "optimizer_state",
    "step",
    "cursor",
    "rng_state",
    "settings_json",
)


def expected_weight_shapes(config: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name of a drafter (docs/DFLASH.md s.7) and its shape ([out, in] for Linear)."""
    d, hd, ffn = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    layer = {
        "input_layernorm.weight": (d,),
        "self_attn.q_proj.weight": (q, d),
        "self_attn.k_proj.weight": (kv, d),
        "self_attn.v_proj.weight": (kv, d),
        "self_attn.o_proj.weight": (d, q),
        "self_attn.q_norm.weight": (hd,),
        "self_attn.k_norm.weight": (hd,),
        "post_attention_layernorm.weight": (d,),
        "mlp.gate_proj.weight": (ffn, d),
        "mlp.up_proj.weight": (ffn, d),
        "mlp.down_proj.weight": (d, ffn),
    }
    shapes = {
        f"layers.{i}.{name}": shape
        for i in range(config.num_hidden_layers)
        for name, shape in layer.items()
    }
    shapes["fc.weight"] = (d, config.num_features * d)
    shapes["hidden_norm.weight"] = (d,)
    shapes["norm.weight"] = (d,)
    return shapes


def export_config_json(
    config: DrafterConfig, *, max_position_embeddings: int = 40960
) -> dict[str, Any]:
    """The servable config.json contents (a Qwen3Config plus the DFlash fields).

    rope_theta is written both flat (transformers 4, vLLM) and as rope_parameters (transformers
    5); block_size both top-level (docs/DFLASH.md s.7) and inside dflash_config (z-lab's reader).
    max_position_embeddings is the target's (Qwen3: 40960); the drafter does not limit it.
    """
    n = config.num_hidden_layers
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": config.hidden_size,
        "num_hidden_layers": n,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "vocab_size": config.vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": n,
        "layer_types": ["full_attention"] * n,
        "initializer_range": 0.02,
        "use_cache": True,
        "block_size": config.block_size,
        "num_target_layers": config.num_target_layers,
        "dflash_config": {
            "mask_token_id": config.mask_token_id,
            "target_layer_ids": list(config.target_layer_ids),
            "block_size": config.block_size,
        },
        "dtype": "bfloat16",
        "torch_dtype": "bfloat16",
    }


def _drafter_tensors(drafter: nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Named trainable tensors of a module (buffers such as RoPE tables are not exported) or of
    a state dict; torch.compile's `_orig_mod.` prefix is removed."""
    items = drafter.named_parameters() if isinstance(drafter, nn.Module) else drafter.items()
    return {name.replace("_orig_mod.", ""): t for name, t in items}


def _check_names_and_shapes(
    tensors: Mapping[str, torch.Tensor], config: DrafterConfig, where: str
) -> None:
    expected = expected_weight_shapes(config)
    missing = sorted(expected.keys() - tensors.keys())
    if missing:
        raise ValueError(f"{where}: missing drafter tensors {missing}")
    wrong = {
        name: (tuple(tensors[name].shape), shape)
        for name, shape in expected.items()
        if tuple(tensors[name].shape) != shape
    }
    if wrong:
        raise ValueError(f"{where}: tensor shapes (found, expected) differ: {wrong}")


def export_drafter(
    drafter: nn.Module | Mapping[str, torch.Tensor],
    config: DrafterConfig,
    out_dir: Path,
    *,
    max_position_embeddings: int = 40960,
) -> Path:
    """Write the servable export of `drafter` (a module or its state dict) to `out_dir`; return it.

    The tensors must be exactly the names of `expected_weight_shapes(config)`: a missing or
    extra parameter raises (an extra one would be a trained weight the server never loads).
    An existing `out_dir` is replaced only if it is an earlier export (or empty).
    """
    out_dir = Path(out_dir)
    tensors = _drafter_tensors(drafter)
    extra = sorted(tensors.keys() - expected_weight_shapes(config).keys())
    if extra:
        raise ValueError(f"export_drafter: tensors not in the servable format: {extra}")
    _check_names_and_shapes(tensors, config, "export_drafter")
    # Sync point: device -> host copies; fp32 master weights become bf16.
    bf16 = {
        name: t.detach().to(device="cpu", dtype=torch.bfloat16).contiguous()
        for name, t in sorted(tensors.items())
    }
    config_json = export_config_json(config, max_position_embeddings=max_position_embeddings)

    def write(tmp: Path) -> None:
        _write_json(tmp / CONFIG_NAME, config_json)
        save_file(bf16, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        _fsync_path(tmp / WEIGHTS_NAME)

    _write_dir_atomically(out_dir, write, is_replaceable=_is_export_dir)
    get_logger(__name__).info("drafter_exported", path=str(out_dir), tensors=len(bf16))
    return out_dir


def _is_export_dir(path: Path) -> bool:
    names = {p.name for p in path.iterdir()}
    return not names or {CONFIG_NAME, WEIGHTS_NAME} <= names


def load_drafter_export(folder: Path) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    """Read an export (ours or another tool's) into (config, tensors as stored, on the CPU).

    Tolerated: a `model.` name prefix, and extra tensors such as embed_tokens / lm_head, dropped
    with one `drafter_export_keys_dropped` log line. Missing tensors, wrong shapes or missing
    config fields raise ValueError naming them.
    """
    folder = Path(folder)
    config_path, weights_path = folder / CONFIG_NAME, folder / WEIGHTS_NAME
    for path in (config_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(f"drafter export file not found: {path}")
    config = drafter_config_from_json(json.loads(config_path.read_text()), where=str(config_path))
    stored = {name.removeprefix("model."): t for name, t in load_file(str(weights_path)).items()}
    expected = expected_weight_shapes(config)
    dropped = sorted(stored.keys() - expected.keys())
    if dropped:
        get_logger(__name__).info(
            "drafter_export_keys_dropped", path=str(weights_path), dropped=dropped
        )
    tensors = {name: t for name, t in stored.items() if name in expected}
    _check_names_and_shapes(tensors, config, str(weights_path))
    return config, tensors


def drafter_config_from_json(
    cfg: Mapping[str, Any], *, where: str = "config.json"
) -> DrafterConfig:
    """Build a DrafterConfig from a servable config.json's contents (see export_config_json)."""
    dflash = cfg.get("dflash_config") or {}
    required = (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "rms_norm_eps",
        "vocab_size",
        "num_target_layers",
    )
    missing = [k for k in required if k not in cfg]
    missing += [
        f"dflash_config.{k}" for k in ("mask_token_id", "target_layer_ids") if k not in dflash
    ]
    rope_theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta")
    if rope_theta is None:
        missing.append("rope_theta")
    if missing:
        raise ValueError(f"{where}: missing fields {missing}")
    layer_types = cfg.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(f"{where}: only full_attention layers are supported, got {layer_types}")
    heads = cfg["num_attention_heads"]
    return DrafterConfig(
        hidden_size=cfg["hidden_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        intermediate_size=cfg["intermediate_size"],
        rms_norm_eps=float(cfg["rms_norm_eps"]),
        rope_theta=float(rope_theta),
        vocab_size=cfg["vocab_size"],
        num_target_layers=cfg["num_target_layers"],
        target_layer_ids=tuple(dflash["target_layer_ids"]),
        mask_token_id=dflash["mask_token_id"],
        block_size=_block_size(cfg, dflash, where),
    )


def _block_size(cfg: Mapping[str, Any], dflash: Mapping[str, Any], where: str) -> int:
    found = {v for v in (cfg.get("block_size"), dflash.get("block_size")) if v is not None}
    if len(found) > 1:
        raise ValueError(f"{where}: block_size and dflash_config.block_size differ: {found}")
    if not found:
        get_logger(__name__).info("drafter_block_size_defaulted", path=where, block_size=16)
        return 16
    return int(found.pop())


def save_training_state(
    path: Path,
    *,
    drafter_state: Mapping[str, torch.Tensor],
    optimizer_state: Mapping[str, Any],
    step: int,
    cursor: dict[str, Any],
    rng_state: Any,
    settings_json: str,
) -> Path:
    """Save everything a resumed run needs to `path` (torch.save), atomically; return `path`.

    `rng_state` and `cursor` must hold only tensors and plain Python values (dict, list, tuple,
    int, float, str, None): the loader uses weights_only=True and refuses anything else.
    """
    path = Path(path)
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r} must be a non-negative int")
    if not isinstance(cursor, dict):
        raise ValueError(f"cursor must be a dict, got {type(cursor).__name__}")
    json.loads(settings_json)  # raises on a malformed settings snapshot
    payload = {
        "format": TRAINING_STATE_FORMAT,
        "version": TRAINING_STATE_VERSION,
        "drafter_state": dict(drafter_state),
        "optimizer_state": dict(optimizer_state),
        "step": step,
        "cursor": cursor,
        "rng_state": rng_state,
        "settings_json": settings_json,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            torch.save(payload, f)  # sync point: device tensors are copied to the host
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_path(path.parent)
    get_logger(__name__).info("training_state_saved", path=str(path), step=step)
    return path


def load_training_state(path: Path) -> dict[str, Any]:
    """Load a `save_training_state` file onto the CPU: a dict with keys drafter_state,
    optimizer_state, step, cursor, rng_state, settings_json. Optimizer.load_state_dict moves the
    state to the parameters' device."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"training state not found: {path}")
    payload = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(payload, dict) or payload.get("format") != TRAINING_STATE_FORMAT:
        raise ValueError(f"{path} is not a dflash_async training state")
    if payload.get("version") != TRAINING_STATE_VERSION:
        raise ValueError(
            f"{path}: training state version {payload.get('version')!r}, "
            f"this code reads version {TRAINING_STATE_VERSION}"
        )
    missing = [k for k in _TRAINING_STATE_KEYS if k not in payload]
    if missing:
        raise ValueError(f"{path}: training state lacks {missing}")
    return {k: payload[k] for k in _TRAINING_STATE_KEYS}


def _write_json(path: Path, obj: Mapping[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _fsync_path(path: Path) -> None:
    """fsync a file or a folder (a folder's fsync makes renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_dir_atomically(
    out_dir: Path, write: Callable[[Path], None], *, is_replaceable: Callable[[Path], bool]
) -> None:
    """Run `write` into a temporary sibling of `out_dir`, then move it to `out_dir`.

    A folder cannot be renamed over a non-empty one, so an old `out_dir` is first renamed aside
    (`.NAME.old-*`) and deleted after the new one is in place. A crash between the two renames
    leaves no folder at `out_dir`, but the old checkpoint intact beside it; never a partial one.
    """
    if out_dir.exists() and not (out_dir.is_dir() and is_replaceable(out_dir)):
        raise ValueError(f"refusing to replace {out_dir}: it is not an earlier checkpoint")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{tag}")
    old = out_dir.with_name(f".{out_dir.name}.old-{tag}")
    tmp.mkdir()
    try:
        write(tmp)
        _fsync_path(tmp)
        if out_dir.exists():
            out_dir.rename(old)
        tmp.rename(out_dir)
        _fsync_path(out_dir.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
