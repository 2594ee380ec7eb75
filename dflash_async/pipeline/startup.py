"""Start-up: turn settings into the run's inputs and each worker's state.

Everything here runs once, before the first step: resolving the target and data (the built-in
tiny target and demo corpus when the paths are empty), the drafter config derived from the
target's, the target's frozen embedding and lm_head read straight from its safetensors (no
second copy of the target), and each drafter's step built inside its own worker thread.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig

from dflash_async.log import get_logger
from dflash_async.model.drafter import DFlashDrafter
from dflash_async.model.drafter_config import DrafterConfig, drafter_config_from_target
from dflash_async.model.objective import DFlashObjective, ObjectiveConfig
from dflash_async.model.optim import warmup_steps_for
from dflash_async.model.step import DrafterStep
from dflash_async.settings import PipelineSettings, Settings, SettingsError
from dflash_async.target.loading import TargetError

EMBED_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")
LM_HEAD_NAMES = ("lm_head.weight",)


@dataclass(frozen=True)
class RunInputs:
    target_path: str
    data_path: str
    builtin_target: bool
    drafter_config: DrafterConfig


def check_device_combination(pipeline: PipelineSettings) -> None:
    """SettingsError (exit 2) for a CUDA target with a CPU drafter, a combination not supported.

    The hidden-state slots then live in pinned host memory, written by the target's asynchronous
    device-to-host copies, and a CPU drafter has no CUDA stream to wait on the producer's event:
    it could read a slot before the copy landed. Refused at start-up rather than raced.
    """
    cpu_drafters = "cpu" in pipeline.drafter_devices
    cuda_targets = [d for d in pipeline.target_devices if d != "cpu"]
    if cpu_drafters and cuda_targets:
        raise SettingsError(
            f"DFLASH_PIPELINE__TARGET_DEVICES={','.join(pipeline.target_devices)} with "
            f"DFLASH_PIPELINE__DRAFTER_DEVICES={','.join(pipeline.drafter_devices)}: a CPU "
            "drafter cannot follow a CUDA target (it would read hidden-state slots before the "
            "target's GPU copies land); put every drafter on a GPU, or the targets on cpu"
        )


def resolve_inputs(settings: Settings, log) -> RunInputs:
    """Target folder, data path and drafter config (builds the tiny target/corpus if needed)."""
    from dflash_async.eval.regenerate import demo_corpus
    from dflash_async.target.tiny import builtin_cache_dir, ensure_tiny_target

    builtin = not settings.target.path
    target_path = str(ensure_tiny_target(builtin_cache_dir())) if builtin else settings.target.path
    data_path = settings.data.path
    if not data_path:
        data_path = str(demo_corpus(builtin_cache_dir(), target_path, n_train=512))
        log.info("demo_corpus_ready", path=data_path, target=target_path)
    config = drafter_config_for(settings, target_path, builtin)
    return RunInputs(target_path, data_path, builtin, config)


def drafter_config_for(settings: Settings, target_path: str, builtin: bool) -> DrafterConfig:
    """The drafter's shapes from the target's config.json and the drafter/train settings."""
    try:
        target_config = AutoConfig.from_pretrained(target_path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise TargetError(f"cannot read the config of target {target_path!r}: {e}") from e
    mask_token_id = settings.drafter.mask_token_id
    if mask_token_id is None and builtin:
        from dflash_async.target.loading import load_target_tokenizer

        mask_token_id = load_target_tokenizer(target_path).mask_token_id
    try:
        return drafter_config_from_target(
            target_config,
            num_hidden_layers=settings.drafter.num_layers,
            num_features=settings.target.num_features,
            block_size=settings.train.block_size,
            mask_token_id=mask_token_id,
            target_layer_ids=settings.target.target_layer_ids,
        )
    except ValueError as e:  # the target cannot host this drafter: name the settings involved
        raise SettingsError(
            f"drafter for target {target_path!r}: {e} (see DFLASH_TARGET__NUM_FEATURES, "
            "DFLASH_TARGET__TARGET_LAYER_IDS, DFLASH_DRAFTER__MASK_TOKEN_ID)"
        ) from None


def _weight_files(folder: Path) -> dict[str, Path]:
    """tensor name -> safetensors file holding it (sharded or single-file checkpoints)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    names = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            names.update(dict.fromkeys(f.keys(), file))
    return names


