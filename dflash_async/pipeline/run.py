"""The whole run in one process: the map of the system.

    settings ──run_spec──> specs ──prepare_node──> inputs, samples, resume point (host)
                                 ──start_node───> Node: workers, rings, evaluator (devices)
    read ──packs──> target workers ──slots (a ring per drafter)──> drafter workers ──records──> report
                                                                   └─ between steps: save, eval

`run()` turns the settings into specs (pipeline/specs.py, the one reader of `Settings` below the
CLI), joins the other nodes, and `_run_node` starts the node (pipeline/startup.py) and trains it;
`_train` is the stage topology in data-flow order. Every task belongs to one task group: a
failure anywhere cancels everything and propagates; closing a channel is the end signal;
SIGINT/SIGTERM stop after the current step (start-up and evaluations at once), save, and exit
130/143 (shutdown.py).

Where new things plug in: a drafter kind is a model (model/), built by model/build.py from its
StepSpec; a target family is a packed forward chosen by targets/forward.py for target workers
(stages/produce.py); a new setting is read once, in pipeline/specs.py, into the spec of the code
that uses it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from contextlib import AsyncExitStack

import anyio

from dflash_async.checkpoint.resume import export_path
from dflash_async.model.flops import drafter_step_flops
from dflash_async.pipeline.distributed import (
    RankInfo,
    process_group,
    rank_info_from_env,
)
from dflash_async.pipeline.reducer import NodeReducer
from dflash_async.pipeline.shutdown import Shutdown
from dflash_async.pipeline.specs import RunSpec, run_spec
from dflash_async.pipeline.startup import Node, prepare_node, start_node
from dflash_async.runtime.channels import open_channel
from dflash_async.runtime.cpu_threads import pin_cpu_threads
from dflash_async.runtime.meters import LoopLag
from dflash_async.settings import Settings
from dflash_async.stages.chain import chain_stage
from dflash_async.stages.produce import target_stage
from dflash_async.stages.read import read_stage
from dflash_async.stages.report import GpuBusy, Throughput, report_stage
from dflash_async.stages.save import Saver
from dflash_async.stages.train import Progress, train_steps
from dflash_async.usage import check_writable_folder


async def run(
    settings: Settings,
    log,
    environ: Mapping[str, str] | None = None,
    *,
    shutdown: Shutdown | None = None,
    on_accepted: Callable[[], None] | None = None,
) -> int:
    """Train a drafter end to end; returns the exit code: 0, or 130/143 after SIGINT/SIGTERM
    (handled from this first line: shutdown.py; `python -m dflash_async run` passes a Shutdown
    that ends the process after a signal; without one, run returns the code).

    Under torchrun or srun (`environ` names the ranks) this node first joins the others.
    `on_accepted` is called once the resume point is known and checked (the run may write its
    folder from then on: runlog/record.py); a run refused or stopped before never calls it."""
    shutdown = shutdown or Shutdown(hard_exit=False)
    with shutdown.installed():
        await shutdown.attach()
        started = time.perf_counter()
        check_writable_folder(settings.output_dir, argument="DFLASH_OUTPUT_DIR")  # exit 2
        spec = run_spec(settings)  # exit 2 for bad devices or roles, before any loading
        pin_cpu_threads()  # the CPU's numerics from one state, whatever start-up then runs
        nodes = spec.nodes
        async with process_group(
            rank_info_from_env(os.environ if environ is None else environ),
            backend=nodes.backend,
            timeout_s=nodes.timeout_s,
            silence_s=nodes.silence_s,
            log=log,
        ) as rank:
            return await _run_node(spec, rank, started, log, shutdown, on_accepted=on_accepted)


async def _run_node(
    spec: RunSpec,
    rank: RankInfo,
    started: float,
    log,
    shutdown,
    *,
    on_accepted: Callable[[], None] | None = None,
) -> int:
    """This node's part of the run (the whole run on a single node)."""
    prepared = await prepare_node(spec, rank, log=log, shutdown=shutdown)
    if prepared is None:
        return _interrupted(shutdown, 0, log, rank)
    if on_accepted is not None:
        on_accepted()
    inputs = prepared.inputs
    log.info(
        "run_started",
        target=inputs.target_path,
        data=inputs.data_path,
        samples=len(prepared.samples),
        drafter=inputs.drafter_config.__dict__,
    )
    async with AsyncExitStack() as stack:
        node = await start_node(stack, prepared, log=log, shutdown=shutdown)
        if node is None:  # nothing new to save: no step ran
            return _interrupted(shutdown, prepared.resume.step, log, rank)
        log.info(
            "startup_completed",
            startup_s=round(time.perf_counter() - started, 2),
            total_steps=node.plan.total_steps,
        )
        if spec.eval.at_start and rank.is_writer and node.resume.path is None:
            with shutdown.interruptible():
                await node.evaluate(0)
        if shutdown.requested:
            return _interrupted(shutdown, node.resume.step, log, rank)
        steps, summary = await _train(node, log, shutdown=shutdown)
        if spec.eval.at_end and not shutdown.requested and rank.is_writer:
            with shutdown.interruptible():
                summary["eval_tau"] = (await node.evaluate(steps, wait=True)).get("tau")
        if shutdown.requested:  # inside the stack: a hard exit does not wait for busy threads
            return _interrupted(shutdown, steps, log, rank)
    if not rank.is_writer:
        return 0
    log.info(
        "train_completed",
        steps=steps,
        export=str(export_path(spec.output_dir)),
        wall_s=round(time.perf_counter() - started, 2),
        **{k: summary[k] for k in ("loss", "acc", "tau_hat", "eval_tau") if k in summary},
    )
    return 0


