"""Safe stops, as a user meets them: `python -m dflash_async run` in a subprocess (tiny target,
tiny settings) stopped by SIGINT/SIGTERM at start-up, during an evaluation, twice in a row, or
killed with SIGKILL while a checkpoint is being written. Each ends within 5 s of the signal with
the documented code (130 SIGINT, 143 SIGTERM; never 134), no traceback, and only complete,
loadable checkpoints on disk. Plus the start-up refusal of an output folder that is a file
(mismatched settings on resume: test_resume.py; both are SettingsErrors, exit 2 in the CLI).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from structlog.testing import capture_logs
from tiny_run import tiny_env, tiny_inputs

from dflash_async.checkpoint.state import list_checkpoints, load_checkpoint
from dflash_async.log import get_logger
from dflash_async.pipeline import run as pipeline
from dflash_async.pipeline.shutdown import Shutdown
from dflash_async.settings.env import load_settings
from dflash_async.usage import UsageError

STOP_WITHIN_S = 5.0  # the bound, from the signal to the exit
START_DEADLINE_S = 90  # a process reaches its first step in ~5-15 s (imports included)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """DFLASH_* settings of a tiny CPU run (tiny target, 40 pre-tokenized samples) that runs
    until stopped, plus a prompts file for evaluations that last long enough to be interrupted."""
    root = tmp_path_factory.mktemp("signals")
    prompts = [{"prompt": f"Tell me about the number {i}."} for i in range(16)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    return tiny_env(tiny_inputs(root)) | {
        "DFLASH_LOG__FORMAT": "json",
        "DFLASH_TRAIN__MAX_STEPS": "100000",
        "DFLASH_TRAIN__SAVE_EVERY": "0",
        "DFLASH_EVAL__PROMPTS_PATH": str(root / "prompts.jsonl"),
        "DFLASH_EVAL__NUM_PROMPTS": "16",
        "DFLASH_EVAL__MAX_NEW_TOKENS": "256",  # ~1 min of decoding on 2 cores: far past 5 s
        "DFLASH_EVAL__AT_END": "false",
    }


class Run:
    """One `python -m dflash_async run` with a clean DFLASH_* environment and no GPU."""

    def __init__(self, settings: dict[str, str], cwd: Path) -> None:
        environ = {k: v for k, v in os.environ.items() if not k.upper().startswith("DFLASH_")}
        environ |= settings | {"CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "dflash_async", "run"],
            env=environ,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self.events: list[dict[str, Any]] = []
        self._buffer = b""

    def wait_for(self, event: str, **fields: Any) -> dict[str, Any]:
        """Read stdout until an `event` line with these fields; fail after START_DEADLINE_S."""
        assert self.process.stdout is not None
        fd, deadline = self.process.stdout.fileno(), time.monotonic() + START_DEADLINE_S
        seen = len(self.events)
        while time.monotonic() < deadline:
            for e in self.events[seen:]:
                if e["event"] == event and all(e.get(k) == v for k, v in fields.items()):
                    return e
            seen = len(self.events)
            ready, _, _ = select.select([fd], [], [], 0.1)
            chunk = os.read(fd, 1 << 16) if ready else b""
            if ready and not chunk:
                break
            *lines, self._buffer = (self._buffer + chunk).split(b"\n")
            self.events += [json.loads(line) for line in lines if line.strip()]
        self.process.kill()
        pytest.fail(f"no {event} {fields} event; exit {self.process.wait()}: {self.events[-3:]}")

    def stop(self, *signums: int) -> tuple[int, float, str]:
        """Send the signals (50 ms apart); (exit code, seconds from the first to the exit, stderr)."""
        sent = time.monotonic()
        for i, signum in enumerate(signums):
            if i:
                time.sleep(0.05)
            self.process.send_signal(signum)
        try:
            out, err = self.process.communicate(timeout=30)
        finally:
            if self.process.poll() is None:
                self.process.kill()
        elapsed = time.monotonic() - sent
        lines = (self._buffer + out).split(b"\n")
        self.events += [json.loads(line) for line in lines if line.strip()]
        return self.process.returncode, elapsed, err.decode()

    def names(self) -> list[str]:
        return [e["event"] for e in self.events]


def assert_only_loadable_checkpoints(output_dir: Path) -> list[int]:
    steps = []
    for step, folder in list_checkpoints(output_dir):
        assert load_checkpoint(folder)["step"] == step
        steps.append(step)
    return steps


def test_sigint_during_startup_ends_with_130_and_writes_nothing(
    env: dict[str, str], tmp_path: Path
) -> None:
    run = Run(env | {"DFLASH_OUTPUT_DIR": str(tmp_path / "out")}, tmp_path)
    run.wait_for("settings_loaded")  # data, target and drafter are loading now
    code, elapsed, err = run.stop(signal.SIGINT)
    assert (code, "Traceback" in err) == (130, False), err
    assert elapsed < STOP_WITHIN_S
    (interrupted,) = [e for e in run.events if e["event"] == "train_interrupted"]
    assert interrupted["step"] == 0
    assert run.events[-1]["event"] == "run_summary"  # the run record is closed before the exit
    assert run.events[-1]["exit_reason"] == "interrupted (SIGINT)"
    assert "step" not in run.names() and not (tmp_path / "out" / "checkpoints").exists()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_an_evaluation_ends_it_within_5_s(
    env: dict[str, str], tmp_path: Path, signum: int
) -> None:
    """SIGINT: the baseline evaluation before any step; SIGTERM: a periodic one after step 2."""
    settings = env | {"DFLASH_OUTPUT_DIR": str(tmp_path / "out")}
    if signum == signal.SIGINT:
        settings |= {"DFLASH_EVAL__AT_START": "true"}
    else:
        settings |= {"DFLASH_EVAL__EVERY": "2", "DFLASH_TRAIN__SAVE_EVERY": "2"}
    run = Run(settings | {"DFLASH_EVAL__MODE": "pause"}, tmp_path)  # training waits for it
    # the evaluation (16 prompts, plain and speculative, ~1 min) starts right after these lines
    if signum == signal.SIGINT:
        run.wait_for("startup_completed")
    else:
        run.wait_for("checkpoint_written", step=2)
    code, elapsed, err = run.stop(signum)
    assert (code, "Traceback" in err) == (
        {signal.SIGINT: 130, signal.SIGTERM: 143}[signum],
        False,
    ), err
    assert elapsed < STOP_WITHIN_S
    assert "eval" not in run.names() and "train_completed" not in run.names()
    expected = [] if signum == signal.SIGINT else [2]
    assert assert_only_loadable_checkpoints(tmp_path / "out") == expected
    (interrupted,) = [e for e in run.events if e["event"] == "train_interrupted"]
    assert interrupted["step"] == (expected or [0])[-1]


def test_double_sigint_exits_at_once_leaving_only_complete_checkpoints(
    env: dict[str, str], tmp_path: Path
) -> None:
    settings = env | {"DFLASH_OUTPUT_DIR": str(tmp_path / "out"), "DFLASH_TRAIN__SAVE_EVERY": "1"}
    run = Run(settings, tmp_path)
    run.wait_for("checkpoint_written", step=3)  # checkpoints are now written at every step
    code, elapsed, err = run.stop(signal.SIGINT, signal.SIGINT)
    assert (code, "Traceback" in err) == (130, False), err
    assert elapsed < STOP_WITHIN_S
    assert "train_completed" not in run.names()
    assert len(assert_only_loadable_checkpoints(tmp_path / "out")) == 2  # the KEEP default


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, bool]]:
    return ("asyncio", {"use_uvloop": True})


# A child that writes the next checkpoint for real (checkpoint/state.write_checkpoint, keep=1) but
# whose torch.save stops half-way through training_state.pt, says so, and waits to be killed.
HALF_WRITER = """
import io, sys, time, torch
from dflash_async.checkpoint import state as ts
state = ts.load_checkpoint(sys.argv[2])
state["step"] += 1
def half_save(obj, path):
    buffer = io.BytesIO()
    torch.save.__wrapped__(obj, buffer)
    open(path, "wb").write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    print("half written", flush=True)
    time.sleep(60)
