"""Tokenization: raw records -> filtered token ids and assistant-only loss masks, in parallel.

Records travel in chunks. Per chunk, every chat is rendered and character-masked by
dflash_async.data.chat (the template renders dominate the cost), then all renderings of the chunk
are tokenized by one call of the tokenizer's batched fast path, and each record's token mask is
derived from its offsets exactly as `encode_chat` does one at a time. The filters (too long,
fewer than 2 x block_size supervised tokens) run in the same pass, so a chunk comes back as three
flat arrays plus its counts: nothing per record crosses a process boundary.

With `workers > 1` chunks go to spawned processes (tokenize_pool.py), a bounded number in
flight, results taken in file order; the first bad record in file order is the one reported. A
data set of a few chunks stays in this process.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from itertools import chain, islice
from typing import Any

import jinja2
import numpy as np
from tqdm import tqdm

from dflash_async.data.chat import (
    ChatMaskError,
    assistant_char_mask,
    chat_template_of,
    supervised_turns,
    token_mask,
)
from dflash_async.data.fast_bpe import FastBPE, check_tokenizer, fast_candidate, proof_why
from dflash_async.data.fast_mask import qwen3_char_mask
from dflash_async.data.fast_template import choose_renderer, render_qwen3
from dflash_async.data.formats import BadRecord, TruncatedRecord, chat_messages, parse_record

Raw = tuple[str, Any]  # (where, raw record) from formats.iter_raw_records
PROGRESS_EVERY_S = 10.0  # seconds between progress events when stderr is not a terminal
FAST_RENDER_SAMPLE = 32  # records of the run checked against jinja before the fast renderer
FAST_ENCODE_SAMPLE = 32  # renderings of the run checked against HF before the fast encoder


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


def _render(raw: Any, tokenizer: Any, options: EncodeOptions, fast_render: Any) -> tuple:
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


@dataclass
class BackendOnly:
    """What a tokenizer process reads of a tokenizer whose backend tokenize_batch calls: it
    pickles without transformers, so a process that renders with fast_template never imports
    transformers (~1 s of start-up per process). The backend travels as its JSON and is built
    on first use (~0.6 s for a 150k vocabulary): a process whose texts the fast encoder takes
    never builds it."""

    backend_json: str  # tokenizers.Tokenizer.to_str()
    chat_template: Any
    name_or_path: str
    split_special_tokens: bool
    size: int  # len(tokenizer): the vocabulary with added tokens

    @cached_property
    def backend_tokenizer(self) -> Any:  # tokenizers.Tokenizer
        from tokenizers import Tokenizer

        return Tokenizer.from_str(self.backend_json)

    def __len__(self) -> int:
        return self.size


def _for_workers(tokenizer: Any) -> Any:
    backend = direct_backend(tokenizer)
    if backend is None:
        return tokenizer
    return BackendOnly(
        backend.to_str(),
        getattr(tokenizer, "chat_template", None),
        str(getattr(tokenizer, "name_or_path", "")),
        bool(getattr(tokenizer, "split_special_tokens", False)),
        len(tokenizer),
    )


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
    rendered = [_render(raw, tokenizer, options, fast_render) for _, raw in chunk]
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
        kept = _filtered(result[1], result[2], options, counts)
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


def _filtered(ids: np.ndarray, mask: np.ndarray, options: EncodeOptions, counts: Counter):
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


def encode_all(
    records: Iterable[Raw],
    tokenizer: Any,
    options: EncodeOptions,
    *,
    workers: int,
    chunk_records: int,
    log: Any,
    progress_every_s: float = PROGRESS_EVERY_S,
) -> Iterator[ChunkResult]:
    """encode_chunk of every chunk of `records`, in order; parallel once there are > 2 chunks."""
    chunks = _chunked(iter(records), chunk_records)
    first = list(islice(chunks, 3))
    fast_render = _fast_renderer(first, tokenizer, options, log)
    texts = _first_renderings(first, tokenizer, options, fast_render)
    if workers > 1 and len(first) > 2:
        from dflash_async.data.tokenize_pool import encode_in_pool  # it imports this module

        for_workers = _for_workers(tokenizer)
        spec_json = getattr(for_workers, "backend_json", None)
        fast_encode, verdict, proving = _fast_encoder_proving(texts, tokenizer, log, spec_json)
        try:
            results = encode_in_pool(
                chain(first, chunks),
                for_workers,
                options,
                workers=workers,
                fast=(fast_render, fast_encode),
                verdict=verdict,
                parent_tokenizer=tokenizer,
            )
            yield from _with_progress(results, log, progress_every_s)
        finally:
            proving.shutdown(wait=False)
        return
    fast = (fast_render, _fast_encoder(texts, tokenizer, log))
    results = (encode_chunk(c, tokenizer, options, *fast) for c in chain(first, chunks))
    yield from _with_progress(results, log, progress_every_s)


def _fast_renderer(chunks: list[list[Raw]], tokenizer: Any, options: EncodeOptions, log: Any):
    """fast_template's renderer if it renders like jinja on probes and the first SAMPLE chats."""
    sample = []
    for _, raw in islice(chain.from_iterable(chunks), FAST_RENDER_SAMPLE):
        try:
            sample.append(chat_messages(parse_record(raw), dict(options.role_map)))
        except (BadRecord, TruncatedRecord):
            continue
    if not sample:  # pre-tokenized data, or nothing readable: jinja reports what is wrong
        return None
    try:
        template = chat_template_of(tokenizer)
    except ChatMaskError:
        return None
    fast_render, why = choose_renderer(template, sample, enable_thinking=options.enable_thinking)
    log.info(
        "chat_renderer_chosen",
        renderer="jinja" if fast_render is None else "python_qwen3",
        checked_records=len(sample),
        **({"why": why} if why else {}),
    )
    return fast_render


