"""Data files and records: which files a data path names, their records, and chat roles.

A data path is a file, a glob or a folder (searched recursively) of:
- `.jsonl` / `.jsonl.gz`: one JSON object per line (CRLF line ends and a UTF-8 BOM are fine);
- `.json`: a JSON array of objects (read record by record, never parsed whole), or JSON lines;
- `.parquet`: one record per row;
- `.arrow`: the shards of a Hugging Face `datasets` folder written by `save_to_disk` (Arrow IPC
  streams, read with pyarrow; the `datasets` package is not needed).
Records are OpenAI `{"messages": [{"role", "content"}]}`, ShareGPT `{"conversations": [{"from",
"value"}]}` or pre-tokenized `{"input_ids", "loss_mask"}`. Roles go through a role map (ShareGPT's
gpt/chatgpt/bing/bard -> assistant, human -> user, ... by default); an unknown role is a bad record.
Every record carries where it came from (`file:line`, `file:row N`) for the error that names it.
Records with images are read by data/images.py.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator, Mapping
from glob import glob
from pathlib import Path
from typing import Any

SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".parquet", ".arrow")
ROLES = ("system", "user", "assistant", "tool")
# Which assistant turns of a conversation a step uses (supervises, regenerates): all, or the last.
ASSISTANT_TURNS = ("all", "last")

DEFAULT_ROLE_MAP: dict[str, str] = {
    "human": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "function": "tool",
    "observation": "tool",
}
# Message fields passed on to the chat template besides role and content; None values are dropped
# (templates render a None as "None" or crash on it).
EXTRA_MESSAGE_KEYS = ("reasoning_content", "thinking", "reasoning", "tool_calls", "name")
DATASETS_METADATA = ("dataset_info.json", "state.json", "dataset_dict.json")
BOM = b"\xef\xbb\xbf"
JSON_BLOCK_CHARS = 1 << 20  # characters read at a time from a JSON array file
ARROW_BATCH_ROWS = 1024


class DataError(ValueError):
    """Bad data for the user to fix; the message is one line naming the file and line."""


class BadRecord(ValueError):
    """A record that cannot be used; the caller adds where it came from."""


class TruncatedRecord(BadRecord):
    """The file's last line is cut off mid-record (an interrupted write or copy)."""


def resolve_files(path: str) -> list[Path]:
    """The data files named by a file, a glob or a folder (searched recursively), sorted."""
    if not path:
        raise DataError("data path is empty")
    if any(ch in path for ch in "*?["):
        files = [Path(p) for p in glob(path, recursive=True)]
    elif Path(path).is_dir():
        files = [p for p in Path(path).rglob("*") if p.is_file()]
    elif Path(path).is_file():
        return [_checked_suffix(Path(path))]
    else:
        raise DataError(f"data path {path!r} does not exist")
    files = sorted(p for p in files if p.name.endswith(SUFFIXES) and not _datasets_metadata(p))
    if not files:
        raise DataError(f"data path {path!r} has no {'/'.join(SUFFIXES)} files")
    return files


def _datasets_metadata(file: Path) -> bool:
    """A `datasets` folder's own JSON files (next to its .arrow shards), not data."""
    marked = any((file.parent / name).is_file() for name in ("state.json", "dataset_dict.json"))
    return marked and file.name in DATASETS_METADATA


def _checked_suffix(file: Path) -> Path:
    if not file.name.endswith(SUFFIXES):
        raise DataError(f"{file}: unknown data file type; use {', '.join(SUFFIXES)}")
    return file


def iter_raw_records(file: Path) -> Iterator[tuple[str, bytes | dict]]:
    """(where, raw record) pairs: a JSON line's bytes (parsed later, in a worker) or a row's dict."""
    import pyarrow as pa

    try:
        if file.name.endswith(".parquet"):
            yield from _parquet_rows(file)
        elif file.name.endswith(".arrow"):
            yield from _arrow_rows(file)
        elif file.name.endswith(".json") and _starts_with_array(file):
            yield from _json_array_items(file)
        else:
            yield from _json_lines(file)
    except (OSError, EOFError) as exc:
        raise DataError(f"{file}: cannot read: {exc}") from exc
    except pa.ArrowException as exc:
        raise DataError(f"{file}: not a readable {file.suffix[1:]} file: {exc}") from exc


