"""Every knob of a run: the settings sections, their defaults, and the checks of single values.

Names: prefix `DFLASH_`, one group per section joined with `__` (`DFLASH_TRAIN__TOKEN_BUDGET`),
top-level fields without a group (`DFLASH_OUTPUT_DIR`). Reading them from the environment and a
preset file, and checking named paths, is settings/env.py's job. Recipe defaults: docs/DFLASH.md s.5.

The sections are pydantic models and the root is a pydantic-settings `BaseSettings` whose only
source is explicit values: settings/env.py maps the environment to fields (see its docstring).
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from dflash_async.data.formats import DEFAULT_ROLE_MAP, parse_role_map
from dflash_async.model.kinds import DEFAULT_KIND, KINDS
from dflash_async.settings.recipe import DrafterSettings, TrainSettings
from dflash_async.settings.values import (
    Section,
    canonical_device,
    parse_device_list,
    parse_int_list,
)

PREFIX = "DFLASH_"
NESTING = "__"
ENV_FILE_VAR = "DFLASH_ENV_FILE"
NO_ENV_FILE = "none"


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
    stages: int = Field(1, ge=1)
    """Stage workers per target replica: its decoder layers split into this many contiguous
    ranges (balanced by bytes), each on its own device; 1 = the whole target on one device."""
    quantize: Literal["none", "fp8"] = "none"
    """fp8: quantize an unquantized checkpoint's decoder weights at load to FP8 e4m3 with 128x128
    block scales (the format of served FP8 checkpoints), so the drafter trains on the features of
    an FP8-served target; on a CPU they are then dequantized for compute. An FP8 or MXFP4
    checkpoint is read as published whatever this says."""
    cuda_graph: bool = False
    """Replay the packed dense and Qwen3-MoE target forwards from one CUDA graph, captured after
    the start-up forward: 3-5% less forward time at Qwen3-30B-A3B, none at the dense Qwen3-8B
    (H200); the graph keeps the forward's activations allocated for the run (2.3-2.9 GB at
    Qwen3-30B-A3B, T = 16384). Other paths, split targets and the CPU run eagerly."""
    weights: Literal["checkpoint", "random"] = "checkpoint"
    """random: draw the weights from the model's own init (seeded by DFLASH_TRAIN__SEED), layer by
    layer on the device, from a PATH that needs only config.json and the tokenizer; for throughput
    runs and benchmarks only (the features of random weights are meaningless for a real drafter)."""

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
    block_size: int = Field(0, ge=0)
    """Decode blocks of this size (2 up to the trained block size: the same drafter drafts
    block_size-1 tokens per block); 0 = the trained block size."""
    prompts_path: str = ""
    """A jsonl file of prompts; empty = the built-in held-out demo prompts (built-in target only;
    with another target and no prompts file, evaluation is skipped with a log line)."""
    temperature: float = Field(0.0, ge=0)
    """Sampling temperature of the speculative decode; 0 = greedy (checked lossless against plain
    greedy). Above 0 drafts are sampled from the drafter's q and verified by rejection sampling
    against the target's p (one prompt at a time, a seeded generator per prompt): tau then
    measures acceptance at that temperature and the output is distributed as plain sampling."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus filter at T > 0 (applied after temperature and top-k, to q and p alike); 1 = off."""
    top_k: int = Field(0, ge=0)
    """Keep the k most likely tokens at T > 0 (after temperature, before top-p); 0 = off."""


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

    @model_validator(mode="before")
    @classmethod
    def _kind_recipe_defaults(cls, data: Any) -> Any:
        """The drafter kind's recipe for the shared DFLASH_TRAIN__* fields the input leaves
        unset (model/kinds/ `train_defaults`: DSpark's block 7 and decay 4)."""
        if not isinstance(data, dict) or not isinstance(data.get("drafter", {}), dict):
            return data
        kind = (data.get("drafter") or {}).get("kind", DEFAULT_KIND)
        if kind not in KINDS or not KINDS[kind].train_defaults:
            return data  # an unknown kind: the drafter section reports it
        train = data.get("train", {})
        if not isinstance(train, dict):
            return data
        unset = {k: v for k, v in KINDS[kind].train_defaults.items() if train.get(k) in (None, "")}
        return {**data, "train": {**train, **unset}}

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
