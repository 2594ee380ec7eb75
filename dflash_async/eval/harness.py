"""`python -m dflash_async eval`: tau of a drafter export over a prompt set, and its inputs.

Loss and accuracy can look excellent while a served drafter accepts ~1 token; decoding is the only
honest measure. This module loads the target and the export (DFlash or DFlash2, optionally served
at a block size below the trained one: --block-size), reads and chat-templates the prompts
(generation prompt on, trailing assistant turns dropped) and takes the stop rules from the
target's generation config, so the greedy output is what `model.generate`, and so the regenerated
training data, would produce. evaluation.py decodes (plain greedy once, cached by baseline.py;
then speculatively, batched), checks every sample lossless and reports tau, the accepted-length
histogram, per-position acceptance and tokens/s. Defaults are EvalSettings' (settings/sections.py): the
in-run evaluation and this command decode the same way unless told otherwise. --temperature 0,0.7
(0 = greedy; above 0: sampling.py) reports the first, plus "by_temperature" for several.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from dflash_async.checkpoint.export import load_drafter_export
from dflash_async.data.formats import (
    BadRecord,
    DataError,
    chat_messages,
    iter_raw_records,
    parse_record,
)
from dflash_async.data.images import (
    encode_image_prompt,
    has_images,
    image_conversation,
    load_image,
)
from dflash_async.data.tokenization import raw_text_ids
from dflash_async.eval.baseline import (
    baseline_key,
    load_baseline,
    save_baseline,
    vision_digest,
)
from dflash_async.eval.evaluation import (
    DecodeSetup,
    greedy_decoders,
    report,
    run_decoders,
    speculative_decoders,
)
from dflash_async.eval.lossless import LosslessError, eos_set, tie_tolerance_for
from dflash_async.eval.regenerate import write_jsonl
from dflash_async.eval.sampling import (
    SamplingOptions,
    sampled_or_none,
    sampling_options,
    temperatures,
)
from dflash_async.eval.teacher_forced import heldout_estimate
from dflash_async.log import get_logger, progress
from dflash_async.model.drafter import DFlashDrafter
from dflash_async.model.drafter_config import DrafterConfig
from dflash_async.model.kinds import kind_of
from dflash_async.runtime.cpu_threads import cpu_threads
from dflash_async.settings import EvalSettings
from dflash_async.targets import multimodal
from dflash_async.targets.families import decoder_layer_count
from dflash_async.targets.loading import (
    default_target_dtype,
    frozen_embeddings,
    load_target,
    load_target_tokenizer,
    text_config,
)
from dflash_async.targets.tiny import builtin_cache_dir, demo_prompts, ensure_tiny_target
from dflash_async.usage import ArgumentParser, UsageError, check_writable_folder, positive_int

# --dtype of the target (the drafter follows it); auto = bf16 on GPU, fp32 on CPU.
TARGET_DTYPES = {
    "auto": None,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


def serving_config(config: DrafterConfig, *, block_size: int | None) -> DrafterConfig:
    """The drafter config decoded with: the trained one, or its block size lowered to
    `block_size` (the same weights draft block_size-1 tokens per block: no tensor's shape depends
    on the block size). UsageError (exit 2) for a block size the drafter was not trained for."""
    if block_size is None or block_size == config.block_size:
        return config
    if not 2 <= block_size <= config.block_size:
        raise UsageError(
            f"--block-size {block_size}: must be in [2, {config.block_size}] "
            f"(the drafter's trained block size is {config.block_size})"
        )
    return replace(config, block_size=block_size)


def load_drafter(
    folder: str | Path, *, device: torch.device, dtype: torch.dtype, block_size: int | None = None
) -> tuple[DFlashDrafter, DrafterConfig]:
    """A servable export (ours or another tool's, docs/DFLASH.md s.7; DFlash or DFlash2) as an
    eval-mode drafter of its kind, served at `block_size` (None: the trained one)."""
    config, tensors = load_drafter_export(Path(folder))
    config = serving_config(config, block_size=block_size)
    drafter = kind_of(config.kind).make_drafter(config)
    drafter.load_state_dict(tensors, strict=True)  # the export holds exactly these names
    return drafter.to(device=device, dtype=dtype).eval().requires_grad_(False), config


def check_drafter_fits_target(config: DrafterConfig, target: PreTrainedModel) -> None:
    """ValueError naming the first field where the drafter was built for another target."""
    cfg = text_config(target)
    embed, _ = frozen_embeddings(target)
    pairs = {
        "hidden_size": (config.hidden_size, cfg.hidden_size),
        "num_target_layers": (config.num_target_layers, decoder_layer_count(cfg)),
        "vocab_size": (config.vocab_size, embed.shape[0]),
    }
    for name, (drafter_value, target_value) in pairs.items():
        if drafter_value != target_value:
            raise ValueError(f"drafter {name}={drafter_value} but the target has {target_value}")


def read_prompts(path: str | Path) -> list[dict[str, Any]]:
    """Records of a jsonl file (or any file `run` reads: .json, .parquet, ...), one prompt each:
    {"messages": [...]} (OpenAI), {"conversations": [{"from", "value"}]} (ShareGPT, as `run`
    and `regenerate` read it; returned as "messages" with ShareGPT's roles mapped) or
    {"prompt": str}. Trailing assistant turns are dropped when the prompt is built. An image
    record (data/images.py) keeps its messages with image parts and its images' sources.

    DataError (a ValueError) naming the file (and line) of a missing or empty file or a bad record.
    """
    source, records = Path(path), []
    if not source.is_file():
        raise DataError(f"prompts file {str(source)!r} does not exist")
    for where, raw in iter_raw_records(source):
        try:
            record = parse_record(raw)
            if has_images(record):  # the images' sources resolved and checked here
                messages, sources = image_conversation(record, root=source.parent)
                records.append({**record, "messages": messages, IMAGE_SOURCES: sources})
                continue
            if not isinstance(record.get("prompt"), str):
                if record.get("messages") is None and record.get("conversations") is None:
                    raise BadRecord(
                        "expected {'messages': [...]}, {'conversations': [...]} or {'prompt': str}"
                    )
                record = {**record, "messages": chat_messages(record)}  # roles checked here
        except BadRecord as e:
            raise DataError(f"{where}: {e}") from e
        records.append(record)
    if not records:  # caught here, before the target loads, not by evaluate() after it
        raise DataError(f"prompts file {str(source)!r} holds no prompt records")
    return records


def prompt_token_ids(tokenizer: Any, record: dict[str, Any], *, enable_thinking: bool) -> list[int]:
    """The chat-templated prompt (add_generation_prompt=True) of a record, as token ids.

    Trailing assistant turns are dropped (they are what the target is asked to generate). A plain
    prompt becomes one user message; without a chat template it is raw text, encoded as the
    tokenizer does by default (its BOS first where it has one: data.tokenization.raw_text_ids).
    """
    if isinstance(record.get("prompt"), str) and not getattr(tokenizer, "chat_template", None):
        return raw_text_ids(tokenizer, record["prompt"])
    if isinstance(record.get("prompt"), str):
        messages = [{"role": "user", "content": record["prompt"]}]
    else:
        messages = chat_messages(record)
    while messages and messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    if not messages:
        raise BadRecord(f"no prompt turn before the assistant turns in {record!r:.200}")
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=enable_thinking
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def stop_rules(target: PreTrainedModel, tokenizer: Any) -> tuple[frozenset[int], tuple[int, ...]]:
    """(eos ids, suppressed ids) of the target's generation config: its greedy output is what
    `model.generate` (and so the regenerated training data) would produce."""
    generation = getattr(target, "generation_config", None)
    eos = getattr(generation, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    suppress = tuple(getattr(generation, "suppress_tokens", None) or ())
    return eos_set(eos), suppress


def prompts_of(
    tokenizer: Any, records: Sequence[dict[str, Any]], *, enable_thinking: bool
) -> list[list[int]]:
    """Token ids of every record's prompt; ValueError naming the record of a bad one."""
    prompts = []
    for i, record in enumerate(records):
        try:
            prompts.append(prompt_token_ids(tokenizer, record, enable_thinking=enable_thinking))
        except BadRecord as e:
            raise ValueError(f"prompt record {i}: {e}") from e
    return prompts


IMAGE_SOURCES = "image_sources"  # the key read_prompts gives an image record's images


def image_prompts_of(
    processor: Any,
    records: Sequence[dict[str, Any]],
    *,
    enable_thinking: bool,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[list[list[int]], list[dict[str, torch.Tensor]]]:
    """(token ids, vision inputs on `device`) of every record's prompt through the target's
    processor (image records and text ones alike); ValueError naming the record of a bad one."""
    prompts, vision = [], []
    for i, record in enumerate(records):
        try:
            if isinstance(record.get("prompt"), str):
                messages = [{"role": "user", "content": record["prompt"]}]
            else:
                messages = list(record["messages"])
            while messages and messages[-1]["role"] == "assistant":
                messages = messages[:-1]
            if not messages:
                raise BadRecord("no prompt turn before the assistant turns")
            images = [load_image(source, None) for source in record.get(IMAGE_SOURCES, ())]
            prompt = encode_image_prompt(
                processor, messages, images, enable_thinking=enable_thinking
            )
        except BadRecord as e:
            raise ValueError(f"prompt record {i}: {e}") from e
        prompts.append(prompt.input_ids.tolist())
        vision.append(prompt.model_inputs(device, dtype))
    return prompts, vision


def has_image_prompts(records: Sequence[dict[str, Any]]) -> bool:
    return any(record.get(IMAGE_SOURCES) for record in records)


def greedy_baseline(
    setup: DecodeSetup, *, folder: str | Path | None, target_id: str
) -> tuple[list, float, bool]:
    """(greedy results, seconds, read from the cache?) of setup's prompts, decoded once per key
    and kept in `folder` (None: not kept)."""
    dtype = frozen_embeddings(setup.target)[0].dtype
    key = baseline_key(
        target_id=target_id,
        dtype=str(dtype),
        device_type=setup.device.type,
        prompts=setup.prompts,
        max_new_tokens=setup.max_new_tokens,
        eos=setup.eos,
        suppress=setup.suppress,
        batch_size=setup.batch_size,
        images=vision_digest(setup.vision),
    )
    cached = load_baseline(folder, key) if folder else None
    if cached is not None:
        return *cached, True
    batches = greedy_decoders(setup)
    shown = progress(batches, total=len(batches), task="eval baseline (batches)")
    results, seconds = run_decoders(shown, setup.device)
    if folder:
        save_baseline(folder, key, results, seconds)
    return results, seconds, False


def evaluate(
    target: PreTrainedModel,
    tokenizer: Any,
    drafter: DFlashDrafter,
    drafter_config: DrafterConfig,
    records: Sequence[dict[str, Any]],
    *,
    max_new_tokens: int,
    batch_size: int = EvalSettings().batch_size,
    enable_thinking: bool = False,
    tie_tolerance: float | None = None,
    warmup: bool = True,
    baseline_dir: str | Path | None = None,
    target_id: str = "",
    sampling: Sequence[SamplingOptions] = (SamplingOptions(),),
    processor: Any = None,
) -> dict[str, Any]:
    """Decode every record greedily (or read the cached baseline) and speculatively once per
    entry of `sampling` (default: greedy); the report of evaluation.report (summary, settings and
    "samples") of the first entry, plus "by_temperature" (every entry's summary) for several.
    Records with images (read_prompts) need the target's `processor` and a wrapper loaded whole:
    every prompt then decodes one at a time with its vision inputs, and the teacher-forced
    estimate (text only) is left out.

    Raises LosslessError if a sample's speculative output is not the greedy one (numerical ties
    aside, see lossless.py; tie_tolerance None = by the target's dtype). `warmup` decodes a few
    tokens of the first batch untimed first (CUDA context, kernel selection, allocator).
    """
    if max_new_tokens < 1 or not records:
        raise ValueError(
            f"need max_new_tokens >= 1 and records, got {max_new_tokens}, {len(records)}"
        )
    check_drafter_fits_target(drafter_config, target)
    embed, _ = frozen_embeddings(target)
    eos, suppress = stop_rules(target, tokenizer)
    tolerance = tie_tolerance_for(embed.dtype) if tie_tolerance is None else tie_tolerance
    vision = None
    if has_image_prompts(records):
        if processor is None:
            raise ValueError("image prompts need the target's processor")
        prompts, vision = image_prompts_of(
            processor,
            records,
            enable_thinking=enable_thinking,
            device=embed.device,
            dtype=embed.dtype,
        )
    else:
        prompts = prompts_of(tokenizer, records, enable_thinking=enable_thinking)
    setup = DecodeSetup(target, prompts, max_new_tokens, eos, suppress, batch_size, vision=vision)
    if warmup:
        short = min(max_new_tokens, 2 * drafter_config.block_size)
        trial = replace(setup, prompts=prompts[:batch_size], max_new_tokens=short)
        trial = replace(trial, vision=vision[:batch_size] if vision is not None else None)
        run_decoders(greedy_decoders(trial)[:1], setup.device)
        run_decoders(speculative_decoders(trial, drafter, drafter_config)[:1], setup.device)
    plain, plain_s, cached = greedy_baseline(setup, folder=baseline_dir, target_id=target_id)
    results = []
    for options in sampling:
        sampled = replace(setup, sampling=sampled_or_none(options))
        batches = speculative_decoders(sampled, drafter, drafter_config)
        shown = progress(batches, total=len(batches), task="eval speculative (batches)")
        spec, spec_s = run_decoders(shown, setup.device)
        results.append(
            report(
                sampled,
                plain,
                spec,
                block_size=drafter_config.drafts_per_block + 1,  # the verified block
                plain_s=plain_s,
                speculative_s=spec_s,
                tie_tolerance=tolerance,
            )
        )
    several = {"by_temperature": [_summary(r) for r in results]} if results[1:] else {}
    estimate = heldout_estimate(target, drafter, prompts, plain) if vision is None else {}
    return results[0] | several | estimate | {"baseline_cached": cached}


def _summary(report: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in report.items() if k != "samples"}


def write_results(samples: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Per-sample results as JSON lines, written atomically."""
    return write_jsonl(samples, path)


def load_fitting_drafter(
    drafter_dir: str | Path, target: PreTrainedModel, device: torch.device, block_size: int | None
) -> tuple[DFlashDrafter, DrafterConfig]:
    """load_drafter on `device` in the target's dtype; DataError (one line, naming the folder) if
    the export is missing, unreadable or built for another target; UsageError for --block-size."""
    dtype = frozen_embeddings(target)[0].dtype
    try:
        drafter, config = load_drafter(
            drafter_dir, device=device, dtype=dtype, block_size=block_size
        )
        check_drafter_fits_target(config, target)
    except UsageError:
        raise
    except (OSError, ValueError) as e:
        raise DataError(f"drafter export {str(drafter_dir)!r}: {e}") from e
    return drafter, config


def run_eval(
    target_path: str | Path | None,
    drafter_dir: str | Path,
    prompts_path: str | Path | None,
    *,
    device: torch.device | str,
    max_new_tokens: int = EvalSettings().max_new_tokens,
    num_prompts: int = EvalSettings().num_prompts,
    batch_size: int = EvalSettings().batch_size,
    log: Any = None,
    cache_dir: str | Path = ".cache/dflash_async",
    results_path: str | Path | None = None,
    baseline_dir: str | Path | None = None,
    dtype: torch.dtype | None = None,
    enable_thinking: bool = False,
    block_size: int | None = None,
    sampling: Sequence[SamplingOptions] = (SamplingOptions(),),
) -> dict[str, Any]:
    """Load the target (empty path = the built-in tiny one, kept under cache_dir) and a drafter
    export, decode `num_prompts` prompts (from prompts_path, or the tiny demo's held-out
    prompts), log one `eval_completed` event, return the report. The greedy baseline is kept in
    `baseline_dir` (default: the results file's folder; None without one). Bad inputs raise
    one-line ValueErrors: TargetError (target folder), DataError (drafter export, prompts file),
    UsageError (a block_size above the trained one). block_size None: the trained one; sampling:
    evaluate's."""
    log = log or get_logger(__name__)
    device = torch.device(device)
    folder = Path(target_path) if target_path else ensure_tiny_target(Path(cache_dir))
    if prompts_path:
        records = read_prompts(prompts_path)[:num_prompts]
    else:
        records = demo_prompts(num_prompts, split="heldout")
    processor = None
    if has_image_prompts(records):  # the wrapper whole and its processor (targets/multimodal.py)
        processor = multimodal.load_target_processor(str(folder))
        dtype = dtype or default_target_dtype(device)
        target = multimodal.load_multimodal_target(str(folder), device=device, dtype=dtype)
    else:
        target = load_target(folder, device=device, dtype=dtype)
    tokenizer = load_target_tokenizer(folder)
    drafter, config = load_fitting_drafter(drafter_dir, target, device, block_size)
    with cpu_threads(1 if device.type == "cpu" else None):
        report = evaluate(
            target,
            tokenizer,
            drafter,
            config,
            records,
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
            enable_thinking=enable_thinking,
            baseline_dir=baseline_dir or (Path(results_path).parent if results_path else None),
            target_id=str(folder.resolve()),
            sampling=sampling,
            processor=processor,
        )
    if results_path:
        write_results(report["samples"], results_path)
    summary = _summary(report)
    log.info("eval_completed", target=str(folder), drafter=str(drafter_dir), **summary)
    return report


def add_decoding_arguments(parser: argparse.ArgumentParser, *, drafter_help: str) -> EvalSettings:
    """The options every command that decodes held-out prompts with a drafter export takes (eval,
    calibrate): target, drafter, prompts, device, tokens per prompt, prompts, target dtype.
    Returns the in-run evaluation's defaults (DFLASH_EVAL__*), which they start from."""
    parser.add_argument("--target", default="", help="local HF model folder; empty = tiny demo")
    parser.add_argument("--drafter", required=True, help=drafter_help)
    parser.add_argument(
        "--prompts",
        default="",
        help="one prompt a record: {messages} (OpenAI), {conversations} (ShareGPT) or {prompt}, "
        "as jsonl, json or parquet (docs/evaluation.md); empty = the demo's held-out prompts",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    defaults = EvalSettings()
    parser.add_argument("--max-new-tokens", type=positive_int, default=defaults.max_new_tokens)
    parser.add_argument("--num-prompts", type=positive_int, default=defaults.num_prompts)
    parser.add_argument(
        "--dtype", choices=sorted(TARGET_DTYPES), default="auto", help="of the target"
    )
    return defaults


def build_parser() -> argparse.ArgumentParser:
    """The options of `python -m dflash_async eval` (see main)."""
    parser = ArgumentParser(  # one-line argument errors (usage.py)
        prog="python -m dflash_async eval",
        description="Acceptance length (tau) of a drafter export by speculative decoding.",
    )
    defaults = add_decoding_arguments(parser, drafter_help="drafter export folder")
    parser.add_argument("--batch-size", type=positive_int, default=defaults.batch_size)
    parser.add_argument("--results", default="", help="write per-sample results (jsonl) here")
    parser.add_argument(
        "--baseline-dir",
        default="",
        help="keep the greedy baseline here (default: --results' folder)",
    )
    parser.add_argument(
        "--block-size",
        type=positive_int,
        default=None,
        help="decode blocks of this size (<= the trained block size; default: the trained one)",
    )
    parser.add_argument(
        "--temperature",
        type=temperatures,
        default=(defaults.temperature,),
        help="sampling temperature(s), comma separated (0 = greedy; e.g. 0,0.7,1.0: tau at each)",
    )
    parser.add_argument("--top-p", type=float, default=defaults.top_p, help="1 = off; T > 0")
    parser.add_argument("--top-k", type=int, default=defaults.top_k, help="0 = off; T > 0")
    parser.add_argument("--seed", type=int, default=0, help="of the per-prompt generators")
    return parser


def main(argv: list[str] | None = None) -> int:
    """`python -m dflash_async eval ...`: print the summary as one JSON line and return 0.

    A lossless-check failure is logged (`eval_failed`) and returns 1. Bad paths raise TargetError
    or DataError (one line; the CLI exits 2); the built-in tiny target is kept in
    `builtin_cache_dir()`.
    """
    args = build_parser().parse_args(argv)
    opts = sampling_options(args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    if args.baseline_dir:  # unwritable: one line, exit 2, before the target is loaded
        check_writable_folder(args.baseline_dir, argument="--baseline-dir")
    log = get_logger(__name__)
    try:
        report = run_eval(
            args.target or None,
            args.drafter,
            args.prompts or None,
            device=args.device,
            max_new_tokens=args.max_new_tokens,
            num_prompts=args.num_prompts,
            batch_size=args.batch_size,
            log=log,
            cache_dir=builtin_cache_dir(),
            results_path=args.results or None,
            baseline_dir=args.baseline_dir or None,
            dtype=TARGET_DTYPES[args.dtype],
            block_size=args.block_size,
            sampling=opts,
        )
    except LosslessError as e:
        log.error("eval_failed", reason="lossless_check", error=str(e))
        return 1
    print(json.dumps(_summary(report)), flush=True)
    return 0
