"""Exact resume (CPU, tiny target): a run of 2N steps and a run of N steps + resume + N steps give
bitwise equal drafter weights, optimizer state, anchor generators and per-step losses; also with
two drafter workers, across an epoch boundary, with an evaluation in between, and when the
first part was stopped by a signal rather than by a periodic checkpoint.

On the CPU every step is deterministic (same packs, same anchors, same fp32 arithmetic), so the
comparisons are exact (torch.equal, ==): any state that is not saved or not restored (a
generator, AdamW's step counter, the lr schedule, the data cursor) breaks them.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from structlog.testing import capture_logs
from tiny_run import tiny_env, tiny_inputs

from dflash_async.checkpoint.state import list_checkpoints, load_checkpoint
from dflash_async.errors import SettingsError
from dflash_async.log import get_logger
from dflash_async.pipeline import run as pipeline
from dflash_async.pipeline.shutdown import Shutdown
from dflash_async.settings import Settings
from dflash_async.settings.env import load_settings

RUN_DEADLINE_S = 60  # a run here takes ~1-3 s; past this it hangs
N = 5  # steps before the resume; 40 samples make 8 packs per epoch: 2N steps cross epochs


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The tiny target, its mask token, 40 pre-tokenized samples and one evaluation prompt."""
    root = tmp_path_factory.mktemp("resume")
    (root / "prompts.jsonl").write_text(json.dumps({"prompt": "Count: one two three"}) + "\n")
    return tiny_inputs(root) | {"prompts": str(root / "prompts.jsonl")}


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, bool]]:
    """uvloop only, the backend `python -m dflash_async run` uses: these runs are the slow ones."""
    return ("asyncio", {"use_uvloop": True})


def settings_for(inputs: dict[str, str], output_dir: Path, **env: str) -> Settings:
    base = tiny_env(inputs, output_dir) | {
        "DFLASH_TRAIN__MAX_STEPS": str(2 * N),
        "DFLASH_TRAIN__SAVE_EVERY": str(N),
        "DFLASH_TRAIN__WARMUP_FRAC": "0.25",  # lr changes every step: a schedule off by one shows
        "DFLASH_EVAL__AT_END": "false",
    }
    return load_settings(base | env)


async def train(settings: Settings, shutdown: Shutdown | None = None) -> tuple[int, list[dict]]:
    with capture_logs() as events, anyio.fail_after(RUN_DEADLINE_S):
        code = await pipeline.run(settings, get_logger("test"), shutdown=shutdown)
    return code, events


