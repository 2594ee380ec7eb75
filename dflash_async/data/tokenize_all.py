"""Tokenization of a whole data set: `encode_all`, which chooses the fast chat renderer and the
fast encoder once for the run (each checked against the tokenizer's own on the run's first
records, and logged), encodes the chunks of tokenization.py in this process or, with `workers > 1`
and more than two chunks, in the tokenizer processes of tokenize_pool.py, and reports progress
(a bar on a terminal, events otherwise).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from itertools import chain, islice
from typing import Any

import numpy as np
from tqdm import tqdm

from dflash_async.data.chat import ChatMaskError, chat_template_of
from dflash_async.data.fast_bpe import FastBPE, check_tokenizer, fast_candidate, proof_why
from dflash_async.data.fast_template import choose_renderer
from dflash_async.data.formats import BadRecord, TruncatedRecord, chat_messages, parse_record
from dflash_async.data.tokenization import (
    ChunkResult,
    EncodeOptions,
    Raw,
    direct_backend,
    encode_chunk,
    render_record,
    tokenize_batch,
)
from dflash_async.data.tokenize_pool import encode_in_pool, worker_tokenizer

PROGRESS_EVERY_S = 10.0  # seconds between progress events when stderr is not a terminal
FAST_RENDER_SAMPLE = 32  # records of the run checked against jinja before the fast renderer
FAST_ENCODE_SAMPLE = 32  # renderings of the run checked against HF before the fast encoder


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
        for_workers = worker_tokenizer(tokenizer)
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
    rendered = [render_record(raw, tokenizer, options, fast_render) for _, raw in first]
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