def _first_renderings(
    chunks: list[list[Raw]], tokenizer: Any, options: EncodeOptions, fast_render: Any
) -> list[str]:
    """The run's first SAMPLE chat renderings: what the fast encoder is compared on."""
    first = islice(chain.from_iterable(chunks), FAST_ENCODE_SAMPLE)
    rendered = [_render(raw, tokenizer, options, fast_render) for _, raw in first]
    return [r[1] for r in rendered if r[0] == "chat"]


_NO_BACKEND = "the tokenizer has truncation, padding or no fast backend"


def _fast_encoder(texts: list[str], tokenizer: Any, log: Any) -> FastBPE | None:
    """fast_bpe's encoder if it is proven to encode as the tokenizer and gives the tokenizer's
    ids and offsets on the run's first renderings; logs which encoder and why. Its checks cost
    ~1 s once (less for a small vocabulary, ~2.5 s for a 150k one)."""
    if not texts:  # pre-tokenized data, or nothing readable: nothing to check it on
        return None
    backend = direct_backend(tokenizer)
    fast, why = (None, _NO_BACKEND) if backend is None else check_tokenizer(backend)
    return _compared(fast, why, texts, tokenizer, log)


def _fast_encoder_proving(texts: list[str], tokenizer: Any, log: Any, spec_json: Any) -> tuple:
    """_fast_encoder for tokenizer processes: (the candidate encoder, a Future of whether it may
    be used or None, the thread proving it): the proof runs while the processes start."""
    proving = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflash-fast-bpe-proof")
    backend = direct_backend(tokenizer)
    if not texts:
        return None, None, proving
    fast, why, spec = (
        (None, _NO_BACKEND, {}) if backend is None else fast_candidate(backend, spec_json=spec_json)
    )

    def decide() -> bool:
        failed = proof_why(fast, spec) if fast is not None else why
        return _compared(None if failed else fast, failed, texts, tokenizer, log) is not None

    if fast is None:  # refused already: log it now, nothing to wait for
        decide()
        return None, None, proving
    return fast, proving.submit(decide), proving


def _compared(fast: FastBPE | None, why: str, texts: list[str], tokenizer: Any, log: Any):
    """`fast` if it gives the tokenizer's ids and offsets on `texts` (else None); logs which."""
    checked = 0
    if fast is not None:  # texts it leaves to HF (None) are not compared
        pairs = zip(fast.encode_batch(texts), tokenize_batch(tokenizer, texts), strict=True)
        for i, (got, want) in enumerate(pairs):
            checked += got is not None
            if got is not None and not all(map(np.array_equal, got, want)):
                fast, why = None, f"rendering {i} of the run encodes to other ids or offsets"
                break
    log.info(
        "tokenizer_chosen",
        encoder="huggingface" if fast is None else "tiktoken",
        checked_records=checked,
        **({"why": why} if why else {}),
    )
    return fast


def _chunked(records: Iterator[Raw], size: int) -> Iterator[list[Raw]]:
    while chunk := list(islice(records, size)):
        yield chunk


def _with_progress(
    results: Iterator[ChunkResult], log: Any, every_s: float
) -> Iterator[ChunkResult]:
    """A tqdm bar on a terminal, else a `tokenization_progressed` event every `every_s`."""
    on_tty = sys.stderr.isatty()
    started = last = time.perf_counter()
    records = samples = 0
    with tqdm(unit="rec", desc="tokenizing", disable=not on_tty) as bar:
        for result in results:
            records += result.counts["records"]
            samples += len(result.lengths)
            bar.update(result.counts["records"])
            now = time.perf_counter()
            if not on_tty and now - last >= every_s:
                log.info(
                    "tokenization_progressed",
                    records=records,
                    samples=samples,
                    elapsed_s=round(now - started, 1),
                    records_per_s=round(records / max(now - started, 1e-9), 1),
                )
                last = now
            yield result
