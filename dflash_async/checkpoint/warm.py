"""Warm starts (DFLASH_DRAFTER__INIT): the drafter weights a new run starts from.

Owns reading those weights, from a servable export (export.py: ours, or z-lab's format written
by another tool) or from a training checkpoint (state.py: the fp32 masters), checking them
against the drafter this run builds, and copying them into a built step.

A warm start is a fine-tune or an extension, not a resume (checkpoint/resume.py): only the
weights are taken; AdamW's moments, the lr schedule (warm-up included), the data cursor and the
generators start afresh, and the run's length and recipe are this run's own. An export holds bf16
tensors, so the fp32 masters start bf16-rounded; a checkpoint gives its fp32 masters exactly.

An export folder written by another tool may hold the frozen tensors the drafter shares with the
target, `embed_tokens.weight` and `lm_head.weight` (z-lab's layout; DeepSpec's
`Qwen3DSparkModel.save_pretrained`), and `model.`-prefixed names. Those two are checked against the
target's shape [vocab, hidden] (a mismatch is refused: it was trained for another target) and
dropped, since this run takes them from its target; every other tensor must be one of this
run's drafter, of its shape (an unexpected name is refused, naming it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from dflash_async.checkpoint.export import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    drafter_config_from_json,
    expected_weight_shapes,
    read_weights,
)
from dflash_async.checkpoint.state import STATE_NAME, load_checkpoint
from dflash_async.errors import SettingsError
from dflash_async.model.drafter_config import DrafterConfig
from dflash_async.model.step import DrafterStep

INIT_VAR = "DFLASH_DRAFTER__INIT"
# the tensors a drafter shares with its target, frozen: another tool's export may hold them
FROZEN_NAMES = ("embed_tokens.weight", "lm_head.weight")

# The drafter fields a warm start must share with this run, in the order they are compared, and
# the setting that changes each one here (the rest come from the target's config.json). The
# shape fields decide the tensors; layer ids, mask token, block size, rope and eps decide what
# the weights mean (which target layers they read, which token they were taught to fill in).
_SAME_FIELDS = {
    "hidden_size": "DFLASH_TARGET__PATH",
    "num_hidden_layers": "DFLASH_DRAFTER__NUM_LAYERS",
    "num_attention_heads": "DFLASH_TARGET__PATH",
    "num_key_value_heads": "DFLASH_TARGET__PATH",
    "head_dim": "DFLASH_TARGET__PATH",
    "intermediate_size": "DFLASH_TARGET__PATH",
    "vocab_size": "DFLASH_TARGET__PATH",
    "num_target_layers": "DFLASH_TARGET__PATH",
    "target_layer_ids": "DFLASH_TARGET__NUM_FEATURES, DFLASH_TARGET__TARGET_LAYER_IDS",
    "mask_token_id": "DFLASH_DRAFTER__MASK_TOKEN_ID",
    "block_size": "DFLASH_TRAIN__BLOCK_SIZE",
    "rope_theta": "DFLASH_TARGET__PATH",
    "rms_norm_eps": "DFLASH_TARGET__PATH",
}
# The run identity's key of the drafter's config (state.run_identity); matched by its start so a
# longer description of the key there does not break warm starts from older checkpoints.
_IDENTITY_DRAFTER_KEY = "drafter shape"

InitKind = Literal["export", "checkpoint"]


@dataclass(frozen=True)
class InitWeights:
    """The weights a run starts from, checked against its drafter, on the CPU as stored."""

    path: Path
    kind: InitKind
    tensors: dict[str, torch.Tensor]  # flat names (export.expected_weight_shapes)

    @property
    def stored_dtype(self) -> str:
        return str(next(iter(self.tensors.values())).dtype).removeprefix("torch.")


def init_kind(path: Path) -> InitKind | None:
    """What `path` holds: a checkpoint folder, an export folder, or neither (None)."""
    if (path / STATE_NAME).is_file():
        return "checkpoint"
    if (path / CONFIG_NAME).is_file() and (path / WEIGHTS_NAME).is_file():
        return "export"
    return None


def init_problem(path: str) -> str | None:
    """What is wrong with DFLASH_DRAFTER__INIT=`path` on this machine, found from the file
    names alone (settings load: no weights read); None when it looks like weights."""
    folder = Path(path)
    if not folder.is_dir():
        return f"the folder {path} does not exist"
    if init_kind(folder) is None:
        return (
            f"{path} is neither a drafter export ({CONFIG_NAME} + {WEIGHTS_NAME}) nor a training "
            f"checkpoint ({STATE_NAME})"
        )
    return None


def read_init_weights(path: Path, config: DrafterConfig) -> InitWeights:
    """The weights at `path` for a drafter of `config` (CPU and files only); SettingsError (exit
    2, one line) naming the first field or tensor that differs, or why the files are unreadable."""
    path = Path(path)
    problem = init_problem(str(path))
    if problem is not None:
        raise SettingsError(f"{INIT_VAR}={path}: {problem}")
    kind = init_kind(path)
    if kind == "export":
        theirs = _read(lambda: _export_config(path), path)
        check_same_drafter(theirs, config, path=path)
        stored = _read(lambda: read_weights(path / WEIGHTS_NAME), path)
        tensors = _without_frozen(stored, config, path=path)
    else:
        state = _read(lambda: load_checkpoint(path), path)
        check_same_drafter(_checkpoint_config(state, path), config, path=path)
        tensors = state["drafter"]  # the fp32 masters; the optimizer state is not used
    _check_tensors(tensors, config, path=path)
    return InitWeights(path, kind, dict(tensors))


def check_same_drafter(theirs: DrafterConfig, ours: DrafterConfig, *, path: Path) -> None:
    """SettingsError naming the first field of `_SAME_FIELDS` where the two drafters differ."""
    for field, setting in _SAME_FIELDS.items():
        found, wanted = getattr(theirs, field), getattr(ours, field)
        if found != wanted:
            raise SettingsError(
                f"{INIT_VAR}={path}: its drafter has {field}={_shown(found)}, this run's has "
                f"{_shown(wanted)} (see {setting}); warm-start from a drafter of this run's shape"
            )


def _shown(value: Any) -> str:
    return repr(list(value)) if isinstance(value, tuple) else repr(value)


def _read(load, path: Path):
    """`load()`, with an unreadable or malformed file as a SettingsError naming `path`."""
    try:
        return load()
    except (OSError, RuntimeError, ValueError, KeyError, TypeError) as e:
        if isinstance(e, SettingsError):
            raise
        raise SettingsError(f"{INIT_VAR}={path}: cannot read it: {e}") from None


def _without_frozen(
    stored: dict[str, torch.Tensor], config: DrafterConfig, *, path: Path
) -> dict[str, torch.Tensor]:
    """An export's tensors by flat name (a `model.` prefix removed), the frozen embedding and
    lm_head checked against the target's shape and dropped (see the module doc)."""
    tensors = {name.removeprefix("model."): t for name, t in stored.items()}
    target_shape = (config.vocab_size, config.hidden_size)
    for name in FROZEN_NAMES:
        if name in tensors and tuple(tensors[name].shape) != target_shape:
            raise SettingsError(
                f"{INIT_VAR}={path}: its frozen {name} has shape {list(tensors[name].shape)}, "
                f"this run's target {list(target_shape)}: it was trained for another target"
            )
    return {name: t for name, t in tensors.items() if name not in FROZEN_NAMES}


