"""The read stage: data files -> tokenized samples with assistant-only loss masks.

Reads jsonl (optionally .gz) and parquet files (a file, a glob or a folder of them) in three forms:
OpenAI `{"messages": [{"role", "content"}, ...]}`, ShareGPT `{"conversations": [{"from", "value"},
...]}` and pre-tokenized `{"input_ids": [...], "loss_mask": [...]}`. Chats are rendered with the
target tokenizer's own chat template and masked by dflash_async.data.chat. Samples are then filtered
with counted reasons (empty, no assistant turn, too long -> truncated or dropped, fewer than
2 x block_size supervised tokens), logged once as `data_loaded`. A bad record is a DataError naming
its file and line, or with on_bad_record="skip" a counted skip: nothing is lost silently.

The result is cached on disk (three .npy arrays, memory-mapped on load) under a key of the data
files' paths, sizes and mtimes, the tokenizer and its template, and the options, so a second run
starts in seconds. Large sets are tokenized by `num_proc` spawned processes.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import multiprocessing
import sys
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from glob import glob
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
from tqdm import tqdm

from dflash_async.atomic import atomic_directory
from dflash_async.data.chat import ChatMaskError, encode_chat, supervised_turns

ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}
# Message fields passed on to the chat template besides role and content; None values are dropped
# (templates render a None as "None" or crash on it).
EXTRA_MESSAGE_KEYS = ("reasoning_content", "thinking", "reasoning", "tool_calls", "name")
SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")
CHUNK_RECORDS = 256  # records per task sent to a tokenizer process


class DataError(ValueError):
    """Bad data for the user to fix; the message is one line naming the file and line."""


class BadRecord(ValueError):
    """A record that cannot be used; the caller adds where it came from."""


@dataclass(frozen=True)
class DataOptions:
    """The `data` settings the read stage uses (see settings.py for their documentation)."""

    max_len: int = 3072
    enable_thinking: bool = True
    loss_turns: str = "all"  # "all" | "last"
    too_long: str = "truncate"  # "truncate" | "drop"
    on_bad_record: str = "error"  # "error" | "skip"
    cache_dir: str | None = None  # None or "": no cache
    num_proc: int = 1

    def __post_init__(self) -> None:
        choices = {"loss_turns": ("all", "last"), "too_long": ("truncate", "drop")}
        choices["on_bad_record"] = ("error", "skip")
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} must be one of {allowed}")
        if self.max_len < 1 or self.num_proc < 1:
            raise ValueError(f"max_len={self.max_len} and num_proc={self.num_proc} must be >= 1")


@dataclass(frozen=True, eq=False)
class TokenizedSamples:
    """Samples as flat arrays: sample i is tokens[offsets[i]:offsets[i+1]] and its loss mask."""

    tokens: np.ndarray  # [N] int32
    loss_mask: np.ndarray  # [N] bool
    offsets: np.ndarray  # [n+1] int64, offsets[0] == 0, offsets[-1] == N
    summary: dict[str, Any] = field(default_factory=dict, compare=False)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per sample, [n] int64."""
        return np.diff(self.offsets)

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids [L] int32, loss_mask [L] bool) of sample i; views, not copies."""
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[lo:hi], self.loss_mask[lo:hi]


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
    files = sorted(p for p in files if p.name.endswith(SUFFIXES))
    if not files:
        raise DataError(f"data path {path!r} has no {'/'.join(SUFFIXES)} files")
    return files


def _checked_suffix(file: Path) -> Path:
    if not file.name.endswith(SUFFIXES):
        raise DataError(f"{file}: unknown data file type; use {', '.join(SUFFIXES)}")
    return file


def iter_raw_records(file: Path) -> Iterator[tuple[str, bytes | dict]]:
    """(where, raw record) pairs: a jsonl line's bytes (decoded later) or a parquet row's dict."""
    try:
        if file.name.endswith(".parquet"):
            yield from _parquet_rows(file)
        else:
            opener = gzip.open if file.name.endswith(".gz") else open
            with opener(file, "rb") as stream:
                for line_no, line in enumerate(stream, start=1):
                    if line.strip():
                        yield f"{file}:{line_no}", line
    except (OSError, EOFError) as exc:
        raise DataError(f"{file}: cannot read: {exc}") from exc


def _parquet_rows(file: Path) -> Iterator[tuple[str, dict]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        row = 0
        for batch in pq.ParquetFile(file).iter_batches(batch_size=1024):
            for record in batch.to_pylist():
                row += 1
                yield f"{file}:row {row}", record
    except pa.ArrowException as exc:
        raise DataError(f"{file}: not a readable parquet file: {exc}") from exc


def parse_record(raw: bytes | dict) -> dict:
    """A raw jsonl line or parquet row as a JSON object; BadRecord if it is not one."""
    if isinstance(raw, bytes):
        try:
            raw = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise BadRecord(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
        except json.JSONDecodeError as exc:
            raise BadRecord(f"malformed JSON: {exc.msg} at column {exc.colno}") from exc
    if not isinstance(raw, dict):
        raise BadRecord(f"a record must be a JSON object, got {type(raw).__name__}")
    return raw


def chat_messages(record: dict) -> list[dict]:
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
    return [_message(turn, role_key, content_key, n) for n, turn in enumerate(turns)]


def _message(turn: Any, role_key: str, content_key: str, n: int) -> dict:
    if not isinstance(turn, dict):
        raise BadRecord(f"message {n} must be an object, got {type(turn).__name__}")
    role = ROLE_ALIASES.get(turn.get(role_key)) if isinstance(turn.get(role_key), str) else None
    if role is None:
        raise BadRecord(f"message {n} has unknown role {role_key}={turn.get(role_key)!r}")
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
    raise BadRecord(f"message {n} content must be text, got {type(content).__name__}")


def pretokenized(record: dict, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids int32, loss_mask bool) of a pre-tokenized record, validated."""
    ids, mask = record.get("input_ids"), record.get("loss_mask")
    if not isinstance(ids, list) or not isinstance(mask, list) or len(ids) != len(mask):
        raise BadRecord("'input_ids' and 'loss_mask' must be lists of the same length")
    if not all(type(t) is int and 0 <= t < vocab_size for t in ids):
        raise BadRecord(f"'input_ids' must be integers in [0, {vocab_size})")
    if not all(m in (0, 1) for m in mask):
        raise BadRecord("'loss_mask' must hold 0/1 or true/false values")
    return np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=bool)