def losses(events: list[dict]) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in events if e["event"] == "step"}


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Bitwise equal training states (weights, AdamW, schedule, cursor, generators)."""
    assert (a["step"], a["schedule_step"], a["cursor"]) == (
        b["step"],
        b["schedule_step"],
        b["cursor"],
    )
    assert a["drafter"].keys() == b["drafter"].keys()
    for name in a["drafter"]:
        assert torch.equal(a["drafter"][name], b["drafter"][name]), name
    assert len(a["optimizer"]) == len(b["optimizer"])
    for x, y in zip(a["optimizer"], b["optimizer"], strict=True):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    for x, y in zip(a["rng"]["anchor_generators"], b["rng"]["anchor_generators"], strict=True):
        assert torch.equal(x, y)
    assert a["run"] == b["run"]


def two_drafters(settings: Settings) -> Settings:
    """Two CPU drafter workers: each step trains on the two oldest packs (rings.py), whichever
    drafter's ring they sit in; the pack-seeded anchors and a sum of two (the same in either
    order) keep that exact."""
    pipeline = {"drafter_devices": ("cpu", "cpu")}
    return settings.model_copy(update={"pipeline": settings.pipeline.model_copy(update=pipeline)})


@pytest.mark.anyio
@pytest.mark.parametrize(
    "variant", ["one_drafter", "two_drafters_across_epochs", "evaluation_between"]
)
async def test_n_steps_then_resume_then_n_steps_equals_2n_steps_bit_for_bit(
    inputs: dict[str, str], tmp_path: Path, variant: str
) -> None:
    env = {}
    if variant == "evaluation_between":  # an evaluation at step N, just before the checkpoint
        env = {
            "DFLASH_EVAL__EVERY": str(N),
            "DFLASH_EVAL__PROMPTS_PATH": inputs["prompts"],
            "DFLASH_EVAL__NUM_PROMPTS": "1",
            "DFLASH_EVAL__MAX_NEW_TOKENS": "8",
        }
    reference = settings_for(inputs, tmp_path / "reference", **env)
    if variant == "two_drafters_across_epochs":  # 2 packs per step: epoch 0 ends before step N
        reference = two_drafters(reference)
    code, ref_events = await train(reference)
    assert code == 0
    evaluated = [e["step"] for e in ref_events if e["event"] == "eval"]
    assert evaluated == ([N] if variant == "evaluation_between" else [])
    (first, _), (last, last_dir) = list_checkpoints(tmp_path / "reference")
    assert (first, last) == (N, 2 * N)
    cursor = load_checkpoint(last_dir)["cursor"]
    assert cursor["epoch"] >= 1  # the 2N steps crossed an epoch boundary

    # The first N steps are the reference's; resume its step-N checkpoint into a new folder.
    resumed_settings = reference.model_copy(
        update={
            "output_dir": tmp_path / "resumed",
            "train": reference.train.model_copy(
                update={"resume": str(list_checkpoints(tmp_path / "reference")[0][1])}
            ),
        }
    )
    code, events = await train(resumed_settings)
    assert code == 0
    (resumed,) = [e for e in events if e["event"] == "resumed"]
    assert resumed["step"] == N
    assert losses(events) == {s: v for s, v in losses(ref_events).items() if s > N}
    assert_same_state(
        load_checkpoint(list_checkpoints(tmp_path / "resumed")[-1][1]), load_checkpoint(last_dir)
    )


@pytest.mark.anyio
async def test_a_run_stopped_by_a_signal_resumes_in_its_folder_bit_for_bit(
    inputs: dict[str, str], tmp_path: Path
) -> None:
    reference = settings_for(inputs, tmp_path / "reference", DFLASH_TRAIN__SAVE_EVERY="0")
    code, ref_events = await train(reference)
    assert code == 0

    settings = settings_for(inputs, tmp_path / "out", DFLASH_TRAIN__SAVE_EVERY="0")
    shutdown = Shutdown(hard_exit=False)
    real_train_steps = pipeline.train_steps

    async def stop_after_two(*args, on_step_end, **kwargs) -> int:
        async def after(step: int) -> None:
            await on_step_end(step)
            if step == 2:  # as a SIGTERM arriving during step 3 would
                shutdown.request(signal.SIGTERM)

        return await real_train_steps(*args, on_step_end=after, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pipeline, "train_steps", stop_after_two)
        code, first_events = await train(settings, shutdown)
    assert code == 143
    names = [e["event"] for e in first_events]
    assert "train_completed" not in names
    (interrupted,) = [e for e in first_events if e["event"] == "train_interrupted"]
    stopped = interrupted["step"]  # 2 or 3: the loop sees the request at its next check
    assert interrupted["reason"] == "SIGTERM" and 2 <= stopped < 2 * N
    assert [step for step, _ in list_checkpoints(tmp_path / "out")] == [stopped]

    code, events = await train(settings)  # DFLASH_TRAIN__RESUME=auto: the same folder
    assert code == 0
    assert [e["step"] for e in events if e["event"] == "resumed"] == [stopped]
    assert losses(first_events) | losses(events) == losses(ref_events)
    assert_same_state(
        load_checkpoint(list_checkpoints(tmp_path / "out")[-1][1]),
        load_checkpoint(list_checkpoints(tmp_path / "reference")[-1][1]),
    )


@pytest.mark.anyio
async def test_resume_refuses_a_checkpoint_of_other_run_defining_settings(
    inputs: dict[str, str], tmp_path: Path
) -> None:
    code, _ = await train(settings_for(inputs, tmp_path / "out", DFLASH_TRAIN__MAX_STEPS="1"))
    assert code == 0
    changed = settings_for(
        inputs, tmp_path / "out", DFLASH_TRAIN__MAX_STEPS="1", DFLASH_TRAIN__NUM_ANCHORS="8"
    )
    with pytest.raises(SettingsError, match=r"^DFLASH_TRAIN__NUM_ANCHORS: this run has 8") as error:
        await train(changed)
    assert "\n" not in str(error.value)  # the CLI prints it as one line, exit 2
    never = settings_for(inputs, tmp_path / "out", DFLASH_TRAIN__RESUME="never")
    with pytest.raises(SettingsError, match=r"RESUME=never: .* holds a previous run"):
        await train(never)
