"""`python -m dflash_async bench data`: the read stage at the scale of real drafter data, on CPU.

Three measurements, each printed as a table:
- tokenization: records/s of `load_samples` (no cache) on synthetic ShareGPT conversations of
  ~1k tokens (3 user/assistant exchanges), with the tiny target's tokenizer and with the
  Qwen-style byte-level BPE built by the repository's tests/fixtures/chat_tokenizer.py, in one
  process and with worker processes; or, with --path (and --tokenizer, a target folder or any
  folder holding a tokenizer), a real data file read as `run` reads it: the run's data defaults,
  its tokenizer loader and a cache folder, first load (tokenize + cache write) then reload;
- cached reload: `load_samples` of a cache entry holding 1 M samples (written directly, so the
  bench does not tokenize 1 M records first);
- planning off the loop: the read stage planning one epoch of 5 M synthetic lengths in its
  worker thread while a task ticks every 1 ms; reports the loop lag (how late the tick wakes)
  during planning and, as the floor this machine gives, while idle.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import random
import resource
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from dflash_async.atomic import atomic_directory
from dflash_async.bench.packing_bench import format_table, synthetic_lengths
from dflash_async.data import cache
from dflash_async.data.fast_bpe import check_tokenizer
from dflash_async.data.fast_template import render_qwen3
from dflash_async.data.formats import chat_messages, resolve_files
from dflash_async.data.packing import PackCursor
from dflash_async.data.samples import (
    DROP_REASONS,
    DataOptions,
    encode_options,
    load_samples,
)
from dflash_async.data.tokenization import direct_backend
from dflash_async.runtime.channels import open_channel
from dflash_async.settings.env import repo_root
from dflash_async.stages.read import read_stage
from dflash_async.targets.tiny import tiny_tokenizer

EXCHANGES = 3
USER_WORDS, ASSISTANT_WORDS = 60, 190  # ~1k tokens per conversation with either tokenizer


class _Quiet:
    def __init__(self) -> None:
        self.encoder = ""
        self.loaded: dict = {}

    def warning(self, event: str, **fields: Any) -> None:
        """The data's warnings (synthetic data: none that matter to a benchmark)."""

    def info(self, event: str, **fields: Any) -> None:
        if event == "tokenizer_chosen":
            self.encoder = fields["encoder"]
        elif event == "data_loaded":
            self.loaded = fields


