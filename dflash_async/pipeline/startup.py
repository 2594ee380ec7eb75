"""Start-up: one node's run from its specs to one typed record, `Node`, before the first step.

Two phases, each interruptible by a signal (run.py):
1. `prepare_node` (CPU and files only): the checks of the target that need no model (its
   config.json's family, first of all), the target folder and corpus (the built-in tiny target
   and demo corpus when the paths are empty; built by rank 0 first), the drafter config derived
   from the target's, the tokenized samples, where the run resumes, and the warm start's weights
   (DFLASH_DRAFTER__INIT, read and checked unless the run resumes).
2. `start_node`: the worker threads. Target 0 loads first (placement may calibrate on it), the
   roles are placed, the other targets load, the run's length is planned and checked against the
   other nodes, each drafter's step is built (and captured) in its own thread, one device at a
   time, then given the warm start's weights or restored from the checkpoint; the slot rings
   and the evaluator come last.
Every thread and task is entered into the caller's AsyncExitStack, so leaving it stops them all.
"""

from __future__ import annotations

import gc
import json
import shutil
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import anyio
import torch
from transformers import AutoConfig

from dflash_async.checkpoint.ranks import broadcast_state
from dflash_async.checkpoint.resume import Resume, resume_point
from dflash_async.checkpoint.space import check_output_space
from dflash_async.checkpoint.state import data_fingerprint, restore, run_identity
from dflash_async.checkpoint.warm import InitWeights, load_init_weights, read_init_weights
from dflash_async.data.images import ImageTextSamples, data_has_images, load_image_samples
from dflash_async.data.samples import DataError, TokenizedSamples, load_samples
from dflash_async.errors import SettingsError
from dflash_async.log import get_logger
from dflash_async.model.drafter_config import DrafterConfig, DrafterSpec, drafter_config_from_target
from dflash_async.pipeline.distributed import (
    RankInfo,
    check_same_run,
    writer_decides,
    writer_first,
)
from dflash_async.pipeline.placement import placing, split_placement
from dflash_async.pipeline.shutdown import Shutdown
from dflash_async.pipeline.specs import RunSpec, fit_attention
from dflash_async.runtime.devices import DeviceWorker, open_device_worker
from dflash_async.runtime.rings import RingSet
from dflash_async.stages.chain import TargetChain, load_chain
from dflash_async.stages.evaluate import Evaluate, evaluation_off, open_run_evaluator
from dflash_async.stages.produce import TargetRunner, load_runner
from dflash_async.stages.read import Plan, first_epoch, plan_run
from dflash_async.stages.train import DrafterRunner, drafter_step_on
from dflash_async.targets.config_readers import text_config_of
from dflash_async.targets.families import unsupported_reason
from dflash_async.targets.generic_config import unknown_model_type
from dflash_async.targets.loading import TargetError, load_target_tokenizer
from dflash_async.targets.mask_token import mask_token
from dflash_async.targets.multimodal import load_target_processor, vision_problem


@dataclass(frozen=True)
class RunInputs:
    """The run's target, corpus and drafter shape, as found on disk."""

    target_path: str
    data_path: str
    builtin_target: bool
    drafter_config: DrafterConfig


@dataclass
class Prepared:
    """Phase 1's result: everything of the node that lives on the host."""

    spec: RunSpec
    rank: RankInfo
    inputs: RunInputs
    samples: TokenizedSamples
    resume: Resume
    init: InitWeights | None = None  # the warm start's weights, dropped once loaded (host memory)


@dataclass
class Node:
    """The running node: its inputs, plan, workers, rings, resume point and evaluator."""

    spec: RunSpec
    rank: RankInfo
    inputs: RunInputs
    samples: TokenizedSamples
    resume: Resume
    plan: Plan
    targets: list[DeviceWorker]
    target_runners: list[TargetRunner]
    homes: tuple[int | None, ...]  # per target: the ring it fills first
    drafters: list[DrafterRunner]
    rings: RingSet
    target_flops: Callable[[int, int], float]  # (tokens, documents) -> one pack's target FLOPs
    # `await evaluate(step)`: tau now; a no-op when evaluation is off (and until start_node
    # opens the evaluator, its last act)
    evaluate: Evaluate = evaluation_off
    chains: list[TargetChain] = field(default_factory=list)  # a split target's replicas (or none)


