"""Tokenization of one chunk of records: raw records -> filtered token ids and assistant-only loss
masks (`encode_chunk`).

Records travel in chunks. Per chunk, every chat is rendered and character-masked by
dflash_async.data.chat (the template renders dominate the cost), then all renderings of the chunk
are tokenized by one call of the tokenizer's batched fast path, and each record's token mask is
derived from its offsets exactly as `encode_chat` does one at a time. The filters (too long,
fewer than 2 x block_size supervised tokens) run in the same pass, so a chunk comes back as three
flat arrays plus its counts: nothing per record crosses a process boundary.

A whole data set is encoded by tokenize_all.py (`encode_all`): with `workers > 1` chunks go to
spawned processes (tokenize_pool.py), a bounded number in flight, results taken in file order;
the first bad record in file order is the one reported. A data set of a few chunks stays in
this process.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import jinja2
import numpy as np

from dflash_async.data.chat import (
    ChatMaskError,
    assistant_char_mask,
    chat_template_of,
    supervised_turns,
    token_mask,
)
from dflash_async.data.fast_bpe import FastBPE
from dflash_async.data.fast_mask import qwen3_char_mask
from dflash_async.data.fast_template import render_qwen3
from dflash_async.data.formats import BadRecord, TruncatedRecord, chat_messages, parse_record

Raw = tuple[str, Any]  # (where, raw record) from formats.iter_raw_records


@dataclass(frozen=True)
class EncodeOptions:
    """What decides the samples (all of it is in the cache key) and how they are computed."""

    max_len: int
    enable_thinking: bool
    loss_turns: str
    too_long: str
    block_size: int
    role_map: tuple[tuple[str, str], ...]  # sorted (alias, role) pairs: hashable, picklable


@dataclass
class ChunkResult:
    """The kept samples of one chunk, flat, and the count of every record dropped or changed."""

    tokens: np.ndarray  # [N] int32
    loss_mask: np.ndarray  # [N] bool
    lengths: np.ndarray  # [n] int64 tokens per kept sample
    counts: Counter = field(default_factory=Counter)
    bad: list[tuple[str, str]] = field(default_factory=list)  # (where, why) in record order
    # (kept samples before it, text, char mask) of each rendering left for the parent to encode
    pending: list[tuple[int, str, np.ndarray]] = field(default_factory=list)


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


def raw_text_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of raw text (no chat template) as the tokenizer encodes it by default: with its
    special tokens, so a Llama or sentencepiece tokenizer puts its BOS first, the input its model
    was trained on (a base Llama continuing text without it drafts and decodes off its training
    distribution). Chat renderings are encoded without them instead: the template writes its
    own."""
    return list(tokenizer(text)["input_ids"])


def render_record(raw: Any, tokenizer: Any, options: EncodeOptions, fast_render: Any) -> tuple:
    """One raw record -> ("chat", text, char_mask) | ("ok", ids, mask) | (count name, why)."""
    try:
        record = parse_record(raw)
        if record.get("input_ids") is not None:
            ids, mask = pretokenized(record, len(tokenizer))
            return ("ok", ids, mask) if len(ids) else ("empty", "")
        messages = chat_messages(record, dict(options.role_map))
        if not any(m.get("content") or m.get("tool_calls") for m in messages):
            return ("empty", "")
        if not supervised_turns(messages, options.loss_turns):
            return ("no_assistant_turn", "")
        tools = record.get("tools") if isinstance(record.get("tools"), list) else None
        kwargs = dict(
            enable_thinking=options.enable_thinking, loss_turns=options.loss_turns, tools=tools
        )
        found = qwen3_char_mask(messages, **kwargs) if fast_render is render_qwen3 else None
        text, char_mask = found or assistant_char_mask(
            chat_template_of(tokenizer), messages, fast_render=fast_render, **kwargs
        )
        return ("chat", text, char_mask)
    except TruncatedRecord as exc:
        return ("truncated_last_line", str(exc))
    except (BadRecord, ChatMaskError, jinja2.TemplateError) as exc:  # the template's own checks
        return ("bad_record", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)


