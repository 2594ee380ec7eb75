"""Every knob of a run: the settings sections, their defaults, and the checks of single values.

Names: prefix `DFLASH_`, one group per section joined with `__` (`DFLASH_TRAIN__TOKEN_BUDGET`),
top-level fields without a group (`DFLASH_OUTPUT_DIR`). Reading them from the environment and a
preset file, and checking named paths, is settings_env.py's job. Recipe defaults: docs/DFLASH.md s.5.

The sections are pydantic models and the root is a pydantic-settings `BaseSettings` whose only
source is explicit values: settings_env.py maps the environment to fields (see its docstring).
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from dflash_async.data.formats import DEFAULT_ROLE_MAP, parse_role_map
from dflash_async.model.drafter_config import DEFAULT_GAMMA
from dflash_async.settings_values import (
    Section,
    canonical_device,
    parse_device_list,
    parse_int_list,
)

PREFIX = "DFLASH_"
NESTING = "__"
ENV_FILE_VAR = "DFLASH_ENV_FILE"
NO_ENV_FILE = "none"


class SettingsError(ValueError):
    """Bad settings; `str(error)` is one line for the user (the CLI prints it and exits 2)."""


class TargetSettings(Section):
    path: str = ""
    """Local Hugging Face model folder, or a model id (Org/Name) in the local Hugging Face cache
    (never downloaded); empty = the built-in tiny target."""
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """Target weights and compute dtype; auto = bfloat16 on GPU, float32 on CPU."""
    num_features: int = Field(5, ge=1)
    """k: how many target layers feed the drafter."""
    target_layer_ids: tuple[int, ...] | None = None
    """Comma list of target layers to capture; empty = derived from the layer count (docs/DFLASH.md s.1)."""
    packed_hybrid: bool = True
    """Qwen3.5 targets on CUDA: the packed varlen forward on flash-linear-attention kernels; false =
    HF on right-padded batches."""

    _split_layer_ids = field_validator("target_layer_ids", mode="before")(parse_int_list)

    @model_validator(mode="after")
    def _ids_match_num_features(self) -> TargetSettings:
        ids = self.target_layer_ids
        if ids is not None and len(ids) != self.num_features:
            raise ValueError(
                f"DFLASH_TARGET__TARGET_LAYER_IDS={','.join(map(str, ids))} names {len(ids)} "
                f"layers but DFLASH_TARGET__NUM_FEATURES={self.num_features}"
            )
        return self


class DrafterSettings(Section):
    num_layers: int = Field(5, ge=1)
    """Drafter transformer layers."""
    mask_token_id: int | None = Field(None, ge=0)
    """Token id of the masked block positions; empty = chosen from the target's tokenizer."""
    init: str = ""
    """Warm start from an export (ours or z-lab's) or a training checkpoint folder: weights only,
    fresh optimizer and schedule; shapes must match (exit 2); empty = random init; ignored when
    the run resumes its own checkpoint."""
    kind: Literal["dflash", "dflash2"] = "dflash"
    """The drafter trained and exported: dflash (DFlashDraftModel) or dflash2 (DFlash2DraftModel:
    two grouped dynamic causal convolutions per layer and a candidate selector, docs/DFLASH.md
    s.9). The in-run evaluation cannot decode dflash2 yet and is skipped for it."""
    conv_kernel_size: int = Field(2, ge=1)
    """dflash2: taps K of each layer's causal convolutions along the block (2 in every release)."""
    conv_group_size: int = Field(16, ge=1)
    """dflash2: channels sharing one dynamic kernel; must divide the hidden size."""
    selector_rank: int = Field(256, ge=1)
    """dflash2: rank r of the candidate selector's codebooks and hidden projection."""
    selector_top_k: int = Field(16, ge=1)
    """dflash2: candidates per slot the selector chooses among (the unary top-k)."""


class DataSettings(Section):
    path: str = ""
    """Conversations: a jsonl/parquet file, a glob or a folder; empty = the built-in corpus."""
    max_len: int = Field(3072, ge=2)
    """Longest sample in tokens (see too_long)."""
    enable_thinking: bool = False
    """Passed to the chat template (Qwen3 thinking blocks)."""
    loss_turns: Literal["all", "last"] = "all"
    """Which assistant turns are supervised."""
    too_long: Literal["truncate", "drop"] = "truncate"
    """What happens to a sample longer than max_len."""
    on_bad_record: Literal["error", "skip"] = "error"
    """A malformed record stops the run (error, naming file and line) or is counted and skipped."""
    role_map: dict[str, str] = Field(default_factory=lambda: dict(DEFAULT_ROLE_MAP))
    """Role aliases as alias=role pairs (gpt=assistant,human=user) or JSON; replaces the default
    table (ShareGPT's human -> user, gpt/chatgpt/bing/bard -> assistant, ...)."""
    cache_dir: str = ""
    """Where tokenized data is cached (memory-mapped, shared by later runs and every rank);
    empty = OUTPUT_DIR/cache (the run's own: a resume never tokenizes again, and it goes when
    the output folder goes); a folder to share entries between runs; `none` = no on-disk cache."""
    workers: int = Field(0, ge=0)
    """Processes used to tokenize the data set; 0 = one per CPU core."""

    _parse_role_map = field_validator("role_map", mode="before")(parse_role_map)


