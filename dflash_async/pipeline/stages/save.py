"""Save stage: the servable drafter export, written atomically from the drafter's own thread."""

from __future__ import annotations

from pathlib import Path

from dflash_async.checkpoint import export_drafter
from dflash_async.pipeline.stages.train import DrafterRunner


def export_path(output_dir: Path) -> Path:
    return output_dir / "drafter"


async def save_stage(runner: DrafterRunner, output_dir: Path, step: int, log) -> Path:
    """Export drafter 0 (all drafters hold identical weights) between two steps.

    The job runs on the drafter's worker, after the step's queued work: the weights are the
    step's. Copying them to the host is a sync point, once per checkpoint.
    """
    path = export_path(output_dir)
    drafter = runner.step.objective.drafter
    await runner.worker.run(export_drafter, drafter, drafter.config, path)
    log.info("checkpoint_saved", step=step, path=str(path))
    return path
