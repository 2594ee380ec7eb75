"""In-process generation at GPU speed: one worker thread per device, each owning a replica of the
target and a static KV cache it reuses, fed batches of prompts sorted by length.

`GenerationPool.generate(rows)` takes prompts (token ids) and gives back each one's new ids in
the order given: the prompts are sorted longest first (a batch pads little), cut into batches of
`plan.batch` rows, put on one queue that the devices' threads take from (a free device takes the
next batch), and the answers are put back in input order, so the result does not depend on
batching or on which device ran what.

Every batch is one HF `model.generate` (its decode steps' attention: regen/cache_attention.py, which
reads the cache without copying it per query head) with a `StaticCache` of `plan.batch` rows by
`plan.cache_len` tokens (left padding, the attention mask; transformers derives the position ids
from the mask, so a padded row equals the row alone: tests/regen/test_regen_batched.py checks it token
for token on the CPU). On a GPU, generate compiles the decode step (`CompileConfig`: inductor,
CUDA graphs from torch 2.13 on); the cache and batch keep one shape, so it compiles once: the cache length is the
longest prompt rounded up to `_LENGTH_BUCKET` plus `max_new_tokens`, and a last, short batch is
filled up with copies of its last prompt (their answers are dropped). A longer prompt later
re-plans (a new shape: one more compile).

An image prompt (`generate_images`: token ids with the placeholders expanded, and the processor's
vision inputs) is a job alone, run by the wrapper's `generate` with its own dynamic cache and no
compile: each has its own length and vision shapes, so it neither batches nor keeps one shape.

The batch is as large as fits (`fit_batch`): per row (`row_bytes`) the KV cache (bytes per token
x cache length) plus the prefill's activations, the mask and a step's float32 scores and logits,
against the device's free memory after the weights (measured once, before any cache) times
`_HEADROOM`, less `_RESERVE_BYTES` for the compiler, CUDA graphs and cuBLAS. An out-of-memory
error says to pass a smaller batch size.
"""

from __future__ import annotations

import copy
import inspect
import threading
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from queue import SimpleQueue
from typing import Any

import torch
from torch.torch_version import TorchVersion
from transformers import (
    CompileConfig,
    GenerationConfig,
    GenerationMixin,
    StaticCache,
    StoppingCriteria,
    StoppingCriteriaList,
)

from dflash_async.data.images import ImageTextSample
from dflash_async.eval.regenerate import generate_ids
from dflash_async.regen.cache_attention import gqa_decode

_HEADROOM = 0.9  # of the free memory: the caching allocator's fragmentation
_RESERVE_BYTES = 4 * 2**30  # inductor and CUDA-graph workspace, cuBLAS, the sampling temporaries
_LENGTH_BUCKET = 256  # cache length rounded up: a somewhat longer prompt later needs no re-plan
_MAX_BATCH = 1024
_CPU_BATCH = 32  # no compile on the CPU: any batch works, this one is quick
_JOIN_S = 30.0  # a worker stops within a decode step or a prefill once asked (daemon threads: a
# compile still running past this does not hold the process)
# CUDA graphs (inductor's "reduce-overhead") run in a Python thread from torch 2.13 on: before,
# cudagraph trees assert in any thread but the one that imported them (pytorch#123177, fixed by
# pytorch#184357); older torch compiles the decode step without them ("default")
_GRAPHS_IN_THREADS = TorchVersion(torch.__version__) >= (2, 13)
# transformers renamed generate's `past_key_values` to `cache` (the old name warns until 6.0)
_CACHE_KWARG = (
    "cache"
    if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    else "past_key_values"
)


