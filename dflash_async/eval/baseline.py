"""The plain-greedy baseline of an evaluation, computed once and kept in the output folder.

Every evaluation checks each speculative output against plain greedy decoding of the target, and
reports plain tokens/s next to speculative tokens/s. The greedy output depends only on the
target (its folder, dtype and device kind), the prompt token ids (so the chat template),
max_new_tokens, the stop rules, the decode batch size (bf16 kernels differ by batch shape) and
an image prompt's vision inputs, never on the drafter: so it is decoded once per key and stored as
`<folder>/baseline-<key>.jsonl` (one meta line, then one line per prompt), and every later
evaluation of the run, a resumed run or a later `eval` reads it back.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from dflash_async.eval.lossless import GreedyResult
from dflash_async.eval.regenerate import write_jsonl


def baseline_key(
    *,
    target_id: str,
    dtype: str,
    device_type: str,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos: frozenset[int],
    suppress: Sequence[int],
    batch_size: int,
    images: str = "",
) -> str:
    """A 16-hex-digit digest of everything the greedy output depends on (`images`: a digest of
    image prompts' vision inputs, vision_digest; "" for text prompts)."""
    identity = {
        "target": target_id,
        "dtype": dtype,
        "device_type": device_type,
        "prompts": [list(map(int, p)) for p in prompts],
        "max_new_tokens": max_new_tokens,
        "eos": sorted(eos),
        "suppress": sorted(suppress),
        "batch_size": batch_size,
    }
    if images:  # text prompts keep the keys they always had
        identity["images"] = images
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def vision_digest(vision: Sequence[Mapping[str, torch.Tensor]] | None) -> str:
    """A digest of image prompts' vision inputs (names, shapes, dtypes and values), "" for none."""
    if vision is None:
        return ""
    digest = hashlib.sha256()
    for inputs in vision:
        for name in sorted(inputs):
            value = inputs[name].detach().cpu().contiguous()
            digest.update(f"{name}{tuple(value.shape)}{value.dtype}".encode())
            digest.update(value.view(-1).view(torch.uint8).numpy().tobytes())
        digest.update(b"|")
    return digest.hexdigest()[:16]


def baseline_path(folder: str | Path, key: str) -> Path:
    return Path(folder) / f"baseline-{key}.jsonl"


def load_baseline(folder: str | Path, key: str) -> tuple[list[GreedyResult], float] | None:
    """(results, seconds it took to decode them) or None when not computed yet."""
    path = baseline_path(folder, key)
    if not path.is_file():
        return None
    meta, *rows = (json.loads(line) for line in path.read_text().splitlines())
    if meta.get("key") != key or len(rows) != meta.get("num_prompts"):
        return None  # a stale or truncated file: decode again (it is rewritten atomically)
    results = [
        GreedyResult(r["tokens"], r["runner_up"], r["margins"], r["alternatives"], r["gaps"])
        for r in rows
    ]
    return results, float(meta["plain_s"])


def save_baseline(
    folder: str | Path, key: str, results: Sequence[GreedyResult], plain_s: float
) -> Path:
    """Write the baseline atomically (a reader never sees half a file)."""
    meta = {"key": key, "num_prompts": len(results), "plain_s": plain_s}
    rows = [
        {
            "tokens": r.tokens,
            "runner_up": r.runner_up,
            "margins": r.margins,
            "alternatives": r.alternatives,
            "gaps": r.gaps,
        }
        for r in results
    ]
    return write_jsonl([meta, *rows], baseline_path(folder, key))
