"""Two nodes on one machine: two `run` processes joined by gloo on 127.0.0.1.

Each rank is this file run as a script (`python tests/pipeline/test_distributed.py WEIGHTS_DIR`) with
torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) set by the test: the real CLI
entry, with one hook that saves the drafter's flat weights after every step. The reference is
one process with two CPU drafters (`cpu,cpu`), which the pipeline already proves equal to one
drafter seeing both packs (test_pipeline.py).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest
import torch
from tiny_run import tiny_env, tiny_inputs

from dflash_async.checkpoint.state import list_checkpoints

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
RANK_DEADLINE_S = 60  # a rank here starts in ~5 s and trains 3 steps in ~1 s; past this it hangs


def run_env(inputs: dict[str, str], output_dir: Path, **extra: str) -> dict:
    """The tiny CPU run (tiny_run.tiny_env) for STEPS steps, no saves, JSON logs."""
    return tiny_env(inputs, output_dir) | {
        "DFLASH_TRAIN__MAX_STEPS": str(STEPS),
        "DFLASH_TRAIN__SAVE_EVERY": "0",
        "DFLASH_EVAL__AT_END": "false",
        "DFLASH_LOG__FORMAT": "json",
        **extra,
    }


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The tiny target and 40 pre-tokenized samples of 24..60 tokens (~7 packs an epoch)."""
    return tiny_inputs(tmp_path_factory.mktemp("distributed"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_ranks(
    env: dict, weights_dir: Path, logs: Path, *, world_size: int = 2
) -> list[subprocess.Popen]:
    """Two ranks of this file's script, as torchrun would start them, on loopback only (one
    plain process, without the launcher's variables, for world_size 1)."""
    port = str(free_port())
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DFLASH_", "SLURM_"))}
    base = {k: v for k, v in base.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    procs = []
    for rank in range(world_size):
        rank_env = (
            base
            | env
            | {"PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}", "OMP_NUM_THREADS": "1"}
        )
        if world_size > 1:
            rank_env |= {
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(rank),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "GLOO_SOCKET_IFNAME": "lo",
            }
        log = (logs / f"rank{rank}.log").open("w")
        command = [sys.executable, __file__, str(weights_dir)]
        procs.append(
            subprocess.Popen(command, env=rank_env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        )
    return procs


def events(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]


def reference_weights(env: dict) -> list[torch.Tensor]:
    """Drafter 0's flat weights after every step of ONE process with two CPU drafters."""
    from dflash_async.log import get_logger
    from dflash_async.pipeline import run as pipeline
    from dflash_async.settings.env import load_settings

    settings = load_settings(
        env
        | {"DFLASH_PIPELINE__TARGET_DEVICES": "cpu", "DFLASH_PIPELINE__DRAFTER_DEVICES": "cpu,cpu"}
    )
    weights: list[torch.Tensor] = []
    real_train_steps = pipeline.train_steps

    async def recorded(runners, *args, on_step_end=None, **kwargs) -> int:
        async def after_step(step: int) -> None:
            weights.append(await runners[0].worker.run(flat_weights, runners))
            if on_step_end is not None:
                await on_step_end(step)

        return await real_train_steps(runners, *args, on_step_end=after_step, **kwargs)

    pipeline.train_steps = recorded
    try:
        assert anyio.run(pipeline.run, settings, get_logger("test"), {}) == 0
    finally:
        pipeline.train_steps = real_train_steps
    return weights


def flat_weights(runners) -> torch.Tensor:
    """Drafter 0's weights on the host. Run on its worker: on a GPU the copy then follows the
    step's queued work on the worker's stream (a sync point, test only)."""
    return torch.cat([p.detach().flatten() for p in runners[0].step.params]).cpu()


def wait_all(procs: list[subprocess.Popen], deadline_s: float) -> list[int]:
    end = time.monotonic() + deadline_s
    try:
        return [p.wait(timeout=max(0.1, end - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def wait_for_step_2(procs: list[subprocess.Popen], weights_dir: Path) -> None:
    """Until both ranks have written their step-2 weights; a rank that exits first, or
    RANK_DEADLINE_S passing, fails the test."""
    deadline = time.monotonic() + RANK_DEADLINE_S
    while not all((weights_dir / f"rank{r}-step2.pt").exists() for r in range(2)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.05)


@pytest.mark.timeout(120)
def test_two_ranks_hold_identical_weights_equal_to_one_process_with_both_packs(
    tiny: dict, tmp_path: Path, single_thread: None
) -> None:
    env = run_env(tiny, tmp_path / "out")
    procs = launch_ranks(env, tmp_path, tmp_path)
    reference = reference_weights(env | {"DFLASH_OUTPUT_DIR": str(tmp_path / "single")})
    assert wait_all(procs, RANK_DEADLINE_S) == [0, 0], (tmp_path / "rank1.log").read_text()[-3000:]
    assert len(reference) == STEPS
    for step in range(1, STEPS + 1):
        rank0, rank1 = (torch.load(tmp_path / f"rank{r}-step{step}.pt") for r in range(2))
        assert torch.equal(rank0, rank1), f"ranks differ after step {step}"
        # Both sides add the same two fp32 gradients (a + b is exact-order for two operands), so
        # they agree bit for bit; 1e-6 is the bar the issue sets.
        torch.testing.assert_close(rank0, reference[step - 1], rtol=0, atol=1e-6)
    assert not torch.equal(reference[0], reference[-1])  # the weights moved
    logs = [events(tmp_path / f"rank{r}.log") for r in range(2)]
    for rank, log in enumerate(logs):
        steps = [e for e in log if e["event"] == "step"]
        assert [(e["step"], e["rank"]) for e in steps] == [(s, rank) for s in (1, 2, 3)]
        assert 0 < steps[0]["tokens"] <= 256  # one pack per rank and step
    writers = [
        [e["event"] for e in log if e["event"] in ("export_written", "train_completed")]
        for log in logs
    ]
    assert writers == [["export_written", "train_completed"], []]  # rank 0 alone writes
    record = events(tmp_path / "out" / "log.jsonl")  # the run folder's record: rank 0's lines
    assert record and {e.get("rank", 0) for e in record} == {0}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim", [0, 1])
def test_killing_one_rank_ends_the_other_with_an_error_within_30_s(
    victim: int, tiny: dict, tmp_path: Path
) -> None:
    env = run_env(tiny, tmp_path / "out", DFLASH_TRAIN__MAX_STEPS="100000")
    procs = launch_ranks(env, tmp_path, tmp_path)
    wait_for_step_2(procs, tmp_path)
    procs[victim].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    survivor = procs[1 - victim]
    try:
        code = survivor.wait(timeout=30)
    finally:
        wait_all(procs, 0)
    assert code != 0
    assert time.monotonic() - killed_at < 30
    names = [e["event"] for e in events(tmp_path / f"rank{1 - victim}.log")]
    assert "peer_lost" in names or "run_failed" in names  # logged, not a silent exit


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim", [0, 1])
def test_sigterm_to_one_rank_interrupts_every_rank_after_the_same_step_with_exit_143(
    victim: int, tiny: dict, tmp_path: Path
) -> None:
    env = run_env(tiny, tmp_path / "out", DFLASH_TRAIN__MAX_STEPS="100000")
    procs = launch_ranks(env, tmp_path, tmp_path)
    wait_for_step_2(procs, tmp_path)
    procs[victim].send_signal(signal.SIGTERM)  # one rank: the others learn it in the all-reduce
    assert wait_all(procs, 30) == [143, 143], (tmp_path / "rank0.log").read_text()[-3000:]
    logs = [events(tmp_path / f"rank{r}.log") for r in range(2)]
    last = [[e["step"] for e in log if e["event"] == "step"][-1] for log in logs]
    assert last[0] == last[1]
    for log in logs:  # each rank says why it stopped, none believes it completed
        names = [e["event"] for e in log]
        assert "train_completed" not in names
        (interrupted,) = [e for e in log if e["event"] == "train_interrupted"]
        assert (interrupted["step"], interrupted["reason"]) == (last[0], "SIGTERM")
    (saved,) = [e for e in logs[0] if e["event"] == "export_written"]
    assert saved["step"] == last[0] and (tmp_path / "out" / "drafter").is_dir()
    (summary,) = [e for e in events(tmp_path / "out" / "log.jsonl") if e["event"] == "run_summary"]
    assert summary["exit_reason"] == "terminated (SIGTERM)"


def wait_for_step_event(procs: list[subprocess.Popen], log: Path, step: int) -> None:
    """Until `log` holds the `step` event of `step` (every rank still running)."""
    deadline = time.monotonic() + RANK_DEADLINE_S
    while not any(e["event"] == "step" and e["step"] == step for e in events(log)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.05)


def step_losses(logs: Path, rank: int) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in events(logs / f"rank{rank}.log") if e["event"] == "step"}


RESUME_STEPS = 8  # 2 ranks x 4 packs an epoch: the run crosses an epoch boundary


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_ranks_sigtermed_at_step_2_then_resumed_end_bit_for_bit_as_an_uninterrupted_run(
    tiny: dict, tmp_path: Path
) -> None:
    env = run_env(
        tiny,
        tmp_path / "out",
        DFLASH_TRAIN__MAX_STEPS=str(RESUME_STEPS),
        DFLASH_TRAIN__WARMUP_FRAC="0.25",
    )  # lr moves every step: an off-by-one shows
    runs = {name: tmp_path / name for name in ("reference", "first", "resumed")}
    for folder in runs.values():
        folder.mkdir()
    reference = launch_ranks(
        env | {"DFLASH_OUTPUT_DIR": str(tmp_path / "ref-out")}, runs["reference"], runs["reference"]
    )
    first = launch_ranks(env, runs["first"], runs["first"])
    wait_for_step_event(first, runs["first"] / "rank1.log", 2)
    first[1].send_signal(signal.SIGTERM)  # rank 1 alone, after its step-2 line
    assert wait_all(first, 30) == [143, 143], (runs["first"] / "rank0.log").read_text()[-3000:]
    stopped = max(step_losses(runs["first"], 0))
    assert 2 <= stopped < RESUME_STEPS and [s for s, _ in list_checkpoints(tmp_path / "out")] == [
        stopped
    ]
    resumed = launch_ranks(env, runs["resumed"], runs["resumed"])  # RESUME=auto, same folder
    assert wait_all(resumed, RANK_DEADLINE_S) == [0, 0], (
        runs["resumed"] / "rank1.log"
    ).read_text()[-3000:]
    assert wait_all(reference, RANK_DEADLINE_S) == [0, 0]
    for rank in range(2):
        (event,) = [
            e for e in events(runs["resumed"] / f"rank{rank}.log") if e["event"] == "resumed"
        ]
        assert event["step"] == stopped
        interrupted_then_resumed = step_losses(runs["first"], rank) | step_losses(
            runs["resumed"], rank
        )
        assert interrupted_then_resumed == step_losses(runs["reference"], rank)
        final = [
            torch.load(runs[name] / f"rank{rank}-step{RESUME_STEPS}.pt")
            for name in ("reference", "resumed")
        ]
        assert torch.equal(*final), f"rank {rank}: final weights differ"
    exports = [sorted((tmp_path / out / "drafter").iterdir()) for out in ("ref-out", "out")]
    assert [p.name for p in exports[0]] == [p.name for p in exports[1]]
    for a, b in zip(*exports, strict=True):
        assert a.read_bytes() == b.read_bytes(), a.name


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_two_rank_checkpoint_resumed_by_one_process_exits_2_naming_both_world_sizes(
    tiny: dict, tmp_path: Path
) -> None:
    env = run_env(tiny, tmp_path / "out", DFLASH_TRAIN__MAX_STEPS="1")
    assert wait_all(launch_ranks(env, tmp_path, tmp_path), RANK_DEADLINE_S) == [0, 0]
    assert [s for s, _ in list_checkpoints(tmp_path / "out")] == [1]
    more = env | {"DFLASH_TRAIN__MAX_STEPS": "2"}
    assert wait_all(launch_ranks(more, tmp_path, tmp_path, world_size=1), RANK_DEADLINE_S) == [2]
    error = (tmp_path / "rank0.log").read_text()
    assert re.search(
        r"error: ranks .*: this run has 1 rank\(s\), the checkpoint .* written by 2", error
    )
    assert [s for s, _ in list_checkpoints(tmp_path / "out")] == [1]  # nothing trained


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_one_process_checkpoint_resumed_by_two_ranks_exits_2_on_both_naming_both_sizes(
    tiny: dict, tmp_path: Path
) -> None:
    env = run_env(tiny, tmp_path / "out", DFLASH_TRAIN__MAX_STEPS="1")
    assert wait_all(launch_ranks(env, tmp_path, tmp_path, world_size=1), RANK_DEADLINE_S) == [0]
    more = env | {"DFLASH_TRAIN__MAX_STEPS": "2"}
    assert wait_all(launch_ranks(more, tmp_path, tmp_path), RANK_DEADLINE_S) == [2, 2]
    for rank in range(2):  # the same line on every rank, not a lost peer (exit 1) on rank 1
        error = (tmp_path / f"rank{rank}.log").read_text()
        assert re.search(
            r"error: ranks .*: this run has 2 rank\(s\), the checkpoint .* written by 1", error
        )
    assert [s for s, _ in list_checkpoints(tmp_path / "out")] == [1]


def _rank_main(weights_dir: str) -> int:
    """One rank: the CLI's `run`, saving drafter 0's flat weights after every step."""
    from dflash_async.__main__ import main
    from dflash_async.pipeline import run as pipeline

    real_train_steps = pipeline.train_steps
    rank = int(os.environ.get("RANK", "0"))

    async def recorded(runners, *args, on_step_end=None, **kwargs) -> int:
        async def after_step(step: int) -> None:
            path = Path(weights_dir) / f"rank{rank}-step{step}.pt"
            torch.save(await runners[0].worker.run(flat_weights, runners), path.with_suffix(".tmp"))
            path.with_suffix(".tmp").rename(path)
            if on_step_end is not None:
                await on_step_end(step)

        return await real_train_steps(runners, *args, on_step_end=after_step, **kwargs)

    pipeline.train_steps = recorded
    return main(["run"])


if __name__ == "__main__":
    sys.exit(_rank_main(sys.argv[1]))