class TrainSettings(Section):
    epochs: int = Field(6, ge=1)
    """Passes over the data (used when max_steps is 0)."""
    max_steps: int = Field(0, ge=0)
    """Stop after this many optimizer steps; 0 = run the epochs."""
    token_budget: int = Field(49152, ge=1)
    """T: rows of every pack (real tokens + padding) given to one drafter per step."""
    num_anchors: int = Field(2048, ge=1)
    """A: anchors (blocks) sampled per pack."""
    block_size: int = Field(16, ge=2)
    """B: tokens per drafted block (the anchor + B-1 masked positions)."""
    gamma: float | None = Field(None, gt=0, validate_default=True)
    """Loss-weight decay exp(-(k-1)/gamma); empty = 7, 5, 4 for block sizes 16, 10, 8."""
    lr: float = Field(6e-4, gt=0)
    """Peak learning rate."""
    warmup_frac: float = Field(0.04, ge=0, lt=1)
    """Fraction of the steps spent in linear warmup before the cosine decay to 0."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    grad_clip: float = Field(1.0, ge=0)
    """Max global gradient norm; 0 = no clipping."""
    seed: int = 42
    """Seeds the drafter init, pack planning and anchor sampling."""
    save_every: int = Field(1000, ge=0)
    """Write a checkpoint every this many steps (and always at the end); 0 = only at the end."""
    keep_checkpoints: int = Field(2, ge=1)
    """Training checkpoints kept in OUTPUT_DIR/checkpoints (the newest ones)."""
    resume: str = Field("auto", min_length=1)
    """auto: continue from the newest checkpoint in OUTPUT_DIR if there is one; never: start
    afresh (refused if OUTPUT_DIR holds a previous run); or the path of a checkpoint folder."""
    cuda_graph: bool = True
    """Capture the drafter step as a CUDA graph (GPU only; ignored on CPU)."""
    compile: bool = True
    """torch.compile the drafter's layers (norms, RoPE, SwiGLU) and the CE math (GPU only)."""
    attention: Literal["auto", "sdpa", "flex"] = "auto"
    """Drafter attention: flex on GPU, sdpa (dense mask reference) on CPU when auto."""
    ce_chunk_size: int = Field(2048, ge=1)
    """Block positions per cross-entropy chunk (bounds the logits held at once)."""
    flex_backend: Literal["auto", "triton", "flash"] = "auto"
    """flex_attention's kernels on GPU: torch's Triton ones, or flash-attn-4's (flex's FLASH
    backend: `pip install -e ".[flash]"`; Hopper and Blackwell GPUs). auto: flash where it is
    installed, torch is 2.11 or newer and the GPU is one of those, unless FLEX_KERNEL_OPTIONS or
    FLEX_AUTOTUNE tune the Triton kernels; else triton. The same result up to bf16 rounding
    order; flash was 3.5-5.5 ms faster per Qwen3-8B-shaped step on an H200 (BENCHMARKS.md), but
    is not bitwise reproducible."""
    flex_kernel_options: dict[str, bool | int | str] = Field(default_factory=dict)
    """flex_attention kernel options on GPU, JSON (torch's FlexKernelOptions, e.g.
    {"USE_TMA": true}, {"bwd_BLOCK_M1": 64}); empty = torch's defaults. The backend is
    DFLASH_TRAIN__FLEX_BACKEND's."""
    flex_autotune: bool = False
    """Compile flex_attention with max-autotune (searches its block sizes at start-up; GPU)."""
    ce_kernel: Literal["auto", "compiled", "triton"] = "auto"
    """The CE chunk's elementwise pass: model/ce_kernel.py's Triton kernel (GPU only; `auto`
    picks it on a GPU) or the torch ops, compiled where `compile` is on (same result up to fp32
    rounding order). The CPU always runs the plain torch ops."""
    selector_alpha: float = Field(1.0, ge=0)
    """dflash2: weight of the candidate selector's cross-entropy next to the DFlash loss; 0 trains
    the unary DFlash loss alone (the selector then learns nothing)."""
    working_weights: bool = True
    """Keep bf16 working copies of the drafter's matmul weights, written by the optimizer with
    the fp32 weights, and the gradients in bf16 (GPU with `compile`; ignored elsewhere). The
    forward and the matmul weights' gradients are the same; the norm weights' gradients and the
    sums across drafters are rounded to bf16. Off: autocast casts the fp32 weights at every use
    and the gradients are fp32 (the same memory; slower, BENCHMARKS.md)."""

    @field_validator("flex_kernel_options", mode="before")
    @classmethod
    def _flex_options_json(cls, value: Any) -> Any:
        if isinstance(value, str):  # from the environment or an env file
            try:
                return json.loads(value) if value.strip() else {}
            except json.JSONDecodeError as error:
                raise ValueError(f"not JSON ({error.msg})") from None
        return value

    @field_validator("flex_kernel_options")
    @classmethod
    def _known_flex_options(
        cls, options: dict[str, bool | int | str]
    ) -> dict[str, bool | int | str]:
        if not options:
            return options
        from dflash_async.model.attention import unknown_flex_options  # lazy: torch is heavy

        problem = unknown_flex_options(options)
        if problem:
            raise ValueError(f"DFLASH_TRAIN__FLEX_KERNEL_OPTIONS: {problem}")
        return options

    @field_validator("gamma")
    @classmethod
    def _derive_gamma(cls, gamma: float | None, info: ValidationInfo) -> float | None:
        block_size = info.data.get("block_size")
        if gamma is not None or block_size is None:  # block_size None: its own error is reported
            return gamma
        if block_size not in DEFAULT_GAMMA:
            raise ValueError(
                f"no default gamma for DFLASH_TRAIN__BLOCK_SIZE={block_size} (known: "
                f"{', '.join(map(str, DEFAULT_GAMMA))}): set DFLASH_TRAIN__GAMMA"
            )
        return DEFAULT_GAMMA[block_size]

    @model_validator(mode="after")
    def _anchors_fit(self) -> TrainSettings:
        if self.num_anchors > self.token_budget:
            raise ValueError(
                f"DFLASH_TRAIN__NUM_ANCHORS={self.num_anchors} exceeds "
                f"DFLASH_TRAIN__TOKEN_BUDGET={self.token_budget}: anchors are distinct tokens"
            )
        return self


