"""regen/batched_generation.py, the in-process engine's generation: batches of a static KV cache, prompts
sorted by length, one worker thread per replica; on the CPU (fp32) its greedy answers equal the
one-at-a-time HF path token for token, prompts of very different lengths in one batch included;
the batch-size arithmetic; errors and a close stop the threads (nothing hangs)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import CompileConfig, Qwen3Config

import dflash_async.regen.batched_generation as batched
import dflash_async.regen.cache_attention as attention
from dflash_async.eval.regenerate import generate_ids, generation_config, regenerate, render_prompt
from dflash_async.regen.batched_generation import (
    GenerationPool,
    fit_batch,
    kv_bytes_per_token,
    row_bytes,
    run_to_end,
)
from dflash_async.regen.cache_attention import gqa_attention
from dflash_async.regen.corpus import Conversation
from dflash_async.regen.engines import InProcessEngine, Sampling
from dflash_async.targets.loading import load_target, load_target_tokenizer
from dflash_async.targets.tiny import ensure_tiny_target

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_intra_op_thread")]
MAX_NEW = 24
# very different lengths (a few tokens to ~200), in no particular order
TEXTS = [
    "Hi.",
    "Repeat after me: " + " ".join(["red cat blue dog lion"] * 40),
    "What is 2 plus 3?",
    "List 4 fruits, one per line. " * 8,
    "Spell the word cat.",
    "Count from one to ten. " * 3,
]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_target(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny(tiny_folder: Path) -> tuple[Any, Any]:
    return load_target(tiny_folder, device=torch.device("cpu")), load_target_tokenizer(tiny_folder)


def _rows(tokenizer: Any) -> list[list[int]]:
    prompts = [render_prompt(tokenizer, [{"role": "user", "content": t}], {}) for t in TEXTS]
    return tokenizer(prompts, add_special_tokens=False)["input_ids"]


def _config(model: Any, tokenizer: Any) -> Any:
    return generation_config(model, tokenizer, max_new_tokens=MAX_NEW, greedy=True, temperature=1)


def _one_at_a_time(model: Any, tokenizer: Any, rows: list[list[int]]) -> list[list[int]]:
    """Today's HF path, each prompt alone (no padding), dynamic cache."""
    return [generate_ids(model, [row], _config(model, tokenizer))[0] for row in rows]


