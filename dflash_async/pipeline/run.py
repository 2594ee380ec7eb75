"""The whole run in one process: stages and channels wired in one task group.

    read ──packs──> target workers ──slots (a ring per drafter)──> drafter workers ──records──> report
                                                                    └──> save (every N steps, at the end)

`run()` is the map of the system: start-up (inputs, workers, compile/capture) and then the stage
topology in data-flow order. Every task belongs to one task group: a failure anywhere cancels
everything and propagates; closing a channel is the end signal; SIGINT/SIGTERM stop after the
current step (start-up and evaluations at once), save, and exit 130/143 (shutdown.py).
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import numpy as np
import torch

from dflash_async.checkpoint.resume import Resume, resume_point
from dflash_async.data.packing import PackCursor, plan_epoch
from dflash_async.data.samples import DataError, DataOptions, TokenizedSamples, load_samples
from dflash_async.model.flops import drafter_step_flops
from dflash_async.pipeline import workers as placing
from dflash_async.pipeline.channels import open_channel
from dflash_async.pipeline.devices import DeviceWorker, open_device_worker
from dflash_async.pipeline.distributed import (
    NodeReducer,
    RankInfo,
    check_same_run,
    pick_backend,
    process_group,
    rank_info_from_env,
    writer_first,
)
from dflash_async.pipeline.meters import LoopLag
from dflash_async.pipeline.rings import RingSet
from dflash_async.pipeline.shutdown import Shutdown
from dflash_async.pipeline.startup import RunInputs, build_drafter_step, resolve_inputs
from dflash_async.settings import Settings
from dflash_async.stages.evaluate import eval_setup, open_evaluator
from dflash_async.stages.produce import TargetRunner, load_runner, target_stage
from dflash_async.stages.read import read_stage
from dflash_async.stages.report import GpuBusy, Throughput, report_stage
from dflash_async.stages.save import Saver, export_path
from dflash_async.stages.train import DrafterRunner, Progress, train_steps
from dflash_async.target.loading import load_target_tokenizer, resolve_target_dtype
from dflash_async.usage import check_writable_folder


@dataclass
class Plan:
    total_steps: int
    epochs: int | None  # None: loop over the data until max_steps


def plan_steps(
    settings: Settings, lengths: np.ndarray, num_drafters: int, *, node: RankInfo
) -> Plan:
    """How many optimizer steps the run makes (each consumes one pack per drafter); with several
    nodes, every node's share of an epoch has the same number of packs (plan_epoch)."""
    train = settings.train
    if train.max_steps:
        return Plan(train.max_steps, None)
    share = plan_epoch(lengths, train.token_budget, train.seed, 0, rank=node.rank,
                       world_size=node.world_size)  # fmt: skip
    packs = len(share)
    return Plan(max(1, train.epochs * packs // num_drafters), train.epochs)


def _read_data(settings: Settings, inputs: RunInputs, log) -> TokenizedSamples:
    data = settings.data
    options = DataOptions(
        max_len=min(data.max_len, settings.train.token_budget),
        enable_thinking=data.enable_thinking,
        loss_turns=data.loss_turns,
        too_long=data.too_long,
        on_bad_record=data.on_bad_record,
        role_map=data.role_map,
        cache_dir=data.cache_dir or None,
        workers=data.workers,
    )
    tokenizer = load_target_tokenizer(inputs.target_path)
    samples = load_samples(
        inputs.data_path, tokenizer, options=options, block_size=settings.train.block_size, log=log
    )
    vocab = inputs.drafter_config.vocab_size
    if samples.max_token_id >= vocab:  # would index past the embedding
        raise DataError(
            f"{inputs.data_path}: token id {samples.max_token_id} is outside the target's "
            f"vocabulary ({vocab} ids)"
        )
    return samples


async def _start_drafters(
    settings, inputs, workers, total_steps, log, *, node_rank: int = 0, node=(0, 1)
) -> list[DrafterRunner]:
    """Build each drafter in its own thread; capture graphs one device at a time. Anchors are
    drawn per drafter of the whole run (node_rank * drafters per node + local index)."""
    cuda = workers[0].device.type == "cuda"
    runners = []
    for rank, worker in enumerate(workers):  # one at a time: compile/capture not thread-safe
        started = time.perf_counter()
        step = await worker.run(
            build_drafter_step, settings, inputs.drafter_config, inputs.target_path,
            device=worker.device, rank=node_rank * len(workers) + rank, total_steps=total_steps,
            compile=cuda and settings.train.compile,
        )  # fmt: skip
        timings = {}  # warmup_s includes compiling and autotuning (the first calls)
        if cuda and settings.train.cuda_graph:
            timings = await worker.run(step.capture)
        log.info("drafter_ready", device=str(worker.device), graph=step.graphs is not None,
                 **{k: round(v, 2) for k, v in timings.items()},
                 startup_s=round(time.perf_counter() - started, 2))  # fmt: skip
        runners.append(DrafterRunner(worker, step, seed=settings.train.seed, node=node))
    return runners


@asynccontextmanager
async def _evaluator(settings, inputs: RunInputs, workers: Workers, output_dir: Path, log):
    """`await evaluate(step)`: tau of the drafter now on the run's own target (overlapping
    training, or a logged pause), or a no-op naming why it cannot run. Refuses a target that
    evaluation cannot decode before any training (SettingsError)."""
    ev = settings.eval
    if not (ev.every or ev.at_start or ev.at_end):
        yield None
        return
    if not (inputs.builtin_target or ev.prompts_path):

        async def skipped(step: int, *, wait: bool = False) -> dict:
            log.info("eval_skipped", step=step, reason="set DFLASH_EVAL__PROMPTS_PATH")
            return {}

        yield skipped
        return
    setup = await anyio.to_thread.run_sync(
        lambda: eval_setup(
            ev, target=workers.target_runners[0].model, target_path=inputs.target_path,
            builtin_target=inputs.builtin_target, drafter_config=inputs.drafter_config,
        )
    )  # fmt: skip
    log.info("eval_ready", prompts=len(setup.prompts), max_new_tokens=ev.max_new_tokens,
             batch_size=ev.batch_size, mode=ev.mode, decoder="batched" if setup.batched else "reference")  # fmt: skip
    async with open_evaluator(
        ev, setup, target_worker=workers.targets[0], drafter=workers.drafters[0],
        output_dir=output_dir, target_id=inputs.target_path, log=log,
    ) as evaluate:  # fmt: skip
        yield evaluate


@dataclass
class Workers:
    """The started worker threads, the state each holds, and the rings between them."""

    targets: list[DeviceWorker]
    target_runners: list[TargetRunner]
    drafters: list[DrafterRunner]
    feature_dtype: torch.dtype
    rings: RingSet
    homes: tuple[int | None, ...]  # per target: the ring it fills first
    plan: Plan
    target_flops: Callable[[int, int], float]  # (tokens, documents) -> one pack's target FLOPs


async def _start_workers(
    stack: AsyncExitStack, settings, inputs: RunInputs, samples, log, *, node: RankInfo
):
    """Place, then one thread per worker: targets loaded, drafters built (and captured)."""
    pipe, train, cfg = settings.pipeline, settings.train, inputs.drafter_config
    open_worker = lambda device, name, grad: stack.enter_async_context(  # noqa: E731
        open_device_worker(device, name, grad_enabled=grad)
    )
    given = placing.given_roles(settings)
    first = (given.targets if given else placing.candidate_devices(settings))[0]
    feature_dtype = torch.bfloat16 if first.type == "cuda" else torch.float32
    load = lambda w: w.run(load_runner, inputs.target_path, device=w.device,  # noqa: E731
                           dtype=resolve_target_dtype(settings.target.dtype, w.device),
                           layer_ids=cfg.target_layer_ids, token_budget=train.token_budget,
                           max_batch_tokens=pipe.target_batch_tokens,
                           packed_hybrid=settings.target.packed_hybrid)  # fmt: skip
    targets = [await open_worker(first, "target0", False)]
    runners = [await load(targets[0])]
    roles = await placing.place(settings, inputs, samples, target=targets[0], runner=runners[0],
                                log=log)  # fmt: skip
    for i, device in enumerate(roles.targets[1:], start=1):
        targets.append(await open_worker(device, f"target{i}", False))
        runners.append(await load(targets[-1]))
    # Off the loop: planning an epoch is seconds at millions of samples; the check waits on peers.
    plan = await anyio.to_thread.run_sync(
        lambda: plan_steps(settings, samples.lengths, len(roles.drafters), node=node)
    )
    await anyio.to_thread.run_sync(lambda: check_same_run(
        node, timeout_s=pipe.dist_timeout_s, samples=len(samples),
        tokens=int(samples.lengths.sum()), drafters=len(roles.drafters),
        total_steps=plan.total_steps))  # fmt: skip
    drafters = [await open_worker(d, f"drafter{i}", True) for i, d in enumerate(roles.drafters)]
    steps = await _start_drafters(
        settings,
        inputs,
        drafters,
        plan.total_steps,
        log,
        node_rank=node.rank,
        node=(node.rank, node.world_size),
    )
    rings = placing.open_rings(roles, num_slots=pipe.num_slots, token_budget=train.token_budget,
                               feature_dim=cfg.num_features * cfg.hidden_size, dtype=feature_dtype)  # fmt: skip
    flops = placing.target_pack_flops(inputs)
    return Workers(targets, runners, steps, feature_dtype, rings, roles.homes, plan, flops)


def _throughput(settings: Settings, config, workers: Workers, lag: LoopLag):
    train = settings.train
    targets = [(w, r.meter) for w, r in zip(workers.targets, workers.target_runners, strict=True)]
    drafters = [(r.worker, r.meter) for r in workers.drafters]
    return Throughput(
        workers.rings, targets, drafters, train.token_budget,
        step_flops=lambda pairs: drafter_step_flops(
            config, token_budget=train.token_budget, num_anchors=train.num_anchors,
            visible_pairs=pairs,
        ),
        loop_lag_ms=lag.read_max_ms,
        target_flops=workers.target_flops,
        gpus=GpuBusy(targets + drafters),
    )  # fmt: skip


async def _produce(
    settings, samples, plan: Plan, workers: Workers, node: RankInfo, start: PackCursor
) -> None:
    """read -> packs channel -> every target worker -> rings (each target its home ring first,
    else the one with room); closes the rings when all are done."""
    rings = workers.rings
    train = settings.train
    send_packs, receive_packs = open_channel(2 * len(workers.targets), "packs")
    async with anyio.create_task_group() as producers:
        producers.start_soon(
            lambda: read_stage(samples.lengths, token_budget=train.token_budget, seed=train.seed,
                               start=start, epochs=plan.epochs, send=send_packs,
                               rank=node.rank, world_size=node.world_size)
        )  # fmt: skip
        for worker, runner, home in zip(
            workers.targets, workers.target_runners, workers.homes, strict=True
        ):
            ring = rings.producer(home)
            producers.start_soon(target_stage, worker, runner, samples, receive_packs.clone(), ring)
        receive_packs.close()
    rings.close()  # all producers done: the consumers drain the rings and stop


async def run(
    settings: Settings, log, environ: Mapping[str, str] | None = None, *,
    shutdown: Shutdown | None = None,
) -> int:  # fmt: skip
    """Train a drafter end to end; returns the exit code: 0, or 130/143 after SIGINT/SIGTERM
    (handled from this first line: shutdown.py; `python -m dflash_async run` passes a Shutdown
    that ends the process after a signal; without one, run returns the code).

    Under torchrun or srun (`environ` names the ranks) this node first joins the others."""
    shutdown = shutdown or Shutdown(hard_exit=False)
    with shutdown.installed():
        await shutdown.attach()
        started = time.perf_counter()
        check_writable_folder(settings.output_dir, argument="DFLASH_OUTPUT_DIR")  # exit 2
        placing.check_devices(settings)  # fail fast, before any loading
        async with _join_nodes(settings, environ, log) as node:
            return await _run_node(settings, node, started, log, shutdown)


def _join_nodes(settings: Settings, environ: Mapping[str, str] | None, log):
    """The process group of a torchrun/srun launch (nothing on a single node)."""
    pipe, given = settings.pipeline, placing.given_roles(settings)
    drafter_devices = given.drafters if given else placing.candidate_devices(settings)
    return process_group(
        rank_info_from_env(os.environ if environ is None else environ),
        backend=pick_backend(pipe.dist_backend, drafter_devices),
        timeout_s=pipe.dist_timeout_s, silence_s=pipe.dist_silence_s, log=log,
    )  # fmt: skip


async def _run_node(settings: Settings, node: RankInfo, started: float, log, shutdown) -> int:
    """This node's part of the run (the whole run on a single node)."""
    with shutdown.interruptible():  # CPU only, files: an abandoned thread is harmless
        inputs = await writer_first(  # CPU only: files
            node, lambda: resolve_inputs(settings, log), timeout_s=settings.pipeline.dist_timeout_s
        )
        samples = await anyio.to_thread.run_sync(
            _read_data, settings, inputs, log, abandon_on_cancel=True
        )
        resume = await anyio.to_thread.run_sync(
            resume_point, settings, inputs, samples, Path(settings.output_dir), node,
            abandon_on_cancel=True,
        )  # fmt: skip
    if shutdown.requested:
        return _interrupted(shutdown, 0, log, node)
    cfg, output_dir = inputs.drafter_config, Path(settings.output_dir)
    log.info("run_started", target=inputs.target_path, data=inputs.data_path, samples=len(samples),
             drafter=cfg.__dict__)  # fmt: skip
    async with AsyncExitStack() as stack:
        with shutdown.interruptible():  # loading, placement, compile, capture
            workers = await _start_workers(stack, settings, inputs, samples, log, node=node)
            plan = workers.plan
            await resume.restore(workers.drafters, log, total_steps=plan.total_steps)
            log.info("startup_completed", startup_s=round(time.perf_counter() - started, 2),
                     total_steps=plan.total_steps)  # fmt: skip
            # Start-up leaves ~350k long-lived objects (torch, transformers, the target's
            # modules); a full collection that walks them all took 180-200 ms on the loop
            # (BENCHMARKS.md, issue 15). Frozen, collections during training see only what
            # training allocates. Process-wide: undone when the run ends.
            gc.freeze()
            stack.callback(gc.unfreeze)
        if not shutdown.requested:  # its task group lives in the stack, outside that scope
            evaluate = await stack.enter_async_context(
                _evaluator(settings, inputs, workers, output_dir, log)
            )
            if settings.eval.at_start and node.is_writer and resume.path is None:
                with shutdown.interruptible():
                    await evaluate(0)
        if shutdown.requested:  # nothing new to save: no step ran
            return _interrupted(shutdown, resume.step, log, node)
        steps, summary = await _train(
            settings, samples, plan, workers, evaluate, log, node=node, shutdown=shutdown,
            resume=resume,
        )  # fmt: skip
        if settings.eval.at_end and not shutdown.requested and node.is_writer:
            with shutdown.interruptible():
                summary["eval_tau"] = (await evaluate(steps, wait=True)).get("tau")
        if shutdown.requested:  # inside the stack: a hard exit does not wait for busy threads
            return _interrupted(shutdown, steps, log, node)
    if not node.is_writer:
        return 0
    log.info("train_completed", steps=steps, export=str(export_path(output_dir)),
             wall_s=round(time.perf_counter() - started, 2),
             **{k: summary[k] for k in ("loss", "acc", "tau_hat", "eval_tau") if k in summary})  # fmt: skip
    return 0


def _interrupted(shutdown: Shutdown, step: int, log, node: RankInfo) -> int:
    log.info("train_interrupted", step=step, reason=shutdown.reason)
    if node.distributed:  # leave the process group properly: the peers wait for this rank
        return shutdown.exit_code
    return shutdown.finish(shutdown.exit_code)


async def _train(
    settings, samples, plan: Plan, workers: Workers, evaluate, log, *, node, shutdown: Shutdown,
    resume: Resume,
):  # fmt: skip
    """The stage topology in data-flow order; returns (steps done, summary).
    On several nodes only rank 0 (the writer) saves and evaluates."""
    train, output_dir, first = settings.train, Path(settings.output_dir), workers.drafters[0]
    lag, summary, progress = LoopLag(), {}, Progress(resume.cursor)
    throughput = _throughput(settings, first.step.objective.drafter.config, workers, lag)
    send_records, receive_records = open_channel(4, "records")

    async def between_steps(step: int) -> None:  # periodic checkpoints and evaluations
        if not node.is_writer:
            return
        if train.save_every and step % train.save_every == 0 and step < plan.total_steps:
            await saver.save(step, progress.cursor)
        if settings.eval.every and step % settings.eval.every == 0 and step < plan.total_steps:
            with shutdown.interruptible():
                await evaluate(step)

    async def report() -> None:
        summary.update(await report_stage(
            receive_records, throughput, log, total_steps=plan.total_steps,
            tensorboard_dir=settings.log.tensorboard_dir,
        ))  # fmt: skip

    async with anyio.create_task_group() as background:
        saver = Saver(workers.drafters, output_dir, keep=train.keep_checkpoints, seed=train.seed,
                      run=resume.identity, tasks=background, log=log)  # fmt: skip
        saver.last_step = resume.step if resume.path else None
        background.start_soon(lag.run)
        background.start_soon(_produce, settings, samples, plan, workers, node, progress.cursor)
        async with anyio.create_task_group() as foreground:
            foreground.start_soon(report)
            steps = await train_steps(
                workers.drafters, workers.rings, send_records, first_step=resume.step,
                last_step=plan.total_steps, stop=shutdown.stopping, on_step_end=between_steps,
                across_nodes=NodeReducer() if node.distributed else None, progress=progress,
            )  # fmt: skip
        if node.is_writer and steps > resume.step:  # the final checkpoint, also after a signal
            await saver.save(steps, progress.cursor)
        await saver.close()
        background.cancel_scope.cancel()
    return steps, summary
