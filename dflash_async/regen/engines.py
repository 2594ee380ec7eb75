"""The two ways `regenerate` gets answers, behind one interface: `outcomes(conversations)`.

- `ServerEngine`: an OpenAI-compatible `/v1/chat/completions` endpoint (vLLM, SGLang, ...), the
  ecosystem's way to generate at scale. Requests go out from a fixed pool of `concurrency`
  threads; sampling is sent explicitly (temperature 0 = greedy by default, top_p 1, max_tokens, a
  per-record seed); the chat template's kwargs (`enable_thinking`, ...) go as
  `chat_template_kwargs`, which both servers pass to the template. Timeouts, connection errors,
  408/429 and 5xx are retried with exponential back-off; another 4xx is the server rejecting the
  record (the command skips it or fails, by --on-error).
- `InProcessEngine`: the target loaded here, one replica per device, batched generation with a
  static KV cache, prompts sorted by length (regen/batched_generation.py). Image prompts go
  through the target's processor (its chat template, its image tokens and pixel inputs) to the
  wrapper loaded whole, one prompt a job.

Both yield one `Outcome` per conversation in input order, so the output does not depend on the
engine's concurrency; `None` now and then while waiting, so the caller can log progress.
"""

from __future__ import annotations

import copy
import itertools
import json
import random
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from http.client import HTTPException
from queue import SimpleQueue
from typing import Any

from dflash_async.data.formats import BadRecord, DataError
from dflash_async.data.images import (
    ImageTextSample,
    encode_rendered_prompt,
    has_images,
    image_conversation,
    inline_images,
    load_image,
    processor_template,
)
from dflash_async.eval.regenerate import (
    answers,
    generation_config,
    render_prompt,
    turns_to_generate,
)
from dflash_async.regen.batched_generation import GenerationPool
from dflash_async.regen.corpus import Conversation
from dflash_async.runtime.cpu_threads import cpu_threads
from dflash_async.usage import UsageError

_RETRIED_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_FATAL_STATUS = frozenset({401, 403})  # the server refuses us, not this record: stop the run
_ERROR_TEXT_CHARS = 300
_MAX_BACKOFF_S = 30.0


@dataclass(frozen=True)
class Sampling:
    """What both engines generate with; all of it is part of the output's identity."""

    max_new_tokens: int
    greedy: bool = True
    temperature: float = 1.0
    seed: int = 0
    turns: str = "all"
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)  # enable_thinking included


@dataclass(frozen=True)
class Outcome:
    """A conversation's answer: the regenerated record, or None and why the server refused it."""

    conversation: Conversation
    record: dict[str, Any] | None
    new_tokens: int = 0
    error: str | None = None


class RecordRejected(Exception):
    """The server answered this record with a client error (too long, malformed...)."""


class ServerError(RuntimeError):
    """The server failed past the retries, or refuses every request (exit 1)."""


