"""The error contract every command shares, for what a user passes in (arguments, devices, paths).

Bad input is a `UsageError` (or SettingsError, DataError, TargetError): the CLI prints one line,
`error: ...`, on stderr and exits 2, before any model is loaded. `ArgumentParser` gives argparse
mistakes the same one-line form (argparse alone prints the whole usage first). Imports no torch.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import NoReturn


class UsageError(ValueError):
    """A bad argument of a command; `str(error)` is one line naming the argument (exit 2)."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with an argument error as one line on stderr (`--help` shows the usage)."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {self.prog}: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def positive_int(text: str) -> int:
    """argparse type: an int >= 1 (the parser then exits 2 naming the option and the value)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def require_cuda(what: str, device: str | None = None) -> None:
    """UsageError unless CUDA is available (and `device`, when given, is a CUDA device)."""
    import torch

    if not torch.cuda.is_available():
        raise UsageError(f"{what} needs a CUDA GPU and none is visible here")
    if device is not None and torch.device(device).type != "cuda":
        raise UsageError(f"{what} measures the GPU path: --device {device} is not a CUDA device")


def check_writable_file(path: str | os.PathLike[str], *, argument: str) -> Path:
    """UsageError unless a file can be written at `path` (its folder is created if needed)."""
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"{argument} {str(target)!r} is a folder, not a file")
    check_writable_folder(target.parent, argument=argument, shown=target)
    return target


def check_writable_folder(
    path: str | os.PathLike[str], *, argument: str, shown: str | os.PathLike[str] | None = None
) -> Path:
    """UsageError unless files can be created in folder `path` (created if needed); tried for
    real with a temporary file, since permission bits say nothing for root or on network mounts."""
    folder = Path(path)
    shown = str(shown if shown is not None else folder)
    existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise UsageError(f"{argument} {shown!r} cannot be written: {str(existing)!r} is a file")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise UsageError(f"{argument} {shown!r} cannot be written: {reason}") from None
    return folder
