"""GPU: two co-located pairs (two targets, two drafters) on one GPU, and one pair per GPU on two,
train with identical drafters; the gradient combine is ordered by events, not host syncs.

The tiny target and test_pipeline's tiny run, with CUDA graphs on (compile off, SDPA attention:
seconds, not minutes of compiling): the code paths of `benchmarks/gpu.sh placement`'s 8B runs.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch
from conftest import TinySpec, make_objective, tiny_config, tiny_drafter, tiny_target_weights
from structlog.testing import capture_logs
from test_pipeline import RUN_DEADLINE_S, flat_weights, laid_out, random_docs, run_settings
from tiny_run import tiny_inputs

from dflash_async.data.packing import PackedBatch
from dflash_async.log import get_logger
from dflash_async.model.optim import LrSchedule, build_optimizer
from dflash_async.model.step import DrafterStep
from dflash_async.pipeline import run as pipeline
from dflash_async.runtime.devices import open_device_worker
from dflash_async.stages.train import DrafterRunner, combine_gradients

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]
CASES = ["two_on_one_gpu", "one_per_gpu"]


def gpu_devices(case: str) -> tuple[str, str]:
    if case == "two_on_one_gpu":
        return ("0", "0")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    return ("0", "1")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return tiny_inputs(tmp_path_factory.mktemp("placement_gpu"))


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("case", CASES)
async def test_colocated_gpu_pairs_train_identical_drafters(
    case: str, inputs: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = run_settings(
        inputs,
        tmp_path / "out",
        DFLASH_TRAIN__MAX_STEPS="6",
        DFLASH_PIPELINE__LAYOUT="colocated",
        DFLASH_PIPELINE__DEVICES=",".join(gpu_devices(case)),
        DFLASH_TRAIN__COMPILE="false",
        DFLASH_TRAIN__CUDA_GRAPH="true",
        DFLASH_TRAIN__ATTENTION="sdpa",
        DFLASH_EVAL__AT_END="false",
    )
    weights: list[list[torch.Tensor]] = []
    real_train_steps = pipeline.train_steps

    async def train_steps_checked(runners, *args, on_step_end=None, **kwargs) -> int:
        async def after_step(step: int) -> None:
            for i in range(torch.cuda.device_count()):  # test only: every drafter stream is done
                torch.cuda.synchronize(i)
            weights.append([flat_weights(r.step).cpu() for r in runners])
            if on_step_end is not None:
                await on_step_end(step)

        return await real_train_steps(runners, *args, on_step_end=after_step, **kwargs)

    monkeypatch.setattr(pipeline, "train_steps", train_steps_checked)
    with capture_logs() as events, anyio.fail_after(RUN_DEADLINE_S * 4):
        assert await pipeline.run(settings, get_logger("test")) == 0
    assert len(weights) == 6
    for step in weights:
        assert len(step) == 2 and torch.equal(step[0], step[1])
    assert not torch.equal(weights[0][0], weights[-1][0])
    ready = [e for e in events if e["event"] == "drafter_ready"]
    assert len(ready) == 2 and all(e["graph"] for e in ready)  # both replayed CUDA graphs
    steps = [e for e in events if e["event"] == "step"]
    assert all(
        e["node_mfu"] > 0 and all(0 <= b <= 1 for b in e["gpu_busy"].values()) for e in steps
    )


def gpu_step(device: torch.device) -> DrafterStep:
    """A float32 tiny drafter step on `device` (every call starts from the same weights)."""
    spec = TinySpec()
    config = tiny_config(spec)
    drafter = tiny_drafter(config, seed=0, dtype=torch.float32, device=str(device))
    embed, lm_head = tiny_target_weights(config, seed=0, dtype=torch.float32, device=str(device))
    objective = make_objective(config, drafter, embed, lm_head, num_anchors=8, ce_chunk_size=16)
    schedule = LrSchedule(peak_lr=1e-2, warmup_steps=1, total_steps=10, device=device)
    optimizer = build_optimizer(drafter.parameters(), lr_tensor=schedule.lr, weight_decay=0.0)
    width = config.num_features * config.hidden_size
    batch = PackedBatch.empty(64, width, device=device, feature_dtype=torch.float32)
    return DrafterStep(
        objective,
        optimizer,
        schedule,
        batch=batch,
        num_anchors=8,
        grad_clip=1.0,
        generator=torch.Generator(device).manual_seed(0),
    )


def phase_a(step: DrafterStep, pack: PackedBatch) -> torch.cuda.Event:
    step.batch.copy_(pack.to(step.device))
    step.phase_a()
    event = torch.cuda.Event()
    event.record()
    return event


def combine(runners, events, strict: bool):
    if not strict:  # the first call creates the NCCL communicators (start-up work)
        return combine_gradients(runners, events)
    torch.cuda.synchronize()  # the phase A jobs are only enqueued; settle before strict mode
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing CUDA call now raises
    try:
        return combine_gradients(runners, events)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def grad_on_host(step: DrafterStep, after: torch.cuda.Event | None = None) -> torch.Tensor:
    if after is not None:
        torch.cuda.current_stream().wait_event(after)
    return step.flat_grad.cpu()  # a sync point: test only


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("case", CASES)
async def test_the_gradient_combine_makes_no_host_sync_and_sums_every_drafter(case: str) -> None:
    devices = [torch.device("cuda", int(d)) for d in gpu_devices(case)]
    async with (
        open_device_worker(devices[0], "d0") as w0,
        open_device_worker(devices[1], "d1") as w1,
    ):
        workers = [w0, w1]
        steps = [await w.run(gpu_step, w.device) for w in workers]
        runners = [DrafterRunner(w, s) for w, s in zip(workers, steps, strict=True)]
        for round_ in range(2):  # the second round runs the combine in strict sync mode
            packs = [laid_out(*random_docs(10 * round_ + i, (20, 25, 11)), 64) for i in range(2)]
            events = [
                await w.run(phase_a, s, p) for w, s, p in zip(workers, steps, packs, strict=True)
            ]
            alone = [await w.run(grad_on_host, s) for w, s in zip(workers, steps, strict=True)]
            assert not torch.equal(alone[0], alone[1])  # the two packs gave different gradients
            combined = await w0.run(combine, runners, events, round_ == 1)
            summed = [
                await w.run(grad_on_host, s, e)
                for w, s, e in zip(workers, steps, combined, strict=True)
            ]
            torch.testing.assert_close(summed[0], alone[0] + alone[1], rtol=0, atol=0)
            assert torch.equal(summed[0], summed[1])
            for w, r, e in zip(workers, runners, combined, strict=True):
                await w.run(r.update, e)
        await w0.run(torch.cuda.synchronize)
        await w1.run(torch.cuda.synchronize)
    assert torch.equal(flat_weights(steps[0]).cpu(), flat_weights(steps[1]).cpu())
