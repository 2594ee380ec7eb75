"""DSpark end to end on the CPU pipeline (tiny target): a run trains, evaluates in the run and
exports a Qwen3DSparkModel whose `eval` gives the in-run tau; a new run warm-starts from that
export; a restored DSpark step continues bit for bit."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import TinySpec, randomize_, tiny_batch, tiny_config, tiny_target_weights

from dflash_async.model.kinds.dspark.drafter import DSparkDrafter
from dflash_async.model.kinds.dspark.objective import DSparkObjective
from dflash_async.model.objective import ObjectiveConfig


def _env(inputs, out, prompts, **extra):
    from tiny_run import tiny_env

    return (
        tiny_env(inputs, out)
        | {
            "DFLASH_DRAFTER__KIND": "dspark",
            "DFLASH_DRAFTER__MARKOV_RANK": "16",
            "DFLASH_TRAIN__MAX_STEPS": "16",
            "DFLASH_TRAIN__SAVE_EVERY": "0",
            "DFLASH_TRAIN__LR": "3e-3",
            "DFLASH_TRAIN__WARMUP_FRAC": "0",
            "DFLASH_EVAL__AT_START": "true",
            "DFLASH_EVAL__NUM_PROMPTS": "3",
            "DFLASH_EVAL__MAX_NEW_TOKENS": "8",
            "DFLASH_EVAL__PROMPTS_PATH": str(prompts),
        }
        | extra
    )


@pytest.mark.anyio
@pytest.mark.timeout(300)
async def test_a_dspark_run_trains_exports_and_its_export_decodes_warm_starts_and_calibrates(
    tmp_path,
):
    import anyio
    from structlog.testing import capture_logs
    from test_evaluate_inrun import write_prompts
    from tiny_run import tiny_inputs

    from dflash_async.eval.harness import run_eval
    from dflash_async.log import get_logger
    from dflash_async.pipeline import run as pipeline
    from dflash_async.settings.env import load_settings

    inputs = tiny_inputs(tmp_path / "inputs")
    prompts = write_prompts(tmp_path / "prompts.jsonl")  # 3 prompts
    with capture_logs() as events, anyio.fail_after(150):
        code = await pipeline.run(
            load_settings(_env(inputs, tmp_path / "out", prompts)), get_logger("t")
        )
    assert code == 0
    losses = [e["loss"] for e in events if e["event"] == "step"]
    assert len(losses) == 16 and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4, losses
    evals = [e for e in events if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [0, 16] and all(e["tau"] >= 1.0 for e in evals), evals
    # anchor-first: a block of 8 inputs drafts 8 tokens, a verified block holds 9
    assert all(len(e["accepted_length_histogram"]) == 9 for e in evals)
    # the confidence head's calibration per draft slot: slot 1 is reached at every step
    for e in evals:
        slots = e["confidence_by_slot"]
        assert [s["slot"] for s in slots] == list(range(1, 9))
        assert slots[0]["steps"] == sum(e["accepted_length_histogram"].values())
        assert 0 <= slots[0]["predicted"] <= 1 and 0 <= slots[0]["measured"] <= 1
    assert not [e for e in events if e["event"] in ("eval_failed", "eval_skipped")]
    export = tmp_path / "out" / "drafter"
    cfg = json.loads((export / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["markov_rank"] == 16
    with capture_logs():  # the same prompts and decode settings as the run's evaluations
        report = run_eval(
            inputs["target"], export, prompts, device="cpu", max_new_tokens=8, num_prompts=3
        )
    for name in ("tau", "accepted_length_histogram"):
        assert report[name] == evals[-1][name], (name, report[name], evals)

    warm = _env(inputs, tmp_path / "warm", prompts, DFLASH_DRAFTER__INIT=str(export))
    warm |= {"DFLASH_TRAIN__MAX_STEPS": "1", "DFLASH_EVAL__AT_START": "false"}
    with capture_logs() as events, anyio.fail_after(120):
        assert await pipeline.run(load_settings(warm), get_logger("t")) == 0
    (initialized,) = [e for e in events if e["event"] == "drafter_initialized"]
    assert initialized["kind"] == "export"

    # calibrate: the trained head's temperature, fitted on the prompts, folded into a new export
    from dflash_async.eval.calibrate_command import build_parser, run_calibrate

    calibrated = tmp_path / "calibrated"
    options = ["--target", inputs["target"], "--drafter", str(export), "--prompts", str(prompts)]
    options += ["--out", str(calibrated), "--device", "cpu", "--max-new-tokens", "8"]
    with capture_logs():
        fitted = run_calibrate(build_parser().parse_args(options))
    assert fitted["temperature"] > 0 and fitted["bce_after"] <= fitted["bce_before"]
    with capture_logs():  # greedy drafts do not read the head: the same tau, its new predictions
        after = run_eval(
            inputs["target"], calibrated, prompts, device="cpu", max_new_tokens=8, num_prompts=3
        )
    assert after["tau"] == report["tau"]
    predicted = [[s["predicted"] for s in r["confidence_by_slot"]] for r in (report, after)]
    assert predicted[0] != predicted[1]


def _dspark_step(seed: int):
    from dflash_async.model.step import DrafterStep

    spec = TinySpec(block_size=4)
    config = dataclasses.replace(tiny_config(spec), kind="dspark", markov_rank=8)
    drafter = DSparkDrafter(config)
    randomize_(drafter, seed)
    embed, lm_head = tiny_target_weights(config, 0, dtype=torch.float32)
    objective = DSparkObjective(
        ObjectiveConfig(block_size=4, num_anchors=8, mask_token_id=config.mask_token_id, gamma=4.0),
        drafter,
        embed,
        lm_head,
        target_norm=torch.ones(config.hidden_size),
    )
    step = DrafterStep.build(
        objective,
        token_budget=spec.num_tokens,
        peak_lr=1e-2,
        warmup_steps=2,
        total_steps=10,
        generator=torch.Generator().manual_seed(seed),
    )
    step.batch.copy_(tiny_batch(spec, config, dtype=torch.float32))
    return step


def test_a_restored_dspark_step_continues_exactly(tmp_path) -> None:
    """The Markov and confidence heads resume with the backbone: three more steps are bit for
    bit the uninterrupted ones."""
    from dflash_async.checkpoint.state import load_checkpoint, restore, snapshot, write_checkpoint
    from dflash_async.data.packing import PackCursor

    def train(step, n: int) -> list[float]:
        values = []
        for _ in range(n):
            step.phase_a()
            values.append(step.stats[0].item())  # sync point: test only
            step.phase_b()
        return values

    original = _dspark_step(seed=0)
    train(original, 2)
    state = snapshot([original], step=2, cursor=PackCursor(0, 2), seed=0, run={})
    folder, _ = write_checkpoint(tmp_path, state, keep=2)
    resumed = _dspark_step(seed=1)
    restore(resumed, load_checkpoint(folder), rank=0)
    assert train(resumed, 3) == train(original, 3)
    names = [n for n, _ in original.objective.drafter.named_parameters()]
    assert any("markov_head" in n for n in names) and any("confidence_head" in n for n in names)
    for p, q in zip(original.params, resumed.params, strict=True):
        assert torch.equal(p, q)
