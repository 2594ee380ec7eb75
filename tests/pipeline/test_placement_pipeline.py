"""The placed pipeline on several `cpu` devices: co-located pairs, split roles, and the drafters'
gradient combine (the code paths of several GPUs, with CPU tensors).

Reuses test_pipeline.py's tiny run (built-in tiny target, 256-row packs, a 1-layer drafter).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_pipeline import (
    NUM_ANCHORS,
    PACK_ROWS,
    FixedAnchors,
    flat_weights,
    laid_out,
    make_step,
    random_docs,
    run_recording_weights,
    run_settings,
)
from tiny_run import tiny_inputs

from dflash_async.model.objective import Anchors, sample_anchors
from dflash_async.model.step import STATS
from dflash_async.pipeline import placement
from dflash_async.pipeline.placement import placing
from dflash_async.runtime.devices import DeviceWorker
from dflash_async.stages.train import DrafterRunner, combine_gradients

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("single_thread")]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return tiny_inputs(tmp_path_factory.mktemp("placement"))


@pytest.mark.anyio
@pytest.mark.parametrize("pairs", [2, 3])
async def test_colocated_pairs_end_every_step_with_identical_drafters(
    pairs: int, inputs: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = run_settings(
        inputs,
        tmp_path / "out",
        DFLASH_TRAIN__MAX_STEPS="3",
        DFLASH_PIPELINE__DEVICES=",".join(["cpu"] * pairs),
        DFLASH_PIPELINE__LAYOUT="colocated",
    )
    weights, events = await run_recording_weights(settings, monkeypatch)
    assert len(weights) == 3
    for step in weights:
        assert len(step) == pairs and all(torch.equal(step[0], w) for w in step[1:])
    assert not torch.equal(weights[0][0], weights[-1][0])  # the weights did move
    (event,) = [e for e in events if e["event"] == "placement"]
    assert (event["layout"], event["num_targets"], event["num_drafters"]) == ("colocated",) + (
        pairs,
    ) * 2
    steps = [e for e in events if e["event"] == "step"]
    assert all(e["tokens"] > 256 for e in steps)  # several packs' tokens per step
    assert all(len(e["slot_queues"]) == pairs for e in steps)
    assert all(set(e["gpu_busy"]) == {"cpu"} and "node_mfu" not in e for e in steps)  # CPU


@pytest.mark.anyio
async def test_auto_calibrates_and_logs_one_placement_event_with_its_numbers(
    inputs: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = run_settings(
        inputs, tmp_path / "out", DFLASH_TRAIN__MAX_STEPS="2", DFLASH_PIPELINE__DEVICES="cpu,cpu"
    )
    _, events = await run_recording_weights(settings, monkeypatch)
    (event,) = [e for e in events if e["event"] == "placement"]
    assert event["rates_source"] == "measured"
    assert event["target_tokens_per_s"] > 0 and event["drafter_tokens_per_s"] > 0
    assert event["colocated_tokens_per_s_per_gpu"] > 0 and event["split_tokens_per_s_per_gpu"] > 0
    best = max(("colocated", "split"), key=lambda k: event[f"{k}_tokens_per_s_per_gpu"])
    assert event["layout"] == best  # memory fits on the CPU: the rates decide


@pytest.mark.anyio
async def test_auto_runs_split_when_the_target_does_not_fit_beside_the_drafter(
    inputs: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = placing.memory_needs

    def small_devices(*args, **kwargs) -> placement.MemoryNeeds:
        needs = real(*args, **kwargs)  # pretend each device holds one stage, not both
        room = max(needs.target_side, needs.drafter_side) / placement.HEADROOM
        return placement.MemoryNeeds(**{**needs.__dict__, "device_bytes": room * 1.01})

    monkeypatch.setattr(placing, "memory_needs", small_devices)
    settings = run_settings(
        inputs,
        tmp_path / "out",
        DFLASH_TRAIN__MAX_STEPS="2",
        DFLASH_PIPELINE__DEVICES="cpu,cpu,cpu",
    )
    weights, events = await run_recording_weights(settings, monkeypatch)
    (event,) = [e for e in events if e["event"] == "placement"]
    assert event["layout"] == "split" and event["num_targets"] + event["num_drafters"] == 3
    assert event["reason"].startswith("the target does not fit beside the drafter: target ")
    assert all(len(step) == event["num_drafters"] for step in weights)


def test_three_drafters_update_equals_one_drafter_on_all_three_packs_blocks() -> None:
    """combine_gradients with three drafters on one device (the within-device sum, then the
    copy back): the same update as one drafter on the three packs laid end to end with the
    same anchors, and three identical copies (see test_pipeline's two-drafter version)."""
    samplers = [FixedAnchors() for _ in range(3)]
    trio = [make_step(PACK_ROWS, NUM_ANCHORS, s) for s in samplers]
    cpu = torch.device("cpu")
    runners = [DrafterRunner(DeviceWorker(cpu, name=f"d{i}"), s) for i, s in enumerate(trio)]
    single_sampler = FixedAnchors()
    single = make_step(3 * PACK_ROWS, 3 * NUM_ANCHORS, single_sampler)
    gen = torch.Generator().manual_seed(11)
    lengths = ((20, 25, 11), (9, 10, 8, 12, 7), (30, 14))
    for step in range(3):  # AdamW's moments make later steps depend on earlier ones
        docs = [random_docs(100 * (i + 1) + step, n) for i, n in enumerate(lengths)]
        packs = [laid_out(d, f, PACK_ROWS) for d, f in docs]
        anchors = [sample_anchors(p.loss_mask, p.doc_ids, NUM_ANCHORS, gen) for p in packs]
        for s, sampler, pack, a in zip(trio, samplers, packs, anchors, strict=True):
            s.batch.copy_(pack)
            sampler.anchors = a
            s.phase_a()
        assert len({s.stats[STATS.index("weight_sum")].item() for s in trio}) > 1
        assert combine_gradients(runners, [None] * 3) == [None] * 3  # CPU: nothing to wait for
        all_docs = [doc for d, _ in docs for doc in d]
        all_features = torch.cat([f for _, f in docs])
        single.batch.copy_(laid_out(all_docs, all_features, 3 * PACK_ROWS))
        shifts = [0, docs[0][1].shape[0], docs[0][1].shape[0] + docs[1][1].shape[0]]
        single_sampler.anchors = Anchors(
            torch.cat([a.positions + k for a, k in zip(anchors, shifts, strict=True)]),
            torch.cat([a.valid for a in anchors]),
        )
        single.phase_a()
        assert all(torch.equal(trio[0].flat_grad, s.flat_grad) for s in trio[1:])
        # fp32 sums in another order: relative 1e-4 as in the two-drafter test
        torch.testing.assert_close(trio[0].flat_grad, single.flat_grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(trio[0].stats, single.stats, rtol=1e-6, atol=0)
        for s in (*trio, single):
            s.phase_b()
        assert all(torch.equal(flat_weights(trio[0]), flat_weights(s)) for s in trio[1:])
        # AdamW's 1/(sqrt(v) + 1e-8) amplifies rounding where a gradient is ~1e-8: ~1e-3 lr
        torch.testing.assert_close(
            flat_weights(trio[0]), flat_weights(single), rtol=0, atol=1e-2 * 1e-3
        )


@pytest.mark.anyio
async def test_epoch_0_is_planned_once_for_the_length_the_calibration_and_the_read_stage(
    inputs: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planning an epoch is seconds at millions of samples: start-up plans epoch 0 once and
    hands it to the calibration (auto on two devices) and the read stage; later epochs are the
    read stage's planner's."""
    from dflash_async.data import packing
    from dflash_async.stages import read

    planned: list[int] = []

    def counted(real):
        def plan(lengths, token_budget, seed, epoch, **kwargs):
            planned.append(epoch)
            return real(lengths, token_budget, seed, epoch, **kwargs)

        return plan

    monkeypatch.setattr(read, "plan_epoch", counted(read.plan_epoch))
    monkeypatch.setattr(packing, "plan_epoch", counted(packing.plan_epoch))  # the planner's
    settings = run_settings(
        inputs,
        tmp_path / "out",
        DFLASH_TRAIN__MAX_STEPS="0",
        DFLASH_TRAIN__EPOCHS="2",
        DFLASH_PIPELINE__DEVICES="cpu,cpu",
    )
    _, events = await run_recording_weights(settings, monkeypatch)
    (event,) = [e for e in events if e["event"] == "placement"]
    assert event["rates_source"] == "measured"  # the calibration ran, on epoch 0's packs
    assert planned == [0, 1]
