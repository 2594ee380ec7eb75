"""The `settings_resolved` report: where each non-default value came from, and contradictions.

One event at the start of `run` (and warnings on `settings`' stderr): the variables whose value
differs from the field default, grouped by where they came from (the preset file, the
environment, `auto: ...` for the recipe of the target's size), the devices the run will use, and
a warning for each contradiction a user would otherwise discover late: roles and devices both
given, a layout beside roles by hand, GPUs named on a machine without them, a data path without a
target (the built-in tiny target then trains on it). The visible GPU count is a parameter, so
that what a machine would report is computed anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash_async.settings import NESTING, PREFIX, Settings
from dflash_async.settings.env import DEVICES_VAR, ROLE_VARS, Sources, setting_names

LAYOUT_VAR = f"{PREFIX}PIPELINE{NESTING}LAYOUT"


@dataclass(frozen=True)
class Resolution:
    """The event's fields: sources (origin -> names), devices, notes and warnings."""

    sources: dict[str, list[str]]
    devices: str
    notes: tuple[str, ...]
    warnings: tuple[str, ...]

    def event_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"sources": self.sources, "devices": self.devices}
        if self.notes:
            fields["notes"] = list(self.notes)
        if self.warnings:
            fields["warnings"] = list(self.warnings)
        return fields


def visible_gpu_count() -> int:
    """The CUDA devices this process sees (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve(settings: Settings, sources: Sources, *, visible_gpus: int) -> Resolution:
    """The report of `settings` loaded from `sources` on a machine with `visible_gpus` GPUs."""
    grouped: dict[str, list[str]] = {}
    for name, origin in sources.by_name.items():
        if _differs_from_default(settings, name):
            grouped.setdefault(origin, []).append(name)
    pipe = settings.pipeline
    roles = bool(pipe.target_devices or pipe.drafter_devices)
    where = lambda name: sources.by_name.get(name, "the field default")  # noqa: E731
    warnings = []
    if pipe.devices and pipe.target_devices and pipe.drafter_devices:
        warnings.append(
            f"{DEVICES_VAR}={','.join(pipe.devices)} ({where(DEVICES_VAR)}) is not used: both "
            f"roles are given ({' and '.join(f'{n} ({where(n)})' for n in ROLE_VARS)})"
        )
    if roles and pipe.layout != "auto":
        warnings.append(
            f"{LAYOUT_VAR}={pipe.layout} ({where(LAYOUT_VAR)}) is not used: roles given by hand "
            "decide the layout"
        )
    named = [*pipe.devices, *pipe.target_devices, *pipe.drafter_devices]
    gpus = sorted({d for d in named if d != "cpu"}, key=lambda d: int(d.split(":")[1]))
    missing = [d for d in gpus if int(d.split(":")[1]) >= visible_gpus]
    if missing:
        have = f"{visible_gpus} visible" if visible_gpus else "none visible"
        warnings.append(
            f"the device settings name {', '.join(missing)} but this machine has {have}: "
            "`run` refuses them here (exit 2)"
        )
    if settings.target.path and not visible_gpus and not named:
        warnings.append(
            "no GPU is visible here: the target and the drafter run on the CPU, far slower "
            "than on a GPU; check CUDA_VISIBLE_DEVICES and that torch is a CUDA build"
        )
    if settings.data.path and not settings.target.path:
        warnings.append(
            f"{PREFIX}DATA{NESTING}PATH without {PREFIX}TARGET{NESTING}PATH: the built-in tiny "
            "target (the demo's, a random-weight model with its own tokenizer) trains on this "
            "data; name your target to train a drafter for it"
        )
    return Resolution(grouped, _devices(settings, visible_gpus), sources.notes, tuple(warnings))


def _devices(settings: Settings, visible_gpus: int) -> str:
    pipe = settings.pipeline
    if pipe.target_devices or pipe.drafter_devices:
        targets = ",".join(pipe.target_devices or pipe.devices) or "every visible GPU"
        drafters = ",".join(pipe.drafter_devices or pipe.devices) or "every visible GPU"
        return f"targets {targets}; drafters {drafters} (roles by hand)"
    if pipe.devices:
        return f"{','.join(pipe.devices)}, placement {pipe.layout}"
    if visible_gpus:
        last = f"..cuda:{visible_gpus - 1}" if visible_gpus > 1 else ""
        return f"cuda:0{last} (every visible GPU), placement {pipe.layout}"
    return f"cpu (no GPU visible), placement {pipe.layout}"


def _differs_from_default(settings: Settings, name: str) -> bool:
    path = setting_names().get(name)
    if path is None:
        return False
    model: Any = settings
    owner: Any = type(settings)
    for part in path[:-1]:
        owner = owner.model_fields[part].annotation
        model = getattr(model, part)
    field = owner.model_fields[path[-1]]
    default = field.get_default(call_default_factory=True)
    return getattr(model, path[-1]) != default
