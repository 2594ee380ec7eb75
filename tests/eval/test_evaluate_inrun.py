"""Evaluation inside `run`: the run's own target, overlapping training or a logged pause.

Short CPU runs (tiny Qwen3 target, 256-row packs, 1-layer drafter, as in test_pipeline.py) with
evaluation at start, every 2 steps and at the end over 3 prompts x 8 tokens. Also a tiny hybrid
(Qwen3-Next) target, which is evaluated, and a target kind evaluation cannot verify, which is
refused before the first training step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from structlog.testing import capture_logs
from target_kit import save_random_target
from test_pipeline import run_settings
from tiny_run import write_pretokenized
from transformers import Qwen3NextConfig

from dflash_async.errors import SettingsError
from dflash_async.log import get_logger
from dflash_async.pipeline import run as pipeline
from dflash_async.pipeline import startup
from dflash_async.targets.loading import load_target_tokenizer
from dflash_async.targets.tiny import ensure_tiny_target, tiny_tokenizer

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("single_thread")]
RUN_DEADLINE_S = 60


def write_prompts(path: Path) -> Path:
    records = [{"prompt": "What is 2 plus 3?"}, {"prompt": "List 3 colors."}, {"prompt": "hi"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("inrun")
    target = ensure_tiny_target(root / "cache")
    tokenizer = load_target_tokenizer(target)
    data = write_pretokenized(root / "data.jsonl", records=40, vocab=len(tokenizer))
    prompts = write_prompts(root / "prompts.jsonl")
    return {
        "target": str(target),
        "data": str(data),
        "mask": str(tokenizer.mask_token_id),
        "prompts": str(prompts),
    }


def eval_env(inputs: dict[str, str], **extra: str) -> dict[str, str]:
    return {
        "DFLASH_EVAL__PROMPTS_PATH": inputs["prompts"],
        "DFLASH_EVAL__NUM_PROMPTS": "3",
        "DFLASH_EVAL__MAX_NEW_TOKENS": "8",
        "DFLASH_EVAL__AT_START": "true",
        "DFLASH_EVAL__EVERY": "2",
        "DFLASH_EVAL__AT_END": "true",
    } | extra


async def run_logged(settings) -> tuple[int, list[dict[str, Any]]]:
    with capture_logs() as events, anyio.fail_after(RUN_DEADLINE_S):
        code = await pipeline.run(settings, get_logger("test"))
    return code, events


@pytest.mark.anyio
async def test_run_evaluates_on_its_own_target_and_keeps_results_not_models(
    inputs: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One target load for training and evaluation; the baseline decoded once; every
    evaluation leaves a results file and no model copy; the final one runs after training."""
    loads = []
    real_load = startup.load_runner

    def counted(*args, **kwargs):
        loads.append(args)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(startup, "load_runner", counted)
    settings = run_settings(inputs, tmp_path / "out", **eval_env(inputs))
    code, events = await run_logged(settings)
    assert code == 0 and len(loads) == 1
    evals = [e for e in events if e["event"] == "eval"]
    skipped = [e["step"] for e in events if e["event"] == "eval_skipped"]
    # Overlap: a request while one is in flight is skipped (training is faster than decoding
    # here, so which of steps 2 and 4 run depends on timing); the final one always runs.
    assert sorted([e["step"] for e in evals] + skipped) == [0, 2, 4, 5]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 5
    assert [e["baseline_cached"] for e in evals] == [False] + [True] * (len(evals) - 1)
    assert all(e["max_new_tokens"] == 8 and e["num_samples"] == 3 for e in evals)
    assert {e["mode"] for e in evals[:-1]} == {"overlap"} and evals[-1]["mode"] == "pause"
    assert all(e["training_waited_s"] >= 0 and e["target_busy_s"] > 0 for e in evals)
    folder = tmp_path / "out" / "eval"
    names = sorted(p.name for p in folder.iterdir())
    assert [n for n in names if n.startswith("step-")] == [f"step-{e['step']}.jsonl" for e in evals]
    assert len([n for n in names if n.startswith("baseline-")]) == 1
    assert not list(folder.rglob("*.safetensors"))  # results, never a model copy per evaluation


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the loop is not what is tested here
async def test_pause_mode_holds_training_until_the_evaluation_is_logged(
    inputs: dict[str, str], tmp_path: Path
) -> None:
    env = eval_env(inputs, DFLASH_EVAL__MODE="pause", DFLASH_EVAL__AT_START="false")
    code, events = await run_logged(run_settings(inputs, tmp_path / "out", **env))
    assert code == 0
    order = [(e["event"], e.get("step")) for e in events if e["event"] in ("step", "eval")]
    assert order.index(("eval", 2)) < order.index(("step", 3))  # step 3 waited for it
    (at_2,) = [e for e in events if e["event"] == "eval" and e["step"] == 2]
    assert at_2["mode"] == "pause" and at_2["training_waited_s"] >= at_2["target_busy_s"]


