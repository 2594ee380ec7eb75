"""The servable drafter export (the training state for resume is checkpoint/state.py).

Export (docs/DFLASH.md s.7) is what SGLang, vLLM and z-lab's code load: a folder with a Qwen3
`config.json` (architectures ["DFlashDraftModel"], a `dflash_config` with mask_token_id and
target_layer_ids) and a bf16 `model.safetensors` with flat names and no embedding or lm_head.
Each drafter kind (model/kinds/) names its architecture (["DFlash2DraftModel"] for DFlash2, s.9)
and adds its own fields to `dflash_config` and its own tensors (DFlash2: convolutions, selector).
The drafter variants (s.10) are written where z-lab's reader looks for them: `layer_types`,
`sliding_window`, `use_sliding_window` and `is_causal` at the top level, `output_multiplier`,
`final_logit_softcapping` and `input_embedding_scale` in `dflash_config` (only when set).
A wrong config is the quiet failure here (s.6 bug 5: engines refuse to load, or load and read the
wrong target layers), so the config is written field by field from the DrafterConfig and loading
one back validates every field it needs.

The export is written atomically (atomic.py): no partial export is ever where a good one was.
Exporting a module copies device tensors to the host (a CPU-GPU sync point): call it between
steps, never inside one, or export a host copy of the state dict from another thread.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from dflash_async.atomic import atomic_directory
from dflash_async.log import get_logger
from dflash_async.model.drafter_config import DrafterConfig
from dflash_async.model.kinds import KINDS, kind_of
from dflash_async.model.layer_rules import SLIDING_ATTENTION, layer_types_of

# dflash_config's logit and embedding fields (docs/DFLASH.md s.10) and their "unset" values
TRANSFORM_DEFAULTS = {
    "output_multiplier": 1.0,
    "final_logit_softcapping": None,
    "input_embedding_scale": 1.0,
}

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


def expected_weight_shapes(config: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name of a drafter (docs/DFLASH.md s.7) and its shape ([out, in] for Linear),
    its kind's own tensors included."""
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
    return shapes | kind_of(config.kind).weight_shapes(config)


def export_config_json(
    config: DrafterConfig, *, max_position_embeddings: int = 40960
) -> dict[str, Any]:
    """The servable config.json contents (a Qwen3Config plus the DFlash fields and the kind's).

    rope_theta is written both flat (transformers 4, vLLM) and as rope_parameters (transformers
    5); block_size both top-level (docs/DFLASH.md s.7) and inside dflash_config (z-lab's reader).
    max_position_embeddings is the target's (Qwen3: 40960); the drafter does not limit it.
    """
    kind = kind_of(config.kind)
    dflash_config = {
        "mask_token_id": config.mask_token_id,
        "target_layer_ids": list(config.target_layer_ids),
        "block_size": config.block_size,
    }
    dflash_config |= kind.export_fields(config)
    dflash_config |= {
        name: getattr(config, name)
        for name, unset in TRANSFORM_DEFAULTS.items()
        if getattr(config, name) != unset
    }
    return {
        "architectures": [kind.architecture],
        "model_type": kind.model_type,
        **qwen3_layer_fields(config, max_position_embeddings=max_position_embeddings),
        "initializer_range": 0.02,
        "use_cache": True,
        "block_size": config.block_size,
        "num_target_layers": config.num_target_layers,
        **kind.top_level_fields(config),
        "dflash_config": dflash_config,
        "dtype": "bfloat16",
        "torch_dtype": "bfloat16",
    }


def qwen3_layer_fields(config: DrafterConfig, *, max_position_embeddings: int) -> dict[str, Any]:
    """The Qwen3Config fields of the drafter's layers (every export format writes them): sizes,
    norm, RoPE, vocabulary and the attention layout (`_layer_fields`)."""
    return {
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
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
        **_layer_fields(config),
    }


def _layer_fields(config: DrafterConfig) -> dict[str, Any]:
    """The top-level attention-layout fields: per-layer types, the window, the in-block rule
    (`is_causal` only when it overrides the per-layer default)."""
    types = list(layer_types_of(config.layer_types, config.num_hidden_layers))
    sliding = SLIDING_ATTENTION in types
    fields = {
        "use_sliding_window": sliding,
        "sliding_window": config.sliding_window if sliding else None,
        "max_window_layers": config.num_hidden_layers,
        "layer_types": types,
    }
    if config.is_causal is not None:
        fields["is_causal"] = config.is_causal
    return fields


def drafter_tensors(drafter: nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Named trainable tensors of a module (buffers such as RoPE tables are not exported) or of
    a state dict; torch.compile's `_orig_mod.` prefix is removed."""
    items = drafter.named_parameters() if isinstance(drafter, nn.Module) else drafter.items()
    return {name.replace("_orig_mod.", ""): t for name, t in items}


def check_names_and_shapes(
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


def export_bytes(config: DrafterConfig) -> int:
    """Estimated bytes of the export of a drafter of `config`: its bf16 tensors, plus a bound on
    the safetensors header and config.json."""
    shapes = expected_weight_shapes(config).values()
    return sum(2 * math.prod(shape) for shape in shapes) + 256 * len(shapes) + (64 << 10)


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
    tensors = drafter_tensors(drafter)
    extra = sorted(tensors.keys() - expected_weight_shapes(config).keys())
    if extra:
        raise ValueError(f"export_drafter: tensors not in the servable format: {extra}")
    check_names_and_shapes(tensors, config, "export_drafter")
    # Sync point: device -> host copies; fp32 master weights become bf16.
    bf16 = {
        name: t.detach().to(device="cpu", dtype=torch.bfloat16).contiguous()
        for name, t in sorted(tensors.items())
    }
    config_json = export_config_json(config, max_position_embeddings=max_position_embeddings)

    with atomic_directory(out_dir, replaceable=_is_export_dir) as tmp:
        (tmp / CONFIG_NAME).write_text(json.dumps(config_json, indent=2) + "\n")
        save_file(bf16, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
    get_logger(__name__).info("drafter_exported", path=str(out_dir), tensors=len(bf16))
    return out_dir


def _is_export_dir(path: Path) -> bool:
    names = {p.name for p in path.iterdir()}
    return not names or {CONFIG_NAME, WEIGHTS_NAME} <= names


def load_drafter_export(folder: Path) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    """Read an export (ours or another tool's) into (config, tensors as stored, on the CPU).

    Tolerated: a `model.` name prefix, and extra tensors such as embed_tokens / lm_head, dropped
    with one `drafter_export_keys_dropped` log line. Missing tensors, wrong shapes, missing
    config fields or an unreadable (truncated, corrupt) weights file raise ValueError naming them.
    """
    folder = Path(folder)
    config_path, weights_path = folder / CONFIG_NAME, folder / WEIGHTS_NAME
    for path in (config_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(f"drafter export file not found: {path}")
    cfg = json.loads(config_path.read_text())
    if "speculators_model_type" in cfg:  # checkpoint/speculators.py's convention, not this one
        raise ValueError(
            f"{config_path}: a vLLM speculators export; read the default export it was made from"
        )
    config = drafter_config_from_json(cfg, where=str(config_path))
    stored = {name.removeprefix("model."): t for name, t in read_weights(weights_path).items()}
    expected = expected_weight_shapes(config)
    dropped = sorted(stored.keys() - expected.keys())
    if dropped:
        get_logger(__name__).info(
            "drafter_export_keys_dropped", path=str(weights_path), dropped=dropped
        )
    tensors = {name: t for name, t in stored.items() if name in expected}
    check_names_and_shapes(tensors, config, str(weights_path))
    return config, tensors


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file; ValueError naming it if it is truncated or not
    safetensors at all (SafetensorError is no ValueError: callers treat a bad export as bad input)."""
    try:
        return load_file(str(path))
    except SafetensorError as error:
        raise ValueError(f"{path}: not a readable safetensors file ({error})") from error


def drafter_config_from_json(
    cfg: Mapping[str, Any], *, where: str = "config.json"
) -> DrafterConfig:
    """Build a DrafterConfig from a servable config.json's contents (see export_config_json).
    A config without `dflash_config` that names mask_token_id and target_layer_ids at the top
    level (DeepSpec's Qwen3DSparkModel convention) is read from there."""
    dflash = cfg.get("dflash_config") or {}
    if "dflash_config" not in cfg and {"mask_token_id", "target_layer_ids"} <= cfg.keys():
        dflash = cfg
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
        **_variant_fields(cfg, dflash, where),
        **_layout_and_transforms(cfg, dflash),
    )


def _layout_and_transforms(cfg: Mapping[str, Any], dflash: Mapping[str, Any]) -> dict:
    """The s.10 variant fields of a config.json (as export_config_json writes them; z-lab's
    reader takes the dflash_config ones from the top level too). All-full layer_types read as
    () so that a default drafter's config equals the one it was exported from."""
    types = tuple(cfg.get("layer_types") or ())
    sliding = SLIDING_ATTENTION in types
    values: dict[str, Any] = {
        "layer_types": types if sliding or len(set(types)) > 1 else (),
        "sliding_window": cfg.get("sliding_window") if sliding else None,
        "is_causal": cfg.get("is_causal"),
    }
    for name, unset in TRANSFORM_DEFAULTS.items():
        value = dflash.get(name, cfg.get(name, unset))
        values[name] = unset if value is None else float(value)
    if values["final_logit_softcapping"] is not None and values["final_logit_softcapping"] <= 0:
        values["final_logit_softcapping"] = None  # z-lab's reader: a cap <= 0 is no cap
    return values


def _variant_fields(cfg: Mapping[str, Any], dflash: Mapping[str, Any], where: str) -> dict:
    """kind from `architectures` (the default kind when none is known) and its dflash_config
    fields (model/kinds/)."""
    named = cfg.get("architectures") or []
    kinds = sorted(name for name, kind in KINDS.items() if kind.architecture in named)
    if len(kinds) > 1:
        raise ValueError(f"{where}: architectures name both {kinds}")
    if not kinds:
        return {}
    return {"kind": kinds[0], **kind_of(kinds[0]).fields_from_export(dflash, where)}


def _block_size(cfg: Mapping[str, Any], dflash: Mapping[str, Any], where: str) -> int:
    found = {v for v in (cfg.get("block_size"), dflash.get("block_size")) if v is not None}
    if len(found) > 1:
        raise ValueError(f"{where}: block_size and dflash_config.block_size differ: {found}")
    if not found:
        get_logger(__name__).info("drafter_block_size_defaulted", path=where, block_size=16)
        return 16
    return int(found.pop())
