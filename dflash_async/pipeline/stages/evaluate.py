"""Eval stage: acceptance length (tau) of the drafter being trained, by speculative decoding.

The drafter's current weights are exported (the servable format, so this also checks that the
export loads), then the target worker decodes the held-out prompts with it: greedy speculative
decoding, checked token for token against plain greedy decoding (evaluate.py). One `eval` event.
"""

from __future__ import annotations

from pathlib import Path

from dflash_async.checkpoint import export_drafter
from dflash_async.pipeline.devices import DeviceWorker
from dflash_async.pipeline.stages.train import DrafterRunner


async def eval_stage(
    drafter: DrafterRunner,
    target_worker: DeviceWorker,
    *,
    target_path: str,
    prompts_path: str,
    num_prompts: int,
    max_new_tokens: int,
    output_dir: Path,
    step: int,
    log,
) -> dict:
    """Export drafter weights at `step` and decode on the target worker's device; returns tau etc."""
    from dflash_async.eval.harness import run_eval

    folder = output_dir / "eval" / f"step-{step}"
    model = drafter.step.objective.drafter
    await drafter.worker.run(export_drafter, model, model.config, folder)
    report = await target_worker.run(
        run_eval, target_path, folder, prompts_path or None,
        device=target_worker.device, max_new_tokens=max_new_tokens, num_prompts=num_prompts,
        log=log, results_path=folder / "samples.jsonl",
    )  # fmt: skip
    summary = {k: v for k, v in report.items() if k != "samples"}
    log.info("eval", step=step, **summary)
    return summary
