"""The tiny CPU run that the pipeline-level tests share: the built-in tiny target, a small
pre-tokenized data set, and the DFLASH_* settings of a 256-row, 16-anchor, one-layer run.

One place for them, so that a run-defining default changes once for every test that starts a run
(pipeline, placement, resume, signals, several nodes, in-run evaluation, the CLI, run reports).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from dflash_async.targets.loading import load_target_tokenizer
from dflash_async.targets.tiny import ensure_tiny_target


def write_pretokenized(path: Path, *, records: int, vocab: int, seed: int = 0) -> Path:
    """`records` pre-tokenized samples of 24..60 tokens, the first quarter unsupervised."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(records):
            n = rng.randint(24, 60)
            ids = [rng.randrange(10, vocab) for _ in range(n)]
            mask = [0] * (n // 4) + [1] * (n - n // 4)
            f.write(json.dumps({"input_ids": ids, "loss_mask": mask}) + "\n")
    return path


def tiny_inputs(root: Path, *, records: int = 40) -> dict[str, str]:
    """The tiny target folder, its mask token and a data file (40 samples: ~6 packs an epoch)."""
    target = ensure_tiny_target(root / "cache")
    tokenizer = load_target_tokenizer(target)
    data = write_pretokenized(root / "data.jsonl", records=records, vocab=len(tokenizer))
    return {"target": str(target), "data": str(data), "mask": str(tokenizer.mask_token_id)}


def tiny_env(inputs: dict[str, str], output_dir: Path | None = None) -> dict[str, str]:
    """Settings of a tiny CPU run, no preset file; the caller adds steps, saves, evaluation."""
    env = {
        "DFLASH_ENV_FILE": "none",
        "DFLASH_TARGET__PATH": inputs["target"],
        "DFLASH_TARGET__NUM_FEATURES": "3",
        "DFLASH_DATA__PATH": inputs["data"],
        "DFLASH_DATA__MAX_LEN": "128",
        "DFLASH_DRAFTER__NUM_LAYERS": "1",
        "DFLASH_DRAFTER__MASK_TOKEN_ID": inputs["mask"],
        "DFLASH_TRAIN__TOKEN_BUDGET": "256",
        "DFLASH_TRAIN__NUM_ANCHORS": "16",
        "DFLASH_TRAIN__BLOCK_SIZE": "8",
        "DFLASH_TRAIN__CE_CHUNK_SIZE": "64",
        "DFLASH_PIPELINE__NUM_SLOTS": "2",
        "DFLASH_PIPELINE__TARGET_BATCH_TOKENS": "256",
    }
    if output_dir is not None:
        env["DFLASH_OUTPUT_DIR"] = str(output_dir)
    return env


def tiny_run_settings(root: Path, cache: Path) -> dict[str, str]:
    """A tiny CPU run in `root` as the CLI starts it (JSON logs, outputs under root/out, the
    default CE chunk): the tiny target (built once under `cache`), 40 pre-tokenized samples,
    256-row packs, a 1-layer drafter, steps until stopped."""
    target = ensure_tiny_target(cache)
    tokenizer = load_target_tokenizer(target)
    write_pretokenized(root / "data.jsonl", records=40, vocab=len(tokenizer))
    return {
        "DFLASH_ENV_FILE": "none",
        "DFLASH_LOG__FORMAT": "json",
        "DFLASH_OUTPUT_DIR": str(root / "out"),
        "DFLASH_TARGET__PATH": str(target),
        "DFLASH_TARGET__NUM_FEATURES": "3",
        "DFLASH_DATA__PATH": str(root / "data.jsonl"),
        "DFLASH_DATA__MAX_LEN": "128",
        "DFLASH_DRAFTER__NUM_LAYERS": "1",
        "DFLASH_DRAFTER__MASK_TOKEN_ID": str(tokenizer.mask_token_id),
        "DFLASH_TRAIN__TOKEN_BUDGET": "256",
        "DFLASH_TRAIN__NUM_ANCHORS": "16",
        "DFLASH_TRAIN__BLOCK_SIZE": "8",
        "DFLASH_TRAIN__MAX_STEPS": "100000",
        "DFLASH_TRAIN__SAVE_EVERY": "0",
        "DFLASH_PIPELINE__NUM_SLOTS": "2",
        "DFLASH_PIPELINE__TARGET_BATCH_TOKENS": "256",
    }