def encode_record(raw: bytes | dict, tokenizer: Any, options: DataOptions) -> tuple:
    """One raw record -> ("ok", ids, mask) | ("empty",) | ("no_assistant_turn",) | ("bad", why)."""
    try:
        record = parse_record(raw)
        if record.get("input_ids") is not None:
            ids, mask = pretokenized(record, len(tokenizer))
            return ("ok", ids, mask) if len(ids) else ("empty",)
        messages = chat_messages(record)
        if not any(m.get("content") or m.get("tool_calls") for m in messages):
            return ("empty",)
        if not supervised_turns(messages, options.loss_turns):
            return ("no_assistant_turn",)
        tools = record.get("tools") if isinstance(record.get("tools"), list) else None
        ids, mask = encode_chat(
            tokenizer,
            messages,
            enable_thinking=options.enable_thinking,
            loss_turns=options.loss_turns,
            tools=tools,
        )
        return ("ok", ids, mask)
    except (BadRecord, ChatMaskError, jinja2.TemplateError) as exc:  # the template's own checks
        return ("bad", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)


def encode_chunk(
    chunk: list[tuple[str, bytes | dict]], tokenizer: Any, options: DataOptions
) -> list[tuple]:
    return [encode_record(raw, tokenizer, options) for _, raw in chunk]


# Per-process state of a tokenizer worker, set once by the pool initializer so the tokenizer is
# pickled once per process rather than once per chunk. Only spawned worker processes set it.
_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer: Any, options: DataOptions) -> None:
    _WORKER.update(tokenizer=tokenizer, options=options)


def _encode_chunk_in_worker(chunk: list[tuple[str, bytes | dict]]) -> list[tuple]:
    return encode_chunk(chunk, _WORKER["tokenizer"], _WORKER["options"])


def encode_all(
    records: list[tuple[str, bytes | dict]], tokenizer: Any, options: DataOptions
) -> Iterator[tuple]:
    """Results of encode_record for every record, in order; parallel for large sets."""
    chunks = [records[i : i + CHUNK_RECORDS] for i in range(0, len(records), CHUNK_RECORDS)]
    bar = tqdm(total=len(records), unit="rec", desc="tokenizing", disable=not sys.stderr.isatty())
    with bar:
        if options.num_proc > 1 and len(chunks) > 2:
            # spawn, not fork: the parent runs an event loop and device threads. An executor,
            # not a Pool: a worker that dies raises BrokenProcessPool instead of hanging.
            pool = ProcessPoolExecutor(
                max_workers=min(options.num_proc, len(chunks)),
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker,
                initargs=(tokenizer, options),
            )
            try:
                for results in pool.map(_encode_chunk_in_worker, chunks):
                    bar.update(len(results))
                    yield from results
            finally:  # on a DataError mid-way, do not tokenize the rest first
                pool.shutdown(cancel_futures=True)
        else:
            for chunk in chunks:
                results = encode_chunk(chunk, tokenizer, options)
                bar.update(len(results))
                yield from results


