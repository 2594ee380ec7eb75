"""The input side of `regenerate`: which records a machine answers, read as `run` reads them.

One reader for both commands: files come from `formats.resolve_files` (a file, a glob, a folder,
a `datasets` folder of .jsonl(.gz)/.json/.parquet/.arrow) and records from `iter_raw_records`,
`parse_record` and `chat_messages` (OpenAI `messages` or ShareGPT `conversations`, through the
role map). Records are numbered across the whole corpus in file order; `--shard i/n` keeps those
numbered k with k % n == i (deterministic, streaming: no machine needs the total first). An
image record (data/images.py) keeps its images as OpenAI image_url parts, each path made absolute.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_async.data.formats import (
    BadRecord,
    DataError,
    chat_messages,
    iter_raw_records,
    parse_record,
    resolve_files,
)
from dflash_async.data.images import has_images, openai_image_messages

_CONVERSATION_KEYS = ("messages", "conversations")


@dataclass(frozen=True)
class Split:
    """This machine's part `index` of `count` (`--shard index/count`)."""

    index: int = 0
    count: int = 1

    @classmethod
    def parse(cls, text: str) -> Split:
        """`"i/n"` with 0 <= i < n; ValueError otherwise (argparse turns it into exit 2)."""
        parts = text.split("/")
        try:
            index, count = (int(p) for p in parts)
        except ValueError:
            raise ValueError(f"{text!r}: use i/n, e.g. 0/4") from None
        if not 0 <= index < count:
            raise ValueError(f"{text!r}: need 0 <= i < n")
        return cls(index, count)

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


@dataclass(frozen=True)
class Conversation:
    """One input record to answer: its number in the corpus, where it came from, and the record
    in OpenAI form ({"messages": [...]} in place of `messages`/`conversations`, other keys kept)."""

    number: int
    where: str
    record: dict[str, Any]


@dataclass(frozen=True)
class Corpus:
    """The records of `path` that this machine answers (see the module docstring)."""

    path: str
    files: tuple[Path, ...]
    role_map: Mapping[str, str]
    split: Split = Split()
    limit: int | None = None  # the first N records of the whole corpus, before the split

    @classmethod
    def open(
        cls, path: str, *, role_map: Mapping[str, str], split: Split, limit: int | None
    ) -> Corpus:
        """DataError (exit 2) when `path` names no data files."""
        return cls(path, tuple(resolve_files(path)), dict(role_map), split, limit)

    def _raw(self) -> Iterator[tuple[int, str, bytes | dict, Path]]:
        number = 0
        for file in self.files:
            for where, raw in iter_raw_records(file):
                if self.limit is not None and number >= self.limit:
                    return
                yield number, where, raw, file
                number += 1

    def _record(self, raw: bytes | dict, where: str, file: Path) -> dict[str, Any]:
        return openai_record(raw, where, self.role_map, root=file.parent)

    def conversations(self, *, skip: int = 0) -> Iterator[Conversation]:
        """This machine's records in order, after the first `skip` of them (not parsed: resume).
        A bad record is a DataError naming its file and line."""
        mine = 0
        for number, where, raw, file in self._raw():
            if number % self.split.count != self.split.index:
                continue
            mine += 1
            if mine > skip:
                yield Conversation(number, where, self._record(raw, where, file))

    def scan(self) -> Scan:
        """One pass over the input that also checks every record of this machine, so bad data
        (an image file that does not exist included) fails before any model loads."""
        digest, mine, with_images = hashlib.blake2b(digest_size=16), 0, 0
        for number, where, raw, file in self._raw():
            digest.update(raw if isinstance(raw, bytes) else _canonical(raw).encode())
            if number % self.split.count == self.split.index:
                with_images += has_images(self._record(raw, where, file))
                mine += 1
        return Scan(mine, digest.hexdigest(), with_images)


@dataclass(frozen=True)
class Scan:
    """What Corpus.scan found: this machine's records, the fingerprint of the whole input's
    records, and how many of this machine's hold images."""

    records: int
    fingerprint: str
    with_images: int


def _canonical(row: dict) -> str:
    return json.dumps(row, sort_keys=True, ensure_ascii=False, default=str)


def openai_record(
    raw: bytes | dict,
    where: str,
    role_map: Mapping[str, str],
    *,
    root: Path | None = None,
) -> dict[str, Any]:
    """The record with its turns as OpenAI messages, in the place of its conversation key. An
    image record (data/images.py) keeps its images as image_url parts, their paths made
    absolute (`root`: the data file's folder)."""
    try:
        record = parse_record(raw)
        if has_images(record):
            messages = openai_image_messages(record, root=root, role_map=role_map)
            record = {k: v for k, v in record.items() if k not in ("image", "images")}
        else:
            messages = chat_messages(record, role_map)
    except BadRecord as error:
        raise DataError(f"{where}: {error}") from None
    if not any(m["role"] == "user" for m in messages):
        raise DataError(f"{where}: no user message to answer")
    out: dict[str, Any] = {}
    for key, value in record.items():
        if key in _CONVERSATION_KEYS:
            out.setdefault("messages", messages)
        else:
            out[key] = value
    return out


def check_output_outside_input(input_path: str, output: Path) -> None:
    """DataError when the output folder is the input or lies inside it: the input would be
    overwritten, or the shards read back as input by a later run."""
    out = output.resolve()
    magic = any(ch in input_path for ch in "*?[")
    base = Path(input_path.split("*")[0].split("?")[0].split("[")[0]) if magic else Path(input_path)
    base = base if base.is_dir() or not magic else base.parent
    source = base.resolve()
    if out == source or (source.is_dir() and out.is_relative_to(source)):
        raise DataError(
            f"--output {str(output)!r} is {'the input' if out == source else 'inside the input'} "
            f"{input_path!r}: choose a folder outside it"
        )