def _shape(config: Any) -> tuple[Any, int, int, int]:
    """(text config, query heads, KV heads, head dim)."""
    text = config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return text, heads, getattr(text, "num_key_value_heads", None) or heads, head_dim


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Bytes the static cache holds per token and row: K and V of every layer (linear-attention
    or sliding layers counted as full ones: an over-estimate, never an under-estimate)."""
    text, _, kv_heads, head_dim = _shape(config)
    return 2 * text.num_hidden_layers * kv_heads * head_dim * dtype.itemsize


def row_bytes(config: Any, dtype: torch.dtype, *, prompt_len: int, cache_len: int) -> int:
    """The most memory one batch row needs besides the weights: its KV cache; the prefill's
    largest live activations, one layer at a time (per prompt token the residual stream, its
    norm, q/k/v, the attention output and the MLP's gate, activation, up and product; per cached
    token sdpa's K and V repeated to every query head; the mask, boolean and as sdpa's float
    bias); a decode step's float32 attention scores (three live) and logits, scores and softmax
    over the vocabulary."""
    text, heads, kv_heads, head_dim = _shape(config)
    inner = getattr(text, "intermediate_size", None) or 4 * text.hidden_size
    size = dtype.itemsize
    per_prompt_token = size * (4 * text.hidden_size + (heads + 2 * kv_heads) * head_dim + 4 * inner)
    per_cached_token = size * 2 * heads * head_dim + 3 * prompt_len + 3 * 4 * heads
    return (
        kv_bytes_per_token(config, dtype) * cache_len
        + per_prompt_token * prompt_len
        + per_cached_token * cache_len
        + 3 * 4 * text.vocab_size
    )


def fit_batch(*, budget_bytes: int, row_bytes: int, cap: int = _MAX_BATCH) -> int:
    """Rows that fit in `budget_bytes`: a multiple of 8 from 8 up, at most `cap`."""
    rows = min(cap, max(budget_bytes, 0) // row_bytes)
    return rows - rows % 8 if rows >= 8 else rows


def budget_bytes(device: torch.device) -> int:
    """What the caches and activations may use on `device`, now (the weights loaded, no cache)."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * _HEADROOM) - _RESERVE_BYTES


@dataclass(frozen=True)
class Plan:
    """The shape every batch has: `batch` rows, a cache of `cache_len` tokens."""

    batch: int
    cache_len: int


class _Stop(StoppingCriteria):
    """Ends a generate at the next step once `event` is set (close / Ctrl-C), without a sync."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), device=input_ids.device)


class _Count(StoppingCriteria):
    """Adds a batch's real rows to the pool's decoded tokens at every decode step (host
    arithmetic only: no sync), so that progress shows work before a batch ends."""

    def __init__(self, pool: GenerationPool, rows: int) -> None:
        self.pool, self.rows = pool, rows

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        with self.pool._count_lock:
            self.pool.tokens_decoded += self.rows
        return torch.zeros((input_ids.shape[0],), dtype=torch.bool, device=input_ids.device)


@contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Seed this device's RNG for one batch and put its state back afterwards."""
    if device.type == "cuda":
        state = torch.cuda.get_rng_state(device)
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)
        try:
            yield
        finally:
            torch.cuda.set_rng_state(state, device)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            yield


