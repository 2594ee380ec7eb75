"""Acceptance length by speculative decoding: lossless, the accept rule, tau, export -> eval.

The target is tiny_decoding.py's tiny random Qwen3 (fp32, no download); drafters are real
DFlashDrafters (random) or oracles that know the target's greedy continuation.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import TinySpec, randomize_, tiny_config, tiny_drafter, tiny_target_weights
from structlog.testing import capture_logs
from target_kit import capture_features
from tiny_decoding import VOCAB, CharTokenizer, tiny_qwen3_target
from transformers import Qwen3Config

from dflash_async.checkpoint.export import export_drafter
from dflash_async.data.samples import DataError
from dflash_async.eval import evaluation, harness
from dflash_async.eval.harness import (
    check_drafter_fits_target,
    evaluate,
    load_drafter,
    main,
    prompt_token_ids,
    run_eval,
)
from dflash_async.eval.lossless import GreedyResult, LosslessError, SpecResult, check_lossless
from dflash_async.eval.speculative import (
    DFlashBlockDrafter,
    greedy_generate,
    speculative_decode,
    speculative_generate,
)
from dflash_async.model.drafter import DFlashDrafter
from dflash_async.model.drafter_config import drafter_config_from_target
from dflash_async.targets.loading import (
    TargetError,
    frozen_embeddings,
    random_target,
)
from dflash_async.targets.tiny import ensure_tiny_target, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

MAX_NEW = 40


@pytest.fixture(scope="module")
def target():
    return tiny_qwen3_target()


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB - 1, (n,), generator=gen).tolist() for n in (3, 11, 24)]


def drafter_for(target, block_size: int, *, randomized: bool = True, seed: int = 0):
    config = drafter_config_from_target(
        target.config,
        num_hidden_layers=2,
        num_features=2,
        block_size=block_size,
        mask_token_id=VOCAB - 1,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # reset_parameters draws from the global RNG
        drafter = DFlashDrafter(config).eval().requires_grad_(False)
    if randomized:
        randomize_(drafter, seed)  # O(1) weights: drafts that depend on the context
    return drafter, config


class OracleDrafter:
    """Knows the target's greedy continuation; slots past `correct` get a wrong token."""

    def __init__(self, sequence: list[int], block_size: int, correct: int) -> None:
        self.sequence, self.block_size, self.correct = sequence, block_size, correct
        self.context_positions: list[int] = []
        self.context_features: list[torch.Tensor] = []

    def extend_context(self, features: torch.Tensor, positions: torch.Tensor) -> None:
        self.context_features.append(features.clone())
        self.context_positions += positions.tolist()

    def draft(self, anchor_token: int, anchor_position: int) -> torch.Tensor:
        truth = self.sequence[anchor_position + 1 : anchor_position + self.block_size]
        truth += [0] * (self.block_size - 1 - len(truth))
        drafts = [t if k < self.correct else (t + 1) % VOCAB for k, t in enumerate(truth)]
        return torch.tensor(drafts)


