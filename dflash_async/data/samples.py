"""The read stage's product: the data path -> filtered, tokenized, memory-mapped samples.

`load_samples` resolves the files (formats.py), looks the result up in the cache (cache.py) and
otherwise streams every record through tokenize_all.py, appending each chunk's kept samples to
array files: the corpus is never a Python list. Samples are filtered with counted reasons (bad
record, truncated last line, empty, no assistant turn, too long -> truncated or dropped, fewer
than 2 x block_size supervised tokens), logged once as `data_loaded`. A bad record is a DataError
naming its file and line, or with on_bad_record="skip" a counted skip: nothing is lost silently.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections import Counter
from contextlib import closing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dflash_async.atomic import atomic_directory
from dflash_async.data import cache
from dflash_async.data.formats import (
    DEFAULT_ROLE_MAP,
    DataError,
    iter_raw_records,
    parse_role_map,
    resolve_files,
)
from dflash_async.data.tokenization import EncodeOptions
from dflash_async.data.tokenize_all import encode_all

DROP_REASONS = (
    "bad_record",
    "truncated_last_line",
    "empty",
    "no_assistant_turn",
    "too_few_supervised",
    "too_long_dropped",
    "too_long_truncated",
)


@dataclass(frozen=True)
class DataOptions:
    """The `data` settings the read stage uses (see settings/sections.py for their documentation)."""

    max_len: int = 3072
    enable_thinking: bool = True
    loss_turns: str = "all"  # "all" | "last"
    too_long: str = "truncate"  # "truncate" | "drop"
    on_bad_record: str = "error"  # "error" | "skip"
    role_map: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_ROLE_MAP))
    cache_dir: str | None = None  # None: no cache (run_spec resolves the setting's default)
    workers: int = 1  # tokenizer processes; 0 = one per core
    chunk_records: int = 256  # records per task sent to a tokenizer process

    def __post_init__(self) -> None:
        choices = {"loss_turns": ("all", "last"), "too_long": ("truncate", "drop")}
        choices["on_bad_record"] = ("error", "skip")
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} must be one of {allowed}")
        if self.max_len < 1 or self.workers < 0 or self.chunk_records < 1:
            raise ValueError(
                f"max_len={self.max_len} and chunk_records={self.chunk_records} must be >= 1, "
                f"workers={self.workers} >= 0"
            )
        parse_role_map(self.role_map)

    @property
    def num_workers(self) -> int:
        return self.workers or os.cpu_count() or 1


@dataclass(frozen=True, eq=False)
class TokenizedSamples:
    """Samples as flat arrays: sample i is tokens[offsets[i]:offsets[i+1]] and its loss mask."""

    tokens: np.ndarray  # [N] int32
    loss_mask: np.ndarray  # [N] bool
    offsets: np.ndarray  # [n+1] int64, offsets[0] == 0, offsets[-1] == N
    summary: dict[str, Any] = field(default_factory=dict, compare=False)
    lengths: np.ndarray = field(init=False, compare=False)  # [n] int64, computed once

    def __post_init__(self) -> None:
        object.__setattr__(self, "lengths", np.diff(self.offsets))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def max_token_id(self) -> int:
        """The largest token id (-1 if none): from the summary, else one pass over the tokens."""
        if "max_token_id" in self.summary:
            return int(self.summary["max_token_id"])
        return int(self.tokens.max()) if len(self.tokens) else -1

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids [L] int32, loss_mask [L] bool) of sample i; views, not copies."""
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[lo:hi], self.loss_mask[lo:hi]