def tokenize_batch(
    tokenizer: Any, texts: list[str], fast: FastBPE | None = None
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids int32, offsets [L, 2] int64) of each text: the tokenizer's batched fast path.

    The same ids and offsets as `tokenizer(text, add_special_tokens=False,
    return_offsets_mapping=True)` one text at a time (a test holds them equal). `fast`, a
    checked fast_bpe encoder, encodes the texts it can, the tokenizer the rest. A fast tokenizer
    whose backend has no truncation or padding set and splits special tokens as the tokenizer
    says is called directly: transformers' conversion of each encoding to lists costs as much
    as a fifth of the tokenization.
    """
    if not texts:
        return []
    if fast is not None:
        encoded = fast.encode_batch(texts)
        rest = [i for i, e in enumerate(encoded) if e is None]
        for i, e in zip(rest, tokenize_batch(tokenizer, [texts[i] for i in rest]), strict=True):
            encoded[i] = e
        return encoded
    backend = direct_backend(tokenizer)
    if backend is not None:
        return [
            (np.array(e.ids, dtype=np.int32), _flat_offsets(e.offsets))
            for e in backend.encode_batch(texts, add_special_tokens=False)
        ]
    encoding = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    return [
        (np.asarray(ids, dtype=np.int32), _flat_offsets(offsets))
        for ids, offsets in zip(encoding["input_ids"], encoding["offset_mapping"], strict=True)
    ]


def direct_backend(tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` that gives what the plain call gives, if there is one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (
        backend is not None
        and backend.truncation is None
        and backend.padding is None
        and backend.encode_special_tokens == getattr(tokenizer, "split_special_tokens", False)
    ):
        return backend
    return None


def _flat_offsets(offsets: list[tuple[int, int]]) -> np.ndarray:
    """[L, 2] int64 offsets; fromiter over the flattened pairs is ~3x faster than asarray."""
    flat = np.fromiter(chain.from_iterable(offsets), dtype=np.int64, count=2 * len(offsets))
    return flat.reshape(-1, 2)


def encode_chunk(
    chunk: list[Raw],
    tokenizer: Any,
    options: EncodeOptions,
    fast_render: Any = None,
    fast_encode: FastBPE | None = None,
    defer: bool = False,
) -> ChunkResult:
    """Render, tokenize (one batched call), mask and filter the records of one chunk. With
    `defer`, renderings `fast_encode` refuses are left in `pending` (tokenize_pool.finish_chunk)
    rather than encoded here with `tokenizer`."""
    rendered = [render_record(raw, tokenizer, options, fast_render) for _, raw in chunk]
    texts = [r[1] for r in rendered if r[0] == "chat"]
    if defer and fast_encode is not None:
        encoded = iter(fast_encode.encode_batch(texts))
    else:
        encoded = iter(tokenize_batch(tokenizer, texts, fast_encode))
    counts, bad, ids_list, mask_list, pending = Counter(records=len(chunk)), [], [], [], []
    for (where, _), result in zip(chunk, rendered, strict=True):
        status = result[0]
        if status == "chat":
            if (got := next(encoded)) is None:
                pending.append((len(ids_list), result[1], result[2]))
                continue
            ids, offsets = got
            status, result = "ok", ("ok", ids, token_mask(result[2], offsets))
        if status != "ok":
            counts[status] += 1
            if status in ("bad_record", "truncated_last_line"):
                bad.append((where, result[1]))
            continue
        kept = filtered(result[1], result[2], options, counts)
        if kept is not None:
            ids_list.append(kept[0])
            mask_list.append(kept[1])
    return ChunkResult(
        tokens=np.concatenate(ids_list) if ids_list else np.zeros(0, np.int32),
        loss_mask=np.concatenate(mask_list) if mask_list else np.zeros(0, bool),
        lengths=np.array([len(x) for x in ids_list], dtype=np.int64),
        counts=counts,
        bad=bad,
        pending=pending,
    )


def filtered(ids: np.ndarray, mask: np.ndarray, options: EncodeOptions, counts: Counter):
    """The sample cut to max_len (or None if dropped), counting why it changed or went."""
    if len(ids) > options.max_len:
        counts[f"too_long_{'dropped' if options.too_long == 'drop' else 'truncated'}"] += 1
        if options.too_long == "drop":
            return None
        ids, mask = ids[: options.max_len], mask[: options.max_len]
    if int(mask.sum()) < 2 * options.block_size:
        counts["too_few_supervised"] += 1
        return None
    return ids, mask