@pytest.fixture(scope="module")
def hybrid_target(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Qwen3-Next folder with the built-in tokenizer."""
    tokenizer = tiny_tokenizer()
    config = Qwen3NextConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        max_position_embeddings=512,
        layer_types=["linear_attention", "full_attention"] * 3,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
    )
    folder = save_random_target(tmp_path_factory.mktemp("hybrid") / "qwen3-next-tiny", config, 0)
    tokenizer.save_pretrained(folder)
    return str(folder)


def hybrid_settings(inputs: dict[str, str], hybrid_target: str, output_dir: Path, **extra: str):
    env = eval_env(inputs, DFLASH_EVAL__EVERY="0", DFLASH_TARGET__NUM_FEATURES="2") | extra
    return run_settings(inputs | {"target": hybrid_target}, output_dir, **env)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the loop is not what is tested here
async def test_a_run_with_a_hybrid_target_evaluates_it(
    inputs: dict[str, str], hybrid_target: str, tmp_path: Path
) -> None:
    code, events = await run_logged(hybrid_settings(inputs, hybrid_target, tmp_path / "out"))
    assert code == 0
    (ready,) = [e for e in events if e["event"] == "eval_ready"]
    assert ready["decoder"] == "reference"
    evals = [e for e in events if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [0, 5]
    assert all(e["num_samples"] == 3 and e["tau"] >= 1 for e in evals)  # lossless-checked


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_target_evaluation_cannot_verify_is_refused_before_training(
    inputs: dict[str, str], hybrid_target: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A layer kind with no exact verification (simulated): SettingsError (exit 2, one line)
    at start-up, naming how to train without evaluation; not one training step ran."""
    from dflash_async.stages import evaluate as stage

    monkeypatch.setattr(stage, "evaluation_unsupported_reason", lambda target: "layer types ['x']")
    settings = hybrid_settings(inputs, hybrid_target, tmp_path / "out")
    with capture_logs() as events, pytest.raises(SettingsError) as refused:
        with anyio.fail_after(RUN_DEADLINE_S):
            await pipeline.run(settings, get_logger("test"))
    assert "\n" not in str(refused.value) and "DFLASH_EVAL__EVERY=0" in str(refused.value)
    assert not [e for e in events if e["event"] == "step"]


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_lossless_failure_is_logged_and_training_goes_on(
    inputs: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dflash_async.eval import evaluation
    from dflash_async.eval.lossless import LosslessError

    def differs(index, *args):
        raise LosslessError(f"sample {index}: speculative output differs")

    monkeypatch.setattr(evaluation, "check_lossless", differs)
    env = eval_env(inputs, DFLASH_EVAL__EVERY="0", DFLASH_EVAL__AT_START="false")
    code, events = await run_logged(run_settings(inputs, tmp_path / "out", **env))
    assert code == 0 and len([e for e in events if e["event"] == "step"]) == 5
    (failed,) = [e for e in events if e["event"] == "eval_failed"]
    assert failed["step"] == 5 and "sample 0" in failed["error"]


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_final_in_run_tau_is_evals_tau_of_the_final_export(
    inputs: dict[str, str], tmp_path: Path
) -> None:
    """One set of decode settings and the served (bf16) weights: `eval` of the export saved at
    the end reports exactly the tau the run logged for its last evaluation."""
    from dflash_async.eval.harness import run_eval

    env = eval_env(inputs, DFLASH_EVAL__EVERY="0", DFLASH_EVAL__AT_START="false")
    code, events = await run_logged(run_settings(inputs, tmp_path / "out", **env))
    (final,) = [e for e in events if e["event"] == "eval"]
    with capture_logs():
        report = run_eval(
            inputs["target"],
            tmp_path / "out" / "drafter",
            inputs["prompts"],
            device="cpu",
            max_new_tokens=8,
            num_prompts=3,
        )
    assert code == 0 and report["tau"] == final["tau"]
    assert report["accepted_length_histogram"] == final["accepted_length_histogram"]


def test_eval_command_defaults_are_the_in_run_defaults() -> None:
    """No preset or flag sets them apart: the demo preset leaves the decode settings alone."""
    from dflash_async.eval.harness import build_parser
    from dflash_async.settings import EvalSettings

    args = build_parser().parse_args(["--drafter", "x"])
    ours = EvalSettings()
    assert (args.max_new_tokens, args.num_prompts, args.batch_size) == (
        ours.max_new_tokens,
        ours.num_prompts,
        ours.batch_size,
    )
    demo = (Path(__file__).parents[2] / "settings" / "demo.env").read_text()
    for name in ("MAX_NEW_TOKENS", "NUM_PROMPTS", "BATCH_SIZE"):
        line = next((x for x in demo.splitlines() if x.startswith(f"DFLASH_EVAL__{name}=")), None)
        assert line is None or line.split("=")[1] == str(getattr(ours, name.lower()))


def test_the_evaluation_copy_holds_the_exported_bf16_weights() -> None:
    """In-run evaluation decodes with what `eval` would load from the export: the training
    weights rounded to bf16, here held in fp32 (the CPU target's dtype); one copy, reused."""
    from conftest import TinySpec, randomize_, tiny_config

    from dflash_async.model.drafter import DFlashDrafter
    from dflash_async.stages.evaluate import copy_weights

    source = DFlashDrafter(tiny_config(TinySpec()))
    randomize_(source, 0)
    copy = copy_weights(source, None, device=torch.device("cpu"), dtype=torch.float32)
    for name, value in source.state_dict().items():
        assert torch.equal(copy.state_dict()[name], value.bfloat16().float()), name
    with torch.no_grad():
        source.fc.weight.add_(1.0)
    assert copy_weights(source, copy, device=torch.device("cpu"), dtype=torch.float32) is copy
    assert torch.equal(copy.fc.weight, source.fc.weight.bfloat16().float())


def test_eval_command_refuses_an_unwritable_baseline_folder(tmp_path: Path) -> None:
    from dflash_async.eval.harness import main
    from dflash_async.usage import UsageError

    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(UsageError, match="--baseline-dir") as refused:
        main(["--drafter", "x", "--baseline-dir", str(blocker / "sub")])
    assert "\n" not in str(refused.value)