def test_cached_block_logits_equal_a_full_recompute():
    """The drafter's context KV cache (filled in chunks) gives the logits of one uncached pass
    over every context row: the block sees all committed context and all of its slots."""
    cfg = tiny_config(TinySpec(vocab_size=50, block_size=5))  # mask 49, 2 features of d=32
    drafter = tiny_drafter(cfg, seed=3)
    embed, lm_head = tiny_target_weights(cfg, seed=4)
    features = torch.randn(13, 64, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    cached = DFlashBlockDrafter(drafter, cfg, embed, lm_head, max_context=20)
    for rows in (slice(0, 6), slice(6, 7), slice(7, 13)):
        cached.extend_context(features[rows], torch.arange(13)[rows])

    block = torch.tensor([7] + [49] * 4)
    full_attend = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
    hidden = drafter(embed[block], torch.arange(13, 18), features, torch.arange(13), full_attend)
    torch.testing.assert_close(cached.block_logits(7, 13), hidden[1:] @ lm_head.T)


@pytest.mark.parametrize("block_size", [4, 8, 16])
def test_speculative_output_equals_greedy_for_random_drafters(target, block_size):
    drafter, cfg = drafter_for(target, block_size)
    embed, lm_head = frozen_embeddings(target)
    for prompt in prompts():
        plain = greedy_generate(target, prompt, MAX_NEW, None)
        spec = speculative_generate(
            target, drafter, cfg, embed, lm_head, prompt, max_new_tokens=MAX_NEW, eos_token_id=None
        )
        assert spec.tokens == plain.tokens
        assert len(spec.tokens) == MAX_NEW
        assert all(1 <= n <= block_size for n in spec.accepted_lengths)


@pytest.mark.parametrize("correct", [0, 1, 3])
def test_each_step_commits_exactly_the_correct_draft_prefix_plus_one(target, correct):
    """An oracle right for the first `correct` slots: every step accepts exactly that many, and
    cropping the target cache after partial acceptance keeps the output lossless."""
    block_size = 6
    for prompt in prompts():
        plain = greedy_generate(target, prompt, MAX_NEW, None)
        oracle = OracleDrafter(prompt + plain.tokens, block_size, correct)
        spec = speculative_decode(
            target, oracle, prompt, layer_ids=(1, 2), max_new_tokens=MAX_NEW, eos_token_id=None
        )
        assert spec.tokens == plain.tokens
        assert spec.accepted_lengths[:-1] == [correct + 1] * (len(spec.accepted_lengths) - 1)


@pytest.mark.parametrize("block_size", [4, 8, 16])
def test_oracle_drafter_reaches_tau_of_the_block_size(target, block_size):
    prompt = prompts()[1]
    plain = greedy_generate(target, prompt, 64, None)
    oracle = OracleDrafter(prompt + plain.tokens, block_size, correct=block_size)
    spec = speculative_decode(
        target, oracle, prompt, layer_ids=(1, 2), max_new_tokens=64, eos_token_id=None
    )
    assert spec.tokens == plain.tokens
    assert spec.accepted_lengths[:-1] == [block_size] * (len(spec.accepted_lengths) - 1)
    assert spec.tau > block_size - 1


def test_drafter_context_is_the_committed_tokens_features_at_their_positions(target):
    """What the drafter is given equals the trainer's features of the final sequence (the
    prompt and every committed token but the newest), row by row, positions 0..n-1."""
    prompt = prompts()[2]
    plain = greedy_generate(target, prompt, MAX_NEW, None)
    oracle = OracleDrafter(prompt + plain.tokens, block_size=5, correct=2)
    speculative_decode(
        target, oracle, prompt, layer_ids=(1, 3), max_new_tokens=MAX_NEW, eos_token_id=None
    )
    n = len(oracle.context_positions)
    assert oracle.context_positions == list(range(n))
    assert n >= len(prompt) + MAX_NEW - 5
    sequence = torch.tensor([(prompt + plain.tokens)[:n]])
    expected = capture_features(target, sequence, torch.ones_like(sequence), (1, 3))[0]
    torch.testing.assert_close(torch.cat(oracle.context_features), expected, atol=1e-4, rtol=1e-4)


def test_both_decoders_stop_at_the_same_eos(target):
    drafter, cfg = drafter_for(target, 4)
    embed, lm_head = frozen_embeddings(target)
    prompt = prompts()[1]
    free = greedy_generate(target, prompt, MAX_NEW, None).tokens
    eos = free[len(free) // 2]
    plain = greedy_generate(target, prompt, MAX_NEW, eos)
    spec = speculative_generate(
        target, drafter, cfg, embed, lm_head, prompt, max_new_tokens=MAX_NEW, eos_token_id=[eos]
    )
    assert spec.tokens == plain.tokens == free[: free.index(eos) + 1]


def test_suppressed_tokens_are_never_generated(target):
    prompt = prompts()[0]
    banned = sorted(set(greedy_generate(target, prompt, MAX_NEW, None).tokens))[:3]
    oracle_seq = greedy_generate(target, prompt, MAX_NEW, None, suppress_token_ids=banned)
    assert not set(banned) & set(oracle_seq.tokens)
    drafter, cfg = drafter_for(target, 4)
    embed, lm_head = frozen_embeddings(target)
    spec = speculative_generate(
        target,
        drafter,
        cfg,
        embed,
        lm_head,
        prompt,
        max_new_tokens=MAX_NEW,
        eos_token_id=None,
        suppress_token_ids=banned,
    )
    assert spec.tokens == oracle_seq.tokens


def test_greedy_runner_up_and_margin_describe_the_second_choice(target):
    prompt = prompts()[0]
    plain = greedy_generate(target, prompt, 3, None)
    logits = target(torch.tensor([prompt])).logits[0, -1]
    top = logits.topk(2)
    assert (plain.tokens[0], plain.runner_up[0]) == tuple(top.indices.tolist())
    assert plain.margins[0] == pytest.approx(float(top.values[0] - top.values[1]), abs=1e-5)


def test_lossless_check_tolerates_only_a_numerical_tie():
    greedy = GreedyResult(tokens=[5, 6, 7], runner_up=[1, 2, 3], margins=[0.5, 1e-6, 0.2])
    assert check_lossless(0, greedy, SpecResult([5, 6, 7], [1, 2]), tolerance=1e-4) is None
    assert check_lossless(0, greedy, SpecResult([5, 2, 9], [1, 2]), tolerance=1e-4) == 1
    with pytest.raises(LosslessError, match=r"sample 3.*new token 1"):
        check_lossless(3, greedy, SpecResult([5, 4, 7], [1, 2]), tolerance=1e-4)  # not runner-up
    with pytest.raises(LosslessError, match="new token 0"):
        check_lossless(3, greedy, SpecResult([1, 6, 7], [1, 2]), tolerance=1e-4)  # margin too big
    with pytest.raises(LosslessError, match="lengths 3 vs 2"):
        check_lossless(3, greedy, SpecResult([5, 6], [1, 2]), tolerance=1e-4)


def test_random_drafter_tau_is_close_to_one_and_the_report_is_complete(target):
    """Untrained drafters (Qwen3's 0.02 init, three seeds) accept ~nothing. Not exactly 1: this
    target repeats some tokens often, and a drafter that happens to emit one of them scores."""
    records = [{"prompt": "hello there"}, {"messages": [{"role": "user", "content": "count"}]}]
    taus = []
    for seed in range(3):
        drafter, cfg = drafter_for(target, 8, randomized=False, seed=seed)
        report = evaluate(target, CharTokenizer(), drafter, cfg, records, max_new_tokens=MAX_NEW)
        taus.append(report["tau"])
    assert 1.0 <= sum(taus) / len(taus) < 1.25, taus
    assert report["num_samples"] == 2 and report["new_tokens"] == 2 * MAX_NEW
    assert sorted(report["accepted_length_histogram"]) == list(range(1, 9))
    assert sum(report["accepted_length_histogram"].values()) == sum(
        s["steps"] for s in report["samples"]
    )
    assert report["plain_tokens_per_s"] > 0 and report["speculative_tokens_per_s"] > 0
    assert report["numerical_ties"] == 0
    json.dumps(report)  # every field is JSON-ready


def test_plain_prompt_and_user_message_render_the_same_and_answers_are_dropped():
    tok = CharTokenizer()
    plain = prompt_token_ids(tok, {"prompt": "hi"}, enable_thinking=False)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "old answer"}]
    assert prompt_token_ids(tok, {"messages": messages}, enable_thinking=False) == plain


