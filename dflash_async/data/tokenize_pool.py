"""The tokenizer processes of tokenize_all.encode_all: spawned, a bounded number of chunks in
flight, results in file order, and an encoder verdict that may arrive after they started.

Spawn, not fork: the parent runs an event loop and device threads. The fast encoder's proof
(fast_bpe.proof_why, ~1.5 CPU s for a 150k vocabulary) runs in a parent thread while the
processes start and encode with the candidate tables; no result is handed on before the verdict.
If the proof fails, the chunks in flight are encoded again with the HF tokenizer and so is every
later one: the output is what it would have been had the proof run first.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import tempfile
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from dflash_async.data.chat import token_mask
from dflash_async.data.tokenization import (
    ChunkResult,
    EncodeOptions,
    Raw,
    direct_backend,
    encode_chunk,
    filtered,
    tokenize_batch,
)


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


def worker_tokenizer(tokenizer: Any) -> Any:
    """What the tokenizer processes are given of `tokenizer`: a `BackendOnly` where its backend
    gives what the plain call gives, else the tokenizer itself."""
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


# Per-process state of a tokenizer worker, set once by the pool initializer so the tokenizer is
# pickled once per process rather than once per chunk. Only spawned worker processes set it.
_WORKER: dict[str, Any] = {}


def _init_worker(state_path: str) -> None:
    # One thread of Rust tokenization per process (HF and fast_bpe read it): the processes
    # already fill the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    with open(state_path, "rb") as f:
        tokenizer, options, fast = pickle.load(f)
    _WORKER.update(tokenizer=tokenizer, options=options, fast=fast)


def _encode_chunk_in_worker(chunk: list[Raw], use_fast: bool) -> ChunkResult:
    fast_render, fast_encode = _WORKER["fast"]
    # No cyclic garbage collection during a chunk: parsing and rendering 256 records allocate
    # ~10^5 objects, and the generation-0 passes that triggers cost ~13% of a worker's CPU on
    # real ShareGPT records (1.72 -> 1.49 CPU s per 2,500, measured with encode_batch). The
    # chunk's objects are freed by reference counting; anything cyclic is collected at the
    # next chunk's end.
    gc.disable()
    try:
        return encode_chunk(
            chunk,
            _WORKER["tokenizer"],
            _WORKER["options"],
            fast_render,
            fast_encode if use_fast else None,
            defer=True,
        )
    finally:
        gc.enable()


def finish_chunk(result: ChunkResult, tokenizer: Any, options: EncodeOptions) -> ChunkResult:
    """`result` with its pending renderings (those the fast encoder refused: NFC-changing text,
    code points past U+30000; a few in 1,000) encoded by `tokenizer` in this process, masked,
    filtered and put back in record order. So a worker never builds the HF backend (~0.6 CPU s
    for a 150k vocabulary) for them; the parent has it already."""
    if not result.pending:
        return result
    encoded = tokenize_batch(tokenizer, [text for _, text, _ in result.pending])
    bounds = np.concatenate([[0], np.cumsum(result.lengths)])
    ids_list, mask_list, done = [], [], 0

    def keep_up_to(at: int) -> None:
        ids_list.extend(result.tokens[bounds[k] : bounds[k + 1]] for k in range(done, at))
        mask_list.extend(result.loss_mask[bounds[k] : bounds[k + 1]] for k in range(done, at))

    for (at, _, char_mask), (ids, offsets) in zip(result.pending, encoded, strict=True):
        keep_up_to(at)
        done = at
        kept = filtered(ids, token_mask(char_mask, offsets), options, result.counts)
        if kept is not None:
            ids_list.append(kept[0])
            mask_list.append(kept[1])
    keep_up_to(len(result.lengths))
    return ChunkResult(
        tokens=np.concatenate(ids_list) if ids_list else np.zeros(0, np.int32),
        loss_mask=np.concatenate(mask_list) if mask_list else np.zeros(0, bool),
        lengths=np.array([len(x) for x in ids_list], dtype=np.int64),
        counts=result.counts,
        bad=result.bad,
    )


def encode_in_pool(
    chunks: Iterator[list[Raw]],
    tokenizer: Any,
    options: EncodeOptions,
    *,
    workers: int,
    fast: tuple,
    verdict: Future | None,
    parent_tokenizer: Any = None,
) -> Iterator[ChunkResult]:
    """encode_chunk of every chunk in `workers` processes, in order. `fast` is (renderer,
    encoder); `verdict`, if not None, resolves to whether the encoder may be used; the texts
    the encoder refuses are encoded here by `parent_tokenizer` (default: `tokenizer`)."""
    parent_tokenizer = tokenizer if parent_tokenizer is None else parent_tokenizer
    # The workers' state (the tokenizer's 7 MB JSON, the tiktoken tables) goes through a file,
    # pickled once: as initargs it is pickled per worker and written down each spawn pipe,
    # and that write blocks the parent until the child has imported its main module, so the
    # next worker started ~0.5-3 s later. The file is removed when the pool shuts down.
    with tempfile.NamedTemporaryFile(
        prefix="dflash-tokenize-", suffix=".pkl", delete=False
    ) as state:
        pickle.dump((tokenizer, options, fast), state, protocol=pickle.HIGHEST_PROTOCOL)
    # An executor, not a Pool: a worker that dies raises BrokenProcessPool instead of hanging.
    pool = ProcessPoolExecutor(
        max_workers=workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_init_worker,
        initargs=(state.name,),
    )
    use_fast = fast[1] is not None
    in_flight: deque[tuple[list[Raw], Future]] = deque()

    def next_result() -> ChunkResult:
        nonlocal verdict, use_fast, in_flight
        if verdict is not None:  # the first result waits for the proof
            refused, verdict = not verdict.result(), None
            if refused and use_fast:
                use_fast = False
                for _, future in in_flight:
                    future.cancel()
                in_flight = deque(
                    (c, pool.submit(_encode_chunk_in_worker, c, False)) for c, _ in in_flight
                )
        return finish_chunk(in_flight.popleft()[1].result(), parent_tokenizer, options)

    try:
        for chunk in chunks:  # 2 chunks per worker in flight bound the memory held
            in_flight.append((chunk, pool.submit(_encode_chunk_in_worker, chunk, use_fast)))
            if len(in_flight) >= 2 * workers:
                yield next_result()
        while in_flight:
            yield next_result()
    finally:  # on a DataError mid-way, do not tokenize the rest first
        pool.shutdown(cancel_futures=True)
        os.unlink(state.name)
