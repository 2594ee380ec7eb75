"""Placement of a split target (DFLASH_TARGET__STAGES = k > 1): replicas x stages over the devices.

The layout chosen for this first, in-process version: the DFLASH_PIPELINE__DEVICES list is cut
into consecutive groups of k devices, one target replica per group (stage s of a replica on the
group's s-th device), and every device also runs a drafter (co-located: n devices, n / k
replicas, n drafters). A replica's home ring is the one on its last stage's device (that stage
publishes). Roles by hand and the split layout are refused with k > 1 (pipeline/specs.py).

Memory decides at start-up, before any model loads: each device needs its stage's weights (the
layer bytes of targets/split.py, from the model built on the meta device at the target dtype),
the target's transient activations, and the drafter's state, activations and ring
(placing.memory_needs, the hook the tests fake). A device that does not fit ends the run with
exit 2 naming the bytes needed and available on every device.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dflash_async.model.build import StepSpec
from dflash_async.model.drafter_config import DrafterConfig
from dflash_async.pipeline import placement
from dflash_async.pipeline.placement import placing
from dflash_async.targets.split import Split, layer_sizes, replica_devices, split_layers


def meta_split(target_path: str, *, dtype: torch.dtype, stages: int, last_layer: int) -> Split:
    """The stage ranges and weight bytes of the target, from its config alone (meta device)."""
    config = AutoConfig.from_pretrained(target_path, local_files_only=True).get_text_config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    from dflash_async.targets.loading import text_model

    return split_layers(layer_sizes(text_model(model), last_layer=last_layer), stages=stages)


def place_split(
    spec: placing.PlacementSpec,
    step: StepSpec,
    config: DrafterConfig,
    *,
    target_path: str,
    stages: int,
    dtype: torch.dtype,
    log,
) -> tuple[placing.Roles, list[tuple[torch.device, ...]], tuple[int | None, ...]]:
    """(roles, each replica's stage devices, each replica's home ring); PlacementError (exit 2)
    when a device cannot hold its share."""
    devices = spec.devices
    groups = replica_devices(devices, stages=stages)
    split = meta_split(
        target_path, dtype=dtype, stages=stages, last_layer=max(config.captured_layer_ids)
    )
    memory = placing.memory_needs(spec, step, config, target_path, devices[0])
    needed = [
        split.stage_bytes[i % stages] + memory.target_activations + memory.drafter_side
        for i in range(len(devices))
    ]
    available = memory.device_bytes
    _check_fit(needed, available, devices, stages=stages)
    homes = tuple(i * stages + stages - 1 for i in range(len(groups)))  # the last stage's ring
    roles = placing.Roles("colocated", tuple(devices), tuple(devices), (None,) * len(devices))
    log.info(
        "placement",
        layout="colocated",
        replicas=len(groups),
        stages=stages,
        num_targets=len(groups),
        num_drafters=len(devices),
        layers=[[r.start, r.stop] for r in split.ranges],
        device_bytes_needed=[int(b) for b in needed],
        device_bytes=None if available is None else int(available),
        reason=f"DFLASH_TARGET__STAGES={stages}: {len(groups)} replicas x {stages} stages, "
        "a drafter on every device",
    )
    return roles, groups, homes


def _check_fit(needed: list[float], available: float | None, devices, *, stages: int) -> None:
    if available is None:
        return
    room = placement.HEADROOM * available
    if all(b <= room for b in needed):
        return
    pairs = enumerate(zip(devices, needed, strict=True))
    per_device = ", ".join(
        f"{d}#{i} (stage {i % stages}) needs {int(b)} bytes" for i, (d, b) in pairs
    )
    raise placement.PlacementError(
        f"the split target does not fit: {per_device}; available {int(room)} bytes per device "
        f"({placement.HEADROOM:.0%} of {int(available)}); raise DFLASH_TARGET__STAGES or list "
        "larger devices"
    )