async def prepare_node(
    spec: RunSpec, rank: RankInfo, *, log, shutdown: Shutdown
) -> Prepared | None:
    """Phase 1: inputs (rank 0 first), tokenized samples and the resume point, in threads;
    None after a signal (CPU only and files: an abandoned thread is harmless)."""
    with shutdown.interruptible():
        prepared = await _prepare(spec, rank, log)
    return None if shutdown.requested else prepared


async def _prepare(spec: RunSpec, rank: RankInfo, log) -> Prepared:
    """Phase 1 (see prepare_node). A run refused here (bad data, a resume point or warm start
    that does not fit) leaves nothing in OUTPUT_DIR: the run's own tokenized-data cache
    (OUTPUT_DIR/cache, the default), when this run created it, goes with the refusal."""
    run_cache = spec.data.cache_dir == str(spec.output_dir / "cache")
    created = run_cache and rank.is_writer and not Path(spec.data.cache_dir).exists()
    try:
        return await _prepare_inputs(spec, rank, log)
    except BaseException:
        if created:
            shutil.rmtree(spec.data.cache_dir, ignore_errors=True)
        raise


async def _prepare_inputs(spec: RunSpec, rank: RankInfo, log) -> Prepared:
    inputs = await writer_first(  # CPU only: files
        rank, lambda: resolve_inputs(spec, log), timeout_s=spec.nodes.timeout_s
    )
    spec = fit_attention(spec, head_dim=inputs.drafter_config.head_dim, log=log)
    samples = await anyio.to_thread.run_sync(
        read_samples, spec, inputs, log, abandon_on_cancel=True
    )

    def identity() -> dict:
        fingerprint = data_fingerprint(samples.tokens, samples.loss_mask, samples.offsets)
        return run_identity(
            spec.step,
            inputs.drafter_config,
            target_path=inputs.target_path,
            data=fingerprint,
            world_size=rank.world_size,
        )

    run = await anyio.to_thread.run_sync(identity, abandon_on_cancel=True)

    def decide() -> tuple[Resume, dict]:  # rank 0: it owns the folder and reads the checkpoint
        point = resume_point(spec.save.resume, run, spec.output_dir)
        return point, point.shared()

    # Every rank resumes alike or is refused alike (exit 2): rank 0 decides (a wait on it).
    point, shared = await writer_decides(rank, "resume", decide, timeout_s=spec.nodes.timeout_s)
    if not rank.is_writer:
        point = Resume.of_rank(shared, run, rank=rank.rank)
    init = await anyio.to_thread.run_sync(  # CPU only: files
        lambda: init_weights(spec.drafter, inputs.drafter_config, resume=point, log=log),
        abandon_on_cancel=True,
    )
    return Prepared(spec, rank, inputs, samples, point, init)


def init_weights(
    spec: DrafterSpec, config: DrafterConfig, *, resume: Resume, log
) -> InitWeights | None:
    """The warm start's weights (exit 2 unless they fit this run's drafter); None without
    DFLASH_DRAFTER__INIT, or when the run resumes a checkpoint: the resume wins (its weights are
    this run's own, trained on from INIT or not), and INIT is ignored with a log line."""
    if spec.init is None:
        return None
    if resume.path is not None:
        log.info(
            "drafter_init_ignored",
            path=str(spec.init),
            resumed=str(resume.path),
            reason="the run resumes its checkpoint",
        )
        return None
    return read_init_weights(spec.init, config)


