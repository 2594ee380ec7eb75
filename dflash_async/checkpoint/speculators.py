"""The vLLM speculators convention of a DSpark export (docs/DFLASH.md s.11, "The speculators
export"): writing it from our drafter and reading it back.

This module owns that convention alone: the config.json that speculators' `DSparkSpeculatorConfig`
validates (the kind's `speculators_model_type`, a Qwen3 `transformer_layer_config`, the heads'
fields and a `speculators_config` naming the verifier), the map between its fields and a
DrafterConfig, and the refusals of what it cannot express. The default export
(checkpoint/export.py, `Qwen3DSparkModel`) is unchanged; checkpoint/formats.py selects between
the two.

What differs from the default export, and why each is exact:
- slots: `sample_from_anchor: true` with `block_size` = B (B drafts, the anchor's slot predicts
  the next token, slot k's Markov input is the token at anchor + k), which is our block. The
  older convention (`sample_from_anchor: false`, a block of B+1 whose anchor slot drafts nothing)
  runs the layers on a different block and is refused on reading, never converted;
- target layers: speculators counts the layer whose *input* it captures
  (`aux_hidden_state_layer_ids` = our `target_layer_ids` + 1, the hidden state after layer i);
- vocabulary: the full target vocabulary (`draft_vocab_size` = `vocab_size`), so neither `t2d`
  nor `d2t` is written, and neither is `embed_tokens` or `lm_head`: speculators takes both from
  the verifier, as it does for a full-vocabulary draft;
- tensors: the same names and values as the default export (speculators' DSpark model names its
  backbone, `markov_head.*` and `confidence_head.proj.*` as we do), bf16.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from dflash_async.atomic import atomic_directory
from dflash_async.checkpoint.export import (
    CONFIG_NAME,
    TRANSFORM_DEFAULTS,
    WEIGHTS_NAME,
    check_names_and_shapes,
    drafter_tensors,
    expected_weight_shapes,
    qwen3_layer_fields,
    read_weights,
)
from dflash_async.log import get_logger
from dflash_async.model.drafter_config import DrafterConfig
from dflash_async.model.kinds import KINDS
from dflash_async.model.layer_rules import FULL_ATTENTION, layer_types_of


def speculators_types() -> dict[str, tuple[str, str]]:
    """Our kind -> (speculators_model_type, the architecture its config names), for the kinds
    whose weights a speculators model loads exactly (model/kinds/, `speculators_model`)."""
    return {name: k.speculators_model for name, k in KINDS.items() if k.speculators_model}


SPECULATORS_VERSION = "0.9.0"  # the release whose DSparkSpeculatorConfig this follows


def check_exportable(config: DrafterConfig) -> None:
    """ValueError naming what the speculators convention cannot carry exactly: a kind without a
    speculators model here, sliding or causal layers, an embedding scale."""
    if config.kind not in speculators_types():
        raise ValueError(
            f"no speculators format for a {config.kind!r} drafter (only "
            f"{', '.join(speculators_types())}): serve its default export, or convert that with "
            "speculators' own converter"
        )
    types = set(layer_types_of(config.layer_types, config.num_hidden_layers))
    if types != {FULL_ATTENTION} or config.is_causal is not None:
        raise ValueError(
            "the speculators export takes full bidirectional attention layers only "
            f"(layer_types={sorted(types)}, is_causal={config.is_causal})"
        )
    changed = [n for n, unset in TRANSFORM_DEFAULTS.items() if getattr(config, n) != unset]
    if changed:
        raise ValueError(f"the speculators export has no field for {changed}")


def speculators_config_json(
    config: DrafterConfig,
    *,
    verifier: str | None,
    verifier_architectures: list[str] | tuple[str, ...] = (),
    max_position_embeddings: int = 40960,
) -> dict[str, Any]:
    """The config.json of the speculators convention (see the module doc) for `config`;
    `verifier`: the target's Hugging Face id or path (vLLM serves it as the target, speculators
    loads its embedding, lm_head and final norm from there; None: name none)."""
    check_exportable(config)
    model_type, architecture = speculators_types()[config.kind]
    layer = {
        "model_type": "qwen3",
        **qwen3_layer_fields(config, max_position_embeddings=max_position_embeddings),
    }
    return {
        "speculators_model_type": model_type,
        "speculators_version": SPECULATORS_VERSION,
        "architectures": [architecture],
        "transformer_layer_config": layer,
        "draft_vocab_size": config.vocab_size,
        "block_size": config.block_size,
        "sample_from_anchor": True,
        "aux_hidden_state_layer_ids": [i + 1 for i in config.target_layer_ids],
        "target_hidden_size": None,
        "mask_token_id": config.mask_token_id,
        "sliding_window_non_causal": False,
        "markov_rank": config.markov_rank,
        "markov_head_type": config.markov_head_type,
        "enable_confidence_head": config.confidence_head,
        "confidence_head_with_markov": config.confidence_head_with_markov,
        "num_target_layers": config.num_target_layers,  # ours: speculators keeps extra fields
        "speculators_config": {
            "algorithm": model_type,
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": config.block_size,  # every slot drafts
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
        "dtype": "bfloat16",
        "torch_dtype": "bfloat16",
    }


def export_speculators(
    drafter: nn.Module | Mapping[str, torch.Tensor],
    config: DrafterConfig,
    out_dir: Path,
    *,
    verifier: str | None,
    verifier_architectures: list[str] | tuple[str, ...] = (),
) -> Path:
    """Write `drafter` (a module or its state dict, exactly the tensors of
    `expected_weight_shapes(config)`) in the speculators convention to `out_dir`; return it.
    An existing `out_dir` is replaced only if it is an earlier export (or empty)."""
    out_dir = Path(out_dir)
    config_json = speculators_config_json(
        config, verifier=verifier, verifier_architectures=verifier_architectures
    )
    tensors = drafter_tensors(drafter)
    extra = sorted(tensors.keys() - expected_weight_shapes(config).keys())
    if extra:
        raise ValueError(f"export_speculators: tensors not in the format: {extra}")
    check_names_and_shapes(tensors, config, "export_speculators")
    bf16 = {  # sync point for device tensors: device -> host copies
        name: t.detach().to(device="cpu", dtype=torch.bfloat16).contiguous()
        for name, t in sorted(tensors.items())
    }
    with atomic_directory(out_dir, replaceable=_is_export_dir) as tmp:
        (tmp / CONFIG_NAME).write_text(json.dumps(config_json, indent=2) + "\n")
        save_file(bf16, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
    get_logger(__name__).info("speculators_exported", path=str(out_dir), tensors=len(bf16))
    return out_dir


def _is_export_dir(path: Path) -> bool:
    names = {p.name for p in path.iterdir()}
    return not names or {CONFIG_NAME, WEIGHTS_NAME} <= names


def is_speculators_config(cfg: Mapping[str, Any]) -> bool:
    """Whether a config.json's contents are in the speculators convention."""
    return "speculators_model_type" in cfg