class _Replica:
    """One device's copy of the target, its cache (kept while the plan holds) and its thread."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.cache: Any = None
        self.shape: tuple[int, int] | None = None

    def run(self, rows: list[list[int]], plan: Plan, config: GenerationConfig, **kwargs: Any):
        shape = (len(rows), plan.cache_len)
        if self.shape != shape:
            self.cache = self.shape = None  # the old cache is freed before the new one fills
            self.cache = StaticCache(config=self.model.config, max_cache_len=plan.cache_len)
            self.shape = shape
        self.cache.reset()  # its length is read from it; stale keys would count
        return generate_ids(
            self.model, rows, copy.deepcopy(config), **{_CACHE_KWARG: self.cache}, **kwargs
        )

    def run_image(self, prompt: ImageTextSample, config: GenerationConfig, **kwargs: Any):
        """An image prompt's new ids ([1 row]): the wrapper's generate on its token ids and
        vision inputs, with generate's own cache (each prompt has its own length and vision
        shapes, so no static cache and no compile)."""
        config = copy.deepcopy(config)
        config.disable_compile = True
        ids = torch.as_tensor(prompt.input_ids, dtype=torch.long, device=self.device)[None]
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                generation_config=config,
                **prompt.model_inputs(self.device, self.model.dtype),
                **kwargs,
            )
        # Sync point: the generated ids come back to the host to be decoded.
        return out[:, ids.shape[1] :].tolist()


@dataclass(frozen=True)
class _Job:
    """A batch of text prompts (`rows`, the first `real` of them wanted, in `plan`'s shape) or
    one image prompt (`image`, rows empty), sampled with `seed`; its new ids go to `future`."""

    rows: list[list[int]]
    real: int
    plan: Plan | None
    seed: int
    future: Future
    image: ImageTextSample | None = None

    def out_of_memory(self) -> str:
        """What ran out of memory, and what to do."""
        if self.image is not None:
            return f"an image prompt of {len(self.image)} tokens alone (lower --max-new-tokens)"
        assert self.plan is not None
        return (
            f"{self.plan.batch} rows x {self.plan.cache_len} cached tokens; pass a smaller batch "
            "size (--batch-size)"
        )


class GenerationPool:
    """Replicas of one target, one per device, generating batches together (module docstring).

    `config` is the generation config of every batch (greedy or sampled, eos, max_new_tokens...);
    `batch_size` None: as large as fits (`_CPU_BATCH` on the CPU); `compile` None: on a GPU,
    with `compile_config` (default: inductor, static shapes, CUDA graphs where torch allows them
    in a thread: see _GRAPHS_IN_THREADS).
    Use it as a context manager: the threads start on entry and are stopped and joined on exit,
    an error or Ctrl-C included (a running generate stops at its next step).
    """

    def __init__(
        self,
        models: Sequence[Any],
        *,
        config: GenerationConfig,
        batch_size: int | None = None,
        compile: bool | None = None,
        compile_config: CompileConfig | None = None,
        seed: int = 0,
        tick_s: float = 1.0,
    ) -> None:
        if not models:
            raise ValueError("GenerationPool needs at least one model")
        self.replicas = [_Replica(model) for model in models]
        on_gpu = all(r.device.type == "cuda" for r in self.replicas)
        self.compile = on_gpu if compile is None else compile
        self.config = copy.deepcopy(config)
        # the pool passes its own cache, and generate refuses a cache_implementation beside one
        self.config.cache_implementation = None
        if self.compile:  # dynamic shapes off: every batch has one shape, compiled once
            mode = "reduce-overhead" if _GRAPHS_IN_THREADS else "default"
            compile_config = copy.copy(compile_config) or CompileConfig(dynamic=False, mode=mode)
            compile_config._compile_all_devices = not on_gpu  # a CPU test compiles too
            self.config.compile_config = compile_config
        else:
            self.config.disable_compile = True
        self.batch_size, self.seed, self.tick_s = batch_size, seed, tick_s
        # rows x decode steps of every batch so far, running ones included (a row that ended
        # early counts until its batch ends): the work progress can show mid-batch
        self.tokens_decoded = 0
        self._count_lock = threading.Lock()
        self.plan: Plan | None = None
        self.batches = 0  # submitted so far: a sampled batch's seed is seed + its number
        self._budgets = [
            budget_bytes(r.device) if r.device.type == "cuda" else None for r in self.replicas
        ]
        self._jobs: SimpleQueue[_Job | None] = SimpleQueue()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._attention = ExitStack()

    def __enter__(self) -> GenerationPool:
        self._stop.clear()
        self._jobs = SimpleQueue()  # nothing left over from an earlier block
        try:
            for (
                replica
            ) in self.replicas:  # regen/cache_attention.py: decode steps without repeat_kv
                self._attention.enter_context(gqa_decode(replica.model))
        except BaseException:
            self._attention.close()
            raise
        self._threads = [
            threading.Thread(
                target=self._work, args=(r, self._jobs), daemon=True, name=f"regenerate-{r.device}"
            )
            for r in self.replicas
        ]
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for _ in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join(timeout=_JOIN_S)
        self._threads = []
        self._attention.close()

    def plan_for(self, longest: int) -> Plan:
        """The shape for prompts up to `longest` tokens: the current one while it holds."""
        max_new = self.config.max_new_tokens
        if self.plan is not None and longest + max_new <= self.plan.cache_len:
            return self.plan
        cache_len = -(-longest // _LENGTH_BUCKET) * _LENGTH_BUCKET + max_new
        if self.batch_size is not None:
            batch = self.batch_size
        elif any(b is None for b in self._budgets):
            batch = _CPU_BATCH
        else:
            model = self.replicas[0].model
            row = row_bytes(model.config, model.dtype, prompt_len=longest, cache_len=cache_len)
            batch = min(fit_batch(budget_bytes=budget, row_bytes=row) for budget in self._budgets)
            if batch < 1:
                raise RuntimeError(
                    f"a prompt of {longest} tokens + {max_new} new does not fit one row's cache "
                    f"in the free GPU memory ({min(self._budgets) / 2**30:.1f} GiB usable)"
                )
        self.plan = Plan(batch=batch, cache_len=cache_len)
        return self.plan

    def generate(self, rows: Sequence[list[int]]) -> Generator[None, None, list[list[int]]]:
        """Each prompt's new ids, in the order given (`results = yield from pool.generate(r)`);
        yields None every tick_s while waiting, so a caller can log progress."""
        if not self._threads:
            raise RuntimeError("GenerationPool.generate outside its `with` block")
        order = sorted(range(len(rows)), key=lambda j: (-len(rows[j]), j))
        if not order:
            return []
        plan = self.plan_for(len(rows[order[0]]))
        jobs = []
        for lo in range(0, len(order), plan.batch):
            chunk = order[lo : lo + plan.batch]
            batch = [list(rows[j]) for j in chunk]
            if self.compile:  # the compiled shape: fill up with copies of the last prompt
                batch += [batch[-1]] * (plan.batch - len(batch))
            jobs.append((chunk, partial(_Job, rows=batch, real=len(chunk), plan=plan)))
        return (yield from self._run(jobs, len(rows)))

    def generate_images(
        self, prompts: Sequence[ImageTextSample]
    ) -> Generator[None, None, list[list[int]]]:
        """Each image prompt's new ids, in the order given, as `generate`: one prompt a job (its
        vision inputs have their own shapes), the jobs taken by whichever device is free."""
        if not self._threads:
            raise RuntimeError("GenerationPool.generate_images outside its `with` block")
        jobs = [
            ([j], partial(_Job, rows=[], real=1, plan=None, image=prompt))
            for j, prompt in enumerate(prompts)
        ]
        return (yield from self._run(jobs, len(prompts)))

    def _run(
        self, jobs: list[tuple[list[int], Callable[..., _Job]]], count: int
    ) -> Generator[None, None, list[list[int]]]:
        """Queue the jobs (the prompts each answers, and its _Job but for seed and future) and
        gather their new ids into `count` results in input order, yielding None every tick_s
        while waiting."""
        pending: list[tuple[list[int], Future]] = []
        try:
            for chunk, job in jobs:
                pending.append((chunk, future := Future()))
                self._jobs.put(job(seed=self.seed + self.batches, future=future))
                self.batches += 1
            results: list[list[int]] = [[] for _ in range(count)]
            for chunk, future in pending:
                while True:
                    try:
                        new_ids = future.result(timeout=self.tick_s)
                        break
                    except FutureTimeout:
                        if not any(thread.is_alive() for thread in self._threads):
                            raise RuntimeError("every worker thread of the pool ended") from None
                        yield None
                for j, ids in zip(chunk, new_ids, strict=True):
                    results[j] = ids
            return results
        finally:
            for _, future in pending:
                future.cancel()  # not started yet: never runs (after an error or a close)

    def _work(self, replica: _Replica, jobs: SimpleQueue[_Job | None]) -> None:
        if replica.device.type == "cuda":
            torch.cuda.set_device(replica.device)
        sampled = bool(self.config.do_sample)
        while (job := jobs.get()) is not None:
            future = job.future
            if not future.set_running_or_notify_cancel():
                continue
            stopping = StoppingCriteriaList([_Stop(self._stop), _Count(self, job.real)])
            try:
                with _seeded(job.seed, replica.device) if sampled else nullcontext():
                    if job.image is not None:
                        new_ids = replica.run_image(
                            job.image, self.config, stopping_criteria=stopping
                        )
                    else:
                        assert job.plan is not None
                        new_ids = replica.run(
                            job.rows, job.plan, self.config, stopping_criteria=stopping
                        )
                future.set_result(new_ids[: job.real])
            except torch.OutOfMemoryError as error:
                future.set_exception(
                    torch.OutOfMemoryError(
                        f"{replica.device}: out of memory generating {job.out_of_memory()}: {error}"
                    )
                )
            except BaseException as error:  # handed to the caller's thread, which raises it
                future.set_exception(error)


def run_to_end(steps: Generator[None, None, Any], on_tick: Callable[[], None] | None = None) -> Any:
    """Drive `pool.generate(...)` to its result outside a generator (the benchmark)."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
        if on_tick is not None:
            on_tick()
