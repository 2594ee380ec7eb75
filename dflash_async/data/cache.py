"""The tokenized-data cache: flat arrays on disk, memory-mapped, keyed by everything that shapes them.

A cache entry is a folder `tokenized-<key>/` of three raw little-endian arrays (`tokens.bin`
int32, `loss_mask.bin` bool, `offsets.bin` int64: sample i is tokens[offsets[i]:offsets[i+1]])
and `summary.json` (counts, dtypes, sizes). The arrays are appended chunk by chunk while
tokenizing, so a corpus larger than RAM never sits in memory, and opened with np.memmap: loading
1 M samples costs a few page faults, not a read. Written through the package's one atomic
helper (dflash_async.atomic: temporary sibling, fsync, rename), so a reader (a later run, another
rank) sees a whole entry or none; two writers of one key produce the same bytes.

The key hashes the data files (resolved path, size, mtime), the tokenizer's full definition and
chat template, the options that change the samples (max_len, masking, role map, ...) and the
cache version. A lock file per key makes the other ranks of a node wait for the one building it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

CACHE_VERSION = 2  # bump when the tokenization or the cache layout changes
ARRAYS = {"tokens": np.int32, "loss_mask": np.bool_, "offsets": np.int64}


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of the tokenizer's full definition (vocab, merges, added tokens) and chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    digest = hashlib.sha256()
    if backend is not None:
        digest.update(backend.to_str().encode())
    else:
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    digest.update(repr(getattr(tokenizer, "chat_template", None)).encode())
    return digest.hexdigest()


def cache_key(files: list[Path], tokenizer: Any, options: dict[str, Any]) -> str:
    """Key of the tokenized cache: data files (path, size, mtime), tokenizer, sample options."""
    stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    material = {
        "version": CACHE_VERSION,
        "files": stats,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "options": options,
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:32]


def entry_path(cache_dir: Path, key: str) -> Path:
    return cache_dir / f"tokenized-{key}"


def open_arrays(folder: Path) -> dict[str, np.ndarray]:
    """The arrays of a written folder, memory-mapped read-only (empty arrays are plain)."""
    arrays = {}
    for name, dtype in ARRAYS.items():
        path = folder / f"{name}.bin"
        size = path.stat().st_size
        arrays[name] = np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype=dtype)
    return arrays


def read_entry(cache_dir: Path, key: str) -> tuple[dict[str, np.ndarray], dict] | None:
    """(memory-mapped arrays, summary) of the entry under `key`, or None if there is none."""
    folder = entry_path(cache_dir, key)
    if not (folder / "summary.json").is_file():
        return None
    return open_arrays(folder), json.loads((folder / "summary.json").read_text())


class ArrayWriter:
    """Appends samples to the three array files of a folder; `finish` writes the summary."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        # open for the writer's lifetime; closed by close() / leaving its `with` block
        self._files = {name: open(folder / f"{name}.bin", "wb") for name in ARRAYS}  # noqa: SIM115
        self._files["offsets"].write(np.zeros(1, np.int64).tobytes())
        self.num_tokens = 0
        self.num_samples = 0
        self.num_supervised = 0
        self.max_token_id = -1

    def append(self, tokens: np.ndarray, loss_mask: np.ndarray, lengths: np.ndarray) -> None:
        """Samples laid end to end: tokens [N] int32, loss_mask [N] bool, lengths [n] (sum N)."""
        offsets = self.num_tokens + np.cumsum(lengths, dtype=np.int64)  # [n]
        self._files["tokens"].write(np.ascontiguousarray(tokens, dtype=np.int32).tobytes())
        self._files["loss_mask"].write(np.ascontiguousarray(loss_mask, dtype=np.bool_).tobytes())
        self._files["offsets"].write(offsets.tobytes())
        self.num_tokens += len(tokens)
        self.num_samples += len(lengths)
        self.num_supervised += int(loss_mask.sum())
        if len(tokens):
            self.max_token_id = max(self.max_token_id, int(tokens.max()))

    def __enter__(self) -> ArrayWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        for stream in self._files.values():
            stream.close()

    def finish(self, summary: dict) -> None:
        """Flush the arrays to disk, then write summary.json (its presence marks an entry done)."""
        for stream in self._files.values():
            stream.flush()
            os.fsync(stream.fileno())
        self.close()
        (self.folder / "summary.json").write_text(json.dumps(summary))


def unfinished(folder: Path) -> bool:
    """A folder under an entry's name without summary.json (not an entry): safe to replace."""
    return not (folder / "summary.json").is_file()


@contextmanager
def entry_lock(cache_dir: Path, key: str) -> Iterator[None]:
    """Hold the lock of one key (an flock on `tokenized-<key>.lock`): the ranks of a node that
    load the same data wait for the first one to build the entry instead of each building it.
    Entries stay correct without it (the atomic rename); it saves the duplicated work."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / f"tokenized-{key}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield
