"""The border: `Settings` in, the run's frozen specs out; below it nothing reads `Settings`.

Each spec is defined beside the code that owns it and carries only what that code needs:

    StepSpec       model/build.py       the drafter step's recipe and kernels
    DrafterSpec    model/drafter_config the drafter's shape settings (the rest from the target)
                                        and its warm-start weights (DFLASH_DRAFTER__INIT)
    PlanSpec       stages/read.py       packs, epochs, steps
    TargetSpec     stages/produce.py    how target workers load and run the target
    PlacementSpec  pipeline/placement/placing.py  the candidate devices, roles by hand, ring depth
    NodesSpec      pipeline/distributed the process group of several nodes
    SaveSpec       stages/save.py       checkpoints, export, resume policy
    EvalSettings   settings/sections.py          the in-run evaluation (the section as it is)
    DataOptions    data/samples.py      reading and tokenizing the corpus

Every `auto` that depends on the machine is resolved here (device lists, dtypes, which kernels a
CPU runs, the process group's backend), and every cross-field check that needs the machine
(devices that exist, roles that work together) fails here with exit 2, before any model loads.
Two choices stay with their owners because they need the files or the GPU in hand: the drafter's
layer ids and mask token (from the target's config, at start-up) and the kernels a GPU offers
(flex backend, CE pass: resolved by the objective on its device and logged).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from dflash_async.data.samples import DataOptions
from dflash_async.errors import SettingsError
from dflash_async.kernels.fp8_format import rowwise_kernel_problem
from dflash_async.model.build import StepSpec
from dflash_async.model.drafter_config import DrafterSpec, kinds_drafter_fields
from dflash_async.model.kinds import DEFAULT_KIND, kind_of
from dflash_async.model.objective import ObjectiveConfig
from dflash_async.pipeline.distributed import NodesSpec, pick_backend
from dflash_async.pipeline.placement.placing import PlacementSpec, candidate_devices, given_roles
from dflash_async.settings import DataSettings, EvalSettings, Settings, TargetSettings
from dflash_async.settings.recipe import TrainSettings
from dflash_async.stages.produce import TargetSpec
from dflash_async.stages.read import PlanSpec
from dflash_async.stages.save import SaveSpec
from dflash_async.targets.packed.dense import FLEX_MIN_HEAD_DIM
from dflash_async.targets.split import replica_devices


@dataclass(frozen=True)
class RunSpec:
    """One run, every setting resolved (the specs above)."""

    output_dir: Path
    target_path: str  # a local folder (a cached model id resolved); "" = the built-in target
    data_path: str  # "" = the built-in demo corpus
    drafter: DrafterSpec
    data: DataOptions
    plan: PlanSpec
    step: StepSpec
    target: TargetSpec
    placement: PlacementSpec
    nodes: NodesSpec
    save: SaveSpec
    eval: EvalSettings
    tensorboard_dir: str  # "" = off
    attention_auto: bool = False  # DFLASH_TRAIN__ATTENTION was auto (see fit_attention)


def run_spec(settings: Settings, *, visible_gpus: int | None = None) -> RunSpec:
    """The run's specs; SettingsError (exit 2) for devices this machine lacks, roles that do not
    work together, or a kernel the drafters' devices cannot run. `visible_gpus`: the GPUs that
    empty DEVICES stand for (this machine's unless given)."""
    train, pipe = settings.train, settings.pipeline
    budget = train.token_budget  # T, the one read: every spec below gets it from here
    devices = candidate_devices(pipe.devices, visible_gpus=visible_gpus)
    given = given_roles(pipe.target_devices, pipe.drafter_devices, default=devices)
    placement = PlacementSpec(
        layout=pipe.layout,
        devices=devices,
        given=given,
        num_slots=pipe.num_slots,
        target_batch_tokens=pipe.target_batch_tokens,
        calibration_packs=pipe.calibration_packs,
    )
    _check_stages(settings.target.stages, layout=pipe.layout, given=given, devices=devices)
    if train.fp8_matmuls is True:  # emulate runs anywhere
        _check_fp8_matmuls(placement.drafter_devices)
    cuda = placement.drafter_devices[0].type == "cuda"
    return RunSpec(
        output_dir=settings.output_dir,
        target_path=settings.target.path,
        data_path=settings.data.path,
        drafter=DrafterSpec(
            num_layers=settings.drafter.num_layers,
            num_features=settings.target.num_features,
            block_size=train.block_size,
            target_layer_ids=settings.target.target_layer_ids,
            mask_token_id=settings.drafter.mask_token_id,
            init=Path(settings.drafter.init) if settings.drafter.init else None,
            kind=settings.drafter.kind,
            **{name: getattr(settings.drafter, name) for name in kinds_drafter_fields()},
            **_variant_fields(settings),
        ),
        data=_data_options(
            settings.data,
            max_len=min(settings.data.max_len, budget),
            output_dir=settings.output_dir,
        ),
        plan=PlanSpec(
            token_budget=budget, seed=train.seed, epochs=train.epochs, max_steps=train.max_steps
        ),
        step=_step_spec(train, token_budget=budget, cuda=cuda, kind=settings.drafter.kind),
        target=_target_spec(
            settings.target,
            token_budget=budget,
            max_batch_tokens=pipe.target_batch_tokens,
            seed=train.seed,
            decode=_evaluation_decodes(settings),
        ),
        placement=placement,
        nodes=NodesSpec(
            backend=pick_backend(pipe.dist_backend, placement.drafter_devices),
            timeout_s=pipe.dist_timeout_s,
            silence_s=pipe.dist_silence_s,
        ),
        save=SaveSpec(
            output_dir=settings.output_dir,
            every=train.save_every,
            keep=train.keep_checkpoints,
            resume=train.resume,
        ),
        eval=settings.eval,
        tensorboard_dir=settings.log.tensorboard_dir,
        attention_auto=train.attention == "auto",
    )


def fit_attention(spec: RunSpec, *, head_dim: int, log) -> RunSpec:
    """The run's spec once the drafter's head_dim is known (it is the target's): flex with
    smaller heads than flex_attention takes is sdpa when the attention was auto (logged as
    attention_fitted), else SettingsError (exit 2) naming the setting."""
    if spec.step.attention != "flex" or head_dim >= FLEX_MIN_HEAD_DIM:
        return spec
    if not spec.attention_auto:
        raise SettingsError(
            f"DFLASH_TRAIN__ATTENTION=flex: the drafter's heads have {head_dim} dimensions (the "
            f"target's) and flex_attention's kernels take {FLEX_MIN_HEAD_DIM} or more; use sdpa "
            "or auto"
        )
    log.info(
        "attention_fitted",
        attention="sdpa",
        head_dim=head_dim,
        reason=f"flex_attention's kernels take heads of {FLEX_MIN_HEAD_DIM} dimensions or more",
    )
    return replace(spec, step=replace(spec.step, attention="sdpa"))


def _variant_fields(settings: Settings) -> dict:
    """The drafter variants (docs/DFLASH.md s.10): sliding layers, the in-block rule, the logit
    transforms and the embedding scale, as DrafterSpec (and DrafterConfig) fields."""
    drafter = settings.drafter
    return dict(
        layer_types=tuple(drafter.layer_types),
        sliding_window=drafter.sliding_window,
        is_causal=drafter.is_causal,
        output_multiplier=drafter.output_multiplier,
        final_logit_softcapping=drafter.final_logit_softcapping,
        input_embedding_scale=drafter.input_embedding_scale,
    )


def _step_spec(
    train: TrainSettings, *, token_budget: int, cuda: bool, kind: str = DEFAULT_KIND
) -> StepSpec:
    """The drafter step: compile, graphs and the Triton CE pass only on GPU drafters."""
    attention = train.attention if train.attention != "auto" else ("flex" if cuda else "sdpa")
    if attention == "flex" and not cuda:
        raise SettingsError(
            "DFLASH_TRAIN__ATTENTION=flex needs GPU drafters (flex_attention has no backward on "
            "a CPU); use sdpa or auto"
        )
    tile = ObjectiveConfig.flex_tile  # any anchor count fits: the step pads them (pad_anchors)
    if attention == "flex" and token_budget % tile:
        below, above = token_budget // tile * tile, (token_budget // tile + 1) * tile
        raise SettingsError(
            f"DFLASH_TRAIN__TOKEN_BUDGET={token_budget}: flex attention on GPU drafters takes "
            f"packs of whole {tile}-row tiles; use a multiple of {tile}"
            + (f" ({below} or {above})" if below else f" ({above})")
        )
    return StepSpec(
        token_budget=token_budget,
        num_anchors=train.num_anchors,
        gamma=train.gamma,
        lr=train.lr,
        warmup_frac=train.warmup_frac,
        weight_decay=train.weight_decay,
        grad_clip=train.grad_clip,
        seed=train.seed,
        attention=attention,
        compile=cuda and train.compile,
        compiled_update=cuda and train.compile,
        cuda_graph=cuda and train.cuda_graph,
        ce_chunk_size=train.ce_chunk_size,
        ce_kernel=train.ce_kernel if cuda else "compiled",
        flex_backend=train.flex_backend,
        flex_kernel_options=tuple(sorted(train.flex_kernel_options.items())),
        flex_autotune=train.flex_autotune,
        working_weights=train.working_weights,
        kind=kind,
        fp8_matmuls=train.fp8_matmuls,
        sdpa_query_rows=train.sdpa_query_rows,
        **kind_of(kind).step_values(train, cuda=cuda),  # the kind's own objective and kernels
    )


def _check_fp8_matmuls(devices) -> None:
    """DFLASH_TRAIN__FP8_MATMULS needs the row-wise FP8 kernel on every drafter device: elsewhere
    the drafter could only emulate its rounding (model/fp8_training.py's reference, slower than
    the plain step), which no run asks for; SettingsError (exit 2) naming the device."""
    for device in dict.fromkeys(devices):
        problem = rowwise_kernel_problem(device)
        if problem:
            raise SettingsError(
                f"DFLASH_TRAIN__FP8_MATMULS=true needs GPU drafters with FP8 tensor cores "
                f"(compute capability >= 8.9), not {device}: {problem}; unset it, or put the "
                "drafters on such GPUs (DFLASH_PIPELINE__DRAFTER_DEVICES)"
            )


def _target_spec(
    target: TargetSettings, *, token_budget: int, max_batch_tokens: int, seed: int, decode: bool
) -> TargetSpec:
    """DFLASH_TARGET__DTYPE per device type: auto is bf16 on a GPU, fp32 on the CPU."""
    named = {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(target.dtype)
    return TargetSpec(
        cuda_dtype=named or torch.bfloat16,
        cpu_dtype=named or torch.float32,
        token_budget=token_budget,
        max_batch_tokens=max_batch_tokens,
        packed_hybrid=target.packed_hybrid,
        stages=target.stages,
        quantize=target.quantize,
        weights=target.weights,
        seed=seed,
        decode=decode,
        cuda_graph=target.cuda_graph,
    )


def _evaluation_decodes(settings: Settings) -> bool:
    """Whether the in-run evaluation will decode on the target (then a random target is drawn
    whole: every layer, the final norm, the lm_head): it is on (EVERY, AT_START or AT_END) and
    has prompts (its own for any target but the built-in one; else it is skipped:
    stages/evaluate.py)."""
    e = settings.eval
    return bool(e.every or e.at_start or e.at_end) and bool(
        e.prompts_path or not settings.target.path
    )


def _check_stages(stages: int, *, layout: str, given, devices) -> None:
    """A split target (DFLASH_TARGET__STAGES > 1) runs co-located on DEVICES, in groups of
    `stages` devices (pipeline/placement/split_placement.py); anything else is refused here (exit 2)."""
    if stages == 1:
        return
    if given is not None or layout == "split":
        raise SettingsError(
            f"DFLASH_TARGET__STAGES={stages} runs a replica per {stages} devices of "
            "DFLASH_PIPELINE__DEVICES with a drafter on every device; roles by hand "
            "(TARGET_DEVICES/DRAFTER_DEVICES) and DFLASH_PIPELINE__LAYOUT=split are not supported "
            "with it yet"
        )
    replica_devices(devices, stages=stages)  # exit 2 unless the devices divide evenly


def _data_options(data: DataSettings, *, max_len: int, output_dir: Path) -> DataOptions:
    """DFLASH_DATA__CACHE_DIR resolved: empty is OUTPUT_DIR/cache (owned by the run, removed with
    it, so a resume or a re-run never tokenizes again), `none` is off, anything else that folder."""
    cache_dir = data.cache_dir or str(output_dir / "cache")
    return DataOptions(
        max_len=max_len,
        enable_thinking=data.enable_thinking,
        loss_turns=data.loss_turns,
        too_long=data.too_long,
        on_bad_record=data.on_bad_record,
        role_map=data.role_map,
        cache_dir=None if cache_dir == "none" else cache_dir,
        workers=data.workers,
    )
