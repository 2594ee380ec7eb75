"""Who runs where: the devices of a run, the roles the placement gives them, and their rings.

`placement.py` holds the decision and its cost model as pure functions; this module feeds it
what the machine and the settings say (device memory, the target's weight bytes, the drafter's
parameter count, stage rates estimated from FLOPs or measured by calibration.py) and turns the
decision into roles (which device runs a target worker, which a drafter worker, and which ring
each target fills first) and the slot rings (one per drafter, on its GPU when every target can
write there by peer copy, else in pinned host memory).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig

from dflash_async.data.packing import PackedBatch
from dflash_async.data.samples import TokenizedSamples
from dflash_async.errors import SettingsError
from dflash_async.model.build import StepSpec
from dflash_async.model.drafter_config import DrafterConfig
from dflash_async.model.flops import drafter_step_flops, target_forward_flops
from dflash_async.model.kinds import kind_of
from dflash_async.pipeline import placement
from dflash_async.pipeline.placement.calibration import calibrate
from dflash_async.runtime.devices import DeviceWorker, open_device_worker, parse_devices
from dflash_async.runtime.rings import Notifier, RingSet, SlotRing
from dflash_async.stages.produce import TargetRunner
from dflash_async.targets.random_weights import held_bytes

ASSUMED_TARGET_MFU = 0.5  # FLOP estimates before any measurement (docs/GPU.md: 0.36 .. 0.70)
ASSUMED_DRAFTER_MFU = 0.6  # (docs/GPU.md: 0.48 .. 0.67)


@dataclass(frozen=True)
class Roles:
    """Devices of the target and drafter workers; homes[i]: the ring target i fills first."""

    layout: placement.Layout
    targets: tuple[torch.device, ...]
    drafters: tuple[torch.device, ...]
    homes: tuple[int | None, ...]


@dataclass(frozen=True)
class PlacementSpec:
    """Where the workers may run and how the placement decides (settings/sections.py: DFLASH_PIPELINE__*)."""

    layout: placement.Layout  # auto | colocated | split
    devices: tuple[torch.device, ...]  # the candidates: DEVICES, else every GPU, else one cpu
    given: Roles | None  # roles by hand (TARGET_DEVICES / DRAFTER_DEVICES), else decided
    num_slots: int  # per drafter ring
    target_batch_tokens: int
    calibration_packs: int  # 0: decide from FLOP estimates alone

    @property
    def first_device(self) -> torch.device:
        """Where target 0 loads: the first given target device, else the first candidate."""
        return (self.given.targets if self.given else self.devices)[0]

    @property
    def drafter_devices(self) -> tuple[torch.device, ...]:
        """The drafters' devices as far as known before placing (their type is what counts)."""
        return self.given.drafters if self.given else self.devices


def candidate_devices(
    devices: Sequence[str], *, visible_gpus: int | None = None
) -> tuple[torch.device, ...]:
    """DFLASH_PIPELINE__DEVICES, else every visible GPU (`visible_gpus`: this machine's count
    unless given), else one cpu (SettingsError, exit 2, for a device this machine does not have)."""
    if devices:
        return parse_devices(devices, setting="DFLASH_PIPELINE__DEVICES")
    if visible_gpus is None:
        visible_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible_gpus:
        return tuple(torch.device("cuda", i) for i in range(visible_gpus))
    return (torch.device("cpu"),)


def given_roles(
    target_devices: Sequence[str],
    drafter_devices: Sequence[str],
    *,
    default: tuple[torch.device, ...],
) -> Roles | None:
    """Roles set by hand (TARGET_DEVICES / DRAFTER_DEVICES; the unset one is `default`), or
    None; SettingsError (exit 2) for a device this machine lacks or a CPU drafter after a CUDA
    target (the hidden-state slots would be read before the target's GPU copies land)."""
    if not (target_devices or drafter_devices):
        return None
    # Checked on the names first: the refusal holds on a machine without the GPU named.
    if "cpu" in drafter_devices and any(d != "cpu" for d in target_devices):
        raise SettingsError(
            f"DFLASH_PIPELINE__TARGET_DEVICES={','.join(target_devices)} with "
            f"DFLASH_PIPELINE__DRAFTER_DEVICES={','.join(drafter_devices)}: a CPU "
            "drafter cannot follow a CUDA target (it would read hidden-state slots before the "
            "target's GPU copies land); put every drafter on a GPU, or the targets on cpu"
        )
    targets = parse_devices(target_devices, setting="DFLASH_PIPELINE__TARGET_DEVICES")
    drafters = parse_devices(drafter_devices, setting="DFLASH_PIPELINE__DRAFTER_DEVICES")
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
        raise SettingsError(  # see given_roles
            f"DFLASH_PIPELINE__DEVICES: a split of {[str(t) for t in targets]} targets and "
            f"{[str(d) for d in drafters]} drafters puts a CPU drafter after a CUDA target; "
            "list only GPUs, or only cpu"
        )
    return Roles(layout, tuple(targets), tuple(drafters), tuple(homes))


