"""DeviceWorker: thread affinity, error propagation, cancellation and shutdown, on asyncio and uvloop."""

from __future__ import annotations

import contextvars
import threading
import time

import anyio
import pytest
import torch
from anyio import wait_all_tasks_blocked

from dflash_async.errors import SettingsError
from dflash_async.runtime.devices import (
    DeviceWorker,
    open_device_worker,
    parse_device,
    parse_devices,
)

pytestmark = pytest.mark.timeout(30)
CPU = torch.device("cpu")
REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="unset")


def _worker_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("dflash-")]


@pytest.mark.anyio
async def test_every_job_runs_on_one_fixed_thread_not_the_loop_thread() -> None:
    async with open_device_worker(CPU, "target0") as worker:
        idents = {await worker.run(threading.get_ident) for _ in range(20)}
    assert len(idents) == 1
    assert idents != {threading.get_ident()}


@pytest.mark.anyio
async def test_job_exception_reaches_the_awaiting_task_and_the_worker_survives() -> None:
    def fail() -> None:
        raise ValueError("bad pack 7")

    async with open_device_worker(CPU, "drafter0") as worker:
        with pytest.raises(ValueError, match="bad pack 7"):
            await worker.run(fail)
        assert await worker.run(lambda x, y=1: x + y, 2, y=3) == 5


@pytest.mark.anyio
async def test_closing_the_worker_joins_its_thread() -> None:
    async with open_device_worker(CPU, "target0") as worker:
        await worker.run(time.sleep, 0.01)
        assert worker.thread in threading.enumerate()
    assert not worker.thread.is_alive()
    assert _worker_threads() == []


@pytest.mark.anyio
async def test_jobs_run_in_submission_order() -> None:
    order: list[int] = []
    async with open_device_worker(CPU, "target0") as worker, anyio.create_task_group() as tg:
        for i in range(10):
            tg.start_soon(worker.run, order.append, i)
            await wait_all_tasks_blocked()  # each submission is queued before the next
    assert order == list(range(10))


@pytest.mark.anyio
async def test_job_sees_the_contextvars_of_the_task_that_submitted_it() -> None:
    async with open_device_worker(CPU, "target0") as worker:
        token = REQUEST_ID.set("pack-3")
        try:
            assert await worker.run(REQUEST_ID.get) == "pack-3"
        finally:
            REQUEST_ID.reset(token)
        assert await worker.run(REQUEST_ID.get) == "unset"


@pytest.mark.anyio
async def test_cancelled_awaiter_does_not_hang_and_the_running_job_finishes() -> None:
    gate, finished = threading.Event(), threading.Event()

    def blocked_job() -> str:
        gate.wait(5)
        finished.set()
        return "dropped"

    async with open_device_worker(CPU, "drafter0") as worker:
        with anyio.move_on_after(0.05) as scope:
            await worker.run(blocked_job)
        assert scope.cancelled_caught
        gate.set()
        assert await worker.run(lambda: "next") == "next"  # runs after blocked_job ended
        assert finished.is_set()


@pytest.mark.anyio
async def test_close_refuses_queued_jobs_and_lets_the_running_one_finish() -> None:
    started, gate = threading.Event(), threading.Event()
    outcomes: list[str] = []

    def running_job() -> str:
        started.set()
        gate.wait(5)
        return "ran"

    async def submit(worker: DeviceWorker, fn: object) -> None:
        try:
            outcomes.append(await worker.run(fn))  # type: ignore[arg-type]
        except anyio.ClosedResourceError:
            outcomes.append("refused")

    worker = DeviceWorker(CPU, name="target0")
    worker.start()
    async with anyio.create_task_group() as tg:
        tg.start_soon(submit, worker, running_job)
        with anyio.fail_after(5):
            while not started.is_set():  # the thread has taken the first job
                await anyio.sleep(0.001)
        tg.start_soon(submit, worker, lambda: "queued")
        await wait_all_tasks_blocked()
        gate.set()
        await worker.aclose()
    assert sorted(outcomes) == ["ran", "refused"]
    assert not worker.thread.is_alive()
    with pytest.raises(anyio.ClosedResourceError):
        await worker.run(lambda: None)


@pytest.mark.anyio
async def test_busy_seconds_counts_time_spent_in_jobs() -> None:
    async with open_device_worker(CPU, "drafter0") as worker:
        before = worker.busy_seconds
        await worker.run(time.sleep, 0.05)
        assert 0.05 <= worker.busy_seconds - before < 1.0
        assert worker.jobs_done >= 1


@pytest.mark.anyio
async def test_grad_mode_is_set_in_the_worker_thread() -> None:
    async with open_device_worker(CPU, "target0", grad_enabled=False) as worker:
        assert await worker.run(torch.is_grad_enabled) is False
    assert torch.is_grad_enabled()  # the loop thread's mode is untouched


@pytest.mark.anyio
async def test_start_up_failure_is_raised_when_opening_and_leaves_no_thread() -> None:
    with pytest.raises(RuntimeError, match="failed to start"):
        async with open_device_worker(torch.device("cuda", 99), "drafter9"):
            pytest.fail("must not be reached")
    assert _worker_threads() == []


def test_blocking_close_joins_the_thread() -> None:
    worker = DeviceWorker(CPU, name="target0")
    worker.start()
    worker.close(timeout=5)
    assert not worker.thread.is_alive()


def test_parse_device_accepts_cpu_and_names_the_setting_for_missing_gpus() -> None:
    assert parse_device("cpu") == CPU
    assert parse_devices(["cpu", "cpu"], setting="X") == (CPU, CPU)
    with pytest.raises(SettingsError, match=r"DFLASH_PIPELINE__DRAFTER_DEVICES='cuda:99'"):
        parse_device("cuda:99", setting="DFLASH_PIPELINE__DRAFTER_DEVICES")
    with pytest.raises(SettingsError, match=r"DFLASH_PIPELINE__TARGET_DEVICES='gpu0'"):
        parse_device("gpu0", setting="DFLASH_PIPELINE__TARGET_DEVICES")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.anyio
async def test_cuda_worker_sets_its_device_and_a_non_default_stream() -> None:
    index = torch.cuda.device_count() - 1
    async with open_device_worker(parse_device(str(index)), "drafter") as worker:

        def thread_state() -> tuple[int, bool, bool]:
            stream = torch.cuda.current_stream()
            return (
                torch.cuda.current_device(),
                stream == torch.cuda.default_stream(),
                stream == worker.stream,
            )

        device, on_default, on_own = await worker.run(thread_state)
    assert (device, on_default, on_own) == (index, False, True)
