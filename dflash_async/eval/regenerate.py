"""The in-process generation core of regeneration: `model.generate` over conversations in memory.

A drafter is trained to predict what ITS target would say, so the training answers should be the
target's own (docs/DFLASH.md s.5). This module owns the HF path: left-padded batches sorted by
prompt length (less padding) through `model.generate`, turn selection, and the cached demo corpus.
The `regenerate` command (files, shards, resume, the server engine) is `dflash_async/regen/`.

Which turns: `turns="all"` (the default) regenerates EVERY assistant turn, in order, each given the
previously regenerated turns (round r generates the r-th turn of every conversation that has one),
so a later turn never answers an earlier answer that the target did not write; `turns="last"`
regenerates only the last one, given the original history (one generation per conversation). A
conversation ending with a user turn (or a tool result) gets a new assistant turn. Assistant turns
carrying `tool_calls` are kept verbatim (the tool results that follow them answer those exact
calls).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import structlog
import torch
from transformers import GenerationConfig, PreTrainedModel

from dflash_async.atomic import atomic_file
from dflash_async.data.formats import ASSISTANT_TURNS as TURNS
from dflash_async.log import progress
from dflash_async.runtime.cpu_threads import cpu_threads
from dflash_async.targets.loading import load_target, load_target_tokenizer
from dflash_async.targets.tiny import TINY_SEED, demo_prompts

_ROLES = ("system", "user", "assistant", "tool")
_HASH_WHOLE_FILE_BELOW = 64 * 2**20  # bytes; bigger files are keyed by name, size and mtime
_DEMO_CORPUS_VERSION = "1"  # bump when the demo corpus recipe changes


def _checked_conversation(record: Any, where: str) -> dict[str, Any]:
    """A deep copy of `record` ({"messages": [...], other keys kept}); ValueError naming `where`."""
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: expected an object with a non-empty 'messages' list")
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in _ROLES:
            raise ValueError(f"{where}: messages[{i}] has role {role!r}, expected one of {_ROLES}")
    if not any(m["role"] == "user" for m in messages):
        raise ValueError(f"{where}: no user message to answer")
    return copy.deepcopy(record)


def turns_to_generate(messages: list[dict[str, Any]], turns: str = "all") -> list[int]:
    """Indices of the assistant turns to (re)generate: those after the first user turn, without
    tool calls (`turns="last"`: the last of them only). Appends an empty assistant turn when the
    last turn is a user's or a tool's."""
    if turns not in TURNS:
        raise ValueError(f"turns={turns!r} must be one of {TURNS}")
    if messages[-1]["role"] in ("user", "tool"):
        messages.append({"role": "assistant", "content": ""})
    first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
    indices = [
        i
        for i, m in enumerate(messages)
        if m["role"] == "assistant" and not m.get("tool_calls") and i > first_user
    ]
    return indices[-1:] if turns == "last" else indices


def generation_config(
    model: PreTrainedModel,
    tokenizer: Any,
    *,
    max_new_tokens: int,
    greedy: bool,
    temperature: float,
) -> GenerationConfig:
    """The model's own generation config (eos ids, suppressed tokens...) with our overrides."""
    config = copy.deepcopy(model.generation_config)
    config.max_new_tokens = max_new_tokens
    config.max_length = None
    config.do_sample = not greedy
    if greedy:  # unset the sampling knobs so transformers does not warn they are ignored
        config.temperature = config.top_p = config.top_k = None
    else:
        config.temperature = temperature
    if config.eos_token_id is None:
        config.eos_token_id = tokenizer.eos_token_id
    if config.pad_token_id is None:  # left padding is masked: any id will do
        pad = tokenizer.pad_token_id
        config.pad_token_id = pad if pad is not None else min(_eos_ids(config), default=0)
    return config


def _eos_ids(config: GenerationConfig) -> set[int]:
    eos = config.eos_token_id
    return {eos} if isinstance(eos, int) else set(eos or ())


def _answer(new_ids: list[int], tokenizer: Any, eos_ids: set[int]) -> tuple[str, bool, int]:
    """(text up to the first eos, whether an eos ended it, tokens generated including the eos)."""
    stop = next((i for i, t in enumerate(new_ids) if t in eos_ids), None)
    kept = new_ids if stop is None else new_ids[:stop]
    count = len(new_ids) if stop is None else stop + 1
    return tokenizer.decode(kept, skip_special_tokens=True), stop is not None, count