def filter_samples(
    records: list[tuple[str, bytes | dict]],
    results: Iterator[tuple],
    *,
    options: DataOptions,
    block_size: int,
) -> tuple[TokenizedSamples, Counter]:
    """Apply the filters in order, counting every record that is dropped or changed."""
    counts: Counter = Counter()
    kept_ids, kept_masks = [], []
    for (where, _), result in zip(records, results, strict=True):
        counts["records"] += 1
        status = result[0]
        if status == "bad":
            if options.on_bad_record == "error":
                raise DataError(
                    f"{where}: {result[1]} (set DFLASH_DATA__ON_BAD_RECORD=skip to skip)"
                )
            counts["bad_record"] += 1
            continue
        if status != "ok":
            counts[status] += 1
            continue
        ids, mask = result[1], result[2]
        if len(ids) > options.max_len:
            counts[f"too_long_{'dropped' if options.too_long == 'drop' else 'truncated'}"] += 1
            if options.too_long == "drop":
                continue
            ids, mask = ids[: options.max_len], mask[: options.max_len]
        if int(mask.sum()) < 2 * block_size:
            counts["too_few_supervised"] += 1
            continue
        kept_ids.append(ids)
        kept_masks.append(mask)
    return _flatten(kept_ids, kept_masks), counts


def _flatten(ids: list[np.ndarray], masks: list[np.ndarray]) -> TokenizedSamples:
    offsets = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum([len(x) for x in ids], out=offsets[1:])
    return TokenizedSamples(
        tokens=np.concatenate(ids).astype(np.int32, copy=False) if ids else np.zeros(0, np.int32),
        loss_mask=np.concatenate(masks) if masks else np.zeros(0, bool),
        offsets=offsets,
    )


def load_samples(
    path: str, tokenizer: Any, *, options: DataOptions, block_size: int, log: Any
) -> TokenizedSamples:
    """Read, tokenize, mask and filter the data at `path`; DataError for the user on bad data.

    Logs one `data_loaded` event with the counts of every filter; `log` is a structlog logger.
    """
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    started = time.perf_counter()
    files = resolve_files(path)
    cache_dir = Path(options.cache_dir) if options.cache_dir else None
    output_options = {**asdict(options), "block_size": block_size}
    for name in ("cache_dir", "num_proc"):  # they do not change the samples
        output_options.pop(name)
    key = cache_key(files, tokenizer, output_options) if cache_dir else ""
    samples = read_cache(cache_dir, key) if cache_dir else None
    cached = samples is not None
    if samples is None:
        samples = _read_and_filter(path, files, tokenizer, options, block_size)
        if cache_dir:
            write_cache(cache_dir, key, samples)
    load_s = round(time.perf_counter() - started, 3)
    log.info("data_loaded", path=path, cached=cached, load_s=load_s, **samples.summary)
    return samples


def _read_and_filter(
    path: str, files: list[Path], tokenizer: Any, options: DataOptions, block_size: int
) -> TokenizedSamples:
    records = [item for file in files for item in iter_raw_records(file)]
    results = encode_all(records, tokenizer, options)
    samples, counts = filter_samples(records, results, options=options, block_size=block_size)
    reasons = ("bad_record", "empty", "no_assistant_turn", "too_few_supervised")
    summary = {
        "files": len(files),
        "records": counts["records"],
        "samples": len(samples),
        **{
            reason: counts[reason]
            for reason in (*reasons, "too_long_dropped", "too_long_truncated")
        },
        "tokens": len(samples.tokens),
        "supervised_tokens": int(samples.loss_mask.sum()),
    }
    if not len(samples):
        counted = ", ".join(f"{k}={v}" for k, v in summary.items() if v)
        raise DataError(f"{path}: no usable samples after filtering ({counted})")
    return TokenizedSamples(samples.tokens, samples.loss_mask, samples.offsets, summary)


CACHE_VERSION = 1  # bump when the tokenization or the cache layout changes
CACHE_ARRAYS = ("tokens", "loss_mask", "offsets")


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
    """Key of the tokenized cache: data files (path, size, mtime), tokenizer, output options."""
    stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    material = {
        "version": CACHE_VERSION,
        "files": stats,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "options": options,
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:32]


def read_cache(cache_dir: Path, key: str) -> TokenizedSamples | None:
    """The cached samples (arrays memory-mapped, read-only) or None if there are none."""
    folder = cache_dir / f"tokenized-{key}"
    if not (folder / "summary.json").is_file():
        return None
    arrays = {name: np.load(folder / f"{name}.npy", mmap_mode="r") for name in CACHE_ARRAYS}
    return TokenizedSamples(**arrays, summary=json.loads((folder / "summary.json").read_text()))


def write_cache(cache_dir: Path, key: str, samples: TokenizedSamples) -> Path:
    """Write the samples under `key` atomically; a copy another process finished first wins."""
    final = cache_dir / f"tokenized-{key}"
    with atomic_directory(final, keep_existing=True) as temporary:
        for name in CACHE_ARRAYS:
            np.save(temporary / f"{name}.npy", np.ascontiguousarray(getattr(samples, name)))
        (temporary / "summary.json").write_text(json.dumps(samples.summary))
    return final