def load_frozen_embeddings(
    folder: str, *, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's embed_tokens and lm_head weights [V, d] (the same tensor when tied)."""
    files = _weight_files(Path(folder))

    def read(names: tuple[str, ...]) -> torch.Tensor | None:
        name = next((n for n in names if n in files), None)
        if name is None:
            return None
        with safe_open(files[name], framework="pt") as f:
            return f.get_tensor(name).to(device=device, dtype=dtype)

    embed = read(EMBED_NAMES)
    if embed is None:
        raise TargetError(f"target {folder!r} has no embedding tensor ({' or '.join(EMBED_NAMES)})")
    lm_head = read(LM_HEAD_NAMES)
    return embed, embed if lm_head is None else lm_head  # tied embeddings: one tensor


def build_drafter_step(
    settings: Settings,
    config: DrafterConfig,
    target_path: str,
    *,
    device: torch.device,
    rank: int,
    total_steps: int,
    compile: bool,
) -> DrafterStep:
    """One drafter's model, objective, optimizer, schedule and static inputs on `device`.

    Every drafter is seeded alike, so all start from identical weights; each draws its own
    anchors (generator seeded by seed and rank). Call in its worker.
    """
    train = settings.train
    torch.manual_seed(train.seed)
    cuda = device.type == "cuda"
    target_dtype = torch.bfloat16 if cuda else torch.float32
    embed, lm_head = load_frozen_embeddings(target_path, device=device, dtype=target_dtype)
    drafter = DFlashDrafter(config).to(device)
    attention = train.attention if train.attention != "auto" else ("flex" if cuda else "sdpa")
    objective = DFlashObjective(
        ObjectiveConfig(
            block_size=config.block_size,
            num_anchors=train.num_anchors,
            mask_token_id=config.mask_token_id,
            gamma=train.gamma,
            ce_chunk_size=train.ce_chunk_size,
            attention=attention,
            compile=compile,
            flex_kernel_options=tuple(sorted(train.flex_kernel_options.items())),
            flex_backend=train.flex_backend,
            flex_autotune=train.flex_autotune,
            ce_kernel=train.ce_kernel if cuda else "compiled",  # CPU: the plain torch ops
        ),
        drafter,
        embed,
        lm_head,
    )
    step = DrafterStep.build(
        objective,
        token_budget=train.token_budget,
        peak_lr=train.lr,
        warmup_steps=warmup_steps_for(total_steps, train.warmup_frac),
        total_steps=total_steps,
        weight_decay=train.weight_decay,
        grad_clip=train.grad_clip if train.grad_clip > 0 else float("inf"),
        generator=torch.Generator(device).manual_seed(train.seed * 1000 + rank),
        working_weights=None if train.working_weights else False,  # None: with the compiled update
    )
    if attention == "flex":  # the preflight line of the kernels chosen for the step
        get_logger("drafter").info("drafter_kernels_chosen", rank=rank, attention=attention,
                 flex_backend=objective.flex_backend,
                 flex_kernel_options=train.flex_kernel_options, flex_autotune=train.flex_autotune,
                 ce_chunk_size=train.ce_chunk_size, ce_kernel=objective.ce_kernel,
                 update="compiled" if step.adamw is not None else "reference",
                 working_weights=any(w is not None for w in step.working),
                 grad_dtype=str(step.grad_dtype).removeprefix("torch."),
                 torch=torch.__version__)  # fmt: skip
    return step
