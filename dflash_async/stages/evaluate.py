"""Eval stage: tau of the drafter being trained, decoded on the target the run already holds.

No second target load and no export to disk: at a step boundary the drafter's weights (DFlash or
DFlash2, whose drafts are its selector's walk: eval/selector.py asks the kind) are copied
(on the drafter's worker, one sync) into one evaluation copy on the target's device, kept for the
whole run; then the decode jobs of eval/evaluation.py run on the target's DeviceWorker. That
worker runs jobs in submission order, so decode steps (tens of ms each) interleave with the
target's training jobs instead of stopping them:

    overlap (default): evaluate(step) returns after the weight copy; training goes on while the
             evaluation shares the target's worker: jobs of about job_ms of decode steps, a
             training job between two of them (the time taken is logged as target_busy_s); one
             evaluation at a time (a later request is skipped, logged); the run's end waits for
             one still running.
    pause:   evaluate(step) returns when the evaluation is done; the training loop waits
             (logged as training_waited_s), bounded by the decode work of one evaluation.

The plain-greedy baseline depends only on the target and the prompts: decoded at the first
evaluation, kept in memory and in OUTPUT_DIR/eval/baseline-<key>.jsonl (a resumed run reads it).
Each evaluation keeps its results (OUTPUT_DIR/eval/step-N.jsonl), never a model copy, and logs
one `eval` event with the decode settings it used, or `eval_failed` when a sample is not lossless
(an evaluation's verdict: logged as an error, training goes on).
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import torch

from dflash_async.errors import SettingsError
from dflash_async.eval.baseline import (
    baseline_key,
    load_baseline,
    save_baseline,
    vision_digest,
)
from dflash_async.eval.evaluation import (
    Decoder,
    DecodeSetup,
    advance_for,
    evaluation_unsupported_reason,
    greedy_decoders,
    report,
    speculative_decoders,
    timed_job,
)
from dflash_async.eval.lossless import LosslessError, tie_tolerance_for
from dflash_async.eval.regenerate import write_jsonl
from dflash_async.eval.sampling import SamplingOptions, sampled_or_none
from dflash_async.eval.teacher_forced import heldout_estimate
from dflash_async.model.drafter import DFlashDrafter
from dflash_async.model.kinds import kind_of
from dflash_async.runtime.devices import DeviceWorker
from dflash_async.settings import EvalSettings
from dflash_async.stages.train import DrafterRunner
from dflash_async.targets.loading import frozen_embeddings, load_target_tokenizer

EXPORT_DTYPE = torch.bfloat16  # the servable export's (checkpoint.export_drafter, DFLASH.md s.7)

# `await evaluate(step, wait=False)`: the summary, or {} (started in the background, or skipped)
Evaluate = Callable[..., Awaitable[dict[str, Any]]]


def copy_weights(
    source: DFlashDrafter,
    copy: DFlashDrafter | None,
    *,
    device: torch.device,
    dtype: torch.dtype,
    block_size: int = 0,
) -> DFlashDrafter:
    """The drafter's current weights in `copy` (made on first use, on `device` in `dtype`, a
    drafter of the source's kind served at `block_size`, 0 = the trained one), rounded through
    bf16 like the servable export: the in-run tau is the served drafter's, and `eval` of the
    export saved at the same step reports the same tau. Call on the drafter's worker: the copy is
    ordered after its last step on that stream."""
    if copy is None:
        config = source.config
        if block_size:
            config = replace(config, block_size=block_size)  # checked by eval_setup
        with torch.device("meta"):
            copy = kind_of(config.kind).make_drafter(config)
        copy = copy.to_empty(device=device).to(dtype).eval().requires_grad_(False)
    copy.load_state_dict({k: v.to(EXPORT_DTYPE) for k, v in source.state_dict().items()})
    if source.fc.weight.device.type == "cuda":
        # Sync point (one per evaluation): the target's thread reads the copy on its own stream.
        torch.cuda.current_stream().synchronize()
    return copy


class InRunEvaluator:
    """The evaluations of one run (lifecycle: open_run_evaluator). Call `await evaluate(step)`."""

    def __init__(
        self,
        settings: EvalSettings,
        setup: DecodeSetup,
        *,
        target_worker: DeviceWorker,
        drafter: DrafterRunner,
        output_dir: Path,
        target_id: str,
        task_group: anyio.abc.TaskGroup,
        log: Any,
    ) -> None:
        self.settings, self.setup, self.log = settings, setup, log
        self.target_worker, self.drafter, self.task_group = target_worker, drafter, task_group
        self.folder, self.target_id = output_dir / "eval", target_id
        self.copy: DFlashDrafter | None = None
        self.baseline: tuple[list, float] | None = None
        self.running: anyio.Event | None = None  # set when the evaluation in flight ends

    async def __call__(self, step: int, *, wait: bool = False) -> dict[str, Any]:
        """Evaluate the drafter as of `step`; {} when started in the background (overlap) or
        skipped, else the summary. wait=True waits for one in flight first, then decodes."""
        asked = time.perf_counter()
        if self.running is not None and not wait:
            self.log.info("eval_skipped", step=step, reason="previous evaluation still running")
            return {}
        if self.running is not None:
            await self.running.wait()
        await self._snapshot()
        self.running = anyio.Event()
        if wait or self.settings.mode == "pause":
            return await self._evaluate(step, asked=asked, mode="pause")
        self.task_group.start_soon(lambda: self._evaluate(step, asked=asked, mode="overlap"))
        return {}

    async def _snapshot(self) -> None:
        source = self.drafter.step.objective.drafter
        dtype = frozen_embeddings(self.setup.target)[0].dtype
        self.copy = await self.drafter.worker.run(
            functools.partial(copy_weights, block_size=self.settings.block_size),
            source,
            self.copy,
            device=self.setup.device,
            dtype=dtype,
        )

    async def _jobs(self, factories: Sequence[Callable[[], Decoder]]) -> tuple[list, float]:
        """Decode on the target's worker, one short job at a time; (results, device seconds)."""
        worker, device, seconds, results = self.target_worker, self.setup.device, [0.0], []
        for make in factories:
            decoder = await worker.run(timed_job, make, device, seconds)
            advance = functools.partial(advance_for, decoder, self.settings.job_ms / 1e3)
            while not await worker.run(timed_job, advance, device, seconds):
                pass
            results += await worker.run(decoder.results)
        return results, seconds[0]

    async def _plain(self) -> tuple[list, float, bool]:
        """The greedy baseline: (results, seconds, cached?); decoded once per run at most."""
        if self.baseline is not None:
            return *self.baseline, True
        s = self.setup
        key = baseline_key(
            target_id=self.target_id,
            dtype=str(frozen_embeddings(s.target)[0].dtype),
            device_type=s.device.type,
            prompts=s.prompts,
            max_new_tokens=s.max_new_tokens,
            eos=s.eos,
            suppress=s.suppress,
            batch_size=s.batch_size,
            images=vision_digest(s.vision),
        )
        self.baseline = load_baseline(self.folder, key)
        if self.baseline is not None:
            return *self.baseline, True
        self.baseline = await self._jobs(greedy_decoders(s))
        save_baseline(self.folder, key, *self.baseline)
        return *self.baseline, False

    async def _evaluate(self, step: int, *, asked: float, mode: str) -> dict[str, Any]:
        assert self.running is not None and self.copy is not None
        started = time.perf_counter()
        try:
            plain, plain_s, cached = await self._plain()
            factories = speculative_decoders(self.setup, self.copy, self.copy.config)
            spec, spec_s = await self._jobs(factories)
            estimate = {}  # the teacher-forced estimate reads text prompts only
            if self.setup.vision is None:
                estimate = await self.target_worker.run(
                    heldout_estimate, self.setup.target, self.copy, self.setup.prompts, plain
                )
        finally:
            self.running.set()
            self.running = None
        waited = (time.perf_counter() if mode == "pause" else started) - asked
        timing = {
            "mode": mode,
            "training_waited_s": round(waited, 3),
            "target_busy_s": round(spec_s + (0.0 if cached else plain_s), 3),
            "eval_s": round(time.perf_counter() - started, 3),
            "baseline_cached": cached,
        }
        try:
            result = report(
                self.setup,
                plain,
                spec,
                block_size=self.copy.config.drafts_per_block + 1,  # the verified block
                plain_s=plain_s,
                speculative_s=spec_s,
                tie_tolerance=tie_tolerance_for(frozen_embeddings(self.setup.target)[0].dtype),
            )
        except LosslessError as e:  # the evaluation's verdict, not a reason to stop training
            self.log.error(
                "eval_failed", step=step, reason="lossless_check", error=str(e), **timing
            )
            return {}
        write_jsonl(result.pop("samples"), self.folder / f"step-{step}.jsonl")
        summary = result | estimate | timing
        self.log.info("eval", step=step, num_prompts=len(self.setup.prompts), **summary)
        return summary