def resolve_inputs(spec: RunSpec, log) -> RunInputs:
    """Target folder, data path and drafter config (builds the tiny target/corpus if needed)."""
    from dflash_async.eval.regenerate import demo_corpus
    from dflash_async.targets.tiny import builtin_cache_dir, ensure_tiny_target

    builtin = not spec.target_path
    if not builtin:
        check_target_config(spec.target_path)
    target_path = str(ensure_tiny_target(builtin_cache_dir())) if builtin else spec.target_path
    # the drafter's shape, the mask token and the family need the config and the tokenizer
    # only: checked before the demo corpus is regenerated with the target (minutes)
    config = drafter_config_for(spec.drafter, target_path, builtin)
    data_path = spec.data_path
    if not data_path:
        data_path = str(demo_corpus(builtin_cache_dir(), target_path, n_train=512))
        log.info("demo_corpus_ready", path=data_path, target=target_path)
    return RunInputs(target_path, data_path, builtin, config)


def check_target_config(target_path: str) -> None:
    """The target checks that need no model, from config.json as JSON: it exists and parses,
    transformers knows its model_type (else the line names the installed version), and
    targets/families.py's table or the generic path can run it with its quantization.
    TargetError or SettingsError (exit 2)."""
    config_file = Path(target_path) / "config.json"
    if not config_file.is_file():
        raise TargetError(f"target folder {target_path!r} has no config.json")
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TargetError(f"cannot read {config_file}: {e}") from e
    if not isinstance(raw, dict):
        raise TargetError(f"{config_file} is not a JSON object")
    unknown = unknown_model_type(target_path)
    if unknown:
        raise SettingsError(f"{unknown}; DFLASH_TARGET__PATH={target_path!r}")
    unsupported = unsupported_reason(SimpleNamespace(**raw))
    if unsupported:
        raise SettingsError(f"{unsupported}; DFLASH_TARGET__PATH={target_path!r}")