half_save.__wrapped__ = torch.save
torch.save = half_save
ts.write_checkpoint(sys.argv[1], state, keep=1)
"""


@pytest.mark.anyio
async def test_sigkill_while_writing_a_checkpoint_leaves_the_previous_one_to_resume(
    env: dict[str, str], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    settings = load_settings(env | {"DFLASH_OUTPUT_DIR": str(out), "DFLASH_TRAIN__MAX_STEPS": "4"})
    shutdown = Shutdown(hard_exit=False)
    real_train_steps = pipeline.train_steps

    async def stop_after_one(*args, on_step_end, **kwargs) -> int:
        async def after(step: int) -> None:
            await on_step_end(step)
            shutdown.request(signal.SIGTERM)

        return await real_train_steps(*args, on_step_end=after, **kwargs)

    with pytest.MonkeyPatch.context() as patch, capture_logs(), anyio.fail_after(60):
        patch.setattr(pipeline, "train_steps", stop_after_one)
        assert await pipeline.run(settings, get_logger("test"), shutdown=shutdown) == 143
    ((saved, folder),) = list_checkpoints(out)

    environ = {k: v for k, v in os.environ.items() if not k.upper().startswith("DFLASH_")}
    child = subprocess.Popen(
        [sys.executable, "-c", HALF_WRITER, str(out), str(folder)],
        env=environ | {"PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == b"half written\n"
    finally:
        child.kill()  # SIGKILL: no cleanup of any kind runs
        _, err = child.communicate()
    assert child.returncode == -signal.SIGKILL, err.decode()
    assert [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]  # the debris
    assert [step for step, _ in list_checkpoints(out)] == [saved]
    assert load_checkpoint(folder)["step"] == saved

    with capture_logs() as events, anyio.fail_after(60):
        assert await pipeline.run(settings, get_logger("test")) == 0
    assert [e["step"] for e in events if e["event"] == "resumed"] == [saved]
    assert [e["step"] for e in events if e["event"] == "step"] == list(range(saved + 1, 5))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [folder.name, "step-00000004"]


def test_an_output_dir_that_is_a_file_is_refused_before_any_work(
    env: dict[str, str], tmp_path: Path
) -> None:
    (tmp_path / "taken").write_text("not a folder")
    settings = load_settings(env | {"DFLASH_OUTPUT_DIR": str(tmp_path / "taken")})
    with capture_logs() as events, pytest.raises(UsageError, match="taken' is a file"):
        anyio.run(pipeline.run, settings, get_logger("test"))
    assert events == []  # refused before reading the data or loading anything