class PipelineSettings(Section):
    layout: Literal["auto", "colocated", "split"] = "auto"
    """colocated: every device runs a target and a drafter worker around its own slot ring;
    split: target GPUs feed drafter GPUs; auto: decided from memory fit and stage rates."""
    devices: tuple[str, ...] = ()
    """Devices to place workers on (GPU indices or cpu; a device may repeat: one more pair on
    it); empty = every visible GPU, else one cpu."""
    target_devices: tuple[str, ...] = ()
    """Roles by hand (with DRAFTER_DEVICES): the target workers' devices; empty = placed."""
    drafter_devices: tuple[str, ...] = ()
    """Roles by hand: the drafter workers' devices (a GPU may also be a target device)."""
    num_slots: int = Field(4, ge=1)
    """Hidden-state slots in each drafter's ring: how many packs its targets may run ahead."""
    target_batch_tokens: int = Field(16384, ge=1)
    """Most tokens per target forward; a pack is split into forwards of whole documents."""
    calibration_packs: int = Field(2, ge=0)
    """auto: packs each stage runs alone and together at start-up to measure its rate (timed,
    not trained on); 0 = decide from FLOP estimates."""
    dist_backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Several nodes (torchrun/srun): process group backend; auto = nccl for GPU drafters, gloo
    for CPU ones (gloo also lets two ranks share one GPU)."""
    dist_timeout_s: float = Field(1800.0, gt=0)
    """Several nodes: longest wait in a collective or at start-up before every rank stops; must
    exceed rank 0's longest evaluation or checkpoint, which the other ranks wait for."""
    dist_silence_s: float = Field(30.0, gt=0)
    """Several nodes: a peer whose watchdog has not beaten for this long is dead; every rank stops."""

    @field_validator("target_devices", "drafter_devices", mode="before")
    @classmethod
    def _split_devices(cls, value: Any) -> tuple[str, ...]:
        return () if value in ("", (), []) else parse_device_list(value)

    @field_validator("devices", mode="before")
    @classmethod
    def _split_repeatable(cls, value: Any) -> tuple[str, ...]:
        items = value.split(",") if isinstance(value, str) else list(value)
        return tuple(canonical_device(str(i).strip().lower()) for i in items if str(i).strip())


