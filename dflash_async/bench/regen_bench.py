"""`python -m dflash_async bench regen`: in-process regeneration throughput on one device, today's
HF path against the batched static-cache engine of `regenerate --target` (regen/batched_generation.py).

The target: a public shape (`target_shapes.shape_configs()`, default qwen3-8b) with random weights
built in memory on the GPU in bf16, or `--shape tiny`, a small fp32 Qwen3 that runs on the CPU in
seconds (to check the benchmark end to end, not to measure). The work: --prompts prompts of
random token ids with chat-like lengths (lognormal around --prompt-tokens, from 1/8 of it to 4x),
each generating exactly --max-new-tokens (min_new_tokens = max_new_tokens: random weights would
hit the eos anywhere), greedy. Rows, in this order:

(a) `hf_generate`: today's path (eval/regenerate.py before the engine), HF `generate` with its
    dynamic cache, batches of --baseline-batch (32) prompts sorted by length, measured on
    --baseline-batches (1) batches of a random sample of the prompts (its tokens/s does not depend
    on how many batches; its time does: ~30-60 s a batch on an H200), after one small untimed call;
(b) `static_batched`: `GenerationPool`, one replica, the batch as large as fits (or
    --batch-size), decode compiled on a GPU; an untimed warm-up of 16 new tokens in the same
    shape (the compile: `warmup_s`), then all the prompts timed, prefill included (the default
    400 prompts are ~2 batches of what fits Qwen3-8B's cache on an H200).

Stdout: one JSON line per row (generated tokens, seconds, tokens/s, batch, cache length), then a
`summary` line with the ratio (b)/(a); stderr: the table. On an H200 (qwen3-8b, the defaults) the
whole run is meant to take under ~4 minutes: building the model, (a) ~30-60 s, the compile, (b).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, GenerationConfig, PretrainedConfig, Qwen3Config

from dflash_async.bench.target_shapes import shape_configs
from dflash_async.eval.regenerate import generate_ids
from dflash_async.regen.batched_generation import GenerationPool, run_to_end
from dflash_async.runtime.cpu_threads import cpu_threads
from dflash_async.usage import ArgumentParser, positive_int, require_cuda

_WARMUP_NEW_TOKENS = 16
_TINY = {"prompts": 48, "max_new_tokens": 32, "prompt_tokens": 40}
_GPU = {"prompts": 400, "max_new_tokens": 512, "prompt_tokens": 400}  # (b): ~2 batches


def _tiny_config() -> PretrainedConfig:
    return Qwen3Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        max_position_embeddings=4096,
    )


def build_target(shape: str, device: torch.device, *, seed: int = 0) -> Any:
    """Random weights of `shape`, built on `device` (bf16 on a GPU, fp32 on the CPU)."""
    config = _tiny_config() if shape == "tiny" else shape_configs()[shape][0]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval().requires_grad_(False)


def chat_prompts(n: int, mean_tokens: int, vocab: int, *, seed: int = 0) -> list[list[int]]:
    """n prompts of random ids, lognormal lengths around mean_tokens, clipped to [mean/8, 4 mean]."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(mean_tokens), 0.6, n), mean_tokens // 8, 4 * mean_tokens)
    return [rng.integers(1, vocab, int(length)).tolist() for length in lengths]


def _config(max_new_tokens: int, vocab: int) -> GenerationConfig:
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=vocab - 1,
        pad_token_id=0,
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_generate_row(model: Any, prompts: list[list[int]], options: Any) -> dict[str, Any]:
    """(a): today's path on a sample of the prompts (see the module docstring)."""
    device, vocab = model.device, model.config.vocab_size
    rng = np.random.default_rng(1)
    count = min(len(prompts), options.baseline_batch * options.baseline_batches)
    sample = [prompts[i] for i in rng.choice(len(prompts), count, replace=False)]
    sample.sort(key=len, reverse=True)  # today's path sorts longest first too
    generate_ids(model, [p[:8] for p in sample[:2]], _config(4, vocab))  # cuBLAS, allocator
    _sync(device)
    started, tokens = time.perf_counter(), 0
    config = _config(options.max_new_tokens, vocab)
    for lo in range(0, len(sample), options.baseline_batch):
        tokens += sum(
            map(len, generate_ids(model, sample[lo : lo + options.baseline_batch], config))
        )
    _sync(device)
    seconds = time.perf_counter() - started
    return {
        "row": "hf_generate",
        "cache": "dynamic",
        "batch": options.baseline_batch,
        "prompts": len(sample),
        "new_tokens": tokens,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(tokens / seconds, 1),
    }