def _fixtures() -> Any:
    """tests/fixtures/chat_tokenizer.py of this repository, loaded by path."""
    path = repo_root() / "tests" / "fixtures" / "chat_tokenizer.py"
    if not path.is_file():
        raise SystemExit(f"bench data needs the repository's {path}")
    spec = importlib.util.spec_from_file_location("chat_tokenizer_fixture", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cpu_s() -> float:
    """CPU seconds of this process and its reaped children (the tokenizer workers): the figure
    that does not depend on what else shares the machine's cores."""
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def sharegpt_records(num: int, words: list[str], text: Any, seed: int = 0) -> list[dict]:
    """ShareGPT conversations of EXCHANGES human/gpt exchanges; `text(rng, words, n)` writes."""
    rng = random.Random(seed)
    return [
        {
            "conversations": [
                turn
                for _ in range(EXCHANGES)
                for turn in (
                    {"from": "human", "value": text(rng, words, USER_WORDS)},
                    {"from": "gpt", "value": text(rng, words, ASSISTANT_WORDS)},
                )
            ]
        }
        for _ in range(num)
    ]


def bench_tokenization(
    num_records: int, workers: list[int], names: tuple[str, ...] = ("tiny", "qwen_style")
) -> list[dict]:
    fixtures = _fixtures()
    tiny = tiny_tokenizer()
    tokenizers = {
        "tiny": lambda: (tiny, sorted(w for w in tiny.get_vocab() if w.isalpha())),
        "qwen_style": lambda: (
            fixtures.qwen_style_tokenizer(),
            fixtures.english_like_words(20_000),
        ),
    }
    tokenizers = {name: tokenizers[name]() for name in names}
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name, (tokenizer, words) in tokenizers.items():
            path = Path(folder) / f"{name}.jsonl"
            records = sharegpt_records(num_records, words, fixtures.english_like_text)
            path.write_text("".join(json.dumps(r) + "\n" for r in records))
            floor_ms, fast_ms = _tokenizer_cpu_ms(tokenizer, records[:500])
            for count in workers:
                options = DataOptions(max_len=4096, enable_thinking=False, workers=count)
                started, cpu, log = time.perf_counter(), _cpu_s(), _Quiet()
                samples = load_samples(
                    str(path), tokenizer, options=options, block_size=16, log=log
                )
                seconds, cpu_s = time.perf_counter() - started, _cpu_s() - cpu
                rows.append(
                    {
                        "tokenizer": name,
                        "encoder": log.encoder,
                        "workers": count,
                        "records": num_records,
                        "tokens_per_record": round(len(samples.tokens) / len(samples)),
                        "seconds": round(seconds, 2),
                        "records_per_s": round(num_records / seconds),
                        "cpu_s": round(cpu_s, 2),  # this process + finished worker processes
                        "records_per_cpu_s": round(num_records / cpu_s),
                        "tokenizer_alone_cpu_ms_per_record": round(floor_ms, 2),
                        "tiktoken_alone_cpu_ms_per_record": fast_ms,
                    }
                )
                print(format_table(rows[-1]), flush=True)
    return rows


def bench_file(path: str, tokenizer_path: str, workers: list[int]) -> list[dict]:
    """`path` read as `run` reads DFLASH_DATA__PATH: the target folder's tokenizer through the
    run's loader, the run's data defaults (DataSettings) and block size, a fresh cache folder per
    worker count; the first load tokenizes and writes the cache, the second only maps it."""
    from dflash_async.pipeline.specs import _data_options
    from dflash_async.settings import DataSettings
    from dflash_async.settings.recipe import TrainSettings
    from dflash_async.targets.loading import load_target_tokenizer

    block_size = TrainSettings().block_size
    rows = []
    for count in workers:
        with tempfile.TemporaryDirectory() as folder:
            started = time.perf_counter()
            tokenizer = load_target_tokenizer(tokenizer_path)
            tokenizer_s = time.perf_counter() - started
            options = _data_options(
                DataSettings(workers=count), max_len=DataSettings().max_len, output_dir=Path(folder)
            )
            timed = []
            for _ in range(2):  # first load, then the cached reload
                started, cpu, log = time.perf_counter(), _cpu_s(), _Quiet()
                samples = load_samples(
                    path, tokenizer, options=options, block_size=block_size, log=log
                )
                timed.append((time.perf_counter() - started, _cpu_s() - cpu, log))
            (first_s, cpu_s, first), (reload_s, _, again) = timed
            assert not first.loaded["cached"] and again.loaded["cached"]
            tokens = int(samples.lengths.sum())
            rows.append(
                {
                    "path": Path(path).name,
                    "encoder": first.encoder,
                    "workers": count,
                    "records": first.loaded["records"],
                    "samples": len(samples),
                    "tokens": tokens,
                    "supervised_tokens": int(samples.loss_mask.sum()),
                    "tokenizer_load_s": round(tokenizer_s, 2),
                    "first_load_s": round(first_s, 2),
                    "tokens_per_s": round(tokens / first_s),
                    "cpu_s": round(cpu_s, 2),
                    "reload_s": round(reload_s, 3),
                    "filtered": {k: first.loaded[k] for k in DROP_REASONS if first.loaded.get(k)},
                }
            )
            print(format_table(rows[-1]), flush=True)
    return rows


def _tokenizer_cpu_ms(tokenizer: Any, records: list[dict]) -> tuple[float, float | None]:
    """CPU ms per record of the tokenizer's Rust batch alone on the records' renderings: the
    part of tokenization no rendering or masking work can remove; and of fast_bpe's tiktoken
    encoder with its offsets where it is proven exact (else None)."""
    texts = [
        render_qwen3(chat_messages(r), add_generation_prompt=False, enable_thinking=False)
        for r in records
    ]
    assert all(t is not None for t in texts)
    backend = direct_backend(tokenizer)
    cpu = time.process_time()  # all threads of this process: the backend may use several
    backend.encode_batch(texts, add_special_tokens=False)
    hf_ms = (time.process_time() - cpu) / len(texts) * 1e3
    fast, _ = check_tokenizer(backend)
    if fast is None:
        return hf_ms, None
    fast.encode_batch(texts[:1])  # builds tiktoken's tables first
    cpu = time.process_time()
    fast.encode_batch(texts)
    return hf_ms, round((time.process_time() - cpu) / len(texts) * 1e3, 2)


def bench_cached_reload(num_samples: int, mean_len: int = 64) -> dict:
    """Write a `num_samples` entry under the key load_samples computes, then time the reload."""
    tokenizer = tiny_tokenizer()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as folder:
        data = Path(folder) / "d.jsonl"
        data.write_text("{}\n")
        options = DataOptions(cache_dir=str(Path(folder) / "cache"))
        encode = encode_options(options, block_size=16)
        key = cache.cache_key(resolve_files(str(data)), tokenizer, asdict(encode))
        final = cache.entry_path(Path(options.cache_dir), key)
        lengths = rng.integers(mean_len // 2, 3 * mean_len // 2, num_samples)  # [n]
        written = time.perf_counter()
        with (
            atomic_directory(final, replaceable=cache.unfinished) as temporary,
            cache.ArrayWriter(temporary) as writer,
        ):  # written and published as load_samples does
            for part in np.array_split(lengths, 100):
                tokens = rng.integers(0, len(tokenizer), int(part.sum()), dtype=np.int32)
                writer.append(tokens, tokens % 3 > 0, part)
            writer.finish({"samples": num_samples, "max_token_id": writer.max_token_id})
        write_s = time.perf_counter() - written
        started = time.perf_counter()
        samples = load_samples(str(data), tokenizer, options=options, block_size=16, log=_Quiet())
        reload_s = time.perf_counter() - started
        assert len(samples) == num_samples and int(samples.lengths.sum()) == lengths.sum()
    figures = {
        "samples": num_samples,
        "tokens": int(lengths.sum()),
        "write_s": round(write_s, 2),
        "reload_s": round(reload_s, 3),
    }
    print(format_table(figures), flush=True)
    return figures


def _cpu_wait_s() -> float | None:
    """Seconds the calling thread has spent runnable but waiting for a CPU (Linux schedstat's
    run-queue time); None where the kernel does not report it."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as stat:
            return int(stat.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


async def _ticks(lags: list[tuple[float, float]], stop: anyio.Event) -> None:
    """(lag s, of which waiting for a CPU s) of a 1 ms sleep, until `stop`."""
    while not stop.is_set():
        started, waited = time.perf_counter(), _cpu_wait_s()
        await anyio.sleep(0.001)
        lag = time.perf_counter() - started - 0.001
        lags.append((lag, 0.0 if waited is None else _cpu_wait_s() - waited))


class _FullCollections:
    """Pauses of the garbage collector's full (generation 2) collections while installed."""

    def __init__(self) -> None:
        self.pauses_s: list[float] = []
        self._started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif info["generation"] == 2:
            self.pauses_s.append(time.perf_counter() - self._started)

    def __enter__(self) -> _FullCollections:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        gc.callbacks.remove(self)


async def _plan_with_ticks(lengths: np.ndarray, token_budget: int, in_process: bool) -> dict:
    """Loop lag while idle (the machine's floor), while epoch 0 is planned (start to the first
    pack: the planner's start-up included), and while packs are taken at 500/s for `after_s`
    (the next epoch is planned ahead meanwhile). Each tick's lag is also given less the time the
    loop's thread waited for a CPU (`own`): what this process did to the loop, not what other
    processes on the machine did to it."""
    idle: list[tuple[float, float]] = []
    stop = anyio.Event()
    async with anyio.create_task_group() as group:
        group.start_soon(_ticks, idle, stop)
        await anyio.sleep(2.0)
        stop.set()
    planning: list[tuple[float, float]] = []
    sending: list[tuple[float, float]] = []
    send, receive = open_channel(4, "packs")
    started = time.perf_counter()
    with _FullCollections() as collections:
        async with anyio.create_task_group() as group:
            stop = anyio.Event()
            group.start_soon(_ticks, planning, stop)
            group.start_soon(
                lambda: read_stage(
                    lengths,
                    token_budget=token_budget,
                    seed=0,
                    start=PackCursor(),
                    epochs=None,
                    send=send,
                    plan_in_process=in_process,
                )
            )
            await receive.receive()
            plan_s = time.perf_counter() - started
            stop.set()
            stop = anyio.Event()
            group.start_soon(_ticks, sending, stop)
            with anyio.move_on_after(max(5.0, 2.5 * plan_s)):
                async for _ in receive:
                    await anyio.sleep(0.002)
            stop.set()
            group.cancel_scope.cancel()
    figures = {
        "planner": "process" if in_process else "thread",
        "samples": len(lengths),
        "gc_frozen": gc.get_freeze_count() > 0,
        "first_pack_s": round(plan_s, 2),
        "full_gc_pauses": len(collections.pauses_s),
        "full_gc_max_ms": round(max(collections.pauses_s, default=0.0) * 1e3, 1),
    }
    for name, ticks in (("planning", planning), ("sending", sending), ("idle", idle)):
        lag = np.array([t[0] for t in ticks]) * 1e3  # [ticks] ms
        own = lag - np.array([t[1] for t in ticks]) * 1e3  # [ticks] ms, less waiting for a CPU
        figures |= {
            f"{name}_lag_max_p99_ms": f"{lag.max():.1f} / {np.percentile(lag, 99):.1f}",
            f"{name}_own_max_p99_ms": f"{own.max():.1f} / {np.percentile(own, 99):.1f}",
            f"{name}_ticks_over_5ms_lag_own": f"{(lag > 5).sum()} / {(own > 5).sum()} of {len(lag)}",
        }
    return figures


def bench_planning(num_samples: int, token_budget: int = 49152, gc_freeze: bool = False) -> list:
    """The read stage planning one epoch in a process (the default at this size) and, for
    comparison, in a thread of this process; on uvloop, as `run` does. gc_freeze: move every
    object alive after start-up out of the collector's reach first (gc.freeze), so that a full
    collection does not walk the ~1 M objects of torch and transformers."""
    lengths = synthetic_lengths(num_samples, 3072, seed=0)
    if gc_freeze:
        gc.collect()
        gc.freeze()
    rows = []
    for in_process in (True, False):
        rows.append(
            anyio.run(
                _plan_with_ticks,
                lengths,
                token_budget,
                in_process,
                backend_options={"use_uvloop": True},
            )
        )
        print(format_table(rows[-1]), flush=True)
    return rows


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m dflash_async bench data")
    parser.add_argument("--records", type=int, default=2000, help="tokenization records")
    parser.add_argument("--workers", default="1,2", help="comma list of worker counts")
    parser.add_argument("--tokenizers", default="tiny,qwen_style", help="comma list")
    parser.add_argument("--reload-samples", type=int, default=1_000_000)
    parser.add_argument("--plan-samples", type=int, default=5_000_000)
    parser.add_argument("--only", choices=("tokenize", "reload", "plan"), default=None)
    parser.add_argument("--gc-freeze", action="store_true", help="gc.freeze() before planning")
    parser.add_argument("--path", help="a real data file or folder (as DFLASH_DATA__PATH)")
    parser.add_argument("--tokenizer", help="with --path: a folder holding the target tokenizer")
    options = parser.parse_args(argv)
    if (options.path is None) != (options.tokenizer is None):
        parser.error("--path and --tokenizer go together")
    workers = [int(w) for w in options.workers.split(",")]
    if options.path is not None and options.only in (None, "tokenize"):
        bench_file(options.path, options.tokenizer, workers)
    elif options.only in (None, "tokenize"):
        bench_tokenization(options.records, workers, tuple(options.tokenizers.split(",")))
    if options.only in (None, "reload"):
        bench_cached_reload(options.reload_samples)
    if options.only in (None, "plan"):
        bench_planning(options.plan_samples, gc_freeze=options.gc_freeze)
    return 0
