"""`python -m dflash_async calibrate`: fit a DSpark export's confidence-head temperature on held-out
prompts and write it into the export (eval/calibration.py has the method and why it is exact).

The target, prompts, device and dtype options are `eval`'s. The held-out sequences are each
prompt followed by the target's greedy continuation (--max-new-tokens). The result is one JSON
line: the temperature and the BCE per slot before and after.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from dflash_async.checkpoint.export import load_drafter_export
from dflash_async.data.samples import DataError
from dflash_async.eval import calibration
from dflash_async.eval.harness import (
    TARGET_DTYPES,
    add_decoding_arguments,
    load_fitting_drafter,
    prompts_of,
    read_prompts,
    stop_rules,
)
from dflash_async.eval.speculative import greedy_generate
from dflash_async.log import get_logger, progress
from dflash_async.runtime.cpu_threads import cpu_threads
from dflash_async.targets.loading import frozen_embeddings, load_target, load_target_tokenizer
from dflash_async.targets.tiny import builtin_cache_dir, demo_prompts, ensure_tiny_target
from dflash_async.usage import ArgumentParser, check_writable_folder


def build_parser() -> argparse.ArgumentParser:
    """The options of `python -m dflash_async calibrate`."""
    parser = ArgumentParser(
        prog="python -m dflash_async calibrate",
        description="Fit a DSpark drafter's confidence-head temperature on held-out prompts and "
        "fold it into the export's confidence head (the format is unchanged).",
    )
    add_decoding_arguments(parser, drafter_help="DSpark drafter export folder")
    parser.add_argument(
        "--out", default="", help="write the calibrated export here (default: over --drafter)"
    )
    return parser


def check_drafter(path: str) -> None:
    """DataError (one line, exit 2) unless `path` is a readable DSpark export with a confidence
    head: checked before the target is loaded."""
    try:
        config, _ = load_drafter_export(Path(path))
        calibration.check_calibratable(config, where=f"drafter export {path!r}")
    except (OSError, ValueError) as e:
        raise DataError(str(e) if "drafter export" in str(e) else f"{path!r}: {e}") from e


def run_calibrate(args: argparse.Namespace) -> dict[str, Any]:
    """Fit, write, return the report (see the module doc)."""
    device = torch.device(args.device)
    folder = Path(args.target) if args.target else ensure_tiny_target(builtin_cache_dir())
    if args.prompts:
        records = read_prompts(args.prompts)[: args.num_prompts]
    else:
        records = demo_prompts(args.num_prompts, split="heldout")
    target = load_target(folder, device=device, dtype=TARGET_DTYPES[args.dtype])
    tokenizer = load_target_tokenizer(folder)
    drafter, _ = load_fitting_drafter(args.drafter, target, device, None)
    embed, lm_head = frozen_embeddings(target)
    eos, suppress = stop_rules(target, tokenizer)
    with cpu_threads(1 if device.type == "cpu" else None), torch.no_grad():
        sequences = []
        prompts = prompts_of(tokenizer, records, enable_thinking=False)
        for prompt in progress(prompts, total=len(prompts), task="calibrate (prompts)"):
            result = greedy_generate(
                target, prompt, args.max_new_tokens, list(eos), suppress_token_ids=suppress
            )
            sequences.append((list(prompt) + list(result.tokens), len(prompt)))
        pairs = calibration.heldout_pairs(target, drafter, embed, lm_head, sequences)
    try:
        temperature = calibration.fit_temperature(pairs.logits, pairs.acceptance)
    except ValueError as e:  # no slots, or a head that does not predict acceptance: exit 2
        raise DataError(f"drafter export {args.drafter!r}: {e}") from e
    out = Path(args.out or args.drafter)
    calibration.write_calibrated_export(Path(args.drafter), out, temperature)
    return {
        "event": "calibrated",
        "path": str(out),
        "temperature": temperature,
        "pairs": int(pairs.logits.numel()),
        "bce_before": calibration.bce(pairs.logits, pairs.acceptance),
        "bce_after": calibration.bce(pairs.logits, pairs.acceptance, temperature),
        "by_slot_before": calibration.bce_by_slot(pairs),
        "by_slot_after": calibration.bce_by_slot(pairs, temperature),
    }


def main(argv: list[str] | None = None) -> int:
    """Parse, check the inputs (exit 2 on bad ones, before any model is loaded), calibrate,
    print the report as one JSON line."""
    args = build_parser().parse_args(argv)
    check_drafter(args.drafter)
    if args.prompts:
        read_prompts(args.prompts)
    check_writable_folder(args.out or args.drafter, argument="--out")
    report = run_calibrate(args)
    get_logger(__name__).info("calibrated", path=report["path"], temperature=report["temperature"])
    print(json.dumps(report), flush=True)
    return 0
