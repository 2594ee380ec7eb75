"""The one drafter-step builder: a `StepSpec` and the target's frozen tensors -> a `DrafterStep`.

The pipeline (one per drafter worker and one for the placement's calibration), `bench drafter`
and the tests all build their step here, so a kernel choice or a recipe value reaches every one
of them through one spec. `StepSpec` holds the resolved recipe; the choices that depend on the
kernels a GPU has (flex_attention's backend, the CE pass) stay `auto` until the objective resolves
them on its device, and the `drafter_kernels_chosen` line logs what they became.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from dflash_async.log import get_logger
from dflash_async.model.drafter_config import DrafterConfig
from dflash_async.model.fp8_training import Fp8Matmuls, use_fp8_matmuls
from dflash_async.model.kinds import DEFAULT_KIND, KINDS, kind_of
from dflash_async.model.kinds.interface import with_fields
from dflash_async.model.objective import ObjectiveConfig
from dflash_async.model.optim import warmup_steps_for
from dflash_async.model.step import DrafterStep


@dataclass(frozen=True)
class _StepSpec:
    """The recipe and kernels of one drafter step (settings/recipe.py documents each field);
    after these come every kind's own DFLASH_TRAIN__* fields (model/kinds/), which only the
    objective of that kind reads."""

    token_budget: int  # T rows of the step's static inputs
    num_anchors: int
    gamma: float
    lr: float  # peak learning rate
    warmup_frac: float
    weight_decay: float
    grad_clip: float  # 0: no clipping
    seed: int  # initial weights (every drafter alike) and, with the rank, the anchor stream
    attention: Literal["sdpa", "flex"]
    compile: bool  # torch.compile the layers and the CE pass (GPU only)
    compiled_update: bool  # phase B through update.py's compiled AdamW (GPU, with compile)
    cuda_graph: bool  # capture the step (GPU only)
    ce_chunk_size: int
    ce_kernel: Literal["auto", "compiled", "triton"]  # auto: Triton on a GPU (the objective)
    flex_backend: Literal["auto", "triton", "flash"]  # auto: resolved on the device
    flex_kernel_options: tuple[tuple[str, bool | int | str], ...] = ()
    flex_autotune: bool = False
    working_weights: bool = True  # bf16 working copies where the compiled update runs
    kind: str = DEFAULT_KIND  # the drafter's (DrafterConfig.kind)
    # the drafter's linears as FP8 matmuls (model/fp8_training.py); emulate: its reference
    fp8_matmuls: bool | Literal["emulate"] = False
    sdpa_query_rows: int = 1024  # sdpa: block rows per attention call (model/attention_rule.py)


StepSpec = with_fields(_StepSpec, [kind.train_fields for kind in KINDS.values()])


def build_drafter_step(
    spec: StepSpec,
    config: DrafterConfig,
    *,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    device: torch.device,
    rank: int,
    total_steps: int,
    flex_fn=None,
    target_norm: torch.Tensor | None = None,
) -> DrafterStep:
    """One drafter's model, objective, optimizer, schedule and static inputs on `device`.

    `embed` and `lm_head` are the target's frozen [V, d] tensors on `device` (the same tensor when
    tied). Every drafter is seeded alike, so all start from identical weights; each draws its own
    anchors (a generator seeded by the seed and `rank`, the drafter's index in the whole run).
    `flex_fn`: a compiled flex_attention to share between steps (tests); None: the objective's.
    `target_norm`: the target's final norm weight [d] on `device`, for a kind that reads the
    target's own distribution (model/kinds/ `captures_final_hidden`); others take none.
    Call in the device's worker thread: compiling happens at the first calls.
    """
    if spec.kind != config.kind:
        raise ValueError(f"the step is for a {spec.kind} drafter, the config for {config.kind}")
    kind = kind_of(spec.kind)
    torch.manual_seed(spec.seed)
    drafter = kind.make_drafter(config).to(device)
    fp8 = None  # installed before the first forward
    if spec.fp8_matmuls:
        fp8 = use_fp8_matmuls(drafter, kernel=False if spec.fp8_matmuls == "emulate" else None)
    objective = kind.make_objective(
        ObjectiveConfig(
            block_size=config.block_size,
            num_anchors=spec.num_anchors,
            mask_token_id=config.mask_token_id,
            gamma=spec.gamma,
            ce_chunk_size=spec.ce_chunk_size,
            attention=spec.attention,
            compile=spec.compile,
            flex_kernel_options=spec.flex_kernel_options,
            flex_backend=spec.flex_backend,
            flex_autotune=spec.flex_autotune,
            ce_kernel=spec.ce_kernel,
            sdpa_query_rows=spec.sdpa_query_rows,
        ),
        drafter,
        embed,
        lm_head,
        spec=spec,
        flex_fn=flex_fn,
        **({"target_norm": target_norm} if kind.captures_final_hidden else {}),
    )
    step = DrafterStep.build(
        objective,
        token_budget=spec.token_budget,
        peak_lr=spec.lr,
        warmup_steps=warmup_steps_for(total_steps, spec.warmup_frac),
        total_steps=total_steps,
        weight_decay=spec.weight_decay,
        grad_clip=spec.grad_clip if spec.grad_clip > 0 else float("inf"),
        generator=torch.Generator(device).manual_seed(spec.seed * 1000 + rank),
        compiled_update=spec.compiled_update,
        working_weights=None if spec.working_weights else False,  # None: with the compiled update
    )
    if spec.attention == "flex":  # the preflight line of the kernels chosen for the step
        get_logger("drafter").info(
            "drafter_kernels_chosen",
            rank=rank,
            attention=spec.attention,
            flex_backend=objective.flex_backend,
            flex_kernel_options=dict(spec.flex_kernel_options),
            flex_autotune=spec.flex_autotune,
            ce_chunk_size=spec.ce_chunk_size,
            ce_kernel=objective.ce_kernel,
            anchors=spec.num_anchors,  # sampled; the slots padded to the tile (pad_anchors)
            anchor_slots=-(-spec.num_anchors // objective.anchor_multiple)
            * objective.anchor_multiple,
            **kind.kernels_chosen(objective),
            update="compiled" if step.adamw is not None else "reference",
            working_weights=any(w is not None for w in step.working),
            grad_dtype=str(step.grad_dtype).removeprefix("torch."),
            fp8_matmuls=_fp8_line(fp8),
            fp8_linears=len(fp8.fp8) if fp8 else 0,
            fp8_kept=list(fp8.kept) if fp8 else [],
            torch=torch.__version__,
        )
    return step


def _fp8_line(fp8: Fp8Matmuls | None) -> str:
    """The drafter_kernels_chosen value of DFLASH_TRAIN__FP8_MATMULS: off, the kernel, or the
    reference and why."""
    if fp8 is None:
        return "off"
    return fp8.path if fp8.reason is None else f"{fp8.path} ({fp8.reason})"
