"""The tokenizer processes of tokenization.encode_all: spawned, a bounded number of chunks in
flight, results in file order, and an encoder verdict that may arrive after they started.

Spawn, not fork: the parent runs an event loop and device threads. The fast encoder's proof
(fast_bpe.proof_why, ~1.5 CPU s for a 150k vocabulary) runs in a parent thread while the
processes start and encode with the candidate tables; no result is handed on before the verdict.
If the proof fails, the chunks in flight are encoded again with the HF tokenizer and so is every
later one: the output is what it would have been had the proof run first.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

from dflash_async.data.tokenization import ChunkResult, EncodeOptions, Raw, encode_chunk

# Per-process state of a tokenizer worker, set once by the pool initializer so the tokenizer is
# pickled once per process rather than once per chunk. Only spawned worker processes set it.
_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer: Any, options: EncodeOptions, fast: tuple) -> None:
    # One thread of Rust tokenization per process (HF and fast_bpe read it): the processes
    # already fill the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER.update(tokenizer=tokenizer, options=options, fast=fast)


def _encode_chunk_in_worker(chunk: list[Raw], use_fast: bool) -> ChunkResult:
    fast_render, fast_encode = _WORKER["fast"]
    return encode_chunk(chunk, _WORKER["tokenizer"], _WORKER["options"], fast_render,
                        fast_encode if use_fast else None)  # fmt: skip


def encode_in_pool(
    chunks: Iterator[list[Raw]],
    tokenizer: Any,
    options: EncodeOptions,
    *,
    workers: int,
    fast: tuple,
    verdict: Future | None,
) -> Iterator[ChunkResult]:
    """encode_chunk of every chunk in `workers` processes, in order. `fast` is (renderer,
    encoder); `verdict`, if not None, resolves to whether the encoder may be used."""
    # An executor, not a Pool: a worker that dies raises BrokenProcessPool instead of hanging.
    pool = ProcessPoolExecutor(
        max_workers=workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_init_worker,
        initargs=(tokenizer, options, fast),
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
                in_flight = deque((c, pool.submit(_encode_chunk_in_worker, c, False))
                                  for c, _ in in_flight)  # fmt: skip
        return in_flight.popleft()[1].result()

    try:
        for chunk in chunks:  # 2 chunks per worker in flight bound the memory held
            in_flight.append((chunk, pool.submit(_encode_chunk_in_worker, chunk, use_fast)))
            if len(in_flight) >= 2 * workers:
                yield next_result()
        while in_flight:
            yield next_result()
    finally:  # on a DataError mid-way, do not tokenize the rest first
        pool.shutdown(cancel_futures=True)
