"""The export formats, one table, and `python -m dflash_async export`, which rewrites an export
in another of them (docs/DFLASH.md s.11, "The speculators export").

FORMATS maps a format's name to its writer: `default` is the export every run writes
(checkpoint/export.py: z-lab's, SGLang's and DeepSpec's config), `speculators` the vLLM
speculators convention (checkpoint/speculators.py). The command reads an export folder (the
default format, as a run writes it), checks it as `eval` does, and writes the same bf16 tensors
in the chosen format: the values are copied, never recomputed.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from dflash_async.checkpoint import speculators
from dflash_async.checkpoint.export import export_drafter, load_drafter_export
from dflash_async.model.drafter_config import DrafterConfig
from dflash_async.usage import ArgumentParser


def _default(tensors, config, out: Path, *, verifier, verifier_architectures) -> Path:
    return export_drafter(tensors, config, out)


Writer = Callable[..., Path]
# name -> writer(tensors, config, out, *, verifier, verifier_architectures)
FORMATS: dict[str, Writer] = {
    "default": _default,
    "speculators": speculators.export_speculators,
}


def write_export(
    tensors: Mapping[str, torch.Tensor],
    config: DrafterConfig,
    out: Path,
    *,
    format: str,
    verifier: str | None = None,
    verifier_architectures: list[str] | tuple[str, ...] = (),
) -> Path:
    """Write `tensors` of a `config` drafter to `out` in `format` (a FORMATS name)."""
    if format not in FORMATS:
        raise ValueError(f"unknown export format {format!r}; the formats are {', '.join(FORMATS)}")
    return FORMATS[format](
        tensors, config, Path(out), verifier=verifier, verifier_architectures=verifier_architectures
    )


def verifier_architectures(verifier: str) -> list[str]:
    """The `architectures` of the verifier's config.json when `verifier` is a local folder
    holding one; [] otherwise (a Hugging Face id: nothing is downloaded)."""
    path = Path(verifier) / "config.json"
    if not path.is_file():
        return []
    return list(json.loads(path.read_text()).get("architectures") or [])


def build_parser() -> argparse.ArgumentParser:
    """The options of `python -m dflash_async export`."""
    parser = ArgumentParser(
        prog="python -m dflash_async export",
        description="Rewrite a drafter export in another format (the tensors are copied).",
    )
    parser.add_argument("--drafter", required=True, help="the export folder a run wrote")
    parser.add_argument("--format", required=True, choices=sorted(FORMATS))
    parser.add_argument("--out", required=True, help="the folder to write")
    parser.add_argument(
        "--verifier",
        default="",
        help="speculators: the target's Hugging Face id or folder, recorded in the config",
    )
    return parser


def run_export(args: argparse.Namespace) -> dict[str, Any]:
    """Read --drafter, write --out in --format; the JSON line's contents."""
    config, tensors = load_drafter_export(Path(args.drafter))
    verifier = args.verifier or None
    architectures = verifier_architectures(verifier) if verifier else []
    out = write_export(
        tensors,
        config,
        Path(args.out),
        format=args.format,
        verifier=verifier,
        verifier_architectures=architectures,
    )
    return {"event": "export_written", "format": args.format, "path": str(out)}
