"""Runs with a split target (DFLASH_TARGET__STAGES=2: one replica over two CPU stage workers, a
drafter on each device): it trains exactly as the unsplit target does, resumes bit for bit, a
stage's failure ends the run, and a target too big for the devices exits 2 naming the bytes.

The unsplit reference has the same drafters (TARGET_DEVICES=cpu, DRAFTER_DEVICES=cpu,cpu): one
target replica either way, so the publish order is the plan's and every step takes the same
packs (rings.py); the split target's features are bit for bit the unsplit ones
(test_target_split.py), so every step line's numbers are equal.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from structlog.testing import capture_logs
from test_pipeline import fail_on_call, run_settings, worker_threads
from test_resume import N, assert_same_state, losses, settings_for, train
from tiny_run import tiny_inputs

from dflash_async.checkpoint.state import list_checkpoints, load_checkpoint
from dflash_async.log import get_logger
from dflash_async.pipeline import placement
from dflash_async.pipeline import run as pipeline
from dflash_async.pipeline.placement import placing
from dflash_async.stages import chain

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("single_thread")]
SPLIT = {"DFLASH_PIPELINE__DEVICES": "cpu,cpu", "DFLASH_TARGET__STAGES": "2"}
UNSPLIT = {"DFLASH_PIPELINE__TARGET_DEVICES": "cpu", "DFLASH_PIPELINE__DRAFTER_DEVICES": "cpu,cpu"}
SAME = ("step", "epoch", "loss", "acc", "tau_hat", "lr", "grad_norm", "tokens", "padding_frac")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return tiny_inputs(tmp_path_factory.mktemp("split"))


async def _run(settings) -> list[dict]:
    with capture_logs() as events, anyio.fail_after(60):
        assert await pipeline.run(settings, get_logger("test")) == 0
    return events


def _steps(events: list[dict]) -> list[dict]:
    return [{k: e[k] for k in SAME} for e in events if e["event"] == "step"]


@pytest.mark.anyio
async def test_a_run_with_a_split_target_logs_the_unsplit_runs_step_lines(
    inputs: dict[str, str], tmp_path: Path
) -> None:
    split = await _run(run_settings(inputs, tmp_path / "split", **SPLIT))
    unsplit = await _run(run_settings(inputs, tmp_path / "unsplit", **UNSPLIT))
    assert len(_steps(split)) == 5 and _steps(split) == _steps(unsplit)
    (event,) = [e for e in split if e["event"] == "placement"]
    assert (event["replicas"], event["stages"], event["num_drafters"]) == (1, 2, 2)
    assert len(event["device_bytes_needed"]) == 2 and event["layers"][0][0] == 0
    (chained,) = [e for e in split if e["event"] == "target_split"]
    assert chained["target_path"] == "packed_dense" and chained["stages"] == 2


@pytest.mark.anyio
async def test_a_split_run_stopped_and_resumed_equals_the_uninterrupted_one(
    inputs: dict[str, str], tmp_path: Path
) -> None:
    reference = settings_for(inputs, tmp_path / "reference", **SPLIT)
    code, ref_events = await train(reference)
    assert code == 0
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
    assert [e["step"] for e in events if e["event"] == "resumed"] == [N]
    assert losses(events) == {s: v for s, v in losses(ref_events).items() if s > N}
    assert_same_state(
        load_checkpoint(list_checkpoints(tmp_path / "resumed")[-1][1]),
        load_checkpoint(list_checkpoints(tmp_path / "reference")[-1][1]),
    )


@pytest.mark.anyio
async def test_a_failing_stage_worker_cancels_the_run_and_joins_every_thread(
    inputs: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(chain, "run_stage", fail_on_call(9, chain.run_stage, "stage failed"))
    settings = run_settings(inputs, tmp_path / "out", DFLASH_TRAIN__MAX_STEPS="1000", **SPLIT)
    with pytest.raises(BaseExceptionGroup) as raised, anyio.fail_after(60):
        await pipeline.run(settings, get_logger("test"))
    assert raised.group_contains(RuntimeError, match="stage failed", depth=None)
    assert worker_threads() == []


@pytest.mark.anyio
async def test_a_split_target_too_big_for_the_devices_exits_2_with_the_bytes_per_device(
    inputs: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = placing.memory_needs

    def small_devices(*args, **kwargs) -> placement.MemoryNeeds:
        needs = real(*args, **kwargs)  # room for the drafter side only: no stage fits
        return placement.MemoryNeeds(**{**needs.__dict__, "device_bytes": needs.drafter_side})

    monkeypatch.setattr(placing, "memory_needs", small_devices)
    settings = run_settings(inputs, tmp_path / "out", **SPLIT)
    with pytest.raises(placement.PlacementError) as raised, anyio.fail_after(60):
        await pipeline.run(settings, get_logger("test"))
    message = str(raised.value)
    assert "the split target does not fit: cpu#0 (stage 0) needs " in message
    assert "cpu#1 (stage 1) needs " in message and " bytes per device" in message
