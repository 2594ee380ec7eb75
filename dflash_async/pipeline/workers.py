"""Who runs where: the devices of a run, the roles the placement gives them, and their rings.

`placement.py` holds the decision and its cost model as pure functions; this module feeds it
what the machine and the settings say (device memory, the target's weight bytes, the drafter's
parameter count, stage rates estimated from FLOPs or measured by a short calibration) and turns
the decision into roles (which device runs a target worker, which a drafter worker, and which
ring each target fills first) and the slot rings (one per drafter, on its GPU when every target
can write there by peer copy, else in pinned host memory).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import anyio
import numpy as np
import torch
from transformers import AutoConfig

from dflash_async.data.packing import PackCursor, PackedBatch, plan_epoch
from dflash_async.data.samples import TokenizedSamples
from dflash_async.model.drafter import DFlashDrafter
from dflash_async.model.flops import drafter_step_flops, target_forward_flops
from dflash_async.pipeline import placement
from dflash_async.pipeline.devices import DeviceWorker, open_device_worker, parse_devices
from dflash_async.pipeline.meters import BusyMeter
from dflash_async.pipeline.rings import Notifier, RingSet, SlotRing
from dflash_async.pipeline.startup import RunInputs, build_drafter_step, check_device_combination
from dflash_async.settings import Settings, SettingsError
from dflash_async.stages import produce
from dflash_async.stages.read import PlannedPack

ASSUMED_TARGET_MFU = 0.5  # FLOP estimates before any measurement (docs/GPU.md: 0.36 .. 0.70)
ASSUMED_DRAFTER_MFU = 0.6  # (docs/GPU.md: 0.48 .. 0.67)


@dataclass(frozen=True)
class Roles:
    """Devices of the target and drafter workers; homes[i]: the ring target i fills first."""

    layout: placement.Layout
    targets: tuple[torch.device, ...]
    drafters: tuple[torch.device, ...]
    homes: tuple[int | None, ...]


def candidate_devices(settings: Settings) -> tuple[torch.device, ...]:
    """DFLASH_PIPELINE__DEVICES, else every visible GPU, else one cpu (SettingsError, exit 2,
    for a device this machine does not have)."""
    if settings.pipeline.devices:
        return parse_devices(settings.pipeline.devices, setting="DFLASH_PIPELINE__DEVICES")
    if torch.cuda.is_available():
        return tuple(torch.device("cuda", i) for i in range(torch.cuda.device_count()))
    return (torch.device("cpu"),)


def check_devices(settings: Settings) -> None:
    """SettingsError (exit 2) for a device of DEVICES / TARGET_DEVICES / DRAFTER_DEVICES that
    this machine does not have, or roles by hand that are not supported."""
    check_device_combination(settings.pipeline)
    given_roles(settings)
    candidate_devices(settings)


def given_roles(settings: Settings) -> Roles | None:
    """Roles set by hand (TARGET_DEVICES / DRAFTER_DEVICES; the unset one is DEVICES), or None."""
    pipe = settings.pipeline
    if not (pipe.target_devices or pipe.drafter_devices):
        return None
    default = candidate_devices(settings)
    targets = parse_devices(pipe.target_devices, setting="DFLASH_PIPELINE__TARGET_DEVICES")
    drafters = parse_devices(pipe.drafter_devices, setting="DFLASH_PIPELINE__DRAFTER_DEVICES")
    return roles_from_lists(targets or default, drafters or default)


def roles_from_lists(targets, drafters) -> Roles:
    """Equal lists are the colocated layout; otherwise a target's home is a drafter ring on its
    own device (each ring is the home of at most one target), else none."""
    free = list(range(len(drafters)))
    homes = []
    for device in targets:
        home = next((i for i in free if drafters[i] == device), None)
        if home is not None:
            free.remove(home)
        homes.append(home)
    layout = "colocated" if tuple(targets) == tuple(drafters) else "split"
    if any(t.type == "cuda" for t in targets) and any(d.type == "cpu" for d in drafters):
        raise SettingsError(  # see startup.check_device_combination
            f"DFLASH_PIPELINE__DEVICES: a split of {[str(t) for t in targets]} targets and "
            f"{[str(d) for d in drafters]} drafters puts a CPU drafter after a CUDA target; "
            "list only GPUs, or only cpu"
        )
    return Roles(layout, tuple(targets), tuple(drafters), tuple(homes))


async def place(settings, inputs: RunInputs, samples, *, target, runner, log) -> Roles:
    """The roles of every device: given by hand, or decided (auto: calibrated on device 0)."""
    pipe, budget = settings.pipeline, settings.train.token_budget
    given = given_roles(settings)
    if given is not None:
        log.info("placement", layout=given.layout, num_targets=len(given.targets),
                 num_drafters=len(given.drafters),
                 reason="roles given by DFLASH_PIPELINE__TARGET_DEVICES/DRAFTER_DEVICES")  # fmt: skip
        return given
    devices = candidate_devices(settings)
    flops = flops_per_token(settings, inputs, float(samples.lengths.mean()))
    rates = estimated_rates(*flops)
    # a repeated GPU holds several pairs; repeated cpu entries stand for separate devices
    pairs = max(devices.count(d) for d in devices) if devices[0].type == "cuda" else 1
    memory = memory_needs(settings, inputs, target.device).times(pairs)

    def choose(rates: placement.StageRates) -> placement.Placement:
        return placement.decide(pipe.layout, gpus=len(devices), rates=rates, memory=memory,
                                token_budget=budget, links=links(inputs, devices))  # fmt: skip

    decision = choose(rates)
    measure = pipe.calibration_packs > 0 and (len(devices) > 1 or devices[0].type == "cuda")
    started, timing = time.perf_counter(), {}
    if pipe.layout == "auto" and decision.layout == "colocated" and measure:
        async with open_device_worker(target.device, "calibration", grad_enabled=True) as drafter:
            measured = await calibrate(settings, inputs, samples, target=target, runner=runner,
                                       drafter=drafter, flops=flops)  # fmt: skip
        rates = measured or rates
        decision = choose(rates)
        timing = {"calibration_s": round(time.perf_counter() - started, 2)}
    log.info("placement", **decision.event_fields(rates, memory), **timing)
    return placed_roles(decision, devices)


def placed_roles(decision: placement.Placement, devices: tuple[torch.device, ...]) -> Roles:
    """colocated: a target and a drafter on every device; split: the first n_t devices targets."""
    if decision.layout == "colocated":
        return roles_from_lists(devices, devices)
    n = decision.num_targets
    return roles_from_lists(devices[:n], devices[n:])


def open_rings(
    roles: Roles, *, num_slots: int, token_budget: int, feature_dim: int, dtype: torch.dtype
) -> RingSet:
    """One ring per drafter, sharing one notifier: on the drafter's GPU when every target GPU
    can write there (same GPU, or peer access: NVLink/PCIe), else in pinned host memory."""
    changed = Notifier()
    rings = []
    for i, drafter in enumerate(roles.drafters):
        peer = drafter.type == "cuda" and all(
            t == drafter or (t.type == "cuda" and torch.cuda.can_device_access_peer(t, drafter))
            for t in roles.targets
        )
        device = drafter if peer else torch.device("cpu")
        rings.append(SlotRing(num_slots, token_budget=token_budget, feature_dim=feature_dim,
                              device=device, feature_dtype=dtype, name=f"slots{i}",
                              changed=changed))  # fmt: skip
    return RingSet(rings)


def links(inputs: RunInputs, devices: tuple[torch.device, ...]) -> placement.Links:
    """Gradient and feature bytes of this drafter; peer access between the first two GPUs."""
    cfg = inputs.drafter_config
    peer = len(devices) < 2 or (
        devices[0].type == devices[1].type == "cuda"
        and (devices[0] == devices[1] or torch.cuda.can_device_access_peer(devices[0], devices[1]))
    )
    return placement.Links(
        grad_bytes=4 * drafter_params(inputs),
        feature_bytes_per_token=cfg.num_features * cfg.hidden_size * 2,
        peer_access=peer,
    )


def drafter_params(inputs: RunInputs) -> int:
    """Trainable drafter parameters, counted on the meta device (no memory)."""
    with torch.device("meta"):
        return sum(p.numel() for p in DFlashDrafter(inputs.drafter_config).parameters())


def memory_needs(settings: Settings, inputs: RunInputs, device: torch.device):
    """placement.MemoryNeeds of this run on `device` (its total memory; unbounded on cpu)."""
    cfg, train = inputs.drafter_config, settings.train
    files = [
        *Path(inputs.target_path).glob("*.safetensors"),
        *Path(inputs.target_path).glob("*.bin"),
    ]
    frozen = cfg.vocab_size * cfg.hidden_size * 2  # embed + lm_head (tied ones counted twice)
    state, saved = placement.drafter_bytes(
        params=drafter_params(inputs), frozen_params=frozen, hidden=cfg.hidden_size,
        ffn=cfg.intermediate_size, layers=cfg.num_hidden_layers, vocab=cfg.vocab_size,
        num_features=cfg.num_features, token_budget=train.token_budget,
        num_anchors=train.num_anchors, block_size=cfg.block_size, ce_chunk=train.ce_chunk_size,
    )  # fmt: skip
    weights, transient = placement.target_bytes(
        weight_bytes=sum(f.stat().st_size for f in files), hidden=cfg.hidden_size,
        ffn=cfg.intermediate_size, num_features=cfg.num_features,
        token_budget=train.token_budget, batch_tokens=settings.pipeline.target_batch_tokens,
    )  # fmt: skip
    width = cfg.num_features * cfg.hidden_size
    ring = (
        settings.pipeline.num_slots
        * PackedBatch.empty(
            1, width, device=torch.device("meta"), feature_dtype=torch.bfloat16
        ).nbytes
        * train.token_budget
    )
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    return placement.MemoryNeeds(weights, transient, state, saved, ring, total)


def flops_per_token(settings: Settings, inputs: RunInputs, mean_doc_len: float):
    """(target, drafter) FLOPs per real token at this recipe, for the rate estimate and MFU."""
    cfg, train = inputs.drafter_config, settings.train
    text = AutoConfig.from_pretrained(inputs.target_path, local_files_only=True).get_text_config()
    target = target_forward_flops(
        text, layers_run=max(cfg.target_layer_ids) + 1, tokens=1,
        attention_pairs=(mean_doc_len + 1) / 2,
    )  # fmt: skip
    context = mean_doc_len / 2  # a uniform anchor sits mid-document on average
    pairs = train.num_anchors * cfg.block_size * (context + cfg.block_size)
    drafter = drafter_step_flops(cfg, token_budget=train.token_budget,
                                 num_anchors=train.num_anchors, visible_pairs=pairs)  # fmt: skip
    return target, drafter / train.token_budget


def target_pack_flops(inputs: RunInputs):
    """`flops(tokens, documents)` of the target's forward over one pack. The attention pairs
    assume documents of equal length (n(n+1)/2 each); attention is ~1-2% of the FLOPs at
    700-token documents, so unequal lengths move the total by well under 1%."""
    text = AutoConfig.from_pretrained(inputs.target_path, local_files_only=True).get_text_config()
    layers = max(inputs.drafter_config.target_layer_ids) + 1

    def flops(tokens: int, documents: int) -> float:
        pairs = tokens * (tokens / max(documents, 1) + 1) / 2
        return target_forward_flops(text, layers_run=layers, tokens=tokens, attention_pairs=pairs)

    return flops


def estimated_rates(target_fpt: float, drafter_fpt: float) -> placement.StageRates:
    """Stage rates from FLOPs at assumed MFUs: only the ratio matters before a measurement."""
    peak = placement.PEAK_FLOPS
    return placement.StageRates(
        ASSUMED_TARGET_MFU * peak / target_fpt, ASSUMED_DRAFTER_MFU * peak / drafter_fpt,
        source="flop_estimate", target_flops_per_token=target_fpt,
        drafter_flops_per_token=drafter_fpt,
    )  # fmt: skip


# ---- calibration: each stage alone, then both, on the first device ---------------------------


async def calibrate(
    settings: Settings,
    inputs: RunInputs,
    samples: TokenizedSamples,
    *,
    target: DeviceWorker,
    runner: produce.TargetRunner,
    drafter: DeviceWorker,
    flops: tuple[float, float],
) -> placement.StageRates | None:
    """Measured StageRates: `calibration_packs` packs through the target alone, through a
    throw-away drafter (built here, freed after; the run's drafters start fresh) alone, then
    through both at once on their threads. One warm-up pack first (compiling). None when the
    data holds fewer than two packs."""  # fmt: skip
    train = settings.train
    plan = await anyio.to_thread.run_sync(  # off the loop: seconds at millions of samples
        plan_epoch, samples.lengths, train.token_budget, train.seed, 0
    )
    k = min(settings.pipeline.calibration_packs, len(plan) - 1)
    if k < 1:
        return None
    plan = plan[: k + 1]
    packs = [PlannedPack(PackCursor(0, i), np.asarray(ix)) for i, ix in enumerate(plan)]
    tokens = float(np.mean([samples.lengths[p.indices].sum() for p in packs[1:]]))
    width = inputs.drafter_config.num_features * inputs.drafter_config.hidden_size
    slot = PackedBatch.empty(train.token_budget, width, device=target.device,
                             feature_dtype=runner.inputs.features.dtype)  # fmt: skip
    cuda = drafter.device.type == "cuda"
    step = await drafter.run(
        build_drafter_step, settings, inputs.drafter_config, inputs.target_path,
        device=drafter.device, rank=0, total_steps=1, compile=cuda and settings.train.compile,
    )  # fmt: skip
    fill = (_fill, runner, samples, packs[1:], slot)
    train_on = (_train_on, step, slot, k)
    await target.run(_fill, runner, samples, packs[:1], slot)  # warm-up: first calls compile
    await drafter.run(_train_on, step, slot, 1)
    target_s = await target.run(*fill)
    drafter_s = await drafter.run(*train_on)
    started = time.perf_counter()
    async with anyio.create_task_group() as both:
        both.start_soon(target.run, *fill)
        both.start_soon(drafter.run, *train_on)
    together_s = time.perf_counter() - started
    del fill, train_on, step  # the throw-away drafter's memory goes back before the run's start
    runner.meter = BusyMeter()  # the run's busy fractions start at its first step
    if cuda:
        await drafter.run(torch.cuda.empty_cache)
    t, d = k * tokens / target_s, k * tokens / drafter_s
    return placement.StageRates(
        t, d, overlap=placement.overlap_from(k * tokens / together_s, t, d), source="measured",
        target_flops_per_token=flops[0], drafter_flops_per_token=flops[1],
    )  # fmt: skip


def _fill(runner, samples, packs: list[PlannedPack], slot: PackedBatch) -> float:
    """Seconds of the target on `packs` (run in its worker)."""
    started = time.perf_counter()
    for pack in packs:
        produce.fill_slot(runner, produce.stage_inputs(runner, samples, pack), slot)
    return _finished(started)


def _train_on(step, slot: PackedBatch, n: int) -> float:
    """Seconds of `n` drafter steps on `slot` (run in its worker)."""
    started = time.perf_counter()
    for _ in range(n):
        step.batch.copy_(slot)
        step.phase_a()
        step.phase_b()
    return _finished(started)


def _finished(started: float) -> float:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # sync point: start-up calibration only (this thread's GPU)
    return time.perf_counter() - started
