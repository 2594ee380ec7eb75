"""Atomic writes, the one helper of the package: a file or a folder appears whole, or not at all.

Both forms write a temporary sibling (`.NAME.tmp-PID-RANDOM`), fsync every file in it and the
folder itself, rename it into place and fsync the parent, so that after a crash, a SIGKILL or a
power cut a reader finds either the previous version or the new one, never a partial one.
Temporaries are created with `open` and `mkdir`, so they respect the umask like any other output
(group-readable where the umask says so; `tempfile` would make them private, 0600/0700), and
files that a library wrote privately into a temporary folder are opened up to what the umask allows.

A folder cannot be renamed over a non-empty folder: the previous one is first renamed aside
(`.NAME.old-*`) and deleted once the new one is in place. A crash between the two renames leaves
no folder at NAME but the previous one intact beside it; `stale_siblings` finds such leftovers.
"""

from __future__ import annotations

import os
import shutil
import stat
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


def fsync_path(path: Path) -> None:
    """fsync a file or a folder (a folder's fsync makes the renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    """The process umask, read without changing it (os.umask would, for every thread)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o022)  # no /proc (not Linux): the classic read-and-restore
        os.umask(mask)
        return mask


def _settle_tree(root: Path) -> None:
    """Give every file the permissions the umask allows (some writers, e.g. safetensors,
    create 0600 files), then fsync each file and folder."""
    readable = 0o666 & ~_umask()
    for folder, _, files in os.walk(root):
        for name in files:
            path = Path(folder) / name
            mode = stat.S_IMODE(path.stat().st_mode)
            if mode | readable != mode:
                path.chmod(mode | readable)
            fsync_path(path)
        fsync_path(Path(folder))


def _tag() -> str:
    return f"{os.getpid()}-{uuid.uuid4().hex[:8]}"


def stale_siblings(path: Path) -> list[Path]:
    """Temporaries and set-aside copies of `path` left by a writer that was killed."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    prefixes = (f".{path.name}.tmp-", f".{path.name}.old-")
    return sorted(p for p in path.parent.iterdir() if p.name.startswith(prefixes))


@contextmanager
def atomic_directory(
    path: str | os.PathLike[str],
    *,
    replaceable: Callable[[Path], bool] = lambda _: True,
    keep_existing: bool = False,
) -> Iterator[Path]:
    """Yield an empty temporary folder beside `path`; when the block ends without an error it
    becomes `path` (every file fsynced first). On an error it is deleted and `path` is untouched.

    An existing `path` is replaced only if `replaceable(path)` (else ValueError, before anything
    is written). `keep_existing`: an existing `path` wins (another process wrote the same thing
    first) and the new copy is discarded.
    """
    final = Path(path)
    if final.exists() and not keep_existing and not (final.is_dir() and replaceable(final)):
        raise ValueError(f"refusing to replace {final}: it is not an earlier copy of this output")
    final.parent.mkdir(parents=True, exist_ok=True)
    tag = _tag()
    tmp, old = (
        final.with_name(f".{final.name}.tmp-{tag}"),
        final.with_name(f".{final.name}.old-{tag}"),
    )
    tmp.mkdir()
    try:
        yield tmp
        _settle_tree(tmp)
        if final.exists():
            if keep_existing:
                return
            final.rename(old)
        tmp.rename(final)
        fsync_path(final.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def atomic_file(path: str | os.PathLike[str], mode: str = "w", **open_kwargs: Any) -> Iterator[IO]:
    """Yield an open temporary file beside `path`; when the block ends without an error it is
    flushed, fsynced and renamed over `path`. On an error it is deleted and `path` is untouched."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{_tag()}")
    try:
        with open(tmp, mode, **open_kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fsync_path(final.parent)
    finally:
        tmp.unlink(missing_ok=True)


def remove_directory(path: Path) -> None:
    """Delete a folder so that no half-deleted copy is ever left under its name: it is renamed
    to a hidden sibling first (atomic), then removed."""
    doomed = path.with_name(f".{path.name}.old-{_tag()}")
    path.rename(doomed)
    fsync_path(path.parent)
    shutil.rmtree(doomed, ignore_errors=True)
