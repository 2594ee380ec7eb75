"""`python -m dflash_async bench drafter`: time one drafter train step at a given shape.

Random weights, a synthetic pack of equal-length documents with every token supervised, the
target's embedding and lm_head as random frozen bf16 tensors. Reports step ms, TFLOP/s, MFU and
peak memory, eager or replayed as CUDA graphs (step.py). Used for BENCHMARKS.md.

`--fp8-matmuls` runs the drafter's linears as FP8 matmuls (DFLASH_TRAIN__FP8_MATMULS,
model/fp8_training.py). Its FLOPs are counted as for bf16 (the same matmuls), and its MFU is
against the same bf16 peak (780 TFLOP/s, H200), so step time and MFU compare directly with a bf16
row; it is not a fraction of the FP8 peak.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import sys
import time
from dataclasses import asdict, dataclass

import torch

from dflash_async.bench.step_profile import (
    format_kernels,
    format_rows,
    graph_kernels,
    part_rows,
    profile_parts,
)
from dflash_async.data.packing import PackedBatch
from dflash_async.model.build import StepSpec, build_drafter_step
from dflash_async.model.drafter_config import DrafterConfig
from dflash_async.model.flops import drafter_step_flops, drafter_step_flops_by_part, mfu
from dflash_async.model.kinds import DEFAULT_KIND, KINDS, kind_of
from dflash_async.model.objective import DEFAULT_GAMMA
from dflash_async.model.step import STATS, DrafterStep
from dflash_async.runtime.devices import parse_device
from dflash_async.usage import ArgumentParser, require_cuda

BENCH_STEPS = 10_000  # the schedule's length: the timed steps sit early in its warm-up


def qwen3_8b_drafter_config(num_layers: int = 5, block_size: int = 16) -> DrafterConfig:
    """The drafter shape for Qwen3-8B (d 4096, 32/8 heads, head_dim 128, ffn 12288)."""
    return DrafterConfig(
        hidden_size=4096,
        num_hidden_layers=num_layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=12288,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        vocab_size=151936,
        num_target_layers=36,
        target_layer_ids=(1, 9, 17, 25, 33),
        mask_token_id=151669,
        block_size=block_size,
    )


def synthetic_pack(
    config: DrafterConfig, *, token_budget: int, num_docs: int, device, seed: int = 0
) -> PackedBatch:
    """`num_docs` equal documents filling the budget, all tokens supervised, random features."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    T, doc_len = token_budget, token_budget // num_docs
    rows = torch.arange(T)
    doc_ids = (rows // doc_len).clamp(max=num_docs - 1)
    features = torch.randn(T, config.feature_width, generator=g)  # with a captured last layer
    batch = PackedBatch(
        input_ids=torch.randint(0, config.vocab_size, (T,), generator=g),
        loss_mask=torch.ones(T, dtype=torch.bool),
        doc_ids=doc_ids,
        position_ids=rows - doc_ids * doc_len,
        features=features.to(
            torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
        ),
    )
    return batch.to(device)


def build_step(
    config: DrafterConfig,
    *,
    token_budget: int,
    num_anchors: int,
    device: torch.device,
    attention: str,
    flex_fn=None,
    ce_chunk_size: int = 2048,
    seed: int = 0,
    compile: bool = False,
    flex_kernel_options: dict | None = None,
    flex_autotune: bool = False,
    compiled_update: bool | None = None,
    working_weights: bool | None = None,
    ce_kernel: str = "auto",
    conv_kernel: str = "auto",
    flex_backend: str = "auto",
    fp8_matmuls: bool = False,
) -> DrafterStep:
    """A DrafterStep with random drafter/target weights on `device` (fp32 master weights),
    built by the product's builder (model/build.py) at the recipe's lr and gamma, 10 warm-up
    steps of 10,000. None for `compiled_update` / `working_weights`: the product's rule (the
    compiled update where `compile` runs on a GPU; working weights with it)."""
    torch.manual_seed(seed)
    target_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    embed = torch.randn(config.vocab_size, config.hidden_size, device=device, dtype=target_dtype)
    lm_head = torch.randn_like(embed) * 0.02
    norm = 1 + 0.1 * torch.randn(config.hidden_size, device=device, dtype=target_dtype)
    kind = kind_of(config.kind)
    if compiled_update is None:
        compiled_update = compile and device.type == "cuda"
    spec = StepSpec(
        token_budget=token_budget,
        num_anchors=num_anchors,
        # the kind's recipe, else DFlash's table (4 where it has none, e.g. block 7: the step's
        # time does not depend on the decay)
        gamma=kind.train_defaults.get("gamma") or DEFAULT_GAMMA.get(config.block_size, 4.0),
        lr=6e-4,
        warmup_frac=10 / BENCH_STEPS,
        weight_decay=0.0,
        grad_clip=1.0,
        seed=seed,
        attention=attention,
        compile=compile,
        compiled_update=compiled_update,
        cuda_graph=device.type == "cuda",
        ce_chunk_size=ce_chunk_size,
        ce_kernel=ce_kernel,
        conv_kernel=conv_kernel,
        flex_backend=flex_backend,
        flex_kernel_options=tuple(sorted((flex_kernel_options or {}).items())),
        flex_autotune=flex_autotune,
        working_weights=working_weights is not False,
        kind=config.kind,
        fp8_matmuls=fp8_matmuls,
    )
    return build_drafter_step(
        spec,
        config,
        embed=embed,
        lm_head=lm_head,
        device=device,
        rank=0,
        total_steps=BENCH_STEPS,
        flex_fn=flex_fn,
        target_norm=norm,  # read by a kind that captures the target's last layer only
    )


@dataclass
class DrafterBench:
    mode: str
    step_ms: float
    tflops: float
    mfu: float
    peak_mem_gib: float  # max allocated over the timed steps (graph mode: misses the graph pool)
    peak_all_gib: float  # max allocated from the build on: compile, warm-up, capture, steps
    loss: float
    flex_backend: str  # the resolved one: "triton" or "flash" ("triton" under sdpa)
    parts_ms: dict[str, float] | None = None  # --profile: ms per step of each part


def time_steps(step: DrafterStep, steps: int) -> float:
    """Mean seconds per full step (phase A + B) over `steps` replays/launches."""
    sync = torch.cuda.synchronize if step.device.type == "cuda" else (lambda *_: None)
    sync()  # sync point: benchmark timing only
    start = time.perf_counter()
    for _ in range(steps):
        step.phase_a()
        step.phase_b()
    sync()  # sync point: benchmark timing only
    return (time.perf_counter() - start) / steps


def bench_drafter(
    config: DrafterConfig,
    *,
    token_budget: int,
    num_anchors: int,
    num_docs: int,
    device: torch.device,
    attention: str,
    cuda_graph: bool,
    steps: int = 10,
    warmup: int = 3,
    flex_fn=None,
    ce_chunk_size: int = 2048,
    profile: bool = False,
    compile: bool = False,
    flex_kernel_options: dict | None = None,
    flex_autotune: bool = False,
    compiled_update: bool | None = None,
    working_weights: bool | None = None,
    ce_kernel: str = "auto",
    conv_kernel: str = "auto",
    flex_backend: str = "auto",
    trace: str | None = None,
    fp8_matmuls: bool = False,
    profile_top: int = 25,
) -> DrafterBench:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step = build_step(
        config,
        token_budget=token_budget,
        num_anchors=num_anchors,
        device=device,
        attention=attention,
        flex_fn=flex_fn,
        ce_chunk_size=ce_chunk_size,
        compile=compile,
        flex_kernel_options=flex_kernel_options,
        flex_autotune=flex_autotune,
        compiled_update=compiled_update,
        working_weights=working_weights,
        ce_kernel=ce_kernel,
        conv_kernel=conv_kernel,
        flex_backend=flex_backend,
        fp8_matmuls=fp8_matmuls,
    )
    step.batch.copy_(
        synthetic_pack(config, token_budget=token_budget, num_docs=num_docs, device=device),
    )
    if cuda_graph:
        step.capture(warmup_steps=warmup)
    else:
        time_steps(step, warmup)
    peak_all = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = time_steps(step, steps)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    stats = dict(zip(STATS, step.stats.tolist(), strict=True))  # sync point: report only
    kwargs = dict(
        token_budget=token_budget, num_anchors=num_anchors, visible_pairs=stats["visible_pairs"]
    )
    flops = drafter_step_flops(config, **kwargs)
    result = DrafterBench(
        mode="graph" if cuda_graph else "eager",
        step_ms=seconds * 1e3,
        tflops=flops / seconds / 1e12,
        mfu=mfu(flops, seconds),
        peak_mem_gib=peak,
        peak_all_gib=max(peak_all / 2**30, peak),
        loss=stats["ce_sum"] / max(stats["weight_sum"], 1e-12),
        flex_backend=step.objective.flex_backend,
    )
    if profile:
        rows = part_rows(
            profile_parts(step, steps=2),
            steps=2,
            intermediate_size=config.intermediate_size,
            flops_by_part=drafter_step_flops_by_part(config, **kwargs),
        )
        result.parts_ms = {r.part: round(r.ms, 3) for r in rows}
        title = (
            f"### T={token_budget}, {num_anchors} anchors x {config.block_size}: by part, from "
            f"2 profiled eager steps of the same code (a CUDA-graph replay hides which operator "
            f"launched which kernel). Whole step, {result.mode}: {result.step_ms:.1f} ms, "
            f"MFU {result.mfu:.3f} (peak 780 TFLOP/s, measured H200 bf16)"
            + (
                ". FP8 matmuls: FLOPs as for bf16, MFU against the same bf16 peak"
                if fp8_matmuls
                else ""
            )
        )
        print(format_rows(rows, title=title), file=sys.stderr, flush=True)
        if cuda_graph:
            graph = graph_kernels(step, steps=2, top=profile_top, trace=trace)
            title = (
                f"### The same step graph-replayed, GPU activity by name (2 replays): "
                f"busy {graph.busy_ms:.1f} ms per {result.step_ms:.1f} ms step"
            )
            print(format_kernels(graph, title=title), file=sys.stderr, flush=True)
    return result


# Kernel variants of the step that `--variants` compares in one process (bench_drafter kwargs).
# Each is exact in math (same loss and gradients up to bf16 rounding order): tests/test_gpu_drafter_
# kernels.py checks that. Not here: fused linear-CE kernels (liger-kernel, cut-cross-entropy):
# none returns the argmax that the step's accuracy and acceptance metrics need, so each would
# add a second lm_head pass.
VARIANTS = {  # the slowest to build (autotune: minutes) last
    "today": {},
    "ce_chunk_4096": {"ce_chunk_size": 4096},
    "ce_chunk_8192": {"ce_chunk_size": 8192},
    "flex_dq_in_dkv_loop": {"flex_kernel_options": {"WRITE_DQ": False}},
    "flex_tma": {"flex_kernel_options": {"USE_TMA": True}},
    # flex_attention's kernels: flash-attn-4's (CuTe DSL; where flash_attn.cute is importable,
    # installed with the `flash` extra; `today` where it is) or torch's Triton ones
    "flex_flash": {"flex_backend": "flash"},
    "flex_triton": {"flex_backend": "triton"},
    # phase B: torch's clip_grad_norm_ + fused AdamW, or model/update.py's compiled AdamW (the
    # default where the step compiles; `today` is the one the flags pick)
    "reference_update": {"compiled_update": False},
    "compiled_update": {"compiled_update": True},
    # the matmul weights: bf16 working copies with bf16 gradients (the default with the
    # compiled update, model/step.py) or autocast's casts of the fp32 masters
    "working_weights": {"working_weights": True},
    "master_weights": {"working_weights": False},
    # the CE pass: kernels/ce_kernel.py's Triton kernel (the GPU default) or the torch ops
    # (torch.compile'd with --compile)
    "ce_triton": {"ce_kernel": "triton"},
    "ce_compiled": {"ce_kernel": "compiled"},
    # DFlash2's convolutions: kernels/conv_kernel.py's Triton kernels (the GPU default) or the
    # torch ops, compiled with the layers
    "conv_triton": {"conv_kernel": "triton"},
    "conv_compiled": {"conv_kernel": "compiled"},
    # all of the above as they were before the fused update: the whole step's before/after in one run
    "previous_default": {
        "compiled_update": False,
        "ce_kernel": "compiled",
        "flex_backend": "triton",
    },
    "flex_autotune": {"flex_autotune": True},
}


def qwen3_4b_drafter_config() -> DrafterConfig:
    """The drafter shape for Qwen3-4B (d 2560, 32/8 heads, head_dim 128, ffn 9728, 36 target
    layers): the geometry SpecForge's TorchTitan engine publishes its step times at."""
    return dataclasses.replace(qwen3_8b_drafter_config(), hidden_size=2560, intermediate_size=9728)


SHAPES = {
    "qwen3-8b": qwen3_8b_drafter_config,
    "qwen3-4b": qwen3_4b_drafter_config,
    "qwen3-8b-specforge": qwen3_8b_drafter_config,
    "small": lambda: dataclasses.replace(
        qwen3_8b_drafter_config(num_layers=2),
        hidden_size=1024,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=3072,
        vocab_size=32000,
        mask_token_id=31999,
    ),
}


@dataclass(frozen=True)
class StepGeometry:
    """A shape's default pack: tokens per step, anchors per step, documents per pack."""

    token_budget: int
    num_anchors: int
    num_docs: int


# Each shape's pack unless --token-budget/--num-anchors/--num-docs say otherwise. qwen3-8b: this
# project's 8B recipe. qwen3-4b: SpecForge's TorchTitan benchmark per H200 rank (2 samples of 4096
# tokens, 512 anchors each). qwen3-8b-specforge: SpecForge's Qwen3-8B DFlash recipe (4 samples of
# 3072 tokens, 512 anchors each).
GEOMETRIES = {
    "qwen3-8b": StepGeometry(token_budget=16384, num_anchors=1024, num_docs=4),
    "qwen3-4b": StepGeometry(token_budget=8192, num_anchors=1024, num_docs=2),
    "qwen3-8b-specforge": StepGeometry(token_budget=12288, num_anchors=2048, num_docs=4),
    "small": StepGeometry(token_budget=16384, num_anchors=1024, num_docs=4),
}


def main(argv: list[str] | None = None) -> None:
    """bench drafter [--shape qwen3-8b|qwen3-4b|...] [--token-budget N] ... : one JSON line per mode
    (per variant with --variants); --profile adds a table by part on stderr.

    GPU only: without CUDA, or with a CPU --device, a UsageError at once (exit 2). The step has no
    CPU flex backward, and the sdpa reference at these shapes takes many minutes on a CPU.
    """
    parser = ArgumentParser(prog="python -m dflash_async bench drafter")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    parser.add_argument("--token-budget", type=int, help="the shape's own unless given")
    parser.add_argument("--num-anchors", type=int, help="the shape's own unless given")
    parser.add_argument("--num-docs", type=int, help="the shape's own unless given")
    parser.add_argument("--attention", choices=("flex", "sdpa"), default="flex")
    parser.add_argument("--modes", default="eager,graph")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", default="cuda:0", help="a CUDA device")
    parser.add_argument("--ce-chunk-size", type=int, default=2048)
    parser.add_argument("--profile", action="store_true", help="time by part (table on stderr)")
    parser.add_argument(
        "--trace", help="with --profile: write the graph replays' Chrome trace here (.json.gz)"
    )
    parser.add_argument(
        "--profile-top",
        type=int,
        default=25,
        help="with --profile: kernels listed, the longest first",
    )
    parser.add_argument("--compile", action="store_true", help="compile layers and CE math")
    parser.add_argument(
        "--variants", default="today", help=f"comma-separated, of: {', '.join(VARIANTS)}"
    )
    parser.add_argument("--kind", choices=tuple(KINDS), default=DEFAULT_KIND)
    parser.add_argument("--block-size", type=int, help="the shape's own (16) unless given")
    parser.add_argument("--vocab-size", type=int, help="the shape's own unless given")
    parser.add_argument(
        "--layer-types", help="full_attention|sliding_attention, one for every layer or a list"
    )
    parser.add_argument("--sliding-window", type=int, help="W of the sliding layers")
    parser.add_argument(
        "--fp8-matmuls",
        action="store_true",
        help="the drafter's linears as FP8 matmuls (DFLASH_TRAIN__FP8_MATMULS); FLOPs and MFU "
        "counted as for bf16, against the bf16 peak",
    )
    args = parser.parse_args(argv)
    for name, value in dataclasses.asdict(GEOMETRIES[args.shape]).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)} (known: {', '.join(VARIANTS)})")
    require_cuda("bench drafter", args.device)
    device = parse_device(args.device, setting="--device")
    torch.cuda.set_device(device)
    for variant in args.variants.split(","):
        for mode in args.modes.split(","):
            options = {"ce_chunk_size": args.ce_chunk_size, **VARIANTS[variant]}
            try:
                result = _bench_variant(args, device, mode, options)
            except Exception as error:  # a candidate kernel may not build here: say so, go on
                if variant == "today":
                    raise
                failed = {"variant": variant, "mode": mode, "error": str(error)[:400]}
                print(json.dumps(failed), flush=True)
                continue
            finally:
                gc.collect()  # the step's graphs and buffers go before the next one is built
                torch.cuda.empty_cache()
            row = {"shape": args.shape, **vars(args), "variant": variant, **asdict(result)}
            print(json.dumps(row), flush=True)