class EvalSettings(Section):
    every: int = Field(0, ge=0)
    """Measure acceptance length by decoding every this many steps; 0 = never."""
    at_start: bool = False
    """Also measure the untrained drafter before the first step (a baseline for tau)."""
    at_end: bool = True
    """Measure the final drafter after training."""
    num_prompts: int = Field(16, ge=1)
    """Prompts decoded per evaluation (the defaults here are also `eval`'s)."""
    max_new_tokens: int = Field(256, ge=1)
    """Tokens generated per prompt."""
    batch_size: int = Field(64, ge=1)
    """Prompts decoded together (batched speculative decoding; hybrid targets decode one)."""
    mode: Literal["overlap", "pause"] = "overlap"
    """overlap: training continues while the target's worker interleaves decode steps with its
    training work; pause: training waits for each evaluation (logged as training_waited_s)."""
    job_ms: int = Field(500, ge=1)
    """Decode steps per job on the target's worker (about this many ms); its training jobs run
    between them, so with overlap an evaluation takes about job_ms / (job_ms + a target job)."""
    prompts_path: str = ""
    """A jsonl file of prompts; empty = the built-in held-out demo prompts (built-in target only;
    with another target and no prompts file, evaluation is skipped with a log line)."""


class LogSettings(Section):
    format: Literal["auto", "json", "console"] = "auto"
    """JSON lines, a console renderer, or auto (console on a TTY, else JSON)."""
    level: str = "info"
    """Minimum level: debug, info, warning, error."""
    every: int = Field(1, ge=1)
    """Show every N-th step line on stdout (OUTPUT_DIR/log.jsonl always keeps every step)."""
    tensorboard_dir: str = ""
    """Also write the step scalars as TensorBoard events in this folder; empty = off (needs the
    `tensorboard` extra)."""

    @field_validator("level")
    @classmethod
    def _known_level(cls, level: str) -> str:
        if level.upper() not in logging.getLevelNamesMapping():
            raise ValueError(f"unknown level {level!r}: use debug, info, warning or error")
        return level.lower()

    @field_validator("tensorboard_dir")
    @classmethod
    def _tensorboard_installed(cls, folder: str) -> str:
        if folder and importlib.util.find_spec("tensorboard") is None:  # found, not imported
            raise ValueError("needs tensorboard: pip install 'dflash_async[tensorboard]'")
        return folder


class Settings(BaseSettings):
    """The whole run's settings. Build with `load_settings`; immutable."""

    model_config = SettingsConfigDict(
        env_prefix=PREFIX,
        env_nested_delimiter=NESTING,
        extra="forbid",
        frozen=True,
        use_attribute_docstrings=True,
    )

    output_dir: Path = Path("runs/dflash")
    """Checkpoints and logs go here."""
    env_file: str = NO_ENV_FILE
    """The preset file loaded (DFLASH_ENV_FILE); none = no file."""
    target: TargetSettings = TargetSettings()
    drafter: DrafterSettings = DrafterSettings()
    data: DataSettings = DataSettings()
    train: TrainSettings = TrainSettings()
    pipeline: PipelineSettings = PipelineSettings()
    eval: EvalSettings = EvalSettings()
    log: LogSettings = LogSettings()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        *args: PydanticBaseSettingsSource,
        **kwargs: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Only explicit values: `load_settings` does the environment (see the module doc)."""
        return (init_settings,)

    @field_validator("output_dir")
    @classmethod
    def _output_dir_named(cls, output_dir: Path) -> Path:
        if str(output_dir) in ("", "."):
            raise ValueError("must name a folder for checkpoints and logs")
        return output_dir

    @model_validator(mode="after")
    def _documents_fit(self) -> Settings:
        max_len, budget = self.data.max_len, self.train.token_budget
        if max_len > budget:
            raise ValueError(
                f"DFLASH_DATA__MAX_LEN={max_len} exceeds DFLASH_TRAIN__TOKEN_BUDGET={budget}: "
                "a pack holds whole documents"
            )
        if max_len > self.pipeline.target_batch_tokens:
            raise ValueError(
                f"DFLASH_DATA__MAX_LEN={max_len} exceeds DFLASH_PIPELINE__TARGET_BATCH_TOKENS="
                f"{self.pipeline.target_batch_tokens}: a target forward holds whole documents"
            )
        return self

    def public_dict(self) -> dict[str, Any]:
        """The effective settings as JSON-ready data (a future `SecretStr` field dumps masked)."""
        return self.model_dump(mode="json")