def _json_lines(file: Path) -> Iterator[tuple[str, bytes]]:
    """Non-blank lines with their line numbers; a BOM before the first line is dropped.

    A line keeps its end, so the last line of a file that stops mid-record is recognisable: it
    is the only one without b"\\n" (parse_record reports it as truncated).
    """
    opener = gzip.open if file.name.endswith(".gz") else open
    with opener(file, "rb") as stream:
        for line_no, line in enumerate(stream, start=1):
            if line_no == 1 and line.startswith(BOM):
                line = line[len(BOM) :]
            if line.strip():
                yield f"{file}:{line_no}", line


def _starts_with_array(file: Path) -> bool:
    with open(file, "rb") as stream:
        head = stream.read(4096).removeprefix(BOM).lstrip()
    return head.startswith(b"[")


def _json_array_items(file: Path) -> Iterator[tuple[str, dict | Any]]:
    """The elements of a top-level JSON array, decoded one at a time from blocks of the file.

    An element that does not decode is retried with more text until the file ends (a long record
    spans blocks); only then is it a bad record. A malformed array stops the file: its remaining
    structure cannot be trusted.
    """
    decoder = json.JSONDecoder()
    with open(file, encoding="utf-8-sig", newline="") as stream:
        text, line, eof, block = stream.read(JSON_BLOCK_CHARS), 1, False, JSON_BLOCK_CHARS
        pos = text.index("[") + 1
        line += text.count("\n", 0, pos)
        while True:
            pos, line, at_end = _skip_separators(text, pos, line)
            if at_end == "]":
                return
            if at_end == "need more":
                more = "" if eof else stream.read(block)
                if not more:
                    raise DataError(f"{file}:{line}: the JSON array is not closed with ']'")
                text, pos = text[pos:] + more, 0
                continue
            try:
                item, end = decoder.raw_decode(text, pos)
            except json.JSONDecodeError as exc:
                if not eof:  # maybe the element goes on in the next block
                    more = stream.read(block)
                    eof, block = not more, 2 * block
                    text, pos = text[pos:] + more, 0
                    continue
                raise DataError(f"{file}:{line}: {_array_error(text, pos, line, exc)}") from exc
            yield f"{file}:{line}", item
            line += text.count("\n", pos, end)
            pos, block = end, JSON_BLOCK_CHARS


def _array_error(text: str, pos: int, line: int, exc: json.JSONDecodeError) -> str:
    """A whole sentence for an element that does not decode (json's own `msg` alone stops
    mid-phrase: "Unterminated string starting at"): where, and whether the file was cut off."""
    at_line = line + text.count("\n", pos, exc.pos)
    newline = text.rfind("\n", pos, exc.pos)  # the text may start mid-line: columns from there
    column = f", column {exc.pos - newline}" if newline >= 0 else ""
    where = f"{exc.msg.removesuffix(' at')} at line {at_line}{column}"
    if not text[pos:].rstrip().endswith("]"):
        return f"malformed JSON array: {where}; the file ends before the array's ']' (cut off?)"
    return f"malformed JSON array: {where}"


def _skip_separators(text: str, pos: int, line: int) -> tuple[int, int, str]:
    """Skip whitespace and one comma; returns (pos, line, "item" | "]" | "need more")."""
    while pos < len(text) and text[pos] in " \t\r\n,":
        line += text[pos] == "\n"
        pos += 1
    if pos >= len(text):
        return pos, line, "need more"
    return pos, line, "]" if text[pos] == "]" else "item"


def _parquet_rows(file: Path) -> Iterator[tuple[str, dict]]:
    import pyarrow.parquet as pq

    row = 0
    for batch in pq.ParquetFile(file).iter_batches(batch_size=ARROW_BATCH_ROWS):
        for record in batch.to_pylist():
            row += 1
            yield f"{file}:row {row}", record