def drafter_config_for(spec: DrafterSpec, target_path: str, builtin: bool) -> DrafterConfig:
    """The drafter's shapes from the target's config.json and the drafter's own settings; a
    target no family or the generic path can run (targets/families.unsupported_reason), or
    whose model_type transformers does not know, is SettingsError (exit 2) naming it.
    The mask token, unless set, is the target tokenizer's (targets/mask_token.py; the built-in
    target's `<|mask|>` by its first rule), logged with the rule that chose it."""
    if Path(target_path).is_dir() and not (Path(target_path) / "config.json").is_file():
        raise TargetError(f"target folder {target_path!r} has no config.json")
    unknown = unknown_model_type(target_path) if Path(target_path).is_dir() else None
    if unknown:
        raise SettingsError(f"{unknown}; DFLASH_TARGET__PATH={target_path!r}")
    try:
        target_config = AutoConfig.from_pretrained(target_path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise TargetError(f"cannot read the config of target {target_path!r}: {e}") from e
    unsupported = unsupported_reason(target_config)
    if unsupported:
        raise SettingsError(f"{unsupported}; DFLASH_TARGET__PATH={target_path!r}")
    mask_token_id = spec.mask_token_id
    if mask_token_id is None:
        vocab = text_config_of(target_config).vocab_size
        found = mask_token(load_target_tokenizer(target_path), vocab_size=vocab)
        if found is None:
            raise SettingsError(
                f"target {target_path!r}: its tokenizer has no mask token, no spare embedding "
                "row and no unused special token; set DFLASH_DRAFTER__MASK_TOKEN_ID to an id "
                "the data never contains"
            )
        get_logger(__name__).info(
            "mask_token_chosen", id=found.id, token=found.token, rule=found.rule, builtin=builtin
        )
        mask_token_id = found.id
    try:
        return drafter_config_from_target(
            target_config,
            num_hidden_layers=spec.num_layers,
            num_features=spec.num_features,
            block_size=spec.block_size,
            mask_token_id=mask_token_id,
            target_layer_ids=spec.target_layer_ids,
            **spec.variant_fields(),
        )
    except ValueError as e:  # the target cannot host this drafter: name the settings involved
        raise SettingsError(
            f"drafter for target {target_path!r}: {e} (see DFLASH_TARGET__NUM_FEATURES, "
            "DFLASH_TARGET__TARGET_LAYER_IDS, DFLASH_DRAFTER__MASK_TOKEN_ID)"
        ) from None


def read_samples(spec: RunSpec, inputs: RunInputs, log) -> TokenizedSamples:
    """The corpus tokenized with the target's tokenizer (DataError for an id past its vocab);
    data with image records through the target's processor (read_image_data)."""
    if data_has_images(inputs.data_path):
        samples = read_image_data(spec, inputs, log)
    else:
        tokenizer = load_target_tokenizer(inputs.target_path)
        samples = load_samples(
            inputs.data_path,
            tokenizer,
            options=spec.data,
            block_size=spec.drafter.block_size,
            log=log,
        )
    vocab = inputs.drafter_config.vocab_size
    if samples.max_token_id >= vocab:  # would index past the embedding
        raise DataError(
            f"{inputs.data_path}: token id {samples.max_token_id} is outside the target's "
            f"vocabulary ({vocab} ids)"
        )
    return samples


def read_image_data(spec: RunSpec, inputs: RunInputs, log) -> ImageTextSamples:
    """Image+text samples (data/images.py) through the target folder's processor, for a
    multimodal target run whole (targets/multimodal.py); what that path does not cover is
    refused first (exit 2), before any model loads."""
    where = f"DFLASH_DATA__PATH={inputs.data_path!r} holds image records"
    problem = vision_problem(AutoConfig.from_pretrained(inputs.target_path, local_files_only=True))
    if problem:
        raise SettingsError(f"{where}: {problem}; DFLASH_TARGET__PATH={inputs.target_path!r}")
    t = spec.target
    refused = {
        "DFLASH_TARGET__STAGES": t.stages != 1,
        "DFLASH_TARGET__QUANTIZE": t.quantize != "none",
    }
    for name, on in refused.items():
        if on:
            raise SettingsError(f"{where}: {name} is not supported with image data yet")
    processor = load_target_processor(inputs.target_path)
    return load_image_samples(
        inputs.data_path,
        processor,
        options=spec.data,
        block_size=spec.drafter.block_size,
        log=log,
    )


async def start_node(
    stack: AsyncExitStack, prepared: Prepared, *, log, shutdown: Shutdown
) -> Node | None:
    """Phase 2: the worker threads, placed, loaded, built and restored, then the evaluator (see
    the module doc); None after a signal (loading, compile and capture stop at once)."""
    with shutdown.interruptible():
        node = await _start_workers(stack, prepared, log)
    if shutdown.requested:
        return None
    # Entered outside the interruptible scope: the evaluator's task group lives in the stack.
    node.evaluate = await stack.enter_async_context(
        open_run_evaluator(
            node.spec.eval,
            inputs=node.inputs,
            target_worker=node.targets[0],
            target_model=node.target_runners[0].model,
            drafter=node.drafters[0],
            output_dir=node.spec.output_dir,
            log=log,
        )
    )
    return node


async def _start_workers(stack: AsyncExitStack, prepared: Prepared, log) -> Node:
    spec, rank, inputs, samples = prepared.spec, prepared.rank, prepared.inputs, prepared.samples
    cfg, place = inputs.drafter_config, spec.placement

    async def open_worker(device: torch.device, name: str, grad: bool) -> DeviceWorker:
        return await stack.enter_async_context(open_device_worker(device, name, grad_enabled=grad))

    async def load(worker: DeviceWorker) -> TargetRunner:
        return await worker.run(
            load_runner,
            inputs.target_path,
            spec=spec.target,
            device=worker.device,
            layer_ids=cfg.captured_layer_ids,
            images=isinstance(samples, ImageTextSamples),
        )

    first = await anyio.to_thread.run_sync(  # off the loop: seconds at millions of samples
        lambda: first_epoch(spec.plan, samples.lengths, rank=rank.rank, world_size=rank.world_size)
    )
    chains = []
    if spec.target.stages > 1:  # a split target: chains of stage workers (stages/chain.py)
        roles, chains = await _start_chains(spec, inputs, open_worker, log)
        targets = [s.worker for c in chains for s in c.stages]
        runners = [s.runner for c in chains for s in c.stages]
    else:
        targets = [await open_worker(place.first_device, "target0", False)]
        runners = [await load(targets[0])]
        roles = await placing.place(
            place,
            spec.step,
            cfg,
            samples,
            first,
            target_path=inputs.target_path,
            target=targets[0],
            runner=runners[0],
            log=log,
        )
    for i, device in enumerate(roles.targets[len(targets) :], start=len(targets)):
        targets.append(await open_worker(device, f"target{i}", False))
        runners.append(await load(targets[-1]))
    plan = await _plan_and_check(prepared, first, num_drafters=len(roles.drafters))
    workers = [await open_worker(d, f"drafter{i}", True) for i, d in enumerate(roles.drafters)]
    drafters = await _start_drafters(spec, inputs, workers, plan.total_steps, rank, log)
    if rank.is_writer:  # the one writer of the output folder: exit 2 if it cannot hold a run
        _check_space(spec, drafters[0], cfg, log)
    await _warm_start(prepared, drafters, log)
    await _restore(prepared, drafters, log, total_steps=plan.total_steps)
    feature_dtype = torch.bfloat16 if place.first_device.type == "cuda" else torch.float32
    rings = placing.open_rings(
        roles,
        num_slots=place.num_slots,
        token_budget=spec.step.token_budget,
        feature_dim=cfg.feature_width,
        dtype=feature_dtype,
    )
    # Start-up leaves ~350k long-lived objects (torch, transformers, the target's modules); a
    # full collection that walks them all took 180-200 ms on the loop (BENCHMARKS.md).
    # Frozen, collections during training see only what training allocates. Process-wide:
    # undone when the run ends.
    gc.freeze()
    stack.callback(gc.unfreeze)
    flops = placing.target_pack_flops(cfg, inputs.target_path)
    return Node(
        spec,
        rank,
        inputs,
        samples,
        prepared.resume,
        plan,
        targets,
        runners,
        roles.homes,
        drafters,
        rings,
        flops,
        chains=chains,
    )


async def _start_chains(spec: RunSpec, inputs: RunInputs, open_worker, log):
    """Placed replicas x stages (exit 2 when a device cannot hold its share), then each
    replica's chain of stage workers, loaded one replica at a time."""
    t, cfg, stages = spec.target, inputs.drafter_config, spec.target.stages
    roles, groups, homes = split_placement.place_split(
        spec.placement,
        spec.step,
        cfg,
        target_path=inputs.target_path,
        stages=stages,
        dtype=t.dtype_on(spec.placement.devices[0]),
        log=log,
    )
    chains = []
    for r, (group, home) in enumerate(zip(groups, homes, strict=True)):
        workers = [await open_worker(d, f"target{r}.{s}", False) for s, d in enumerate(group)]
        chain = await load_chain(
            inputs.target_path, workers, spec=t, layer_ids=cfg.captured_layer_ids, log=log
        )
        chain.home = home
        chains.append(chain)
    return roles, chains


def _check_space(spec: RunSpec, drafter: DrafterRunner, cfg: DrafterConfig, log) -> None:
    """SettingsError before the first step unless the output filesystem holds the run's
    checkpoints and export (checkpoint/space.py); sizes from the built drafter (no sync)."""
    needed = check_output_space(spec.output_dir, drafter.step, cfg, keep=spec.save.keep)
    log.info("output_space_checked", path=str(spec.output_dir), needed_bytes=needed)


async def _plan_and_check(prepared: Prepared, first, *, num_drafters: int) -> Plan:
    """The run's length, then the same facts on every node (a check that waits on the peers)."""
    spec, rank, samples = prepared.spec, prepared.rank, prepared.samples
    plan = plan_run(spec.plan, first, num_drafters=num_drafters)
    await anyio.to_thread.run_sync(
        lambda: check_same_run(
            rank,
            timeout_s=spec.nodes.timeout_s,
            samples=len(samples),
            tokens=int(samples.lengths.sum()),
            drafters=num_drafters,
            total_steps=plan.total_steps,
        )
    )
    return plan


async def _start_drafters(
    spec: RunSpec,
    inputs: RunInputs,
    workers: list[DeviceWorker],
    total_steps: int,
    rank: RankInfo,
    log,
) -> list[DrafterRunner]:
    """Build each drafter in its own thread; capture graphs one device at a time. Anchors are
    drawn per drafter of the whole run (node rank * drafters per node + local index)."""
    runners = []
    for i, worker in enumerate(workers):  # one at a time: compile/capture not thread-safe
        started = time.perf_counter()
        step = await worker.run(
            drafter_step_on,
            worker.device,
            spec.step,
            inputs.drafter_config,
            target_path=inputs.target_path,
            rank=rank.rank * len(workers) + i,
            total_steps=total_steps,
            random_seed=spec.target.random_seed,
        )
        timings = {}  # warmup_s includes compiling and autotuning (the first calls)
        if spec.step.cuda_graph:
            timings = await worker.run(step.capture)
        log.info(
            "drafter_ready",
            device=str(worker.device),
            graph=step.graphs is not None,
            **{k: round(v, 2) for k, v in timings.items()},
            startup_s=round(time.perf_counter() - started, 2),
        )
        runners.append(
            DrafterRunner(worker, step, seed=spec.step.seed, node=(rank.rank, rank.world_size))
        )
    return runners


async def _warm_start(prepared: Prepared, drafters: list[DrafterRunner], log) -> None:
    """Give every drafter the warm start's weights (in its thread, after capture, in place),
    then drop the host copy; a no-op without one (checkpoint/warm.py)."""
    init, prepared.init = prepared.init, None
    if init is None:
        return
    for runner in drafters:
        tensors = await runner.worker.run(load_init_weights, runner.step, init)
    log.info(
        "drafter_initialized",
        path=str(init.path),
        kind=init.kind,
        tensors=tensors,
        stored_dtype=init.stored_dtype,
        drafters=len(drafters),
    )


async def _restore(
    prepared: Prepared, drafters: list[DrafterRunner], log, *, total_steps: int
) -> None:
    """Check the placed plan against the checkpoint's, then put every drafter (in its thread,
    after capture, in place) back to the checkpoint's state. Several ranks: rank 0 checks (the
    others are refused alike) and hands its checkpoint to every rank (ranks.broadcast_state)."""
    resume, rank, timeout_s = prepared.resume, prepared.rank, prepared.spec.nodes.timeout_s
    plan = {"total_steps": total_steps, "num_drafters": len(drafters)}
    state, _ = await writer_decides(
        rank, "resume_placed", lambda: (resume.placed(**plan), None), timeout_s=timeout_s
    )
    if not rank.is_writer:
        resume.placed(**plan)  # the identity this rank holds; rank 0 checked it
    if resume.path is None:
        return
    if rank.distributed:  # sync points: one broadcast per tensor, at start-up
        first = drafters[0].worker
        state = await first.run(
            broadcast_state, state, rank, device=first.device, timeout_s=timeout_s
        )
    for i, runner in enumerate(drafters):
        await runner.worker.run(restore, runner.step, state, rank=i, node=rank.rank)
    log.info(
        "resumed",
        step=resume.step,
        epoch=resume.cursor.epoch,
        pack=resume.cursor.index,
        path=str(resume.path),
    )