def test_a_drafter_built_for_another_target_is_refused(target):
    _, cfg = drafter_for(target, 4)
    other = replace(cfg, hidden_size=32)
    check_drafter_fits_target(cfg, target)
    with pytest.raises(ValueError, match="hidden_size=32 but the target has 64"):
        check_drafter_fits_target(other, target)


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory) -> tuple[Path, Path, DFlashDrafter]:
    """(tiny target folder, export folder, the exported drafter): a random 1-layer B=4 drafter."""
    root = tmp_path_factory.mktemp("tiny_export")
    folder = ensure_tiny_target(root / "cache")
    cfg = drafter_config_from_target(
        Qwen3Config.from_pretrained(folder),
        num_hidden_layers=1,
        num_features=2,
        block_size=4,
        mask_token_id=tiny_tokenizer().mask_token_id,
    )
    drafter = DFlashDrafter(cfg)
    export_drafter(drafter, cfg, root / "export")
    return folder, root / "export", drafter


def test_export_then_load_then_eval(tiny_export, tmp_path: Path):
    """The servable export is what eval loads: same weights (bf16), and a full run_eval."""
    folder, export, drafter = tiny_export
    loaded, loaded_cfg = load_drafter(export, device=torch.device("cpu"), dtype=torch.float32)
    assert loaded_cfg == drafter.config
    for name, value in drafter.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value.bfloat16().float())

    prompts_path = tmp_path / "prompts.jsonl"
    records = [{"prompt": "What is 2 plus 3?"}, {"messages": [{"role": "user", "content": "hi"}]}]
    prompts_path.write_text("".join(json.dumps(r) + "\n" for r in records))
    with capture_logs() as events:
        report = run_eval(
            folder,
            export,
            prompts_path,
            device="cpu",
            max_new_tokens=12,
            num_prompts=2,
            results_path=tmp_path / "results.jsonl",
        )
    assert report["num_samples"] == 2 and report["tau"] >= 1.0
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert [json.loads(line)["index"] for line in lines] == [0, 1]
    completed = [e for e in events if e["event"] == "eval_completed"]
    assert len(completed) == 1 and completed[0]["tau"] == report["tau"]