def _arrow_rows(file: Path) -> Iterator[tuple[str, dict]]:
    """Rows of an Arrow IPC stream (what `datasets` writes) or file, memory-mapped."""
    import pyarrow as pa

    with pa.memory_map(str(file)) as source:
        try:
            reader = pa.ipc.open_stream(source)
            batches = iter(reader)
        except pa.ArrowInvalid:
            source.seek(0)
            reader = pa.ipc.open_file(source)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        row = 0
        for batch in batches:
            for record in batch.to_pylist():
                row += 1
                yield f"{file}:row {row}", record


def parse_record(raw: bytes | Any) -> dict:
    """A raw JSON line or a row as a JSON object; BadRecord if it is not one."""
    if isinstance(raw, bytes):
        try:
            raw = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise BadRecord(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
        except json.JSONDecodeError as exc:
            if not raw.endswith(b"\n"):  # only a file's last line can lack its end
                raise TruncatedRecord(
                    f"truncated last line (the file ends mid-record: {exc.msg} at column "
                    f"{exc.colno})"
                ) from exc
            raise BadRecord(f"malformed JSON: {exc.msg} at column {exc.colno}") from exc
    if not isinstance(raw, dict):
        raise BadRecord(f"a record must be a JSON object, got {type(raw).__name__}")
    return raw


def chat_messages(record: dict, role_map: Mapping[str, str] = DEFAULT_ROLE_MAP) -> list[dict]:
    """The record's conversation as template messages; BadRecord if it has no known form."""
    if record.get("messages") is not None:
        turns, role_key, content_key = record["messages"], "role", "content"
    elif record.get("conversations") is not None:
        turns, role_key, content_key = record["conversations"], "from", "value"
    else:
        keys = sorted(k for k, v in record.items() if v is not None)
        raise BadRecord(f"neither 'messages', 'conversations' nor 'input_ids' in keys {keys}")
    if not isinstance(turns, list):
        raise BadRecord(f"{role_key!r} turns must be a list, got {type(turns).__name__}")
    return [_message(turn, role_key, content_key, n, role_map) for n, turn in enumerate(turns)]


def _message(turn: Any, role_key: str, content_key: str, n: int, role_map: Mapping) -> dict:
    if not isinstance(turn, dict):
        raise BadRecord(f"message {n} must be an object, got {type(turn).__name__}")
    name = turn.get(role_key)
    role = (name if name in ROLES else role_map.get(name)) if isinstance(name, str) else None
    if role is None:
        raise BadRecord(
            f"message {n} has unknown role {role_key}={name!r} (map it with DFLASH_DATA__ROLE_MAP)"
        )
    message = {k: turn[k] for k in EXTRA_MESSAGE_KEYS if turn.get(k) is not None}
    message["role"] = role
    content = _text(turn.get(content_key), n)
    if content is not None:
        message["content"] = content
    return message


def _text(content: Any, n: int) -> str | None:
    """Content as a string: strings as they are, OpenAI text parts joined."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    if isinstance(content, list) and any(
        isinstance(p, dict) and p.get("type") in ("image", "image_url") for p in content
    ):
        raise BadRecord(
            f"message {n} holds an image, in a file read as text: image data is read as such "
            "when the first records of one of its files hold images (docs/images.md)"
        )
    raise BadRecord(f"message {n} content must be text, got {type(content).__name__}")


def parse_role_map(value: Any) -> dict[str, str]:
    """`"gpt=assistant,human=user"`, a JSON object or a mapping -> {alias: role}, checked."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("{"):
            value = json.loads(text)
        else:
            pairs = [item.split("=", 1) for item in text.split(",") if item.strip()]
            if any(len(pair) != 2 for pair in pairs):
                raise ValueError(f"{value!r}: use alias=role pairs, e.g. gpt=assistant,human=user")
            value = {alias.strip(): role.strip() for alias, role in pairs}
    if not isinstance(value, Mapping):
        raise ValueError(f"a role map must be alias=role pairs, got {type(value).__name__}")
    bad = {alias: role for alias, role in value.items() if role not in ROLES}
    if bad:
        raise ValueError(f"roles must be one of {', '.join(ROLES)}; got {bad}")
    return dict(value)