class InProcessEngine:
    """The target in this process: a `GenerationPool` (regen/batched_generation.py) of one replica per
    device, fed windows of conversations; `batch_size` None: as large as fits. `processor`: the
    target's (AutoProcessor), needed for image records, whose models are the wrapper whole.

    A window is `window_batches` batches per device of conversations; its turns are generated
    round by round (round r: the r-th chosen turn of each conversation, given the earlier ones as
    regenerated), each round's prompts sorted by length across the window, and its outcomes come
    out in input order once its last round is done (a kill redoes at most the window in flight).
    """

    def __init__(
        self,
        models: Sequence[Any],
        tokenizer: Any,
        *,
        sampling: Sampling,
        batch_size: int | None,
        compile: bool | None = None,
        window_batches: int = 4,
        tick_s: float = 1.0,
        processor: Any = None,
    ) -> None:
        s = sampling
        self.tokenizer, self.sampling, self.processor = tokenizer, sampling, processor
        config = generation_config(
            models[0],
            tokenizer,
            max_new_tokens=s.max_new_tokens,
            greedy=s.greedy,
            temperature=s.temperature,
        )
        self.pool = GenerationPool(
            models,
            config=config,
            batch_size=batch_size,
            compile=compile,
            seed=s.seed,
            tick_s=tick_s,
        )
        self.window_batches = window_batches
        # the positions the model was trained for: answers past them are warned about
        text = getattr(models[0].config, "text_config", None) or models[0].config
        self.context: int | None = getattr(text, "max_position_embeddings", None)
        self._warnings: list[dict[str, Any]] = []
        # on the CPU one intra-op thread decodes several times faster (cpu_threads says why)
        on_cpu = any(r.device.type == "cpu" for r in self.pool.replicas)
        self.threads = 1 if on_cpu else None

    def progress(self) -> dict[str, int]:
        """Work done so far, for the progress line: tokens decoded (mid-batch included)."""
        return {"tokens_decoded": self.pool.tokens_decoded}

    def take_warnings(self) -> list[dict[str, Any]]:
        """The warnings found since the last call (prompts whose answers may run past the
        model's context), each the fields of one log event."""
        found, self._warnings = self._warnings, []
        return found

    def _check_context(self, rows: list[list[int]]) -> None:
        max_new = self.sampling.max_new_tokens
        if self.context is None:
            return
        over = [len(row) for row in rows if len(row) + max_new > self.context]
        if over:
            self._warnings.append(
                {
                    "prompts": len(over),
                    "of_prompts": len(rows),
                    "longest_prompt": max(over),
                    "max_new_tokens": max_new,
                    "context": self.context,
                    "hint": f"prompt + --max-new-tokens {max_new} exceeds the model's "
                    f"{self.context}-token context (max_position_embeddings): an answer that "
                    "long runs past the positions the model was trained on; lower "
                    "--max-new-tokens",
                }
            )

    def _window_size(self) -> int:
        plan = self.pool.plan  # none before the first window: a guess of what fits
        batch = plan.batch if plan is not None else self.pool.batch_size or 64
        return self.window_batches * batch * len(self.pool.replicas)

    def outcomes(self, conversations: Iterable[Conversation]) -> Iterator[Outcome | None]:
        source = iter(conversations)
        with cpu_threads(self.threads), self.pool:
            while window := list(itertools.islice(source, self._window_size())):
                yield from self._window(window)

    def _window(self, window: list[Conversation]) -> Iterator[Outcome | None]:
        s, tokenizer = self.sampling, self.tokenizer
        records = [copy.deepcopy(c.record) for c in window]
        chosen = [turns_to_generate(r["messages"], s.turns) for r in records]
        tokens = [0] * len(records)
        for round_ in range(max((len(t) for t in chosen), default=0)):
            jobs = [(n, t[round_]) for n, t in enumerate(chosen) if len(t) > round_]
            text_jobs, image_jobs = [], []
            for n, i in jobs:
                pictured = has_images({"messages": records[n]["messages"][:i]})
                (image_jobs if pictured else text_jobs).append((n, i))
            prompts = [
                render_prompt(tokenizer, records[n]["messages"][:i], s.template_kwargs)
                for n, i in text_jobs
            ]
            # no special tokens added: the template has them
            rows = tokenizer(prompts, add_special_tokens=False)["input_ids"] if prompts else []
            images = [
                self._image_prompt(window[n], records[n]["messages"][:i]) for n, i in image_jobs
            ]
            self._check_context([*rows, *(p.input_ids for p in images)])
            new_ids = yield from self.pool.generate(rows)
            new_ids += yield from self.pool.generate_images(images)
            for (n, index), (text, _, count) in zip(
                text_jobs + image_jobs, answers(new_ids, tokenizer, self.pool.config), strict=True
            ):
                records[n]["messages"][index] = {"role": "assistant", "content": text}
                tokens[n] += count
        for conversation, record, count in zip(window, records, tokens, strict=True):
            yield Outcome(conversation, record, count)

    def _image_prompt(self, conversation: Conversation, messages: list[dict]) -> ImageTextSample:
        """The conversation so far with its images, as the target reads it: rendered by the
        processor's chat template (with the run's template kwargs), then expanded and encoded
        by the processor. DataError naming the record for an image that cannot be read."""
        if self.processor is None:
            raise DataError(f"{conversation.where}: image records need the target's processor")
        try:
            parts, sources = image_conversation({"messages": messages}, root=None)
            pictures = [load_image(source, None) for source in sources]
        except BadRecord as error:
            raise DataError(f"{conversation.where}: {error}") from None
        template = {
            "chat_template": processor_template(self.processor),
            **self.sampling.template_kwargs,
        }
        text = render_prompt(self.tokenizer, parts, template)
        return encode_rendered_prompt(self.processor, text, pictures)


def completions_url(server: str) -> str:
    """`http://host:port`, `.../v1` or the full endpoint -> the chat completions endpoint."""
    base = server.rstrip("/").removesuffix("/chat/completions").removesuffix("/v1")
    return f"{base}/v1/chat/completions"