def test_eval_command_prints_the_summary_as_one_json_line(tiny_export, tmp_path: Path, capsys):
    """`eval` on the demo held-out prompts: exit 0, one JSON line with tau, the histogram, both
    decoders' tokens/s and the speedup; per-sample results in --results."""
    folder, export, _ = tiny_export
    argv = ["--target", str(folder), "--drafter", str(export), "--device", "cpu"]
    argv += ["--max-new-tokens", "8", "--num-prompts", "2", "--results", str(tmp_path / "r.jsonl")]
    with capture_logs():
        assert main(argv) == 0
    (line,) = capsys.readouterr().out.splitlines()
    summary = json.loads(line)
    assert summary["num_samples"] == 2 and summary["block_size"] == 4 and summary["tau"] >= 1.0
    assert list(summary["accepted_length_histogram"]) == ["1", "2", "3", "4"]
    assert summary["plain_tokens_per_s"] > 0 and summary["speculative_tokens_per_s"] > 0
    assert summary["speedup"] > 0 and "samples" not in summary
    assert len((tmp_path / "r.jsonl").read_text().splitlines()) == 2


@pytest.mark.parametrize(
    ("option", "value", "error", "match"),
    [
        ("--drafter", "missing", DataError, "drafter export .*missing.*not found"),
        ("--prompts", "missing.jsonl", DataError, "prompts file .*missing.jsonl.* does not exist"),
        ("--target", "missing", TargetError, "target folder .*missing.* does not exist"),
    ],
)
def test_eval_command_names_a_bad_path_in_one_line(
    tiny_export, tmp_path, option, value, error, match
):
    folder, export, _ = tiny_export
    paths = {"--target": str(folder), "--drafter": str(export), "--prompts": ""}
    paths[option] = str(tmp_path / value)
    argv = [arg for option_value in paths.items() for arg in option_value] + ["--device", "cpu"]
    with pytest.raises(error, match=match) as caught:
        main(argv)
    assert "\n" not in str(caught.value)


def test_eval_command_logs_a_lossless_failure_and_returns_1(tiny_export, monkeypatch, capsys):
    """A speculative decoder that emits the wrong first token: logged as eval_failed, exit 1."""
    folder, export, _ = tiny_export
    real = evaluation.speculative_decoders

    def wrong_first_token(*args, **kwargs):
        def make(factory):
            decoder = factory()
            right = decoder.results
            decoder.results = lambda: [
                SpecResult([r.tokens[0] + 1, *r.tokens[1:]], r.accepted_lengths) for r in right()
            ]
            return decoder

        return [lambda f=f: make(f) for f in real(*args, **kwargs)]

    monkeypatch.setattr(harness, "speculative_decoders", wrong_first_token)
    argv = ["--target", str(folder), "--drafter", str(export), "--device", "cpu"]
    with capture_logs() as events:
        assert main([*argv, "--max-new-tokens", "4", "--num-prompts", "1"]) == 1
    (failed,) = [e for e in events if e["event"] == "eval_failed"]
    assert "sample 0" in failed["error"] and "new token 0" in failed["error"]
    assert capsys.readouterr().out == ""


