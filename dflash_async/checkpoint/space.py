"""Disk space for checkpoints: the start-up check that the output folder's filesystem can hold
the run's checkpoints and export, and the one-line error of a save that found the disk full.

The sizes come from the code that writes them (`state.checkpoint_bytes`, `export.export_bytes`).
Only the standard library is imported at the top: the CLI imports `NoSpaceError` from here to
map it to its exit code (2, __main__.py), and a bad-settings exit should not wait for torch.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    from dflash_async.model.drafter_config import DrafterConfig
    from dflash_async.model.step import DrafterStep

# OSError numbers that mean "this filesystem takes no more of your bytes": full, or over quota.
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
# What torch.save's C++ writer (PyTorchStreamWriter) raises, as a RuntimeError without an errno,
# when the OS accepted fewer bytes than it wrote: "[enforce fail at inline_container.cc:672] .
# unexpected pos 704 vs 598" (torch 2.x on a full disk), or "... file write failed".
_SHORT_WRITE = ("unexpected pos", "file write failed")


class NoSpaceError(Exception):
    """A checkpoint or export write ran out of disk space; the CLI exits 2 with its one line."""

    def __init__(self, path: Path, *, needed: int | None, free: int) -> None:
        self.path, self.needed, self.free = Path(path), needed, free
        needs = f"needs ~{human_bytes(needed)}, " if needed is not None else ""
        super().__init__(
            f"no space left on device writing {self.path} ({needs}{human_bytes(free)} free)"
        )


def human_bytes(n: int) -> str:
    """`n` bytes in the largest binary unit that leaves a number >= 1 (1.5 GiB, 320.0 KiB)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still put on the filesystem of `path` (or of its nearest
    existing parent, for a folder not created yet)."""
    existing = next(p for p in (Path(path), *Path(path).parents) if p.exists())
    return shutil.disk_usage(existing).free


def space_needed(
    *, checkpoint: int, export: int, keep: int, existing: int, has_export: bool
) -> int:
    """Bytes the run still needs on the output filesystem.

    The rule: a save writes the new checkpoint before it deletes the oldest, so the folder holds
    up to `keep` + 1 checkpoints and one export (a new export is written only after the pruning,
    and a checkpoint is larger than an export). Checkpoints and an export already on disk (a
    resumed run's) are counted as part of that: only the missing ones need free space.
    """
    missing = max(0, keep + 1 - existing)
    return missing * checkpoint + (0 if has_export else export)


def check_output_space(
    output_dir: Path,
    step: DrafterStep,
    config: DrafterConfig,
    *,
    keep: int,
    free: Callable[[Path], int] | None = None,
) -> int:
    """SettingsError (exit 2, one line naming DFLASH_TRAIN__KEEP_CHECKPOINTS) unless the free
    space of `output_dir`'s filesystem holds the run's checkpoints and export (`space_needed`);
    returns the bytes needed. Call on rank 0 (the writer) once the drafter is built. `free`: a
    test's stand-in for the filesystem's free bytes (default: `free_bytes`, looked up at the call)."""
    from dflash_async.checkpoint.export import export_bytes  # torch: imported when used
    from dflash_async.checkpoint.resume import export_path
    from dflash_async.checkpoint.state import checkpoint_bytes, list_checkpoints
    from dflash_async.errors import SettingsError

    existing = len(list_checkpoints(output_dir))
    needed = space_needed(
        checkpoint=checkpoint_bytes(step),
        export=export_bytes(config),
        keep=keep,
        existing=existing,
        has_export=export_path(Path(output_dir)).exists(),
    )
    available = (free or free_bytes)(Path(output_dir))
    if needed > available:
        already = f", {existing} already there" if existing else ""
        raise SettingsError(
            f"DFLASH_OUTPUT_DIR={output_dir}: needs ~{human_bytes(needed)} for {keep}+1 "
            f"checkpoints and the export{already}, {human_bytes(available)} free on its "
            "filesystem; free some space, choose another DFLASH_OUTPUT_DIR, or keep fewer "
            f"checkpoints (DFLASH_TRAIN__KEEP_CHECKPOINTS={keep})"
        )
    return needed


def is_no_space(error: BaseException, *, needed: int | None, free: int) -> bool:
    """Whether a failed write failed for want of space: an OSError ENOSPC/EDQUOT, or torch's
    short-write RuntimeError (no errno) while the filesystem has less free than the write needs
    (measured after the partial write was removed, so a short write for another reason, with
    room to spare, stays the internal error it is)."""
    if isinstance(error, OSError):
        return error.errno in _NO_SPACE
    if isinstance(error, RuntimeError) and any(s in str(error) for s in _SHORT_WRITE):
        return needed is not None and free < needed
    return False