def _until_eos(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def test_batched_static_cache_greedy_ids_equal_one_prompt_at_a_time(
    tiny: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tokenizer = tiny
    rows = _rows(tokenizer)
    assert max(map(len, rows)) > 10 * min(map(len, rows))  # very different lengths
    expected = _one_at_a_time(model, tokenizer, rows)
    assert any(len(_until_eos(e, tokenizer.eos_token_id)) == MAX_NEW for e in expected)
    decode_steps = []

    def counted(module: Any, query: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        decode_steps.append(query.shape[2] == 1)
        return gqa_attention(module, query, *args, **kwargs)

    monkeypatch.setattr(attention, "gqa_attention", counted)
    with GenerationPool([model], config=_config(model, tokenizer), batch_size=4) as pool:
        got = run_to_end(pool.generate(rows))  # batches [longest 4], [the other 2]
    assert sum(decode_steps) > MAX_NEW  # the decode steps went through regen/cache_attention.py
    assert model.config._attn_implementation == "sdpa"  # and the model is as it was
    eos = tokenizer.eos_token_id
    assert [_until_eos(g, eos) for g in got] == [_until_eos(e, eos) for e in expected]


def test_the_compiled_path_pads_the_last_batch_and_keeps_one_graph(tiny: tuple) -> None:
    """What a GPU runs (compile on, a short last batch filled up to the batch's shape), compiled
    here with dynamo's eager backend: the same ids, and one graph for every batch and step."""
    model, tokenizer = tiny
    rows = _rows(tokenizer)
    expected = _one_at_a_time(model, tokenizer, rows)
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    config = CompileConfig(backend="eager", dynamic=False)
    with GenerationPool(
        [model], config=_config(model, tokenizer), batch_size=4, compile=True, compile_config=config
    ) as pool:
        got = run_to_end(pool.generate(rows))
        got_again = run_to_end(pool.generate(rows[:3]))  # a shorter call: the same shape
    eos = tokenizer.eos_token_id
    assert [_until_eos(g, eos) for g in got] == [_until_eos(e, eos) for e in expected]
    assert got_again == got[:3]
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


def test_two_replicas_share_the_batches_and_answer_in_input_order(tiny: tuple) -> None:
    model, tokenizer = tiny
    rows = _rows(tokenizer) * 2
    alone = GenerationPool([model], config=_config(model, tokenizer), batch_size=2)
    with alone:
        expected = run_to_end(alone.generate(rows))
    pool = GenerationPool([model, model], config=_config(model, tokenizer), batch_size=2)
    with pool:
        assert run_to_end(pool.generate(rows)) == expected
        assert all(thread.is_alive() for thread in pool._threads)
        threads = list(pool._threads)
    assert not any(thread.is_alive() for thread in threads)


def test_the_engine_equals_the_one_at_a_time_regeneration_and_ticks_while_waiting(
    tiny: tuple,
) -> None:
    model, tokenizer = tiny
    records = [{"messages": [{"role": "user", "content": t}]} for t in TEXTS]
    records[2]["messages"] += [
        {"role": "assistant", "content": "old"},
        {"role": "user", "content": "And 4 plus 4?"},
    ]
    expected = regenerate(model, tokenizer, records, max_new_tokens=MAX_NEW, batch_size=1)
    conversations = [Conversation(n, f"in.jsonl:{n + 1}", r) for n, r in enumerate(records)]
    sampling = Sampling(max_new_tokens=MAX_NEW, template_kwargs={"enable_thinking": False})
    engine = InProcessEngine(
        [model], tokenizer, sampling=sampling, batch_size=4, window_batches=1, tick_s=0.001
    )
    outcomes = list(engine.outcomes(conversations))
    done = [o for o in outcomes if o is not None]
    assert [o.record for o in done] == expected  # windows of 4, then 2; every turn
    assert [o.conversation.number for o in done] == list(range(len(records)))
    assert None in outcomes  # the caller's progress line gets its chances


def test_an_error_in_a_worker_reaches_the_caller_and_the_threads_end(
    tiny: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tokenizer = tiny

    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError("generation failed")

    monkeypatch.setattr(batched, "generate_ids", fail)
    pool = GenerationPool([model, model], config=_config(model, tokenizer), batch_size=1)
    with pytest.raises(RuntimeError, match="generation failed"), pool:
        threads = list(pool._threads)
        run_to_end(pool.generate(_rows(tokenizer)))
    assert not any(thread.is_alive() for thread in threads)


def test_workers_that_died_fail_the_call_instead_of_hanging(
    tiny: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tokenizer = tiny
    monkeypatch.setattr(GenerationPool, "_work", lambda self, replica, jobs: None)  # ends at once
    pool = GenerationPool([model], config=_config(model, tokenizer), batch_size=2, tick_s=0.01)
    with pytest.raises(RuntimeError, match="every worker thread"), pool:
        run_to_end(pool.generate(_rows(tokenizer)))


def test_closing_mid_batch_stops_the_running_generate_at_its_next_step(tiny: tuple) -> None:
    model, tokenizer = tiny
    config = _config(model, tokenizer)
    config.max_new_tokens, config.min_new_tokens = 4000, 4000  # minutes on this CPU
    pool = GenerationPool([model], config=config, batch_size=2, tick_s=0.05)
    with pool:
        threads = list(pool._threads)
        steps = pool.generate(_rows(tokenizer)[:2])
        next(steps)  # running: the first tick
        steps.close()
        started = time.monotonic()
    assert time.monotonic() - started < 30
    assert not any(thread.is_alive() for thread in threads)


def test_the_batch_is_what_fits_in_the_free_memory() -> None:
    """Qwen3-8B in bf16: 144 KiB of K and V per token; 100 GiB for caches and activations."""
    config = Qwen3Config(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
    )
    kv = kv_bytes_per_token(config, torch.bfloat16)
    assert kv == 2 * 36 * 8 * 128 * 2 == 147456
    row = row_bytes(config, torch.bfloat16, prompt_len=1536, cache_len=2048)
    assert kv * 2048 < row < 2 * kv * 2048  # the cache, then the prefill of 1536 tokens
    rows = fit_batch(budget_bytes=100 * 2**30, row_bytes=row)
    assert rows % 8 == 0 and rows * row <= 100 * 2**30 < (rows + 8) * row
    assert 150 < rows < 300
    short = row_bytes(config, torch.bfloat16, prompt_len=32, cache_len=288)
    assert fit_batch(budget_bytes=100 * 2**30, row_bytes=short) == 1024  # the cap
    assert fit_batch(budget_bytes=row * 5, row_bytes=row) == 5
    assert fit_batch(budget_bytes=-1, row_bytes=row) == 0


def test_bench_regen_runs_end_to_end_on_the_cpu_with_the_tiny_shape(capsys) -> None:
    from dflash_async.bench.regen_bench import main

    main(["--shape", "tiny", "--prompts", "12", "--max-new-tokens", "4", "--baseline-batch", "4"])
    out, err = capsys.readouterr()
    rows = {row["row"]: row for row in map(json.loads, out.splitlines())}
    assert set(rows) == {"setup", "hf_generate", "static_batched", "summary"}
    assert rows["hf_generate"]["new_tokens"] == 4 * 4  # 1 batch of 4 prompts, every token
    assert rows["static_batched"]["new_tokens"] == 12 * 4
    assert rows["summary"]["speedup"] > 0 and "speedup" in err


def test_the_decode_attention_equals_hf_sdpa_without_repeating_the_cache() -> None:
    """One query row over a cache with left padding and an unfilled tail, 4 query heads on 2 KV
    heads: regen/cache_attention.py's grouped matmuls give HF sdpa's output (which repeats K and V)."""
    from types import SimpleNamespace

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from dflash_async.regen.cache_attention import gqa_attention

    generator = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(shape, generator=generator)
        for shape in ((3, 4, 1, 8), (3, 2, 10, 8), (3, 2, 10, 8))
    )
    mask = torch.ones(3, 1, 1, 10, dtype=torch.bool)
    mask[0, ..., :4] = False  # left padding
    mask[:, ..., 8:] = False  # the cache's unfilled tail
    module = SimpleNamespace(num_key_value_groups=2, is_causal=True, training=False)
    expected, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](module, q, k, v, mask, scaling=0.3)
    got, _ = gqa_attention(module, q, k, v, mask, scaling=0.3)
    assert got.shape == expected.shape == (3, 1, 4, 8)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(AssertionError):  # the masked keys matter: not a vacuous comparison
        torch.testing.assert_close(gqa_attention(module, q, k, v, mask | True, scaling=0.3)[0], got)


@pytest.mark.gpu
def test_on_a_gpu_the_compiled_pool_runs_in_its_thread_with_one_graph(tiny_folder: Path) -> None:
    """The GPU path as `regenerate` runs it: inductor in the worker thread (CUDA graphs from torch
    2.13 on), the tiny target in fp32 on cuda:0. GPU kernels differ by batch shape, so the ids are
    compared loosely with the one-at-a-time HF path: at least half of the rows the same."""
    from torch._dynamo.utils import counters

    model = load_target(tiny_folder, device=torch.device("cuda", 0))
    tokenizer = load_target_tokenizer(tiny_folder)
    rows = _rows(tokenizer)
    expected = _one_at_a_time(model, tokenizer, rows)
    torch._dynamo.reset()
    counters.clear()
    with GenerationPool([model], config=_config(model, tokenizer), batch_size=4) as pool:
        assert pool.compile
        got = run_to_end(pool.generate(rows))
        got_again = run_to_end(pool.generate(rows))
    assert got_again == got  # the same batches: the same ids
    assert counters["stats"]["unique_graphs"] == 1
    eos = tokenizer.eos_token_id
    got, expected = [_until_eos(g, eos) for g in got], [_until_eos(e, eos) for e in expected]
    same = sum(g == e for g, e in zip(got, expected, strict=True))
    assert same >= len(rows) / 2, (same, got, expected)
    torch._dynamo.reset()