def _qwen3_8b_shaped_target(device: torch.device):
    """Qwen3-8B's shapes with random weights, built directly on the GPU in bf16."""
    from transformers import AutoModelForCausalLM

    config = Qwen3Config(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[device]), device:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval().requires_grad_(False)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_speculative_decoding_is_lossless(target, dtype):
    """On CUDA the cached drafter, the target cache cropping and the accept rule still give the
    greedy output (bf16: up to a counted numerical tie, which evaluate() reports)."""
    device = torch.device("cuda")
    gpu_target = random_target(target.config, seed=0, dtype=dtype).to(device)
    drafter, cfg = drafter_for(gpu_target, 8)
    drafter = drafter.to(device, dtype)
    report = evaluate(
        gpu_target, CharTokenizer(), drafter, cfg, [{"prompt": "abc"}], max_new_tokens=64
    )
    assert report["num_samples"] == 1
    for prompt in prompts():
        plain = greedy_generate(gpu_target, prompt, MAX_NEW, None)
        oracle = OracleDrafter(prompt + plain.tokens, block_size=8, correct=3)
        spec = speculative_decode(
            gpu_target, oracle, prompt, layer_ids=(1, 3), max_new_tokens=MAX_NEW, eos_token_id=None
        )
        tolerance = 1e-4 if dtype == torch.float32 else 0.5
        check_lossless(0, plain, spec, tolerance)


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_qwen3_8b_shaped_eval_reports_tokens_per_s():
    """The H200 figure for BENCHMARKS.md: random Qwen3-8B-shaped target (bf16), an untrained
    5-layer B=16 drafter, 4 prompts x 256 tokens; plus the all-accepted ceiling (oracle drafts).
    Run: python -m pytest -q -s -m gpu tests/eval/test_evaluate.py -k 8b"""
    device = torch.device("cuda")
    target_8b = _qwen3_8b_shaped_target(device)
    cfg = drafter_config_from_target(target_8b.config, mask_token_id=151669)
    with device:  # initialise the 1.05 B parameters on the GPU, not the host
        drafter = DFlashDrafter(cfg).to(torch.bfloat16).eval().requires_grad_(False)
    records = [{"prompt": "x" * n} for n in (64, 256, 512, 1024)]
    tokenizer = _WideTokenizer()
    report = evaluate(target_8b, tokenizer, drafter, cfg, records, max_new_tokens=256)
    prompt = prompt_token_ids(tokenizer, records[1], enable_thinking=False)
    plain = greedy_generate(target_8b, prompt, 256, None)
    oracle = OracleDrafter(prompt + plain.tokens, cfg.block_size, correct=cfg.block_size)
    torch.cuda.synchronize()
    start = time.perf_counter()
    ceiling = speculative_decode(
        target_8b,
        oracle,
        prompt,
        layer_ids=cfg.target_layer_ids,
        max_new_tokens=256,
        eos_token_id=None,
    )
    torch.cuda.synchronize()
    summary = {k: v for k, v in report.items() if k != "samples"}
    summary["oracle_tau"] = ceiling.tau
    summary["oracle_tokens_per_s"] = len(ceiling.tokens) / (time.perf_counter() - start)
    print(json.dumps({"event": "bench_eval_qwen3_8b_shaped", **summary}))
    # No bound on oracle_tau: after a bf16 numerical tie the oracle's continuation is stale.
    assert report["plain_tokens_per_s"] > 0 and summary["oracle_tau"] >= 1


class _WideTokenizer(CharTokenizer):
    """Prompt ids drawn at random from a large vocabulary (one per character), seeded."""

    def __call__(self, text, add_special_tokens):
        gen = torch.Generator().manual_seed(len(text))
        return {"input_ids": torch.randint(0, 150_000, (len(text),), generator=gen).tolist()}