def _export_config(path: Path) -> DrafterConfig:
    config_path = path / CONFIG_NAME
    return drafter_config_from_json(json.loads(config_path.read_text()), where=str(config_path))


def _checkpoint_config(state: dict[str, Any], path: Path) -> DrafterConfig:
    """The drafter config a checkpoint was trained with, from its run identity."""
    found = [v for k, v in state["run"].items() if k.startswith(_IDENTITY_DRAFTER_KEY)]
    if len(found) != 1 or not isinstance(found[0], dict):
        raise SettingsError(f"{INIT_VAR}={path}: its run identity holds no drafter config")
    fields = dict(found[0])
    fields["target_layer_ids"] = tuple(fields["target_layer_ids"])  # a list in JSON
    return _read(lambda: DrafterConfig(**fields), path)


def _check_tensors(tensors: dict[str, torch.Tensor], config: DrafterConfig, *, path: Path) -> None:
    """Every name of this run's drafter with its shape, and nothing else (first difference)."""
    expected = expected_weight_shapes(config)
    for name in sorted(expected.keys() | tensors.keys()):
        if name not in tensors:
            raise SettingsError(f"{INIT_VAR}={path}: no tensor {name}")
        if name not in expected:
            raise SettingsError(f"{INIT_VAR}={path}: tensor {name} is not in this run's drafter")
        if tuple(tensors[name].shape) != expected[name]:
            raise SettingsError(
                f"{INIT_VAR}={path}: tensor {name} has shape {list(tensors[name].shape)}, this "
                f"run's drafter {list(expected[name])}"
            )


@torch.no_grad()
def load_init_weights(step: DrafterStep, init: InitWeights) -> int:
    """Copy the weights into `step`'s parameters, cast to their dtype (fp32 masters), and its
    working copies; call on the drafter's own thread before the first step. Returns the number
    of tensors. In place (`copy_`): a captured graph keeps reading the same tensors.

    Sync point (start-up only): each copy from a pageable host tensor to a GPU parameter waits
    for the transfer.
    """
    named = step.objective.drafter.named_parameters()
    params = {name.replace("_orig_mod.", ""): p for name, p in named if p.requires_grad}
    if params.keys() != init.tensors.keys():  # read_init_weights checked the same names
        raise ValueError(f"{init.path}: the drafter's parameters differ from the loaded tensors")
    for name, p in params.items():
        p.copy_(init.tensors[name])
    step.sync_working_weights()
    return len(params)