async def place(
    spec: PlacementSpec,
    step: StepSpec,
    config: DrafterConfig,
    samples: TokenizedSamples,
    first_epoch: list[np.ndarray],
    *,
    target_path: str,
    target: DeviceWorker,
    runner: TargetRunner,
    log,
) -> Roles:
    """The roles of every device: given by hand, or decided (auto: calibrated on device 0)."""
    if spec.given is not None:
        given = spec.given
        log.info(
            "placement",
            layout=given.layout,
            num_targets=len(given.targets),
            num_drafters=len(given.drafters),
            reason="roles given by DFLASH_PIPELINE__TARGET_DEVICES/DRAFTER_DEVICES",
        )
        return given
    devices = spec.devices
    flops = flops_per_token(step, config, target_path, float(samples.lengths.mean()))
    rates = estimated_rates(*flops)
    # a repeated GPU holds several pairs; repeated cpu entries stand for separate devices
    pairs = max(devices.count(d) for d in devices) if devices[0].type == "cuda" else 1
    random = getattr(runner, "random_seed", None) is not None  # no files: what it holds
    loaded = held_bytes(runner.model) if random else None
    memory = memory_needs(
        spec, step, config, target_path, target.device, weight_bytes=loaded
    ).times(pairs)

    def choose(rates: placement.StageRates) -> placement.Placement:
        return placement.decide(
            spec.layout,
            gpus=len(devices),
            rates=rates,
            memory=memory,
            token_budget=step.token_budget,
            links=links(config, devices),
        )

    decision = choose(rates)
    measure = spec.calibration_packs > 0 and (len(devices) > 1 or devices[0].type == "cuda")
    started, timing = time.perf_counter(), {}
    if spec.layout == "auto" and decision.layout == "colocated" and measure:
        async with open_device_worker(target.device, "calibration", grad_enabled=True) as drafter:
            measured = await calibrate(
                step,
                config,
                samples,
                first_epoch,
                packs=spec.calibration_packs,
                target_path=target_path,
                target=target,
                runner=runner,
                drafter=drafter,
                flops=flops,
            )
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
        rings.append(
            SlotRing(
                num_slots,
                token_budget=token_budget,
                feature_dim=feature_dim,
                device=device,
                feature_dtype=dtype,
                name=f"slots{i}",
                changed=changed,
            )
        )
    return RingSet(rings)


def links(config: DrafterConfig, devices: tuple[torch.device, ...]) -> placement.Links:
    """Gradient and feature bytes of this drafter; peer access between the first two GPUs."""
    peer = len(devices) < 2 or (
        devices[0].type == devices[1].type == "cuda"
        and (devices[0] == devices[1] or torch.cuda.can_device_access_peer(devices[0], devices[1]))
    )
    return placement.Links(
        grad_bytes=4 * drafter_params(config),
        feature_bytes_per_token=config.feature_width * 2,
        peer_access=peer,
    )


def drafter_params(config: DrafterConfig) -> int:
    """Trainable drafter parameters, counted on the meta device (no memory)."""
    with torch.device("meta"):
        return sum(p.numel() for p in kind_of(config.kind).make_drafter(config).parameters())


