"""The output side of `regenerate`: answers streamed into shard files that a re-run resumes.

OUTPUT/ holds `shard-00000.jsonl`, `shard-00001.jsonl`, ... (`records_per_shard` records each, the
last one shorter), each written whole through atomic.py, and `regenerate.manifest` (JSON; not a
data suffix, so `run` reading OUTPUT/ skips it, as it skips the in-progress part below): the input
fingerprint and settings, the finished shards, how many input records were consumed (answered or
skipped) and how many bytes of the in-progress `shard-NNNNN.jsonl.partial` are complete.

Crash safety, in this order: records are appended to the partial file; a flush fsyncs it, then
rewrites the manifest atomically. A shard is finished by writing its file atomically, then the
manifest, then emptying the partial. A re-run trusts only the manifest: it truncates the partial
to the recorded bytes and regenerates what came after, so a kill at any point (SIGKILL included)
resumes after the last recorded record and, with deterministic answers (greedy), ends with the
same bytes as an uninterrupted run. A crash between a shard's file and the manifest rewrites the
same shard again. A kill inside an atomic write leaves only its temporary, which the re-run
deletes.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dflash_async.atomic import atomic_file, fsync_path
from dflash_async.data.formats import DataError

MANIFEST = "regenerate.manifest"
FORMAT = "dflash-regenerate/1"


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.jsonl"


@dataclass
class Progress:
    """What the manifest records about the work done (all counts of this machine's records)."""

    shards: list[dict[str, Any]] = field(default_factory=list)  # [{"file", "records"}]
    consumed: int = 0  # input records answered or skipped
    skipped: int = 0  # records the server rejected (--on-error skip)
    partial_records: int = 0
    partial_bytes: int = 0
    complete: bool = False


def _refuse(output: Path, why: str) -> DataError:
    return DataError(f"--output {str(output)!r} {why}; choose another folder or delete it")


def read_progress(output: Path, identity: dict[str, Any]) -> Progress:
    """The recorded progress of an earlier run with the same identity (fresh when none);
    DataError (exit 2) for a folder holding something else or a different regeneration."""
    manifest = output / MANIFEST
    if not manifest.is_file():
        if output.is_dir() and any(output.iterdir()):
            raise _refuse(output, "is not empty and holds no regenerate.manifest")
        return Progress()
    try:
        saved = json.loads(manifest.read_text(encoding="utf-8"))
        recorded = saved["identity"]
        progress = Progress(**saved["progress"])
    except (ValueError, KeyError, TypeError) as error:
        raise _refuse(output, f"has an unreadable {MANIFEST} ({error})") from None
    if recorded != identity:
        changed = sorted(
            k for k in identity.keys() | recorded.keys() if identity.get(k) != recorded.get(k)
        )
        raise _refuse(output, f"holds a regeneration with other settings ({', '.join(changed)})")
    return progress


class ShardWriter:
    """Appends answers in input order, finishes shards, flushes the manifest (module docstring)."""

    def __init__(
        self, output: Path, *, identity: dict[str, Any], records_per_shard: int, progress: Progress
    ) -> None:
        self.output, self.identity, self.per_shard = output, identity, records_per_shard
        self.progress = progress
        output.mkdir(parents=True, exist_ok=True)
        self._remove_stale_temporaries()
        self._finish_recorded_shards()
        self._partial_path = output / (shard_name(len(progress.shards)) + ".partial")
        self._partial = self._reopen_partial()
        self._unflushed = False
        self._consistent = True  # False while add/flush/finish run (see flush)

    def _reopen_partial(self) -> Any:
        """The in-progress shard cut back to what the manifest recorded (the rest is redone)."""
        path, size = self._partial_path, self.progress.partial_bytes
        if size and (not path.is_file() or path.stat().st_size < size):
            raise _refuse(self.output, f"lost records of {path.name} that its manifest records")
        partial = open(path, "r+b" if path.is_file() else "w+b")  # noqa: SIM115 (see close())
        partial.truncate(size)
        partial.seek(size)
        return partial

    def _remove_stale_temporaries(self) -> None:
        """A kill inside an atomic write leaves its temporary (`.shard-00001.jsonl.tmp-...`, the
        manifest's): never renamed, so never part of the output; the re-run deletes them."""
        for pattern in (".shard-*.jsonl.tmp-*", f".{MANIFEST}.tmp-*"):
            for stale in self.output.glob(pattern):
                stale.unlink(missing_ok=True)

    def _finish_recorded_shards(self) -> None:
        """A crash right after a shard was recorded: its file exists (it is written first); drop
        the leftover partial of a shard that is finished."""
        for shard in self.progress.shards:
            if not (self.output / shard["file"]).is_file():
                raise _refuse(self.output, f"lost {shard['file']} that its manifest records")
            (self.output / (shard["file"] + ".partial")).unlink(missing_ok=True)

    @property
    def done(self) -> int:
        return self.progress.consumed

    def add(self, record: dict[str, Any] | None) -> None:
        """The next input record's answer (None: skipped); finishes the shard when it is full."""
        self._consistent = False
        self.progress.consumed += 1
        self._unflushed = True
        if record is None:
            self.progress.skipped += 1
        else:
            line = json.dumps(record, ensure_ascii=False, default=str).encode() + b"\n"
            self._partial.write(line)
            self.progress.partial_records += 1
            if self.progress.partial_records == self.per_shard:
                self._finish_shard()
        self._consistent = True

    def flush(self) -> None:
        """Make every record added so far survive a crash (the partial, then the manifest).

        A no-op after an add, flush or finish that did not return (a signal's KeyboardInterrupt
        lands between any two statements, an error): the counts may then be half updated (a
        record counted and not written, or written and not counted), and the manifest of the
        last flush, which is consistent, stands; the re-run redoes what came after it.
        """
        if not self._unflushed or not self._consistent:
            return
        self._consistent = False
        self._partial.flush()
        os.fsync(self._partial.fileno())
        self.progress.partial_bytes = self._partial.tell()
        self._write_manifest()
        self._consistent = True

    def _finish_shard(self) -> Path:
        self._partial.flush()
        size = self._partial.tell()
        path = self.output / shard_name(len(self.progress.shards))
        with open(self._partial_path, "rb") as source, atomic_file(path, "wb") as shard:
            shard.write(source.read(size))
        self.progress.shards.append({"file": path.name, "records": self.progress.partial_records})
        self.progress.partial_records = self.progress.partial_bytes = 0
        self._write_manifest()
        self._partial.close()
        self._partial_path.unlink()
        fsync_path(self.output)
        self._partial_path = self.output / (shard_name(len(self.progress.shards)) + ".partial")
        self._partial = open(self._partial_path, "w+b")  # noqa: SIM115 (closed in close())
        self._unflushed = False
        return path

    def finish(self) -> None:
        """The input is done: the last (shorter) shard, and the manifest marked complete."""
        self._consistent = False
        if self.progress.partial_records:
            self._finish_shard()
        self.progress.complete = True
        self._write_manifest()
        self.close()
        self._partial_path.unlink(missing_ok=True)
        self._consistent = True

    def close(self) -> None:
        if not self._partial.closed:
            self._partial.close()

    def _write_manifest(self) -> None:
        body = {"format": FORMAT, "identity": self.identity, "progress": asdict(self.progress)}
        with atomic_file(self.output / MANIFEST, "w", encoding="utf-8") as f:
            f.write(json.dumps(body, indent=1, sort_keys=True) + "\n")
        self._unflushed = False


def shard_files(output: Path) -> list[Path]:
    """The finished shards of an output folder, in order."""
    return sorted(output.glob("shard-*.jsonl"))