def drafter_config_from_speculators(
    cfg: Mapping[str, Any], *, where: str = "config.json"
) -> DrafterConfig:
    """The DrafterConfig of a speculators-convention config.json (the inverse of
    speculators_config_json). ValueError for another model type, the B+1 slot convention
    (`sample_from_anchor` false), a reduced draft vocabulary, or a missing field."""
    known = {spec: kind for kind, (spec, _) in speculators_types().items()}
    model_type = cfg.get("speculators_model_type")
    if model_type not in known:
        raise ValueError(f"{where}: speculators_model_type {model_type!r} is not {sorted(known)}")
    if cfg.get("sample_from_anchor", True) is not True:
        raise ValueError(
            f"{where}: sample_from_anchor is false (a block of B+1 whose anchor slot drafts "
            "nothing): not the anchor-first slots of this project's DSpark drafter"
        )
    required = ("transformer_layer_config", "block_size", "aux_hidden_state_layer_ids")
    required += ("mask_token_id", "num_target_layers", "markov_rank", "draft_vocab_size")
    missing = [k for k in required if cfg.get(k) is None]
    if missing:
        raise ValueError(f"{where}: missing fields {missing}")
    layer = cfg["transformer_layer_config"]
    if cfg["draft_vocab_size"] != layer.get("vocab_size"):
        raise ValueError(
            f"{where}: draft_vocab_size {cfg['draft_vocab_size']} is a reduced vocabulary "
            f"(the target's is {layer.get('vocab_size')}): not a drafter of this project"
        )
    rope = layer.get("rope_theta") or (layer.get("rope_parameters") or {}).get("rope_theta")
    heads = layer["num_attention_heads"]
    return DrafterConfig(
        kind=known[model_type],
        hidden_size=layer["hidden_size"],
        num_hidden_layers=layer["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=layer.get("num_key_value_heads") or heads,
        head_dim=layer.get("head_dim") or layer["hidden_size"] // heads,
        intermediate_size=layer["intermediate_size"],
        rms_norm_eps=float(layer["rms_norm_eps"]),
        rope_theta=float(rope),
        vocab_size=layer["vocab_size"],
        num_target_layers=cfg["num_target_layers"],
        target_layer_ids=tuple(i - 1 for i in cfg["aux_hidden_state_layer_ids"]),
        mask_token_id=cfg["mask_token_id"],
        block_size=int(cfg["block_size"]),
        markov_rank=int(cfg["markov_rank"]),
        markov_head_type=str(cfg.get("markov_head_type", "vanilla")),
        confidence_head=bool(cfg.get("enable_confidence_head", False)),
        confidence_head_with_markov=bool(cfg.get("confidence_head_with_markov", False)),
    )


def load_speculators_export(folder: Path) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    """Read a speculators-convention export into (config, tensors as stored, on the CPU).
    Tolerated: `embed_tokens`, `lm_head`, `verifier_*` (the verifier's, dropped: ours come from
    the target). Any other extra tensor, a missing one or a wrong shape raises ValueError."""
    folder = Path(folder)
    config_path, weights_path = folder / CONFIG_NAME, folder / WEIGHTS_NAME
    for path in (config_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(f"speculators export file not found: {path}")
    config = drafter_config_from_speculators(
        json.loads(config_path.read_text()), where=str(config_path)
    )
    stored = read_weights(weights_path)
    frozen = {"embed_tokens.weight", "lm_head.weight"}
    frozen |= {n for n in stored if n.startswith("verifier_")}
    unknown = sorted(stored.keys() - expected_weight_shapes(config).keys() - frozen)
    if unknown:
        raise ValueError(f"{weights_path}: tensors not in the format: {unknown}")
    tensors = {name: t for name, t in stored.items() if name not in frozen}
    check_names_and_shapes(tensors, config, str(weights_path))
    return config, tensors