def static_batched_row(model: Any, prompts: list[list[int]], options: Any) -> dict[str, Any]:
    """(b): the engine's pool, warmed up in the measured shape, then every prompt timed."""
    device, vocab = model.device, model.config.vocab_size
    if device.type == "cuda":
        torch.cuda.empty_cache()  # (a)'s cached blocks back: the pool measures the free memory
        torch.cuda.reset_peak_memory_stats(device)
    config = _config(options.max_new_tokens, vocab)
    pool = GenerationPool([model], config=config, batch_size=options.batch_size)
    plan = pool.plan_for(max(map(len, prompts)))
    longest = sorted(prompts, key=len, reverse=True)[: plan.batch]
    with pool:
        pool.config.max_new_tokens = pool.config.min_new_tokens = _WARMUP_NEW_TOKENS  # same shape
        started = time.perf_counter()
        run_to_end(pool.generate(longest))
        _sync(device)
        warmup = time.perf_counter() - started
        pool.config.max_new_tokens = pool.config.min_new_tokens = options.max_new_tokens
        started = time.perf_counter()
        new_ids = run_to_end(pool.generate(prompts))
        _sync(device)
        seconds = time.perf_counter() - started
    assert pool.plan == plan, (pool.plan, plan)  # one shape: nothing recompiled in the timing
    tokens = sum(map(len, new_ids))
    memory = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    return {
        "row": "static_batched",
        "cache": "static",
        "batch": plan.batch,
        "cache_len": plan.cache_len,
        "compiled": pool.compile,
        "compile_mode": pool.config.compile_config.mode if pool.compile else None,
        "prompts": len(prompts),
        "batches": -(-len(prompts) // plan.batch),
        "new_tokens": tokens,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(tokens / seconds, 1),
        "warmup_s": round(warmup, 1),
        "max_memory_gib": round(memory, 1),
    }


def main(argv: list[str] | None = None) -> None:
    """bench regen [--shape qwen3-8b|tiny] [--prompts N] [--max-new-tokens M] ...: JSON lines on
    stdout, the table on stderr; a GPU shape without CUDA is a UsageError (exit 2)."""
    parser = ArgumentParser(prog="python -m dflash_async bench regen")
    parser.add_argument("--shape", default="qwen3-8b", choices=[*shape_configs(), "tiny"])
    parser.add_argument("--device", default=None, help="default: cuda:0 (tiny: cpu)")
    parser.add_argument("--prompts", type=positive_int, default=None, help="(b)'s prompts")
    parser.add_argument("--max-new-tokens", type=positive_int, default=None)
    parser.add_argument("--prompt-tokens", type=positive_int, default=None, help="mean length")
    parser.add_argument("--baseline-batch", type=positive_int, default=32)
    parser.add_argument("--baseline-batches", type=positive_int, default=1)
    parser.add_argument("--batch-size", type=positive_int, default=None, help="(b): default fit")
    options = parser.parse_args(argv)
    defaults = _TINY if options.shape == "tiny" else _GPU
    for key, value in defaults.items():
        if getattr(options, key) is None:
            setattr(options, key, value)
    device = torch.device(options.device or ("cpu" if options.shape == "tiny" else "cuda:0"))
    if device.type == "cuda" or options.shape != "tiny":
        require_cuda("bench regen", str(device))
    started = time.perf_counter()
    model = build_target(options.shape, device)
    prompts = chat_prompts(options.prompts, options.prompt_tokens, model.config.vocab_size)
    setup = {
        "row": "setup",
        "shape": options.shape,
        "device": str(device),
        "prompts": len(prompts),
        "mean_prompt_tokens": round(float(np.mean([len(p) for p in prompts])), 1),
        "max_prompt_tokens": max(map(len, prompts)),
        "max_new_tokens": options.max_new_tokens,
        "build_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(setup), flush=True)
    with cpu_threads(1 if device.type == "cpu" else None):  # cpu_threads says why
        rows = [hf_generate_row(model, prompts, options)]
        print(json.dumps(rows[-1]), flush=True)
        rows.append(static_batched_row(model, prompts, options))
        print(json.dumps(rows[-1]), flush=True)
    ratio = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
    summary = {
        "row": "summary",
        "speedup": round(ratio, 2),
        "goal": 5.0,
        "total_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(summary), flush=True)
    table = [
        f"{options.shape} on {device}: {len(prompts)} prompts (mean {setup['mean_prompt_tokens']}"
        f" tokens), {options.max_new_tokens} new tokens each, greedy",
        f"{'row':<16}{'cache':<9}{'batch':>6}{'prompts':>8}{'new tokens':>11}{'s':>8}"
        f"{'tokens/s':>11}",
    ]
    for r in rows:
        table.append(
            f"{r['row']:<16}{r['cache']:<9}{r['batch']:>6}{r['prompts']:>8}"
            f"{r['new_tokens']:>11}{r['seconds']:>8}{r['tokens_per_s']:>11}"
        )
    table.append(
        f"speedup {ratio:.2f}x (goal >= 5x); (b) warm-up/compile "
        f"{rows[1]['warmup_s']} s, total {summary['total_s']} s"
    )
    print("\n".join(table), file=sys.stderr)  # stdout holds only the JSON lines
