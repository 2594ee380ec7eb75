"""Resume policy: where a run starts (a checkpoint, or scratch) and which folders it may write.

OUTPUT_DIR/checkpoints/step-NNNNNNNN   the training state (state.py), newest K kept
OUTPUT_DIR/drafter                     the servable export of the newest checkpoint (export.py)

`resume_point` picks the checkpoint (DFLASH_TRAIN__RESUME) and refuses one whose run-defining
settings differ (exit 2 naming the setting; the number of ranks is one of them);
`Resume.placed` completes that check with what is known once the workers are placed. On several
ranks rank 0 alone decides and reads the checkpoint; `Resume.shared` is what the other ranks
learn of it at start-up (`Resume.of_rank`), and the state itself reaches them by broadcast
(checkpoint/ranks.py). Nothing a previous run wrote is replaced unless this run
resumes it. Putting the state back into the drafters is the start-up's (pipeline/startup.py).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from dflash_async.atomic import stale_siblings
from dflash_async.checkpoint.state import (
    CHECKPOINTS,
    STATE_NAME,
    check_run_identity,
    cursor_of,
    list_checkpoints,
    load_checkpoint,
    own_part,
    plan_identity,
)
from dflash_async.data.packing import PackCursor
from dflash_async.errors import SettingsError


def export_path(output_dir: Path) -> Path:
    return output_dir / "drafter"


@dataclass
class Resume:
    """Where the run starts: a checkpoint (path None: from scratch) and the run identity."""

    identity: dict
    path: Path | None = None
    step: int = 0
    cursor: PackCursor = field(default_factory=PackCursor)
    state: dict | None = None  # the loaded training state, dropped once restored (host memory)

    def shared(self) -> dict:
        """What every rank needs to know of rank 0's resume point before the first step (JSON):
        the checkpoint, its step and each rank's own data cursor."""
        if self.state is None:
            return {"path": None}
        ranks = len(self.state.get("ranks", [None]))
        cursors = [own_part(self.state, node=r)["cursor"] for r in range(ranks)]
        return {"path": str(self.path), "step": self.step, "cursors": cursors}

    @classmethod
    def of_rank(cls, shared: dict, identity: dict, *, rank: int) -> Resume:
        """Rank `rank`'s resume point from rank 0's `shared()`; its state comes by broadcast."""
        if shared["path"] is None:
            return cls(identity)
        cursor = shared["cursors"][rank]
        return cls(
            identity,
            Path(shared["path"]),
            shared["step"],
            PackCursor(cursor["epoch"], cursor["index"]),
        )

    def placed(self, *, total_steps: int, num_drafters: int) -> dict | None:
        """Complete the identity with the placed run's plan (SettingsError if it differs from
        the checkpoint's); the state to restore, handed over once (None: from scratch)."""
        self.identity |= plan_identity(total_steps=total_steps, num_drafters=num_drafters)
        state, self.state = self.state, None  # a Qwen3-8B-shaped drafter's state is ~12 GB
        if state is not None:
            check_run_identity(state["run"], self.identity, self.path)
        return state


def resume_point(mode: str, identity: dict, output_dir: Path) -> Resume:
    """The checkpoint to resume for DFLASH_TRAIN__RESUME=`mode`; SettingsError (exit 2, before
    any model is loaded) naming a run-defining setting that differs from the checkpoint's, the
    number of ranks included (the placed run's plan is checked by `Resume.placed`). Call on the
    writer (rank 0) alone: it owns the folder."""
    path = resume_source(mode, output_dir)
    if path is None:
        return Resume(identity)
    try:
        state = load_checkpoint(path)
    except (OSError, ValueError, RuntimeError) as e:
        raise SettingsError(
            f"DFLASH_TRAIN__RESUME: cannot read the checkpoint {path}: {e}"
        ) from None
    check_run_identity(state["run"], identity, path)
    return Resume(identity, path, state["step"], cursor_of(state), state)


def resume_source(mode: str, output_dir: Path) -> Path | None:
    """The checkpoint to resume from for DFLASH_TRAIN__RESUME=`mode`, or None to start afresh.

    auto: the newest checkpoint in `output_dir`. never: none, and an `output_dir` holding a
    previous run is refused (it would be overwritten). A path: that checkpoint folder; refused
    when `output_dir` holds another run's checkpoints. SettingsError (exit 2) for each refusal.
    """
    existing = list_checkpoints(output_dir)
    previous = bool(existing) or export_path(output_dir).exists()
    if mode != "never" or not previous:  # this run owns the folder: a killed writer's leftovers go
        _remove_leftovers(output_dir)
    if mode == "never":
        if previous:
            raise SettingsError(
                f"DFLASH_TRAIN__RESUME=never: {output_dir} holds a previous run, which this run "
                "would overwrite; choose another DFLASH_OUTPUT_DIR or resume it (auto)"
            )
        return None
    if mode == "auto":
        if existing:
            return existing[-1][1]
        if previous:
            raise SettingsError(
                f"DFLASH_OUTPUT_DIR={output_dir} holds a drafter export but no training "
                "checkpoint to resume; choose another DFLASH_OUTPUT_DIR"
            )
        return None
    path = Path(mode)
    if not (path / STATE_NAME).is_file():
        raise SettingsError(f"DFLASH_TRAIN__RESUME={mode}: no {STATE_NAME} in that folder")
    if existing and path.resolve().parent != existing[0][1].resolve().parent:
        raise SettingsError(
            f"DFLASH_TRAIN__RESUME={mode}: {output_dir} holds another run's checkpoints; "
            "choose another DFLASH_OUTPUT_DIR"
        )
    return path


def _remove_leftovers(output_dir: Path) -> None:
    """Temporaries of a checkpoint or export write that was killed (never a complete copy)."""
    root = output_dir / CHECKPOINTS
    hidden = [p for p in root.iterdir() if p.name.startswith(".step-")] if root.is_dir() else []
    for path in [*hidden, *stale_siblings(export_path(output_dir))]:
        shutil.rmtree(path, ignore_errors=True)
