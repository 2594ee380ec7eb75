"""Resume: where a run starts (a checkpoint, or scratch) and putting the drafters back there.

`resume_point` computes the run identity (checkpoint/state.run_identity), picks the checkpoint
(DFLASH_TRAIN__RESUME, stages/save.resume_source) and refuses one whose run-defining settings
differ (exit 2 naming the setting). `Resume.restore` loads the state into every drafter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dflash_async.checkpoint.state import (
    check_run_identity,
    cursor_of,
    data_fingerprint,
    load_checkpoint,
    plan_identity,
    restore,
    run_identity,
)
from dflash_async.data.packing import PackCursor
from dflash_async.pipeline.distributed import RankInfo
from dflash_async.pipeline.startup import RunInputs
from dflash_async.settings import Settings, SettingsError
from dflash_async.stages.save import resume_source
from dflash_async.stages.train import DrafterRunner


@dataclass
class Resume:
    """Where the run starts: a checkpoint (path None: from scratch) and the run identity."""

    identity: dict
    path: Path | None = None
    step: int = 0
    cursor: PackCursor = field(default_factory=PackCursor)
    state: dict | None = None  # the loaded training state, dropped once restored (host memory)

    async def restore(self, runners: list[DrafterRunner], log, *, total_steps: int) -> None:
        """Complete the identity with the placed run's plan (SettingsError if it differs from
        the checkpoint's), then put each drafter (in its thread, after capture) back to the
        checkpoint's state."""
        self.identity |= plan_identity(total_steps=total_steps, num_drafters=len(runners))
        if self.state is None:
            return
        check_run_identity(self.state["run"], self.identity, self.path)
        for rank, runner in enumerate(runners):
            await runner.worker.run(restore, runner.step, self.state, rank=rank)
        self.state = None  # a Qwen3-8B-shaped drafter's state is ~12 GB
        log.info("resumed", step=self.step, epoch=self.cursor.epoch, pack=self.cursor.index,
                 path=str(self.path))  # fmt: skip


def resume_point(
    settings: Settings, inputs: RunInputs, samples, output_dir: Path, node: RankInfo | None = None
) -> Resume:
    """The run identity, and the checkpoint to resume (DFLASH_TRAIN__RESUME); SettingsError
    (exit 2, before any model is loaded) naming a run-defining setting that differs from the
    checkpoint's (the placed run's plan is checked by `Resume.restore`)."""
    fingerprint = data_fingerprint(samples.tokens, samples.loss_mask, samples.offsets)
    identity = run_identity(settings, inputs.drafter_config, target_path=inputs.target_path,
                            data=fingerprint)  # fmt: skip
    if node is not None and not node.is_writer:
        return Resume(identity)  # rank 0 alone writes (and owns) the output folder
    path = resume_source(settings.train.resume, output_dir)
    if path is None:
        return Resume(identity)
    if node is not None and node.distributed:
        raise SettingsError(
            f"{path}: resuming a run of several nodes is not supported yet; resume it on one "
            "node, or start afresh in another DFLASH_OUTPUT_DIR"
        )
    try:
        state = load_checkpoint(path)
    except (OSError, ValueError, RuntimeError) as e:
        raise SettingsError(
            f"DFLASH_TRAIN__RESUME: cannot read the checkpoint {path}: {e}"
        ) from None
    check_run_identity(state["run"], identity, path)
    return Resume(identity, path, state["step"], cursor_of(state), state)
