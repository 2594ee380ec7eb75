"""The drafter and its training recipe: the `drafter` and `train` sections of the settings.

Apart from settings/sections.py (the root and the other sections) because these are the sections that
grow with every drafter kind and kernel choice; the same rules hold: frozen, no unknown fields,
every field documented, checks of single values here and cross-section checks in the root. Each
drafter kind's own fields are its module's (model/kinds/), composed here from the kinds' table,
after the fields every kind shares and in the table's order.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from dflash_async.model.kinds import DEFAULT_KIND, KINDS
from dflash_async.model.layer_rules import LAYER_TYPES, SLIDING_ATTENTION
from dflash_async.model.objective import DEFAULT_GAMMA
from dflash_async.settings.values import Section


def parse_name_list(value: Any) -> Any:
    """`"full_attention,sliding_attention"` -> a tuple of the names; other values as they are."""
    if isinstance(value, str):
        return tuple(part.strip() for part in value.split(",") if part.strip())
    return value


def kind_description() -> str:
    """DFLASH_DRAFTER__KIND's description: each kind's name, export architecture and summary."""
    kinds = [f"{name} ({kind.architecture}: {kind.summary})" for name, kind in KINDS.items()]
    listed = " or ".join(filter(None, [", ".join(kinds[:-1]), kinds[-1]]))  # a, b or c
    return f"The drafter trained and exported: {listed}."


# DFLASH_DRAFTER__KIND's values: the table's names (a Literal, so that a wrong one is refused
# with the known names listed)
KindName = Literal[tuple(KINDS)]


class _DrafterCommon(Section):
    """The drafter fields every kind has, up to the kind."""

    num_layers: int = Field(5, ge=1)
    """Drafter transformer layers."""
    mask_token_id: int | None = Field(None, ge=0)
    """Token id of the masked block positions; empty = chosen from the target's tokenizer."""
    init: str = ""
    """Warm start from an export (ours, z-lab's, or a DSpark drafter saved by DeepSpec, its frozen
    embedding and lm_head dropped) or a training checkpoint folder: weights only,
    fresh optimizer and schedule; shapes must match (exit 2); empty = random init; ignored when
    the run resumes its own checkpoint."""
    # described from the table, so that the values listed are those accepted
    kind: KindName = Field(DEFAULT_KIND, description=kind_description())