def memory_needs(
    spec: PlacementSpec,
    step: StepSpec,
    config: DrafterConfig,
    target_path: str,
    device: torch.device,
    *,
    weight_bytes: int | None = None,
) -> placement.MemoryNeeds:
    """placement.MemoryNeeds of this run on `device` (its total memory; unbounded on cpu).
    The target's weight bytes are its files' unless given (a random target: what it holds).
    Its `length_bytes`: the needs at this token budget less the needs at none, what the pack
    length costs (named in the error when nothing fits)."""
    files = [*Path(target_path).glob("*.safetensors"), *Path(target_path).glob("*.bin")]
    if weight_bytes is None:
        weight_bytes = sum(f.stat().st_size for f in files)
    needs = _needs_at(spec, step, config, weight_bytes, step.token_budget)
    none = _needs_at(spec, step, config, weight_bytes, 0)
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    staging = step.token_budget * config.feature_width * 2
    return placement.MemoryNeeds(
        *needs,
        device_bytes=total,
        token_budget=step.token_budget,
        length_bytes=sum(needs) - sum(none) - staging,
        target_staging=staging,
    )


def _needs_at(
    spec: PlacementSpec, step: StepSpec, cfg: DrafterConfig, weight_bytes: int, budget: int
) -> tuple[float, float, float, float, float]:
    """(target weights, target activations, drafter state, drafter activations, ring) in bytes
    at a pack length of `budget` rows."""
    frozen = cfg.vocab_size * cfg.hidden_size * 2  # embed + lm_head (tied ones counted twice)
    state, saved = placement.drafter_bytes(
        params=drafter_params(cfg),
        frozen_params=frozen,
        hidden=cfg.hidden_size,
        ffn=cfg.intermediate_size,
        layers=cfg.num_hidden_layers,
        vocab=cfg.vocab_size,
        num_features=cfg.num_features,
        token_budget=budget,
        num_anchors=step.num_anchors,
        block_size=cfg.block_size,
        ce_chunk=step.ce_chunk_size,
        kv_width=cfg.num_key_value_heads * cfg.head_dim,
    )
    weights, transient = placement.target_bytes(
        weight_bytes=weight_bytes,
        hidden=cfg.hidden_size,
        ffn=cfg.intermediate_size,
        feature_width=cfg.feature_width,
        token_budget=budget,
        # the packed forwards run the pack whole; the HF fallback in target batches
        batch_tokens=max(spec.target_batch_tokens, budget),
    )
    width = cfg.feature_width
    row = PackedBatch.empty(1, width, device=torch.device("meta"), feature_dtype=torch.bfloat16)
    ring = spec.num_slots * row.nbytes * budget
    return weights, transient, state, saved, ring


def flops_per_token(
    step: StepSpec, config: DrafterConfig, target_path: str, mean_doc_len: float
) -> tuple[float, float]:
    """(target, drafter) FLOPs per real token at this recipe, for the rate estimate and MFU."""
    cfg = config
    text = AutoConfig.from_pretrained(target_path, local_files_only=True).get_text_config()
    target = target_forward_flops(
        text,
        layers_run=max(cfg.captured_layer_ids) + 1,
        tokens=1,
        attention_pairs=(mean_doc_len + 1) / 2,
    )
    context = mean_doc_len / 2  # a uniform anchor sits mid-document on average
    pairs = step.num_anchors * cfg.block_size * (context + cfg.block_size)
    drafter = drafter_step_flops(
        cfg, token_budget=step.token_budget, num_anchors=step.num_anchors, visible_pairs=pairs
    )
    return target, drafter / step.token_budget


def target_pack_flops(config: DrafterConfig, target_path: str):
    """`flops(tokens, documents)` of the target's forward over one pack. The attention pairs
    assume documents of equal length (n(n+1)/2 each); attention is ~1-2% of the FLOPs at
    700-token documents, so unequal lengths move the total by well under 1%."""
    text = AutoConfig.from_pretrained(target_path, local_files_only=True).get_text_config()
    layers = max(config.captured_layer_ids) + 1

    def flops(tokens: int, documents: int) -> float:
        pairs = tokens * (tokens / max(documents, 1) + 1) / 2
        return target_forward_flops(text, layers_run=layers, tokens=tokens, attention_pairs=pairs)

    return flops


def estimated_rates(target_fpt: float, drafter_fpt: float) -> placement.StageRates:
    """Stage rates from FLOPs at assumed MFUs: only the ratio matters before a measurement."""
    peak = placement.PEAK_FLOPS
    return placement.StageRates(
        ASSUMED_TARGET_MFU * peak / target_fpt,
        ASSUMED_DRAFTER_MFU * peak / drafter_fpt,
        source="flop_estimate",
        target_flops_per_token=target_fpt,
        drafter_flops_per_token=drafter_fpt,
    )
