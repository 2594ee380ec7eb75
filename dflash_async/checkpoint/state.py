"""The training state: everything a run needs to continue bit for bit where it stopped.

A checkpoint is a folder OUTPUT_DIR/checkpoints/step-NNNNNNNN (written atomically, atomic.py)
holding `training_state.pt` (torch.save, read back with weights_only=True) and `run.json` (the
run identity and position again, for people). The state holds:
  drafter    every trainable parameter in its training dtype (the fp32 masters), by name
  optimizer  AdamW's per-parameter state (exp_avg, exp_avg_sq, step), in parameter order
  step       optimizer steps done, which is also the lr schedule's position
  cursor     the next pack: epoch, index in that epoch's plan, and the plan's seed
  rng        each drafter's anchor-noise generator (one per device) and torch's CPU generator
  run        the settings that define the run (`run_identity`, the world size included), compared
             on resume
  ranks      several ranks only: every rank's own cursor and generators, by rank (rank 0's are
             `cursor` and `rng` again; checkpoint/ranks.py says why they are saved, not derived)

`snapshot` runs on drafter 0's thread (the device-to-host copy into reused page-locked buffers,
`HostStaging`, a sync point, between steps);
`write_checkpoint` on any thread (serialise, fsync, rename, prune); `restore` on each drafter's
thread after capture, in place, so that captured graphs keep pointing at the same tensors.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_async.atomic import atomic_directory, remove_directory
from dflash_async.data.packing import PackCursor
from dflash_async.errors import SettingsError
from dflash_async.model.kinds import DEFAULT_KIND, kind_of
from dflash_async.model.step import DrafterStep

FORMAT = "dflash_async.training_state"
VERSION = 2
CHECKPOINTS = "checkpoints"
STATE_NAME = "training_state.pt"
RUN_NAME = "run.json"
_KEYS = ("step", "drafter", "optimizer", "cursor", "rng", "run")
_FOLDER = re.compile(r"step-(\d{8,})")


def checkpoint_dir(output_dir: Path, step: int) -> Path:
    return Path(output_dir) / CHECKPOINTS / f"step-{step:08d}"


def list_checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint under `output_dir`, oldest first. Hidden
    temporaries of a writer that was killed are not checkpoints and are never listed."""
    root = Path(output_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for folder in root.iterdir():
        match = _FOLDER.fullmatch(folder.name)
        if match and (folder / STATE_NAME).is_file():
            found.append((int(match.group(1)), folder))
    return sorted(found)


def data_fingerprint(
    tokens: np.ndarray, loss_mask: np.ndarray, offsets: np.ndarray, *, max_read: int = 1 << 24
) -> str:
    """blake2b of the tokenized samples the run trains on (data files, tokenizer and data options
    all land here): every sample boundary, and an even sample of at most `max_read` tokens and
    mask values (hashing 500M tokens in full would add seconds to every start)."""
    digest = hashlib.blake2b(digest_size=16)
    stride = max(1, -(-len(tokens) // max_read))
    for array in (offsets, tokens[::stride], loss_mask[::stride]):
        digest.update(np.ascontiguousarray(array).view(np.uint8).data)
    return digest.hexdigest()


# The run identity's key for the number of ranks (`check_run_identity` words its refusal).
WORLD_SIZE_KEY = "ranks (WORLD_SIZE of torchrun, SLURM_NTASKS of srun)"
FP8_MATMULS_KEY = "DFLASH_TRAIN__FP8_MATMULS"
# A key recorded later than the first checkpoints, and its value for those that lack it.
_BEFORE_RECORDED = {WORLD_SIZE_KEY: 1, FP8_MATMULS_KEY: False}


def run_identity(
    recipe: Any, drafter_config: Any, *, target_path: str, data: str, world_size: int = 1
) -> dict:
    """The settings that define a run, keyed by the setting a user changes to alter each one.

    `recipe`: the step's spec (model/build.StepSpec). A resumed run must match every value: each
    changes the weights a step produces (the shapes, the objective, the schedule, the data
    order). `plan_identity` adds what is known only once the workers are placed.
    """
    config_json = Path(target_path) / "config.json"
    target = (
        hashlib.sha256(config_json.read_bytes()).hexdigest()[:16] if config_json.is_file() else ""
    )
    identity = {
        "DFLASH_TARGET__PATH (config.json sha256)": target,
        "drafter shape (DFLASH_DRAFTER__*, DFLASH_TARGET__NUM_FEATURES, ...)": drafter_config.identity(),
        "DFLASH_DATA__PATH (tokenized data blake2b)": data,
        "DFLASH_TRAIN__TOKEN_BUDGET": recipe.token_budget,
        "DFLASH_TRAIN__NUM_ANCHORS": recipe.num_anchors,
        "DFLASH_TRAIN__BLOCK_SIZE": drafter_config.block_size,
        "DFLASH_TRAIN__GAMMA": recipe.gamma,
        "DFLASH_TRAIN__SEED": recipe.seed,
        "DFLASH_TRAIN__LR": recipe.lr,
        "DFLASH_TRAIN__WARMUP_FRAC": recipe.warmup_frac,
        "DFLASH_TRAIN__WEIGHT_DECAY": recipe.weight_decay,
        "DFLASH_TRAIN__GRAD_CLIP": recipe.grad_clip,
        FP8_MATMULS_KEY: getattr(recipe, "fp8_matmuls", False),  # the linears' numerics
        WORLD_SIZE_KEY: world_size,  # each rank's share of the data, its cursor, depend on it
    }
    # the kind's own keys (model/kinds/): none for DFlash, whose identity is the one from before
    # other kinds existed, so that its older checkpoints still resume
    identity |= kind_of(getattr(recipe, "kind", DEFAULT_KIND)).run_identity(recipe)
    return json.loads(json.dumps(identity))  # tuples become lists, as they come back from disk


def plan_identity(*, total_steps: int, num_drafters: int) -> dict:
    """The run-defining facts of the placed run: the schedule's length and packs per step."""
    return {
        "total steps (DFLASH_TRAIN__MAX_STEPS, DFLASH_TRAIN__EPOCHS)": total_steps,
        "drafter workers (DFLASH_PIPELINE__LAYOUT, __DEVICES, __DRAFTER_DEVICES)": num_drafters,
    }


def check_run_identity(saved: dict[str, Any], current: dict[str, Any], where: Path) -> None:
    """SettingsError (exit 2, one line) naming the first run-defining setting that differs. A
    checkpoint written before the world size was recorded is taken as one rank's, one written
    before DFLASH_TRAIN__FP8_MATMULS was as a bf16 run's (the setting did not exist)."""
    saved = _BEFORE_RECORDED | saved
    if saved[WORLD_SIZE_KEY] != current.get(WORLD_SIZE_KEY, 1):
        raise SettingsError(
            f"{WORLD_SIZE_KEY}: this run has {current.get(WORLD_SIZE_KEY, 1)} rank(s), the "
            f"checkpoint {where} was written by {saved[WORLD_SIZE_KEY]}; resuming on another "
            "number of ranks is not supported (each rank's data share and cursor depend on it): "
            f"resume it with {saved[WORLD_SIZE_KEY]} rank(s), or start afresh in another "
            "DFLASH_OUTPUT_DIR"
        )
    for key in current:
        if saved.get(key) != current[key]:
            raise SettingsError(
                f"{key}: this run has {current[key]!r}, the checkpoint {where} has "
                f"{saved.get(key)!r}; resume with the same settings, or start a new run in "
                "another DFLASH_OUTPUT_DIR"
            )


class HostStaging:
    """Host buffers that snapshots copy into, allocated at the first save and reused by every
    later one, page-locked when the source is on a GPU.

    Why: a fresh pageable host copy of the Qwen3-8B drafter's state (11.7 GiB) took ~9 s on an
    H200 (1.3 GB/s: page faults of new memory plus the driver's staged pageable copy), all of it
    blocking training; a page-locked buffer copies at ~50 GB/s. The buffers are plain host tensors
    registered with cudaHostRegister rather than `pin_memory()`: the pinned caching allocator
    rounds each block up to a power of two (a 192 MiB fp32 MLP weight would pin 256 MiB).

    Contract: a snapshot's tensors are these buffers, so they stay valid only until the next
    snapshot. The Saver keeps at most one save in flight and starts the next snapshot only after
    the previous write finished, which is what makes the reuse safe.
    """

    # Below this a tensor is copied through pageable memory: registering costs more than it saves.
    MIN_PAGE_LOCKED_BYTES = 1 << 20

    def __init__(self, *, page_lock: bool = True) -> None:
        self.page_lock = page_lock  # False: plain host buffers (nothing to unlock, no close())
        self._buffers: dict[str, torch.Tensor] = {}
        self._locked: list[torch.Tensor] = []

    def copy(self, key: str, source: torch.Tensor) -> torch.Tensor:
        """Enqueue a copy of `source` into the buffer for `key` (non-blocking from a GPU); the
        copy is complete only after `wait(device)`."""
        buf = self._buffers.get(key)
        if buf is None or buf.shape != source.shape or buf.dtype != source.dtype:
            buf = torch.empty(source.shape, dtype=source.dtype)
            if self.page_lock and source.is_cuda and buf.nbytes >= self.MIN_PAGE_LOCKED_BYTES:
                _page_lock(buf)
                self._locked.append(buf)
            self._buffers[key] = buf
        buf.copy_(source.detach(), non_blocking=source.is_cuda)
        return buf

    @staticmethod
    def wait(device: torch.device) -> None:
        """Sync point: the calling thread's stream on `device` has finished every copy."""
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()

    def close(self) -> None:
        """Unlock the page-locked buffers (they are freed with the object)."""
        for buf in self._locked:
            torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
        self._locked.clear()
        self._buffers.clear()


def _page_lock(buf: torch.Tensor) -> None:
    # 0 = cudaHostRegisterDefault; the buffer is then usable for async copies from any device.
    err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {buf.nbytes} bytes failed: {err}")


@torch.no_grad()
def snapshot(
    steps: Sequence[DrafterStep],
    *,
    step: int,
    cursor: PackCursor,
    seed: int,
    run: dict,
    staging: HostStaging | None = None,
) -> dict[str, Any]:
    """A host copy of the training state after `step` optimizer steps; call on drafter 0's
    thread between steps. All drafters hold identical weights and optimizer state (step.py), so
    drafter 0's are saved; each drafter's anchor generator is its own. With `staging`, the
    returned tensors are its reused buffers (valid until the next snapshot into it); without,
    fresh pageable copies (nothing left page-locked for a caller to release).

    Sync point: one, at the end: the copies are enqueued on this thread's stream and waited for
    (`HostStaging.wait`), so training goes on only once the host holds the state.
    """
    first = steps[0]
    staging = staging if staging is not None else HostStaging(page_lock=False)
    host = staging.copy
    params = dict(_named_params(first))
    optimizer = [
        {
            k: host(f"optimizer.{name}.{k}", v) if torch.is_tensor(v) else v
            for k, v in first.optimizer.state[p].items()
        }
        for name, p in params.items()
    ]  # empty dicts before the first optimizer step
    drafter = {name: host(f"drafter.{name}", p) for name, p in params.items()}
    staging.wait(next(iter(params.values())).device)
    return {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "drafter": drafter,
        "optimizer": optimizer,
        "schedule_step": int(first.schedule.step.item()),  # sync point (a scalar, after the wait)
        "cursor": {"epoch": cursor.epoch, "index": cursor.index, "seed": seed},
        "rng": {
            "anchor_generators": [s.generator.get_state() for s in steps],
            "torch_cpu": torch.get_rng_state(),
        },
        "run": run,
    }


def _named_params(step: DrafterStep) -> list[tuple[str, torch.nn.Parameter]]:
    named = step.objective.drafter.named_parameters()
    return [(name.replace("_orig_mod.", ""), p) for name, p in named if p.requires_grad]


# Beyond the tensors' bytes: torch.save's zip records (a header and 64-byte alignment each; per
# parameter four: it, AdamW's two moments and its `step` scalar; ~400 bytes each measured), the
# generator states, run.json and the pickled rest.
_CHECKPOINT_OVERHEAD_BYTES = 256 << 10
_RECORD_OVERHEAD_BYTES = 512


def checkpoint_bytes(step: DrafterStep) -> int:
    """Estimated bytes of one checkpoint of `step` (`write_checkpoint`'s folder): every trainable
    parameter in its training dtype and AdamW's two moments of the same shape and dtype, plus a
    bound on the rest. Known before the first step (the optimizer state does not exist yet)."""
    params = [p for _, p in _named_params(step)]
    tensors = 3 * sum(p.numel() * p.element_size() for p in params)
    return tensors + 4 * len(params) * _RECORD_OVERHEAD_BYTES + _CHECKPOINT_OVERHEAD_BYTES


def state_bytes(state: dict[str, Any]) -> int:
    """The bytes of a snapshot's tensors, about what `write_checkpoint` puts on disk."""
    tensors = [*state["drafter"].values()]
    tensors += [v for saved in state["optimizer"] for v in saved.values() if torch.is_tensor(v)]
    return sum(t.numel() * t.element_size() for t in tensors) + _CHECKPOINT_OVERHEAD_BYTES


def write_checkpoint(output_dir: Path, state: dict[str, Any], *, keep: int) -> tuple[Path, int]:
    """Write `state` as checkpoint folder of its step (atomic), then delete all but the newest
    `keep` checkpoints. Returns (folder, bytes written)."""
    folder = checkpoint_dir(output_dir, state["step"])
    readme = {k: state[k] for k in ("step", "cursor", "run")}
    with atomic_directory(folder, replaceable=lambda p: (p / STATE_NAME).is_file()) as tmp:
        torch.save(state, tmp / STATE_NAME)
        (tmp / RUN_NAME).write_text(json.dumps(readme, indent=2) + "\n")
        size = sum(f.stat().st_size for f in tmp.iterdir())
    for _, old in list_checkpoints(output_dir)[:-keep]:
        remove_directory(old)
    return folder, size


def load_checkpoint(folder: Path) -> dict[str, Any]:
    """Read a checkpoint folder (or its training_state.pt) onto the CPU; ValueError naming the
    file for anything that is not a complete training state of this version."""
    path = Path(folder)
    path = path / STATE_NAME if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(f"no training state at {path}")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{path} is not a dflash_async training state")
    if state.get("version") != VERSION:
        raise ValueError(f"{path}: version {state.get('version')!r}, this code reads {VERSION}")
    missing = [k for k in _KEYS if k not in state]
    if missing:
        raise ValueError(f"{path}: training state lacks {missing}")
    return state


def cursor_of(state: dict[str, Any], *, node: int = 0) -> PackCursor:
    """The data cursor of rank `node` (its index into its own share of the epoch)."""
    cursor = own_part(state, node=node)["cursor"]
    return PackCursor(cursor["epoch"], cursor["index"])


def own_part(state: dict[str, Any], *, node: int) -> dict[str, Any]:
    """Rank `node`'s cursor and generators: `ranks[node]` on several ranks, else the state's."""
    if "ranks" in state:
        return state["ranks"][node]
    return {"cursor": state["cursor"], "rng": state["rng"]}


@torch.no_grad()
def restore(step: DrafterStep, state: dict[str, Any], *, rank: int, node: int = 0) -> None:
    """Put drafter `rank` (of this process) of rank `node` exactly where the state was saved;
    call on its own thread after capture (capture resets the optimizer), before the first step.
    Tensors are copied in place."""
    params = _named_params(step)
    names = {name for name, _ in params}
    if names != state["drafter"].keys() or len(state["optimizer"]) != len(params):
        raise ValueError("the checkpoint's drafter parameters differ from this drafter's")
    for (name, p), saved in zip(params, state["optimizer"], strict=True):
        p.copy_(state["drafter"][name])
        _restore_optimizer_state(step.optimizer, p, saved)
    step.schedule.set_step_(state["schedule_step"])
    step.sync_working_weights()
    step.flat_grad.zero_()
    rng = own_part(state, node=node)["rng"]
    step.generator.set_state(rng["anchor_generators"][rank])
    torch.set_rng_state(rng["torch_cpu"])


def _restore_optimizer_state(
    optimizer: torch.optim.Optimizer, p: torch.Tensor, saved: dict
) -> None:
    live = optimizer.state.get(p)
    if live:  # in place: a captured update keeps its pointers
        for key, value in saved.items():
            if torch.is_tensor(value):
                live[key].copy_(value)
            else:
                live[key] = value
        return
    # No state yet (eager, never stepped): create it where AdamW would (step on the device when
    # fused or capturable). param_groups are not loaded: their lr is the schedule's live tensor.
    group = next(g for g in optimizer.param_groups if any(q is p for q in g["params"]))
    step_device = p.device if group.get("fused") or group.get("capturable") else torch.device("cpu")
    optimizer.state[p] = {  # copies: each drafter owns its state (the loaded one is shared)
        k: v.to(step_device if k == "step" else p.device, copy=True) if torch.is_tensor(v) else v
        for k, v in saved.items()
    }