def eval_setup(
    settings: EvalSettings,
    *,
    target: Any,
    target_path: str,
    builtin_target: bool,
    drafter_config: Any,
) -> DecodeSetup:
    """The prompts (the file, or the tiny demo's held-out ones), stop rules and decode settings
    of the run's evaluations. SettingsError (one line, exit 2) for a target evaluation cannot
    serve or a drafter that does not fit it: raised at start-up, before any training."""
    from dflash_async.eval.harness import (  # lazy: the harness imports the CLI's loaders
        check_drafter_fits_target,
        has_image_prompts,
        image_prompts_of,
        prompts_of,
        read_prompts,
        stop_rules,
    )
    from dflash_async.targets.multimodal import load_target_processor, model_vision_problem
    from dflash_async.targets.tiny import demo_prompts

    problem = evaluation_unsupported_reason(target)
    if problem:
        raise SettingsError(
            f"evaluation cannot decode this target ({problem}); set DFLASH_EVAL__EVERY=0, "
            "DFLASH_EVAL__AT_START=false and DFLASH_EVAL__AT_END=false to train without it"
        )
    try:
        check_drafter_fits_target(drafter_config, target)
    except ValueError as e:
        raise SettingsError(f"evaluation: {e}") from e
    if settings.block_size and not 2 <= settings.block_size <= drafter_config.block_size:
        raise SettingsError(
            f"DFLASH_EVAL__BLOCK_SIZE={settings.block_size}: must be 0 (the trained block size) "
            f"or in [2, {drafter_config.block_size}]"
        )
    tokenizer = load_target_tokenizer(target_path)
    if settings.prompts_path:
        records = read_prompts(settings.prompts_path)[: settings.num_prompts]
    else:
        assert builtin_target, "the demo prompts belong to the built-in target"
        records = demo_prompts(settings.num_prompts, split="heldout")
    eos, suppress = stop_rules(target, tokenizer)
    vision = None
    if has_image_prompts(records):  # the run's target must hold its vision tower
        problem = model_vision_problem(target)
        if problem:
            raise SettingsError(
                f"DFLASH_EVAL__PROMPTS_PATH holds image prompts, but the run's target runs "
                f"without its vision tower (a run on text data): {problem}"
            )
        embed = frozen_embeddings(target)[0]
        prompts, vision = image_prompts_of(
            load_target_processor(target_path),
            records,
            enable_thinking=False,
            device=embed.device,
            dtype=embed.dtype,
        )
    else:
        prompts = prompts_of(tokenizer, records, enable_thinking=False)
    sampling = SamplingOptions(settings.temperature, top_p=settings.top_p, top_k=settings.top_k)
    return DecodeSetup(
        target,
        prompts,
        settings.max_new_tokens,
        eos,
        suppress,
        settings.batch_size,
        sampling=sampled_or_none(sampling),
        vision=vision,
    )