def encode_options(options: DataOptions, block_size: int) -> EncodeOptions:
    return EncodeOptions(
        max_len=options.max_len,
        enable_thinking=options.enable_thinking,
        loss_turns=options.loss_turns,
        too_long=options.too_long,
        block_size=block_size,
        role_map=tuple(sorted(parse_role_map(options.role_map).items())),
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
    encode = encode_options(options, block_size)
    cache_dir = Path(options.cache_dir) if options.cache_dir else None
    if cache_dir is None:
        with tempfile.TemporaryDirectory(prefix="dflash-tokenized-") as scratch:
            # memory maps outlive the folder: the files are unlinked, their pages stay mapped
            samples, cached = (
                _tokenize_into(
                    Path(scratch) / "arrays", path, files, tokenizer, options, encode, log
                ),
                False,
            )
    else:
        key = cache.cache_key(files, tokenizer, asdict(encode))
        with cache.entry_lock(cache_dir, key):  # one builder per key; other ranks wait, then read
            entry = cache.read_entry(cache_dir, key)
            cached = entry is not None
            if entry is None:
                final = cache.entry_path(cache_dir, key)
                with atomic_directory(final, replaceable=cache.unfinished) as temporary:
                    built = _tokenize_into(temporary, path, files, tokenizer, options, encode, log)
                entry = cache.open_arrays(final), built.summary
        samples = TokenizedSamples(**entry[0], summary=entry[1])
    load_s = round(time.perf_counter() - started, 3)
    warn_about(samples, tokenizer, options=options, block_size=block_size, log=log)
    log.info(
        "data_loaded",
        path=path,
        cached=cached,
        cache_dir=options.cache_dir or None,
        load_s=load_s,
        **samples.summary,
    )
    return samples


def _tokenize_into(
    folder: Path,
    path: str,
    files: list[Path],
    tokenizer: Any,
    options: DataOptions,
    encode: EncodeOptions,
    log: Any,
) -> TokenizedSamples:
    """Stream every record through tokenization into array files in `folder`; map them back."""
    records = (item for file in files for item in iter_raw_records(file))
    counts = Counter()
    results = encode_all(
        records,
        tokenizer,
        encode,
        workers=options.num_workers,
        chunk_records=options.chunk_records,
        log=log,
    )
    with cache.ArrayWriter(folder) as writer, closing(results):  # closing: stop the workers
        for result in results:
            if result.bad and options.on_bad_record == "error":
                where, why = result.bad[0]
                raise DataError(f"{where}: {why} (set DFLASH_DATA__ON_BAD_RECORD=skip to skip)")
            counts.update(result.counts)
            writer.append(result.tokens, result.loss_mask, result.lengths)
        summary = {
            "files": len(files),
            "records": counts["records"],
            "samples": writer.num_samples,
            **{reason: counts[reason] for reason in DROP_REASONS},
            "tokens": writer.num_tokens,
            "supervised_tokens": writer.num_supervised,
            "max_token_id": writer.max_token_id,
        }
        if not writer.num_samples:
            counted = ", ".join(f"{k}={v}" for k, v in summary.items() if v and k != "max_token_id")
            raise DataError(f"{path}: no usable samples after filtering ({counted})")
        writer.finish(summary)
    return TokenizedSamples(**cache.open_arrays(folder), summary=summary)


# Above this share of unknown tokens the tokenizer does not cover the data: a byte-level BPE
# tokenizer (Qwen, Llama 3) has no unknown token at all, and a word-level one fitted to its
# corpus (the built-in tiny target's) meets only rare words there.
UNKNOWN_WARN_FRACTION = 0.05


def warn_about(
    samples: TokenizedSamples, tokenizer: Any, *, options: DataOptions, block_size: int, log: Any
) -> None:
    """Warnings a user must see before training on the samples: a corpus the tokenizer mostly
    cannot read (`data_unknown_tokens`, with the fraction), and records lost to MAX_LEN
    (`data_too_long`, with the counts and what to change)."""
    unknown = getattr(tokenizer, "unk_token_id", None)
    total = int(samples.lengths.sum())
    if unknown is not None and total:
        count = int(np.count_nonzero(samples.tokens == unknown))
        if count > UNKNOWN_WARN_FRACTION * total:
            log.warning(
                "data_unknown_tokens",
                unknown_fraction=round(count / total, 4),
                unknown_tokens=count,
                tokens=total,
                token=str(getattr(tokenizer, "unk_token", unknown)),
                hint="the target's tokenizer does not cover this data: the drafter would learn "
                "to predict the unknown token; train with the tokenizer of the target that "
                "wrote the data (the built-in tiny target knows only its demo corpus' words)",
            )
    summary = samples.summary
    records = summary.get("records", 0)
    dropped, truncated = summary.get("too_long_dropped", 0), summary.get("too_long_truncated", 0)
    if records and (dropped or truncated):
        log.warning(
            "data_too_long",
            records=records,
            too_long_dropped=dropped,
            too_long_truncated=truncated,
            too_few_supervised=summary.get("too_few_supervised", 0),
            max_len=options.max_len,
            hint=f"{dropped + truncated} of {records} records "
            f"({(dropped + truncated) / records:.1%}) are longer than DFLASH_DATA__MAX_LEN="
            f"{options.max_len} tokens and were "
            + ("dropped" if options.too_long == "drop" else "truncated")
            + "; raise DFLASH_DATA__MAX_LEN (at most DFLASH_TRAIN__TOKEN_BUDGET)"
            + (
                ", or set DFLASH_DATA__TOO_LONG=truncate to keep their first tokens"
                if options.too_long == "drop"
                else f"; a truncated record with fewer than {2 * block_size} supervised tokens "
                "left is counted in too_few_supervised"
            ),
        )