def _left_padded(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [B, S], attention_mask [B, S]) with the padding on the left of each row.

    Padded by hand: many tokenizers (Llama's) have no pad token, and we must not modify theirs.
    """
    width = max(len(r) for r in rows)
    input_ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return input_ids, mask


def generate_ids(
    model: PreTrainedModel, rows: list[list[int]], config: GenerationConfig, **generate_kwargs: Any
) -> list[list[int]]:
    """The new ids of each prompt (left-padded together, one `model.generate`), eos and the
    padding after it included; `generate_kwargs` (a cache, stopping criteria) go to generate."""
    device = next(model.parameters()).device
    input_ids, mask = _left_padded(rows, config.pad_token_id)
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids.to(device),
            attention_mask=mask.to(device),
            generation_config=config,
            **generate_kwargs,
        )
    # Sync point: the generated ids come back to the host to be decoded.
    return out[:, input_ids.shape[1] :].tolist()


def answers(
    new_ids: list[list[int]], tokenizer: Any, config: GenerationConfig
) -> list[tuple[str, bool, int]]:
    """(answer text, ended by eos, new tokens including the eos) of each row of `generate_ids`."""
    eos_ids = _eos_ids(config)
    return [_answer(row, tokenizer, eos_ids) for row in new_ids]


def _generate_batch(
    model: PreTrainedModel,
    tokenizer: Any,
    rows: list[list[int]],
    config: GenerationConfig,
) -> list[tuple[str, bool, int]]:
    """Generate for one batch of prompt ids: (answer text, ended by eos, new tokens) each."""
    return answers(generate_ids(model, rows, config), tokenizer, config)


def render_prompt(
    tokenizer: Any, messages: list[dict[str, Any]], template_kwargs: Mapping[str, Any]
) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **template_kwargs
    )


def regenerate(
    model: PreTrainedModel,
    tokenizer: Any,
    conversations: Sequence[dict[str, Any]],
    *,
    max_new_tokens: int,
    batch_size: int,
    greedy: bool = True,
    temperature: float = 1.0,
    seed: int = 0,
    enable_thinking: bool = False,
    turns: str = "all",
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """The conversations with their assistant turns written by `model` (see the module docstring).

    Returns new records ({"messages": [...]} plus the input's other keys), in input order. Greedy
    by default; sampling is seeded (the global RNG state is restored afterwards). A turn that hit
    `max_new_tokens` is kept as it is (truncated). `template_kwargs` go to the chat template
    besides `enable_thinking`. Raises ValueError naming a malformed record. Logs one
    `regenerate_completed` event.
    """
    start = time.perf_counter()
    records, stats = regenerate_with_stats(
        model,
        tokenizer,
        conversations,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        greedy=greedy,
        temperature=temperature,
        seed=seed,
        turns=turns,
        show_progress=True,
        template_kwargs={"enable_thinking": enable_thinking, **(template_kwargs or {})},
    )
    seconds = time.perf_counter() - start
    totals = {key: (sum(v) if isinstance(v, list) else v) for key, v in stats.items()}
    structlog.get_logger().info(
        "regenerate_completed",
        conversations=len(records),
        **totals,
        seconds=round(seconds, 3),
        new_tokens_per_s=round(totals["new_tokens"] / max(seconds, 1e-9), 1),
    )
    return records


def regenerate_with_stats(
    model: PreTrainedModel,
    tokenizer: Any,
    conversations: Sequence[dict[str, Any]],
    *,
    max_new_tokens: int,
    batch_size: int,
    greedy: bool,
    temperature: float,
    seed: int,
    turns: str,
    template_kwargs: Mapping[str, Any],
    show_progress: bool = False,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """`regenerate` without its log event: (records, {"turns", "truncated_turns": totals,
    "new_tokens": [per record]}). `template_kwargs` are all the chat template's extra arguments.
    """
    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError(
            f"max_new_tokens={max_new_tokens} and batch_size={batch_size} must be >= 1"
        )
    records = [_checked_conversation(c, f"conversation {i}") for i, c in enumerate(conversations)]
    chosen = [turns_to_generate(r["messages"], turns) for r in records]
    config = generation_config(
        model, tokenizer, max_new_tokens=max_new_tokens, greedy=greedy, temperature=temperature
    )
    stats: dict[str, Any] = {"turns": 0, "new_tokens": [0] * len(records), "truncated_turns": 0}
    with nullcontext() if greedy else _seeded(seed, next(model.parameters()).device):
        for round_ in range(max((len(t) for t in chosen), default=0)):
            jobs = [(n, t[round_]) for n, t in enumerate(chosen) if len(t) > round_]
            _run_round(
                model,
                tokenizer,
                records,
                jobs,
                config,
                batch_size=batch_size,
                template_kwargs=template_kwargs,
                stats=stats,
                show_progress=show_progress,
            )
    return records, stats


def _run_round(
    model: PreTrainedModel,
    tokenizer: Any,
    records: list[dict[str, Any]],
    jobs: list[tuple[int, int]],
    config: GenerationConfig,
    *,
    batch_size: int,
    template_kwargs: Mapping[str, Any],
    stats: dict[str, Any],
    show_progress: bool,
) -> None:
    """Fill the assistant turn `index` of each (record number, index), longest prompts first."""
    prompts = [
        render_prompt(tokenizer, records[n]["messages"][:i], template_kwargs) for n, i in jobs
    ]
    rows = tokenizer(prompts, add_special_tokens=False)["input_ids"]  # the template has them
    order = sorted(range(len(jobs)), key=lambda j: -len(rows[j]))  # similar lengths together
    starts = range(0, len(order), batch_size)
    shown = (
        progress(starts, total=len(starts), task="regenerate (batches)")
        if show_progress
        else starts
    )
    for lo in shown:
        chunk = order[lo : lo + batch_size]
        results = _generate_batch(model, tokenizer, [rows[j] for j in chunk], config)
        for j, (text, stopped, count) in zip(chunk, results, strict=True):
            n, index = jobs[j]
            records[n]["messages"][index] = {"role": "assistant", "content": text}
            stats["turns"] += 1
            stats["new_tokens"][n] += count
            stats["truncated_turns"] += not stopped


@contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Seed sampling without leaking the seed: the CPU (and this GPU's) RNG state is restored."""
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def write_jsonl(records: Iterable[dict[str, Any]], path: str | os.PathLike[str]) -> Path:
    """Write one JSON object per line to `path` atomically (temporary file, fsync, rename)."""
    with atomic_file(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return Path(path)


def _folder_digest(folder: Path) -> str:
    """A content hash of a model folder (large files by name, size and mtime only)."""
    digest = hashlib.blake2b(digest_size=8)
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        stat = file.stat()
        digest.update(f"{file.relative_to(folder)}:{stat.st_size}".encode())
        if stat.st_size < _HASH_WHOLE_FILE_BELOW:
            digest.update(file.read_bytes())
        else:
            digest.update(str(stat.st_mtime_ns).encode())
    return digest.hexdigest()


def demo_corpus(
    cache_dir: str | os.PathLike[str],
    target_path: str | os.PathLike[str],
    n_train: int,
    *,
    max_new_tokens: int = 64,
    batch_size: int = 64,
    seed: int = TINY_SEED,
) -> Path:
    """The built-in demo data: `n_train` demo prompts answered greedily by the target on the CPU.

    Cached as `cache_dir/demo-corpus-<hash>.jsonl`, keyed by the target folder's content, the
    prompts and the generation settings, so the demo drafter always learns its target's answers.
    Cost with the tiny target (measured on 2 cores that other jobs kept busy, load 4 to 9):
    300 prompts x 64 new tokens in 7-15 s, plus ~1 s to load; a cached corpus returns at once.
    """
    prompts = demo_prompts(n_train, seed, split="train")
    key = hashlib.blake2b(digest_size=8)
    for part in (_DEMO_CORPUS_VERSION, _folder_digest(Path(target_path)), json.dumps(prompts)):
        key.update(part.encode())
    key.update(f"{max_new_tokens}:{batch_size}".encode())
    path = Path(cache_dir) / f"demo-corpus-{key.hexdigest()}.jsonl"
    if path.is_file():
        return path
    model = load_target(target_path, device=torch.device("cpu"))
    tokenizer = load_target_tokenizer(target_path)
    with cpu_threads(1):
        records = regenerate(
            model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size
        )
    return write_jsonl(records, path)