async def evaluation_off(step: int, *, wait: bool = False) -> dict[str, Any]:
    """The `evaluate` of a run without evaluation."""
    return {}


def _skip_reason(settings: EvalSettings, inputs: Any) -> str | None:
    """Why the run's evaluations are skipped (logged each time), or None."""
    if not (inputs.builtin_target or settings.prompts_path):
        return "set DFLASH_EVAL__PROMPTS_PATH"
    return None


@asynccontextmanager
async def open_run_evaluator(
    settings: EvalSettings,
    *,
    inputs: Any,
    target_worker: DeviceWorker,
    target_model: Any,
    drafter: DrafterRunner,
    output_dir: Path,
    log: Any,
) -> AsyncIterator[Evaluate]:
    """The run's `evaluate`: tau of the drafter now on the run's own target (overlapping
    training, or a logged pause); a no-op when evaluation is off, or one that logs why it cannot
    run (no prompts for a target of one's own). `inputs`: the run's (pipeline/startup.RunInputs).
    Refuses a target that evaluation cannot decode before any training (SettingsError)."""
    if not (settings.every or settings.at_start or settings.at_end):
        yield evaluation_off
        return
    reason = _skip_reason(settings, inputs)
    if reason:

        async def skipped(step: int, *, wait: bool = False) -> dict:
            log.info("eval_skipped", step=step, reason=reason)
            return {}

        yield skipped
        return
    setup = await anyio.to_thread.run_sync(
        lambda: eval_setup(
            settings,
            target=target_model,
            target_path=inputs.target_path,
            builtin_target=inputs.builtin_target,
            drafter_config=inputs.drafter_config,
        )
    )
    log.info(
        "eval_ready",
        prompts=len(setup.prompts),
        max_new_tokens=settings.max_new_tokens,
        batch_size=settings.batch_size,
        mode=settings.mode,
        decoder="batched" if setup.batched else "reference",
    )
    # Background evaluations end with the block: it waits for one still running when it ends
    # normally; an error cancels it (its current decode job finishes in the worker, the rest
    # is dropped).
    async with anyio.create_task_group() as task_group:
        yield InRunEvaluator(
            settings,
            setup,
            target_worker=target_worker,
            drafter=drafter,
            output_dir=output_dir,
            target_id=inputs.target_path,
            task_group=task_group,
            log=log,
        )