class DrafterSettings(*(kind.drafter_fields for kind in reversed(KINDS.values())), _DrafterCommon):
    """The drafter section: every kind's fields, each kind's own (in the table's order), then
    the layer layout and logit transforms (pydantic lists a base's fields before its subclass's,
    the last base's first, so the kinds are given in reverse)."""

    layer_types: tuple[str, ...] = ()
    """Comma list of full_attention|sliding_attention, one per drafter layer; empty = every
    layer full attention. A sliding layer's block slot k sees only the context rows within
    SLIDING_WINDOW of its own position anchor + k (z-lab's per-slot window)."""
    sliding_window: int | None = Field(None, ge=1)
    """W of the sliding layers: block slot k sees context rows p with (anchor + k) - p < W (and
    block slots s with |k - s| < W); needed with a sliding_attention layer, ignored without one."""
    is_causal: bool | None = None
    """Inside the block: empty = causal (slot k sees slots 0..k) in sliding layers and
    bidirectional in full ones; true = causal in every layer; false = bidirectional in every
    layer."""
    output_multiplier: float = Field(1.0, gt=0)
    """m: the drafter's logits are lm_head(h) * m, in training as at inference."""
    final_logit_softcapping: float | None = Field(None, gt=0)
    """c: logits become c * tanh(logits / c) after the multiplier; empty = no cap."""
    input_embedding_scale: float = 1.0
    """s: the block's token embeddings are multiplied by s before the first layer."""

    _split_layer_types = field_validator("layer_types", mode="before")(parse_name_list)

    @field_validator("layer_types")
    @classmethod
    def _known_layer_types(cls, types: tuple[str, ...]) -> tuple[str, ...]:
        unknown = sorted(set(types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"{', '.join(unknown)}: each entry is {' or '.join(LAYER_TYPES)}")
        return types

    @model_validator(mode="after")
    def _layer_layout(self) -> DrafterSettings:
        types = self.layer_types
        if types and len(types) != self.num_layers:
            raise ValueError(
                f"DFLASH_DRAFTER__LAYER_TYPES names {len(types)} layers but "
                f"DFLASH_DRAFTER__NUM_LAYERS={self.num_layers}"
            )
        if SLIDING_ATTENTION in types and self.sliding_window is None:
            raise ValueError(
                "DFLASH_DRAFTER__SLIDING_WINDOW must be set (at least 1) with sliding_attention "
                "layers in DFLASH_DRAFTER__LAYER_TYPES"
            )
        return self


class _TrainCommon(Section):
    """The training fields every kind has, up to the CE pass."""

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
    """Drafter attention: flex on GPU, sdpa (the same rule in chunks of block rows, each against
    only the keys it may see) on CPU when auto; auto is sdpa on GPU too for heads of under 16
    dimensions (a tiny target's), which flex_attention's kernels do not take."""
    sdpa_query_rows: int = Field(1024, ge=1)
    """sdpa: block rows per attention call (whole blocks); each call's mask is this many rows x
    the context keys they see, so memory grows linearly with TOKEN_BUDGET (100 MB at 1024 rows
    against a 98304-token document). Fewer anchors x block size than this: one call."""
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
    """The CE chunk's elementwise pass: kernels/ce_kernel.py's Triton kernel (GPU only; `auto`
    picks it on a GPU) or the torch ops, compiled where `compile` is on (same result up to fp32
    rounding order). DSpark's CE + L1 pass has its own Triton kernel, kernels/ce_l1_kernel.py,
    which `auto` picks on a GPU too (`compiled`: its closed form in torch ops). The CPU always
    runs the plain torch ops."""

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
        from dflash_async.model.attention_rule import unknown_flex_options  # lazy: torch is heavy

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


class TrainSettings(*(kind.train_fields for kind in reversed(KINDS.values())), _TrainCommon):
    """The train section: every kind's fields, each kind's own (in the table's order), then
    the matmul weights' numerics (the kinds in reverse: see DrafterSettings)."""

    working_weights: bool = True
    """Keep bf16 working copies of the drafter's matmul weights, written by the optimizer with
    the fp32 weights, and the gradients in bf16 (GPU with `compile`; ignored elsewhere). The
    forward and the matmul weights' gradients are the same; the norm weights' gradients and the
    sums across drafters are rounded to bf16. Off: autocast casts the fp32 weights at every use
    and the gradients are fp32 (the same memory; slower, BENCHMARKS.md)."""
    fp8_matmuls: bool | Literal["emulate"] = False
    """Run the drafter's linears (attention, MLP, fc; DFlash2's projections) as FP8 matmuls on
    the GPU: e4m3 with a scale per row, torch._scaled_mm for the output and the input gradient,
    the weight gradient in bf16 (after torchao float8's row-wise recipes, docs/GPU.md); the
    fp32 weights, the bf16 working copies, checkpoints and exports are unchanged. Needs GPU
    drafters with FP8 tensor cores (compute capability >= 8.9: Ada, Hopper, Blackwell); refused
    elsewhere (exit 2). `emulate`: the same quantization on any device, each product computed
    from the dequantized operands in the compute dtype (torchao's emulate), the kernel's numbers
    but for how it sums: slower than the plain step, for seeing what FP8 does to a drafter's
    quality where no such GPU is. Off by default: it changes the training numerics (e4m3 keeps 3 mantissa bits against bf16's
    7); measured on an H200, 1.16x the bf16 step at the Qwen3-8B drafter shape, and demo loss
    curves within 0.006 of bf16's on the same data (BENCHMARKS.md), a check at the demo's scale
    only. Part of the run identity: a resume must use the same value."""

    @model_validator(mode="after")
    def _anchors_fit(self) -> TrainSettings:
        if self.num_anchors > self.token_budget:
            raise ValueError(
                f"DFLASH_TRAIN__NUM_ANCHORS={self.num_anchors} exceeds "
                f"DFLASH_TRAIN__TOKEN_BUDGET={self.token_budget}: anchors are distinct tokens"
            )
        return self