def shape_config(args) -> DrafterConfig:
    """The --shape's drafter with --kind, --block-size, --vocab-size (the mask token then the
    last id), --layer-types and --sliding-window applied; bad values: DrafterConfig's ValueError."""
    config = SHAPES[args.shape]()
    changes: dict = {"kind": args.kind}
    if args.block_size:
        changes["block_size"] = args.block_size
    if args.vocab_size:
        changes |= {"vocab_size": args.vocab_size, "mask_token_id": args.vocab_size - 1}
    if args.layer_types:
        types = tuple(args.layer_types.split(","))
        changes["layer_types"] = types * config.num_hidden_layers if len(types) == 1 else types
    if args.sliding_window:
        changes["sliding_window"] = args.sliding_window
    return dataclasses.replace(config, **changes)


def _bench_variant(args, device: torch.device, mode: str, options: dict) -> DrafterBench:
    return bench_drafter(
        shape_config(args),
        token_budget=args.token_budget,
        num_anchors=args.num_anchors,
        num_docs=args.num_docs,
        device=device,
        attention=args.attention,
        cuda_graph=mode == "graph",
        steps=args.steps,
        profile=args.profile,
        compile=args.compile,
        trace=args.trace,
        profile_top=args.profile_top,
        fp8_matmuls=args.fp8_matmuls,
        **options,
    )