async def _train(node: Node, log, *, shutdown: Shutdown) -> tuple[int, dict]:
    """The stage topology in data-flow order: read -> packs -> targets -> rings -> train ->
    report, with save and eval between steps; returns (steps done, summary). On several nodes
    only rank 0 (the writer) evaluates and writes checkpoints, into which every other rank
    hands its own cursor and generators at the same steps (stages/save.py)."""
    spec, rank, resume, last = node.spec, node.rank, node.resume, node.plan.total_steps
    lag, summary, progress, start = LoopLag(), {}, Progress(resume.cursor), resume.cursor
    send_packs, receive_packs = open_channel(2 * len(node.targets), "packs")
    send_records, receive_records = open_channel(4, "records")

    async def produce() -> None:  # each target fills its home ring first, else one with room
        async with anyio.create_task_group() as producers:
            producers.start_soon(
                lambda: read_stage(
                    node.samples.lengths,
                    token_budget=spec.plan.token_budget,
                    seed=spec.plan.seed,
                    start=start,
                    epochs=node.plan.epochs,
                    send=send_packs,
                    rank=rank.rank,
                    world_size=rank.world_size,
                    first_plan=node.plan.first_epoch,
                )
            )
            for chain in node.chains:  # a split target: each replica a chain of stages
                producers.start_soon(
                    chain_stage,
                    chain,
                    node.samples,
                    receive_packs.clone(),
                    node.rings.producer(chain.home),
                )
            for worker, runner, home in (
                zip(node.targets, node.target_runners, node.homes, strict=True)
                if not node.chains
                else ()
            ):
                producers.start_soon(
                    target_stage,
                    worker,
                    runner,
                    node.samples,
                    receive_packs.clone(),
                    node.rings.producer(home),
                )
            receive_packs.close()
        node.rings.close()  # all producers done: the consumers drain the rings and stop

    async def between_steps(step: int) -> None:  # periodic checkpoints and evaluations
        if step >= last:
            return
        if spec.save.every and step % spec.save.every == 0:  # every rank: its part (save.py)
            await saver.save(step, progress.cursor)
        if not rank.is_writer:
            return
        if spec.eval.every and step % spec.eval.every == 0:
            with shutdown.interruptible():
                await node.evaluate(step)

    async def report() -> None:
        summary.update(
            await report_stage(
                receive_records,
                _throughput(node, lag),
                log,
                total_steps=last,
                tensorboard_dir=spec.tensorboard_dir,
            )
        )

    # Several nodes: one all-reduce a step, which also carries the stop vote and its signal
    across = NodeReducer(signal_of=lambda: shutdown.signum) if rank.distributed else None
    async with anyio.create_task_group() as background:
        saver = Saver(
            node.drafters,
            spec.output_dir,
            keep=spec.save.keep,
            seed=spec.step.seed,
            run=resume.identity,
            tasks=background,
            log=log,
            node=rank if rank.distributed else None,
            timeout_s=spec.nodes.timeout_s,
        )
        saver.last_step = resume.step if resume.path else None
        background.start_soon(lag.run)
        background.start_soon(produce)
        async with anyio.create_task_group() as foreground:
            foreground.start_soon(report)
            steps = await train_steps(
                node.drafters,
                node.rings,
                send_records,
                first_step=resume.step,
                last_step=last,
                stop=shutdown.stopping,
                on_step_end=between_steps,
                progress=progress,
                across_nodes=across,
            )
        if across is not None and across.agreed_signal is not None:  # a peer's signal, or ours
            shutdown.adopt(across.agreed_signal)  # every rank ends alike: save, 130/143
        if steps > resume.step:  # the final checkpoint, also after a signal (rank 0 writes it)
            await saver.save(steps, progress.cursor)
        await saver.close()
        background.cancel_scope.cancel()
    return steps, summary


def _throughput(node: Node, lag: LoopLag) -> Throughput:
    """The step line's rates, busy fractions and MFU over the node's workers."""
    step = node.spec.step
    targets = [(w, r.meter) for w, r in zip(node.targets, node.target_runners, strict=True)]
    drafters = [(r.worker, r.meter) for r in node.drafters]
    return Throughput(
        node.rings,
        targets,
        drafters,
        step.token_budget,
        step_flops=lambda pairs: drafter_step_flops(
            node.inputs.drafter_config,
            token_budget=step.token_budget,
            num_anchors=step.num_anchors,
            visible_pairs=pairs,
        ),
        loop_lag_ms=lag.read_max_ms,
        target_flops=node.target_flops,
        gpus=GpuBusy(targets + drafters),
    )


def _interrupted(shutdown: Shutdown, step: int, log, rank: RankInfo) -> int:
    log.info("train_interrupted", step=step, reason=shutdown.reason)
    if rank.distributed:  # leave the process group properly: the peers wait for this rank
        return shutdown.exit_code
    return shutdown.finish(shutdown.exit_code)