class ServerEngine:
    """An OpenAI-compatible server; see the module docstring."""

    def __init__(
        self,
        url: str,
        *,
        model: str,
        sampling: Sampling,
        concurrency: int,
        timeout_s: float,
        retries: int,
        backoff_s: float = 0.5,
        tick_s: float = 1.0,
    ) -> None:
        self.url, self.model, self.sampling = completions_url(url), model, sampling
        self.concurrency, self.timeout_s, self.retries = concurrency, timeout_s, retries
        self.backoff_s, self.tick_s = backoff_s, tick_s

    @staticmethod
    def served_model(url: str, *, timeout_s: float) -> str:
        """The first model the server lists (`--model` left out); UsageError (exit 2, before any
        work) when it cannot be reached: a wrong URL is the user's to fix."""
        models_url = completions_url(url).removesuffix("/chat/completions") + "/models"
        try:
            with urllib.request.urlopen(models_url, timeout=timeout_s) as response:
                listed = json.loads(response.read())["data"]
            return str(listed[0]["id"])
        except (OSError, HTTPException, ValueError, KeyError, IndexError, TypeError) as error:
            raise UsageError(f"--server {url!r}: cannot list its models ({error})") from None

    def _payload(self, conversation: Conversation, messages: list[dict[str, Any]]) -> bytes:
        s = self.sampling
        body = {
            "model": self.model,
            "messages": inline_images(messages),  # the server cannot read this machine's files
            "max_tokens": s.max_new_tokens,
            "temperature": 0.0 if s.greedy else s.temperature,
            "top_p": 1.0,
            "n": 1,
            "stream": False,
            "seed": s.seed + conversation.number,  # per record: the same answer when resumed
            "chat_template_kwargs": dict(s.template_kwargs),
        }
        return json.dumps(body, ensure_ascii=False).encode()

    def _post(self, payload: bytes) -> dict[str, Any]:
        """One completion, retried on transient failures; RecordRejected / ServerError."""
        for attempt in range(self.retries + 1):
            request = urllib.request.Request(
                self.url, data=payload, headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as error:
                text = error.read()[:_ERROR_TEXT_CHARS].decode(errors="replace")
                why = f"HTTP {error.code}: {text}"
                if error.code in _FATAL_STATUS:
                    raise ServerError(f"{self.url}: {why}") from None
                if error.code not in _RETRIED_STATUS:
                    raise RecordRejected(why) from None
            except (OSError, HTTPException, ValueError) as error:  # refused, reset, timeout, JSON
                why = f"{type(error).__name__}: {error}"
            if attempt < self.retries:
                delay = min(_MAX_BACKOFF_S, self.backoff_s * 2**attempt)
                time.sleep(delay * random.uniform(1.0, 1.25))  # jitter: workers do not march
        raise ServerError(f"{self.url}: failed {self.retries + 1} times, last: {why}")

    def answer(self, conversation: Conversation) -> Outcome:
        """The conversation with its chosen turns answered in order by the server."""
        record = json.loads(json.dumps(conversation.record, default=str))  # a deep copy
        messages, tokens = record["messages"], 0
        for index in turns_to_generate(messages, self.sampling.turns):
            try:
                reply = self._post(self._payload(conversation, messages[:index]))
                message, used = _reply_message(reply)
            except RecordRejected as error:
                return Outcome(conversation, None, tokens, str(error))
            messages[index], tokens = message, tokens + used
        return Outcome(conversation, record, tokens)

    def outcomes(self, conversations: Iterable[Conversation]) -> Iterator[Outcome | None]:
        """Answers in input order from `concurrency` daemon threads (daemon: a signal's exit
        does not wait for requests in flight), at most 2 x concurrency conversations ahead."""
        jobs: SimpleQueue[tuple[Conversation, Future] | None] = SimpleQueue()
        workers = [
            threading.Thread(target=self._work, args=(jobs,), daemon=True)
            for _ in range(self.concurrency)
        ]
        for worker in workers:
            worker.start()
        pending: deque[Future] = deque()
        source = iter(conversations)
        try:
            while True:
                while len(pending) < 2 * self.concurrency:
                    conversation = next(source, None)
                    if conversation is None:
                        break
                    pending.append(future := Future())
                    jobs.put((conversation, future))
                if not pending:
                    return
                try:
                    outcome = pending[0].result(timeout=self.tick_s)
                except FutureTimeout:
                    yield None  # still waiting: a chance for the caller's progress line
                    continue
                pending.popleft()
                yield outcome
        finally:
            for future in pending:
                future.cancel()
            for _ in workers:
                jobs.put(None)

    def _work(self, jobs: SimpleQueue[tuple[Conversation, Future] | None]) -> None:
        while (job := jobs.get()) is not None:
            conversation, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self.answer(conversation))
            except BaseException as error:  # handed to the main thread, which raises it
                future.set_exception(error)


def _reply_message(reply: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """(the assistant message to store, completion tokens) from a chat completion."""
    try:
        message = reply["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        raise ServerError(
            f"not a chat completion: {json.dumps(reply)[:_ERROR_TEXT_CHARS]}"
        ) from None
    out: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
    # vLLM/SGLang with a reasoning parser return the thinking apart ("reasoning" in newer vLLM)
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:
        out["reasoning_content"] = reasoning
    usage = reply.get("usage") or {}
    return out, int(usage.get("completion_tokens") or 0)
